//! The store: corpora of KV caches in one RocksDB database.
//!
//! Column families (ARCHITECTURE.md, decision 6):
//!
//! | family   | key                                          | value                                |
//! |----------|----------------------------------------------|--------------------------------------|
//! | `meta`   | `store`                                      | [`StoreRecord`] (format version)     |
//! | `meta`   | `corpus/<name>`                              | [`CorpusManifest`] (JSON)            |
//! | `docs`   | corpus id, document number (u32 BE each)     | [`DocumentRecord`] (JSON)            |
//! | `tokens` | corpus id, block (u32 BE each)               | the block's token ids, u32 LE        |
//! | `keys`   | corpus id u32, layer u16, KV head u16, block u32 (BE) | `[tokens, head_dim]` f16 LE, pre-RoPE |
//! | `values` | as `keys`                                    | `[tokens, head_dim]` f16 LE          |
//! | `index`  | corpus id u32, index number u16, layer u16, KV head u16 (BE) | `kvdb_index::save` bytes (structure only; the keys stay in `keys`) |
//! | `queries` | corpus id u32, layer u16, position u32 (BE) | a retrieval layer's sampled query, `[n_heads, head_dim]` f16 LE, pre-RoPE ([`QUERY_SAMPLE_STRIDE`]; ingested as SST files before the manifest commits, as blocks are) |
//!
//! Blocks hold `block_size` consecutive tokens (the last one of a corpus may be partial and
//! is rewritten whole when tokens are appended). Big-endian keys keep a corpus's blocks in
//! order and let one range delete drop a corpus. Every ingest step is one commit whose
//! manifest update is the commit point: readers trust the manifest's token count and
//! nothing past it.
//!
//! ## Key and value blocks and the query sample bypass the log
//!
//! They are most of what an ingest writes (a GPU prefills tens of megabytes of them a
//! second), and RocksDB's ordinary write path would write each byte twice (log, then SST
//! file) and pass it through a memtable. So a commit writes its blocks and sampled query rows
//! as one sorted SST file per family and has RocksDB ingest it (move it into the database,
//! durably), then writes the rest of the batch (tokens, documents, the manifest) as one
//! synced, atomic write to the log.
//! Blocks therefore become visible just *before* the manifest that counts them, which is safe
//! because nothing reads past the committed manifest: a crash in between leaves rows no
//! manifest counts, and the resumed ingest writes the same rows again. The one write that
//! could hurt, deleting blocks a committed manifest still reads, is never made: an ingest
//! deletes a sliding window's old blocks one commit late (`kvdb::ingest`).
//!
//! ## The write-ahead log
//!
//! A commit is durable once RocksDB has synced its log write to the write-ahead log (the
//! `*.log` files), its blocks having been ingested before; memtables reach SST files later.
//! Two rules keep that log honest and small:
//!
//! - **No committed write is dropped silently.** Every handle opens with
//!   [`DBRecoveryMode::TolerateCorruptedTailRecords`]: a damaged record anywhere in a log
//!   fails the open instead of RocksDB's default point-in-time recovery, which replays up to
//!   the damage, drops the rest and carries on. That mode still forgives an incomplete
//!   *last* record, the mark a crash in the middle of a commit can leave (so interrupted
//!   ingests resume), but it cannot tell such a torn write from a last record that was
//!   committed and then cut short or had its length field damaged. So after every commit
//!   the store notes RocksDB's sequence number in `kvdb-last-commit`, and before a writer
//!   replays a log it checks, read-only, that recovery reaches that number (a reader checks
//!   the same after it opens). Either failure is [`Error::WalDamaged`], with the store
//!   untouched.
//! - **The log stays bounded.** [`MAX_TOTAL_WAL_SIZE`] caps the live log, and
//!   [`Store::flush`] (called at the end of an ingest) moves the memtables to SST files so
//!   that a store at rest has an empty log.

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use half::f16;
use kvdb_model::{LayerKind, ModelConfig};
use rocksdb::{
    ColumnFamilyDescriptor, DBCompressionType, DBRecoveryMode, ErrorKind, FlushOptions,
    IngestExternalFileOptions, IteratorMode, Options, SstFileWriter, WriteBatch, WriteOptions, DB,
};
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use rayon::prelude::*;

/// The on-disk format this build reads and writes. Version 3 added the `queries` family
/// (a sample of each retrieval layer's queries, see [`QUERY_SAMPLE_STRIDE`]); corpora written
/// before hold none, and indexes that learn from queries are built without them.
pub const FORMAT_VERSION: u32 = 3;

/// The oldest format this kvdb reads. Version 1 manifests have no `prefill` record (they
/// were all written on the CPU in chunks of 512 tokens, which is what it defaults to); a
/// writer that opens such a store marks it version 2.
pub const OLDEST_FORMAT_VERSION: u32 = 1;

/// Tokens per key/value block unless a corpus says otherwise.
pub const DEFAULT_BLOCK_SIZE: usize = 64;

/// Blocks of a KV head a GPU upload's reader scans as one part ([`Store::layer_kv_f16`]):
/// 32K rows of the default block size, 8-16 MiB of a 128- or 256-wide head, so that a
/// long corpus's layer is read by every core.
const READ_PART_BLOCKS: usize = 512;

/// Column families, in the order they are opened.
const FAMILIES: [&str; 7] = [
    "meta", "docs", "tokens", "keys", "values", "index", "queries",
];

/// An ingest keeps the pre-RoPE queries of one position in this many (those with `position %
/// QUERY_SAMPLE_STRIDE == QUERY_SAMPLE_STRIDE - 1`) of every retrieval layer, all query heads:
/// what indexes that learn where queries look are fitted on (`ivf…,fit`). At 4 query heads
/// per KV head that is 1/8 of the bytes of the layer's keys and values. One in 64 was too
/// few on the default model's ~5.6K-token fit of kvdb/tests/real.rs: with 256 lists the fit
/// lost 8% of the mass to routing by centroid; one in 16 matched it.
pub const QUERY_SAMPLE_STRIDE: usize = 16;

/// The most the live write-ahead log files may hold together (RocksDB's
/// `max_total_wal_size`); past it RocksDB flushes the column families that keep the oldest
/// log alive, and deletes that log.
///
/// Without it the log grows with everything written: a log file can only go once every
/// column family with data in it has been flushed, and `meta`, `docs` and `tokens` take a few
/// KB per commit, so their memtables never fill their 64 MiB `write_buffer_size` and never
/// flush on their own, while RocksDB's default limit is 4 × all memtables (6 families ×
/// 64 MiB × 2 × 4 = 3 GiB). `keys` and `values` fill their memtables at the same commit, when
/// RocksDB starts a new log file: hence log files of ~132 MB each, kept forever.
///
/// 64 MiB is one memtable's worth: `keys` and `values` now flush at ~32 MiB each (SST files
/// of half the default size, which compaction merges anyway), about every 7 commits of a
/// 270M-class model (~9 MB a commit: 512 tokens × 18 layers × 1 KiB of K/V), and the log a
/// crash leaves to replay stays under ~80 MB (measured: a peak of 82 MB over a 12.5K-token
/// ingest whose log used to reach 182 MB).
pub const MAX_TOTAL_WAL_SIZE: u64 = 64 << 20;

/// The note of the last commit's RocksDB sequence number, beside the database (RocksDB
/// ignores files it did not name). It is written after the commit is synced, so it never
/// runs ahead of what is durable: a log that recovers to less has lost committed writes.
const COMMIT_NOTE: &str = "kvdb-last-commit";

const STORE_KEY: &[u8] = b"store";
const CORPUS_PREFIX: &str = "corpus/";

/// The store-wide record under `meta/store`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct StoreRecord {
    /// [`FORMAT_VERSION`] of the writer.
    pub format_version: u32,
    /// The id the next corpus gets (ids are never reused, so a deleted corpus's leftovers
    /// can never be read as a new one's).
    pub next_corpus_id: u32,
}

