//! Keys and values in pinned host memory ([`HostKv`]) behind a GPU cache of hot blocks
//! ([`BlockCache`]): the path for corpora larger than the GPU's memory.

use cudarc::driver::sys::{
    cuMemHostGetDevicePointer_v2, CU_MEMHOSTALLOC_DEVICEMAP, CU_MEMHOSTALLOC_WRITECOMBINED,
};
use cudarc::driver::{CudaSlice, LaunchConfig, PinnedHostSlice, PushKernelArg};

use crate::attention::{KvRows, Selected};
use crate::buffers::{write_into, Csr};
use crate::error::{driver, length, KernelError, Result};
use crate::gpu::{Gpu, KvElement};

/// Threads per block of the fill kernel.
const FILL_THREADS: u32 = 256;

/// Keys and values of one layer in pinned host memory, mapped into the GPU's address space,
/// in blocks of `block_tokens` tokens: `[kv_heads, blocks * block_tokens, head_dim]` each,
/// the last block of a head padded with zeros.
pub struct HostKv<T> {
    /// The pinned allocations, owned so that the mapped addresses stay valid as long as
    /// `self`; the GPU reads them through `device`, the CPU never again.
    _keys: PinnedHostSlice<T>,
    _values: PinnedHostSlice<T>,
    /// Device addresses of the keys and values.
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
    /// blocks of `block_tokens` (the store's block size, a power of two).
    pub fn new(
        gpu: &Gpu,
        keys: &[T],
        values: &[T],
        kv_heads: usize,
        head_dim: usize,
        block_tokens: usize,
    ) -> Result<Self> {
        let row = kv_heads * head_dim;
        if row == 0 || !keys.len().is_multiple_of(row) {
            return Err(KernelError::Length {
                what: "host keys (whole [kv_heads, tokens, head_dim])",
                expected: keys.len().next_multiple_of(row.max(1)),
                found: keys.len(),
            });
        }
        // Block numbers come from shifts: a division per selected id was most of the cache's
        // CPU time.
        if !block_tokens.is_power_of_two() {
            return Err(KernelError::Unsupported {
                what: "block_tokens",
                value: block_tokens,
                supported: "powers of two",
            });
        }
        length("host values", keys.len(), values.len())?;
        // The fill kernel copies whole 16-byte vectors.
        if !(block_tokens * head_dim * size_of::<T>()).is_multiple_of(16) {
            return Err(KernelError::Unsupported {
                what: "block of tokens × head dimension",
                value: block_tokens * head_dim,
                supported: "multiples of 8",
            });
        }
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
            _keys: keys,
            _values: values,
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

/// Marks "no slot" and "no block" in the cache's tables.
const NONE: u32 = u32::MAX;

/// Slots in recency order: an intrusive doubly linked list over slot numbers, so that a
/// lookup moves its slot to the front and eviction takes the back, both in O(1).
#[derive(Debug)]
struct Recency {
    prev: Vec<u32>,
    next: Vec<u32>,
    /// Most recently used slot.
    front: u32,
    /// Least recently used slot.
    back: u32,
}

impl Recency {
    fn new(slots: usize) -> Self {
        Self {
            prev: vec![NONE; slots],
            next: vec![NONE; slots],
            front: NONE,
            back: NONE,
        }
    }

    fn unlink(&mut self, slot: u32) {
        let (p, n) = (self.prev[slot as usize], self.next[slot as usize]);
        match p {
            NONE => self.front = n,
            p => self.next[p as usize] = n,
        }
        match n {
            NONE => self.back = p,
            n => self.prev[n as usize] = p,
        }
    }

    fn push_front(&mut self, slot: u32) {
        self.prev[slot as usize] = NONE;
        self.next[slot as usize] = self.front;
        match self.front {
            NONE => self.back = slot,
            f => self.prev[f as usize] = slot,
        }
        self.front = slot;
    }
}

/// A GPU cache of hot blocks of a [`HostKv`] it owns, the least recently used evicted first.
///
/// [`BlockCache::gather`] makes the blocks of a step's selected ids resident (copying the
/// missing ones in one kernel launch straight from mapped host memory) and returns their
/// rows for [`crate::retrieval_attention`]. Its bookkeeping is array lookups (one slot
/// table entry per host block), so it costs the CPU little next to the GPU's work.
pub struct BlockCache<T> {
    host: HostKv<T>,
    keys: CudaSlice<T>,
    values: CudaSlice<T>,
    slots: usize,
    /// Host block (KV head * blocks per head + block) → slot, or NONE.
    slot_of: Vec<u32>,
    /// Slot → host block, or NONE.
    owner: Vec<u32>,
    /// Host block → the last step that selected it (to count each block once a step).
    seen: Vec<u64>,
    recency: Recency,
    free: Vec<u32>,
    step: u64,
    /// The last step's rows, one list per KV head.
    rows: Csr,
    /// The last step's copies: [host block, slot] pairs.
    jobs: CudaSlice<u32>,
    stats: CacheStats,
}

impl<T> std::fmt::Debug for BlockCache<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BlockCache")
            .field("host", &self.host)
            .field("slots", &self.slots)
            .field("free", &self.free.len())
            .field("stats", &self.stats)
            .finish_non_exhaustive()
    }
}

