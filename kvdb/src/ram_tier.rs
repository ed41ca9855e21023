//! The RAM tier: query-time reads of key and value blocks through an LRU with a byte budget.
//!
//! Decoded f32 blocks are shared (`Arc`) between concurrent queries. When the retrieval
//! layers' keys and values exceed the budget, the least recently used blocks are evicted and
//! read again from the store when next needed; answers do not change, only speed.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use lru::LruCache;

use crate::error::{Error, Result};
use crate::store::{BlockKey, CorpusManifest, Kv, Store};

/// Counters of a RAM tier.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TierStats {
    /// Block reads served from memory.
    pub hits: u64,
    /// Block reads that went to the store.
    pub misses: u64,
    /// Blocks evicted to stay within the budget.
    pub evictions: u64,
    /// Bytes of blocks held now.
    pub resident_bytes: u64,
}

/// A decoded block, shared between readers.
type Block = Arc<Vec<f32>>;

struct Cache {
    blocks: LruCache<(Kv, BlockKey), Arc<Vec<f32>>>,
    bytes: usize,
}

/// Reads one corpus's key/value rows by token id through a byte-budgeted block cache.
pub(crate) struct RamTier {
    store: Arc<Store>,
    corpus: u32,
    block_size: usize,
    head_dim: usize,
    tokens: usize,
    budget: usize,
    cache: Mutex<Cache>,
    hits: AtomicU64,
    misses: AtomicU64,
    evictions: AtomicU64,
}

impl std::fmt::Debug for RamTier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RamTier")
            .field("corpus", &self.corpus)
            .field("budget", &self.budget)
            .field("stats", &self.stats())
            .finish()
    }
}

impl RamTier {
    /// A tier over `manifest`'s committed tokens holding at most `budget` bytes of decoded
    /// blocks (at least one block is always held, so that a read can complete).
    pub(crate) fn new(store: Arc<Store>, manifest: &CorpusManifest, budget: usize) -> Self {
        Self {
            store,
            corpus: manifest.id,
            block_size: manifest.block_size,
            head_dim: manifest.model.head_dim,
            tokens: manifest.tokens,
            budget,
            cache: Mutex::new(Cache {
                blocks: LruCache::unbounded(),
                bytes: 0,
            }),
            hits: AtomicU64::new(0),
            misses: AtomicU64::new(0),
            evictions: AtomicU64::new(0),
        }
    }

    /// The counters so far.
    pub(crate) fn stats(&self) -> TierStats {
        let resident = self.cache.lock().map(|c| c.bytes).unwrap_or(0);
        TierStats {
            hits: self.hits.load(Ordering::Relaxed),
            misses: self.misses.load(Ordering::Relaxed),
            evictions: self.evictions.load(Ordering::Relaxed),
            resident_bytes: resident as u64,
        }
    }

    fn block(&self, kv: Kv, key: BlockKey) -> Result<Arc<Vec<f32>>> {
        if let Ok(mut cache) = self.cache.lock() {
            if let Some(b) = cache.blocks.get(&(kv, key)) {
                self.hits.fetch_add(1, Ordering::Relaxed);
                return Ok(b.clone());
            }
        }
        self.misses.fetch_add(1, Ordering::Relaxed);
        let data = self.store.block(kv, key)?.ok_or_else(|| {
            Error::Corrupt(format!(
                "{kv:?} block {} of layer {} head {} is missing",
                key.block, key.layer, key.head
            ))
        })?;
        let data = Arc::new(data);
        let size = data.len() * std::mem::size_of::<f32>();
        // A poisoned lock only means a reader panicked; the cache itself is still consistent.
        let mut cache = self.cache.lock().unwrap_or_else(|p| p.into_inner());
        if cache.blocks.put((kv, key), data.clone()).is_none() {
            cache.bytes += size;
        }
        while cache.bytes > self.budget && cache.blocks.len() > 1 {
            if let Some((_, old)) = cache.blocks.pop_lru() {
                cache.bytes -= old.len() * std::mem::size_of::<f32>();
                self.evictions.fetch_add(1, Ordering::Relaxed);
            }
        }
        Ok(data)
    }

    /// Appends the rows of `ids` (token ids below the corpus length) of one layer and KV head
    /// to `keys` (pre-RoPE) and `values`, `[ids, head_dim]` each.
    pub(crate) fn gather(
        &self,
        layer: usize,
        head: usize,
        ids: &[u32],
        keys: &mut Vec<f32>,
        values: &mut Vec<f32>,
    ) -> Result<()> {
        let (b, d) = (self.block_size, self.head_dim);
        keys.reserve(ids.len() * d);
        values.reserve(ids.len() * d);
        let mut current: Option<(usize, Block, Block)> = None;
        for &id in ids {
            let id = id as usize;
            if id >= self.tokens {
                return Err(Error::Internal(format!(
                    "token {id} is beyond the corpus's {} tokens",
                    self.tokens
                )));
            }
            let block = id / b;
            let (k, v) = match &current {
                Some((cb, k, v)) if *cb == block => (k.clone(), v.clone()),
                _ => {
                    let key = BlockKey::new(self.corpus, layer, head, block);
                    let k = self.block(Kv::Keys, key)?;
                    let v = self.block(Kv::Values, key)?;
                    current = Some((block, k.clone(), v.clone()));
                    (k, v)
                }
            };
            let row = (id - block * b) * d;
            if k.len() < row + d || v.len() < row + d {
                return Err(Error::Corrupt(format!("block {block} is short")));
            }
            keys.extend_from_slice(&k[row..row + d]);
            values.extend_from_slice(&v[row..row + d]);
        }
        Ok(())
    }
}