/// The model a corpus was ingested with.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ModelRecord {
    /// sha256 of the GGUF file.
    pub sha256: String,
    /// Name from its metadata (or the file name).
    pub name: String,
    /// `general.architecture`.
    pub architecture: String,
    /// Transformer layers.
    pub n_layers: usize,
    /// Query heads.
    pub n_heads: usize,
    /// Key/value heads.
    pub n_kv_heads: usize,
    /// Dimension of a head.
    pub head_dim: usize,
    /// Trained context length.
    pub context_length: usize,
}

/// What a corpus keeps of one layer (ARCHITECTURE.md's layer policy), one per layer in the
/// manifest.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "kind")]
pub enum LayerPolicy {
    /// Every token's keys and values (the layer attends to everything: a retrieval layer).
    All,
    /// Only the last `keep` tokens (a sliding-window layer never looks further back).
    Last {
        /// Tokens kept.
        keep: usize,
    },
}

impl LayerPolicy {
    /// The policy of a new corpus's layers: global layers store everything, sliding-window
    /// layers only what their window can still see.
    pub fn for_model(config: &ModelConfig) -> Vec<Self> {
        config
            .layers
            .iter()
            .map(|l| match l.kind {
                LayerKind::Global => Self::All,
                LayerKind::SlidingWindow { window } => Self::Last {
                    keep: window.saturating_sub(1),
                },
            })
            .collect()
    }
}

/// A document whose ingest was interrupted: its tokens up to the corpus's `tokens` are stored.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PendingDocument {
    /// sha256 of its content.
    pub sha256: String,
    /// Its title.
    pub title: String,
    /// First token of it.
    pub start: usize,
    /// Its length in tokens.
    pub total: usize,
}

/// A corpus's manifest: everything a reader needs, and the commit point of every ingest step.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CorpusManifest {
    /// Format version of the writer.
    pub format_version: u32,
    /// The corpus's name.
    pub name: String,
    /// Its id (prefix of its keys).
    pub id: u32,
    /// The model it was ingested with.
    pub model: ModelRecord,
    /// Tokens per key/value block.
    pub block_size: usize,
    /// Per layer, what is stored (the layer policy).
    pub layers: Vec<LayerPolicy>,
    /// Index specs queries may use (the first is the default).
    pub indexes: Vec<String>,
    /// Committed tokens: the corpus's context is tokens `0..tokens`.
    pub tokens: usize,
    /// Complete documents.
    pub documents: usize,
    /// A document whose ingest was interrupted, if any.
    pub pending: Option<PendingDocument>,
    /// How ingest prefilled it: later ingests and resumes keep its chunk size, so that a
    /// corpus is the same however its ingests were interrupted.
    #[serde(default)]
    pub prefill: PrefillRecord,
}

/// Per-head rows `[heads][tokens, d]` as one `[tokens, heads, d]` array.
pub(crate) fn interleave_heads(per_head: &[Vec<f32>], d: usize) -> Vec<f32> {
    let tokens = per_head.first().map_or(0, |h| h.len() / d.max(1));
    let mut out = Vec::with_capacity(tokens * per_head.len() * d);
    for i in 0..tokens {
        for head in per_head {
            out.extend_from_slice(&head[i * d..(i + 1) * d]);
        }
    }
    out
}

/// How a corpus's ingests prefill.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PrefillRecord {
    /// Where the last ingest ran: `cpu` or `cuda`.
    pub device: String,
    /// Tokens per prefill step (and commit), counted from each document's first token.
    pub chunk: usize,
}

impl Default for PrefillRecord {
    /// What every corpus of format version 1 was ingested with.
    fn default() -> Self {
        Self {
            device: "cpu".into(),
            chunk: 512,
        }
    }
}

impl CorpusManifest {
    /// Layers that store every token (retrieval layers), in order.
    pub fn retrieval_layers(&self) -> Vec<usize> {
        (0..self.layers.len())
            .filter(|&l| self.layers[l] == LayerPolicy::All)
            .collect()
    }

    /// Bytes of the stored keys and values (f16), over every layer and KV head.
    pub fn kv_bytes(&self) -> u64 {
        let row_bytes = (self.model.n_kv_heads * self.model.head_dim * 2 * 2) as u64;
        (0..self.layers.len())
            .map(|l| self.stored_range(l, self.tokens).len() as u64 * row_bytes)
            .sum()
    }

    /// The tokens of layer `layer` that are stored when the corpus holds `tokens` tokens.
    pub fn stored_range(&self, layer: usize, tokens: usize) -> Range<usize> {
        match self.layers.get(layer) {
            Some(LayerPolicy::Last { keep }) => tokens.saturating_sub(*keep)..tokens,
            _ => 0..tokens,
        }
    }
}

/// One complete document of a corpus.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DocumentRecord {
    /// Its number in the corpus (0, 1, ...).
    pub number: usize,
    /// sha256 of its content (its identity).
    pub sha256: String,
    /// Its title (the file name).
    pub title: String,
    /// Where it was read from.
    pub source: String,
    /// Its tokens in the corpus's context.
    pub tokens: Range<usize>,
    /// Its length in bytes.
    pub bytes: usize,
}

/// Which half of the KV cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Kv {
    /// Keys (pre-RoPE).
    Keys,
    /// Values.
    Values,
}

impl Kv {
    fn family(self) -> &'static str {
        match self {
            Kv::Keys => "keys",
            Kv::Values => "values",
        }
    }
}

/// The address of one key or value block.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct BlockKey {
    /// Corpus id.
    pub corpus: u32,
    /// Layer.
    pub layer: u16,
    /// KV head.
    pub head: u16,
    /// Block number (tokens `block * block_size ..`).
    pub block: u32,
}

impl BlockKey {
    /// Block `block` of one layer and KV head of corpus `corpus`, from the `usize` indexes
    /// the engine counts in. The narrowing is lossless for every model a GGUF can describe
    /// (layers and KV heads in the hundreds) and every corpus a context holds (blocks of 64
    /// tokens: 2^32 of them is 2^38 tokens).
    pub fn new(corpus: u32, layer: usize, head: usize, block: usize) -> Self {
        Self {
            corpus,
            layer: layer as u16,
            head: head as u16,
            block: block as u32,
        }
    }

    /// The block's RocksDB key in the `keys` and `values` families.
    pub fn bytes(&self) -> [u8; 12] {
        let mut k = [0u8; 12];
        k[..4].copy_from_slice(&self.corpus.to_be_bytes());
        k[4..6].copy_from_slice(&self.layer.to_be_bytes());
        k[6..8].copy_from_slice(&self.head.to_be_bytes());
        k[8..].copy_from_slice(&self.block.to_be_bytes());
        k
    }
}

/// The address of one sampled query row: corpus, layer and position.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QueryKey {
    /// Corpus id.
    pub corpus: u32,
    /// Layer.
    pub layer: u16,
    /// The query's position.
    pub position: u32,
}

impl QueryKey {
    /// The row of `position` in `layer` of corpus `corpus` (narrowed as [`BlockKey::new`]).
    pub fn new(corpus: u32, layer: usize, position: usize) -> Self {
        Self {
            corpus,
            layer: layer as u16,
            position: position as u32,
        }
    }

    fn bytes(&self) -> [u8; 10] {
        let mut k = [0u8; 10];
        k[..4].copy_from_slice(&self.corpus.to_be_bytes());
        k[4..6].copy_from_slice(&self.layer.to_be_bytes());
        k[6..].copy_from_slice(&self.position.to_be_bytes());
        k
    }

    fn parse(bytes: &[u8]) -> Option<Self> {
        let bytes: &[u8; 10] = bytes.try_into().ok()?;
        Some(Self {
            corpus: u32::from_be_bytes(bytes[..4].try_into().ok()?),
            layer: u16::from_be_bytes(bytes[4..6].try_into().ok()?),
            position: u32::from_be_bytes(bytes[6..].try_into().ok()?),
        })
    }
}

/// One layer's KV head's sampled queries ([`Store::query_sample`]).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct QuerySampleRows {
    /// Positions, ascending.
    pub positions: Vec<u32>,
    /// Pre-RoPE queries `[positions, group, head_dim]`.
    pub queries: Vec<f32>,
}

