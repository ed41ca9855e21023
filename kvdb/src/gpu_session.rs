//! Queries on the GPU (feature `gpu`): the model's forward pass runs on the device, and at
//! every retrieval layer [`GpuSession`] attends with the retrieval kernels over the corpus's
//! keys and values ([`GpuCorpusKv`]: rotated once per corpus and shared by every query) and
//! the query's own tail, which the sequence keeps. The selection statistics and the dense
//! policy are the CPU's ([`QueryState`]).
//!
//! The corpus's rows are resident on the GPU when they fit (or as [`GpuKv`] says); else the
//! first retrieval layers that fit are, and each other retrieval layer keeps its rows in
//! pinned host memory mapped into the GPU's address space (`HostKv`). Routing on the GPU
//! then goes through a cache of whole buckets of the question's own (`BucketCache`, of the
//! layer's block cache budget, while the GPU has the memory): an inverted list's ids are
//! scattered over the corpus, so a cache of token blocks would copy mostly rows nobody asked
//! for. At each step the visits come to the host (a wait for routing), the buckets the cache
//! lacks are copied in, and the bucket launch reads them from there; without a budget
//! (`GpuKv::Host` of 0 bytes) or the memory, the visited rows are read in place over PCIe at
//! every step. A selection searched on the CPU goes through a GPU cache of hot blocks
//! (`BlockCache`, allocated by the first question that needs it): every step's selected ids
//! and the corpus's sinks and window are gathered into it (the missing blocks copied straight
//! from mapped host memory in one launch) and attended from there; queries take turns at a
//! layer's cache. With no cache (`GpuKv::Host`
//! of 0 bytes) those rows are read in place too. Such a corpus cannot be attended in full.
//!
//! How a retrieval layer selects depends on the index:
//! - an index that says how to route on the GPU (`BucketIndex::gpu_routing`: `ivf…,norope,all`
//!   by its centroids, saap by its classifier and geometric expert) is routed there: the
//!   step's pre-RoPE queries pick each KV head's buckets and `bucket_attention` attends to
//!   every key of them, the corpus's sinks and window and the tail
//!   (`Partition::route_and_attend`: the attention's launch starts while routing runs): no
//!   host round trip;
//!   A query that follows its most attended tokens (`--follow`) does so there too: after the
//!   step's last position `follow_most_attended` ranks what each KV head attended and writes
//!   the successors of the most weighed for the layer's next step, whose bucket launch
//!   attends them besides its buckets ([`RoutedFollowing`]);
//! - every other index searches on CPU threads: the layer's queries are copied to the host
//!   once per call and the selection is uploaded as each KV head's list for
//!   `retrieval_attention`, with the corpus's sinks and window as runs and the tail dense.
//!
//! Under full attention every corpus row is attended densely, with the tail as the list.
//! Provenance is computed on the GPU as well: after each answer token's attention,
//! `attention_mass` adds the weight every attended corpus token received to a buffer that is
//! read once, when the answer is complete. It runs on a stream of its own ([`Provenance`]),
//! beside the rest of the layer (the output projection and the MLP), since nothing of the
//! step waits for it; the next attention launch, which reuses the workspace it reads, waits
//! for it.

use std::collections::{BTreeMap, HashMap};
use std::ops::Range;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use candle_core::Tensor;
use half::f16;
use kvdb_index::BucketScores;
use kvdb_kernels::cudarc::driver::sys::{CUevent_flags, CUresult};
use kvdb_kernels::cudarc::driver::CudaViewMut;
use kvdb_kernels::cudarc::driver::{CudaEvent, CudaSlice, CudaView};
use kvdb_kernels::{
    attention_mass, attention_weights, bucket_attention, follow_most_attended, retrieval_attention,
    BlockCache, BucketCache, Buckets, CacheStats, ClassifierHead, Csr, Dense, FollowScratch,
    Followed, HostKv, KernelError, KvCache, KvRows, ListPart, Partition, Query, RouteRope,
    RouteStep, Selected, Visits, Workspace, MAX_VISITED_BUCKETS, NO_TOKEN,
};
use kvdb_model::{
    ExternalAttention, Forward, GpuModel, LayerAttention, LayerCall, Logits, ModelError, Rope,
    SequenceOptions,
};

use crate::error::{Error, Result};
use crate::generate::{
    continue_generation, generate_batch, BatchSteps, GenerateOptions, Generation,
};
use crate::indexes::IndexSet;
use crate::ingest::ModelRef;
use crate::session::{backend_failed, Corpus, GpuKv, QueryState, Step, StepPlace};

/// Tokens per block of a layer kept in host memory: the unit its GPU cache copies. Selections
/// are scattered (a top-k's ids, an inverted list's keys), so a block mostly brings one
/// selected token: 16 tokens (4 KiB of keys at head dim 128) copy little besides it, and the
/// cache's tables stay small.
const HOST_BLOCK_TOKENS: usize = 16;

/// Host memory that must stay available after a corpus layer is pinned: for the rest of this
/// process (a question's buffers, the store's reads) and the system. The Qwen2.5-7B-1M shape at
/// 1M tokens pinned 54 GiB beside a 55 GB store on a tmpfs and kept 9.5 GiB available at its
/// peak (docs/gpu-runs/2026-11-29-qwen-1m-host/).
const HOST_RESERVE_BYTES: usize = 2 << 30;

/// Bytes of memory the host has available for new allocations without swapping (Linux's
/// `MemAvailable`: free memory and the page cache it can reclaim; a tmpfs's files are not
/// reclaimable), `None` where that cannot be read. A cgroup's limit is not read: its usage
/// counts the page cache it could reclaim (a store just read), so a bound from it would refuse
/// corpora that fit; in a container limited below the host, the limit can still be hit.
fn host_available() -> Option<usize> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok()?;
    mem_available(&meminfo)
}

/// `MemAvailable` of a `/proc/meminfo` text, in bytes.
fn mem_available(meminfo: &str) -> Option<usize> {
    let line = meminfo.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let mut fields = line.split_whitespace().skip(1);
    let kib: usize = fields.next()?.parse().ok()?;
    (fields.next() == Some("kB")).then(|| kib.saturating_mul(1024))
}

/// [`Error::HostMemory`] when pinning `needed` more bytes (the next of `layers` host layers of
/// `corpus`, `pinned` before it) would leave less than [`HOST_RESERVE_BYTES`] of the host
/// memory `available` (unchecked when that is unknown). Checked layer by layer as they are
/// pinned, not once before: what is available moves meanwhile (a model's host copy released,
/// the store's reads cached), and a check of the whole beforehand refused the 1M-token run
/// that then pinned 54 GiB with 9.5 GiB to spare.
fn ensure_host_memory(
    corpus: &str,
    (pinned, layers): (usize, usize),
    needed: usize,
    available: Option<usize>,
) -> Result<()> {
    match available {
        Some(available) if needed.saturating_add(HOST_RESERVE_BYTES) > available => {
            Err(Error::HostMemory {
                corpus: corpus.to_string(),
                layers,
                pinned,
                needed,
                available,
                reserve: HOST_RESERVE_BYTES,
            })
        }
        _ => Ok(()),
    }
}

/// A corpus's retrieval layers' keys (rotated at their positions) and values for one GPU,
/// f16 `[kv_heads, tokens, head_dim]` per layer: what every query's retrieval reads.
pub(crate) struct GpuCorpusKv {
    /// The corpus's name (for errors).
    corpus: String,
    /// Per layer of the model; `None` for layers that do not retrieve.
    layers: Vec<Option<CorpusLayer>>,
    /// The GPU they are on.
    gpu: Arc<kvdb_model::Gpu>,
    /// The bucket partitions of index sets routed on the GPU, by the set's spec (`None`
    /// for a set that cannot be), built by the first query through each.
    partitions: Mutex<HashMap<String, Option<Arc<GpuPartitions>>>>,
    /// Seconds the upload spent reading the store and copying to the GPU.
    stages: Vec<(&'static str, f64)>,
    /// The bucket caches' lookups of the questions routed on the GPU so far, all layers
    /// together, added as each question closes ([`BucketCache`]: a question's own).
    bucket_lookups: Mutex<CacheStats>,
}

/// Where one retrieval layer's corpus rows are.
enum CorpusLayer {
    /// On the GPU.
    Resident(KvCache<f16>),
    /// In pinned host memory, read in place, and behind a GPU block cache for selections
    /// searched on the CPU unless the caches have no memory (boxed: its tables are large
    /// next to a resident layer's handles).
    Host {
        rows: Arc<HostKv<f16>>,
        cache: Option<Box<LazyCache>>,
    },
}

impl CorpusLayer {
    /// The rows as the kernels read them: on the GPU, or in place in host memory.
    fn rows(&self) -> KvRows<'_, f16> {
        match self {
            CorpusLayer::Resident(kv) => kv.into(),
            CorpusLayer::Host { rows, .. } => (&**rows).into(),
        }
    }
}

