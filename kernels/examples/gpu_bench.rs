//! Decode-step attention on the GPU: `retrieval_attention` against `flash_decode` and
//! PyTorch's `scaled_dot_product_attention` (flash and cuDNN backends, measured by
//! `scripts/bench_sdpa.py` in the same device command), with K/V resident on the GPU and
//! through the pinned-host block cache. bf16 inputs.
//!
//! ```sh
//! gpu_bench [--sdpa sdpa.jsonl] [--json raw.jsonl] [--quick] [--buckets] [--only SHAPE,N,K] [--iters 200]
//! gpu_bench --projections [--iters 200]
//! gpu_bench --buckets-only [--f16] [--only SHAPE,N,K] [--iters 200]
//! ```
//!
//! `--contiguous` gives each bucket consecutive ids (a corpus stored in bucket order).
//! `--f16` runs the attention in f16 (the product's keys and values) instead of bf16.
//! `--buckets-only` times `bucket_attention` on the tensor-core path (the default) and on
//! the scalar kernel; `--scalar` runs every other attention on the scalar kernel.
//!
//! `--projections` times the weight products of a decode step instead (Llama-3-8B's and
//! Gemma 3 270M's, batch 1), on `Gemm::linear`'s matrix-vector kernel and on cuBLASLt.
//!
//! Timing: CUDA events around each launch, the median of `--iters` (>= 100) launches after a
//! warm-up; and the same launches captured in a CUDA graph, replayed, per step. Every timed
//! call takes the next of several input sets (queries, window position, selection, and a copy
//! of the cache when one copy is small) whose bytes add up to more than 200 MB, so that the
//! 50 MB L2 does not keep them between calls. Bytes touched follow the issue: (dense +
//! selected tokens) × KV heads × head_dim × 2 (K and V) × 2 bytes, plus queries and outputs.

use std::collections::HashSet;
use std::fmt::Write as _;
use std::ops::Range;
use std::time::Instant;

use anyhow::{bail, ensure, Context, Result};
use half::{bf16, f16};
use kvdb_kernels::cudarc::driver::sys::CUevent_flags;
use kvdb_kernels::cudarc::driver::{CudaEvent, CudaSlice};
use kvdb_kernels::ops::RopePairs;
use kvdb_kernels::{
    attention_mass, bucket_attention, flash_decode, retrieval_attention, BlockCache,
    ClassifierHead, Csr, Dense, Gpu, HostKv, KvCache, KvElement, ListPart, Partition, Query,
    RouteRope, RouteStep, Selected, Visits, Workspace,
};
use serde_json::{json, Value};

/// A model's attention shape.
#[derive(Debug, Clone, Copy)]
struct Shape {
    name: &'static str,
    q_heads: usize,
    kv_heads: usize,
    head_dim: usize,
}

const SHAPES: [Shape; 2] = [
    Shape {
        name: "llama",
        q_heads: 32,
        kv_heads: 8,
        head_dim: 128,
    },
    Shape {
        name: "gemma",
        q_heads: 4,
        kv_heads: 1,
        head_dim: 256,
    },
];
const LENGTHS: [usize; 4] = [32 << 10, 128 << 10, 512 << 10, 1 << 20];
const KS: [usize; 4] = [256, 1024, 2048, 4096];
const SINK: u32 = 1;
const WINDOW: u32 = 2048;
/// Hidden units of the saap classifier whose routing `--buckets` times (kvdb's `HIDDEN`).
const SAAP_HIDDEN: usize = 1024;
/// Input sets rotate over at least this many bytes.
const ROTATE_BYTES: f64 = 200e6;
/// Tokens per block of the pinned-host path (the store's block size).
const BLOCK_TOKENS: usize = 64;

struct Args {
    sdpa: Option<String>,
    json: Option<String>,
    quick: bool,
    /// One configuration only (shape name, length, k), e.g. for a profiler.
    only: Option<(String, usize, usize)>,
    /// Bucket routing and attention too (`ivf256,np8,norope,all`'s shape).
    buckets: bool,
    /// Bucket routing and attention alone (e.g. for a profiler: no other launch of the
    /// attention kernel comes first).
    buckets_only: bool,
    /// The decode step's weight products alone.
    projections: bool,
    /// f16 keys, values and queries instead of bf16.
    f16: bool,
    /// The scalar attention kernel instead of the tensor-core path.
    scalar: bool,
    /// Each bucket's ids consecutive (a bucket-ordered layout) instead of scattered.
    contiguous: bool,
    iters: usize,
}

impl Args {
    fn parse() -> Result<Self> {
        let mut args = Self {
            sdpa: None,
            json: None,
            quick: false,
            only: None,
            buckets: false,
            buckets_only: false,
            projections: false,
            f16: false,
            scalar: false,
            contiguous: false,
            iters: 200,
        };
        let mut it = std::env::args().skip(1);
        while let Some(arg) = it.next() {
            match arg.as_str() {
                "--sdpa" => args.sdpa = Some(it.next().context("--sdpa FILE")?),
                "--json" => args.json = Some(it.next().context("--json FILE")?),
                "--quick" => args.quick = true,
                "--buckets" => args.buckets = true,
                "--buckets-only" => {
                    args.buckets = true;
                    args.buckets_only = true;
                }
                "--projections" => args.projections = true,
                "--f16" => args.f16 = true,
                "--scalar" => args.scalar = true,
                "--contiguous" => args.contiguous = true,
                "--only" => {
                    let spec = it.next().context("--only SHAPE,N,K")?;
                    let parts: Vec<&str> = spec.split(',').collect();
                    let [shape, n, k] = parts[..] else {
                        bail!("--only takes SHAPE,N,K, e.g. llama,1048576,2048");
                    };
                    args.only = Some((shape.to_string(), n.parse()?, k.parse()?));
                }
                "--iters" => args.iters = it.next().context("--iters N")?.parse()?,
                other => bail!("unknown argument {other}; usage: gpu_bench [--sdpa FILE] [--json FILE] [--quick] [--buckets] [--buckets-only] [--f16] [--scalar] [--contiguous] [--projections] [--only SHAPE,N,K] [--iters N]"),
            }
        }
        ensure!(args.iters >= 100, "--iters must be at least 100");
        Ok(args)
    }
}

