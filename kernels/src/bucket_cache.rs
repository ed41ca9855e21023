//! A GPU cache of whole buckets ([`BucketCache`]) in front of a partition's rows in pinned
//! host memory ([`HostKv`]): what a bucket launch routed on the GPU reads instead of the
//! host rows, for the buckets it holds.
//!
//! A routed launch reads every id of its visited buckets, which are scattered over the
//! corpus, so a cache of token blocks ([`crate::BlockCache`]) would copy mostly rows nobody
//! asked for; and a question's visits change little from one step to the next (7.5-10.6% of
//! the selected ids new over 56 answer steps, docs/benchmarks.md). So the unit here is the
//! bucket: its rows copied in id order to consecutive rows of the cache, their tokens beside
//! them. At each step the host reads the step's visits once routing has written them
//! ([`crate::Visits::on_host`], a wait), [`BucketCache::fill`] copies in the buckets the cache
//! lacks, and the bucket launch reads every visited bucket the cache holds from there, so
//! that a bucket crosses PCIe once however many steps visit it; one that does not fit beside
//! the step's others is read in place.

use std::collections::VecDeque;

use cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};

use crate::attention::{CachedBuckets, KvRows};
use crate::buffers::write_into;
use crate::cache::{CacheStats, HostKv};
use crate::error::{driver, length, KernelError, Result};
use crate::gpu::{Gpu, KvElement};
use crate::route::Partition;
use crate::NO_TOKEN;

/// Threads per block of `fill_buckets`, and blocks per bucket copied.
const FILL_THREADS: u32 = 256;
const FILL_BLOCKS_PER_BUCKET: u32 = 16;

/// Where a cache's buckets go: one ring of rows, each bucket's rows consecutive, allocated
/// in order and evicted oldest first. A bucket that does not fit before the ring's end
/// starts it again at row 0, leaving the end's rows (less than a bucket) unused for a turn.
/// Kept apart from the GPU buffers so that its bookkeeping is tested without a GPU.
#[derive(Debug, Clone)]
pub(crate) struct BucketRing {
    /// Rows of the ring.
    capacity: u32,
    /// Rows of every list (bucket) of the partition.
    sizes: Vec<u32>,
    /// Each list's first row, or [`NO_TOKEN`].
    slot_of: Vec<u32>,
    /// The placed lists (list, first row), oldest first.
    placed: VecDeque<(u32, u32)>,
    /// The next row to place a bucket at.
    head: u32,
    /// Each list's last [`BucketRing::place`] call: a bucket of the current call is never
    /// evicted by it, and is counted once.
    seen: Vec<u64>,
    call: u64,
}

/// What [`BucketRing::place`] did: the visited buckets found, those placed (list and first
/// row, in pairs, as `fill_buckets` takes them), and those left out (too large for the ring,
/// or more rows than it holds beside the call's other buckets).
#[derive(Debug, Default, PartialEq, Eq)]
pub(crate) struct Placed {
    pub(crate) hits: u64,
    pub(crate) jobs: Vec<u32>,
    pub(crate) left_out: u64,
}

impl BucketRing {
    /// An empty ring of `capacity` rows for lists of `sizes` rows.
    pub(crate) fn new(capacity: u32, sizes: Vec<u32>) -> Self {
        let lists = sizes.len();
        Self {
            capacity,
            sizes,
            slot_of: vec![NO_TOKEN; lists],
            placed: VecDeque::new(),
            head: 0,
            seen: vec![0; lists],
            call: 0,
        }
    }

    /// Each list's first row, or [`NO_TOKEN`].
    pub(crate) fn slot_of(&self) -> &[u32] {
        &self.slot_of
    }

    /// Places the buckets of `visited` (list numbers below the sizes' length, repeats
    /// allowed) that the ring lacks, evicting the oldest.
    pub(crate) fn place(&mut self, visited: &[u32]) -> Placed {
        self.call += 1;
        let mut placed = Placed::default();
        for &list in visited {
            let l = list as usize;
            if self.seen[l] == self.call || self.sizes[l] == 0 {
                continue;
            }
            self.seen[l] = self.call;
            if self.slot_of[l] != NO_TOKEN {
                placed.hits += 1;
                continue;
            }
            match self.allocate(self.sizes[l]) {
                Some(first) => {
                    self.slot_of[l] = first;
                    self.placed.push_back((list, first));
                    placed.jobs.extend([list, first]);
                }
                None => placed.left_out += 1,
            }
        }
        placed
    }

