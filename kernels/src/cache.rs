//! Keys and values in pinned host memory ([`HostKv`]) behind a GPU cache of hot blocks
//! ([`BlockCache`]): the path for corpora larger than the GPU's memory.

use std::collections::HashMap;

use cudarc::driver::sys::{
    cuMemHostGetDevicePointer_v2, CU_MEMHOSTALLOC_DEVICEMAP, CU_MEMHOSTALLOC_WRITECOMBINED,
};
use cudarc::driver::{CudaSlice, LaunchConfig, PinnedHostSlice, PushKernelArg};
use lru::LruCache;

use crate::attention::{KvRows, Selected};
use crate::buffers::{flatten, write_into, Csr};
use crate::error::{driver, length, KernelError, Result};
use crate::gpu::{Gpu, KvElement};

/// Threads per block of the fill kernel.
const FILL_THREADS: u32 = 256;

/// Keys and values of one layer in pinned host memory, mapped into the GPU's address space,
/// in blocks of `block_tokens` tokens: `[kv_heads, blocks * block_tokens, head_dim]` each,
/// the last block of a head padded with zeros.
pub struct HostKv<T> {
    keys: PinnedHostSlice<T>,
    values: PinnedHostSlice<T>,
    /// Device addresses of `keys` and `values`.
    device: (u64, u64),
    kv_heads: usize,
    tokens: usize,
    head_dim: usize,
    block_tokens: usize,
}

impl<T> std::fmt::Debug for HostKv<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostKv")
            .field("kv_heads", &self.kv_heads)
            .field("tokens", &self.tokens)
            .field("head_dim", &self.head_dim)
            .field("block_tokens", &self.block_tokens)
            .finish_non_exhaustive()
    }
}

impl<T: KvElement> HostKv<T> {
    /// Copies keys and values `[kv_heads, tokens, head_dim]` into pinned host memory, in
    /// blocks of `block_tokens` (the store's block size).
    pub fn new(
        gpu: &Gpu,
        keys: &[T],
        values: &[T],
        kv_heads: usize,
        head_dim: usize,
        block_tokens: usize,
    ) -> Result<Self> {
        let row = kv_heads * head_dim;
        if row == 0 || block_tokens == 0 || !keys.len().is_multiple_of(row) {
            return Err(KernelError::Length {
                what: "host keys (whole [kv_heads, tokens, head_dim], block_tokens > 0)",
                expected: keys.len().next_multiple_of(row.max(1)),
                found: keys.len(),
            });
        }
        length("host values", keys.len(), values.len())?;
        let tokens = keys.len() / row;
        if u32::try_from(tokens).is_err() {
            return Err(KernelError::TooLarge {
                what: "tokens",
                value: tokens,
            });
        }
        let blocks = tokens.div_ceil(block_tokens);
        // The fill kernel numbers blocks of all heads with a u32.
        if u32::try_from(kv_heads * blocks).is_err() {
            return Err(KernelError::TooLarge {
                what: "host blocks",
                value: kv_heads * blocks,
            });
        }
        let padded = blocks * block_tokens;
        let copy = |data: &[T]| -> Result<(PinnedHostSlice<T>, u64)> {
            let len = padded * row;
            // cudarc asserts instead of failing on sizes past isize::MAX bytes.
            if len
                .checked_mul(size_of::<T>())
                .is_none_or(|b| b > isize::MAX as usize)
            {
                return Err(KernelError::TooLarge {
                    what: "pinned host bytes",
                    value: len,
                });
            }
            // Mapped, so the fill kernel reads it directly; write-combined, since the CPU
            // only writes it and the GPU reads it over PCIe without snooping caches.
            let flags = CU_MEMHOSTALLOC_DEVICEMAP | CU_MEMHOSTALLOC_WRITECOMBINED;
            // Safety: every element is written below before anything reads it.
            let mut pinned = unsafe { gpu.context().alloc_pinned_with_flags::<T>(len, flags) }
                .map_err(driver("allocating pinned host memory"))?;
            let slice = pinned
                .as_mut_slice()
                .map_err(driver("waiting for pinned host memory"))?;
            for (to, from) in slice
                .chunks_exact_mut(padded * head_dim)
                .zip(data.chunks_exact(tokens * head_dim))
            {
                to[..from.len()].copy_from_slice(from);
                to[from.len()..].fill(T::default());
            }
            let host = slice.as_mut_ptr().cast();
            let mut device = 0u64;
            // Safety: `host` is the start of a live allocation made with DEVICEMAP.
            unsafe { cuMemHostGetDevicePointer_v2(&mut device, host, 0) }
                .result()
                .map_err(driver("mapping pinned host memory"))?;
            Ok((pinned, device))
        };
        let (keys, device_keys) = copy(keys)?;
        let (values, device_values) = copy(values)?;
        Ok(Self {
            keys,
            values,
            device: (device_keys, device_values),
            kv_heads,
            tokens,
            head_dim,
            block_tokens,
        })
    }
}