/// A layer's GPU block cache, allocated by the first question that searches the layer on
/// the CPU: questions routed on the GPU never use it (each takes a bucket cache of the same
/// budget for the time it runs, [`Routes::cache_buckets`]), so a corpus only they ask keeps
/// that GPU memory free between questions. Questions take turns at the cache.
struct LazyCache {
    /// The GPU memory the cache takes.
    bytes: usize,
    /// `None` until a question needs the cache.
    layer: Mutex<Option<HostLayer>>,
}

impl LazyCache {
    /// Runs `use_cache` on the layer's cache, allocated (on `gpu`, in front of the layer's
    /// `rows`) if this is its first use; the cache is locked meanwhile.
    fn with<R>(
        &self,
        gpu: &kvdb_model::Gpu,
        rows: &Arc<HostKv<f16>>,
        (corpus, layer): (&str, usize),
        use_cache: impl FnOnce(&mut HostLayer) -> Result<R>,
    ) -> Result<R> {
        let mut slot = self
            .layer
            .lock()
            .map_err(|_| Error::Internal("an earlier query panicked at a block cache".into()))?;
        let host = match &mut *slot {
            Some(host) => host,
            empty => {
                let allocated = BlockCache::new(gpu, rows.clone(), self.bytes).and_then(|cache| {
                    // Allocated (and zeroed) on `gpu`'s stream: done before any other
                    // question's stream may use it.
                    gpu.synchronize()?;
                    Ok(HostLayer {
                        cache,
                        released: gpu.event()?,
                    })
                });
                match allocated {
                    Ok(host) => empty.insert(host),
                    Err(KernelError::Driver { source, .. })
                        if source.0 == CUresult::CUDA_ERROR_OUT_OF_MEMORY =>
                    {
                        return Err(Error::GpuCacheMemory {
                            corpus: corpus.to_string(),
                            layer,
                            bytes: self.bytes,
                            free: gpu.free_memory().unwrap_or(0),
                        })
                    }
                    Err(e) => return Err(ModelError::from(e).into()),
                }
            }
        };
        use_cache(host)
    }

    /// The cache as it is now (`None` before its first use), for its sizes and counts.
    fn peek<R>(&self, look: impl FnOnce(&HostLayer) -> R) -> Option<R> {
        // A query that panicked holding the lock left the tables as they were: their sizes
        // and counts are still right.
        let slot = self.layer.lock().unwrap_or_else(|p| p.into_inner());
        slot.as_ref().map(look)
    }
}

/// A layer's GPU cache in front of its rows in host memory.
struct HostLayer {
    cache: BlockCache<f16>,
    /// Recorded after the last query's launches that read the cache: the next query's stream
    /// waits for it before the cache's slots change (queries may run on streams of their own).
    released: CudaEvent,
}

/// What uploading a corpus to the GPU did: the bytes kept there and in pinned host memory,
/// and the seconds each stage took (reading the store, copying to the GPU, and for a corpus
/// kept in host memory copying back to it; reading overlaps the rest, a layer read while the
/// one before is copied).
#[derive(Debug, Clone, Default)]
pub struct GpuUpload {
    /// Bytes of GPU memory: the resident layers' keys and values and the block caches in
    /// front of the rest allocated so far.
    pub bytes: usize,
    /// The block caches' part of `bytes`.
    pub cache_bytes: usize,
    /// Bytes of GPU memory the block caches take once allocated: each by the first question
    /// that searches its layer on the CPU; a question routed on the GPU takes as much for
    /// its own bucket caches while it runs.
    pub cache_budget: usize,
    /// Bytes of keys and values in pinned host memory (0 when they are on the GPU).
    pub host_bytes: usize,
    /// Seconds per stage, in order.
    pub stages: Vec<(&'static str, f64)>,
}

/// What a corpus holds for GPU questions, and what its block caches did so far.
#[derive(Debug, Clone, Copy, Default)]
pub struct GpuFootprint {
    /// Bytes of GPU memory: the resident layers' keys and values and the block caches in
    /// front of the rest allocated so far.
    pub gpu_bytes: usize,
    /// The block caches' part of `gpu_bytes`.
    pub cache_bytes: usize,
    /// Bytes of GPU memory the block caches take once allocated ([`GpuUpload::cache_budget`]).
    pub cache_budget: usize,
    /// Bytes of keys and values in pinned host memory (0 when they are on the GPU).
    pub host_bytes: usize,
    /// The block caches' lookups, all layers together, and those of the bucket caches of
    /// the questions routed on the GPU (a bucket a step visits counts as a lookup); none when
    /// the rows are on the GPU.
    pub cache: CacheStats,
    /// Bytes of GPU memory of the partitions that questions routed on the GPU uploaded (not
    /// in `gpu_bytes`): centroids or classifiers, the lists' ids, and every row's bucket
    /// once a question followed ids.
    pub routing_bytes: usize,
}

/// An index set's partitions on the GPU, per layer of the model (`None` for layers that do
/// not retrieve), each with the buckets a search probes.
struct GpuPartitions {
    layers: Vec<Option<(Partition, usize)>>,
}

impl GpuPartitions {
    /// Bytes of GPU memory the partitions take.
    fn bytes(&self) -> usize {
        self.layers.iter().flatten().map(|(p, _)| p.bytes()).sum()
    }

    /// `set`'s partitions when every index of it says how the GPU routes it
    /// (`BucketIndex::gpu_routing`), all of one kind within a layer with the same buckets
    /// per KV head, at most [`kvdb_kernels::MAX_ROUTED_BUCKETS`], and probes at most
    /// [`MAX_VISITED_BUCKETS`], and the routing kernels take the shapes (a classifier's
    /// units fit a block's shared memory); else `None`: the CPU searches. `ropes` are the
    /// model's, per layer (a classifier's geometric expert rotates with its layer's), and
    /// `group` its query heads per KV head.
    fn build(
        set: &IndexSet,
        gpu: &kvdb_model::Gpu,
        ropes: &[&Rope],
        group: usize,
        d: usize,
    ) -> Result<Option<Self>> {
        let mut layers: Vec<Option<(Partition, usize)>> = ropes.iter().map(|_| None).collect();
        for layer in set.layers() {
            let routings = layer
                .heads
                .iter()
                .map(|index| index.as_buckets().and_then(|b| b.gpu_routing()))
                .collect::<Option<Vec<_>>>();
            let Some(routings) = routings else {
                return Ok(None);
            };
            let Some(first) = routings.first() else {
                return Ok(None);
            };
            let buckets = first.lists.len();
            // Ids every search visits (ivf's hot keys): one more list a head, where any has.
            let always: Vec<Vec<u32>> = match routings.iter().any(|r| !r.always.is_empty()) {
                true => routings.iter().map(|r| r.always.to_vec()).collect(),
                false => Vec::new(),
            };
            // More probes than a bucket launch visits search on the CPU instead.
            let differ = routings
                .iter()
                .any(|r| r.lists.len() != buckets || r.probes != first.probes);
            if differ || first.probes + usize::from(!always.is_empty()) > MAX_VISITED_BUCKETS {
                return Ok(None);
            }
            let rope = ropes.get(layer.layer).ok_or_else(|| {
                Error::Internal(format!("index of layer {} past the model", layer.layer))
            })?;
            let lists: Vec<Vec<u32>> = routings.iter().flat_map(|r| r.lists).cloned().collect();
            let partition = match first.scores {
                BucketScores::Centroids(_) => {
                    let centroids = routings
                        .iter()
                        .map(|r| match r.scores {
                            BucketScores::Centroids(c) => Some(c),
                            BucketScores::Classifier { .. } => None,
                        })
                        .collect::<Option<Vec<&[f32]>>>();
                    let Some(centroids) = centroids else {
                        return Ok(None);
                    };
                    let centroids: Vec<f32> = centroids.concat();
                    Partition::new(gpu, &centroids, &lists, &always, routings.len(), d)
                }
                BucketScores::Classifier { .. } => {
                    let heads = routings
                        .iter()
                        .map(|r| match r.scores {
                            BucketScores::Classifier {
                                head,
                                mean_keys,
                                share,
                            } => Some(ClassifierHead {
                                centroids: &head.centroids,
                                w1: &head.w1,
                                b1: &head.b1,
                                w2: &head.w2,
                                b2: &head.b2,
                                prior: head.prior,
                                mean_keys,
                                share,
                            }),
                            BucketScores::Centroids(_) => None,
                        })
                        .collect::<Option<Vec<ClassifierHead<'_>>>>();
                    let Some(heads) = heads else {
                        return Ok(None);
                    };
                    let rope = RouteRope {
                        inv_freq: rope.inv_freq(),
                        pairs: kvdb_model::rope_pairs(rope.style()),
                    };
                    Partition::classifier(gpu, &heads, &lists, d, group, rope)
                }
            };
            let partition = match partition {
                Ok(partition) => partition,
                // Shapes the routing kernels do not take (too many buckets, a classifier
                // too wide for a block): the CPU searches.
                Err(KernelError::Unsupported { .. }) => return Ok(None),
                Err(e) => return Err(ModelError::from(e).into()),
            };
            layers[layer.layer] = Some((partition, first.probes));
        }
        Ok(Some(Self { layers }))
    }
}

impl std::fmt::Debug for GpuCorpusKv {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GpuCorpusKv")
            .field(
                "layers",
                &self.layers.iter().filter(|l| l.is_some()).count(),
            )
            .finish_non_exhaustive()
    }
}