/// SplitMix64: a fast, seedable generator, one per thread of data generation.
struct SplitMix(u64);

impl SplitMix {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in [-1, 1).
    fn unit(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }

    fn below(&mut self, n: u32) -> u32 {
        (((self.next() >> 32) * n as u64) >> 32) as u32
    }
}

/// `len` random elements in [-1, 1), generated on every core.
fn random<T: KvElement>(len: usize, seed: u64) -> Vec<T> {
    let mut data = vec![T::default(); len];
    let threads = std::thread::available_parallelism().map_or(4, |n| n.get());
    let chunk = len.div_ceil(threads).max(1);
    std::thread::scope(|scope| {
        for (i, part) in data.chunks_mut(chunk).enumerate() {
            scope.spawn(move || {
                let mut rng = SplitMix(seed ^ (i as u64).wrapping_mul(0x2545_f491_4f6c_dd1d));
                part.iter_mut().for_each(|x| *x = T::from_f32(rng.unit()));
            });
        }
    });
    data
}

/// Median and mean of event-timed calls, in microseconds.
#[derive(Debug, Clone, Copy)]
struct Timing {
    median_us: f64,
    mean_us: f64,
}

fn event(gpu: &Gpu) -> Result<CudaEvent> {
    Ok(gpu
        .context()
        .new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?)
}

/// Times `iters` calls of `step(i)`, each between two events, after ten untimed ones.
///
/// A few milliseconds of copies are queued first, so that the CPU queues the timed calls
/// while the GPU is still busy: each interval then holds the GPU's work alone, not the
/// CPU's time to submit it (which graphs remove in a real decode loop).
fn time_events(
    gpu: &Gpu,
    iters: usize,
    mut step: impl FnMut(usize) -> Result<()>,
) -> Result<Timing> {
    for i in 0..10 {
        step(i)?;
    }
    let events: Vec<(CudaEvent, CudaEvent)> = (0..iters)
        .map(|_| Ok((event(gpu)?, event(gpu)?)))
        .collect::<Result<_>>()?;
    let src: CudaSlice<u8> = gpu.zeros(256 << 20)?;
    let mut dst: CudaSlice<u8> = gpu.zeros(256 << 20)?;
    for _ in 0..32 {
        gpu.stream().memcpy_dtod(&src, &mut dst)?;
    }
    for (i, (start, end)) in events.iter().enumerate() {
        start.record(gpu.stream())?;
        step(i)?;
        end.record(gpu.stream())?;
    }
    gpu.synchronize()?;
    let mut times: Vec<f64> = events
        .iter()
        .map(|(s, e)| Ok(s.elapsed_ms(e)? as f64 * 1e3))
        .collect::<Result<_>>()?;
    times.sort_by(f64::total_cmp);
    Ok(Timing {
        median_us: times[times.len() / 2],
        mean_us: times.iter().sum::<f64>() / times.len() as f64,
    })
}

/// Captures `sets` calls of `step(0..sets)` in a CUDA graph and returns the time per call of
/// its replays: launch overhead mostly gone, as in a decode loop run from a graph.
fn time_graph(
    gpu: &Gpu,
    sets: usize,
    iters: usize,
    mut step: impl FnMut(usize) -> Result<()>,
) -> Result<f64> {
    let stream = gpu.stream();
    let graph = gpu
        .capture(|| (0..sets).try_for_each(&mut step))?
        .context("empty graph")?;
    let replays = iters.div_ceil(sets).max(2);
    graph.launch()?;
    let (start, end) = (event(gpu)?, event(gpu)?);
    start.record(stream)?;
    for _ in 0..replays {
        graph.launch()?;
    }
    end.record(stream)?;
    Ok(start.elapsed_ms(&end)? as f64 * 1e3 / (replays * sets) as f64)
}

/// Device-to-device copy of 1 GiB: bytes read plus written per second, in GB/s.
fn copy_gbps(gpu: &Gpu) -> Result<f64> {
    let src: CudaSlice<u8> = gpu.zeros(1 << 30)?;
    let mut dst: CudaSlice<u8> = gpu.zeros(1 << 30)?;
    let t = time_events(gpu, 50, |_| Ok(gpu.stream().memcpy_dtod(&src, &mut dst)?))?;
    Ok(2.0 * (1u64 << 30) as f64 / (t.median_us * 1e-6) / 1e9)
}

/// Host-to-device copy of 1 GiB from pinned memory, in GB/s: the PCIe ceiling of cold blocks.
fn pcie_gbps(gpu: &Gpu) -> Result<f64> {
    // Safety: the bytes are copied, never read as anything but bytes.
    let pinned = unsafe { gpu.context().alloc_pinned::<u8>(1 << 30)? };
    let mut dst: CudaSlice<u8> = gpu.zeros(1 << 30)?;
    let t = time_events(gpu, 20, |_| {
        Ok(gpu.stream().memcpy_htod(&pinned, &mut dst)?)
    })?;
    Ok((1u64 << 30) as f64 / (t.median_us * 1e-6) / 1e9)
}

