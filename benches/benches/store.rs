//! The store's commits of an ingest: what a GPU ingest of 122,880 tokens with Gemma 3 270M
//! writes, 30 commits of a 4,096-token chunk each (block size 64, one KV head of dimension
//! 256; its 3 global layers store the chunk's 64 blocks of keys and values, its 15
//! sliding-window layers the 9 blocks their window still sees: 19.4 MiB of f16 a chunk) and
//! the flush that ends it, into a fresh store. `store_commit` commits with
//! `kvdb::store::Store::commit` (key and value blocks ingested as SST files, the rest through
//! the synced write-ahead log); `wal_write_batch` writes the same blocks through the log, one
//! synced RocksDB write batch per chunk (what the store did before, and RocksDB's ordinary
//! way). Throughput is of the blocks.
//!
//! `query_sample_commits` commits only the query sample a GPU ingest of 90,112 tokens of the
//! Llama-3-8B shape keeps (one position in `QUERY_SAMPLE_STRIDE` of its 32 layers, 32 query
//! heads of 128: 64 MiB a 4,096-token chunk, 22 commits, 1.4 GiB; its keys and values are 8
//! times that), the rows as `Store::commit` writes them.
//!
//! `read_rows` reads the stored global layers back as a GPU upload does.
//!
//! `cargo bench -p kvdb-benches --bench store` (`KVDB_BENCH_DIR` picks the folder: the disk
//! under test; the system's temporary folder otherwise).

use std::path::Path;
use std::time::{Duration, Instant};

use criterion::measurement::WallTime;
use criterion::{
    criterion_group, criterion_main, BenchmarkGroup, Criterion, SamplingMode, Throughput,
};
use half::f16;
use kvdb::store::{
    encode_f16, Access, Batch, BlockKey, Kv, ModelRecord, PrefillRecord, QueryKey, Store,
    QUERY_SAMPLE_STRIDE,
};
use rand::{Rng, SeedableRng};
use rocksdb::{ColumnFamilyDescriptor, Options, WriteBatch, WriteOptions, DB};

const BLOCK_ROWS: usize = 64;
const HEAD_DIM: usize = 256;
const LAYERS: u16 = 18;
const GLOBAL: [u16; 3] = [5, 11, 17];
/// Blocks per chunk of a global layer (4,096 tokens) and of a sliding-window one.
const CHUNK_BLOCKS: u32 = 64;
const WINDOW_BLOCKS: u32 = 9;
/// Commits of one ingest.
const CHUNKS: u32 = 30;

/// The Llama-3-8B shape's sample: layers, query heads × head dimension, tokens a chunk and
/// commits.
const LLAMA_LAYERS: usize = 32;
const LLAMA_QUERY_ROW: usize = 32 * 128;
const LLAMA_CHUNK: usize = 4096;
const LLAMA_CHUNKS: u32 = 22;

/// The blocks chunk `chunk` writes, in key order.
fn chunk_blocks(chunk: u32) -> impl Iterator<Item = BlockKey> {
    (0..LAYERS).flat_map(move |layer| {
        let end = (chunk + 1) * CHUNK_BLOCKS;
        let first = if GLOBAL.contains(&layer) {
            end - CHUNK_BLOCKS
        } else {
            end - WINDOW_BLOCKS
        };
        (first..end).map(move |block| BlockKey {
            corpus: 1,
            layer,
            head: 0,
            block,
        })
    })
}

fn ingest_bytes() -> u64 {
    let blocks = chunk_blocks(0).count() as u64;
    u64::from(CHUNKS) * blocks * 2 * (BLOCK_ROWS * HEAD_DIM * 2) as u64
}

/// Times `iters` ingests, each into a fresh database that `open` makes in a folder of its
/// own, committing each of `chunks` chunks with `commit` and ending with `flush`.
fn time_ingests<D>(
    iters: u64,
    chunks: u32,
    open: impl Fn(&Path) -> D,
    commit: impl Fn(&D, u32),
    flush: impl Fn(&D),
) -> Duration {
    let mut total = Duration::ZERO;
    for _ in 0..iters {
        let dir = bench_dir();
        let db = open(dir.path());
        let started = Instant::now();
        for chunk in 0..chunks {
            commit(&db, chunk);
        }
        flush(&db);
        total += started.elapsed();
    }
    total
}

/// Times `iters` ingests through [`Store::commit`], `fill` putting chunk `chunk`'s writes into
/// its batch.
fn time_store_ingests(iters: u64, chunks: u32, fill: impl Fn(&mut Batch<'_>, u32)) -> Duration {
    time_ingests(
        iters,
        chunks,
        |dir| Store::open(dir.join("s"), Access::Write).expect("a store"),
        |store, chunk| {
            let mut batch = store.batch();
            fill(&mut batch, chunk);
            store.commit(batch).expect("a commit");
        },
        |store| store.flush().expect("a flush"),
    )
}

/// A group of whole ingests writing `bytes` each: every iteration is an ingest of seconds, so
/// criterion's fewest samples, flat.
fn ingest_group<'a>(c: &'a mut Criterion, name: &str, bytes: u64) -> BenchmarkGroup<'a, WallTime> {
    let mut group = c.benchmark_group(name);
    group
        .sample_size(10)
        .sampling_mode(SamplingMode::Flat)
        .measurement_time(Duration::from_secs(5))
        .throughput(Throughput::Bytes(bytes));
    group
}

fn bench_dir() -> tempfile::TempDir {
    match std::env::var_os("KVDB_BENCH_DIR") {
        Some(dir) => tempfile::tempdir_in(dir),
        None => tempfile::tempdir(),
    }
    .expect("a folder for the stores")
}