    /// The first of `rows` consecutive rows for a bucket of this call, its older buckets
    /// there evicted; `None` when it would evict one of this call's.
    fn allocate(&mut self, rows: u32) -> Option<u32> {
        if rows > self.capacity {
            return None;
        }
        if self.head + rows > self.capacity {
            // The rows from the head to the end hold the oldest buckets: they go, and the
            // bucket starts the ring again.
            while self.placed.front().is_some_and(|&(_, f)| f >= self.head) {
                self.evict_oldest()?;
            }
            self.head = 0;
        }
        let end = self.head + rows;
        while self
            .placed
            .front()
            .is_some_and(|&(_, f)| f >= self.head && f < end)
        {
            self.evict_oldest()?;
        }
        let first = self.head;
        self.head = end;
        Some(first)
    }

    /// Evicts the oldest bucket, unless it is one of this call's (`None`).
    fn evict_oldest(&mut self) -> Option<()> {
        let &(list, _) = self.placed.front()?;
        if self.seen[list as usize] == self.call {
            return None;
        }
        self.placed.pop_front();
        self.slot_of[list as usize] = NO_TOKEN;
        Some(())
    }

    /// Forgets every bucket.
    pub(crate) fn clear(&mut self) {
        self.slot_of.fill(NO_TOKEN);
        self.placed.clear();
        self.head = 0;
    }
}

/// A GPU cache of whole buckets of one [`Partition`] in front of its rows in host memory
/// (see the module's documentation): [`BucketCache::fill`] copies in the buckets of a step's
/// visits that it lacks, and [`BucketCache::cached`] is what a bucket launch
/// ([`crate::Buckets::cache`]) then reads them from.
pub struct BucketCache<T> {
    keys: CudaSlice<T>,
    values: CudaSlice<T>,
    /// Each row's token (within its KV head), written by the fills.
    token_of: CudaSlice<u32>,
    /// The ring's table on the GPU: each list's first row, or [`NO_TOKEN`].
    slot_of: CudaSlice<u32>,
    ring: BucketRing,
    /// The last fill's jobs: [list, first row] pairs.
    jobs: CudaSlice<u32>,
    head_dim: usize,
    stats: CacheStats,
}

impl<T> std::fmt::Debug for BucketCache<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BucketCache")
            .field("rows", &self.ring.capacity)
            .field("placed", &self.ring.placed.len())
            .field("stats", &self.stats)
            .finish_non_exhaustive()
    }
}

impl<T: KvElement> BucketCache<T> {
    /// An empty cache of `capacity_bytes` of GPU memory for the buckets of `partition`,
    /// whose rows are `host`'s; an error when that holds no row, or more than a row number
    /// counts.
    pub fn new(
        gpu: &Gpu,
        partition: &Partition,
        host: &HostKv<T>,
        capacity_bytes: usize,
    ) -> Result<Self> {
        let head_dim = KvRows::from(host).head_dim;
        let rows = capacity_bytes / (2 * head_dim * size_of::<T>());
        let capacity = u32::try_from(rows)
            .ok()
            .filter(|&r| r > 0 && r != NO_TOKEN)
            .ok_or(KernelError::TooLarge {
                what: "bucket cache rows (or zero)",
                value: rows,
            })?;
        let offsets = gpu.download(&partition.ids().offsets)?;
        let sizes = offsets.windows(2).map(|w| w[1] - w[0]).collect::<Vec<_>>();
        let ring = BucketRing::new(capacity, sizes);
        Ok(Self {
            keys: gpu.zeros(rows * head_dim)?,
            values: gpu.zeros(rows * head_dim)?,
            token_of: gpu.zeros(rows)?,
            slot_of: gpu.upload(ring.slot_of())?,
            ring,
            jobs: gpu.zeros(2)?,
            head_dim,
            stats: CacheStats::default(),
        })
    }

