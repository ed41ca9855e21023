//! What the criterion micro-benches (`benches/benches/*.rs`) share: the corpus sizes, the
//! smoke run under `cargo test`, criterion's settings and [`IndexCache`], the on-disk cache
//! of built indexes.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use criterion::Criterion;
use kvdb_index::saap::SaapHead;
use kvdb_index::{BuildContext, IndexSpec, KeyIndex, SaapSpec};
use kvdb_model::Rope;

/// Seed of every corpus the benches draw (keys, values, queries, index builds).
pub const CORPUS_SEED: u64 = 2024;

/// Corpus sizes of a benchmark run: 16K, 128K and 1M keys.
const BENCH_KEYS: [usize; 3] = [1 << 14, 1 << 17, 1 << 20];

/// The corpus size of a smoke run.
const SMOKE_KEYS: usize = 1 << 12;

/// Default of `KVDB_BENCH_BUILD_LIMIT`, in seconds.
const DEFAULT_BUILD_LIMIT_S: f64 = 600.0;

/// Layout version of the cached files' names and contents; bump it when the way corpora
/// are drawn changes.
const CACHE_VERSION: u32 = 1;

/// Whether criterion only tests the benches: run without `--bench` (`cargo test --benches`)
/// or with `--test`, it calls each routine once. The benches then shrink to a smoke run on
/// [`SMOKE_KEYS`] keys, so that testing them does not build million-key indexes.
pub fn smoke_run() -> bool {
    let args: Vec<String> = std::env::args().collect();
    !args.iter().any(|a| a == "--bench") || args.iter().any(|a| a == "--test")
}

/// The corpus sizes to run, ascending.
pub fn corpus_sizes() -> Vec<usize> {
    if smoke_run() {
        vec![SMOKE_KEYS]
    } else {
        BENCH_KEYS.to_vec()
    }
}

/// `16K`, `128K`, `1M`: a size for bench names.
pub fn size_label(n: usize) -> String {
    match n {
        n if n >= 1 << 20 && n % (1 << 20) == 0 => format!("{}M", n >> 20),
        n if n >= 1 << 10 && n % (1 << 10) == 0 => format!("{}K", n >> 10),
        n => n.to_string(),
    }
}

/// Criterion's settings for the micro-benches: 20 samples in 3 s after a 1 s warm-up (a
/// single search over a million keys takes a large part of a second), overridable on the
/// command line (`-- --quick`, `--sample-size`, `--measurement-time`).
pub fn criterion() -> Criterion {
    Criterion::default()
        .sample_size(20)
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3))
        .configure_from_args()
}

/// Runs `routine` `iters` times and returns how long that took: the body of criterion's
/// `iter_custom`, so that a bench's lazy setup (drawing a corpus, loading an index) runs
/// before the clock starts instead of inflating the warm-up's estimate.
pub fn time_iters<O>(iters: u64, mut routine: impl FnMut() -> O) -> Duration {
    let started = Instant::now();
    for _ in 0..iters {
        std::hint::black_box(routine());
    }
    started.elapsed()
}

/// Prints a status line of the benches (builds, loads, skips) on stderr.
pub fn status(line: &str) {
    eprintln!("kvdb-bench: {line}");
}

/// Built indexes saved with [`kvdb_index::save`] under `$KVDB_HOME/bench-indexes` (default
/// `~/.cache/kvdb/bench-indexes`), one file per spec, corpus size, head dimension, seed,
/// fit and cache version, so that a rerun loads instead of building.
///
/// Loading reopens an index with [`kvdb_index::load`], which keeps what the index saves:
/// ivf's k-means centroids, lsh's hash codes, saap's trained head. Indexes that save no
/// structure (flat, hip, ihip) or only part of it (hnsw rebuilds its graph from the keys
/// and the saved radius) cost about as much to load as to build.
#[derive(Debug, Clone)]
pub struct IndexCache {
    dir: PathBuf,
    /// The first hex digits of the fit's sha256: indexes of another fit are other files.
    fit: String,
    /// Builds estimated to take longer are skipped (`KVDB_BENCH_BUILD_LIMIT`, seconds).
    pub build_limit_s: f64,
}

impl IndexCache {
    /// The cache for corpora drawn from the fit whose file holds `fit_bytes`.
    pub fn new(fit_bytes: &[u8]) -> Result<Self> {
        let dir = kvdb_model::fetch::models_dir()?
            .parent()
            .context("the models folder has no parent")?
            .join("bench-indexes");
        std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        let build_limit_s = match std::env::var("KVDB_BENCH_BUILD_LIMIT") {
            Ok(s) => s
                .parse()
                .with_context(|| format!("KVDB_BENCH_BUILD_LIMIT={s} is not a number"))?,
            Err(_) => DEFAULT_BUILD_LIMIT_S,
        };
        Ok(Self {
            dir,
            fit: kvdb_model::fetch::sha256_hex(fit_bytes)[..12].to_string(),
            build_limit_s,
        })
    }

