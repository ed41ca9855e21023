//! [`Partition`]: a bucket index's partition on the GPU, routed there ([`Partition::route`],
//! `cuda/route.cu`), so that a decode step's bucket attention needs no host round trip. A
//! partition routes by its centroids' inner products with the queries (ivf) or by a trained
//! classifier with the geometric expert (saap, [`Partition::classifier`]).

use std::ops::Range;
use std::sync::OnceLock;

use cudarc::driver::{
    CudaEvent, CudaSlice, CudaView, CudaViewMut, DevicePtr, LaunchConfig, PinnedHostSlice,
    PushKernelArg,
};

use crate::attention::{
    bucket_attention_after_route, lanes_of, BucketOf, Buckets, Dense, Followed, KvRows, Query,
    Workspace, MAX_VISITED_BUCKETS,
};
use crate::buffers::Csr;
use crate::error::{driver, length, KernelError, Result};
use crate::gpu::{param, Gpu, KvElement};
use crate::ops::RopePairs;

/// `route.cu` after the block-level helpers it shares with `attend.cu`.
const SOURCE: &str = concat!(
    include_str!("../cuda/blocks.cuh"),
    include_str!("../cuda/route.cu")
);

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

/// Threads of a classifier routing block, hidden units and buckets each block of its two
/// launches takes (`SAAP_THREADS`, `SAAP_ROWS`, `SAAP_BUCKETS` in `route.cu`: two units and
/// one bucket a warp).
const SAAP_THREADS: u32 = 256;
const SAAP_ROWS: usize = 16;
const SAAP_BUCKETS: usize = 8;

/// Shared memory a classifier routing block may use: what every CUDA GPU gives a block
/// without opting in.
const SAAP_SHARED_BYTES: usize = 48 << 10;

/// One KV head's trained classifier partition (saap), as [`Partition::classifier`] takes
/// it: a bucket's logit for a de-roped query `q` is `w2 · relu(w1 · q + b1) + b2 + prior ·
/// q · centroid`, and the geometric expert's is `prior · rot(q) · mean_key`.
#[derive(Debug, Clone, Copy)]
pub struct ClassifierHead<'a> {
    /// k-means centroids of the de-roped keys, `[buckets, head_dim]`.
    pub centroids: &'a [f32],
    /// The first layer `[hidden, head_dim]` (a batch norm folded in).
    pub w1: &'a [f32],
    /// Its bias `[hidden]`.
    pub b1: &'a [f32],
    /// The second layer `[buckets, hidden]`.
    pub w2: &'a [f32],
    /// Its bias `[buckets]`.
    pub b2: &'a [f32],
    /// Weight of the centroid scores in the logits, and of the expert's scores.
    pub prior: f32,
    /// Each bucket's mean rotated key `[buckets, head_dim]`.
    pub mean_keys: &'a [f32],
    /// The expert's share of each query head's distribution (0: the classifier's alone).
    pub share: f32,
}

/// The layer's RoPE, which rotates the geometric expert's queries as the model rotates its
/// own.
#[derive(Debug, Clone, Copy)]
pub struct RouteRope<'a> {
    /// The angle of each pair at position 1 (`head_dim / 2` of them).
    pub inv_freq: &'a [f64],
    /// Which dimensions form a pair.
    pub pairs: RopePairs,
}

/// What one decode step's routing needs besides its queries ([`Partition::route`]): a
/// classifier partition rotates the queries to `position` for the geometric expert and
/// visits only buckets that hold one of the `candidates` (as saap's search); centroid
/// routing visits the best buckets whatever they hold (as `ivf…,all`) and ignores both.
#[derive(Debug, Clone)]
pub struct RouteStep {
    /// The step's position.
    pub position: usize,
    /// The ids a search may select.
    pub candidates: Range<u32>,
}

/// Checks a GQA group's size against what the routing kernels take (`GROUP` running sums a
/// thread).
fn routed_group(group: usize) -> Result<()> {
    if group == 0 || group > MAX_ROUTED_GROUP {
        return Err(KernelError::Unsupported {
            what: "query heads per KV head routed on the GPU",
            value: group,
            supported: "1 to 16",
        });
    }
    Ok(())
}