impl<T: KvElement> BlockCache<T> {
    /// An empty cache of `capacity_bytes` of GPU memory in front of `host`.
    pub fn new(gpu: &Gpu, host: HostKv<T>, capacity_bytes: usize) -> Result<Self> {
        let block = host.block_tokens * host.head_dim;
        let slots = capacity_bytes / (2 * block * size_of::<T>());
        if slots == 0 || u32::try_from(slots * host.block_tokens).is_err() {
            return Err(KernelError::TooLarge {
                what: "cache slots (or zero)",
                value: slots,
            });
        }
        let blocks = host.kv_heads * host.blocks();
        Ok(Self {
            keys: gpu.zeros(slots * block)?,
            values: gpu.zeros(slots * block)?,
            slots,
            slot_of: vec![NONE; blocks],
            owner: vec![NONE; slots],
            seen: vec![0; blocks],
            recency: Recency::new(slots),
            free: (0..slots as u32).rev().collect(),
            step: 0,
            rows: Csr::from_lists::<&[u32]>(gpu, &[])?,
            jobs: gpu.zeros(2)?,
            stats: CacheStats::default(),
            host,
        })
    }

    /// Makes the blocks of `selected` (token ids, one list per KV head, as for
    /// [`Selected::resident`]) resident and returns their rows in the cache. Fails, leaving
    /// the cached blocks as they were, when an id is out of range or the step needs more
    /// blocks than the cache holds.
    pub fn gather<'a, L: AsRef<[u32]>>(
        &'a mut self,
        gpu: &Gpu,
        selected: &[L],
    ) -> Result<Selected<'a, T>> {
        let host = &self.host;
        length(
            "selected lists (one per KV head)",
            host.kv_heads,
            selected.len(),
        )?;
        let (shift, blocks) = (host.block_tokens.trailing_zeros(), host.blocks() as u32);
        let mask = host.block_tokens as u32 - 1;
        let block_of = |h: usize, id: u32| (h as u32 * blocks + (id >> shift)) as usize;
        self.step += 1;
        let step = self.step;
        // One pass over the ids: range checks, the step's distinct blocks, and its hits,
        // which become the most recent so that no eviction below takes one.
        let (mut needed, mut hits, mut missing) = (0, 0, Vec::new());
        for (h, ids) in selected.iter().enumerate() {
            for &id in ids.as_ref() {
                if id as usize >= host.tokens {
                    return Err(KernelError::OutOfRange {
                        what: "selected token id",
                        index: id.into(),
                        len: host.tokens as u64,
                    });
                }
                let b = block_of(h, id);
                if self.seen[b] == step {
                    continue;
                }
                self.seen[b] = step;
                needed += 1;
                match self.slot_of[b] {
                    NONE => missing.push(b as u32),
                    slot => {
                        self.recency.unlink(slot);
                        self.recency.push_front(slot);
                        hits += 1;
                    }
                }
            }
        }
        if needed > self.slots {
            return Err(KernelError::CacheTooSmall {
                needed,
                slots: self.slots,
            });
        }
        self.stats.hits += hits;
        // Misses take a free slot or the least recently used one, which this step does not
        // use: the step needs at most `slots` blocks and its hits are the most recent.
        let mut jobs = Vec::with_capacity(2 * missing.len());
        for &b in &missing {
            let slot = match self.free.pop() {
                Some(slot) => slot,
                None => {
                    let slot = self.recency.back;
                    self.recency.unlink(slot);
                    self.slot_of[self.owner[slot as usize] as usize] = NONE;
                    slot
                }
            };
            self.slot_of[b as usize] = slot;
            self.owner[slot as usize] = b;
            self.recency.push_front(slot);
            jobs.extend([b, slot]);
        }
        let misses = jobs.len() / 2;
        self.stats.misses += misses as u64;
        let block_bytes = 2 * host.block_tokens * host.head_dim * size_of::<T>();
        self.stats.bytes_copied += (misses * block_bytes) as u64;

        let mut offsets = Vec::with_capacity(selected.len() + 1);
        let mut rows = Vec::new();
        offsets.push(0u32);
        for (h, ids) in selected.iter().enumerate() {
            let ids = ids.as_ref().iter();
            rows.extend(ids.map(|&id| (self.slot_of[block_of(h, id)] << shift) | (id & mask)));
            offsets.push(rows.len() as u32);
        }
        let copied = self
            .rows
            .rewrite(gpu, &offsets, &rows)
            .and_then(|()| match jobs.is_empty() {
                true => Ok(()),
                false => self.fill(gpu, &jobs),
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
                rows: self.slots * self.host.block_tokens,
                head_dim: self.host.head_dim,
            },
            lists: &self.rows,
            runs: &[],
        })
    }

    /// Copies the blocks of `jobs` from host memory into their slots, in one launch.
    fn fill(&mut self, gpu: &Gpu, jobs: &[u32]) -> Result<()> {
        write_into(gpu, &mut self.jobs, jobs)?;
        let function = gpu.fill_kernel()?;
        let vecs = (self.host.block_tokens * self.host.head_dim * size_of::<T>() / 16) as u32;
        let (pool_keys, pool_values) = (gpu.address(&self.keys), gpu.address(&self.values));
        let jobs_address = gpu.address(&self.jobs);
        let config = LaunchConfig {
            grid_dim: ((jobs.len() / 2) as u32, 1, 1),
            block_dim: (FILL_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut builder = gpu.stream().launch_builder(&function);
        builder
            .arg(&self.host.device.0)
            .arg(&self.host.device.1)
            .arg(&pool_keys)
            .arg(&pool_values)
            .arg(&jobs_address)
            .arg(&vecs);
        // Safety: `fill_slots(host_k, host_v, pool_k, pool_v, jobs, vecs)`; every job names a
        // block of the host buffers and a slot below `self.slots`, each `vecs` 16-byte
        // vectors long.
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
        self.slot_of.fill(NONE);
        self.owner.fill(NONE);
        self.recency = Recency::new(self.slots);
        self.free = (0..self.slots as u32).rev().collect();
    }

    /// Number of blocks the cache holds.
    pub fn slots(&self) -> usize {
        self.slots
    }
}