/// One input set of a retrieval step: queries, dense runs, selection, and which cache copy.
struct Set<T> {
    queries: CudaSlice<T>,
    runs: Vec<Range<u32>>,
    lists: Vec<Vec<u32>>,
    ids: Csr,
    copy: usize,
}

/// `k` distinct random ids in `range` per KV head.
fn select(rng: &mut SplitMix, kv_heads: usize, range: Range<u32>, k: usize) -> Vec<Vec<u32>> {
    (0..kv_heads)
        .map(|_| {
            let mut seen = HashSet::with_capacity(k);
            let mut ids = Vec::with_capacity(k);
            while ids.len() < k {
                let id = range.start + rng.below(range.end - range.start);
                if seen.insert(id) {
                    ids.push(id);
                }
            }
            ids
        })
        .collect()
}

/// Everything for one shape and length: the cache (in copies), host data, workspace.
struct Bench<'g, T> {
    gpu: &'g Gpu,
    shape: Shape,
    n: usize,
    keys: Vec<T>,
    values: Vec<T>,
    copies: Vec<KvCache<T>>,
    workspace: Workspace,
    out: CudaSlice<f32>,
    rng: SplitMix,
    iters: usize,
}

impl<'g, T: KvElement> Bench<'g, T> {
    fn new(gpu: &'g Gpu, shape: Shape, n: usize, iters: usize, scalar: bool) -> Result<Self> {
        let len = shape.kv_heads * n * shape.head_dim;
        let (keys, values) = (random(len, n as u64), random(len, !(n as u64)));
        let copies = (ROTATE_BYTES / (4 * len) as f64).ceil().max(1.0) as usize;
        let copies = (0..copies)
            .map(|_| KvCache::upload(gpu, &keys, &values, shape.kv_heads, shape.head_dim))
            .collect::<kvdb_kernels::Result<_>>()?;
        Ok(Self {
            gpu,
            shape,
            n,
            keys,
            values,
            copies,
            workspace: Workspace::new(gpu)?.with_tensor_cores(!scalar),
            out: gpu.zeros(shape.q_heads * shape.head_dim)?,
            rng: SplitMix(n as u64 * 31 + shape.q_heads as u64),
            iters,
        })
    }

    fn queries(&mut self) -> Result<CudaSlice<T>> {
        let q = random(self.shape.q_heads * self.shape.head_dim, self.rng.next());
        Ok(self.gpu.upload(&q)?)
    }

    fn scale(&self) -> f32 {
        1.0 / (self.shape.head_dim as f32).sqrt()
    }

    /// Bytes a step over `tokens` tokens touches (the issue's formula).
    fn bytes(&self, tokens: usize) -> f64 {
        let s = self.shape;
        let kv = tokens * s.kv_heads * s.head_dim * 2 * size_of::<T>();
        (kv + s.q_heads * s.head_dim * (size_of::<T>() + size_of::<f32>())) as f64
    }

    fn flash(&mut self) -> Result<Value> {
        let sets: Vec<CudaSlice<T>> = (0..64).map(|_| self.queries()).collect::<Result<_>>()?;
        let (gpu, n, scale) = (self.gpu, self.n, self.scale());
        let (copies, ws, out) = (&self.copies, &mut self.workspace, &mut self.out);
        let mut step = |i: usize| -> Result<()> {
            let heads = sets[i % sets.len()].as_view();
            let query = Query {
                heads: &heads,
                scale,
            };
            Ok(flash_decode(
                gpu,
                ws,
                query,
                &copies[i % copies.len()],
                n,
                &mut out.as_view_mut(),
            )?)
        };
        let events = time_events(gpu, self.iters, &mut step)?;
        let graph = time_graph(gpu, copies.len().max(8), self.iters, &mut step)?;
        Ok(self.record("flash_decode", None, n, events, graph))
    }

    /// A random decode position, its dense runs and a selection of `k` ids per KV head.
    fn set(&mut self, k: usize, copy: usize) -> Result<Set<T>> {
        let lowest = (SINK + WINDOW) as usize + k;
        ensure!(
            self.n > lowest,
            "{} tokens cannot hold k={k} plus the dense part",
            self.n
        );
        let position = lowest as u32 + self.rng.below((self.n - lowest) as u32);
        let window_start = position + 1 - WINDOW;
        let lists = select(&mut self.rng, self.shape.kv_heads, SINK..window_start, k);
        Ok(Set {
            queries: self.queries()?,
            runs: vec![0..SINK, window_start..position + 1],
            ids: Csr::from_lists(self.gpu, &lists)?,
            lists,
            copy,
        })
    }