/// The address of one saved index: corpus, the index's number in the manifest's `indexes`,
/// layer and KV head.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct IndexKey {
    /// Corpus id.
    pub corpus: u32,
    /// Position of its spec in the manifest's `indexes`.
    pub index: u16,
    /// Layer.
    pub layer: u16,
    /// KV head.
    pub head: u16,
}

impl IndexKey {
    fn bytes(&self) -> [u8; 10] {
        let mut k = [0u8; 10];
        k[..4].copy_from_slice(&self.corpus.to_be_bytes());
        k[4..6].copy_from_slice(&self.index.to_be_bytes());
        k[6..8].copy_from_slice(&self.layer.to_be_bytes());
        k[8..].copy_from_slice(&self.head.to_be_bytes());
        k
    }
}

fn pair_key(a: u32, b: u32) -> [u8; 8] {
    let mut k = [0u8; 8];
    k[..4].copy_from_slice(&a.to_be_bytes());
    k[4..].copy_from_slice(&b.to_be_bytes());
    k
}

/// Encodes f16 rows as little-endian bytes, the store's layout.
pub fn encode_f16(values: &[f16]) -> Cow<'_, [u8]> {
    if cfg!(target_endian = "little") {
        // The layout in memory: no copy (an ingest writes gigabytes).
        Cow::Borrowed(bytemuck::cast_slice(values))
    } else {
        Cow::Owned(values.iter().flat_map(|v| v.to_le_bytes()).collect())
    }
}

/// Decodes f16 little-endian bytes into f32.
pub(crate) fn decode_f16(bytes: &[u8]) -> Result<Vec<f32>> {
    if !bytes.len().is_multiple_of(2) {
        return Err(Error::Corrupt(format!(
            "an f16 block of {} bytes",
            bytes.len()
        )));
    }
    Ok(bytes
        .chunks_exact(2)
        .map(|b| f16::from_le_bytes([b[0], b[1]]).to_f32())
        .collect())
}

/// Whether the store is opened to write (one process at a time) or to read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    /// Create the store if needed and take its write lock.
    Write,
    /// Read the last committed state, even while another process writes (a RocksDB
    /// secondary instance).
    Read,
}

/// The note a long-running writer leaves in the store's folder (RocksDB ignores files it did
/// not name), so that other writers can say who holds the lock.
const OWNER_FILE: &str = "kvdb-owner";

/// The families a commit writes as SST files for RocksDB to ingest ([`Batch::put_block`],
/// [`Batch::put_queries`]).
const INGESTED_FAMILIES: [&str; 3] = ["keys", "values", "queries"];

/// Where a commit writes one family's rows as an SST file before RocksDB ingests it (moves it
/// into the database), beside the database: RocksDB ignores files it did not name. A writer
/// removes what a crash left there when it opens: it was never ingested.
fn ingest_file(store: &Path, family: &str) -> PathBuf {
    store.join(format!("kvdb-ingest-{family}.sst"))
}

/// One RocksDB database holding any number of corpora.
pub struct Store {
    db: DB,
    path: PathBuf,
    /// Holds a secondary instance's own files while it is open.
    secondary: Option<tempfile::TempDir>,
    /// Whether this handle wrote the owner note (removed again on drop).
    owner_note: bool,
    /// The sequence number in the commit note (commits from several threads write it in
    /// turn, so that it only ever grows).
    noted: Mutex<u64>,
}

impl Drop for Store {
    fn drop(&mut self) {
        if self.owner_note {
            let _ = std::fs::remove_file(self.path.join(OWNER_FILE));
        }
    }
}

impl std::fmt::Debug for Store {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Store").field("path", &self.path).finish()
    }
}

impl Store {
    /// Whether a store exists at `path`.
    pub fn exists(path: impl AsRef<Path>) -> bool {
        path.as_ref().join("CURRENT").is_file()
    }

    /// Opens the store at `path`. Writers create it when absent; readers require it.
    ///
    /// Fails with [`Error::WalDamaged`], changing nothing, when replaying the write-ahead log
    /// would drop committed writes.
    pub fn open(path: impl AsRef<Path>, access: Access) -> Result<Self> {
        let path = path.as_ref().to_path_buf();
        if !Self::exists(&path) && (access == Access::Read || path.is_file()) {
            return Err(Error::StoreMissing { path });
        }
        let mut opts = db_options();
        // A reader opens the families that exist: a store no writer of this version has
        // opened yet lacks the newer ones (a writer creates them).
        let existing = match access {
            Access::Read => DB::list_cf(&opts, &path).ok(),
            Access::Write => None,
        };
        let families = FAMILIES
            .iter()
            .filter(|name| {
                existing
                    .as_ref()
                    .is_none_or(|e| e.iter().any(|f| f == *name))
            })
            .map(|name| ColumnFamilyDescriptor::new(*name, family_options(name)));
        // Read before RocksDB opens, so that it never names a commit the replay could miss.
        let noted = read_commit_note(&path);
        let (db, secondary) = match access {
            Access::Write => {
                if let Some(noted) = noted {
                    check_recovery(&path, noted)?;
                }
                let db = DB::open_cf_descriptors(&opts, &path, families).map_err(|e| {
                    if e.kind() == ErrorKind::Corruption {
                        return open_error(&path, e);
                    }
                    if !e.to_string().contains("lock") {
                        return Error::Rocks(e);
                    }
                    match std::fs::read_to_string(path.join(OWNER_FILE)) {
                        Ok(owner) if !owner.trim().is_empty() => Error::StoreOwned {
                            path: path.clone(),
                            owner: owner.trim().to_string(),
                        },
                        _ => Error::StoreBusy { path: path.clone() },
                    }
                })?;
                // We hold the lock, so a note left by an owner that died is stale, and so are
                // SST files a commit wrote but did not ingest.
                let _ = std::fs::remove_file(path.join(OWNER_FILE));
                for family in INGESTED_FAMILIES {
                    let _ = std::fs::remove_file(ingest_file(&path, family));
                }
                (db, None)
            }
            Access::Read => {
                let dir = tempfile::Builder::new()
                    .prefix("kvdb-reader")
                    .tempdir()
                    .map_err(|source| Error::Io {
                        context: "creating a reader's scratch folder".into(),
                        source,
                    })?;
                opts.set_max_open_files(-1);
                let db = DB::open_cf_descriptors_as_secondary(
                    &opts,
                    &path,
                    &dir.path().to_path_buf(),
                    families,
                )
                .map_err(|e| open_error(&path, e))?;
                if let Some(noted) = noted {
                    check_secondary(&db, &path, noted)?;
                }
                (db, Some(dir))
            }
        };
        let store = Self {
            db,
            path,
            secondary,
            owner_note: false,
            noted: Mutex::new(noted.unwrap_or(0)),
        };
        if store.secondary.is_some() {
            store.catch_up_with_blocks()?;
        }
        match store.record()? {
            Some(r) if !(OLDEST_FORMAT_VERSION..=FORMAT_VERSION).contains(&r.format_version) => {
                Err(Error::FormatVersion {
                    path: store.path.clone(),
                    found: r.format_version,
                    expected: FORMAT_VERSION,
                })
            }
            Some(r) if r.format_version < FORMAT_VERSION && access == Access::Write => {
                // Older manifests read as they are (their missing fields default); the
                // store is marked with the version its next writes have.
                store.put_record(&StoreRecord {
                    format_version: FORMAT_VERSION,
                    ..r
                })?;
                Ok(store)
            }
            Some(_) => Ok(store),
            None if access == Access::Write => {
                store.put_record(&StoreRecord {
                    format_version: FORMAT_VERSION,
                    next_corpus_id: 1,
                })?;
                Ok(store)
            }
            None => Err(Error::StoreMissing {
                path: store.path.clone(),
            }),
        }
    }