impl<T> HostKv<T> {
    /// Blocks per KV head.
    fn blocks(&self) -> usize {
        self.tokens.div_ceil(self.block_tokens)
    }

    /// Bytes held, keys and values together.
    pub fn bytes(&self) -> usize {
        self.keys.num_bytes() + self.values.num_bytes()
    }
}

/// Size of a [`BlockCache`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CacheConfig {
    /// GPU memory for cached blocks (keys and values), in bytes.
    pub capacity_bytes: usize,
    /// Tokens per block: the store's block size.
    pub block_tokens: usize,
}

impl Default for CacheConfig {
    /// 1 GiB of blocks of 64 tokens.
    fn default() -> Self {
        Self {
            capacity_bytes: 1 << 30,
            block_tokens: 64,
        }
    }
}

/// Block lookups of a [`BlockCache`] so far: a block is counted once per step that selects
/// it, as a hit when it was already on the GPU.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CacheStats {
    /// Blocks found on the GPU.
    pub hits: u64,
    /// Blocks copied from host memory.
    pub misses: u64,
    /// Bytes copied from host memory.
    pub bytes_copied: u64,
}

impl CacheStats {
    /// `hits / (hits + misses)`, 0 before any lookup.
    pub fn hit_ratio(&self) -> f64 {
        let total = self.hits + self.misses;
        if total == 0 {
            0.0
        } else {
            self.hits as f64 / total as f64
        }
    }
}

/// A GPU cache of hot blocks of a [`HostKv`], least recently used evicted first.
///
/// [`BlockCache::gather`] makes the blocks of a step's selected ids resident (copying the
/// missing ones in one kernel launch straight from mapped host memory) and returns their
/// rows for [`crate::retrieval_attention`].
pub struct BlockCache<T> {
    keys: CudaSlice<T>,
    values: CudaSlice<T>,
    slots: usize,
    block_tokens: usize,
    head_dim: usize,
    /// (KV head, block) → slot, in recency order.
    lru: LruCache<(u32, u32), u32>,
    free: Vec<u32>,
    /// The last step's rows, one list per KV head.
    rows: Csr,
    /// The last step's copies: [host block, slot] pairs.
    jobs: CudaSlice<u32>,
    stats: CacheStats,
}

impl<T> std::fmt::Debug for BlockCache<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BlockCache")
            .field("slots", &self.slots)
            .field("block_tokens", &self.block_tokens)
            .field("head_dim", &self.head_dim)
            .field("resident", &self.lru.len())
            .field("stats", &self.stats)
            .finish_non_exhaustive()
    }
}

impl<T: KvElement> BlockCache<T> {
    /// An empty cache of `config.capacity_bytes` for rows of `head_dim`.
    pub fn new(gpu: &Gpu, head_dim: usize, config: CacheConfig) -> Result<Self> {
        let block_bytes = 2 * config.block_tokens * head_dim * size_of::<T>();
        if block_bytes == 0 || !head_dim.is_multiple_of(8) {
            return Err(KernelError::Unsupported {
                what: "block of tokens × head dimension",
                value: config.block_tokens * head_dim,
                supported: "block_tokens > 0 and head_dim a multiple of 8",
            });
        }
        let slots = config.capacity_bytes / block_bytes;
        if slots == 0 || u32::try_from(slots * config.block_tokens).is_err() {
            return Err(KernelError::TooLarge {
                what: "cache slots (or zero)",
                value: slots,
            });
        }
        let elements = slots * config.block_tokens * head_dim;
        Ok(Self {
            keys: gpu.zeros(elements)?,
            values: gpu.zeros(elements)?,
            slots,
            block_tokens: config.block_tokens,
            head_dim,
            lru: LruCache::unbounded(),
            free: (0..slots as u32).rev().collect(),
            rows: Csr::from_lists::<&[u32]>(gpu, &[])?,
            jobs: gpu.zeros(2)?,
            stats: CacheStats::default(),
        })
    }

