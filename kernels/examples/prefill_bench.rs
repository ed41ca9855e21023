//! Prefill attention on the GPU: `prefill_attention` (bf16, the tensor-core kernel) against
//! PyTorch's `scaled_dot_product_attention` (flash backend, bf16, causal), measured by
//! `scripts/bench_prefill_sdpa.py` in the same device command, which writes the file this
//! reads with `--sdpa`.
//!
//! ```sh
//! python3 scripts/bench_prefill_sdpa.py --out sdpa.jsonl && prefill_bench --sdpa sdpa.jsonl
//! prefill_bench [--sdpa FILE]... [--json FILE] [--quick] [--only 'SHAPE N MODE']...
//! ```
//!
//! Shapes: Llama-3-8B's attention (32 query heads, 8 KV heads, d 128) and Gemma-3-270M's
//! (4 query heads, 1 KV head, d 256), whole-sequence causal prefills of 4K, 32K and 128K
//! tokens, Gemma with a sliding window of 512 too; the same sequences in chunks of 4096
//! queries, each attending to the prefix before it (how the model calls the kernel); and a
//! decode step (one query) over a 1024-key window. Timing: CUDA events around each call (a
//! whole chunked sequence is one call), after a warm-up, the median of several. TFLOP/s
//! count 4·heads·d per visible (query, key) pair: 4·heads·d·n²/2 for a causal prefill.
//!
//! On a Hopper GPU both tensor-core kernels are timed: `prefill_hopper` (what the model uses
//! there) and the mma.sync kernel (`Gpu::portable`). Measured on an H200 (2026-11-26,
//! PyTorch 2.11 in the same command; every row in docs/benchmarks.md, "The model on the
//! GPU"), TFLOP/s of the Hopper kernel, the mma.sync kernel and PyTorch's flash SDPA:
//! Llama 32K whole 466.6 / 340.3 / 356.8, 128K in chunks of 4,096 452.6 / 332.9 / 350.9;
//! Gemma 32K whole 501.5 / 290.0 / 295.4, 128K in chunks 484.6 / 280.1 / 317.7.
//!
//! A decode step over a long global context is one block per KV head walking every key
//! tile: the model takes `flash_decode` (split over the sequence) for those.

use std::collections::HashMap;
use std::fmt::Write as _;

use anyhow::{Context, Result};
use half::bf16;
use kvdb_kernels::cudarc::driver::sys::CUevent_flags;
use kvdb_kernels::cudarc::driver::{CudaEvent, CudaSlice};
use kvdb_kernels::{prefill_attention, Causal, Gpu, KvCache};
use serde_json::{json, Value};

type T = bf16;

/// A model's attention shape.
#[derive(Debug, Clone, Copy)]
struct Shape {
    name: &'static str,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
}

const LLAMA: Shape = Shape {
    name: "llama",
    heads: 32,
    kv_heads: 8,
    head_dim: 128,
};
const GEMMA: Shape = Shape {
    name: "gemma",
    heads: 4,
    kv_heads: 1,
    head_dim: 256,
};
const CHUNK: usize = 4096;

/// One measured configuration.
#[derive(Debug, Clone, Copy)]
struct Config {
    shape: Shape,
    /// Sequence length (a decode step: the query's position + 1).
    n: usize,
    window: Option<usize>,
    /// Queries per call: `n` (one call), CHUNK (chunked) or 1 (a decode step).
    chunk: usize,
}

impl Config {
    /// The mode's name, shared with the Python script.
    fn mode(&self) -> String {
        let kind = match self.chunk {
            1 => "decode",
            c if c >= self.n => "prefill",
            _ => "chunked",
        };
        match self.window {
            Some(w) => format!("{kind}-w{w}"),
            None => kind.to_string(),
        }
    }

    /// Visible (query, key) pairs of the timed queries.
    fn pairs(&self) -> f64 {
        let first = if self.chunk == 1 { self.n - 1 } else { 0 };
        (first..self.n)
            .map(|p| self.window.map_or(p + 1, |w| (p + 1).min(w)) as f64)
            .sum()
    }

    fn flops(&self) -> f64 {
        4.0 * (self.shape.heads * self.shape.head_dim) as f64 * self.pairs()
    }
}

struct Args {
    /// PyTorch's results, one file or several (SDPA, FlexAttention).
    sdpa: Vec<String>,
    json: Option<String>,
    quick: bool,
    /// Only configurations whose "shape n mode" contains one of these.
    only: Vec<String>,
}

