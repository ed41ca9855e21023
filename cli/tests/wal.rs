//! The store's write-ahead log on a tiny random-weight gemma3: a damaged log is refused by
//! writers and readers alike with an error that says what to do, and nothing in the store
//! changes; an incomplete last record that was never acknowledged (a writer killed
//! mid-commit) is forgiven and the ingest resumes to what one uninterrupted ingest stores;
//! and the log stays small, during and after an ingest.
//!
//! The first ingest of each damage test stops right after its last commit, so that its
//! commits are in the log only (a finished ingest flushes them to SST files), all but their
//! key and value blocks and query sample, which never go through the log (they are ingested
//! as SST files).

mod common;

use std::collections::BTreeMap;
use std::ops::ControlFlow;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use anyhow::{ensure, Context, Result};
use common::{dump, tiny, write_documents};
use half::f16;
use kvdb::store::{Access, BlockKey, Kv, Store, MAX_TOTAL_WAL_SIZE};
use kvdb::LoadedModel;
use kvdb::{ingest, ingest_until, IngestEvent};
use kvdb::{read_documents, SourceDocument};
use rand::{Rng, SeedableRng};

/// Ingests `docs` into corpus `c` and stops right after the commit that `stop_after` picks
/// (given the commit's number, from 1, and whether it completes a document), before the
/// flush that ends an ingest: what it committed is in the write-ahead log only. Calls `seen`
/// after every commit.
fn ingest_into_the_log(
    store: &Store,
    loaded: &LoadedModel,
    docs: &[SourceDocument],
    stop_after: impl Fn(usize, bool) -> bool,
    mut seen: impl FnMut(usize),
) -> Result<()> {
    let mut commits = 0;
    let err = ingest_until(store, "c", loaded.as_ref(), docs, &mut |event| {
        if let IngestEvent::Committed { done, total, .. } = event {
            commits += 1;
            seen(commits);
            if stop_after(commits, done == total) {
                return ControlFlow::Break(());
            }
        }
        ControlFlow::Continue(())
    })
    .err()
    .context("the ingest should have stopped")?;
    ensure!(matches!(err, kvdb::Error::Cancelled { .. }), "{err}");
    Ok(())
}

/// The store's write-ahead log files, oldest first, with their sizes. RocksDB deletes an old
/// log once its families are flushed, also between listing the folder and reading a size: a
/// log gone by then holds nothing any more.
fn logs(store: &Path) -> Result<Vec<(PathBuf, u64)>> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(store)? {
        let entry = entry?;
        if entry.path().extension().is_some_and(|e| e == "log") {
            match entry.metadata() {
                Ok(meta) => out.push((entry.path(), meta.len())),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => return Err(e.into()),
            }
        }
    }
    out.sort();
    Ok(out)
}

fn log_bytes(store: &Path) -> Result<u64> {
    Ok(logs(store)?.iter().map(|(_, len)| len).sum())
}

/// The log file holding the store's commits (the largest).
fn the_log(store: &Path) -> Result<PathBuf> {
    let (path, len) = logs(store)?
        .into_iter()
        .max_by_key(|(_, len)| *len)
        .context("no log file")?;
    ensure!(len > 1000, "the log holds only {len} bytes");
    Ok(path)
}

/// Every file of the store but RocksDB's info logs (`LOG*`, which any open may start), with
/// its bytes: what must not change when an open is refused.
fn snapshot(store: &Path) -> Result<BTreeMap<String, Vec<u8>>> {
    let mut out = BTreeMap::new();
    for entry in std::fs::read_dir(store)? {
        let entry = entry?;
        let name = entry.file_name().to_string_lossy().into_owned();
        if !name.starts_with("LOG") {
            out.insert(name, std::fs::read(entry.path())?);
        }
    }
    Ok(out)
}

/// Offsets of the physical records of a RocksDB log file (7-byte headers in 32 KiB blocks).
fn record_offsets(bytes: &[u8]) -> Vec<usize> {
    let mut out = Vec::new();
    for start in (0..bytes.len()).step_by(32 * 1024) {
        let end = (start + 32 * 1024).min(bytes.len());
        let mut at = start;
        while end - at >= 7 {
            let length = usize::from(u16::from_le_bytes([bytes[at + 4], bytes[at + 5]]));
            if bytes[at + 6] == 0 && length == 0 {
                break;
            }
            out.push(at);
            at += 7 + length;
        }
    }
    out
}

/// `kvdb ingest` of `paths` into corpus `c` of `store`.
fn cli_ingest(store: &Path, model: &Path, paths: &[PathBuf]) -> Result<Output> {
    Ok(Command::new(env!("CARGO_BIN_EXE_kvdb"))
        .args(["ingest", "--store"])
        .arg(store)
        .args(["--corpus", "c", "--model"])
        .arg(model)
        .args(paths)
        .output()?)
}

