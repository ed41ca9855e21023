//! Helpers the CLI's store tests share: a tiny model, generated documents, a decoded dump
//! of what a corpus stored, and `kvdb ingest` killed and resumed.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use anyhow::{ensure, Result};
use kvdb::store::{Access, Kv, Store};
use kvdb::{load_model, ComputeDevice, LoadedModel};
use kvdb_model::LoadOptions;
use kvdb_tests::{TinyFile, TinyModel};
use rand::{Rng, SeedableRng};

/// A tiny gemma3 with room for a few thousand tokens of context.
pub fn tiny() -> Result<(TinyFile, LoadedModel)> {
    tiny_on(ComputeDevice::Cpu)
}

/// [`tiny`] loaded for `device` (an error on a machine without it).
pub fn tiny_on(device: ComputeDevice) -> Result<(TinyFile, LoadedModel)> {
    let file = TinyModel {
        context_length: 32768,
        ..TinyModel::gemma3()
    }
    .write_temp()?;
    let loaded = load_model(Some(file.path()), &LoadOptions::default(), device)?;
    Ok((file, loaded))
}

/// Writes `count` documents of varied text, each about `chars` long, into `dir`.
pub fn write_documents(dir: &Path, count: usize, chars: usize, seed: u64) -> Result<Vec<PathBuf>> {
    let words = [
        "the",
        "store",
        "keeps",
        "every",
        "key",
        "and",
        "value",
        "of",
        "a",
        "corpus",
        "so",
        "queries",
        "never",
        "prefill",
        "it",
        "again",
        "attention",
        "retrieval",
        "block",
        "layer",
    ];
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    std::fs::create_dir_all(dir)?;
    let mut paths = Vec::new();
    for i in 0..count {
        let mut text = format!("Document {i}.\n");
        while text.len() < chars {
            text.push_str(words[rng.random_range(0..words.len())]);
            text.push(if rng.random_range(0..12) == 0 {
                '\n'
            } else {
                ' '
            });
        }
        let path = dir.join(format!("doc{i:02}.txt"));
        std::fs::write(&path, text)?;
        paths.push(path);
    }
    Ok(paths)
}

/// Everything a corpus stored, decoded: manifest counts, documents, tokens, and every
/// stored key/value row and sampled query (positions in the header) of every layer and KV
/// head.
pub fn dump(store: &Store, name: &str) -> Result<(String, Vec<u32>, Vec<Vec<u32>>)> {
    let m = store.manifest(name)?;
    let docs = store.documents(&m)?;
    let mut header = format!(
        "tokens {} documents {} pending {:?} docs {:?}",
        m.tokens,
        m.documents,
        m.pending,
        docs.iter()
            .map(|d| (d.number, d.sha256.clone(), d.tokens.clone()))
            .collect::<Vec<_>>()
    );
    let tokens = store.tokens(&m, 0..m.tokens)?;
    let mut rows = Vec::new();
    for layer in 0..m.layers.len() {
        for head in 0..m.model.n_kv_heads {
            for kv in [Kv::Keys, Kv::Values] {
                let range = m.stored_range(layer, m.tokens);
                let r = store.rows(&m, kv, layer, head, range)?;
                rows.push(r.iter().map(|x| x.to_bits()).collect());
            }
            // The sampled queries (none in a layer that keeps none) and their positions.
            let sample = store.query_sample(&m, layer, head)?;
            rows.push(sample.queries.iter().map(|x| x.to_bits()).collect());
            header.push_str(&format!(" sample {layer}/{head} {:?}", sample.positions));
        }
    }
    Ok((header, tokens, rows))
}

/// Runs `kvdb ingest` with `args(store)` (which must ask for `--progress json`) into corpus
/// `c` of a store in `dir`, killing it with SIGKILL at seeded moments (after the n-th
/// committed chunk, plus a seeded delay) and resuming it each time, until 6 kills have landed
/// and one of them left a document half-stored; then checks that a last, uninterrupted run
/// leaves bit for bit what one ingest into a fresh store does. `fresh(store)` readies an
/// empty store before its first ingest (e.g. a corpus made with a chunk size of its own).
#[allow(dead_code)] // Not every test file kills ingests.
pub fn sigkill_and_resume(
    dir: &Path,
    args: &dyn Fn(&Path) -> Vec<String>,
    fresh: &dyn Fn(&Path) -> Result<()>,
    seed: u64,
) -> Result<()> {
    // `KVDB_BIN` names the binary where the tests run away from their build (a GPU machine).
    let bin = std::env::var_os("KVDB_BIN").unwrap_or(env!("CARGO_BIN_EXE_kvdb").into());
    let kvdb = || Command::new(&bin);
    let run = |store: &Path| -> Result<()> {
        let out = kvdb().args(args(store)).output()?;
        ensure!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        Ok(())
    };
    let reference = dir.join("reference");
    fresh(&reference)?;
    run(&reference)?;
    let expected = dump(&Store::open(&reference, Access::Read)?, "c")?;

    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let store_path = dir.join("killed");
    fresh(&store_path)?;
    let (mut kills, mut mid_document) = (0, 0);
    for round in 0..40 {
        if kills >= 6 && mid_document >= 1 {
            break;
        }
        let after_commits = rng.random_range(0..4);
        let delay = Duration::from_micros(rng.random_range(0..4000));
        let mut child = kvdb()
            .args(args(&store_path))
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()?;
        let stdout = child.stdout.take().expect("piped stdout");
        let mut commits = 0;
        let mut finished = true;
        for line in BufReader::new(stdout).lines() {
            if line?.contains("\"committed\"") {
                commits += 1;
                if commits > after_commits {
                    std::thread::sleep(delay);
                    finished = false;
                    break;
                }
            }
        }
        child.kill()?; // SIGKILL on Unix
        let status = child.wait()?;
        if finished && status.success() {
            // It ran to the end before the kill: start over from an empty store.
            std::fs::remove_dir_all(&store_path)?;
            fresh(&store_path)?;
            continue;
        }
        kills += 1;
        let store = Store::open(&store_path, Access::Read)?;
        if let Ok(m) = store.manifest("c") {
            if m.pending.is_some() {
                mid_document += 1;
            }
            // The committed state is always consistent: documents list what the manifest says.
            store.documents(&m)?;
        }
        drop(store);
        eprintln!("round {round}: killed after {commits} committed chunks (+{delay:?})");
    }
    ensure!(kills >= 5, "only {kills} kills landed");
    ensure!(mid_document >= 1, "no kill left a document half-stored");
    run(&store_path)?;
    let resumed = dump(&Store::open(&store_path, Access::Read)?, "c")?;
    ensure!(expected.0 == resumed.0, "manifest and documents differ");
    ensure!(expected.1 == resumed.1, "tokens differ");
    ensure!(expected.2 == resumed.2, "stored keys/values differ");
    Ok(())
}