    fn path(&self, spec: &IndexSpec, keys: usize, head_dim: usize) -> PathBuf {
        let spec: String = spec
            .to_string()
            .chars()
            .map(|c| match c {
                'a'..='z' | 'A'..='Z' | '0'..='9' | ',' | '=' | '.' | '-' => c,
                _ => '_',
            })
            .collect();
        self.dir.join(format!(
            "v{CACHE_VERSION}-{}-d{head_dim}-n{keys}-s{CORPUS_SEED}-{spec}.idx",
            self.fit
        ))
    }

    /// The build seconds recorded in the cached index of `spec` over `keys` keys, if any.
    pub fn build_seconds(&self, spec: &IndexSpec, keys: usize, head_dim: usize) -> Option<f64> {
        let bytes = std::fs::read(self.path(spec, keys, head_dim)).ok()?;
        Some(kvdb_index::saved_info(&bytes).ok()?.stats.seconds)
    }

    /// Why building `spec` over `keys` keys is skipped, if it is: the recorded build time of
    /// the largest smaller cached size (from `smaller`), scaled linearly by the key count,
    /// exceeds the build limit. Without a smaller build to go by, nothing is skipped.
    pub fn skip_reason(
        &self,
        spec: &IndexSpec,
        keys: usize,
        head_dim: usize,
        smaller: &[usize],
    ) -> Option<String> {
        let (from, seconds) = smaller
            .iter()
            .rev()
            .find_map(|&n| Some((n, self.build_seconds(spec, n, head_dim)?)))?;
        let estimate = seconds * keys as f64 / from as f64;
        (estimate > self.build_limit_s).then(|| {
            format!(
                "skipped {spec} at {} keys, d {head_dim}: its build would take about {estimate:.0} \
                 s ({seconds:.1} s at {} × {}), over the {:.0} s limit (KVDB_BENCH_BUILD_LIMIT)",
                size_label(keys),
                size_label(from),
                keys / from,
                self.build_limit_s
            )
        })
    }

    /// The index `spec` over pre-RoPE `keys` (RoPE `rope`, build seed [`CORPUS_SEED`]): loaded
    /// from the cache, or built (calling `saap` for the trained head only when a saap index
    /// is built; it is trained for that spec) and saved. Status lines say which and how long it took.
    pub fn load_or_build<'h>(
        &self,
        spec: &IndexSpec,
        rope: &Rope,
        keys: &[f32],
        saap: &dyn Fn(&SaapSpec) -> Result<&'h SaapHead>,
    ) -> Result<Box<dyn KeyIndex>> {
        let d = rope.head_dim();
        let n = keys.len() / d;
        let path = self.path(spec, n, d);
        let what = format!("{spec} over {} keys, d {d}", size_label(n));
        let mut context = BuildContext {
            rope: rope.clone(),
            seed: CORPUS_SEED,
            saap: None,
            queries: None,
        };
        if let Ok(bytes) = std::fs::read(&path) {
            let started = Instant::now();
            match kvdb_index::load(&bytes, &context, keys) {
                Ok(index) => {
                    status(&format!(
                        "loaded {what} in {:.1} s (built in {:.1} s) from {}",
                        started.elapsed().as_secs_f64(),
                        index.build_stats().seconds,
                        path.display()
                    ));
                    return Ok(index);
                }
                Err(e) => status(&format!("rebuilding {what}: the cached copy failed: {e}")),
            }
        }
        if let IndexSpec::Saap(saap_spec) = spec {
            context.saap = Some(saap(saap_spec)?);
        }
        status(&format!("building {what} ..."));
        let index = kvdb_index::build(spec, &context, keys)?;
        let stats = index.build_stats();
        status(&format!(
            "built {what} in {:.1} s{}",
            stats.seconds,
            stats
                .warnings
                .iter()
                .map(|w| format!("; {w}"))
                .collect::<String>()
        ));
        let tmp = path.with_extension(format!("tmp{}", std::process::id()));
        std::fs::write(&tmp, kvdb_index::save(index.as_ref())?)
            .with_context(|| format!("writing {}", tmp.display()))?;
        std::fs::rename(&tmp, &path).with_context(|| format!("renaming to {}", path.display()))?;
        Ok(index)
    }
}