/// How a [`Partition`] scores buckets.
enum Router {
    /// `[kv_heads, buckets, head_dim]`.
    Centroids(CudaSlice<f32>),
    Classifier(Box<Classifier>),
}

/// A classifier partition's every KV head, stacked as `route.cu` reads them.
struct Classifier {
    /// The GQA group it routes (its scratch holds the group's hidden units and logits).
    group: usize,
    hidden: usize,
    w1: CudaSlice<f32>,
    b1: CudaSlice<f32>,
    w2: CudaSlice<f32>,
    b2: CudaSlice<f32>,
    centroids: CudaSlice<f32>,
    mean_keys: CudaSlice<f32>,
    prior: CudaSlice<f32>,
    share: CudaSlice<f32>,
    inv_freq: CudaSlice<f64>,
    interleaved: bool,
}

impl Router {
    /// Bytes of GPU memory the centroids or the classifier take.
    fn bytes(&self) -> usize {
        match self {
            Router::Centroids(centroids) => centroids.len() * size_of::<f32>(),
            Router::Classifier(c) => {
                let floats = [
                    &c.w1,
                    &c.b1,
                    &c.w2,
                    &c.b2,
                    &c.centroids,
                    &c.mean_keys,
                    &c.prior,
                ];
                let floats: usize = floats.iter().map(|s| s.len()).sum::<usize>() + c.share.len();
                floats * size_of::<f32>() + c.inv_freq.len() * size_of::<f64>()
            }
        }
    }
}

impl Classifier {
    /// Dynamic shared memory of a `saap_scores` block (see `route.cu`): the group's queries,
    /// or in the last block of a head every logit, the sums and the flags.
    fn shared_bytes(group: usize, head_dim: usize, buckets: usize) -> usize {
        let scores = 2 * group * head_dim;
        let ranking = 2 * (group + 1) * buckets;
        scores.max(ranking) * size_of::<f32>()
    }
}

/// One layer's bucket partition, every KV head's: what routes a query (the centroids,
/// `[kv_heads, buckets, head_dim]` f32, a bucket's score their inner product with the query,
/// the best over a GQA group's heads; or a trained classifier, [`Partition::classifier`]) and
/// each bucket's token ids, ascending, as the CSR [`crate::Buckets::ids`] takes (KV head `h`'s
/// bucket `b` is list `h * per_head + b`, and one empty list follows them all). Where every
/// search also visits some ids (ivf's hot keys), they are one more list of each head
/// (`h * per_head + buckets`) that every visit holds, and no bucket list holds them.
pub struct Partition {
    router: Router,
    ids: Csr,
    kv_heads: usize,
    buckets: usize,
    /// Lists per KV head in `ids`: its buckets, then, where every search also visits some
    /// ids ([`Partition::new`]'s `always`), one list of them.
    per_head: usize,
    head_dim: usize,
    /// Every row's bucket, made by the first query that follows (`Partition::bucket_of`).
    bucket_of: OnceLock<BucketOf>,
}

impl std::fmt::Debug for Partition {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Partition")
            .field("kv_heads", &self.kv_heads)
            .field("buckets", &self.buckets)
            .field("per_head", &self.per_head)
            .field("head_dim", &self.head_dim)
            .field(
                "router",
                &match &self.router {
                    Router::Centroids(_) => "centroids",
                    Router::Classifier(_) => "classifier",
                },
            )
            .finish_non_exhaustive()
    }
}

/// A query's visits to a [`Partition`]: the buckets of its last step per KV head (what
/// [`crate::Buckets::visited`] takes), and the ids that the bucket attention of all its
/// steps attended in them (outside the dense runs), counted on the GPU.
pub struct Visits {
    visited: Csr,
    selected: CudaSlice<u64>,
    /// A classifier partition's scratch (`route.cu`): hidden units and logits, then a
    /// counter per KV head and a flag word per bucket.
    scratch: Option<(CudaSlice<f32>, CudaSlice<u32>)>,
    /// Pinned host memory the visited buckets are copied to ([`Visits::on_host`]) and the
    /// event recorded after the copy (the pinned slice's own is not: the context tracks no
    /// events).
    host: Option<(PinnedHostSlice<u32>, CudaEvent)>,
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