impl GpuCorpusKv {
    /// Reads every retrieval layer's keys and values from the store and uploads them as
    /// stored (f16), the keys rotated on the GPU as the model's own keys are; kept there, or
    /// copied to pinned host memory behind a block cache, as `placement` says.
    pub(crate) fn build(
        corpus: &Corpus,
        model: ModelRef<'_>,
        gpu: &GpuModel,
        retrieval_layers: &[usize],
        n: usize,
        placement: GpuKv,
    ) -> Result<Self> {
        let config = model.model.config();
        let (kv_heads, d) = (config.n_kv_heads, config.head_dim);
        // Said before anything is read, rather than as the driver's out-of-memory error
        // halfway through; the rest of the query needs far less than the 1/16 kept free.
        let layer_bytes = 2 * kv_heads * n * d * size_of::<f16>();
        let layers_in_all = retrieval_layers.len();
        // Room is kept for the partitions of an index routed on the GPU, whichever a question
        // asks for (`GpuPartitions`): the lists' ids and every row's bucket, 4 bytes each a
        // row and KV head (1.6% of the rows' bytes at head dim 128), beside the centroids.
        let routing = layers_in_all * 2 * kv_heads * n * size_of::<u32>();
        let needed = layers_in_all * layer_bytes + routing;
        let free = gpu.gpu().free_memory().map_err(ModelError::from)?;
        let usable = free - free / 16;
        // The first layers that fit in `budget` on the GPU, and the GPU memory of the block
        // caches in front of the rest: half of what is left beside the routing.
        let for_rows = usable.saturating_sub(routing);
        let split = |budget: usize| {
            let on_gpu = (budget.min(for_rows) / layer_bytes.max(1)).min(layers_in_all);
            (on_gpu, (for_rows - on_gpu * layer_bytes) / 2)
        };
        // Layers kept on the GPU, and the block caches' memory.
        let (on_gpu, caches) = match placement {
            GpuKv::Resident if needed > usable => {
                return Err(Error::GpuMemory {
                    corpus: corpus.manifest().name.clone(),
                    needed,
                    free,
                })
            }
            GpuKv::Resident => (layers_in_all, 0),
            GpuKv::Auto if needed <= usable => (layers_in_all, 0),
            GpuKv::Auto => split(usable - usable / 8),
            GpuKv::Split { gpu_bytes } => split(gpu_bytes),
            GpuKv::Host { cache_bytes } => (0, cache_bytes.unwrap_or(free / 2)),
        };
        // One thread reads the layers from the store (each by every core, f16 as stored)
        // while this one uploads the layer read before and the GPU rotates its keys: at most
        // three layers are on the host at once (one read, one waiting, one uploading).
        let mut resident: Vec<(usize, KvCache<f16>)> = Vec::new();
        let mut hosted: Vec<(usize, HostKv<f16>)> = Vec::new();
        let mut copying = Duration::ZERO;
        let reading = std::thread::scope(|scope| -> Result<Duration> {
            let (send, read) = std::sync::mpsc::sync_channel(1);
            let reader = scope.spawn(move || {
                let mut reading = Duration::ZERO;
                for &layer in retrieval_layers {
                    let started = Instant::now();
                    let rows = corpus.layer_kv_f16(layer, 0..n);
                    reading += started.elapsed();
                    // The uploader stopped (an error): so does the reading.
                    if send.send((layer, rows)).is_err() {
                        break;
                    }
                }
                reading
            });
            for (layer, rows) in read {
                let (keys, values) = rows?;
                let started = Instant::now();
                let kv = gpu.rotated_kv(layer, &keys, &values, 0..n)?;
                if resident.len() < on_gpu {
                    resident.push((layer, kv));
                } else {
                    // Pinned memory is never paged out: a layer the host cannot hold would
                    // have the kernel kill the process halfway through the copy.
                    ensure_host_memory(
                        &corpus.manifest().name,
                        (hosted.len(), layers_in_all - on_gpu),
                        layer_bytes,
                        host_available(),
                    )?;
                    // Rotated on the GPU, then back to the host: one layer on the GPU at a
                    // time.
                    hosted.push((
                        layer,
                        HostKv::from_device(gpu.gpu(), &kv, HOST_BLOCK_TOKENS)
                            .map_err(ModelError::from)?,
                    ));
                }
                gpu.gpu().synchronize().map_err(ModelError::from)?;
                copying += started.elapsed();
            }
            reader
                .join()
                .map_err(|_| Error::Internal("the store reader panicked".into()))
        })?;
        let mut layers: Vec<Option<CorpusLayer>> = (0..config.n_layers()).map(|_| None).collect();
        for (layer, kv) in resident {
            layers[layer] = Some(CorpusLayer::Resident(kv));
        }
        let per_layer = caches / hosted.len().max(1);
        for (layer, host) in hosted {
            let rows = Arc::new(host);
            // No more than the layer's rows: a larger cache only makes its tables larger.
            // Checked now, allocated by the first question that needs it.
            let cache = match per_layer.min(rows.bytes()) {
                0 => None,
                bytes => {
                    BlockCache::slots_for(&rows, bytes).map_err(ModelError::from)?;
                    Some(Box::new(LazyCache {
                        bytes,
                        layer: Mutex::new(None),
                    }))
                }
            };
            layers[layer] = Some(CorpusLayer::Host { rows, cache });
        }
        let copied = if on_gpu < layers_in_all {
            "copying to the GPU and back to pinned host memory"
        } else {
            "copying to the GPU"
        };
        Ok(Self {
            corpus: corpus.manifest().name.clone(),
            layers,
            gpu: gpu.gpu().clone(),
            partitions: Mutex::new(HashMap::new()),
            bucket_lookups: Mutex::new(CacheStats::default()),
            stages: vec![
                ("reading the store", reading.as_secs_f64()),
                (copied, copying.as_secs_f64()),
            ],
        })
    }

    /// Whether any layer's rows are in host memory rather than on the GPU.
    fn in_host_memory(&self) -> bool {
        self.layers
            .iter()
            .flatten()
            .any(|layer| matches!(layer, CorpusLayer::Host { .. }))
    }

    /// `set`'s bucket partitions on the GPU when the set routes there, built on first use.
    fn partitions(
        &self,
        set: &IndexSet,
        ropes: &[&Rope],
        group: usize,
        d: usize,
    ) -> Result<Option<Arc<GpuPartitions>>> {
        let mut cached = self.partitions.lock().map_err(|_| {
            Error::Internal("an earlier query panicked uploading a partition".into())
        })?;
        let spec = set.built_spec();
        if let Some(partitions) = cached.get(&spec) {
            return Ok(partitions.clone());
        }
        let partitions = GpuPartitions::build(set, &self.gpu, ropes, group, d)?.map(Arc::new);
        cached.insert(spec, partitions.clone());
        Ok(partitions)
    }

    /// Whether these rows are on `gpu`'s device.
    pub(crate) fn is_on(&self, gpu: &GpuModel) -> bool {
        Arc::ptr_eq(&self.gpu, gpu.gpu())
    }

