//! `kvdb doctor`: what this kvdb finds on this machine and what is missing, for a user whose
//! command failed, and for a bug report.

use std::path::{Path, PathBuf};

use anyhow::Result;
use kvdb::store::{Access, Store, FORMAT_VERSION, OLDEST_FORMAT_VERSION};
use kvdb_model::fetch::{default_model_path, sha256_file, DEFAULT_MODEL_SHA256};
use kvdb_model::GgufFile;

/// What the checks found: problems are things a command will fail on.
#[derive(Default)]
struct Report {
    problems: Vec<String>,
}

impl Report {
    fn line(&self, what: &str, found: impl std::fmt::Display) {
        println!("{what:<14} {found}");
    }

    fn problem(&mut self, what: &str, found: String) {
        self.line(what, format!("PROBLEM: {found}"));
        self.problems.push(format!("{what}: {found}"));
    }
}

/// Prints every check; fails (exit status 1) when one found a problem.
pub fn doctor(model: Option<PathBuf>, store: Option<PathBuf>) -> Result<()> {
    let mut report = Report::default();
    report.line(
        "kvdb",
        format!(
            "{} ({} build, {})",
            env!("CARGO_PKG_VERSION"),
            if cfg!(debug_assertions) {
                "debug"
            } else {
                "release"
            },
            if cfg!(feature = "gpu") {
                "GPU support built in"
            } else {
                "CPU only"
            }
        ),
    );
    report.line(
        "linked",
        format!(
            "RocksDB {} (librocksdb-sys {}), faiss (faiss-sys {}, static), OpenBLAS",
            env!("KVDB_ROCKSDB_VERSION"),
            env!("KVDB_LIBROCKSDB_SYS_VERSION"),
            env!("KVDB_FAISS_SYS_VERSION")
        ),
    );
    cpu(&mut report);
    check_model(&mut report, model.as_deref());
    check_store(&mut report, store.as_deref());
    gpu(&mut report);
    if report.problems.is_empty() {
        println!("\nno problems found");
        Ok(())
    } else {
        println!("\n{} problem(s) found:", report.problems.len());
        for p in &report.problems {
            println!("- {p}");
        }
        std::process::exit(1)
    }
}