    /// The visited buckets (every KV head's, as [`Visits::visited`]'s items) on the host:
    /// copied once the launches queued so far (the routing that wrote them) have run, which
    /// this waits for.
    pub fn on_host(&mut self, gpu: &Gpu) -> Result<&[u32]> {
        let items = &self.visited.items;
        let (host, done) = match self.host.take() {
            Some((host, done)) if host.len() == items.len() => (host, done),
            // Plain pinned memory (not write-combined): the CPU reads it. Safety: the copy
            // below writes every element before they are read (after its event).
            _ => (
                unsafe { gpu.context().alloc_pinned_with_flags::<u32>(items.len(), 0) }
                    .map_err(driver("allocating pinned host memory for visits"))?,
                gpu.event()?,
            ),
        };
        let (host, done) = self.host.insert((host, done));
        gpu.stream()
            .memcpy_dtoh(items, host)
            .map_err(driver("copying visits to the host"))?;
        gpu.record(done)?;
        done.synchronize()
            .map_err(driver("waiting for visits copied to the host"))?;
        host.as_slice()
            .map_err(driver("reading visits copied to the host"))
    }
}

impl Partition {
    /// Uploads `kv_heads` heads' partitions: `centroids` `[kv_heads, buckets, head_dim]`,
    /// `lists[h * buckets + b]` the ascending token ids of head `h`'s bucket `b`, and
    /// `always` empty or, per head, ascending ids every search visits besides its buckets
    /// (attended once: taken out of the buckets that hold them).
    pub fn new(
        gpu: &Gpu,
        centroids: &[f32],
        lists: &[Vec<u32>],
        always: &[Vec<u32>],
        kv_heads: usize,
        head_dim: usize,
    ) -> Result<Self> {
        let buckets = lists.len() / kv_heads.max(1);
        length(
            "centroids [kv_heads, buckets, head_dim]",
            kv_heads * buckets * head_dim,
            centroids.len(),
        )?;
        Self::with_router(
            gpu,
            Router::Centroids(gpu.upload(centroids)?),
            lists,
            always,
            kv_heads,
            head_dim,
        )
    }