    /// Makes a reader see the blocks of every commit it sees. A commit's blocks are ingested
    /// before its log write, but a secondary instance reads RocksDB's MANIFEST (where
    /// ingested files are listed) before the log: a commit made between the two reads shows
    /// its corpus manifest without its last blocks. Catching up again reads the MANIFEST
    /// after that commit's ingestion; it may show newer commits with the same gap, so this
    /// checks each corpus's last values block (the last family a commit ingests) and
    /// catches up until it is whole.
    fn catch_up_with_blocks(&self) -> Result<()> {
        const TRIES: usize = 20;
        for _ in 0..TRIES {
            if self.corpora()?.iter().all(|m| self.has_last_block(m)) {
                return Ok(());
            }
            self.db.try_catch_up_with_primary()?;
        }
        // A missing block that catching up does not bring is damage, which reads report.
        Ok(())
    }

    /// Whether the block holding `manifest`'s last token is stored with that token's row
    /// (layer 0, KV head 0, values: every layer stores its last block).
    fn has_last_block(&self, manifest: &CorpusManifest) -> bool {
        let Some(last) = manifest.tokens.checked_sub(1) else {
            return true;
        };
        let b = manifest.block_size;
        let key = BlockKey::new(manifest.id, 0, 0, last / b);
        let Ok(values) = self.cf("values") else {
            return false;
        };
        matches!(
            self.db.get_pinned_cf(values, key.bytes()),
            Ok(Some(bytes)) if bytes.len() >= (last % b + 1) * manifest.model.head_dim * 2
        )
    }

    /// Where the store lives.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Says who holds this writer (e.g. "a kvdb server (pid 7, http://127.0.0.1:8080)"), so
    /// that another writer's [`Error::StoreOwned`] names it; the note goes when the store is
    /// dropped.
    pub fn claim(&mut self, owner: &str) -> Result<()> {
        if self.secondary.is_some() {
            return Err(Error::Internal(
                "a store opened to read cannot be claimed".into(),
            ));
        }
        std::fs::write(self.path.join(OWNER_FILE), owner).map_err(|source| Error::Io {
            context: format!("writing {}", self.path.join(OWNER_FILE).display()),
            source,
        })?;
        self.owner_note = true;
        Ok(())
    }

    fn cf(&self, name: &str) -> Result<&rocksdb::ColumnFamily> {
        self.db
            .cf_handle(name)
            .ok_or_else(|| Error::Corrupt(format!("column family `{name}` is missing")))
    }

    fn record(&self) -> Result<Option<StoreRecord>> {
        self.db
            .get_cf(self.cf("meta")?, STORE_KEY)?
            .map(|b| json(&b, "the store record"))
            .transpose()
    }

    fn put_record(&self, record: &StoreRecord) -> Result<()> {
        let bytes = to_json(record)?;
        self.db.put_cf(self.cf("meta")?, STORE_KEY, bytes)?;
        Ok(())
    }

    /// Every corpus's manifest, by name.
    pub fn corpora(&self) -> Result<Vec<CorpusManifest>> {
        let meta = self.cf("meta")?;
        let mut out = Vec::new();
        let from = CORPUS_PREFIX.as_bytes();
        for item in self
            .db
            .iterator_cf(meta, IteratorMode::From(from, rocksdb::Direction::Forward))
        {
            let (k, v) = item?;
            if !k.starts_with(from) {
                break;
            }
            out.push(json::<CorpusManifest>(&v, "a corpus manifest")?);
        }
        Ok(out)
    }

    /// The manifest of corpus `name`.
    pub fn manifest(&self, name: &str) -> Result<CorpusManifest> {
        let key = format!("{CORPUS_PREFIX}{name}");
        match self.db.get_cf(self.cf("meta")?, key.as_bytes())? {
            Some(v) => json(&v, "a corpus manifest"),
            None => Err(Error::CorpusMissing {
                name: name.to_string(),
                available: self.corpora()?.into_iter().map(|m| m.name).collect(),
            }),
        }
    }

    /// Creates an empty corpus (name already validated) and returns its manifest.
    pub fn create_corpus(
        &self,
        name: &str,
        model: ModelRecord,
        layers: Vec<LayerPolicy>,
        block_size: usize,
        prefill: PrefillRecord,
    ) -> Result<CorpusManifest> {
        let mut record = self
            .record()?
            .ok_or_else(|| Error::Corrupt("the store record is missing".into()))?;
        let manifest = CorpusManifest {
            format_version: FORMAT_VERSION,
            name: name.to_string(),
            id: record.next_corpus_id,
            model,
            block_size,
            layers,
            indexes: vec!["flat".to_string()],
            tokens: 0,
            documents: 0,
            pending: None,
            prefill,
        };
        record.next_corpus_id += 1;
        let mut batch = self.batch();
        batch.put_manifest(&manifest)?;
        batch
            .batch
            .put_cf(self.cf("meta")?, STORE_KEY, to_json(&record)?);
        self.commit(batch)?;
        Ok(manifest)
    }

    /// Deletes corpus `name` and everything it stored, in one atomic batch.
    pub fn delete_corpus(&self, name: &str) -> Result<CorpusManifest> {
        let manifest = self.manifest(name)?;
        let mut batch = self.batch();
        let key = format!("{CORPUS_PREFIX}{name}");
        batch.batch.delete_cf(self.cf("meta")?, key.as_bytes());
        let (from, to) = (manifest.id.to_be_bytes(), (manifest.id + 1).to_be_bytes());
        for family in ["docs", "tokens", "keys", "values", "index", "queries"] {
            batch.batch.delete_range_cf(self.cf(family)?, from, to);
        }
        self.commit(batch)?;
        Ok(manifest)
    }

    /// The complete documents of a corpus, in order.
    pub fn documents(&self, manifest: &CorpusManifest) -> Result<Vec<DocumentRecord>> {
        let docs = self.cf("docs")?;
        let from = pair_key(manifest.id, 0);
        let mut out = Vec::with_capacity(manifest.documents);
        for item in self
            .db
            .iterator_cf(docs, IteratorMode::From(&from, rocksdb::Direction::Forward))
        {
            let (k, v) = item?;
            if out.len() == manifest.documents || !k.starts_with(&manifest.id.to_be_bytes()) {
                break;
            }
            out.push(json::<DocumentRecord>(&v, "a document record")?);
        }
        if out.len() != manifest.documents {
            return Err(Error::Corrupt(format!(
                "corpus `{}` lists {} documents, the store has {}",
                manifest.name,
                manifest.documents,
                out.len()
            )));
        }
        Ok(out)
    }

    /// Token ids `range` of a corpus (within its committed tokens).
    pub fn tokens(&self, manifest: &CorpusManifest, range: Range<usize>) -> Result<Vec<u32>> {
        let cf = self.cf("tokens")?;
        let b = manifest.block_size;
        let mut out = Vec::with_capacity(range.len());
        let mut block = range.start / b;
        while block * b < range.end {
            let bytes = self
                .db
                .get_pinned_cf(cf, pair_key(manifest.id, block as u32))?
                .ok_or_else(|| Error::Corrupt(format!("token block {block} is missing")))?;
            let ids: Vec<u32> = bytes
                .chunks_exact(4)
                .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect();
            let lo = range.start.max(block * b) - block * b;
            let hi = (range.end - block * b).min(ids.len());
            if hi < lo || ids.len() < hi {
                return Err(Error::Corrupt(format!("token block {block} is short")));
            }
            out.extend_from_slice(&ids[lo..hi]);
            block += 1;
        }
        if out.len() != range.len() {
            return Err(Error::Corrupt("token blocks are short".into()));
        }
        Ok(out)
    }

    /// One key or value block as f32 `[tokens, head_dim]` (`None` when absent).
    pub fn block(&self, kv: Kv, key: BlockKey) -> Result<Option<Vec<f32>>> {
        self.db
            .get_pinned_cf(self.cf(kv.family())?, key.bytes())?
            .map(|b| decode_f16(&b))
            .transpose()
    }

    /// Rows `range` of one layer's keys and values for every KV head, f32 `[rows, n_kv_heads,
    /// head_dim]` each (the layout the model hands out), read straight from the store.
    pub fn layer_kv(
        &self,
        manifest: &CorpusManifest,
        layer: usize,
        range: Range<usize>,
    ) -> Result<(Vec<f32>, Vec<f32>)> {
        let heads = 0..manifest.model.n_kv_heads;
        let per_head = |kv: Kv| -> Result<Vec<Vec<f32>>> {
            heads
                .clone()
                .map(|head| self.rows(manifest, kv, layer, head, range.clone()))
                .collect()
        };
        let d = manifest.model.head_dim;
        Ok((
            interleave_heads(&per_head(Kv::Keys)?, d),
            interleave_heads(&per_head(Kv::Values)?, d),
        ))
    }