    /// What the upload did.
    pub(crate) fn upload(&self) -> GpuUpload {
        let footprint = self.footprint();
        GpuUpload {
            bytes: footprint.gpu_bytes,
            cache_bytes: footprint.cache_bytes,
            cache_budget: footprint.cache_budget,
            host_bytes: footprint.host_bytes,
            stages: self.stages.clone(),
        }
    }

    /// The memory the rows take and the block caches' lookups so far.
    pub(crate) fn footprint(&self) -> GpuFootprint {
        let mut footprint = GpuFootprint::default();
        for layer in self.layers.iter().flatten() {
            match layer {
                CorpusLayer::Resident(kv) => {
                    footprint.gpu_bytes +=
                        2 * kv.kv_heads() * kv.tokens() * kv.head_dim() * size_of::<f16>();
                }
                CorpusLayer::Host { rows, cache } => {
                    footprint.host_bytes += rows.bytes();
                    let Some(cache) = cache else { continue };
                    footprint.cache_budget += cache.bytes;
                    let Some((bytes, stats)) =
                        cache.peek(|host| (host.cache.bytes(), host.cache.stats()))
                    else {
                        continue;
                    };
                    footprint.gpu_bytes += bytes;
                    footprint.cache_bytes += bytes;
                    footprint.cache.hits += stats.hits;
                    footprint.cache.misses += stats.misses;
                    footprint.cache.bytes_copied += stats.bytes_copied;
                }
            }
        }
        if let Ok(partitions) = self.partitions.lock() {
            footprint.routing_bytes = partitions.values().flatten().map(|p| p.bytes()).sum();
        }
        if let Ok(lookups) = self.bucket_lookups.lock() {
            footprint.cache.hits += lookups.hits;
            footprint.cache.misses += lookups.misses;
            footprint.cache.bytes_copied += lookups.bytes_copied;
        }
        footprint
    }
}

/// Answers `ids` after `corpus` on the GPU: the sequence keeps the sliding windows and the
/// tail, [`GpuSession`] attends at the retrieval layers.
pub(crate) fn generate<'c>(
    corpus: &'c Corpus,
    model: ModelRef<'_>,
    gpu: &GpuModel,
    session: QueryState<'c>,
    ids: &[u32],
    options: &GenerateOptions,
    on_text: &mut dyn FnMut(&str) -> Result<()>,
) -> Result<(Generation, QueryState<'c>)> {
    let tail = ids.len() + options.max_tokens;
    with_sequence(corpus, model, gpu, session, tail, &mut |sequence| {
        continue_generation(sequence, model.tokenizer, ids, options, on_text)
    })
}

/// The logits `[ids, vocab]` of `ids` run after `corpus` in one call on the GPU.
pub(crate) fn score(
    corpus: &Corpus,
    model: ModelRef<'_>,
    gpu: &GpuModel,
    session: QueryState<'_>,
    ids: &[u32],
) -> Result<Tensor> {
    let (logits, _) = with_sequence(corpus, model, gpu, session, ids.len(), &mut |sequence| {
        sequence
            .forward(ids, &Logits::All)?
            .ok_or_else(|| Error::Internal("the model returned no logits".into()))
    })?;
    Ok(logits)
}

/// Runs `work` on a GPU sequence after `corpus` with room for `tail` tokens of its own, its
/// retrieval layers attended by `session` (returned with `work`'s result).
fn with_sequence<'c, R>(
    corpus: &'c Corpus,
    model: ModelRef<'_>,
    gpu: &GpuModel,
    session: QueryState<'c>,
    tail: usize,
    work: &mut dyn FnMut(&mut dyn Forward) -> Result<R>,
) -> Result<(R, QueryState<'c>)> {
    let mut attention = GpuSession::open(corpus, model, gpu, session)?;
    let result = {
        let mut sequence = gpu.sequence_with(
            &SequenceOptions::default(),
            attention.external(corpus, model, tail),
        )?;
        preload_windows(corpus, &mut *sequence)?;
        work(&mut *sequence)?
    };
    Ok((result, attention.close(gpu)?))
}