    /// Uploads a classifier partition (saap) of one KV head per `heads` for queries of GQA
    /// groups of `group` heads: `lists[h * buckets + b]` the ascending token ids of head `h`'s
    /// bucket `b`, `rope` the layer's (see [`ClassifierHead`] and [`RouteRope`]).
    pub fn classifier<'a>(
        gpu: &Gpu,
        heads: &[ClassifierHead<'a>],
        lists: &[Vec<u32>],
        head_dim: usize,
        group: usize,
        rope: RouteRope<'_>,
    ) -> Result<Self> {
        let kv_heads = heads.len();
        let buckets = lists.len() / kv_heads.max(1);
        let hidden = heads.first().map_or(0, |h| h.b1.len());
        routed_group(group)?;
        if hidden == 0 {
            return Err(KernelError::Unsupported {
                what: "hidden units of a routing classifier",
                value: 0,
                supported: "at least 1",
            });
        }
        let shared = Classifier::shared_bytes(group, head_dim, buckets);
        if shared > SAAP_SHARED_BYTES {
            return Err(KernelError::Unsupported {
                what: "shared memory of classifier routing (bytes: the larger of 2 * group * head_dim and 2 * (group + 1) * buckets floats)",
                value: shared,
                supported: "at most 49,152",
            });
        }
        length(
            "RoPE inv_freq (head_dim / 2)",
            head_dim / 2,
            rope.inv_freq.len(),
        )?;
        for head in heads {
            for (what, expected, found) in [
                (
                    "classifier centroids [buckets, head_dim]",
                    buckets * head_dim,
                    head.centroids.len(),
                ),
                (
                    "classifier w1 [hidden, head_dim]",
                    hidden * head_dim,
                    head.w1.len(),
                ),
                ("classifier b1 [hidden]", hidden, head.b1.len()),
                (
                    "classifier w2 [buckets, hidden]",
                    buckets * hidden,
                    head.w2.len(),
                ),
                ("classifier b2 [buckets]", buckets, head.b2.len()),
                (
                    "mean keys [buckets, head_dim]",
                    buckets * head_dim,
                    head.mean_keys.len(),
                ),
            ] {
                length(what, expected, found)?;
            }
        }
        let stacked = |part: fn(&ClassifierHead<'a>) -> &'a [f32]| -> Result<CudaSlice<f32>> {
            gpu.upload(&heads.iter().flat_map(part).copied().collect::<Vec<f32>>())
        };
        let classifier = Classifier {
            group,
            hidden,
            w1: stacked(|h| h.w1)?,
            b1: stacked(|h| h.b1)?,
            w2: stacked(|h| h.w2)?,
            b2: stacked(|h| h.b2)?,
            centroids: stacked(|h| h.centroids)?,
            mean_keys: stacked(|h| h.mean_keys)?,
            prior: gpu.upload(&heads.iter().map(|h| h.prior).collect::<Vec<f32>>())?,
            share: gpu.upload(&heads.iter().map(|h| h.share).collect::<Vec<f32>>())?,
            inv_freq: gpu.upload(rope.inv_freq)?,
            interleaved: rope.pairs == RopePairs::Interleaved,
        };
        Self::with_router(
            gpu,
            Router::Classifier(Box::new(classifier)),
            lists,
            &[],
            kv_heads,
            head_dim,
        )
    }

    /// The partition of `router` over `lists` and `always` (checked).
    fn with_router(
        gpu: &Gpu,
        router: Router,
        lists: &[Vec<u32>],
        always: &[Vec<u32>],
        kv_heads: usize,
        head_dim: usize,
    ) -> Result<Self> {
        let buckets = lists.len() / kv_heads.max(1);
        length(
            "bucket lists (kv_heads * buckets)",
            kv_heads * buckets,
            lists.len(),
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
        if !always.is_empty() {
            length(
                "always-visited lists (one per KV head)",
                kv_heads,
                always.len(),
            )?;
        }
        if let Some(unsorted) = lists
            .iter()
            .chain(always)
            .position(|l| l.windows(2).any(|w| w[0] >= w[1]))
        {
            return Err(KernelError::Offsets {
                what: "bucket ids (ascending, no repeats)",
                items: unsorted,
            });
        }
        let per_head = buckets + usize::from(!always.is_empty());
        let mut all: Vec<Vec<u32>> = Vec::with_capacity(kv_heads * per_head + 1);
        for (h, head) in lists.chunks_exact(buckets).enumerate() {
            match always.get(h) {
                // Each id once: out of its bucket, into the list every visit holds.
                Some(always) => {
                    all.extend(head.iter().map(|list| {
                        let kept = list.iter().filter(|id| always.binary_search(id).is_err());
                        kept.copied().collect()
                    }));
                    all.push(always.clone());
                }
                None => all.extend(head.iter().cloned()),
            }
        }
        all.push(Vec::new());
        Ok(Self {
            router,
            ids: Csr::from_lists(gpu, &all)?,
            kv_heads,
            buckets,
            per_head,
            head_dim,
            bucket_of: OnceLock::new(),
        })
    }

    /// Every bucket's token ids.
    pub fn ids(&self) -> &Csr {
        &self.ids
    }

    /// Buckets per KV head that routing ranks.
    pub fn buckets(&self) -> usize {
        self.buckets
    }

    /// Lists per KV head in [`Partition::ids`]: the buckets, and one more where every
    /// search visits some ids besides them.
    pub fn lists_per_head(&self) -> usize {
        self.per_head
    }

    /// A query's empty visits of `probes` buckets per KV head (at most the buckets, and with
    /// the list every visit holds at most the [`MAX_VISITED_BUCKETS`] a bucket launch takes).
    pub fn visits(&self, gpu: &Gpu, probes: usize) -> Result<Visits> {
        let always = self.per_head - self.buckets;
        if probes == 0 || probes > self.buckets || probes + always > MAX_VISITED_BUCKETS {
            return Err(KernelError::Unsupported {
                what: "buckets probed",
                value: probes,
                supported: "1 to the partition's buckets, with the list every search visits at \
                            most MAX_VISITED_BUCKETS (128)",
            });
        }
        let scratch = match &self.router {
            Router::Centroids(_) => None,
            Router::Classifier(c) => Some((
                gpu.zeros(self.kv_heads * c.group * (c.hidden + 2 * self.buckets))?,
                gpu.zeros(self.kv_heads * (1 + self.buckets))?,
            )),
        };
        let empty = self.ids.lists() as u32 - 1;
        let visited = match always {
            0 => Csr::uniform(gpu, self.kv_heads, probes, self.ids.lists() as u32)?,
            // Routing writes each head's first `probes`; the last is the head's always list.
            _ => {
                let per_head = |h: usize| {
                    let mut visits = vec![empty; probes];
                    visits.push((h * self.per_head + self.buckets) as u32);
                    visits
                };
                Csr::from_lists(gpu, &(0..self.kv_heads).map(per_head).collect::<Vec<_>>())?
            }
        };
        Ok(Visits {
            visited,
            selected: gpu.zeros(1)?,
            scratch,
            host: None,
        })
    }

    /// Bytes of GPU memory the partition takes: its router, its lists' ids, and every row's
    /// bucket once a query followed ids ([`Partition::bucket_of`]).
    pub fn bytes(&self) -> usize {
        self.router.bytes() + self.ids.bytes() + self.bucket_of.get().map_or(0, BucketOf::bytes)
    }

    /// Every row's bucket, for launches over `rows` rows per KV head that follow ids besides
    /// their visits ([`Followed`]): made on the GPU by the first call (4 bytes a row and KV
    /// head), kept for the partition's life.
    pub fn bucket_of(&self, gpu: &Gpu, rows: usize) -> Result<&BucketOf> {
        if self.bucket_of.get().is_none() {
            let made = BucketOf::new(gpu, &self.ids, self.kv_heads, self.per_head, rows)?;
            // Another thread may have made it first: the same map either way.
            let _ = self.bucket_of.set(made);
        }
        let of = self.bucket_of.get().ok_or(KernelError::Length {
            what: "bucket map",
            expected: rows,
            found: 0,
        })?;
        length("bucket map rows", rows, of.rows)?;
        Ok(of)
    }

    /// The list part of a bucket launch over `visits` of this partition, rows of `kv` (a
    /// [`KvCache`], or a [`crate::HostKv`] read in place) with
    /// `runs` (sinks and window) attended whole: the launch counts what it attends in
    /// [`Visits::selected`].
    pub fn list_part<'a, T>(
        &'a self,
        visits: &'a Visits,
        kv: impl Into<KvRows<'a, T>>,
        runs: &'a [Range<u32>],
    ) -> Buckets<'a, T> {
        Buckets {
            kv: kv.into(),
            runs,
            ids: &self.ids,
            visited: &visits.visited,
            count: Some(&visits.selected),
            follow: None,
            cache: None,
        }
    }

