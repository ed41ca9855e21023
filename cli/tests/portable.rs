//! The `kvdb` binary on a CPU without AVX. The workspace is compiled for the x86-64 baseline
//! and picks AVX2 at run time where the CPU has it (kvdb-simd, candle, OpenBLAS), so the one
//! binary must run on CPUs without AVX rather than stop with an illegal instruction. QEMU's
//! user-mode emulator runs it as its `qemu64` CPU (the x86-64 baseline with SSE3; no SSSE3,
//! SSE4 or AVX) and raises SIGILL on any instruction that CPU lacks: a binary built with
//! `-C target-cpu=x86-64-v3` dies there on its first instructions, which is what this test
//! catches. The CPU says it is an Intel one: as the AMD K8 that `qemu64` claims by default,
//! the system's OpenBLAS picks kernels with 3DNow! (`femms`), which every K8 has and QEMU
//! does not emulate; and without SSE3 its kernels stop on `movddup` (every x86-64 CPU since
//! 2005 has SSE3). The main job runs there end to end on a tiny model: ingest into RocksDB,
//! an IVF index (faiss) and an HNSW one, a question through each, with the same answers as
//! the native run.
//!
//! Needs `qemu-x86_64` (Debian: qemu-user, which scripts/setup.sh --for-tests installs);
//! without it the test prints SKIPPED and passes, unless KVDB_REQUIRE_E2E=1.

mod common;

use std::path::Path;
use std::process::{Command, Output};

use anyhow::{bail, ensure, Result};
use common::{tiny, write_documents};

/// The emulated CPU: SSE2 and SSE3, no SSSE3, SSE4, AVX or FMA (see the top).
const OLD_CPU: &str = "qemu64,vendor=GenuineIntel";

/// `kvdb ARGS`, natively or under QEMU as [`OLD_CPU`]; fails on a signal (no exit status).
fn kvdb(emulated: bool, args: &[&str]) -> Result<Output> {
    let bin = env!("CARGO_BIN_EXE_kvdb");
    let mut cmd = if emulated {
        let mut c = Command::new("qemu-x86_64");
        c.args(["-cpu", OLD_CPU, bin]);
        // A BLAS kernel family pinned for the host (`.ci/run` pins OpenBLAS's AVX2 ones) is
        // not the emulated CPU's: OpenBLAS picks its own there.
        c.env_remove("OPENBLAS_CORETYPE");
        c
    } else {
        Command::new(bin)
    };
    let out = cmd.args(args).output()?;
    let where_ = if emulated {
        "under qemu-x86_64 as a CPU without AVX"
    } else {
        "natively"
    };
    ensure!(
        out.status.code().is_some(),
        "kvdb {args:?} {where_} was killed by a signal ({}): an instruction the CPU lacks?\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(out)
}

/// Like [`kvdb`], and the command must succeed; returns its standard output.
fn kvdb_ok(emulated: bool, args: &[&str]) -> Result<String> {
    let out = kvdb(emulated, args)?;
    ensure!(
        out.status.success(),
        "kvdb {args:?} (emulated: {emulated}) failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

fn qemu_found() -> bool {
    Command::new("qemu-x86_64")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success())
}

/// Ingests `docs` into a fresh store under `dir`, adds two indexes and asks through each;
/// returns the two answers' text.
fn main_job(emulated: bool, model: &Path, docs: &[String], dir: &Path) -> Result<Vec<String>> {
    let store = dir.join(if emulated { "emulated" } else { "native" });
    let (s, m) = (
        store.to_str().unwrap_or_default(),
        model.to_str().unwrap_or_default(),
    );
    let mut ingest = vec!["ingest", "--store", s, "--corpus", "c", "--model", m];
    ingest.extend(["--progress", "none"]);
    ingest.extend(docs.iter().map(String::as_str));
    kvdb_ok(emulated, &ingest)?;
    let mut answers = Vec::new();
    for spec in ["ivf4,np2", "hnsw8,ef16"] {
        let add = ["index", "add", "--store", s, "--corpus", "c", "--model", m];
        kvdb_ok(
            emulated,
            &[&add[..], &["--progress", "none", spec]].concat(),
        )?;
        let ask = [
            "ask", "--store", s, "--corpus", "c", "--model", m, "--index", spec,
        ];
        let rest = ["--k", "8", "--window", "16", "--max-tokens", "6", "--json"];
        let out = kvdb_ok(emulated, &[&ask[..], &rest[..], &["which key?"]].concat())?;
        let json: serde_json::Value = serde_json::from_str(&out)?;
        let Some(answer) = json["answer"].as_str() else {
            bail!("kvdb ask --json printed no answer: {out}")
        };
        answers.push(answer.to_string());
    }
    Ok(answers)
}

#[test]
fn the_binary_runs_the_main_job_on_a_cpu_without_avx() -> Result<()> {
    if cfg!(not(target_arch = "x86_64")) || !qemu_found() {
        if std::env::var_os("KVDB_REQUIRE_E2E").is_some_and(|v| v == "1") {
            bail!(
                "qemu-x86_64 is missing and KVDB_REQUIRE_E2E=1 (Debian: apt-get install qemu-user)"
            );
        }
        eprintln!("SKIPPED: the_binary_runs_the_main_job_on_a_cpu_without_avx needs qemu-x86_64 on x86-64");
        return Ok(());
    }
    // The emulated CPU really lacks AVX2, and the kernels see it.
    let doctor = kvdb(true, &["doctor"])?;
    let report = String::from_utf8_lossy(&doctor.stdout);
    ensure!(
        report
            .lines()
            .any(|l| l.contains("cpu kernels") && l.contains("baseline")),
        "doctor on the emulated CPU does not report the baseline kernels:\n{report}"
    );

    let (model, _) = tiny()?;
    let dir = tempfile::tempdir()?;
    let docs: Vec<String> = write_documents(&dir.path().join("docs"), 3, 600, 7)?
        .iter()
        .map(|p| p.display().to_string())
        .collect();
    let native = main_job(false, model.path(), &docs, dir.path())?;
    let emulated = main_job(true, model.path(), &docs, dir.path())?;
    assert_eq!(
        emulated, native,
        "answers on the emulated CPU (baseline kernels) and natively"
    );
    Ok(())
}