/// Answers several questions (`ids`, each after `corpus`) together on the GPU, each with its
/// own state (`sessions`): the prompts one after another, then one batched step per answer
/// token, every unfinished answer's token in it (the weights read once for all of them), each
/// attending through its own [`GpuSession`]. `on_text(i, piece)` streams answer `i`.
pub(crate) fn generate_together<'c>(
    corpus: &'c Corpus,
    model: ModelRef<'_>,
    gpu: &GpuModel,
    sessions: Vec<QueryState<'c>>,
    ids: &[Vec<u32>],
    options: &GenerateOptions,
    on_text: &mut dyn FnMut(usize, &str) -> Result<()>,
) -> Result<(Vec<(Generation, QueryState<'c>)>, BatchSteps)> {
    let mut attention = sessions
        .into_iter()
        .map(|session| GpuSession::open(corpus, model, gpu, session))
        .collect::<Result<Vec<_>>>()?;
    let (generations, steps) = {
        let externals = attention
            .iter_mut()
            .zip(ids)
            .map(|(session, ids)| {
                Some(session.external(corpus, model, ids.len() + options.max_tokens))
            })
            .collect();
        let mut batch = gpu.batch_with(externals)?;
        for b in 0..ids.len() {
            preload_windows(corpus, batch.sequence(b)?)?;
        }
        generate_batch(&mut *batch, model.tokenizer, ids, options, on_text)?
    };
    let answers = generations
        .into_iter()
        .zip(attention)
        .map(|(generation, session)| Ok((generation, session.close(gpu)?)))
        .collect::<Result<Vec<_>>>()?;
    Ok((answers, steps))
}

/// Loads the corpus's stored sliding windows into `sequence`.
fn preload_windows(corpus: &Corpus, sequence: &mut dyn Forward) -> Result<()> {
    for window in corpus.windows() {
        let host = |t: &Tensor| -> Result<Vec<f32>> { Ok(t.flatten_all()?.to_vec1()?) };
        sequence.preload(
            window.layer,
            &host(&window.keys)?,
            &host(&window.values)?,
            window.positions.clone(),
        )?;
    }
    Ok(())
}

/// A query's routing on the GPU: the index set's partitions and the query's visits of each.
struct Routes {
    partitions: Arc<GpuPartitions>,
    /// Per layer of the model, as `partitions.layers`.
    visits: Vec<Option<Visits>>,
    /// Per layer of the model: the query's GPU cache of the buckets it visits, at a layer
    /// whose rows are in host memory ([`Routes::cache_buckets`]).
    caches: Vec<Option<BucketCache<f16>>>,
}

/// GPU memory a question's bucket caches leave free (its other buffers and the next
/// launches' need far less).
const BUCKET_CACHES_LEAVE: usize = 1 << 30;

impl Routes {
    /// Visits of `breadth` buckets per search (else each layer's own probes); `None` when
    /// `breadth` is more than a bucket launch visits (the CPU searches then).
    fn new(
        partitions: Arc<GpuPartitions>,
        gpu: &kvdb_model::Gpu,
        breadth: Option<usize>,
    ) -> Result<Option<Self>> {
        // The visits of a bucket launch: the probes and a partition's always-visited list.
        let too_many = |p: &Partition| {
            breadth.is_some_and(|b| b + p.lists_per_head() - p.buckets() > MAX_VISITED_BUCKETS)
        };
        if partitions.layers.iter().flatten().any(|(p, _)| too_many(p)) {
            return Ok(None);
        }
        let visits = partitions
            .layers
            .iter()
            .map(|layer| {
                layer
                    .as_ref()
                    .map(|(partition, probes)| {
                        let probes = breadth.unwrap_or(*probes).clamp(1, partition.buckets());
                        partition.visits(gpu, probes)
                    })
                    .transpose()
            })
            .collect::<kvdb_kernels::Result<Vec<_>>>()
            .map_err(ModelError::from)?;
        let caches = visits.iter().map(|_| None).collect();
        Ok(Some(Self {
            partitions,
            visits,
            caches,
        }))
    }

    /// Gives each routed layer whose rows are in host memory a cache of the buckets the
    /// query visits, of the layer's block cache budget (which a routed question leaves
    /// unused), while the GPU keeps [`BUCKET_CACHES_LEAVE`] free beside them: questions
    /// answered together each have their own, and those that find too little memory read
    /// their buckets in place, as with no budget (`--gpu-kv host:0`).
    fn cache_buckets(&mut self, gpu: &kvdb_model::Gpu, kv: &GpuCorpusKv) -> Result<()> {
        let layers = self.partitions.layers.iter().zip(&kv.layers);
        for ((routed, rows), cache) in layers.zip(&mut self.caches) {
            let (
                Some((partition, _)),
                Some(CorpusLayer::Host {
                    rows,
                    cache: Some(budget),
                }),
            ) = (routed, rows)
            else {
                continue;
            };
            let free = gpu.free_memory().map_err(ModelError::from)?;
            if free < budget.bytes + BUCKET_CACHES_LEAVE {
                break;
            }
            match BucketCache::new(gpu, partition, rows, budget.bytes) {
                Ok(made) => *cache = Some(made),
                // Another question took the memory meanwhile: this one reads in place.
                Err(KernelError::Driver { source, .. })
                    if source.0 == CUresult::CUDA_ERROR_OUT_OF_MEMORY =>
                {
                    break
                }
                Err(e) => return Err(ModelError::from(e).into()),
            }
        }
        Ok(())
    }
}

/// What a query that follows its most attended tokens follows at each layer routed on the
/// GPU: per KV head, the successors of the tokens the layer's last step weighed most, ranked
/// on the GPU after that step ([`follow_most_attended`]) and attended by the next step's
/// bucket launch besides its buckets, as the CPU's selection gains them
/// ([`crate::Retrieval::follow`]).
struct RoutedFollowing {
    /// Per layer of the model (`None` for a layer not routed): two lists of `[kv_heads,
    /// follow]` ids, the one the next step attends (`current`) and the one the ranking after
    /// it writes.
    layers: Vec<Option<([CudaSlice<u32>; 2], usize)>>,
    scratch: FollowScratch,
}

impl RoutedFollowing {
    /// Nothing followed yet at any routed layer of `routes`, `follow` ids per KV head; each
    /// routed partition's bucket map made for its layer's rows of `kv` (once per corpus).
    fn new(
        gpu: &kvdb_model::Gpu,
        routes: &Routes,
        kv: &GpuCorpusKv,
        kv_heads: usize,
        follow: usize,
    ) -> Result<Self> {
        let none = vec![NO_TOKEN; kv_heads * follow];
        let layers = routes
            .partitions
            .layers
            .iter()
            .zip(&kv.layers)
            .map(|(layer, rows)| match (layer, rows) {
                (Some((partition, _)), Some(rows)) => {
                    partition.bucket_of(gpu, rows.rows().tokens())?;
                    Ok(Some(([gpu.upload(&none)?, gpu.upload(&none)?], 0)))
                }
                _ => Ok(None),
            })
            .collect::<kvdb_kernels::Result<Vec<_>>>()
            .map_err(ModelError::from)?;
        Ok(Self {
            layers,
            scratch: FollowScratch::new(gpu).map_err(ModelError::from)?,
        })
    }
}

/// One query's attention at the retrieval layers of a GPU sequence.
struct GpuSession<'c, 'm> {
    /// The attention mass each corpus token received from the answer, once it starts.
    /// First, so that it is dropped first: its stream may still read the buffers below.
    provenance: Option<Provenance>,
    session: QueryState<'c>,
    kv: Arc<GpuCorpusKv>,
    /// Routing on the GPU, when the query's index allows it.
    routes: Option<Routes>,
    /// What each routed layer follows, when the query follows its most attended tokens.
    following: Option<RoutedFollowing>,
    /// Per layer, the CPU's RoPE (what the CPU searchers rotate with).
    ropes: Vec<&'m Rope>,
    workspace: Workspace,
    /// The lists of the last launch, rewritten for each.
    lists: Csr,
    /// Corpus tokens.
    n: usize,
    /// Query heads, KV heads, head dim.
    heads: (usize, usize, usize),
    /// Events around each stage's launches, when the query is profiled.
    timer: Option<StageTimer>,
    /// Per layer of the model, when the query follows its most attended tokens: the last
    /// step's selection and the weights its attention gave it, which the layer's next
    /// search reads.
    weighed: Vec<Option<Weighed>>,
}

/// A retrieval layer's selection at a step's last position and the weight each selected
/// token received there, summed over each KV head's group ([`attention_weights`]): on the
/// GPU until the layer's next step, whose search follows the most attended
/// ([`crate::Retrieval::follow`]). Read then, after the step's queries have come to the host,
/// so that the weights cost no wait of their own.
struct Weighed {
    /// Each KV head's selected ids, in the order the attention's lists held them.
    selected: Vec<Vec<u32>>,
    /// Where each KV head's weights start: a block cache's lists hold the dense runs after
    /// the selection.
    starts: Vec<usize>,
    /// One weight per item of the attention's lists.
    weights: CudaSlice<f32>,
}

impl Weighed {
    /// Weighs `part`, the workspace's last launch's selection: lists that hold each of
    /// `selected` followed by `extra` more ids.
    fn launch(
        gpu: &kvdb_model::Gpu,
        workspace: &Workspace,
        part: Selected<'_, f16>,
        selected: Vec<Vec<u32>>,
        extra: usize,
    ) -> Result<Self> {
        let mut starts = Vec::with_capacity(selected.len());
        let mut total = 0;
        for ids in &selected {
            starts.push(total);
            total += ids.len() + extra;
        }
        let mut weights = gpu.zeros::<f32>(total.max(1)).map_err(ModelError::from)?;
        attention_weights(gpu, workspace, part, &mut weights).map_err(ModelError::from)?;
        Ok(Self {
            selected,
            starts,
            weights,
        })
    }

    /// Each KV head's selected ids with their weights (waits for the weights).
    fn read(self, gpu: &kvdb_model::Gpu) -> Result<Vec<Vec<(f32, u32)>>> {
        let weights = download(gpu, &self.weights.as_view())?;
        gpu.synchronize().map_err(ModelError::from)?;
        Ok(self
            .selected
            .into_iter()
            .zip(self.starts)
            .map(|(ids, start)| {
                let weights = weights.get(start..start + ids.len()).unwrap_or_default();
                weights.iter().copied().zip(ids).collect()
            })
            .collect())
    }
}

/// Provenance: the attention mass each corpus token received, added up by `attention_mass`
/// after each attention launch, on a stream of its own beside the layer's remaining work (or
/// on the sequence's own stream in a batched step, [`LayerCall::own_stream`]).
struct Provenance {
    /// A handle on the model's device with a stream of its own.
    gpu: kvdb_kernels::Gpu,
    /// One weight per corpus token.
    mass: CudaSlice<f32>,
    /// Recorded on the model's stream after each attention launch the mass waits for.
    launched: CudaEvent,
    /// Recorded on this stream after each mass launch.
    done: CudaEvent,
    /// Whether a mass launch may still run (`done` not yet waited for).
    pending: bool,
}

impl Provenance {
    fn new(gpu: &kvdb_model::Gpu, n: usize) -> Result<Self> {
        Ok(Self {
            gpu: gpu.fork().map_err(ModelError::from)?,
            mass: gpu.zeros(n).map_err(ModelError::from)?,
            launched: gpu.event().map_err(ModelError::from)?,
            done: gpu.event().map_err(ModelError::from)?,
            pending: false,
        })
    }

    /// The session's provenance, started (for `n` corpus tokens) by the first answer token
    /// that counts.
    fn started<'p>(
        slot: &'p mut Option<Self>,
        gpu: &kvdb_model::Gpu,
        n: usize,
    ) -> Result<&'p mut Self> {
        Ok(match slot {
            Some(provenance) => provenance,
            empty => empty.insert(Self::new(gpu, n)?),
        })
    }

    /// Makes what `gpu` queues from now on wait for the last mass launch.
    fn join(&mut self, gpu: &kvdb_model::Gpu) -> Result<()> {
        if std::mem::take(&mut self.pending) {
            gpu.wait(&self.done).map_err(ModelError::from)?;
        }
        Ok(())
    }

    /// Adds the workspace's last launch's weights of `part`'s rows to the mass, once what
    /// `gpu` queued so far (that launch) has run ([`Provenance::beside`]).
    fn add<T: kvdb_kernels::KvElement>(
        &mut self,
        gpu: &kvdb_model::Gpu,
        own_stream: bool,
        timer: &mut Option<StageTimer>,
        workspace: &Workspace,
        part: ListPart<'_, T>,
    ) -> Result<()> {
        self.beside(gpu, own_stream, timer, "provenance", |side, mass| {
            attention_mass(side, workspace, part, mass)
        })
    }

    /// Launches `work` (stage `stage`, given the stream's handle and the mass) once what
    /// `gpu` queued so far has run: on `gpu`'s stream when it is the sequence's own
    /// (`own_stream`: nothing else waits behind it but this sequence's next launches, which
    /// would wait for the work anyway), else on this stream, beside the layer's remaining
    /// work; [`Provenance::join`] makes later launches wait for it.
    fn beside(
        &mut self,
        gpu: &kvdb_model::Gpu,
        own_stream: bool,
        timer: &mut Option<StageTimer>,
        stage: &'static str,
        work: impl FnOnce(&kvdb_model::Gpu, &mut CudaSlice<f32>) -> kvdb_kernels::Result<()>,
    ) -> Result<()> {
        let mass = &mut self.mass;
        if own_stream {
            return StageTimer::time(timer, gpu, stage, || work(gpu, mass));
        }
        gpu.record(&self.launched).map_err(ModelError::from)?;
        self.gpu.wait(&self.launched).map_err(ModelError::from)?;
        let side = &self.gpu;
        StageTimer::time(timer, side, stage, || work(side, mass))?;
        self.gpu.record(&self.done).map_err(ModelError::from)?;
        self.pending = true;
        Ok(())
    }
}