    /// Routes one decode step: each KV head's group of `queries` (`[kv_heads, group,
    /// head_dim]`, f32, de-roped: the partition's space) visits the buckets of best score at
    /// `step`, written to `visits`.
    pub fn route(
        &self,
        gpu: &Gpu,
        queries: &CudaView<'_, f32>,
        step: &RouteStep,
        visits: &mut Visits,
    ) -> Result<()> {
        let per_group = self.kv_heads * self.head_dim;
        if !queries.len().is_multiple_of(per_group) || queries.is_empty() {
            return Err(KernelError::Length {
                what: "routing queries [kv_heads, group, head_dim]",
                expected: per_group,
                found: queries.len(),
            });
        }
        let group = queries.len() / per_group;
        routed_group(group)?;
        length(
            "visited lists (one per KV head)",
            self.kv_heads,
            visits.visited.lists(),
        )?;
        let defines = [
            ("GROUP", group.to_string()),
            ("HEAD_DIM", self.head_dim.to_string()),
        ];
        match &self.router {
            Router::Centroids(centroids) => {
                self.route_by_centroids(gpu, centroids, queries, &defines, visits)
            }
            Router::Classifier(classifier) => {
                length(
                    "routing queries of the classifier's group",
                    self.kv_heads * classifier.group * self.head_dim,
                    queries.len(),
                )?;
                self.route_by_classifier(gpu, classifier, queries, step, &defines, visits)
            }
        }
    }