    fn retrieval(&mut self, k: usize) -> Result<(Value, Vec<Set<T>>)> {
        let tokens = (SINK + WINDOW) as usize + k;
        let count = (ROTATE_BYTES / self.bytes(tokens)).ceil().clamp(8.0, 256.0) as usize;
        let copies = self.copies.len();
        let sets: Vec<Set<T>> = (0..count)
            .map(|i| self.set(k, i % copies))
            .collect::<Result<_>>()?;
        let (gpu, scale) = (self.gpu, self.scale());
        let (caches, ws, out) = (&self.copies, &mut self.workspace, &mut self.out);
        let mut step = |i: usize| -> Result<()> {
            let set = &sets[i % sets.len()];
            let kv = &caches[set.copy];
            let heads = set.queries.as_view();
            let query = Query {
                heads: &heads,
                scale,
            };
            let dense = Dense {
                kv,
                runs: &set.runs,
            };
            Ok(retrieval_attention(
                gpu,
                ws,
                query,
                dense,
                Selected::resident(kv, &set.ids),
                &mut out.as_view_mut(),
            )?)
        };
        let events = time_events(gpu, self.iters, &mut step)?;
        let graph = time_graph(gpu, sets.len(), self.iters, &mut step)?;
        Ok((
            self.record("retrieval", Some(k), tokens, events, graph),
            sets,
        ))
    }

    /// Retrieval with K/V in pinned host memory behind the block cache: each of a few
    /// selections once on an empty cache (cold), then again (warm). Wall-clock latency of
    /// the whole step (block lookups on the CPU, copies, attention, synchronisation).
    fn pinned(&mut self, cache: &mut BlockCache<T>, k: usize, sets: &[Set<T>]) -> Result<Value> {
        let s = self.shape;
        let d = s.head_dim;
        let (mut cold, mut warm, mut warm_host) = (Vec::new(), Vec::new(), Vec::new());
        let (mut cold_bytes, mut warm_stats) = (0u64, (0u64, 0u64));
        for set in sets.iter().take(5) {
            // The dense part (sink and window) stays on the GPU, compacted to its own rows.
            let mut dense_keys = Vec::new();
            let mut dense_values = Vec::new();
            for h in 0..s.kv_heads {
                for id in set.runs.iter().cloned().flatten() {
                    let at = (h * self.n + id as usize) * d;
                    dense_keys.extend_from_slice(&self.keys[at..at + d]);
                    dense_values.extend_from_slice(&self.values[at..at + d]);
                }
            }
            let dense_kv = KvCache::upload(self.gpu, &dense_keys, &dense_values, s.kv_heads, d)?;
            let dense_rows = 0..(dense_keys.len() / (s.kv_heads * d)) as u32;
            cache.clear();
            for pass in 0..21 {
                let before = cache.stats();
                let start = Instant::now();
                let selected = cache.gather(self.gpu, &set.lists)?;
                // The CPU's part: block lookups, queueing the row upload and the copies.
                let host_us = start.elapsed().as_secs_f64() * 1e6;
                let heads = set.queries.as_view();
                let query = Query {
                    heads: &heads,
                    scale: self.scale(),
                };
                let dense = Dense {
                    kv: &dense_kv,
                    runs: std::slice::from_ref(&dense_rows),
                };
                retrieval_attention(
                    self.gpu,
                    &mut self.workspace,
                    query,
                    dense,
                    selected,
                    &mut self.out.as_view_mut(),
                )?;
                self.gpu.synchronize()?;
                let us = start.elapsed().as_secs_f64() * 1e6;
                let after = cache.stats();
                if pass == 0 {
                    cold.push(us);
                    cold_bytes += after.bytes_copied - before.bytes_copied;
                } else {
                    warm.push(us);
                    warm_host.push(host_us);
                    warm_stats.0 += after.hits - before.hits;
                    warm_stats.1 += after.misses - before.misses;
                }
            }
        }
        let median = |v: &mut Vec<f64>| {
            v.sort_by(f64::total_cmp);
            v[v.len() / 2]
        };
        let (cold_us, warm_us) = (median(&mut cold), median(&mut warm));
        let warm_host_us = median(&mut warm_host);
        let cold_mb = cold_bytes as f64 / cold.len() as f64 / 1e6;
        let warm_hit = warm_stats.0 as f64 / (warm_stats.0 + warm_stats.1).max(1) as f64;
        let v = json!({
            "impl": "pinned", "shape": s.name, "n": self.n, "k": k,
            "cold_us": cold_us, "warm_us": warm_us, "warm_host_us": warm_host_us,
            "cold_copied_mb": cold_mb,
            "cold_pcie_gbps": cold_mb * 1e6 / (cold_us * 1e-6) / 1e9,
            "warm_hit_ratio": warm_hit, "cache_hit_ratio_total": cache.stats().hit_ratio(),
        });
        println!("{v}");
        Ok(v)
    }

