//! Fits the micro-benches' [`KeyModel`] to real keys, values and queries and writes it to
//! `benches/data/key-model.bin`: the default model (Gemma 3 270M) over the GPL-3 text
//! (`kvdb_tests::real_kv_whole`, ~7.5K tokens), its middle retrieval layer, KV head 0 and
//! that head's query group.
//!
//! `cargo run --release -p kvdb-benches --bin fit_keys` (needs `kvdb model fetch` first)

use anyhow::{ensure, Context, Result};
use kvdb_benches::key_model::{committed_path, KeyModel, LowRankGaussian};
use kvdb_model::{GgufFile, RopeScaling, RopeStyle};

/// Principal directions of the keys: about 90% of their variance in this layer.
const KEY_RANK: usize = 32;
/// Principal directions of a group's queries (`[group · head_dim]`): about 70%.
const QUERY_RANK: usize = 32;
/// Values keep only their per-dimension mean and spread: they do not change what the
/// benches time.
const VALUE_RANK: usize = 0;

fn main() -> Result<()> {
    let layers = kvdb_tests::real_kv_whole()?;
    let kv = layers
        .get(layers.len() / 2)
        .context("the model has no retrieval layer")?;
    let path = kvdb_model::fetch::default_model_path()?;
    let config = GgufFile::open(&path)?.config()?;
    let rope = &config.layers[kv.layer].rope;
    ensure!(
        rope.style == RopeStyle::Halves && matches!(rope.scaling, RopeScaling::None),
        "layer {} has RoPE {rope:?}; the key model assumes unscaled half-split RoPE",
        kv.layer
    );
    let d = kv.head_dim;
    let fit = KeyModel::new(
        format!(
            "{}, layer {} KV head 0 and its {} query heads, GPL-3 text ({} tokens)",
            path.file_name()
                .map_or_else(String::new, |f| f.to_string_lossy().into_owned()),
            kv.layer,
            kv.group,
            kv.len()
        ),
        rope.base,
        kv.group,
        LowRankGaussian::fit(&kv.keys, d, KEY_RANK)?,
        LowRankGaussian::fit(&kv.values, d, VALUE_RANK)?,
        LowRankGaussian::fit(&kv.queries, kv.group * d, QUERY_RANK)?,
    );
    let out = committed_path();
    std::fs::create_dir_all(out.parent().context("no parent")?)?;
    let bytes = fit.to_bytes()?;
    std::fs::write(&out, &bytes).with_context(|| format!("writing {}", out.display()))?;
    println!("{}", fit.source);
    for (name, g) in [
        ("keys", &fit.keys),
        ("values", &fit.values),
        ("queries", &fit.queries),
    ] {
        println!(
            "{name:<8} dim {:>4}  rank {:>2}  explained variance {:.3}",
            g.dim,
            g.rank(),
            g.explained_variance()
        );
    }
    println!("wrote {} ({} bytes)", out.display(), bytes.len());
    Ok(())
}
