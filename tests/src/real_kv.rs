//! Keys, values and queries of the default model's retrieval layers on real text (the GPL-3
//! in `tests/data`), captured once and cached on disk, for index tests with fixed floors on
//! real inputs rather than random vectors.

use std::io::{Read, Write};
use std::ops::Range;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, OnceLock};

use anyhow::{ensure, Context, Result};
use candle_core::Device;
use kvdb_model::{
    AttentionBackend, AttentionInput, EncodeOptions, FullAttention, GgufFile, LayerKind,
    LoadOptions, Model, Rope, Tokenizer, WeightMode,
};

/// One retrieval layer's first KV head, as the model produced it over real text.
#[derive(Debug, Clone)]
pub struct RealKv {
    /// The layer.
    pub layer: usize,
    /// Its RoPE.
    pub rope: Rope,
    /// Attention logits are multiplied by this.
    pub scale: f32,
    /// Query heads per KV head.
    pub group: usize,
    /// Vector length.
    pub head_dim: usize,
    /// Pre-RoPE keys `[n, head_dim]` of KV head 0 (id = position).
    pub keys: Vec<f32>,
    /// Values `[n, head_dim]` of KV head 0.
    pub values: Vec<f32>,
    /// Pre-RoPE queries `[n, group, head_dim]` of KV head 0's query heads.
    pub queries: Vec<f32>,
}

impl RealKv {
    /// Tokens captured.
    pub fn len(&self) -> usize {
        self.keys.len() / self.head_dim
    }

    /// Whether nothing was captured.
    pub fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }

    /// The first `tokens` positions.
    fn prefix(&self, tokens: usize) -> Self {
        let d = self.head_dim;
        Self {
            keys: self.keys[..tokens * d].to_vec(),
            values: self.values[..tokens * d].to_vec(),
            queries: self.queries[..tokens * self.group * d].to_vec(),
            rope: self.rope.clone(),
            ..*self
        }
    }

    /// The pre-RoPE queries of the group at `position`, `[group, head_dim]`.
    pub fn query(&self, position: usize) -> &[f32] {
        let w = self.group * self.head_dim;
        &self.queries[position * w..(position + 1) * w]
    }

    /// Each head's exact softmax weights (f64) of the query at `position` over keys
    /// `0..=position`: `[group][position + 1]`.
    pub fn weights(&self, position: usize) -> Vec<Vec<f64>> {
        let d = self.head_dim;
        let mut keys = self.keys[..(position + 1) * d].to_vec();
        self.rope.rotate_rows(&mut keys, 0);
        let mut queries = self.query(position).to_vec();
        self.rope.rotate(&mut queries, position);
        attention_weights(&keys, &queries, d, self.scale)
    }
}

/// Each query's exact softmax weights (f64) over `keys` `[n, d]`, with logits `scale · q·k`;
/// queries and keys already rotated: `[queries][n]`.
pub fn attention_weights(keys: &[f32], queries: &[f32], d: usize, scale: f32) -> Vec<Vec<f64>> {
    queries
        .chunks_exact(d)
        .map(|q| {
            let logits: Vec<f64> = keys
                .chunks_exact(d)
                .map(|k| {
                    scale as f64
                        * q.iter()
                            .zip(k)
                            .map(|(a, b)| *a as f64 * *b as f64)
                            .sum::<f64>()
                })
                .collect();
            let max = logits.iter().fold(f64::NEG_INFINITY, |m, &l| m.max(l));
            let exp: Vec<f64> = logits.iter().map(|l| (l - max).exp()).collect();
            let sum: f64 = exp.iter().sum();
            exp.into_iter().map(|e| e / sum).collect()
        })
        .collect()
}

/// The GPL-3 text in `tests/data`.
pub fn gpl_text() -> Result<String> {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/data/gpl-3.txt");
    std::fs::read_to_string(path).with_context(|| format!("reading {path}"))
}