    /// The sampled pre-RoPE queries of one layer's KV head (the heads of its GQA group), in
    /// position order, up to the corpus's length: empty for a corpus ingested before samples
    /// were kept (format 2) and where the layer keeps none.
    pub fn query_sample(
        &self,
        manifest: &CorpusManifest,
        layer: usize,
        kv_head: usize,
    ) -> Result<QuerySampleRows> {
        let mut sample = QuerySampleRows::default();
        let Ok(family) = self.cf("queries") else {
            return Ok(sample);
        };
        let m = &manifest.model;
        let (d, group) = (m.head_dim, m.n_heads / m.n_kv_heads.max(1));
        let row_bytes = m.n_heads * d * 2;
        let heads = kv_head * group * d * 2..(kv_head + 1) * group * d * 2;
        let from = QueryKey::new(manifest.id, layer, 0).bytes();
        for item in self.db.iterator_cf(
            family,
            IteratorMode::From(&from, rocksdb::Direction::Forward),
        ) {
            let (key, bytes) = item?;
            let Some(key) = QueryKey::parse(&key) else {
                return Err(Error::Corrupt(format!(
                    "a query sample key of {} bytes",
                    key.len()
                )));
            };
            if key.corpus != manifest.id || key.layer as usize != layer {
                break;
            }
            if key.position as usize >= manifest.tokens {
                // Written by an ingest that did not commit its manifest.
                break;
            }
            if bytes.len() != row_bytes {
                return Err(Error::Corrupt(format!(
                    "the query sample of layer {layer} at {} holds {} bytes, not {row_bytes}",
                    key.position,
                    bytes.len()
                )));
            }
            sample.positions.push(key.position);
            sample.queries.extend(decode_f16(&bytes[heads.clone()])?);
        }
        Ok(sample)
    }

    /// Rows `range` of one layer's keys or values for one KV head, f32 `[rows, head_dim]`,
    /// read straight from the store (no RAM tier).
    pub fn rows(
        &self,
        manifest: &CorpusManifest,
        kv: Kv,
        layer: usize,
        head: usize,
        range: Range<usize>,
    ) -> Result<Vec<f32>> {
        let mut out = Vec::with_capacity(range.len() * manifest.model.head_dim);
        let first = BlockKey::new(manifest.id, layer, head, 0);
        self.visit_rows(manifest, kv, first, range, |bytes| {
            out.extend(
                bytes
                    .chunks_exact(2)
                    .map(|b| f16::from_le_bytes([b[0], b[1]]).to_f32()),
            );
        })?;
        Ok(out)
    }

    /// Rows `range` of one layer's keys and values for every KV head, f16 `[n_kv_heads, rows,
    /// head_dim]` each, as stored (no conversion): what a GPU upload reads.
    pub fn layer_kv_f16(
        &self,
        manifest: &CorpusManifest,
        layer: usize,
        range: Range<usize>,
    ) -> Result<(Vec<f16>, Vec<f16>)> {
        let part = READ_PART_BLOCKS * manifest.block_size.max(1);
        self.layer_kv_f16_in_parts(manifest, layer, range, part)
    }

    /// [`Self::layer_kv_f16`] with each KV head's rows read in parts of `part_rows` rows,
    /// all parts of the keys and values in parallel: one scan is bound by one core (about
    /// 1.3 GiB/s here), while a GPU upload of a long corpus wants the whole layer at once.
    /// (`layer_kv_f16` picks the part size; this takes any, for tests.)
    pub fn layer_kv_f16_in_parts(
        &self,
        manifest: &CorpusManifest,
        layer: usize,
        range: Range<usize>,
        part_rows: usize,
    ) -> Result<(Vec<f16>, Vec<f16>)> {
        let (heads, d) = (manifest.model.n_kv_heads, manifest.model.head_dim);
        let rows = range.len();
        if rows * d == 0 || heads == 0 {
            return Ok((Vec::new(), Vec::new()));
        }
        let part = part_rows.max(1) * d;
        let read = |kv: Kv| -> Result<Vec<f16>> {
            let mut out = vec![f16::ZERO; heads * rows * d];
            out.par_chunks_mut(rows * d)
                .enumerate()
                .flat_map(|(head, out)| {
                    out.par_chunks_mut(part)
                        .enumerate()
                        .map(move |(i, out)| (head, i, out))
                })
                .try_for_each(|(head, i, out)| {
                    let start = range.start + i * part_rows.max(1);
                    let first = BlockKey::new(manifest.id, layer, head, 0);
                    let mut at = 0;
                    self.visit_rows(manifest, kv, first, start..start + out.len() / d, |bytes| {
                        let halves = bytes
                            .chunks_exact(2)
                            .map(|b| f16::from_le_bytes([b[0], b[1]]));
                        for (to, from) in out[at..].iter_mut().zip(halves) {
                            *to = from;
                        }
                        at += bytes.len() / 2;
                    })?;
                    match at == out.len() {
                        true => Ok(()),
                        false => Err(Error::Internal(format!(
                            "read {at} of {} halves of layer {layer} head {head}",
                            out.len()
                        ))),
                    }
                })?;
            Ok(out)
        };
        let (keys, values) = rayon::join(|| read(Kv::Keys), || read(Kv::Values));
        Ok((keys?, values?))
    }

    /// Hands `visit` the stored bytes (f16 little-endian) of rows `range` of one layer's keys
    /// or values for one KV head (`head`: the corpus, layer and head of its blocks' keys),
    /// block by block in order.
    ///
    /// One forward scan over the blocks' keys rather than a lookup per block: a corpus's
    /// blocks arrive as one SST file per commit, all overlapping in key range, so a lookup
    /// searches every file's index while a scan merges their positions once. The blocks are
    /// read once (a GPU upload, an index build), so they skip RocksDB's block cache.
    fn visit_rows(
        &self,
        manifest: &CorpusManifest,
        kv: Kv,
        head: BlockKey,
        range: Range<usize>,
        mut visit: impl FnMut(&[u8]),
    ) -> Result<()> {
        if range.is_empty() {
            return Ok(());
        }
        let (b, d) = (manifest.block_size, manifest.model.head_dim);
        let row_bytes = d * size_of::<f16>();
        let (first, end) = (range.start / b, range.end.div_ceil(b));
        let key = |block: usize| {
            BlockKey {
                block: block as u32,
                ..head
            }
            .bytes()
        };
        let layer = head.layer;
        let head = head.head;
        let mut options = rocksdb::ReadOptions::default();
        options.fill_cache(false);
        options.set_iterate_upper_bound(key(end).to_vec());
        let from = key(first);
        let mut blocks = self.db.iterator_cf_opt(
            self.cf(kv.family())?,
            options,
            IteratorMode::From(&from, rocksdb::Direction::Forward),
        );
        for block in first..end {
            let missing = || {
                Error::Corrupt(format!(
                    "{kv:?} block {block} of layer {layer} head {head} is missing"
                ))
            };
            let (found, data) = blocks.next().transpose()?.ok_or_else(missing)?;
            if *found != key(block) {
                return Err(missing());
            }
            let lo = range.start.max(block * b) - block * b;
            let hi = (range.end - block * b).min(b);
            if data.len() < hi * row_bytes {
                return Err(Error::Corrupt(format!(
                    "{kv:?} block {block} of layer {layer} head {head} is short"
                )));
            }
            visit(&data[lo * row_bytes..hi * row_bytes]);
        }
        Ok(())
    }

    /// The saved bytes of one index of one layer and KV head (`None` when absent).
    pub fn index(&self, key: IndexKey) -> Result<Option<Vec<u8>>> {
        Ok(self.db.get_cf(self.cf("index")?, key.bytes())?)
    }