impl Args {
    fn parse() -> Result<Self> {
        let mut args = Self {
            sdpa: Vec::new(),
            json: None,
            quick: false,
            only: Vec::new(),
        };
        let mut it = std::env::args().skip(1);
        while let Some(arg) = it.next() {
            match arg.as_str() {
                "--sdpa" => args.sdpa.push(it.next().context("--sdpa FILE")?),
                "--json" => args.json = Some(it.next().context("--json FILE")?),
                "--quick" => args.quick = true,
                "--only" => args.only.push(it.next().context("--only 'SHAPE N MODE'")?),
                other => anyhow::bail!(
                    "unknown argument {other}; usage: prefill_bench [--sdpa FILE] [--json FILE] [--quick]"
                ),
            }
        }
        Ok(args)
    }
}

/// SplitMix64.
struct SplitMix(u64);

impl SplitMix {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
}

/// `len` random elements in [-1, 1), generated on every core.
fn random(len: usize, seed: u64) -> Vec<T> {
    let mut data = vec![T::default(); len];
    let threads = std::thread::available_parallelism().map_or(4, |n| n.get());
    let chunk = len.div_ceil(threads).max(1);
    std::thread::scope(|scope| {
        for (i, part) in data.chunks_mut(chunk).enumerate() {
            scope.spawn(move || {
                let mut rng = SplitMix(seed ^ (i as u64).wrapping_mul(0x2545_f491_4f6c_dd1d));
                part.iter_mut().for_each(|x| {
                    *x = T::from_f32((rng.next() >> 40) as f32 / (1u64 << 23) as f32 - 1.0)
                });
            });
        }
    });
    data
}

fn event(gpu: &Gpu) -> Result<CudaEvent> {
    Ok(gpu
        .context()
        .new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?)
}

/// Median milliseconds of `step` between two events: one warm-up call, then as many calls
/// as fit in about half a second (3 to 30).
fn time(gpu: &Gpu, mut step: impl FnMut() -> Result<()>) -> Result<(f64, usize)> {
    let once = |step: &mut dyn FnMut() -> Result<()>| -> Result<f64> {
        let (start, end) = (event(gpu)?, event(gpu)?);
        start.record(gpu.stream())?;
        step()?;
        end.record(gpu.stream())?;
        end.synchronize()?;
        Ok(f64::from(start.elapsed_ms(&end)?))
    };
    let first = once(&mut step)?;
    let reps = ((500.0 / first.max(1e-3)) as usize).clamp(3, 30);
    let mut times = (0..reps)
        .map(|_| once(&mut step))
        .collect::<Result<Vec<f64>>>()?;
    times.sort_by(f64::total_cmp);
    Ok((times[reps / 2], reps))
}

/// Times one configuration: a buffer of the sequence's keys and values (a ring of window +
/// chunk - 1 rows for a window), the queries of the timed positions.
fn measure(gpu: &Gpu, c: &Config) -> Result<(f64, usize)> {
    let Shape {
        heads,
        kv_heads,
        head_dim: d,
        ..
    } = c.shape;
    let capacity = match c.window {
        Some(w) => (w + c.chunk - 1).min(c.n),
        None => c.n,
    };
    let mut kv = KvCache::<T>::zeros(gpu, kv_heads, capacity, d)?;
    let rows = random(capacity * kv_heads * d, c.n as u64);
    kv.write_positions(gpu, c.n - capacity, &rows, &rows)?;
    let first = if c.chunk == 1 { c.n - 1 } else { 0 };
    let qrow = heads * d;
    let queries: CudaSlice<T> = gpu.upload(&random((c.n - first) * qrow, 7 + c.n as u64))?;
    let mut out: CudaSlice<T> = gpu.zeros((c.n - first) * qrow)?;
    let scale = 1.0 / (d as f32).sqrt();
    time(gpu, || {
        for start in (first..c.n).step_by(c.chunk) {
            let end = (start + c.chunk).min(c.n);
            let range = (start - first) * qrow..(end - first) * qrow;
            let mask = Causal {
                first_position: start,
                window: c.window,
            };
            prefill_attention(
                gpu,
                &queries.slice(range.clone()),
                heads,
                &kv,
                &mask,
                scale,
                &mut out.slice_mut(range),
            )?;
        }
        Ok(())
    })
}