impl Drop for Provenance {
    /// Buffers freed after this (the workspace's, the corpus's) may be in use by a mass
    /// launch still running on this stream (after an error, say): wait for it.
    fn drop(&mut self) {
        let _ = self.gpu.synchronize();
    }
}

/// GPU time per stage of a query's attention layers, from CUDA events recorded around each
/// stage's launches and read once, when the query is done.
#[derive(Default)]
struct StageTimer {
    marks: Vec<(&'static str, CudaEvent, CudaEvent)>,
}

impl StageTimer {
    /// Runs `work` (launches on `gpu`'s stream) as `stage`, between two events when `timer`
    /// is on.
    fn time<R>(
        timer: &mut Option<Self>,
        gpu: &kvdb_model::Gpu,
        stage: &'static str,
        work: impl FnOnce() -> kvdb_kernels::Result<R>,
    ) -> Result<R> {
        let work = || work().map_err(|e| Error::from(ModelError::from(e)));
        let Some(timer) = timer else {
            return work();
        };
        let event = || {
            gpu.stream()
                .record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
                .map_err(|source| {
                    ModelError::from(KernelError::Driver {
                        op: "recording a timing event",
                        source,
                    })
                })
        };
        let start = event()?;
        let result = work()?;
        timer.marks.push((stage, start, event()?));
        Ok(result)
    }

    /// Seconds per stage (waits for the last event).
    fn seconds(self) -> Result<BTreeMap<&'static str, f64>> {
        let mut totals = BTreeMap::new();
        for (stage, start, end) in self.marks {
            let ms = start.elapsed_ms(&end).map_err(|source| {
                ModelError::from(KernelError::Driver {
                    op: "reading a timing event",
                    source,
                })
            })?;
            *totals.entry(stage).or_insert(0.0) += f64::from(ms) / 1000.0;
        }
        Ok(totals)
    }
}

impl LayerAttention for GpuSession<'_, '_> {
    fn attend(&mut self, call: LayerCall<'_>) -> kvdb_model::Result<()> {
        let layer = call.layer;
        self.attend_call(call).map_err(|e| backend_failed(layer, e))
    }
}

impl<'c, 'm> GpuSession<'c, 'm> {
    /// A query's attention on the GPU after `corpus` with its state `session`: the corpus's
    /// rows on the GPU (uploaded by the first query), and its index's routing there when
    /// the index allows it.
    fn open(
        corpus: &'c Corpus,
        model: ModelRef<'m>,
        gpu: &GpuModel,
        session: QueryState<'c>,
    ) -> Result<Self> {
        if session.estimates() {
            return Err(Error::NotOnGpu {
                what: "estimating unvisited buckets (`estimate`)",
            });
        }
        let kv = corpus.gpu_kv(model, gpu)?;
        if session.full_attention() && kv.in_host_memory() {
            return Err(Error::FullAttentionFromHost {
                corpus: kv.corpus.clone(),
            });
        }
        let config = model.model.config();
        let n = corpus.manifest().tokens;
        let ropes = (0..config.n_layers())
            .map(|l| model.model.rope(l))
            .collect::<Option<Vec<&Rope>>>()
            .ok_or_else(|| Error::Internal("a layer of the model has no RoPE".into()))?;
        let routes = match session.index_set() {
            Some(set) => match kv.partitions(
                set,
                &ropes,
                config.n_heads / config.n_kv_heads.max(1),
                config.head_dim,
            )? {
                Some(partitions) => match Routes::new(partitions, gpu.gpu(), session.breadth())? {
                    Some(mut routes) => {
                        routes.cache_buckets(gpu.gpu(), &kv)?;
                        Some(routes)
                    }
                    None => None,
                },
                None => None,
            },
            None => None,
        };
        let following = match (&routes, session.follow()) {
            (Some(routes), follow) if follow > 0 => Some(RoutedFollowing::new(
                gpu.gpu(),
                routes,
                &kv,
                config.n_kv_heads,
                follow,
            )?),
            _ => None,
        };
        let profile = session.profile;
        Ok(Self {
            session,
            kv,
            routes,
            following,
            ropes,
            workspace: Workspace::new(gpu.gpu()).map_err(ModelError::from)?,
            lists: Csr::from_lists::<&[u32]>(gpu.gpu(), &[]).map_err(ModelError::from)?,
            n,
            heads: (config.n_heads, config.n_kv_heads, config.head_dim),
            provenance: None,
            timer: profile.then(StageTimer::default),
            weighed: (0..config.n_layers()).map(|_| None).collect(),
        })
    }