    /// Bucket retrieval as the GPU session runs it for `ivf{buckets},np{probes},norope,all`:
    /// routing alone (`Partition::route`: centroid scores, the visits, the selected count),
    /// `bucket_attention` alone over the visited buckets plus sinks and window, and both in
    /// turn. Buckets are unequal as k-means leaves them (bucket b of a head holds a share
    /// of the ids falling as 1 / (1 + b / 8)); queries and centroids are random, so the
    /// visits are random buckets.
    fn buckets(&mut self, buckets: usize, probes: usize, contiguous: bool) -> Result<Vec<Value>> {
        let s = self.shape;
        let weights: Vec<f64> = (0..buckets).map(|b| 1.0 / (1.0 + b as f64 / 8.0)).collect();
        let total: f64 = weights.iter().sum();
        let mut lists = vec![Vec::new(); s.kv_heads * buckets];
        for h in 0..s.kv_heads {
            for id in 0..self.n as u32 {
                let mut x = (self.rng.next() >> 11) as f64 / (1u64 << 53) as f64 * total;
                let b = weights.iter().position(|w| {
                    x -= w;
                    x < 0.0
                });
                lists[h * buckets + b.unwrap_or(buckets - 1)].push(id);
            }
        }
        if contiguous {
            // The same bucket sizes, each bucket a run of consecutive ids (buckets in a
            // random order): what a corpus stored in bucket order would read.
            for h in 0..s.kv_heads {
                let head = &mut lists[h * buckets..(h + 1) * buckets];
                let mut order: Vec<usize> = (0..buckets).collect();
                for i in (1..buckets).rev() {
                    order.swap(i, self.rng.below(i as u32 + 1) as usize);
                }
                let mut next = 0u32;
                for b in order {
                    let len = head[b].len() as u32;
                    head[b] = (next..next + len).collect();
                    next += len;
                }
            }
        }
        let mut unit = |len: usize| -> Vec<f32> { (0..len).map(|_| self.rng.unit()).collect() };
        let centroids = unit(s.kv_heads * buckets * s.head_dim);
        let partition = Partition::new(self.gpu, &centroids, &lists, &[], s.kv_heads, s.head_dim)?;
        // The same buckets routed by a saap classifier of SAAP_HIDDEN units (random
        // weights: the cost does not depend on them) with the geometric expert.
        let classifier_weights: Vec<[Vec<f32>; 6]> = (0..s.kv_heads)
            .map(|_| {
                [
                    s.head_dim * SAAP_HIDDEN,
                    SAAP_HIDDEN,
                    buckets * SAAP_HIDDEN,
                    buckets,
                    buckets * s.head_dim,
                    buckets * s.head_dim,
                ]
                .map(&mut unit)
            })
            .collect();
        let heads: Vec<ClassifierHead<'_>> = classifier_weights
            .iter()
            .map(|[w1, b1, w2, b2, centroids, mean_keys]| ClassifierHead {
                centroids,
                w1,
                b1,
                w2,
                b2,
                prior: 0.5,
                mean_keys,
                share: 0.5,
            })
            .collect();
        let inv_freq: Vec<f64> = (0..s.head_dim / 2)
            .map(|i| 10_000f64.powf(-2.0 * i as f64 / s.head_dim as f64))
            .collect();
        let rope = RouteRope {
            inv_freq: &inv_freq,
            pairs: RopePairs::Halves,
        };
        let group = s.q_heads / s.kv_heads;
        let classifier = Partition::classifier(self.gpu, &heads, &lists, s.head_dim, group, rope)?;
        // Input sets whose visits (about 15 MB of keys and values each for Llama at 128K)
        // add up to more than the L2 holds.
        const SETS: usize = 16;
        let route_queries: Vec<CudaSlice<f32>> = (0..SETS)
            .map(|_| Ok(self.gpu.upload(&unit(s.q_heads * s.head_dim))?))
            .collect::<Result<_>>()?;
        let queries: Vec<CudaSlice<T>> =
            (0..SETS).map(|_| self.queries()).collect::<Result<_>>()?;
        let mut visits: Vec<Visits> = (0..SETS)
            .map(|_| Ok(partition.visits(self.gpu, probes)?))
            .collect::<Result<_>>()?;
        let position = self.n as u32 - 1;
        let window_start = position + 1 - WINDOW;
        let runs = [0..SINK, window_start..position + 1];
        let step = RouteStep {
            position: position as usize,
            candidates: SINK..window_start,
        };
        let (gpu, scale) = (self.gpu, self.scale());
        let (copies, ws, out) = (&self.copies, &mut self.workspace, &mut self.out);
        let route = |i: usize, visits: &mut [Visits]| -> Result<()> {
            let q = route_queries[i % SETS].as_view();
            Ok(partition.route(gpu, &q, &step, &mut visits[i % SETS])?)
        };
        let mut attend = |i: usize, visits: &[Visits], ws: &mut Workspace| -> Result<()> {
            let kv = &copies[i % copies.len()];
            let heads = queries[i % SETS].as_view();
            let query = Query {
                heads: &heads,
                scale,
            };
            let part = partition.list_part(&visits[i % SETS], kv, &runs);
            let dense = Dense { kv, runs: &[] };
            Ok(bucket_attention(
                gpu,
                ws,
                query,
                dense,
                part,
                &mut out.as_view_mut(),
            )?)
        };
        // One route and attention per set: the ids each head selects, on average (the
        // attention counts them).
        for i in 0..SETS {
            route(i, &mut visits)?;
            attend(i, &visits, ws)?;
        }
        let selected = visits
            .iter()
            .map(|v| Ok(v.selected(gpu)? as usize))
            .sum::<Result<usize>>()?
            / (SETS * s.kv_heads);
        let mut rows = Vec::new();
        let t = time_events(gpu, self.iters, |i| route(i, &mut visits))?;
        let graph = time_graph(gpu, SETS, self.iters, |i| route(i, &mut visits))?;
        rows.push((
            format!("route ({buckets} buckets, {probes} probed)"),
            0,
            t,
            graph,
        ));
        let tokens = (SINK + WINDOW) as usize + selected;
        // The scalar kernel first, in its own workspace, then the workspace's own path
        // (tensor cores unless --scalar), which the rows below keep using.
        let mut scalar = Workspace::new(gpu)?.with_tensor_cores(false);
        let t = time_events(gpu, self.iters, |i| attend(i, &visits, &mut scalar))?;
        let graph = time_graph(gpu, SETS, self.iters, |i| attend(i, &visits, &mut scalar))?;
        rows.push(("bucket_attention scalar".to_string(), tokens, t, graph));
        let t = time_events(gpu, self.iters, |i| attend(i, &visits, ws))?;
        let graph = time_graph(gpu, SETS, self.iters, |i| attend(i, &visits, ws))?;
        let path = if ws.tensor_cores() {
            "tensor cores"
        } else {
            "scalar"
        };
        rows.push((format!("bucket_attention {path}"), tokens, t, graph));
        // Provenance after the attention, as the session runs it: the weight of each
        // attended corpus row, from the last launch's queries and log-sum-exp.
        let mut mass: CudaSlice<f32> = gpu.zeros(self.n)?;
        let mut weigh = |i: usize, visits: &[Visits], ws: &Workspace| -> Result<()> {
            let part = partition.list_part(&visits[i % SETS], &copies[i % copies.len()], &runs);
            Ok(attention_mass(gpu, ws, ListPart::Buckets(part), &mut mass)?)
        };
        let t = time_events(gpu, self.iters, |i| weigh(i, &visits, ws))?;
        let graph = time_graph(gpu, SETS, self.iters, |i| weigh(i, &visits, ws))?;
        rows.push(("attention_mass".to_string(), tokens, t, graph));
        let mut both = |i: usize| -> Result<()> {
            route(i, &mut visits)?;
            attend(i, &visits, ws)
        };
        let t = time_events(gpu, self.iters, &mut both)?;
        let graph = time_graph(gpu, SETS, self.iters, &mut both)?;
        rows.push(("route+bucket_attention".to_string(), tokens, t, graph));
        // The same two launches through Partition::route_and_attend: the attention's blocks
        // start while routing runs (programmatic dependent launch on Hopper).
        let mut together = |partition: &Partition, i: usize, visits: &mut [Visits]| -> Result<()> {
            let kv = &copies[i % copies.len()];
            let heads = queries[i % SETS].as_view();
            let query = Query {
                heads: &heads,
                scale,
            };
            let q = route_queries[i % SETS].as_view();
            let dense = Dense { kv, runs: &[] };
            Ok(partition.route_and_attend(
                gpu,
                &q,
                &step,
                &mut visits[i % SETS],
                ws,
                query,
                dense,
                kv,
                &runs,
                None,
                &mut out.as_view_mut(),
            )?)
        };
        let t = time_events(gpu, self.iters, |i| together(&partition, i, &mut visits))?;
        let graph = time_graph(gpu, SETS, self.iters, |i| {
            together(&partition, i, &mut visits)
        })?;
        rows.push(("route_and_attend".to_string(), tokens, t, graph));
        // Routing by the classifier, alone and with the attention behind it; first one step
        // a set, to count the ids its visits select (a head, on average).
        let mut classifier_visits: Vec<Visits> = (0..SETS)
            .map(|_| Ok(classifier.visits(gpu, probes)?))
            .collect::<Result<_>>()?;
        for i in 0..SETS {
            together(&classifier, i, &mut classifier_visits)?;
        }
        let classified = classifier_visits
            .iter()
            .map(|v| Ok(v.selected(gpu)? as usize))
            .sum::<Result<usize>>()?
            / (SETS * s.kv_heads);
        let classify = |i: usize, visits: &mut [Visits]| -> Result<()> {
            let q = route_queries[i % SETS].as_view();
            Ok(classifier.route(gpu, &q, &step, &mut visits[i % SETS])?)
        };
        let t = time_events(gpu, self.iters, |i| classify(i, &mut classifier_visits))?;
        let graph = time_graph(gpu, SETS, self.iters, |i| {
            classify(i, &mut classifier_visits)
        })?;
        rows.push((
            format!("route by a classifier of {SAAP_HIDDEN} hidden units"),
            0,
            t,
            graph,
        ));
        let t = time_events(gpu, self.iters, |i| {
            together(&classifier, i, &mut classifier_visits)
        })?;
        let graph = time_graph(gpu, SETS, self.iters, |i| {
            together(&classifier, i, &mut classifier_visits)
        })?;
        rows.push((
            format!("route_and_attend by the classifier ({classified} selected a head)"),
            (SINK + WINDOW) as usize + classified,
            t,
            graph,
        ));
        Ok(rows
            .into_iter()
            .map(|(what, tokens, t, graph)| {
                let mut v = self.record(&what, Some(selected), tokens, t, graph);
                v["selected_per_head"] = json!(selected);
                if what.ends_with("scalar") {
                    v["tensor_cores"] = json!(false);
                }
                v
            })
            .collect())
    }

