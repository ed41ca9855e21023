//! Keys and values in pinned host memory ([`HostKv`]) behind a GPU cache of hot blocks
//! ([`BlockCache`]): the path for corpora larger than the GPU's memory.

use std::marker::PhantomData;
use std::sync::Arc;

use cudarc::driver::sys::{
    cuMemHostGetDevicePointer_v2, CU_MEMHOSTALLOC_DEVICEMAP, CU_MEMHOSTALLOC_WRITECOMBINED,
};
use cudarc::driver::{CudaSlice, LaunchConfig, PinnedHostSlice, PushKernelArg};

use crate::attention::{Buffer, KvRows, Selected, SlotTokens};
use crate::buffers::{write_into, Csr, KvCache};
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
    /// blocks of `block_tokens` (a power of two).
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
        length("host values", keys.len(), values.len())?;
        let tokens = keys.len() / row;
        Self::check(kv_heads, tokens, head_dim, block_tokens)?;
        let (keys_of, values_of) = (keys, values);
        Self::filled(
            gpu,
            (kv_heads, tokens, head_dim),
            block_tokens,
            |head, keys, values| {
                let rows = head * tokens * head_dim..(head + 1) * tokens * head_dim;
                keys.copy_from_slice(&keys_of[rows.clone()]);
                values.copy_from_slice(&values_of[rows]);
                Ok(())
            },
        )
    }

    /// Copies a layer's keys and values from the GPU (`kv`, as attended: keys rotated) into
    /// pinned host memory, in blocks of `block_tokens` (a power of two): what a corpus too
    /// large for the GPU keeps on the host, moved without a detour through pageable memory.
    pub fn from_device(gpu: &Gpu, kv: &KvCache<T>, block_tokens: usize) -> Result<Self> {
        let (kv_heads, tokens, head_dim) = (kv.kv_heads(), kv.tokens(), kv.head_dim());
        Self::check(kv_heads, tokens, head_dim, block_tokens)?;
        let copied = Self::filled(
            gpu,
            (kv_heads, tokens, head_dim),
            block_tokens,
            |h, k, v| {
                let rows = h * tokens * head_dim..(h + 1) * tokens * head_dim;
                let stream = gpu.stream();
                stream
                    .memcpy_dtoh(&kv.keys.slice(rows.clone()), k)
                    .and_then(|()| stream.memcpy_dtoh(&kv.values.slice(rows), v))
                    .map_err(driver("copying keys and values to pinned host memory"))
            },
        )?;
        // The copies are queued on the stream: wait for them before the host memory is used.
        gpu.synchronize()?;
        Ok(copied)
    }

    /// Checks the shape: `kv_heads` heads of `tokens` rows of `head_dim`, in blocks of
    /// `block_tokens` that the fill kernel copies as whole 16-byte vectors.
    fn check(kv_heads: usize, tokens: usize, head_dim: usize, block_tokens: usize) -> Result<()> {
        // Block numbers come from shifts: a division per selected id was most of the cache's
        // CPU time.
        if !block_tokens.is_power_of_two() {
            return Err(KernelError::Unsupported {
                what: "block_tokens",
                value: block_tokens,
                supported: "powers of two",
            });
        }
        // The fill kernel copies whole 16-byte vectors.
        if !(block_tokens * head_dim * size_of::<T>()).is_multiple_of(16) {
            return Err(KernelError::Unsupported {
                what: "block of tokens × head dimension",
                value: block_tokens * head_dim,
                supported: "multiples of 8",
            });
        }
        if u32::try_from(tokens).is_err() {
            return Err(KernelError::TooLarge {
                what: "tokens",
                value: tokens,
            });
        }
        // The fill kernel numbers blocks of all heads with a u32.
        let blocks = kv_heads * tokens.div_ceil(block_tokens);
        if u32::try_from(blocks).is_err() {
            return Err(KernelError::TooLarge {
                what: "host blocks",
                value: blocks,
            });
        }
        Ok(())
    }

    /// Pinned, mapped keys and values of `(kv_heads, tokens, head_dim)` in blocks of
    /// `block_tokens`, each KV head's rows written by `fill(head, keys, values)` and the last
    /// block of each head padded with zeros.
    fn filled(
        gpu: &Gpu,
        (kv_heads, tokens, head_dim): (usize, usize, usize),
        block_tokens: usize,
        mut fill: impl FnMut(usize, &mut [T], &mut [T]) -> Result<()>,
    ) -> Result<Self> {
        let padded = tokens.div_ceil(block_tokens) * block_tokens;
        let (mut keys, device_keys) = pinned::<T>(gpu, kv_heads * padded * head_dim)?;
        let (mut values, device_values) = pinned::<T>(gpu, kv_heads * padded * head_dim)?;
        let waiting = driver("waiting for pinned host memory");
        let (k, v) = (
            keys.as_mut_slice().map_err(waiting)?,
            values
                .as_mut_slice()
                .map_err(driver("waiting for pinned host memory"))?,
        );
        let per_head = padded * head_dim;
        for (head, (k, v)) in k
            .chunks_exact_mut(per_head)
            .zip(v.chunks_exact_mut(per_head))
            .enumerate()
        {
            let (k, k_pad) = k.split_at_mut(tokens * head_dim);
            let (v, v_pad) = v.split_at_mut(tokens * head_dim);
            fill(head, k, v)?;
            k_pad.fill(T::default());
            v_pad.fill(T::default());
        }
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

/// `len` elements of pinned host memory mapped into the GPU's address space, and their device
/// address; the caller writes every element before anything reads them.
fn pinned<T: KvElement>(gpu: &Gpu, len: usize) -> Result<(PinnedHostSlice<T>, u64)> {
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
    // Mapped, so the fill kernel reads it directly; write-combined, since the CPU only writes
    // it and the GPU reads it over PCIe without snooping caches.
    let flags = CU_MEMHOSTALLOC_DEVICEMAP | CU_MEMHOSTALLOC_WRITECOMBINED;
    // Safety: the caller writes every element before anything reads it.
    let mut pinned = unsafe { gpu.context().alloc_pinned_with_flags::<T>(len, flags) }
        .map_err(driver("allocating pinned host memory"))?;
    let host = pinned
        .as_mut_slice()
        .map_err(driver("waiting for pinned host memory"))?
        .as_mut_ptr()
        .cast();
    let mut device = 0u64;
    // Safety: `host` is the start of a live allocation made with DEVICEMAP.
    unsafe { cuMemHostGetDevicePointer_v2(&mut device, host, 0) }
        .result()
        .map_err(driver("mapping pinned host memory"))?;
    Ok((pinned, device))
}

impl<'a, T> From<&'a HostKv<T>> for KvRows<'a, T> {
    /// The rows in place: the kernels read them over PCIe.
    fn from(host: &'a HostKv<T>) -> Self {
        Self {
            keys: Buffer::Mapped(host.device.0, PhantomData),
            values: Buffer::Mapped(host.device.1, PhantomData),
            head_stride: (host.blocks() * host.block_tokens) as u64,
            rows: host.tokens,
            head_dim: host.head_dim,
        }
    }
}

