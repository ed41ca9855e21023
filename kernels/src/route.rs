//! [`Partition`]: a bucket index's partition on the GPU, routed there ([`Partition::route`],
//! `cuda/route.cu`), so that a decode step's bucket attention needs no host round trip.

use std::ops::Range;

use cudarc::driver::{CudaSlice, CudaView, CudaViewMut, DevicePtr, LaunchConfig, PushKernelArg};

use crate::attention::{
    bucket_attention_after_route, lanes_of, Buckets, Dense, Query, Workspace, MAX_VISITED_BUCKETS,
};
use crate::buffers::{Csr, KvCache};
use crate::error::{driver, length, KernelError, Result};
use crate::gpu::{Gpu, KvElement};

const SOURCE: &str = include_str!("../cuda/route.cu");

/// Threads of a routing block (`ROUTE_THREADS` in `route.cu`): several per bucket, so that a
/// head's centroid loads are in flight together.
const ROUTE_THREADS: u32 = 512;

/// Buckets each routing block ranks (a KV head's buckets are ranked in slices of about this
/// many, each by its own block), and most slices per head.
const SLICE_BUCKETS: usize = 32;
const MAX_SLICES: usize = 16;

/// Most query heads per KV head a [`Partition`] routes (`GROUP` in `route.cu`, compiled per
/// group: one running sum per head in registers).
const MAX_ROUTED_GROUP: usize = 16;

/// Most buckets per KV head a [`Partition`] routes: their scores fill 48 KiB of shared
/// memory, what every CUDA GPU gives a block without opting in.
pub const MAX_ROUTED_BUCKETS: usize = (48 << 10) / size_of::<f32>();

/// One layer's bucket partition, every KV head's: the centroids that route a query
/// (`[kv_heads, buckets, head_dim]`, f32; a bucket's score is its inner product with the
/// query, the best over a GQA group's heads) and each bucket's token ids, ascending, as the
/// CSR [`crate::Buckets::ids`] takes (KV head `h`'s bucket `b` is list `h * buckets + b`,
/// and one empty list follows them).
pub struct Partition {
    centroids: CudaSlice<f32>,
    ids: Csr,
    kv_heads: usize,
    buckets: usize,
    head_dim: usize,
}

impl std::fmt::Debug for Partition {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Partition")
            .field("kv_heads", &self.kv_heads)
            .field("buckets", &self.buckets)
            .field("head_dim", &self.head_dim)
            .finish_non_exhaustive()
    }
}

/// A query's visits to a [`Partition`]: the buckets of its last step per KV head (what
/// [`crate::Buckets::visited`] takes), and the ids that the bucket attention of all its
/// steps attended in them (outside the dense runs), counted on the GPU.
pub struct Visits {
    visited: Csr,
    selected: CudaSlice<u64>,
}

impl std::fmt::Debug for Visits {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Visits")
            .field("visited", &self.visited)
            .finish_non_exhaustive()
    }
}

impl Visits {
    /// The buckets the last [`Partition::route`] visited, one list per KV head.
    pub fn visited(&self) -> &Csr {
        &self.visited
    }

    /// The ids the bucket attention over these visits attended so far, the visited ids
    /// outside each step's dense runs (waits for the stream).
    pub fn selected(&self, gpu: &Gpu) -> Result<u64> {
        Ok(gpu.download(&self.selected)?.first().copied().unwrap_or(0))
    }
}

impl Partition {
    /// Uploads `kv_heads` heads' partitions: `centroids` `[kv_heads, buckets, head_dim]` and
    /// `lists[h * buckets + b]` the ascending token ids of head `h`'s bucket `b`.
    pub fn new(
        gpu: &Gpu,
        centroids: &[f32],
        lists: &[Vec<u32>],
        kv_heads: usize,
        head_dim: usize,
    ) -> Result<Self> {
        let buckets = lists.len() / kv_heads.max(1);
        length(
            "bucket lists (kv_heads * buckets)",
            kv_heads * buckets,
            lists.len(),
        )?;
        length(
            "centroids [kv_heads, buckets, head_dim]",
            kv_heads * buckets * head_dim,
            centroids.len(),
        )?;
        if buckets == 0 || buckets > MAX_ROUTED_BUCKETS {
            return Err(KernelError::Unsupported {
                what: "buckets per KV head routed on the GPU",
                value: buckets,
                supported:
                    "1 to MAX_ROUTED_BUCKETS (12,288: their scores fill 48 KiB of shared memory)",
            });
        }
        // A bucket's centroid is read by the attention kernels' lanes of a row.
        lanes_of(head_dim, "head dimension routed on the GPU")?;
        if let Some(unsorted) = lists
            .iter()
            .position(|l| l.windows(2).any(|w| w[0] >= w[1]))
        {
            return Err(KernelError::Offsets {
                what: "bucket ids (ascending, no repeats)",
                items: unsorted,
            });
        }
        let mut all: Vec<&[u32]> = lists.iter().map(Vec::as_slice).collect();
        all.push(&[]);
        Ok(Self {
            centroids: gpu.upload(centroids)?,
            ids: Csr::from_lists(gpu, &all)?,
            kv_heads,
            buckets,
            head_dim,
        })
    }

    /// Every bucket's token ids.
    pub fn ids(&self) -> &Csr {
        &self.ids
    }