    /// The retrieval layers of a sequence after `corpus`, attended by this session, with
    /// room for `tail` tokens of its own (what the model's context leaves at most).
    fn external<'s>(
        &'s mut self,
        corpus: &Corpus,
        model: ModelRef<'_>,
        tail: usize,
    ) -> ExternalAttention<'s> {
        let (n, context) = (self.n, model.model.config().context_length);
        ExternalAttention {
            layers: corpus.retrieval_layers().to_vec(),
            tail_capacity: tail.min(context.saturating_sub(n)).max(1),
            first_position: n,
            attention: self,
        }
    }

    /// The query's state once its sequence is done, with what the GPU counted: the stages'
    /// times, the attention mass (provenance) and the keys routing selected.
    fn close(self, gpu: &GpuModel) -> Result<QueryState<'c>> {
        let GpuSession {
            mut session,
            provenance,
            routes,
            timer,
            kv,
            ..
        } = self;
        if let Some(timer) = timer {
            session.gpu_stages = timer.seconds()?;
        }
        let device = gpu.gpu();
        if let Some(mut provenance) = provenance {
            provenance.join(device)?;
            session.add_mass(
                &device
                    .download(&provenance.mass)
                    .map_err(ModelError::from)?,
            );
        }
        for visits in routes.iter().flat_map(|r| r.visits.iter().flatten()) {
            let selected = visits.selected(device).map_err(ModelError::from)?;
            session.add_selected(selected as usize);
        }
        let mut lookups = kv.bucket_lookups.lock().unwrap_or_else(|p| p.into_inner());
        for cache in routes.iter().flat_map(|r| r.caches.iter().flatten()) {
            let stats = cache.stats();
            lookups.hits += stats.hits;
            lookups.misses += stats.misses;
            lookups.bytes_copied += stats.bytes_copied;
        }
        Ok(session)
    }

    fn attend_call(&mut self, mut call: LayerCall<'_>) -> Result<()> {
        let (h, kv_heads, d) = self.heads;
        let q = h * d;
        let n = self.n;
        let gpu = call.gpu;
        // The session's own handle: a layer's rows stay borrowed while `self` changes.
        let kv = self.kv.clone();
        let layer_rows = kv
            .layers
            .get(call.layer)
            .and_then(Option::as_ref)
            .ok_or_else(|| {
                Error::Internal(format!("layer {} has no keys for the GPU", call.layer))
            })?;
        // Full attention needs the rows on the GPU; `open` refused it over rows in host
        // memory.
        let resident = || match layer_rows {
            CorpusLayer::Resident(kv) => Ok(kv),
            CorpusLayer::Host { .. } => Err(Error::Internal(format!(
                "layer {} is in host memory: it cannot be attended in full",
                call.layer
            ))),
        };
        let first = call.positions.start;
        let mut routed = self.routes.as_mut().and_then(|routes| {
            let partition = routes.partitions.layers.get(call.layer)?.as_ref()?;
            let visits = routes.visits.get_mut(call.layer)?.as_mut()?;
            let cache = routes.caches.get_mut(call.layer).and_then(Option::as_mut);
            Some((&partition.0, visits, cache))
        });
        let retrieves = self.session.retrieves(call.layer);
        // Indexes searched on the CPU: the call's queries go to the host once.
        let found =
            match retrieves && routed.is_none() {
                false => None,
                true => {
                    let started = std::time::Instant::now();
                    let step = host_step(&call, &self.ropes, self.heads, self.n)?;
                    let weighed = self.weighed.get_mut(call.layer).and_then(Option::take);
                    if let Some(weighed) = weighed {
                        let weighted = weighed.read(gpu)?;
                        self.session.follow_weighted(call.layer, weighted, n)?;
                    }
                    self.session.add_transfer(started.elapsed().as_secs_f64());
                    Some(self.session.select(&step)?.ok_or_else(|| {
                        Error::Internal("a retrieval layer selected nothing".into())
                    })?)
                }
            };
        for i in 0..call.positions.len() {
            // The last mass launch reads the workspace (and the lists) this launch rewrites.
            if let Some(provenance) = self.provenance.as_mut() {
                provenance.join(gpu)?;
            }
            let position = first + i;
            let queries = call.queries.slice(i * q..(i + 1) * q);
            let query = Query {
                heads: &queries,
                scale: call.scale,
            };
            let mut out = call.out.slice_mut(i * q..(i + 1) * q);
            let tail_runs: Vec<Range<u32>> = call.tail.rows_of(n..position + 1).collect();
            if !retrieves {
                // Full attention: the corpus densely, the tail's rows as every head's list.
                let rows: Vec<u32> = tail_runs.iter().cloned().flatten().collect();
                self.lists
                    .write_lists(gpu, &vec![rows; kv_heads])
                    .map_err(ModelError::from)?;
                let all = 0..n as u32;
                let corpus = resident()?;
                let dense = Dense {
                    kv: corpus,
                    runs: std::slice::from_ref(&all),
                };
                let selected = Selected::resident(call.tail, &self.lists);
                let workspace = &mut self.workspace;
                StageTimer::time(&mut self.timer, gpu, "attention", || {
                    retrieval_attention(gpu, workspace, query, dense, selected, &mut out)
                })?;
                continue;
            }
            // Retrieval: the tail densely; the corpus's dense part (sinks and the window's
            // part before the tail) as runs, and what the index selected.
            let policy = self
                .session
                .policy_at(position)
                .ok_or_else(|| Error::Internal("retrieval without a budget".into()))?;
            let corpus_runs: Vec<Range<u32>> = policy
                .dense_ranges(position)
                .into_iter()
                .map(|r| r.start.min(n as u32)..r.end.min(n as u32))
                .filter(|r| !r.is_empty())
                .collect();
            let dense = Dense {
                kv: call.tail,
                runs: &tail_runs,
            };
            // Whether the following's launch added this position's mass already.
            let mut mass_added = false;
            let part = match (&mut routed, &found) {
                (Some((partition, visits, cache)), _) => {
                    let raw = call.raw_queries.slice(i * q..(i + 1) * q);
                    // The attention counts the visited ids outside the corpus runs: those in
                    // the policy's candidates, since every corpus id precedes `position`.
                    let step = RouteStep {
                        position,
                        candidates: policy.candidates(position),
                    };
                    let corpus = layer_rows.rows();
                    // What the layer follows (the ids its last step's ranking wrote), and
                    // where the ranking after this step writes what the next follows.
                    let following = self.following.as_mut().and_then(|f| {
                        let RoutedFollowing { layers, scratch } = f;
                        let (lists, current) = layers.get_mut(call.layer)?.as_mut()?;
                        let [a, b] = lists;
                        let (ids, next) = if *current == 0 { (&*a, b) } else { (&*b, a) };
                        Some((ids, next, current, scratch))
                    });
                    let follow = match &following {
                        Some((ids, ..)) => Some(Followed {
                            ids,
                            buckets: partition
                                .bucket_of(gpu, corpus.tokens())
                                .map_err(ModelError::from)?,
                        }),
                        None => None,
                    };
                    let (workspace, timer) = (&mut self.workspace, &mut self.timer);
                    match (cache.as_deref_mut(), layer_rows) {
                        // Rows in host memory behind the question's bucket cache: the visits
                        // come to the host (a wait for routing), the cache copies in the
                        // buckets it lacks (never evicting one of them), and the attention
                        // reads every visited bucket it holds from there, so that a bucket
                        // crosses PCIe once however many steps visit it. Nothing still reads
                        // the rows a copy may overwrite: the stream has run everything queued
                        // before the visits' copy, the last mass launch's wait included.
                        (Some(cache), CorpusLayer::Host { rows, .. }) => {
                            StageTimer::time(timer, gpu, "routing", || {
                                partition.route(gpu, &raw, &step, visits)
                            })?;
                            let visited = visits.on_host(gpu).map_err(ModelError::from)?;
                            StageTimer::time(timer, gpu, "bucket cache", || {
                                cache.fill(gpu, partition, rows, visited)
                            })?;
                            let part = Buckets {
                                follow,
                                cache: Some(cache.cached()),
                                ..partition.list_part(visits, corpus, &corpus_runs)
                            };
                            StageTimer::time(timer, gpu, "attention", || {
                                bucket_attention(gpu, workspace, query, dense, part, &mut out)
                            })?;
                        }
                        // One stage: the attention's launch starts while routing runs (a
                        // programmatic dependent launch), so no event may sit between them.
                        _ => StageTimer::time(timer, gpu, "routing and attention", || {
                            partition.route_and_attend(
                                gpu,
                                &raw,
                                &step,
                                visits,
                                workspace,
                                query,
                                dense,
                                corpus,
                                &corpus_runs,
                                follow,
                                &mut out,
                            )
                        })?,
                    }
                    let cached = cache.as_deref().map(BucketCache::cached);
                    self.session
                        .record_routed(position, kv_heads, partition.buckets());
                    let part = Buckets {
                        follow,
                        cache: cached,
                        ..partition.list_part(visits, layer_rows.rows(), &corpus_runs)
                    };
                    // The step's last position decides what the layer's next step follows;
                    // where it also counts towards provenance, the same launch adds the mass.
                    if let Some((_, next, current, scratch)) = following {
                        if i + 1 == call.positions.len() {
                            let provenance = Provenance::started(&mut self.provenance, gpu, n)?;
                            let workspace = &self.workspace;
                            let counts = self.session.counts_mass_at(position);
                            let stage = match counts {
                                true => "provenance and following",
                                false => "following",
                            };
                            provenance.beside(
                                gpu,
                                call.own_stream,
                                &mut self.timer,
                                stage,
                                |side, mass| {
                                    let mass = counts.then_some(mass);
                                    follow_most_attended(side, workspace, part, scratch, next, mass)
                                },
                            )?;
                            *current = 1 - *current;
                            mass_added = counts;
                        }
                    }
                    ListPart::Buckets(part)
                }
                (None, Some(found)) => {
                    // The step's last position decides what the layer's next search follows.
                    let weigh = self.session.follow() > 0 && i + 1 == call.positions.len();
                    let lists: Vec<Vec<u32>> = found
                        .iter()
                        .map(|per_token| {
                            policy
                                .retrieved(position, per_token[i].selection.ids())
                                .collect()
                        })
                        .collect();
                    let corpus = match layer_rows {
                        CorpusLayer::Host {
                            rows: host_rows,
                            cache: Some(cache),
                        } => {
                            let attended = Attended {
                                query,
                                dense,
                                counts_mass: self.session.counts_mass_at(position),
                                weigh: weigh.then(|| lists.clone()),
                            };
                            let session = SessionParts {
                                workspace: &mut self.workspace,
                                provenance: &mut self.provenance,
                                timer: &mut self.timer,
                                n,
                                corpus: &kv.corpus,
                            };
                            let layer_kv = (host_rows, &**cache);
                            let selection = (lists, &corpus_runs[..]);
                            let weighed = attend_from_host(
                                gpu, call.layer, layer_kv, selection, attended, session, &mut out,
                            )?;
                            if weighed.is_some() {
                                self.weighed[call.layer] = weighed;
                            }
                            continue;
                        }
                        // On the GPU, or read in place from host memory.
                        layer_rows => layer_rows.rows(),
                    };
                    self.lists
                        .write_lists(gpu, &lists)
                        .map_err(ModelError::from)?;
                    let part = Selected::resident(corpus, &self.lists).with_runs(&corpus_runs);
                    let workspace = &mut self.workspace;
                    StageTimer::time(&mut self.timer, gpu, "attention", || {
                        retrieval_attention(gpu, workspace, query, dense, part, &mut out)
                    })?;
                    if weigh {
                        let weighed = Weighed::launch(gpu, &self.workspace, part, lists, 0)?;
                        self.weighed[call.layer] = Some(weighed);
                    }
                    ListPart::Selected(part)
                }
                (None, None) => {
                    return Err(Error::Internal("a retrieval layer selected nothing".into()))
                }
            };
            // Provenance: the weight each corpus token received from this answer token.
            if self.session.counts_mass_at(position) && !mass_added {
                let provenance = Provenance::started(&mut self.provenance, gpu, n)?;
                provenance.add(gpu, call.own_stream, &mut self.timer, &self.workspace, part)?;
            }
        }
        Ok(())
    }
}