    /// An empty batch of writes.
    pub fn batch(&self) -> Batch<'_> {
        Batch {
            store: self,
            batch: WriteBatch::default(),
            blocks: Default::default(),
            queries: Default::default(),
        }
    }

    /// Applies a batch durably (synced to disk). Its key and value blocks and query rows are
    /// ingested first (see [`Batch::put_block`]); everything else is one atomic write: all of
    /// it or none of it.
    pub fn commit(&self, batch: Batch<'_>) -> Result<()> {
        let Batch {
            batch,
            blocks,
            queries,
            ..
        } = batch;
        for (kv, writes) in [Kv::Keys, Kv::Values].into_iter().zip(blocks) {
            self.ingest_sst(kv.family(), writes)?;
        }
        self.ingest_sst("queries", queries)?;
        let mut opts = WriteOptions::default();
        opts.set_sync(true);
        self.db.write_opt(batch, &opts)?;
        self.note_commit();
        Ok(())
    }

    /// Writes `writes` to one SST file (sorted, uncompressed: f16 rows do not compress) and
    /// has RocksDB ingest it into `family`, which moves the file into the database and makes
    /// it durable: the rows are written once, sequentially, instead of to the log, a memtable
    /// and then an SST file (`benches/benches/store.rs`: 1.4x to 1.6x the throughput of synced
    /// write batches for blocks on the disks measured, 2.4x for a GPU ingest's query sample,
    /// docs/benchmarks.md).
    fn ingest_sst<const N: usize>(&self, family: &str, writes: SstWrites<N>) -> Result<()> {
        if writes.puts.is_empty() && writes.deletes.is_empty() {
            return Ok(());
        }
        let file = ingest_file(&self.path, family);
        let mut options = Options::default();
        options.set_compression_type(DBCompressionType::None);
        let mut writer = SstFileWriter::create(&options);
        writer.open(&file)?;
        for (key, rows) in &writes.puts {
            writer.put(key, encode_f16(rows))?;
        }
        for (from, to) in &writes.deletes {
            writer.delete_range(from, to)?;
        }
        writer.finish()?;
        let mut ingest = IngestExternalFileOptions::default();
        ingest.set_move_files(true);
        self.db
            .ingest_external_file_cf_opts(self.cf(family)?, &ingest, vec![&file])?;
        // RocksDB moved the file into the database, or copied it where it could not.
        match std::fs::remove_file(&file) {
            Err(source) if source.kind() != std::io::ErrorKind::NotFound => Err(Error::Io {
                context: format!("removing {}", file.display()),
                source,
            }),
            _ => Ok(()),
        }
    }

    /// Writes every memtable out to SST files and lets RocksDB delete the write-ahead log
    /// files they kept alive, leaving an empty log: call it when a run of commits ends (an
    /// ingest, an index update), so that a store at rest holds no log to replay, to grow or
    /// to lose. Commits are durable without it. A reader has nothing to flush.
    pub fn flush(&self) -> Result<()> {
        if self.secondary.is_some() {
            return Ok(());
        }
        let families = FAMILIES
            .iter()
            .map(|name| self.cf(name))
            .collect::<Result<Vec<_>>>()?;
        let mut options = FlushOptions::default();
        options.set_wait(true);
        self.db.flush_cfs_opt(&families, &options)?;
        Ok(())
    }

    /// Records the sequence number of the last synced commit in the commit note. Best
    /// effort, by design: the note can only lag behind what is durable, so a failed update
    /// weakens the check of a later open but never makes it refuse a sound store, and the
    /// commit itself has succeeded.
    fn note_commit(&self) {
        let mut noted = self.noted.lock().unwrap_or_else(|e| e.into_inner());
        let sequence = self.db.latest_sequence_number();
        if sequence <= *noted {
            return;
        }
        let (temp, note) = (
            self.path.join(format!("{COMMIT_NOTE}.tmp")),
            self.path.join(COMMIT_NOTE),
        );
        // A rename replaces the note whole, so a crash never leaves half a number.
        if std::fs::write(&temp, format!("{sequence}\n"))
            .and_then(|()| std::fs::rename(&temp, &note))
            .is_ok()
        {
            *noted = sequence;
        }
    }
}

/// The RocksDB options of every handle: writers, readers and the recovery check.
fn db_options() -> Options {
    let mut opts = Options::default();
    opts.create_if_missing(true);
    opts.create_missing_column_families(true);
    opts.set_compression_type(rocksdb::DBCompressionType::Lz4);
    opts.set_keep_log_file_num(4);
    // Fail on a damaged log record instead of dropping it and everything after it (the
    // default, point-in-time recovery); an incomplete last record, which a crash mid-commit
    // can leave, is still forgiven (see the module docs for the commit note that covers what
    // this mode cannot tell apart).
    opts.set_wal_recovery_mode(DBRecoveryMode::TolerateCorruptedTailRecords);
    opts.set_max_total_wal_size(MAX_TOTAL_WAL_SIZE);
    opts
}

/// The options of one column family. `keys` and `values` hold almost every byte and, like
/// the query sample in `queries`, are written as ingested SST files, one per commit, each
/// spanning every layer (so they overlap and land in level 0): compacting them as soon as 4
/// are there (RocksDB's default) rewrites a corpus while it is being ingested, on the disk
/// the ingest writes to; 16 let a GPU ingest of ~500K tokens of a 270M-class model finish
/// first (the store bench's 30 commits: 20% faster than with 4). They are not compressed:
/// f16 rows do not compress.
fn family_options(name: &str) -> Options {
    let mut options = Options::default();
    if INGESTED_FAMILIES.contains(&name) {
        options.set_compression_type(DBCompressionType::None);
        options.set_level_zero_file_num_compaction_trigger(16);
        options.set_level_zero_slowdown_writes_trigger(32);
        options.set_level_zero_stop_writes_trigger(48);
    }
    options
}

/// The sequence number in the commit note, if there is a readable one (stores written before
/// the note existed have none; a note that does not parse is no evidence either way).
fn read_commit_note(path: &Path) -> Option<u64> {
    std::fs::read_to_string(path.join(COMMIT_NOTE))
        .ok()?
        .trim()
        .parse()
        .ok()
}

/// Before a writer opens (and recovery writes its result out for good), replays the log
/// read-only, which changes nothing, and checks that it reaches the noted commit: RocksDB's
/// tolerance for an incomplete last record would otherwise drop a committed last record
/// whose length field was damaged, or a log cut short, without a word.
fn check_recovery(path: &Path, noted: u64) -> Result<()> {
    let logs = wal_files(path);
    if logs.iter().all(|(_, len)| *len == 0) {
        // Nothing to replay: every commit is in SST files already.
        return Ok(());
    }
    let recovered = match DB::open_cf_for_read_only(&db_options(), path, FAMILIES, false) {
        Ok(db) => db.latest_sequence_number(),
        Err(e) => {
            return match open_error(path, e) {
                e @ Error::WalDamaged { .. } => Err(e),
                // Anything else (a missing family, a log deleted by a writer that holds the
                // store): the writer's own open says what it is.
                _ => Ok(()),
            };
        }
    };
    // A writer holding the store may have flushed and deleted a log under the check, so
    // only a log that stayed as it was is evidence.
    let unchanged = || {
        let names = |l: &[(PathBuf, u64)]| l.iter().map(|(p, _)| p.clone()).collect::<Vec<_>>();
        names(&wal_files(path)) == names(&logs) && read_commit_note(path) == Some(noted)
    };
    if recovered < noted && unchanged() {
        return Err(lost_commits(path, noted, recovered));
    }
    Ok(())
}

/// A reader's version of [`check_recovery`]: a secondary instance ignores an incomplete last
/// record too (it takes it for a write in progress), so it must reach the noted commit.
fn check_secondary(db: &DB, path: &Path, noted: u64) -> Result<()> {
    for _ in 0..3 {
        if db.latest_sequence_number() >= noted {
            return Ok(());
        }
        // A writer may have flushed and deleted a log while the reader opened; catching
        // up reads the files that replaced it.
        db.try_catch_up_with_primary()
            .map_err(|e| open_error(path, e))?;
    }
    let recovered = db.latest_sequence_number();
    // Only damage found in a log file is evidence: a writer may also have flushed three
    // times over while the reader caught up.
    match locate_damage(path, |_| true) {
        Some(_) if recovered < noted => Err(lost_commits(path, noted, recovered)),
        _ => Ok(()),
    }
}