    fn record(
        &self,
        what: &str,
        k: Option<usize>,
        tokens: usize,
        t: Timing,
        graph_us: f64,
    ) -> Value {
        let bytes = self.bytes(tokens);
        let v = json!({
            "impl": what, "shape": self.shape.name, "n": self.n, "k": k, "tokens": tokens,
            "median_us": t.median_us, "mean_us": t.mean_us, "graph_us": graph_us,
            "bytes": bytes, "gbps": bytes / (t.median_us * 1e-6) / 1e9,
            "graph_gbps": bytes / (graph_us * 1e-6) / 1e9,
            "copies": self.copies.len(), "dtype": format!("{:?}", T::DTYPE),
            "tensor_cores": self.workspace.tensor_cores(),
        });
        println!("{v}");
        v
    }
}

fn find<'a>(
    rows: &'a [Value],
    what: &str,
    shape: &str,
    n: usize,
    k: Option<usize>,
) -> Option<&'a Value> {
    rows.iter().find(|r| {
        r["impl"] == what && r["shape"] == shape && r["n"] == n && k.is_none_or(|k| r["k"] == k)
    })
}

fn f(v: Option<&Value>, key: &str) -> Option<f64> {
    v.and_then(|v| v[key].as_f64())
}

fn cell(x: Option<f64>, digits: usize) -> String {
    x.map_or("n/a".into(), |x| format!("{x:.digits$}"))
}