/// What one position of a retrieval layer attends besides the corpus (its query and the
/// tail's rows), whether its attention counts towards provenance, and the selection to
/// weigh for the next step to follow, if any ([`Weighed`]).
struct Attended<'a> {
    query: Query<'a, f16>,
    dense: Dense<'a, f16>,
    counts_mass: bool,
    weigh: Option<Vec<Vec<u32>>>,
}

/// The parts of a [`GpuSession`] a retrieval from host memory uses, borrowed apart from its
/// routes.
struct SessionParts<'s> {
    workspace: &'s mut Workspace,
    provenance: &'s mut Option<Provenance>,
    timer: &'s mut Option<StageTimer>,
    /// Corpus tokens.
    n: usize,
    /// The corpus's name.
    corpus: &'s str,
}

/// One position's retrieval from a layer kept in host memory (its `rows` and their block
/// `cache`, with the selected ids per KV head and the corpus's dense runs, sinks and window): the ids and the
/// runs gathered into the layer's block cache, attended with the tail, and the provenance
/// mass added (and the selection weighed, when asked) on the model's stream, so that the
/// cache's `released` event, recorded after, covers every launch that reads its slots.
fn attend_from_host(
    gpu: &kvdb_model::Gpu,
    layer: usize,
    (rows, cache): (&Arc<HostKv<f16>>, &LazyCache),
    (mut lists, corpus_runs): (Vec<Vec<u32>>, &[Range<u32>]),
    attended: Attended<'_>,
    session: SessionParts<'_>,
    out: &mut CudaViewMut<'_, f32>,
) -> Result<Option<Weighed>> {
    for list in &mut lists {
        list.extend(corpus_runs.iter().cloned().flatten());
    }
    let corpus = session.corpus;
    cache.with(gpu, rows, (corpus, layer), |host| {
        attend_cached(gpu, layer, host, &lists, attended, session, out)
    })
}

/// [`attend_from_host`] once the layer's cache is allocated and locked.
fn attend_cached(
    gpu: &kvdb_model::Gpu,
    layer: usize,
    host: &mut HostLayer,
    lists: &[Vec<u32>],
    attended: Attended<'_>,
    session: SessionParts<'_>,
    out: &mut CudaViewMut<'_, f32>,
) -> Result<Option<Weighed>> {
    let HostLayer { cache, released } = host;
    gpu.wait(released).map_err(ModelError::from)?;
    let gathered = StageTimer::time(session.timer, gpu, "block cache", || {
        cache.gather(gpu, lists)
    });
    let part = match gathered {
        Err(Error::Model(ModelError::Gpu(KernelError::CacheTooSmall { needed, slots }))) => {
            return Err(Error::GpuCacheTooSmall {
                corpus: session.corpus.to_string(),
                layer,
                needed,
                slots,
            })
        }
        gathered => gathered?,
    };
    let Attended {
        query,
        dense,
        counts_mass,
        weigh,
    } = attended;
    let workspace = &mut *session.workspace;
    StageTimer::time(session.timer, gpu, "attention", || {
        retrieval_attention(gpu, workspace, query, dense, part, out)
    })?;
    let weighed = weigh
        .map(|selected| {
            // Every KV head's list holds the same dense runs after its selection.
            let extra = match (lists.first(), selected.first()) {
                (Some(list), Some(ids)) => list.len() - ids.len(),
                _ => 0,
            };
            Weighed::launch(gpu, session.workspace, part, selected, extra)
        })
        .transpose()?;
    if counts_mass {
        let provenance = Provenance::started(session.provenance, gpu, session.n)?;
        let part = ListPart::Selected(part);
        provenance.add(gpu, true, session.timer, session.workspace, part)?;
    }
    gpu.record(released).map_err(ModelError::from)?;
    Ok(weighed)
}

/// The call's pre-RoPE queries, keys and values on the host, as the CPU session's step.
fn host_step<'r>(
    call: &LayerCall<'_>,
    ropes: &[&'r Rope],
    (h, kv_heads, d): (usize, usize, usize),
    n: usize,
) -> Result<Step<'r>> {
    let t = call.positions.len();
    let queries = download(call.gpu, &call.raw_queries)?;
    let (keys, values) = (
        download(call.gpu, &call.raw_keys)?,
        download(call.gpu, &call.raw_values)?,
    );
    call.gpu.synchronize().map_err(ModelError::from)?;
    let wide = |v: Vec<f16>| -> Vec<f32> { v.iter().map(|x| x.to_f32()).collect() };
    let place = StepPlace {
        layer: call.layer,
        first: call.positions.start,
        scale: call.scale,
        rope: ropes[call.layer],
    };
    Step::from_rows(
        place,
        (t, h, kv_heads, d),
        n,
        queries,
        wide(keys),
        wide(values),
    )
}

/// Queues a copy of a view's elements to the host; the caller waits for the stream once
/// after all of a step's copies.
fn download<T: kvdb_kernels::cudarc::driver::DeviceRepr + Default + Clone>(
    gpu: &kvdb_model::Gpu,
    view: &CudaView<'_, T>,
) -> Result<Vec<T>> {
    let mut host = vec![T::default(); view.len()];
    gpu.stream().memcpy_dtoh(view, &mut host).map_err(|e| {
        ModelError::from(kvdb_model::KernelError::Driver {
            op: "copying a retrieval step's queries, keys and values to the host",
            source: e,
        })
    })?;
    Ok(host)
}

#[cfg(test)]
mod tests {
    use super::{ensure_host_memory, host_available, mem_available, HOST_RESERVE_BYTES};
    use crate::error::Error;

    #[test]
    fn a_layer_the_host_cannot_hold_is_refused_before_it_is_pinned() {
        let gib = 1usize << 30;
        match ensure_host_memory("c", (20, 28), 2 * gib, Some(3 * gib)) {
            Err(e @ Error::HostMemory { .. }) => {
                let message = e.to_string();
                for says in [
                    "corpus `c`",
                    "28 retrieval layers",
                    "20 are",
                    "--gpu-kv",
                    "--device cpu",
                ] {
                    assert!(message.contains(says), "{message}");
                }
            }
            other => panic!("{other:?}"),
        }
        // The reserve is kept exactly, and nothing is checked where nothing is known.
        assert!(
            ensure_host_memory("c", (0, 28), 2 * gib, Some(2 * gib + HOST_RESERVE_BYTES)).is_ok()
        );
        assert!(ensure_host_memory(
            "c",
            (0, 28),
            2 * gib,
            Some(2 * gib + HOST_RESERVE_BYTES - 1)
        )
        .is_err());
        assert!(ensure_host_memory("c", (0, 28), usize::MAX, None).is_ok());
    }

    #[test]
    fn mem_available_reads_meminfo() {
        let meminfo = "MemTotal:       131987456 kB\nMemFree:         1024 kB\n\
                       MemAvailable:   51380224 kB\nBuffers:  0 kB\n";
        assert_eq!(mem_available(meminfo), Some(51380224 * 1024));
        assert_eq!(mem_available("MemTotal: 1 kB\n"), None);
        assert_eq!(mem_available("MemAvailable: lots kB\n"), None);
        assert_eq!(mem_available("MemAvailable: 12 MB\n"), None);
        // Linux reports it.
        if cfg!(target_os = "linux") {
            let available = host_available().expect("MemAvailable on Linux");
            assert!(available > 0);
        }
    }
}