    /// Buckets per KV head.
    pub fn buckets(&self) -> usize {
        self.buckets
    }

    /// A query's empty visits of `probes` buckets per KV head (at most the buckets, and at
    /// most the [`MAX_VISITED_BUCKETS`] a bucket launch takes).
    pub fn visits(&self, gpu: &Gpu, probes: usize) -> Result<Visits> {
        if probes == 0 || probes > self.buckets.min(MAX_VISITED_BUCKETS) {
            return Err(KernelError::Unsupported {
                what: "buckets probed",
                value: probes,
                supported: "1 to the partition's buckets, at most MAX_VISITED_BUCKETS (128)",
            });
        }
        Ok(Visits {
            visited: Csr::uniform(gpu, self.kv_heads, probes, self.ids.lists() as u32)?,
            selected: gpu.zeros(1)?,
        })
    }

    /// The list part of a bucket launch over `visits` of this partition, rows of `kv` with
    /// `runs` (sinks and window) attended whole: the launch counts what it attends in
    /// [`Visits::selected`].
    pub fn list_part<'a, T>(
        &'a self,
        visits: &'a Visits,
        kv: &'a KvCache<T>,
        runs: &'a [Range<u32>],
    ) -> Buckets<'a, T> {
        Buckets {
            kv,
            runs,
            ids: &self.ids,
            visited: &visits.visited,
            count: Some(&visits.selected),
        }
    }

    /// Routes one decode step: each KV head's group of `queries` (`[kv_heads, group,
    /// head_dim]`, f32, in the partition's space) visits the buckets of best score, written
    /// to `visits`.
    pub fn route(&self, gpu: &Gpu, queries: &CudaView<'_, f32>, visits: &mut Visits) -> Result<()> {
        let per_group = self.kv_heads * self.head_dim;
        if !queries.len().is_multiple_of(per_group) || queries.is_empty() {
            return Err(KernelError::Length {
                what: "routing queries [kv_heads, group, head_dim]",
                expected: per_group,
                found: queries.len(),
            });
        }
        let group = queries.len() / per_group;
        if group > MAX_ROUTED_GROUP {
            return Err(KernelError::Unsupported {
                what: "query heads per KV head routed on the GPU",
                value: group,
                supported: "1 to 16",
            });
        }
        length(
            "visited lists (one per KV head)",
            self.kv_heads,
            visits.visited.lists(),
        )?;
        let probes = visits.visited.longest() as u32;
        // The scores, padded to whole chunks of 8 (`SCAN` in `route.cu`).
        let smem = self.buckets.next_multiple_of(8) * size_of::<f32>();
        let function = gpu.kernel(
            SOURCE,
            "route_buckets",
            &[
                ("GROUP", group.to_string()),
                ("HEAD_DIM", self.head_dim.to_string()),
            ],
        )?;
        let q = queries.device_ptr(gpu.stream()).0;
        let (centroids, visited) = (
            gpu.address(&self.centroids),
            gpu.address(&visits.visited.items),
        );
        let (head_dim, buckets) = (self.head_dim as u32, self.buckets as u32);
        let slices = self.buckets.div_ceil(SLICE_BUCKETS).clamp(1, MAX_SLICES);
        // Buckets each slice ranks.
        let per = self.buckets.div_ceil(slices) as u32;
        let mut builder = gpu.stream().launch_builder(&function);
        builder
            .arg(&q)
            .arg(&centroids)
            .arg(&head_dim)
            .arg(&buckets)
            .arg(&probes)
            .arg(&per)
            .arg(&visited);
        let slices = slices as u32;
        let config = LaunchConfig {
            grid_dim: (self.kv_heads as u32, slices, 1),
            block_dim: (ROUTE_THREADS, 1, 1),
            shared_mem_bytes: smem as u32,
        };
        // Safety: the arguments match `route_buckets`'s signature in order and type; the
        // queries hold `kv_heads * group * head_dim` floats, the centroids
        // `kv_heads * buckets * head_dim`, and `visited` `kv_heads * probes` items with
        // probes <= buckets.
        unsafe { builder.launch(config) }.map_err(driver("launching route_buckets"))?;
        Ok(())
    }

    /// [`Partition::route`] then [`crate::bucket_attention`] over the visits (rows of `kv`
    /// with `runs` attended whole, and `dense`), launched back to back: on Hopper the
    /// attention's blocks start while routing runs (programmatic dependent launch), and
    /// only those that attend the visited buckets wait for it. The same results as the two
    /// calls; everything the attention reads but the visits (queries, rows, workspace) must
    /// be ready before this call, as for them.
    #[allow(clippy::too_many_arguments)]
    pub fn route_and_attend<T: KvElement>(
        &self,
        gpu: &Gpu,
        route_queries: &CudaView<'_, f32>,
        visits: &mut Visits,
        workspace: &mut Workspace,
        query: Query<'_, T>,
        dense: Dense<'_, T>,
        kv: &KvCache<T>,
        runs: &[Range<u32>],
        out: &mut CudaViewMut<'_, f32>,
    ) -> Result<()> {
        self.route(gpu, route_queries, visits)?;
        let part = self.list_part(visits, kv, runs);
        bucket_attention_after_route(gpu, workspace, query, dense, part, out)
    }
}