fn configs(quick: bool) -> Vec<Config> {
    let lengths: &[usize] = if quick {
        &[4096, 32768]
    } else {
        &[4096, 32768, 131_072]
    };
    let mut out = Vec::new();
    let add = |out: &mut Vec<Config>, shape, n, window, chunk| {
        out.push(Config {
            shape,
            n,
            window,
            chunk,
        })
    };
    for (shape, window) in [(LLAMA, None), (GEMMA, None), (GEMMA, Some(512))] {
        for &n in lengths {
            add(&mut out, shape, n, window, n);
        }
        for &n in lengths.iter().filter(|&&n| n > CHUNK) {
            add(&mut out, shape, n, window, CHUNK);
        }
    }
    add(&mut out, GEMMA, 100_000, Some(1024), 1);
    add(&mut out, LLAMA, 1024, None, 1);
    add(&mut out, LLAMA, 32768, None, 1);
    out
}

/// PyTorch's results by (shape, n, mode): the median in milliseconds and what it ran.
type Baseline = HashMap<(String, usize, String), (f64, String)>;

fn read_sdpa(path: &str) -> Result<Baseline> {
    let text = std::fs::read_to_string(path).with_context(|| format!("reading {path}"))?;
    let mut map = HashMap::new();
    for line in text.lines().filter(|l| !l.trim().is_empty()) {
        let v: Value = serde_json::from_str(line)?;
        let (Some(shape), Some(n), Some(mode), Some(ms)) = (
            v["shape"].as_str(),
            v["n"].as_u64(),
            v["mode"].as_str(),
            v["ms"].as_f64(),
        ) else {
            continue;
        };
        let how = v["impl"].as_str().unwrap_or("sdpa").to_string();
        map.insert((shape.to_string(), n as usize, mode.to_string()), (ms, how));
    }
    Ok(map)
}

fn main() -> Result<()> {
    let args = Args::parse()?;
    let gpu = Gpu::new(0)?;
    println!("prefill_bench on {}", gpu.name()?);
    // On Hopper both tensor-core kernels, side by side.
    let kernels = gpu.kernel_sets()?;
    let mut sdpa = HashMap::new();
    for path in &args.sdpa {
        sdpa.extend(read_sdpa(path)?);
    }
    let mut json_lines = String::new();
    let mut table = String::new();
    writeln!(
        table,
        "{:<6} {:>7} {:<14} {:<8} {:>10} {:>8} {:>10} {:>8} {:>7}  pytorch",
        "shape", "n", "mode", "kernel", "ours ms", "TFLOP/s", "torch ms", "TFLOP/s", "ratio"
    )?;
    for c in configs(args.quick) {
        let name = format!("{} {} {}", c.shape.name, c.n, c.mode());
        if !args.only.is_empty() && !args.only.iter().any(|o| name.contains(o.as_str())) {
            continue;
        }
        for (kernel, gpu) in &kernels {
            let (ms, reps) = measure(gpu, &c)?;
            let tflops = c.flops() / (ms * 1e-3) / 1e12;
            let key = (c.shape.name.to_string(), c.n, c.mode());
            let theirs = sdpa.get(&key);
            let (torch_ms, torch_tflops, ratio, how) = match theirs {
                Some((t, how)) => (
                    format!("{t:.3}"),
                    format!("{:.1}", c.flops() / (t * 1e-3) / 1e12),
                    format!("{:.2}", t / ms),
                    how.as_str(),
                ),
                None => ("-".into(), "-".into(), "-".into(), ""),
            };
            writeln!(
                table,
                "{:<6} {:>7} {:<14} {:<8} {:>10.3} {:>8.1} {:>10} {:>8} {:>7}  {how}",
                c.shape.name,
                c.n,
                c.mode(),
                kernel,
                ms,
                tflops,
                torch_ms,
                torch_tflops,
                ratio
            )?;
            let line = json!({
                "impl": "kvdb_prefill", "kernel": kernel, "shape": c.shape.name, "n": c.n,
                "mode": c.mode(), "ms": ms, "reps": reps, "tflops": tflops,
            });
            writeln!(json_lines, "{line}")?;
            eprintln!("{line}");
        }
    }
    if let Some(path) = &args.json {
        std::fs::write(path, &json_lines)?;
    }
    println!("\nratio = PyTorch's time / ours (above 1: ours is faster)\n{table}");
    Ok(())
}