/// The tables of docs/benchmarks.md, from this run's records and the SDPA script's.
fn tables(rows: &[Value], sdpa: &[Value], copy: f64, lengths: &[usize]) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "\n### Full attention: flash_decode vs PyTorch SDPA (µs, median of events)\n"
    );
    let _ = writeln!(s, "| shape | N | flash_decode | graph | GB/s | SDPA flash | SDPA cuDNN | flash_decode / SDPA flash |");
    let _ = writeln!(s, "|---|---:|---:|---:|---:|---:|---:|---:|");
    for shape in SHAPES {
        for &n in lengths {
            let ours = find(rows, "flash_decode", shape.name, n, None);
            let fl = f(find(sdpa, "sdpa_flash", shape.name, n, None), "median_us");
            let cu = f(find(sdpa, "sdpa_cudnn", shape.name, n, None), "median_us");
            let o = f(ours, "median_us");
            let _ = writeln!(
                s,
                "| {} | {}K | {} | {} | {} | {} | {} | {} |",
                shape.name,
                n >> 10,
                cell(o, 1),
                cell(f(ours, "graph_us"), 1),
                cell(f(ours, "gbps"), 0),
                cell(fl, 1),
                cell(cu, 1),
                cell(o.zip(fl).map(|(o, fl)| o / fl), 2),
            );
        }
    }
    let _ = writeln!(
        s,
        "\n### Retrieval attention (window {WINDOW} + {SINK} sink + k selected), resident K/V\n"
    );
    let _ = writeln!(
        s,
        "Copy bandwidth (device-to-device, read + write) in this run: {copy:.0} GB/s.\n"
    );
    let _ = writeln!(s, "| shape | N | k | µs (events) | µs/step (graph) | MB touched | GB/s | % of copy | × fastest SDPA | × flash_decode |");
    let _ = writeln!(s, "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    for shape in SHAPES {
        for &n in lengths {
            let best = ["sdpa_flash", "sdpa_cudnn"]
                .iter()
                .filter_map(|b| f(find(sdpa, b, shape.name, n, None), "median_us"))
                .reduce(f64::min);
            let flash = f(find(rows, "flash_decode", shape.name, n, None), "median_us");
            for k in KS {
                let r = find(rows, "retrieval", shape.name, n, Some(k));
                let us = f(r, "median_us");
                let gbps = f(r, "gbps");
                let _ = writeln!(
                    s,
                    "| {} | {}K | {k} | {} | {} | {} | {} | {} | {} | {} |",
                    shape.name,
                    n >> 10,
                    cell(us, 1),
                    cell(f(r, "graph_us"), 1),
                    cell(f(r, "bytes").map(|b| b / 1e6), 1),
                    cell(gbps, 0),
                    cell(gbps.map(|g| 100.0 * g / copy), 0),
                    cell(us.zip(best).map(|(u, b)| b / u), 0),
                    cell(us.zip(flash).map(|(u, fl)| fl / u), 0),
                );
            }
        }
    }
    let _ = writeln!(s, "\n### Retrieval through the pinned-host block cache (blocks of {BLOCK_TOKENS} tokens, LRU)\n");
    let _ = writeln!(s, "| shape | N | k | cold µs | MB copied cold | cold GB/s over PCIe | warm µs | of which CPU µs | warm hit ratio |");
    let _ = writeln!(s, "|---|---:|---:|---:|---:|---:|---:|---:|---:|");
    for shape in SHAPES {
        for &n in lengths {
            for k in KS {
                let r = find(rows, "pinned", shape.name, n, Some(k));
                let _ = writeln!(
                    s,
                    "| {} | {}K | {k} | {} | {} | {} | {} | {} | {} |",
                    shape.name,
                    n >> 10,
                    cell(f(r, "cold_us"), 0),
                    cell(f(r, "cold_copied_mb"), 1),
                    cell(f(r, "cold_pcie_gbps"), 1),
                    cell(f(r, "warm_us"), 1),
                    cell(f(r, "warm_host_us"), 1),
                    cell(f(r, "warm_hit_ratio"), 3),
                );
            }
        }
    }
    s
}

fn read_jsonl(path: &str) -> Result<Vec<Value>> {
    let text = std::fs::read_to_string(path).with_context(|| format!("reading {path}"))?;
    text.lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| serde_json::from_str(l).with_context(|| format!("a line of {path}")))
        .collect()
}