/// Checks that writers (library and CLI) and readers refuse the store with
/// [`kvdb::Error::WalDamaged`] naming `log`, and that the store's files stay as they were.
fn assert_refused(
    store: &Path,
    log: &Path,
    model: &Path,
    paths: &[PathBuf],
    from_rocksdb: bool,
) -> Result<()> {
    let before = snapshot(store)?;
    let log_name = log.file_name().context("log name")?.to_string_lossy();

    let out = cli_ingest(store, model, paths)?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "the ingest should fail: {stderr}");
    eprintln!("{}", stderr.lines().take(4).collect::<Vec<_>>().join("\n"));
    for needle in [
        "write-ahead log is damaged at",
        &log_name,
        "Nothing was changed",
        "would drop committed data",
        "restore the folder",
        "into a new store",
    ] {
        assert!(stderr.contains(needle), "`{needle}` missing from: {stderr}");
    }

    for access in [Access::Write, Access::Read] {
        let err = Store::open(store, access).expect_err("the open should be refused");
        match &err {
            kvdb::Error::WalDamaged { file, source, .. } => {
                assert_eq!(file, log, "{err}");
                assert_eq!(source.is_some(), from_rocksdb, "{err}");
            }
            _ => panic!("{access:?}: expected WalDamaged, got {err}"),
        }
    }
    assert!(
        before == snapshot(store)?,
        "a refused open changed the store"
    );
    Ok(())
}

/// The corpus RocksDB itself recovers from the store, read-only, with `mode`: its committed
/// tokens and documents, or `None` when it has lost the corpus altogether.
fn recovered_by_rocksdb(store: &Path, mode: rocksdb::DBRecoveryMode) -> Result<Option<String>> {
    let mut opts = rocksdb::Options::default();
    opts.set_wal_recovery_mode(mode);
    let families = ["meta", "docs", "tokens", "keys", "values", "index"];
    let db = rocksdb::DB::open_cf_for_read_only(&opts, store, families, false)?;
    let meta = db.cf_handle("meta").context("meta")?;
    Ok(db.get_cf(meta, b"corpus/c")?.map(|m| {
        let m: serde_json::Value = serde_json::from_slice(&m).unwrap_or_default();
        format!("tokens {} documents {}", m["tokens"], m["documents"])
    }))
}

/// The case: 8 bytes flipped in the middle of the log that holds a committed
/// document. RocksDB's default recovery drops everything from there on without a word; kvdb
/// refuses to open the store, says where the damage is and how to recover, and changes
/// nothing, so the document is reported damaged rather than gone.
#[test]
fn a_damaged_log_is_refused_and_left_as_it_was() -> Result<()> {
    let (model, loaded) = tiny()?;
    let dir = tempfile::tempdir()?;
    let paths = write_documents(&dir.path().join("docs"), 2, 1500, 3)?;
    let docs = read_documents(&paths)?;
    let store_path = dir.path().join("s");
    {
        let store = Store::open(&store_path, Access::Write)?;
        ingest_into_the_log(&store, &loaded, &docs[..1], |_, complete| complete, |_| {})?;
        assert_eq!(store.manifest("c")?.documents, 1);
    }
    let log = the_log(&store_path)?;
    let mut bytes = std::fs::read(&log)?;
    let middle = bytes.len() / 2;
    for b in &mut bytes[middle..middle + 8] {
        *b ^= 0xa5;
    }
    std::fs::write(&log, &bytes)?;

    // What kvdb used to open the store with: the committed document silently gone.
    let pit = recovered_by_rocksdb(&store_path, rocksdb::DBRecoveryMode::PointInTime)?;
    assert!(
        !pit.as_deref().is_some_and(|m| m.ends_with("documents 1")),
        "point-in-time recovery kept the document ({pit:?}): flip elsewhere"
    );
    assert_refused(&store_path, &log, model.path(), &paths[1..], true)?;
    // The damage named is the record holding the flipped bytes: it starts at most a block
    // (32 KiB) before them.
    let err = Store::open(&store_path, Access::Write).expect_err("refused");
    let kvdb::Error::WalDamaged { damage, .. } = &err else {
        panic!("{err}")
    };
    let at: usize = damage
        .strip_prefix("the record at byte ")
        .and_then(|rest| rest.strip_suffix(" fails its checksum"))
        .context("a checksum failure")?
        .parse()?;
    assert!(at <= middle && middle < at + 32 * 1024, "{damage}");
    // A store without a commit note (written before kvdb kept one) is refused by RocksDB's
    // recovery itself, which leaves it as it was too.
    std::fs::remove_file(store_path.join("kvdb-last-commit"))?;
    assert_refused(&store_path, &log, model.path(), &paths[1..], true)
}