impl<T> HostKv<T> {
    /// Blocks per KV head.
    fn blocks(&self) -> usize {
        self.tokens.div_ceil(self.block_tokens)
    }

    /// Bytes of pinned host memory the keys and values take (padding included).
    pub fn bytes(&self) -> usize {
        2 * self.kv_heads * self.blocks() * self.block_tokens * self.head_dim * size_of::<T>()
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

/// A GPU cache of hot blocks of a [`HostKv`] it owns, evicted by CLOCK (second chance: a
/// slot used since the hand last passed it is spared once), which approximates least
/// recently used at one write per hit.
///
/// [`BlockCache::gather`] makes the blocks of a step's selected ids resident (copying the
/// missing ones in one kernel launch straight from mapped host memory) and returns their
/// rows for [`crate::retrieval_attention`]. Its bookkeeping is one pass over the ids with two
/// array lookups each (the block's slot, the slot's last step), since a step of a long corpus
/// selects tens of thousands of ids per layer and the GPU waits for it.
pub struct BlockCache<T> {
    /// Shared: other launches may read the same rows in place.
    host: Arc<HostKv<T>>,
    keys: CudaSlice<T>,
    values: CudaSlice<T>,
    slots: usize,
    /// Host block (KV head * blocks per head + block) → slot, or NONE.
    slot_of: Vec<u32>,
    /// Slot → host block, or NONE.
    owner: Vec<u32>,
    /// Slot → the last step that used it: a slot of the current step is never evicted, and
    /// each block is counted once a step.
    used: Vec<u64>,
    /// Slot → used since the clock hand last passed it.
    referenced: Vec<bool>,
    /// The next slot the clock looks at for eviction.
    hand: u32,
    free: Vec<u32>,
    /// Host block → the last step counted by the exact count of a step that may not fit
    /// (which only steps of more ids than slots need).
    seen: Vec<u64>,
    step: u64,
    /// The last step's rows, one list per KV head.
    rows: Csr,
    /// The last step's copies: [host block, slot] pairs.
    jobs: CudaSlice<u32>,
    /// Slot → the first token of the block it holds (within its KV head), written by the
    /// fills: how `attention_mass` adds a slot's rows to their tokens.
    slot_tokens: CudaSlice<u32>,
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
    pub fn new(gpu: &Gpu, host: impl Into<Arc<HostKv<T>>>, capacity_bytes: usize) -> Result<Self> {
        let host = host.into();
        let block = host.block_tokens * host.head_dim;
        let slots = Self::slots_for(&host, capacity_bytes)?;
        let blocks = host.kv_heads * host.blocks();
        Ok(Self {
            keys: gpu.zeros(slots * block)?,
            values: gpu.zeros(slots * block)?,
            slots,
            slot_of: vec![NONE; blocks],
            owner: vec![NONE; slots],
            used: vec![0; slots],
            referenced: vec![false; slots],
            hand: 0,
            seen: vec![0; blocks],
            free: (0..slots as u32).rev().collect(),
            step: 0,
            rows: Csr::from_lists::<&[u32]>(gpu, &[])?,
            jobs: gpu.zeros(2)?,
            slot_tokens: gpu.zeros(slots)?,
            stats: CacheStats::default(),
            host,
        })
    }

    /// The blocks a cache of `capacity_bytes` in front of `host` holds: an error when that is
    /// none, or more slots' rows than a row number counts.
    pub fn slots_for(host: &HostKv<T>, capacity_bytes: usize) -> Result<usize> {
        let slots = capacity_bytes / (2 * host.block_tokens * host.head_dim * size_of::<T>());
        if slots == 0 || u32::try_from(slots * host.block_tokens).is_err() {
            return Err(KernelError::TooLarge {
                what: "cache slots (or zero)",
                value: slots,
            });
        }
        Ok(slots)
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
        // Everything that can fail is checked before a slot changes: the ids' range, and
        // whether the step's distinct blocks fit (counted exactly only when it has more ids
        // than slots: a cache sized for its corpus never needs that).
        let (tokens, mut total) = (host.tokens, 0);
        for ids in selected {
            let ids = ids.as_ref();
            if let Some(&id) = ids.iter().max().filter(|&&id| id as usize >= tokens) {
                return Err(KernelError::OutOfRange {
                    what: "selected token id",
                    index: id.into(),
                    len: tokens as u64,
                });
            }
            total += ids.len();
        }
        self.step += 1;
        let step = self.step;
        if total > self.slots {
            let mut needed = 0;
            for (h, ids) in selected.iter().enumerate() {
                for &id in ids.as_ref() {
                    let b = block_of(h, id);
                    needed += usize::from(self.seen[b] != step);
                    self.seen[b] = step;
                }
            }
            if needed > self.slots {
                return Err(KernelError::CacheTooSmall {
                    needed,
                    slots: self.slots,
                });
            }
        }
        // One pass: each id's block found or given a slot (a free one, else the clock's
        // choice, never a slot of this step), and its row.
        let (mut hits, mut jobs) = (0u64, Vec::new());
        let mut offsets = Vec::with_capacity(selected.len() + 1);
        let mut rows = Vec::with_capacity(total);
        offsets.push(0u32);
        for (h, ids) in selected.iter().enumerate() {
            for &id in ids.as_ref() {
                let b = block_of(h, id);
                let slot = match self.slot_of[b] {
                    NONE => {
                        let slot = match self.free.pop() {
                            Some(slot) => slot,
                            None => self.evict(step),
                        };
                        self.slot_of[b] = slot;
                        self.owner[slot as usize] = b as u32;
                        jobs.extend([b as u32, slot]);
                        slot
                    }
                    slot => {
                        hits += u64::from(self.used[slot as usize] != step);
                        slot
                    }
                };
                self.used[slot as usize] = step;
                self.referenced[slot as usize] = true;
                rows.push((slot << shift) | (id & mask));
            }
            offsets.push(rows.len() as u32);
        }
        self.stats.hits += hits;
        let misses = jobs.len() / 2;
        self.stats.misses += misses as u64;
        let block_bytes = 2 * self.host.block_tokens * self.host.head_dim * size_of::<T>();
        self.stats.bytes_copied += (misses * block_bytes) as u64;
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
                keys: Buffer::Device(&self.keys),
                values: Buffer::Device(&self.values),
                head_stride: 0,
                rows: self.slots * self.host.block_tokens,
                head_dim: self.host.head_dim,
            },
            lists: &self.rows,
            runs: &[],
            tokens: Some(SlotTokens {
                first: &self.slot_tokens,
                shift,
                tokens: self.host.tokens,
            }),
        })
    }

    /// A slot for a missing block of step `step`, taken from the block it held: the first
    /// the clock hand reaches that this step does not use and that was not used since the
    /// hand last passed (those it passes lose that mark). The step needs at most `slots`
    /// blocks (checked before) and only its own are spared every time, so two turns of the
    /// hand find one.
    fn evict(&mut self, step: u64) -> u32 {
        loop {
            let slot = self.hand;
            self.hand = (self.hand + 1) % self.slots as u32;
            let s = slot as usize;
            if self.used[s] == step {
                continue;
            }
            if std::mem::take(&mut self.referenced[s]) {
                continue;
            }
            self.slot_of[self.owner[s] as usize] = NONE;
            return slot;
        }
    }

    /// Copies the blocks of `jobs` from host memory into their slots, in one launch.
    fn fill(&mut self, gpu: &Gpu, jobs: &[u32]) -> Result<()> {
        write_into(gpu, &mut self.jobs, jobs)?;
        let function = gpu.fill_kernel("fill_slots")?;
        let vecs = (self.host.block_tokens * self.host.head_dim * size_of::<T>() / 16) as u32;
        let (pool_keys, pool_values) = (gpu.address(&self.keys), gpu.address(&self.values));
        let jobs_address = gpu.address(&self.jobs);
        let slot_tokens = gpu.address(&self.slot_tokens);
        let (blocks, shift) = (
            self.host.blocks() as u32,
            self.host.block_tokens.trailing_zeros(),
        );
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
            .arg(&vecs)
            .arg(&slot_tokens)
            .arg(&blocks)
            .arg(&shift);
        // Safety: `fill_slots(host_k, host_v, pool_k, pool_v, jobs, vecs, slot_token, blocks,
        // shift)`; every job names a block of the host buffers and a slot below `self.slots`,
        // each `vecs` 16-byte vectors long, and `slot_token` holds one u32 per slot.
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
        self.referenced.fill(false);
        self.hand = 0;
        self.free = (0..self.slots as u32).rev().collect();
    }

    /// Number of blocks the cache holds.
    pub fn slots(&self) -> usize {
        self.slots
    }

    /// Bytes of GPU memory the cache's slots take.
    pub fn bytes(&self) -> usize {
        2 * self.slots * self.host.block_tokens * self.host.head_dim * size_of::<T>()
    }

    /// The host memory behind the cache.
    pub fn host(&self) -> &HostKv<T> {
        &self.host
    }
}