/// A model's weight products per decode step: (name, n, k, times per token).
type Projection = (&'static str, usize, usize, usize);

const PROJECTIONS: [(&str, [Projection; 5]); 2] = [
    (
        "llama3-8b",
        [
            ("qkv", 6144, 4096, 32),
            ("wo", 4096, 4096, 32),
            ("gate_up", 28672, 4096, 32),
            ("down", 4096, 14336, 32),
            ("output", 128_256, 4096, 1),
        ],
    ),
    (
        "gemma3-270m",
        [
            ("qkv", 1536, 640, 18),
            ("wo", 640, 1024, 18),
            ("gate_up", 4096, 640, 18),
            ("down", 640, 2048, 18),
            ("output", 262_144, 640, 1),
        ],
    ),
];

/// `--projections`: each weight product of a decode step at batch 1 on the matrix-vector
/// kernel and on cuBLASLt, weights rotating over copies of more than 200 MB; a table with
/// the weights' GB/s and the sum per token.
fn projections(gpu: &Gpu, iters: usize) -> Result<()> {
    use kvdb_kernels::Gemm;
    let mut gemm = Gemm::new(gpu)?;
    println!("\n### Decode-step weight products at batch 1: matrix-vector kernel vs cuBLASLt (µs, median of events)\n");
    println!(
        "| model | product | n × k | vector kernel | GB/s | cuBLASLt | GB/s | cuBLASLt / kernel |"
    );
    println!("|---|---|---|---:|---:|---:|---:|---:|");
    for (model, products) in PROJECTIONS {
        let mut per_token = [0.0f64; 2];
        for (name, n, k, times) in products {
            let weights: Vec<bf16> = random(n * k, (n * k) as u64);
            let copies = (ROTATE_BYTES / (2 * n * k) as f64).ceil().max(1.0) as usize;
            let copies: Vec<CudaSlice<bf16>> = (0..copies)
                .map(|_| gpu.upload(&weights))
                .collect::<kvdb_kernels::Result<_>>()?;
            let x = gpu.upload(&random::<bf16>(k, 7))?;
            let mut out: CudaSlice<f32> = gpu.zeros(n)?;
            let mut medians = [0.0f64; 2];
            for (m, vector) in [true, false].into_iter().enumerate() {
                gemm.set_vector_kernel(vector);
                let t = time_events(gpu, iters, |i| {
                    let w = &copies[i % copies.len()];
                    let (x, w) = (x.as_view(), w.as_view());
                    Ok(gemm.linear(gpu, &x, &w, k, None, false, &mut out.as_view_mut())?)
                })?;
                medians[m] = t.median_us;
                per_token[m] += t.median_us * times as f64;
            }
            let gbps = |us: f64| (2 * n * k) as f64 / (us * 1e-6) / 1e9;
            println!(
                "| {model} | {name} | {n} × {k} | {:.1} | {:.0} | {:.1} | {:.0} | {:.2} |",
                medians[0],
                gbps(medians[0]),
                medians[1],
                gbps(medians[1]),
                medians[1] / medians[0]
            );
        }
        let [ours, lt] = per_token;
        println!(
            "| {model} | **per token** | | {ours:.0} | | {lt:.0} | | {:.2} |",
            lt / ours
        );
    }
    Ok(())
}

fn main() -> Result<()> {
    let args = Args::parse()?;
    let gpu = Gpu::new(0)?;
    if args.projections {
        return projections(&gpu, args.iters);
    }
    let copy = copy_gbps(&gpu)?;
    let pcie = pcie_gbps(&gpu)?;
    let device = json!({
        "impl": "device", "name": gpu.name()?, "multiprocessors": gpu.multiprocessors(),
        "copy_gbps": copy, "pcie_h2d_gbps": pcie,
    });
    println!("{device}");
    let lengths: &[usize] = if args.quick { &LENGTHS[..1] } else { &LENGTHS };
    let mut rows = vec![device];
    let chosen = |shape: Shape, n: usize, k: Option<usize>| match &args.only {
        None => true,
        Some((s, on, ok)) => s == shape.name && *on == n && k.is_none_or(|k| k == *ok),
    };
    for shape in SHAPES {
        for &n in lengths {
            if !chosen(shape, n, None) {
                continue;
            }
            let started = Instant::now();
            if args.f16 {
                let bench = Bench::<f16>::new(&gpu, shape, n, args.iters, args.scalar)?;
                run(bench, &args, &chosen, &mut rows)?;
            } else {
                let bench = Bench::<bf16>::new(&gpu, shape, n, args.iters, args.scalar)?;
                run(bench, &args, &chosen, &mut rows)?;
            }
            eprintln!(
                "{} N={n}: {:.1} s",
                shape.name,
                started.elapsed().as_secs_f64()
            );
        }
    }
    if let Some(path) = &args.json {
        let text: String = rows.iter().map(|r| format!("{r}\n")).collect();
        std::fs::write(path, text).with_context(|| format!("writing {path}"))?;
    }
    let sdpa = match &args.sdpa {
        Some(path) => read_jsonl(path)?,
        None => Vec::new(),
    };
    println!("{}", tables(&rows, &sdpa, copy, lengths));
    Ok(())
}

/// One shape and length: the flash baseline, buckets when asked, and each k's retrieval.
fn run<T: KvElement>(
    mut bench: Bench<'_, T>,
    args: &Args,
    chosen: &dyn Fn(Shape, usize, Option<usize>) -> bool,
    rows: &mut Vec<Value>,
) -> Result<()> {
    let (gpu, shape, n) = (bench.gpu, bench.shape, bench.n);
    if args.buckets_only {
        rows.extend(bench.buckets(256, 8, args.contiguous)?);
        return Ok(());
    }
    rows.push(bench.flash()?);
    let host = HostKv::new(
        gpu,
        &bench.keys,
        &bench.values,
        shape.kv_heads,
        shape.head_dim,
        BLOCK_TOKENS,
    )?;
    let mut cache = BlockCache::new(gpu, host, 2 << 30)?;
    if args.buckets {
        rows.extend(bench.buckets(256, 8, args.contiguous)?);
    }
    for k in KS.into_iter().filter(|&k| chosen(shape, n, Some(k))) {
        let (record, sets) = bench.retrieval(k)?;
        rows.push(record);
        rows.push(bench.pinned(&mut cache, k, &sets)?);
    }
    Ok(())
}