/// The case RocksDB cannot tell from a torn write: the length field of the log's last record,
/// a whole committed chunk, damaged so that the record seems to run past the end of the file.
/// RocksDB's recovery forgives that as an incomplete write; kvdb's commit note says the record
/// was committed, so it refuses as for any other damage.
#[test]
fn a_committed_last_record_with_a_damaged_length_is_refused() -> Result<()> {
    let (model, loaded) = tiny()?;
    let dir = tempfile::tempdir()?;
    let paths = write_documents(&dir.path().join("docs"), 2, 1500, 4)?;
    let docs = read_documents(&paths)?;
    let store_path = dir.path().join("s");
    {
        let store = Store::open(&store_path, Access::Write)?;
        ingest_into_the_log(&store, &loaded, &docs[..1], |_, complete| complete, |_| {})?;
    }
    let log = the_log(&store_path)?;
    let mut bytes = std::fs::read(&log)?;
    let last = *record_offsets(&bytes).last().context("no record")?;
    bytes[last + 4] = 0xff;
    bytes[last + 5] = 0xff;
    std::fs::write(&log, &bytes)?;

    let tolerated = recovered_by_rocksdb(
        &store_path,
        rocksdb::DBRecoveryMode::TolerateCorruptedTailRecords,
    )?;
    assert!(
        !tolerated
            .as_deref()
            .is_some_and(|m| m.ends_with("documents 1")),
        "RocksDB should drop the last commit silently, it recovered {tolerated:?}"
    );
    assert_refused(&store_path, &log, model.path(), &paths[1..], false)
}

/// A writer killed while it appends a commit leaves an incomplete last record that was never
/// acknowledged (its commit note still names the commit before). That is forgiven: the writer
/// opens with every acknowledged chunk, and ingesting the same documents again finishes to
/// exactly what one uninterrupted ingest stores. The same cut in an acknowledged commit is
/// refused.
#[test]
fn a_torn_last_record_is_forgiven_and_the_ingest_resumes() -> Result<()> {
    let (_model, loaded) = tiny()?;
    let dir = tempfile::tempdir()?;
    let paths = write_documents(&dir.path().join("docs"), 2, 1500, 5)?;
    let docs = read_documents(&paths)?;
    let reference = Store::open(dir.path().join("reference"), Access::Write)?;
    ingest(&reference, "c", loaded.as_ref(), &docs, &mut |_| {})?;

    let store_path = dir.path().join("s");
    let note = store_path.join("kvdb-last-commit");
    let mut first_note = String::new();
    {
        let store = Store::open(&store_path, Access::Write)?;
        ingest_into_the_log(
            &store,
            &loaded,
            &docs,
            |commits, _| commits == 2,
            |commits| {
                if commits == 1 {
                    first_note = std::fs::read_to_string(&note).unwrap_or_default();
                }
            },
        )?;
        assert_eq!(store.manifest("c")?.tokens, 1024);
    }
    let log = the_log(&store_path)?;
    let bytes = std::fs::read(&log)?;
    std::fs::write(&log, &bytes[..bytes.len() - 5])?;

    // The second chunk was acknowledged: cutting it off loses a commit.
    let err = Store::open(&store_path, Access::Write).expect_err("a lost commit");
    assert!(
        matches!(&err, kvdb::Error::WalDamaged { file, source: None, .. } if *file == log),
        "{err}"
    );
    // As a kill mid-append leaves it: the note still names the first chunk.
    ensure!(
        !first_note.is_empty(),
        "no commit note after the first chunk"
    );
    std::fs::write(&note, &first_note)?;
    {
        let store = Store::open(&store_path, Access::Write)?;
        let m = store.manifest("c")?;
        assert_eq!((m.tokens, m.documents), (512, 0));
        assert!(m.pending.is_some(), "the first document is interrupted");
        ingest(&store, "c", loaded.as_ref(), &docs, &mut |_| {})?;
    }
    let resumed = Store::open(&store_path, Access::Read)?;
    let (expected, got) = (dump(&reference, "c")?, dump(&resumed, "c")?);
    assert_eq!(expected.0, got.0, "manifest and documents differ");
    assert_eq!(expected.1, got.1, "tokens differ");
    assert!(expected.2 == got.2, "stored keys/values differ");
    Ok(())
}