/// The error for a failed open: [`Error::WalDamaged`] when a write-ahead log file is
/// damaged, RocksDB's own error otherwise.
fn open_error(path: &Path, e: rocksdb::Error) -> Error {
    if e.kind() != ErrorKind::Corruption {
        return Error::Rocks(e);
    }
    // RocksDB forgives an incomplete last record, so its error is about another one.
    match locate_damage(path, |d| !matches!(d, wal::Damage::Incomplete(_))) {
        Some((file, damage)) => Error::WalDamaged {
            store: path.to_path_buf(),
            file,
            damage: damage.to_string(),
            source: Some(e),
        },
        // A damaged MANIFEST or SST file, not the log.
        None => Error::Rocks(e),
    }
}

/// The error for a log that recovers to less than the noted commit.
fn lost_commits(path: &Path, noted: u64, recovered: u64) -> Error {
    let (file, damage) = match locate_damage(path, |_| true) {
        Some((file, damage)) => (file, damage.to_string()),
        None => (
            path.to_path_buf(),
            "a log file is missing or cut short".to_string(),
        ),
    };
    Error::WalDamaged {
        store: path.to_path_buf(),
        file,
        damage: format!(
            "{damage}, and committed writes are lost with it (the store committed up to \
             sequence number {noted}, replaying its log reaches only {recovered})"
        ),
        source: None,
    }
}

/// The write-ahead log files (`<number>.log`) in the store's folder with their sizes, oldest
/// first.
fn wal_files(path: &Path) -> Vec<(PathBuf, u64)> {
    let mut logs: Vec<(u64, PathBuf, u64)> = std::fs::read_dir(path)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|entry| {
            let name = entry.file_name();
            let number = name.to_str()?.strip_suffix(".log")?.parse().ok()?;
            Some((number, entry.path(), entry.metadata().ok()?.len()))
        })
        .collect();
    logs.sort();
    logs.into_iter().map(|(_, p, len)| (p, len)).collect()
}

/// The first log file of the store whose first damage is of a kind `wanted`: the file and
/// what is wrong.
fn locate_damage(
    path: &Path,
    wanted: impl Fn(&wal::Damage) -> bool,
) -> Option<(PathBuf, wal::Damage)> {
    wal_files(path).into_iter().find_map(|(file, _)| {
        let bytes = std::fs::read(&file).ok()?;
        wal::scan(&bytes)
            .filter(&wanted)
            .map(|damage| (file, damage))
    })
}

/// RocksDB's write-ahead log format (`db/log_format.h`), read just far enough to say where a
/// log file stops being readable. A file is a run of 32 KiB blocks; a block holds records,
/// each a header (the masked CRC32C of the type and payload, u32 LE; the payload's length,
/// u16 LE; the type, u8; for the recyclable types, the log number, u32 LE) and a payload; a
/// block's last bytes, too few for a header, are zero padding.
mod wal {
    use std::fmt;

    const BLOCK: usize = 32 * 1024;
    const HEADER: usize = 7;
    const RECYCLABLE_HEADER: usize = 11;

    /// What is wrong with a log file, at which byte.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub(super) enum Damage {
        /// A record whose checksum does not match.
        Checksum(u64),
        /// A record whose length runs past its block while more of the file follows.
        Length(u64),
        /// The file ends inside its last record (a torn write, or a damaged length field).
        Incomplete(u64),
    }

    impl fmt::Display for Damage {
        fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            match self {
                Damage::Checksum(at) => write!(f, "the record at byte {at} fails its checksum"),
                Damage::Length(at) => write!(f, "the record at byte {at} has a bad length"),
                Damage::Incomplete(at) => write!(
                    f,
                    "its last record, at byte {at}, runs past the end of the file (the file \
                     was cut short, or the record's length is damaged)"
                ),
            }
        }
    }

    /// The first damage in a log file's bytes, if any. A record split over blocks counts
    /// from its first fragment.
    pub(super) fn scan(bytes: &[u8]) -> Option<Damage> {
        // Where the record whose later fragments are still to come starts.
        let mut open: Option<u64> = None;
        for (number, block) in bytes.chunks(BLOCK).enumerate() {
            let start = number * BLOCK;
            let last = start + block.len() == bytes.len();
            let mut at = 0;
            while block.len() - at >= HEADER {
                let h = &block[at..];
                let length = usize::from(u16::from_le_bytes([h[4], h[5]]));
                let kind = h[6];
                if kind == 0 && length == 0 {
                    // Preallocated zeros: RocksDB skips the rest of the block.
                    break;
                }
                let header = match kind {
                    5..=8 | 11 | 131 => RECYCLABLE_HEADER,
                    _ => HEADER,
                };
                let offset = (start + at) as u64;
                if header + length > block.len() - at {
                    return Some(if last {
                        Damage::Incomplete(open.unwrap_or(offset))
                    } else {
                        Damage::Length(offset)
                    });
                }
                let stored = u32::from_le_bytes([h[0], h[1], h[2], h[3]]);
                if crc32c(&h[6..header + length]) != unmask(stored) {
                    return Some(Damage::Checksum(offset));
                }
                match kind {
                    // First fragment.
                    2 | 6 => open = Some(offset),
                    // Whole record, last fragment.
                    1 | 4 | 5 | 8 => open = None,
                    _ => {}
                }
                at += header + length;
            }
            if last && block[at..].iter().any(|&b| b != 0) {
                // Part of a header at the very end.
                return Some(Damage::Incomplete(open.unwrap_or((start + at) as u64)));
            }
        }
        // The file ends between two fragments of a record.
        open.map(Damage::Incomplete)
    }

    /// RocksDB stores CRCs masked (rotated and offset), since a CRC over data that embeds
    /// CRCs is weak.
    fn unmask(masked: u32) -> u32 {
        masked.wrapping_sub(0xa282_ead8).rotate_left(15)
    }

    /// CRC32C (Castagnoli), table-driven: a damaged log is read once, so speed matters little.
    fn crc32c(data: &[u8]) -> u32 {
        const TABLE: [u32; 256] = {
            let mut table = [0u32; 256];
            let mut i = 0;
            while i < 256 {
                let mut c = i as u32;
                let mut k = 0;
                while k < 8 {
                    c = if c & 1 != 0 {
                        (c >> 1) ^ 0x82f6_3b78
                    } else {
                        c >> 1
                    };
                    k += 1;
                }
                table[i] = c;
                i += 1;
            }
            table
        };
        !data.iter().fold(!0u32, |c, &b| {
            TABLE[((c ^ u32::from(b)) & 0xff) as usize] ^ (c >> 8)
        })
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        #[test]
        fn crc32c_matches_the_standard_check_value() {
            assert_eq!(crc32c(b"123456789"), 0xe306_9283);
        }

        /// One physical record of type `kind` as RocksDB writes it: header, then payload.
        fn fragment(kind: u8, payload: &[u8]) -> Vec<u8> {
            let mut crc_input = vec![kind];
            crc_input.extend_from_slice(payload);
            let crc = crc32c(&crc_input);
            let masked = crc.rotate_right(15).wrapping_add(0xa282_ead8);
            let mut out = masked.to_le_bytes().to_vec();
            out.extend_from_slice(&(payload.len() as u16).to_le_bytes());
            out.push(kind);
            out.extend_from_slice(payload);
            out
        }

        /// A whole record in one fragment.
        fn record(payload: &[u8]) -> Vec<u8> {
            fragment(1, payload)
        }

        #[test]
        fn scan_finds_each_kind_of_damage() {
            let mut log = record(b"first record");
            log.extend(record(b"second record"));
            assert_eq!(scan(&log), None);
            let mut flipped = log.clone();
            flipped[10] ^= 0xff;
            assert_eq!(scan(&flipped), Some(Damage::Checksum(0)));
            let second = record(b"first record").len() as u64;
            assert_eq!(
                scan(&log[..log.len() - 3]),
                Some(Damage::Incomplete(second))
            );
            assert_eq!(
                scan(&log[..second as usize + 3]),
                Some(Damage::Incomplete(second))
            );
            let mut long = log.clone();
            long[second as usize + 4] = 0xff;
            assert_eq!(scan(&long), Some(Damage::Incomplete(second)));
            // A length past the block with more blocks after it is plain damage.
            long[second as usize + 5] = 0xff;
            long.resize(BLOCK + 100, 0);
            assert_eq!(scan(&long), Some(Damage::Length(second)));
        }

        #[test]
        fn a_record_over_two_blocks_is_whole_only_with_its_last_fragment() {
            let mut log = fragment(2, &[7; BLOCK - HEADER]);
            log.extend(fragment(4, &[8; 300]));
            log.extend(record(b"after"));
            assert_eq!(scan(&log), None);
            // Cut between the fragments, or inside the last one: the record counts from its
            // first fragment, at byte 0.
            assert_eq!(scan(&log[..BLOCK]), Some(Damage::Incomplete(0)));
            assert_eq!(scan(&log[..BLOCK + 100]), Some(Damage::Incomplete(0)));
            let mut flipped = log.clone();
            flipped[BLOCK + 50] ^= 1;
            assert_eq!(scan(&flipped), Some(Damage::Checksum(BLOCK as u64)));
        }
    }
}

