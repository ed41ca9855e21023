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
//!
//! Blocks hold `block_size` consecutive tokens (the last one of a corpus may be partial and
//! is rewritten whole when tokens are appended). Big-endian keys keep a corpus's blocks in
//! order and let one range delete drop a corpus. Every ingest step is one atomic write batch
//! whose manifest update is the commit point: readers trust the manifest's token count and
//! nothing past it.

use std::ops::Range;
use std::path::{Path, PathBuf};

use half::f16;
use rocksdb::{ColumnFamilyDescriptor, IteratorMode, Options, WriteBatch, WriteOptions, DB};
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// The on-disk format this build reads and writes.
pub const FORMAT_VERSION: u32 = 1;

/// Tokens per key/value block unless a corpus says otherwise.
pub const DEFAULT_BLOCK_SIZE: usize = 64;

/// Column families, in the order they are opened.
const FAMILIES: [&str; 6] = ["meta", "docs", "tokens", "keys", "values", "index"];

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

/// What a corpus keeps of one layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "kind")]
pub enum StoredLayer {
    /// Every token's keys and values (the layer attends to everything: a retrieval layer).
    All,
    /// Only the last `keep` tokens (a sliding-window layer never looks further back).
    Last {
        /// Tokens kept.
        keep: usize,
    },
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
    pub layers: Vec<StoredLayer>,
    /// Index specs queries may use (the first is the default).
    pub indexes: Vec<String>,
    /// Committed tokens: the corpus's context is tokens `0..tokens`.
    pub tokens: usize,
    /// Complete documents.
    pub documents: usize,
    /// A document whose ingest was interrupted, if any.
    pub pending: Option<PendingDocument>,
}

impl CorpusManifest {
    /// Layers that store every token (retrieval layers), in order.
    pub fn retrieval_layers(&self) -> Vec<usize> {
        (0..self.layers.len())
            .filter(|&l| self.layers[l] == StoredLayer::All)
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
            Some(StoredLayer::Last { keep }) => tokens.saturating_sub(*keep)..tokens,
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
    fn bytes(&self) -> [u8; 12] {
        let mut k = [0u8; 12];
        k[..4].copy_from_slice(&self.corpus.to_be_bytes());
        k[4..6].copy_from_slice(&self.layer.to_be_bytes());
        k[6..8].copy_from_slice(&self.head.to_be_bytes());
        k[8..].copy_from_slice(&self.block.to_be_bytes());
        k
    }
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

/// Encodes f32 rows as f16 little-endian bytes (rounding to nearest).
pub fn encode_f16(values: &[f32]) -> Vec<u8> {
    values
        .iter()
        .flat_map(|v| f16::from_f32(*v).to_le_bytes())
        .collect()
}

/// Decodes f16 little-endian bytes into f32.
pub fn decode_f16(bytes: &[u8]) -> Result<Vec<f32>> {
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

/// One RocksDB database holding any number of corpora.
pub struct Store {
    db: DB,
    path: PathBuf,
    /// Holds a secondary instance's own files while it is open.
    secondary: Option<tempfile::TempDir>,
    /// Whether this handle wrote the owner note (removed again on drop).
    owner_note: bool,
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
    pub fn open(path: impl AsRef<Path>, access: Access) -> Result<Self> {
        let path = path.as_ref().to_path_buf();
        if !Self::exists(&path) && (access == Access::Read || path.is_file()) {
            return Err(Error::StoreMissing { path });
        }
        let mut opts = Options::default();
        opts.create_if_missing(true);
        opts.create_missing_column_families(true);
        opts.set_compression_type(rocksdb::DBCompressionType::Lz4);
        opts.set_keep_log_file_num(4);
        let families = FAMILIES
            .iter()
            .map(|name| ColumnFamilyDescriptor::new(*name, Options::default()));
        let (db, secondary) = match access {
            Access::Write => {
                let db = DB::open_cf_descriptors(&opts, &path, families).map_err(|e| {
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
                // We hold the lock, so a note left by an owner that died is stale.
                let _ = std::fs::remove_file(path.join(OWNER_FILE));
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
                )?;
                (db, Some(dir))
            }
        };
        let store = Self {
            db,
            path,
            secondary,
            owner_note: false,
        };
        match store.record()? {
            Some(r) if r.format_version != FORMAT_VERSION => Err(Error::FormatVersion {
                path: store.path.clone(),
                found: r.format_version,
                expected: FORMAT_VERSION,
            }),
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

    /// Where the store lives.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Says who holds this writer (e.g. "a kvdb server (pid 7, http://127.0.0.1:8080)"), so
    /// that another writer's [`Error::StoreOwned`] names it; the note goes when the store is
    /// dropped.
    pub fn claim(&mut self, owner: &str) -> Result<()> {
        if self.secondary.is_some() {
            return Err(Error::Query(
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
        layers: Vec<StoredLayer>,
        block_size: usize,
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
        for family in ["docs", "tokens", "keys", "values", "index"] {
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
        let (b, d) = (manifest.block_size, manifest.model.head_dim);
        let mut out = Vec::with_capacity(range.len() * d);
        let mut block = range.start / b;
        while block * b < range.end {
            let key = BlockKey {
                corpus: manifest.id,
                layer: layer as u16,
                head: head as u16,
                block: block as u32,
            };
            let data = self.block(kv, key)?.ok_or_else(|| {
                Error::Corrupt(format!(
                    "{kv:?} block {block} of layer {layer} head {head} is missing"
                ))
            })?;
            let lo = range.start.max(block * b) - block * b;
            let hi = range.end - block * b;
            let hi = hi.min(b);
            if data.len() < hi * d {
                return Err(Error::Corrupt(format!(
                    "{kv:?} block {block} of layer {layer} head {head} is short"
                )));
            }
            out.extend_from_slice(&data[lo * d..hi * d]);
            block += 1;
        }
        Ok(out)
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
        }
    }

    /// Applies a batch atomically and durably (synced to disk): all of it or none of it.
    pub fn commit(&self, batch: Batch<'_>) -> Result<()> {
        let mut opts = WriteOptions::default();
        opts.set_sync(true);
        self.db.write_opt(batch.batch, &opts)?;
        Ok(())
    }
}

/// Writes that become visible together when committed.
pub struct Batch<'a> {
    store: &'a Store,
    batch: WriteBatch,
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

    /// Writes a key or value block (all of its rows so far), rounding to f16.
    pub fn put_block(&mut self, kv: Kv, key: BlockKey, rows: &[f32]) -> Result<()> {
        self.batch
            .put_cf(self.store.cf(kv.family())?, key.bytes(), encode_f16(rows));
        Ok(())
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

    /// Deletes blocks `blocks` of one layer and KV head (keys and values).
    pub fn delete_blocks(
        &mut self,
        corpus: u32,
        layer: usize,
        head: usize,
        blocks: Range<usize>,
    ) -> Result<()> {
        let key = |block: usize| BlockKey {
            corpus,
            layer: layer as u16,
            head: head as u16,
            block: block as u32,
        };
        for kv in [Kv::Keys, Kv::Values] {
            self.batch.delete_range_cf(
                self.store.cf(kv.family())?,
                key(blocks.start).bytes(),
                key(blocks.end).bytes(),
            );
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