    /// Copies into the cache the buckets of `visited` (list numbers of `partition`, as
    /// [`crate::Visits::visited`] holds them) that it lacks, evicting the oldest (never one of
    /// `visited`), in one launch on `gpu`'s stream, and the table of where each is after it:
    /// launches queued on the stream after this read the cache as it is then. No launch
    /// that read the cache may still be running on another stream (rows it read may be
    /// overwritten). On an error the cache is left empty.
    pub fn fill(
        &mut self,
        gpu: &Gpu,
        partition: &Partition,
        host: &HostKv<T>,
        visited: &[u32],
    ) -> Result<()> {
        let lists = self.ring.sizes.len();
        length("partition lists", lists, partition.ids().lists())?;
        length(
            "host rows' head dimension",
            self.head_dim,
            KvRows::from(host).head_dim,
        )?;
        if let Some(&list) = visited.iter().find(|&&l| l as usize >= lists) {
            return Err(KernelError::OutOfRange {
                what: "visited bucket",
                index: list.into(),
                len: lists as u64,
            });
        }
        let placed = self.ring.place(visited);
        let bucket_bytes = |list: u32| {
            2 * self.ring.sizes[list as usize] as usize * self.head_dim * size_of::<T>()
        };
        let bytes: usize = placed.jobs.chunks(2).map(|job| bucket_bytes(job[0])).sum();
        self.stats.hits += placed.hits;
        self.stats.misses += placed.left_out + (placed.jobs.len() / 2) as u64;
        self.stats.bytes_copied += bytes as u64;
        if placed.jobs.is_empty() {
            return Ok(());
        }
        let copied = self
            .copy(gpu, partition, host, &placed.jobs)
            .and_then(|()| {
                gpu.stream()
                    .memcpy_htod(self.ring.slot_of(), &mut self.slot_of)
                    .map_err(driver("copying the bucket cache's table to the device"))
            });
        if copied.is_err() {
            // What was claimed may not have arrived: forget it all.
            self.ring.clear();
        }
        copied
    }