/// The CPU's vector features beside the ones this binary was compiled to require.
fn cpu(report: &mut Report) {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    #[cfg(target_arch = "x86_64")]
    {
        let has = [
            ("sse4.2", std::arch::is_x86_feature_detected!("sse4.2")),
            ("avx", std::arch::is_x86_feature_detected!("avx")),
            ("avx2", std::arch::is_x86_feature_detected!("avx2")),
            ("fma", std::arch::is_x86_feature_detected!("fma")),
            ("f16c", std::arch::is_x86_feature_detected!("f16c")),
            ("avx512f", std::arch::is_x86_feature_detected!("avx512f")),
        ];
        let found: Vec<&str> = has.iter().filter(|(_, on)| *on).map(|(n, _)| *n).collect();
        report.line("cpu", format!("x86-64, {cores} cores, {}", found.join(" ")));
        let level = kvdb_simd::level();
        let forced = level != kvdb_simd::Level::detected();
        report.line(
            "cpu kernels",
            format!(
                "{}{}",
                level.name(),
                if forced { " (KVDB_CPU=baseline)" } else { "" }
            ),
        );
        // What the compiler was allowed to use everywhere: the x86-64 baseline unless
        // RUSTFLAGS asked for more (`-C target-cpu=native` gives a faster binary for this CPU
        // only).
        let required = [
            ("avx2", cfg!(target_feature = "avx2")),
            ("fma", cfg!(target_feature = "fma")),
            ("f16c", cfg!(target_feature = "f16c")),
        ];
        let missing: Vec<&str> = required
            .iter()
            .filter(|(name, needed)| *needed && !has.iter().any(|(n, on)| n == name && *on))
            .map(|(n, _)| *n)
            .collect();
        if missing.is_empty() {
            report.line(
                "cpu features",
                "every feature this binary was built for is there",
            );
        } else {
            report.problem(
                "cpu features",
                format!(
                    "this binary was built for {} and the CPU lacks them: it will stop with an \
                     illegal instruction; build without a target-cpu in RUSTFLAGS",
                    missing.join(", ")
                ),
            );
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    report.line("cpu", format!("{}, {cores} cores", std::env::consts::ARCH));
}

/// The model a command would use: the one given, or the default one in the cache.
fn check_model(report: &mut Report, explicit: Option<&Path>) {
    let path = match explicit {
        Some(p) => p.to_path_buf(),
        None => match default_model_path() {
            Ok(p) => p,
            Err(e) => return report.problem("model", e.to_string()),
        },
    };
    if !path.exists() {
        let fix = if explicit.is_none() {
            ": fetch it with `kvdb model fetch`"
        } else {
            ""
        };
        return report.problem("model", format!("{} is missing{fix}", path.display()));
    }
    let sha = match sha256_file(&path) {
        Ok(sha) => sha,
        Err(e) => return report.problem("model", format!("{}: {e}", path.display())),
    };
    let described = GgufFile::open(&path).and_then(|f| f.config()).map(|c| {
        format!(
            "{:?}, {} layers, context {}",
            c.architecture,
            c.n_layers(),
            c.context_length
        )
    });
    let described = match described {
        Ok(d) => d,
        Err(e) => return report.problem("model", format!("{} is not usable: {e}", path.display())),
    };
    report.line("model", format!("{} ({described})", path.display()));
    if explicit.is_none() && sha != DEFAULT_MODEL_SHA256 {
        report.problem(
            "model sha256",
            format!("{sha}, not the default model's {DEFAULT_MODEL_SHA256}: fetch it again"),
        );
    } else {
        let verified = if explicit.is_none() {
            " (verified)"
        } else {
            ""
        };
        report.line("model sha256", format!("{sha}{verified}"));
    }
}

/// The store's format and corpora, read as a reader would (nothing is written).
fn check_store(report: &mut Report, path: Option<&Path>) {
    report.line(
        "store format",
        format!(
            "this kvdb reads versions {OLDEST_FORMAT_VERSION} to {FORMAT_VERSION} and writes \
             {FORMAT_VERSION}"
        ),
    );
    let Some(path) = path else {
        return;
    };
    match Store::open(path, Access::Read).and_then(|s| s.corpora()) {
        Ok(corpora) => {
            let names: Vec<String> = corpora
                .iter()
                .map(|c| format!("{} ({} tokens)", c.name, c.tokens))
                .collect();
            report.line(
                "store",
                format!(
                    "{}: {} corpora{}{}",
                    path.display(),
                    names.len(),
                    if names.is_empty() { "" } else { ": " },
                    names.join(", ")
                ),
            );
        }
        Err(e) => report.problem("store", e.to_string()),
    }
}

/// The GPU: driver, NVRTC and cuBLASLt found or not, and why. Not a problem when missing:
/// every command runs on the CPU.
#[cfg(feature = "gpu")]
fn gpu(report: &mut Report) {
    match kvdb_model::Gpu::new(0) {
        Ok(gpu) => {
            let name = gpu.name().unwrap_or_else(|e| format!("(no name: {e})"));
            report.line(
                "gpu",
                format!(
                    "{name}, {} multiprocessors{}",
                    gpu.multiprocessors(),
                    if gpu.hopper() { ", Hopper kernels" } else { "" }
                ),
            );
            match kvdb_model::Gemm::new(&gpu) {
                Ok(_) => report.line("cublaslt", "found"),
                Err(e) => report.problem("cublaslt", format!("{e}: `--device cuda` will fail")),
            }
        }
        Err(e) => report.line("gpu", format!("none usable ({e}); `--device cpu` works")),
    }
}

#[cfg(not(feature = "gpu"))]
fn gpu(report: &mut Report) {
    report.line("gpu", "not built in (rebuild with `--features gpu`)");
}