/// The default model (exact f32 weights) and its tokenizer; an error saying to run
/// `kvdb model fetch` when it is missing.
pub fn default_model() -> Result<(Model, Tokenizer)> {
    let path = kvdb_model::fetch::default_model_path()?;
    ensure!(
        path.exists(),
        "run `kvdb model fetch` first: {} is missing",
        path.display()
    );
    let mut file = GgufFile::open(&path)?;
    let tokenizer = Tokenizer::from_gguf(file.metadata())?;
    let options = LoadOptions {
        weights: WeightMode::Dequantized,
        ..LoadOptions::default()
    };
    let model = Model::from_gguf(&mut file, &options, &Device::Cpu)?;
    Ok((model, tokenizer))
}

/// The retrieval layers of the default model over the first `tokens` tokens of the GPL-3
/// text (at most [`real_kv_whole`]'s length, ~7.5K tokens): a prefix of the whole capture,
/// which is exact because the model is causal and prefills in the same 512-token chunks.
pub fn real_kv(tokens: usize) -> Result<Arc<Vec<RealKv>>> {
    /// Captures by their token count.
    type Captures = Vec<(usize, Arc<Vec<RealKv>>)>;
    static CACHE: OnceLock<Mutex<Captures>> = OnceLock::new();
    let cache = CACHE.get_or_init(Default::default);
    let mut cache = cache.lock().map_err(|_| anyhow::anyhow!("poisoned"))?;
    if let Some((_, kv)) = cache.iter().find(|(n, _)| *n == tokens) {
        return Ok(kv.clone());
    }
    let whole = real_kv_whole()?;
    let available = whole.first().map_or(0, RealKv::len);
    ensure!(
        tokens <= available,
        "the GPL-3 text has only {available} tokens"
    );
    let kv = Arc::new(whole.iter().map(|kv| kv.prefix(tokens)).collect::<Vec<_>>());
    cache.push((tokens, kv.clone()));
    Ok(kv)
}

/// The retrieval layers of the default model over the whole GPL-3 text, captured once per
/// process and cached under `~/.cache/kvdb/fixtures` across test binaries.
pub fn real_kv_whole() -> Result<Arc<Vec<RealKv>>> {
    static WHOLE: Mutex<Option<Arc<Vec<RealKv>>>> = Mutex::new(None);
    let mut whole = WHOLE.lock().map_err(|_| anyhow::anyhow!("poisoned"))?;
    if let Some(kv) = whole.as_ref() {
        return Ok(kv.clone());
    }
    let (model, tokenizer) = default_model()?;
    let ids = tokenizer.encode(&gpl_text()?, EncodeOptions::default())?;
    let kv = Arc::new(match read_cached(&model, ids.len()) {
        Ok(kv) => kv,
        Err(_) => {
            let kv = capture(&model, &ids)?;
            write_cached(&kv, ids.len())?;
            kv
        }
    });
    *whole = Some(kv.clone());
    Ok(kv)
}

fn capture(model: &Model, ids: &[u32]) -> Result<Vec<RealKv>> {
    let config = model.config().clone();
    let layers: Vec<usize> = config
        .layers
        .iter()
        .filter(|l| matches!(l.kind, LayerKind::Global))
        .map(|l| l.index)
        .collect();
    let (d, group) = (config.head_dim, config.n_heads / config.n_kv_heads);
    let mut out: Vec<RealKv> = layers
        .iter()
        .map(|&layer| RealKv {
            layer,
            rope: model.rope(layer).cloned().unwrap_or_else(|| unreachable!()),
            scale: 0.0,
            group,
            head_dim: d,
            keys: Vec::new(),
            values: Vec::new(),
            queries: Vec::new(),
        })
        .collect();
    let mut full = FullAttention::new(&config);
    let mut record = |input: &AttentionInput<'_>| -> kvdb_model::Result<candle_core::Tensor> {
        if let Some(slot) = out.iter_mut().find(|s| s.layer == input.layer.index) {
            slot.scale = input.scale;
            // KV head 0 and its query heads 0..group.
            let k = input
                .keys
                .narrow(1, 0, 1)?
                .flatten_all()?
                .to_vec1::<f32>()?;
            let v = input
                .values
                .narrow(1, 0, 1)?
                .flatten_all()?
                .to_vec1::<f32>()?;
            let q = input
                .queries
                .narrow(1, 0, group)?
                .flatten_all()?
                .to_vec1::<f32>()?;
            slot.keys.extend(k);
            slot.values.extend(v);
            slot.queries.extend(q);
        }
        full.attend(input)
    };
    for (i, chunk) in ids.chunks(512).enumerate() {
        model.forward(
            chunk,
            i * 512,
            &mut record as &mut dyn AttentionBackend,
            &kvdb_model::Logits::None,
        )?;
    }
    Ok(out)
}