    /// Makes the blocks of `selected` (token ids of `host`, one list per KV head, as for
    /// [`Selected::resident`]) resident and returns their rows in the cache. Fails, leaving
    /// the cache as it was, when an id is out of range or the step needs more blocks than
    /// the cache holds.
    pub fn gather<'a, L: AsRef<[u32]>>(
        &'a mut self,
        gpu: &Gpu,
        host: &HostKv<T>,
        selected: &[L],
    ) -> Result<Selected<'a, T>> {
        if (host.block_tokens, host.head_dim) != (self.block_tokens, self.head_dim) {
            return Err(KernelError::CacheMismatch {
                host: format!("blocks of {} × {}", host.block_tokens, host.head_dim),
                cache: format!("blocks of {} × {}", self.block_tokens, self.head_dim),
            });
        }
        length(
            "selected lists (one per KV head)",
            host.kv_heads,
            selected.len(),
        )?;
        let bt = self.block_tokens as u32;
        // The step's distinct blocks, in first-seen order.
        let mut step: HashMap<(u32, u32), u32> = HashMap::new();
        let mut order = Vec::new();
        for (h, ids) in selected.iter().enumerate() {
            for &id in ids.as_ref() {
                if id as usize >= host.tokens {
                    return Err(KernelError::OutOfRange {
                        what: "selected token id",
                        index: id.into(),
                        len: host.tokens as u64,
                    });
                }
                let key = (h as u32, id / bt);
                step.entry(key).or_insert_with(|| {
                    order.push(key);
                    u32::MAX
                });
            }
        }
        if order.len() > self.slots {
            return Err(KernelError::CacheTooSmall {
                needed: order.len(),
                slots: self.slots,
            });
        }
        // Hits first, so that they are the most recent and no eviction below takes one.
        for key in &order {
            if let Some(&slot) = self.lru.get(key) {
                step.insert(*key, slot);
                self.stats.hits += 1;
            }
        }
        let mut jobs = Vec::new();
        for key in &order {
            if step[key] != u32::MAX {
                continue;
            }
            // There is a free slot or a block this step does not use: the step needs at
            // most `slots` blocks and its hits are the most recent.
            let Some(slot) = self
                .free
                .pop()
                .or_else(|| self.lru.pop_lru().map(|(_, s)| s))
            else {
                self.clear();
                return Err(KernelError::CacheTooSmall {
                    needed: order.len(),
                    slots: self.slots,
                });
            };
            self.lru.put(*key, slot);
            step.insert(*key, slot);
            jobs.extend([key.0 * host.blocks() as u32 + key.1, slot]);
        }
        self.stats.misses += (jobs.len() / 2) as u64;
        let block_bytes = 2 * self.block_tokens * self.head_dim * size_of::<T>();
        self.stats.bytes_copied += (jobs.len() / 2 * block_bytes) as u64;

        let rows: Vec<Vec<u32>> = selected
            .iter()
            .enumerate()
            .map(|(h, ids)| {
                let ids = ids.as_ref().iter();
                ids.map(|&id| step[&(h as u32, id / bt)] * bt + id % bt)
                    .collect()
            })
            .collect();
        let (offsets, items) = flatten(&rows)?;
        let copied =
            self.rows
                .rewrite(gpu, &offsets, &items)
                .and_then(|()| match jobs.is_empty() {
                    true => Ok(()),
                    false => self.fill(gpu, host, &jobs),
                });
        if let Err(e) = copied {
            // The blocks just claimed may not have arrived: forget them all.
            self.clear();
            return Err(e);
        }
        Ok(Selected {
            rows: KvRows {
                keys: &self.keys,
                values: &self.values,
                head_stride: 0,
                rows: self.slots * self.block_tokens,
                head_dim: self.head_dim,
            },
            lists: &self.rows,
        })
    }

    /// Copies the blocks of `jobs` from host memory into their slots, in one launch.
    fn fill(&mut self, gpu: &Gpu, host: &HostKv<T>, jobs: &[u32]) -> Result<()> {
        write_into(gpu, &mut self.jobs, jobs)?;
        let function = gpu.fill_kernel()?;
        let vecs = (self.block_tokens * self.head_dim * size_of::<T>() / 16) as u32;
        let (pool_keys, pool_values) = (gpu.address(&self.keys), gpu.address(&self.values));
        let jobs_address = gpu.address(&self.jobs);
        let config = LaunchConfig {
            grid_dim: ((jobs.len() / 2) as u32, 1, 1),
            block_dim: (FILL_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut builder = gpu.stream().launch_builder(&function);
        builder
            .arg(&host.device.0)
            .arg(&host.device.1)
            .arg(&pool_keys)
            .arg(&pool_values)
            .arg(&jobs_address)
            .arg(&vecs);
        // Safety: `fill_slots(host_k, host_v, pool_k, pool_v, jobs, vecs)`; every job names a
        // block of `host` and a slot below `self.slots`, each `vecs` 16-byte vectors long.
        unsafe { builder.launch(config) }.map_err(driver("launching fill_slots"))?;
        Ok(())
    }
}

impl<T> BlockCache<T> {
    /// Lookups so far.
    pub fn stats(&self) -> CacheStats {
        self.stats
    }

    /// Forgets every block (the next step starts cold); the statistics stay.
    pub fn clear(&mut self) {
        self.lru.clear();
        self.free = (0..self.slots as u32).rev().collect();
    }

    /// Number of blocks the cache holds.
    pub fn slots(&self) -> usize {
        self.slots
    }
}