fn raw_db(path: &Path) -> DB {
    let mut options = Options::default();
    options.create_if_missing(true);
    options.create_missing_column_families(true);
    options.set_max_total_wal_size(kvdb::store::MAX_TOTAL_WAL_SIZE);
    let families = ["meta", "keys", "values"]
        .map(|name| ColumnFamilyDescriptor::new(name, Options::default()));
    DB::open_cf_descriptors(&options, path, families).expect("a RocksDB database")
}

fn commit(c: &mut Criterion) {
    let mut rng = rand::rngs::StdRng::seed_from_u64(3);
    // Random rows do not compress, as keys and values do not.
    let rows: Vec<f16> = (0..BLOCK_ROWS * HEAD_DIM)
        .map(|_| f16::from_f32(rng.random_range(-4.0..4.0)))
        .collect();
    let mut group = ingest_group(c, "ingest_commits", ingest_bytes());
    group.bench_function("store_commit", |b| {
        b.iter_custom(|iters| {
            time_store_ingests(iters, CHUNKS, |batch, chunk| {
                for key in chunk_blocks(chunk) {
                    for kv in [Kv::Keys, Kv::Values] {
                        batch.put_block(kv, key, rows.clone());
                    }
                }
            })
        })
    });
    group.bench_function("wal_write_batch", |b| {
        b.iter_custom(|iters| {
            time_ingests(
                iters,
                CHUNKS,
                raw_db,
                |db, chunk| {
                    let (keys, values) = (
                        db.cf_handle("keys").unwrap(),
                        db.cf_handle("values").unwrap(),
                    );
                    let mut batch = WriteBatch::default();
                    for key in chunk_blocks(chunk) {
                        batch.put_cf(&keys, key.bytes(), encode_f16(&rows));
                        batch.put_cf(&values, key.bytes(), encode_f16(&rows));
                    }
                    let mut synced = WriteOptions::default();
                    synced.set_sync(true);
                    db.write_opt(batch, &synced).expect("a write");
                },
                |db| db.flush().expect("a flush"),
            )
        })
    });
    group.finish();
}

fn query_sample(c: &mut Criterion) {
    let mut rng = rand::rngs::StdRng::seed_from_u64(4);
    let row: Vec<f16> = (0..LLAMA_QUERY_ROW)
        .map(|_| f16::from_f32(rng.random_range(-4.0..4.0)))
        .collect();
    let rows_a_chunk = LLAMA_LAYERS * LLAMA_CHUNK / QUERY_SAMPLE_STRIDE;
    let bytes = (u64::from(LLAMA_CHUNKS) * rows_a_chunk as u64) * (LLAMA_QUERY_ROW * 2) as u64;
    let mut group = ingest_group(c, "query_sample_commits", bytes);
    group.bench_function("store_commit", |b| {
        b.iter_custom(|iters| {
            time_store_ingests(iters, LLAMA_CHUNKS, |batch, chunk| {
                let start = chunk as usize * LLAMA_CHUNK;
                for layer in 0..LLAMA_LAYERS {
                    let sampled = start + QUERY_SAMPLE_STRIDE - 1..start + LLAMA_CHUNK;
                    for p in sampled.step_by(QUERY_SAMPLE_STRIDE) {
                        batch.put_queries(QueryKey::new(1, layer, p), &row);
                    }
                }
            })
        })
    });
    group.finish();
}

/// Reads every row of the ingest's global layers back, keys and values, as a GPU upload
/// does (`Store::layer_kv_f16`), from a store that the ingest's 30 commits wrote (30
/// overlapping SST files per family, as a real ingest leaves them before compaction).
fn read(c: &mut Criterion) {
    let dir = bench_dir();
    let store = Store::open(dir.path().join("s"), Access::Write).expect("a store");
    let record = ModelRecord {
        sha256: "0".repeat(64),
        name: "gemma3-270m shape".into(),
        architecture: "gemma3".into(),
        n_layers: LAYERS as usize,
        n_heads: 4,
        n_kv_heads: 1,
        head_dim: HEAD_DIM,
        context_length: 131_072,
    };
    let mut manifest = store
        .create_corpus("c", record, vec![], BLOCK_ROWS, PrefillRecord::default())
        .expect("a corpus");
    assert_eq!(manifest.id, 1, "chunk_blocks writes corpus 1");
    let mut rng = rand::rngs::StdRng::seed_from_u64(5);
    let rows: Vec<f16> = (0..BLOCK_ROWS * HEAD_DIM)
        .map(|_| f16::from_f32(rng.random_range(-4.0..4.0)))
        .collect();
    for chunk in 0..CHUNKS {
        let mut batch = store.batch();
        for key in chunk_blocks(chunk) {
            for kv in [Kv::Keys, Kv::Values] {
                batch.put_block(kv, key, rows.clone());
            }
        }
        manifest.tokens = ((chunk + 1) * CHUNK_BLOCKS) as usize * BLOCK_ROWS;
        batch.put_manifest(&manifest).expect("a manifest");
        store.commit(batch).expect("a commit");
    }
    let tokens = manifest.tokens;
    let mut group = c.benchmark_group("read_rows");
    group.sample_size(10).throughput(Throughput::Bytes(
        (GLOBAL.len() * 2 * tokens * HEAD_DIM * 2) as u64,
    ));
    group.bench_function("layer_kv_f16", |b| {
        b.iter(|| {
            for layer in GLOBAL {
                let (keys, values) = store
                    .layer_kv_f16(&manifest, layer as usize, 0..tokens)
                    .expect("the rows");
                assert_eq!(keys.len() + values.len(), 2 * tokens * HEAD_DIM);
            }
        })
    });
    group.finish();
}

criterion_group!(benches, commit, query_sample, read);
criterion_main!(benches);