    /// `route_buckets` (see `route.cu`).
    fn route_by_centroids(
        &self,
        gpu: &Gpu,
        centroids: &CudaSlice<f32>,
        queries: &CudaView<'_, f32>,
        defines: &[(&str, String)],
        visits: &mut Visits,
    ) -> Result<()> {
        // Each head's visits: the routed probes, then the list every visit holds.
        let stride = visits.visited.longest() as u32;
        let probes = stride.saturating_sub((self.per_head - self.buckets) as u32);
        let per_head = self.per_head as u32;
        // The scores, padded to whole chunks of 8 (`SCAN` in `route.cu`).
        let smem = self.buckets.next_multiple_of(8) * size_of::<f32>();
        let function = gpu.kernel(SOURCE, "route_buckets", defines)?;
        let q = queries.device_ptr(gpu.stream()).0;
        let (centroids, visited) = (gpu.address(centroids), gpu.address(&visits.visited.items));
        let (head_dim, buckets) = (self.head_dim as u32, self.buckets as u32);
        let slices = self.buckets.div_ceil(SLICE_BUCKETS).clamp(1, MAX_SLICES);
        // Buckets each slice ranks.
        let per = self.buckets.div_ceil(slices) as u32;
        let mut params = [
            param(&q),
            param(&centroids),
            param(&head_dim),
            param(&buckets),
            param(&probes),
            param(&per),
            param(&stride),
            param(&per_head),
            param(&visited),
        ];
        let grid = (self.kv_heads as u32, slices as u32);
        // A programmatic dependent launch: its blocks start while attention's inputs (the
        // queries) are still being written, and wait for them first (`route.cu`).
        // Safety: the arguments match `route_buckets`'s signature in order and type; the
        // queries hold `kv_heads * group * head_dim` floats, the centroids
        // `kv_heads * buckets * head_dim`, and `visited` `kv_heads * stride` items with
        // probes <= stride and probes <= buckets (checked by `visits`).
        unsafe {
            gpu.launch_raw(
                &function,
                (grid, ROUTE_THREADS, smem as u32),
                &mut params,
                true,
                "launching route_buckets",
            )
        }
    }