/// After `kvdb ingest` of a few documents exits, the log holds at most [`AT_REST`] bytes: the
/// ingest's last step flushed its chunks to SST files, and only the index update that follows
/// it (a manifest and a flat index's few bytes) may still be in the log. Every document reads
/// back.
#[test]
fn an_ingest_leaves_almost_no_log() -> Result<()> {
    /// What the log files of a store at rest may hold together.
    const AT_REST: u64 = 4096;
    let (model, _loaded) = tiny()?;
    let dir = tempfile::tempdir()?;
    let paths = write_documents(&dir.path().join("docs"), 5, 2500, 6)?;
    let store_path = dir.path().join("s");
    let out = cli_ingest(&store_path, model.path(), &paths)?;
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let logs = log_bytes(&store_path)?;
    assert!(
        logs <= AT_REST,
        "the log holds {logs} bytes after the ingest"
    );

    let store = Store::open(&store_path, Access::Read)?;
    let m = store.manifest("c")?;
    assert_eq!(m.documents, 5);
    assert_eq!(store.documents(&m)?.len(), 5);
    assert_eq!(store.tokens(&m, 0..m.tokens)?.len(), m.tokens);
    let (header, _, rows) = dump(&store, "c")?;
    assert!(header.contains("documents 5"));
    // Keys, values and the sampled queries of every layer's KV head.
    assert_eq!(rows.len(), m.layers.len() * m.model.n_kv_heads * 3);
    Ok(())
}

/// Commits far more than [`MAX_TOTAL_WAL_SIZE`] without a flush. Key and value blocks do
/// not go through the log at all (they are ingested as SST files); token blocks do, and the
/// live log never holds more than twice the bound plus one batch of them (RocksDB flushes the
/// families pinning the oldest log once the bound is passed and deletes that log when the
/// flush is done; writes go on meanwhile). Every block reads back.
#[test]
fn the_log_stays_bounded_without_a_flush() -> Result<()> {
    const BATCH_BLOCKS: u32 = 64;
    const ROWS: usize = 64 * 256;
    let dir = tempfile::tempdir()?;
    let store_path = dir.path().join("s");
    let store = Store::open(&store_path, Access::Write)?;
    let mut rng = rand::rngs::StdRng::seed_from_u64(9);
    let block = |b: u32, kv: Kv| BlockKey {
        corpus: 1,
        layer: 0,
        head: u16::from(kv == Kv::Values),
        block: b,
    };
    let rows = |b: u32| -> Vec<f16> {
        (0..ROWS)
            .map(|i| f16::from_f32(((b as usize * 7 + i) % 251) as f32))
            .collect()
    };
    // Random rows do not compress, as keys, values and token ids do not.
    let noise: Vec<f16> = (0..ROWS)
        .map(|_| f16::from_f32(rng.random_range(-1.0..1.0)))
        .collect();
    let ids: Vec<u32> = (0..ROWS).map(|_| rng.random()).collect();
    // The bytes of one batch's token blocks, and as much again in key and value blocks.
    let batch_bytes = u64::from(BATCH_BLOCKS) * (ROWS as u64) * 4;
    let batches = (3 * MAX_TOTAL_WAL_SIZE) / batch_bytes + 1;
    let mut most = 0;
    for n in 0..batches as u32 {
        let mut batch = store.batch();
        for b in n * BATCH_BLOCKS..(n + 1) * BATCH_BLOCKS {
            batch.put_tokens(1, b as usize, &ids)?;
            batch.put_block(Kv::Keys, block(b, Kv::Keys), noise.clone());
            batch.put_block(Kv::Values, block(b, Kv::Values), rows(b));
        }
        store.commit(batch)?;
        let logged = log_bytes(&store_path)?;
        if n == 0 {
            assert!(
                logged < batch_bytes + batch_bytes / 8,
                "{logged} bytes in the log after a batch of {batch_bytes} bytes of tokens \
                 and as many of keys and values"
            );
        }
        most = most.max(logged);
    }
    eprintln!(
        "{} MiB committed in {batches} batches, the log held at most {} MiB",
        (batches * batch_bytes) >> 20,
        most >> 20
    );
    assert!(
        most <= 2 * MAX_TOTAL_WAL_SIZE + batch_bytes,
        "the log reached {most} bytes"
    );
    store.flush()?;
    drop(store);
    let store = Store::open(&store_path, Access::Read)?;
    for b in [0, 1, batches as u32 * BATCH_BLOCKS - 1] {
        let values = store
            .block(Kv::Values, block(b, Kv::Values))?
            .context("missing")?;
        let expected: Vec<f32> = rows(b).iter().map(|x| x.to_f32()).collect();
        assert_eq!(values, expected);
        let keys = store
            .block(Kv::Keys, block(b, Kv::Keys))?
            .context("missing")?;
        assert_eq!(keys.len(), ROWS);
    }
    Ok(())
}
