//! Helpers the CLI's store tests share: a tiny model, generated documents, and a decoded dump
//! of what a corpus stored.

use std::path::{Path, PathBuf};

use anyhow::Result;
use kvdb::models::{load, ComputeDevice, LoadedModel};
use kvdb::store::{Kv, Store};
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
    let loaded = load(Some(file.path()), &LoadOptions::default(), device)?;
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
/// stored key/value row of every layer and KV head.
pub fn dump(store: &Store, name: &str) -> Result<(String, Vec<u32>, Vec<Vec<u32>>)> {
    let m = store.manifest(name)?;
    let docs = store.documents(&m)?;
    let header = format!(
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
        }
    }
    Ok((header, tokens, rows))
}