    /// `saap_hidden` then `saap_scores` (see `route.cu`).
    fn route_by_classifier(
        &self,
        gpu: &Gpu,
        c: &Classifier,
        queries: &CudaView<'_, f32>,
        step: &RouteStep,
        defines: &[(&str, String)],
        visits: &mut Visits,
    ) -> Result<()> {
        let (scratch, counters) = visits.scratch.as_ref().ok_or(KernelError::Unsupported {
            what: "visits of another partition (no classifier scratch)",
            value: 0,
            supported: "visits made by this partition's `visits`",
        })?;
        // Visits of another classifier partition would have scratch of its sizes.
        length(
            "classifier scratch (hidden units and logits)",
            self.kv_heads * c.group * (c.hidden + 2 * self.buckets),
            scratch.len(),
        )?;
        length(
            "classifier counters and flags",
            self.kv_heads * (1 + self.buckets),
            counters.len(),
        )?;
        let heads = self.kv_heads as u32;
        let q = queries.device_ptr(gpu.stream()).0;
        let hidden_units = gpu.address(scratch);
        let logits = hidden_units + (self.kv_heads * c.group * c.hidden * size_of::<f32>()) as u64;
        let hidden = c.hidden as u32;
        let (buckets, probes) = (self.buckets as u32, visits.visited.longest() as u32);
        let (offsets, ids) = (gpu.address(&self.ids.offsets), gpu.address(&self.ids.items));
        let (counters, visited) = (gpu.address(counters), gpu.address(&visits.visited.items));
        let flags = counters + (self.kv_heads * size_of::<u32>()) as u64;
        let function = gpu.kernel(SOURCE, "saap_hidden", defines)?;
        let (w1, b1) = (gpu.address(&c.w1), gpu.address(&c.b1));
        let mut builder = gpu.stream().launch_builder(&function);
        builder
            .arg(&q)
            .arg(&w1)
            .arg(&b1)
            .arg(&hidden)
            .arg(&hidden_units)
            .arg(&buckets)
            .arg(&offsets)
            .arg(&ids)
            .arg(&step.candidates.start)
            .arg(&step.candidates.end)
            .arg(&flags);
        let config = LaunchConfig {
            grid_dim: (heads, c.hidden.div_ceil(SAAP_ROWS) as u32, 1),
            block_dim: (SAAP_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        // Safety: the arguments match `saap_hidden`'s signature; the queries hold
        // `kv_heads * group * head_dim` floats (checked by `route`), w1 and b1 every head's
        // `hidden * head_dim` and `hidden` (checked by `classifier`), the scratch
        // `kv_heads * group * hidden` floats before the logits, the ids' CSR
        // `kv_heads * buckets` lists (and the empty one), the flags `kv_heads * buckets` words
        // after the counters.
        unsafe { builder.launch(config) }.map_err(driver("launching saap_hidden"))?;

        let function = gpu.kernel(SOURCE, "saap_scores", defines)?;
        let [w2, b2, centroids, mean_keys, prior, share] =
            [&c.w2, &c.b2, &c.centroids, &c.mean_keys, &c.prior, &c.share].map(|b| gpu.address(b));
        let inv_freq = gpu.address(&c.inv_freq);
        let interleaved = u32::from(c.interleaved);
        let position = step.position as u64;
        let mut params = [
            param(&q),
            param(&hidden_units),
            param(&w2),
            param(&b2),
            param(&centroids),
            param(&mean_keys),
            param(&prior),
            param(&share),
            param(&inv_freq),
            param(&interleaved),
            param(&position),
            param(&hidden),
            param(&buckets),
            param(&probes),
            param(&logits),
            param(&flags),
            param(&counters),
            param(&visited),
        ];
        let grid = (heads, self.buckets.div_ceil(SAAP_BUCKETS) as u32);
        let shared = Classifier::shared_bytes(c.group, self.head_dim, self.buckets) as u32;
        // A programmatic dependent launch: its blocks load and rotate the queries while
        // `saap_hidden` runs, and wait for it before reading what it wrote.
        // Safety: `params` points at one value for each of `saap_scores`'s parameters, in
        // order and of its types, alive until the call returns; every buffer holds what
        // `route.cu` reads and writes for `kv_heads` heads of this partition's buckets,
        // hidden units and group (checked by `classifier` and `route`), the shared memory is
        // within what a block gets without opting in (checked by `classifier`), and the
        // counters start at zero and are reset by the last block of each head.
        unsafe {
            gpu.launch_raw(
                &function,
                (grid, SAAP_THREADS, shared),
                &mut params,
                true,
                "launching saap_scores",
            )
        }
    }

    /// [`Partition::route`] then [`crate::bucket_attention`] over the visits (rows of `kv`
    /// with `runs` attended whole, and `dense`), launched back to back: on Hopper the
    /// attention's blocks start while routing runs (programmatic dependent launch), and
    /// only those that attend the visited buckets wait for it. The same results as the two
    /// calls; everything the attention reads but the visits (queries, rows, workspace,
    /// `follow`: ids attended besides the visits) must be ready before this call, as for
    /// them.
    #[allow(clippy::too_many_arguments)]
    pub fn route_and_attend<'k, T: KvElement>(
        &self,
        gpu: &Gpu,
        route_queries: &CudaView<'_, f32>,
        step: &RouteStep,
        visits: &mut Visits,
        workspace: &mut Workspace,
        query: Query<'_, T>,
        dense: Dense<'_, T>,
        kv: impl Into<KvRows<'k, T>>,
        runs: &[Range<u32>],
        follow: Option<Followed<'_>>,
        out: &mut CudaViewMut<'_, f32>,
    ) -> Result<()> {
        self.route(gpu, route_queries, step, visits)?;
        let part = Buckets {
            follow,
            ..self.list_part(visits, kv.into(), runs)
        };
        bucket_attention_after_route(gpu, workspace, query, dense, part, out)
    }
}