    /// `fill_buckets` for `jobs`.
    fn copy(
        &mut self,
        gpu: &Gpu,
        partition: &Partition,
        host: &HostKv<T>,
        jobs: &[u32],
    ) -> Result<()> {
        write_into(gpu, &mut self.jobs, jobs)?;
        let function = gpu.fill_kernel("fill_buckets")?;
        let rows = KvRows::from(host);
        let (host_k, host_v) = (rows.keys.address(gpu), rows.values.address(gpu));
        let ids = partition.ids();
        let (offsets, items) = (gpu.address(&ids.offsets), gpu.address(&ids.items));
        let jobs_address = gpu.address(&self.jobs);
        let buckets = partition.lists_per_head() as u32;
        let row_vecs = (self.head_dim * size_of::<T>() / 16) as u32;
        let (cache_k, cache_v) = (gpu.address(&self.keys), gpu.address(&self.values));
        let token_of = gpu.address(&self.token_of);
        let config = LaunchConfig {
            grid_dim: ((jobs.len() / 2) as u32, FILL_BLOCKS_PER_BUCKET, 1),
            block_dim: (FILL_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut builder = gpu.stream().launch_builder(&function);
        builder
            .arg(&host_k)
            .arg(&host_v)
            .arg(&rows.head_stride)
            .arg(&offsets)
            .arg(&items)
            .arg(&jobs_address)
            .arg(&buckets)
            .arg(&row_vecs)
            .arg(&cache_k)
            .arg(&cache_v)
            .arg(&token_of);
        // Safety: `fill_buckets(host_k, host_v, head_stride, offsets, ids, jobs, buckets,
        // row_vecs, cache_k, cache_v, token_of)`; every job names a list of the partition
        // (checked against its lists) whose ids are rows of `host` (the partition was made
        // for them), and a first row after which the ring holds the list's rows; the rows are
        // whole 16-byte vectors (`HostKv` checks it).
        unsafe { builder.launch(config) }.map_err(driver("launching fill_buckets"))?;
        Ok(())
    }
}

impl<T> BucketCache<T> {
    /// The cache as a bucket launch reads it.
    pub fn cached(&self) -> CachedBuckets<'_, T> {
        CachedBuckets {
            keys: &self.keys,
            values: &self.values,
            slot_of: &self.slot_of,
            token_of: &self.token_of,
        }
    }

    /// Lookups so far: a visited bucket counts once a fill, as a hit when it was in the
    /// cache already.
    pub fn stats(&self) -> CacheStats {
        self.stats
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every placed bucket's rows within the ring and apart from every other's, and the
    /// table agreeing with the placements.
    fn consistent(ring: &BucketRing) {
        let mut spans: Vec<(u32, u32)> = ring
            .placed
            .iter()
            .map(|&(l, f)| (f, f + ring.sizes[l as usize]))
            .collect();
        spans.sort();
        for pair in spans.windows(2) {
            assert!(pair[0].1 <= pair[1].0, "overlapping buckets {pair:?}");
        }
        assert!(spans.iter().all(|&(_, end)| end <= ring.capacity));
        for (l, &slot) in ring.slot_of.iter().enumerate() {
            let placed = ring.placed.iter().find(|&&(list, _)| list as usize == l);
            assert_eq!(placed.map_or(NO_TOKEN, |&(_, f)| f), slot, "list {l}");
        }
    }

    #[test]
    fn places_missing_buckets_and_counts_hits_once() {
        let mut ring = BucketRing::new(100, vec![10, 20, 0, 30]);
        let first = ring.place(&[1, 0, 1, 2]);
        assert_eq!(first.jobs, vec![1, 0, 0, 20]);
        assert_eq!((first.hits, first.left_out), (0, 0));
        let again = ring.place(&[0, 1, 1, 3]);
        assert_eq!(again.jobs, vec![3, 30]);
        assert_eq!((again.hits, again.left_out), (2, 0));
        consistent(&ring);
    }

    #[test]
    fn evicts_the_oldest_and_wraps_around() {
        // Lists of 30 rows in a ring of 100: three fit, the fourth starts the ring again.
        let mut ring = BucketRing::new(100, vec![30; 8]);
        for list in 0..3 {
            ring.place(&[list]);
        }
        let fourth = ring.place(&[3]);
        assert_eq!(fourth.jobs, vec![3, 0]);
        assert_eq!(ring.slot_of()[0], NO_TOKEN, "the oldest bucket went");
        assert_eq!(ring.slot_of()[1], 30);
        let fifth = ring.place(&[4]);
        assert_eq!(fifth.jobs, vec![4, 30]);
        consistent(&ring);
        // Many more calls of random visits keep the ring consistent.
        let mut state = 12345u64;
        for _ in 0..2000 {
            let visits: Vec<u32> = (0..3)
                .map(|_| {
                    state = state
                        .wrapping_mul(6364136223846793005)
                        .wrapping_add(1442695040888963407);
                    ((state >> 33) % 8) as u32
                })
                .collect();
            let placed = ring.place(&visits);
            consistent(&ring);
            // Each distinct visited bucket is a hit, placed or left out, and cached unless
            // left out.
            let mut distinct = visits.clone();
            distinct.sort();
            distinct.dedup();
            let jobs = placed.jobs.len() as u64 / 2;
            assert_eq!(placed.hits + jobs + placed.left_out, distinct.len() as u64);
            let cached = distinct
                .iter()
                .filter(|&&l| ring.slot_of()[l as usize] != NO_TOKEN)
                .count() as u64;
            assert_eq!(cached, placed.hits + jobs, "{visits:?} {placed:?}");
        }
    }

    #[test]
    fn never_evicts_a_bucket_of_the_same_call() {
        let mut ring = BucketRing::new(100, vec![40, 40, 40, 200]);
        let placed = ring.place(&[0, 1, 2, 3]);
        assert_eq!(placed.jobs, vec![0, 0, 1, 40]);
        // The third does not fit beside the call's two, the fourth not at all.
        assert_eq!(placed.left_out, 2);
        consistent(&ring);
        // The next call may evict them.
        let next = ring.place(&[2]);
        assert_eq!(next.jobs, vec![2, 0]);
        assert_eq!(ring.slot_of()[0], NO_TOKEN);
        consistent(&ring);
        ring.clear();
        assert!(ring.slot_of().iter().all(|&s| s == NO_TOKEN));
    }
}