/// Writes that become visible together when committed.
pub struct Batch<'a> {
    store: &'a Store,
    batch: WriteBatch,
    /// Key and value block writes (keys first), ingested as SST files at the commit.
    blocks: [SstWrites<12>; 2],
    /// Query sample rows, ingested as an SST file at the commit as blocks are.
    queries: SstWrites<10>,
}

/// One family's writes of f16 rows in a batch, keyed by `N` bytes: puts sorted by key (an SST
/// file's order; a later put of the same key replaces an earlier one) and range deletions.
struct SstWrites<const N: usize> {
    puts: BTreeMap<[u8; N], Vec<f16>>,
    deletes: Vec<([u8; N], [u8; N])>,
}

impl<const N: usize> Default for SstWrites<N> {
    fn default() -> Self {
        Self {
            puts: BTreeMap::new(),
            deletes: Vec::new(),
        }
    }
}

impl std::fmt::Debug for Batch<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Batch")
            .field("writes", &self.batch.len())
            .finish()
    }
}

impl Batch<'_> {
    /// Writes a corpus's manifest (the commit point).
    pub fn put_manifest(&mut self, manifest: &CorpusManifest) -> Result<()> {
        let key = format!("{CORPUS_PREFIX}{}", manifest.name);
        self.batch
            .put_cf(self.store.cf("meta")?, key.as_bytes(), to_json(manifest)?);
        Ok(())
    }

    /// Writes a complete document's record.
    pub fn put_document(&mut self, corpus: u32, record: &DocumentRecord) -> Result<()> {
        self.batch.put_cf(
            self.store.cf("docs")?,
            pair_key(corpus, record.number as u32),
            to_json(record)?,
        );
        Ok(())
    }

    /// Writes a token block (all of its tokens so far).
    pub fn put_tokens(&mut self, corpus: u32, block: usize, ids: &[u32]) -> Result<()> {
        let bytes: Vec<u8> = ids.iter().flat_map(|t| t.to_le_bytes()).collect();
        self.batch.put_cf(
            self.store.cf("tokens")?,
            pair_key(corpus, block as u32),
            bytes,
        );
        Ok(())
    }

    /// Writes a key or value block (all of its rows so far).
    ///
    /// Blocks bypass the write-ahead log: [`Store::commit`] ingests them as SST files, and
    /// they are durable and visible *before* the batch's other writes commit. That is safe
    /// because readers trust the manifest's token count and nothing past it: a crash between
    /// the two leaves blocks (or rows of a rewritten last block) that no manifest counts
    /// yet, and the resumed ingest writes them again, bit for bit.
    pub fn put_block(&mut self, kv: Kv, key: BlockKey, rows: Vec<f16>) {
        self.blocks[kv as usize].puts.insert(key.bytes(), rows);
    }

    /// Writes the sampled queries of one position of a layer, `[n_heads, head_dim]` f16 (a
    /// resumed ingest writes the same bytes again).
    ///
    /// Like [`Batch::put_block`], ingested as an SST file before the batch's other writes
    /// commit, for the same reason it is safe: [`Store::query_sample`] reads no position at
    /// or past the manifest's token count.
    pub fn put_queries(&mut self, key: QueryKey, queries: &[f16]) {
        self.queries.puts.insert(key.bytes(), queries.to_vec());
    }

    /// Writes one saved index.
    pub fn put_index(&mut self, key: IndexKey, bytes: &[u8]) -> Result<()> {
        self.batch
            .put_cf(self.store.cf("index")?, key.bytes(), bytes);
        Ok(())
    }

    /// Deletes one saved index.
    pub fn delete_index(&mut self, key: IndexKey) -> Result<()> {
        self.batch.delete_cf(self.store.cf("index")?, key.bytes());
        Ok(())
    }

    /// Takes back this batch's puts of blocks `blocks` of one layer and KV head (keys and
    /// values): they will not be written.
    pub fn forget_blocks(&mut self, corpus: u32, layer: usize, head: usize, blocks: Range<usize>) {
        let key = |block: usize| BlockKey::new(corpus, layer, head, block).bytes();
        for writes in &mut self.blocks {
            let mut from = writes.puts.split_off(&key(blocks.start));
            let mut after = from.split_off(&key(blocks.end));
            writes.puts.append(&mut after);
        }
    }

    /// Deletes blocks `blocks` of one layer and KV head (keys and values).
    ///
    /// Like [`Batch::put_block`], applied before the batch's other writes commit: delete only
    /// blocks that the manifest already committed no longer reads.
    pub fn delete_blocks(
        &mut self,
        corpus: u32,
        layer: usize,
        head: usize,
        blocks: Range<usize>,
    ) -> Result<()> {
        if blocks.is_empty() {
            return Ok(());
        }
        let key = |block: usize| BlockKey::new(corpus, layer, head, block);
        for kv in [Kv::Keys, Kv::Values] {
            self.blocks[kv as usize]
                .deletes
                .push((key(blocks.start).bytes(), key(blocks.end).bytes()));
        }
        Ok(())
    }
}

fn json<T: serde::de::DeserializeOwned>(bytes: &[u8], what: &str) -> Result<T> {
    serde_json::from_slice(bytes).map_err(|e| Error::Corrupt(format!("{what} does not parse: {e}")))
}

fn to_json<T: Serialize>(value: &T) -> Result<Vec<u8>> {
    serde_json::to_vec(value).map_err(|e| Error::Corrupt(format!("cannot encode: {e}")))
}

/// Checks a corpus name: 1 to 64 of `[A-Za-z0-9._-]`, starting with a letter or digit (so
/// names are safe in paths, URLs and keys).
pub fn validate_corpus_name(name: &str) -> Result<()> {
    let ok = !name.is_empty()
        && name.len() <= 64
        && name
            .chars()
            .next()
            .is_some_and(|c| c.is_ascii_alphanumeric())
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'));
    if ok {
        Ok(())
    } else {
        Err(Error::InvalidCorpusName {
            name: name.to_string(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The fast encoding is the store's documented layout, f16 little-endian, on any target,
    /// and decodes back to the same values.
    #[test]
    fn f16_blocks_are_little_endian_and_round_trip() -> Result<()> {
        let values: Vec<f16> = [0.0f32, -0.0, 1.5, -2.25, 65504.0, 6.1e-5, f32::INFINITY]
            .iter()
            .map(|&x| f16::from_f32(x))
            .collect();
        let bytes = encode_f16(&values);
        let expected: Vec<u8> = values
            .iter()
            .flat_map(|v| v.to_bits().to_le_bytes())
            .collect();
        assert_eq!(bytes, expected);
        let decoded = decode_f16(&bytes)?;
        let widened: Vec<f32> = values.iter().map(|v| v.to_f32()).collect();
        assert_eq!(decoded, widened);
        Ok(())
    }
}