fn cache_path(tokens: usize) -> Result<PathBuf> {
    let dir = kvdb_model::fetch::models_dir()?
        .parent()
        .map(|p| p.join("fixtures"))
        .context("no cache folder")?;
    Ok(dir.join(format!("real-kv-gpl3-{tokens}.f32")))
}

fn read_cached(model: &Model, tokens: usize) -> Result<Vec<RealKv>> {
    let mut bytes = Vec::new();
    std::fs::File::open(cache_path(tokens)?)?.read_to_end(&mut bytes)?;
    let floats: Vec<f32> = bytes
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect();
    let config = model.config();
    let (d, group) = (config.head_dim, config.n_heads / config.n_kv_heads);
    let mut at = 0;
    let mut take = |n: usize| -> Result<Vec<f32>> {
        ensure!(at + n <= floats.len(), "short cache file");
        at += n;
        Ok(floats[at - n..at].to_vec())
    };
    let mut out = Vec::new();
    for l in config
        .layers
        .iter()
        .filter(|l| matches!(l.kind, LayerKind::Global))
    {
        let scale = take(1)?[0];
        out.push(RealKv {
            layer: l.index,
            rope: model.rope(l.index).cloned().context("no rope")?,
            scale,
            group,
            head_dim: d,
            keys: take(tokens * d)?,
            values: take(tokens * d)?,
            queries: take(tokens * group * d)?,
        });
    }
    ensure!(at == floats.len(), "cache file of another shape");
    Ok(out)
}

fn write_cached(kv: &[RealKv], tokens: usize) -> Result<()> {
    let path = cache_path(tokens)?;
    std::fs::create_dir_all(path.parent().context("no parent")?)?;
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    let mut file = std::io::BufWriter::new(std::fs::File::create(&tmp)?);
    for layer in kv {
        for v in std::iter::once(&layer.scale)
            .chain(&layer.keys)
            .chain(&layer.values)
            .chain(&layer.queries)
        {
            file.write_all(&v.to_le_bytes())?;
        }
    }
    file.into_inner()?.sync_all()?;
    std::fs::rename(tmp, path)?;
    Ok(())
}

/// The engine's default attention sink, left out of the candidates.
pub const SINK: u32 = 4;
/// The engine's default recent window, left out of the candidates.
pub const WINDOW: usize = 256;

/// The candidates of a query at `position`: past the sink, before the window.
pub fn candidates(position: usize) -> Range<u32> {
    SINK..(position - WINDOW) as u32
}

/// 32 evenly spread positions of the last quarter of `n` tokens.
pub fn last_quarter(n: usize) -> Vec<usize> {
    (0..32).map(|i| n - n / 4 + i * (n / 4) / 32).collect()
}

/// The share of each head's eligible attention mass (`weights` `[heads][ids]`) that
/// `ids` hold, averaged over the heads.
pub fn mass_recall(weights: &[Vec<f64>], ids: &[u32], eligible: &Range<u32>) -> f64 {
    let per_head: Vec<f64> = weights
        .iter()
        .map(|w| {
            let total: f64 = eligible.clone().map(|id| w[id as usize]).sum();
            let selected: f64 = ids.iter().map(|&id| w[id as usize]).sum();
            selected / total
        })
        .collect();
    per_head.iter().sum::<f64>() / per_head.len() as f64
}
