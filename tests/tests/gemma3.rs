//! The real default model (Gemma 3 270M, GGUF Q4_K_M) against two independent references
//! and against itself: candle-transformers' `quantized_gemma3`, llama.cpp's logits on a
//! 1,600-token real-text prompt (a golden file made by `scripts/reference/logits_golden.py`),
//! chunked vs one-shot prefill, decode vs prefill, and the attention hook.
//!
//! The model is loaded once per weight mode and shared by the tests (they run in parallel
//! threads of one process). It must be fetched first: `kvdb model fetch`.

use std::path::PathBuf;
use std::sync::OnceLock;

use anyhow::{Context, Result};
use candle_core::{Device, Tensor};
use kvdb_model::{
    Activation, AttentionBackend, AttentionInput, Capture, FullAttention, GgufFile, LayerKind,
    LoadOptions, Logits, Model, Tokenizer, WeightMode,
};

fn model_path() -> PathBuf {
    let path = match std::env::var_os("KVDB_MODEL") {
        Some(p) => PathBuf::from(p),
        None => kvdb_model::fetch::default_model_path().expect("no model cache folder"),
    };
    assert!(
        path.exists(),
        "the default model is missing at {}: run `kvdb model fetch` (or set KVDB_MODEL)",
        path.display()
    );
    path
}

fn load(options: LoadOptions) -> Model {
    Model::load(model_path(), &options, &Device::Cpu).expect("loading the default model")
}

/// f32 weights: the exact reference mode.
fn exact() -> &'static Model {
    static M: OnceLock<Model> = OnceLock::new();
    M.get_or_init(|| {
        load(LoadOptions {
            weights: WeightMode::Dequantized,
            activation: None,
        })
    })
}

/// The default (hybrid) mode.
fn hybrid() -> &'static Model {
    static M: OnceLock<Model> = OnceLock::new();
    M.get_or_init(|| load(LoadOptions::default()))
}

fn tokenizer() -> &'static Tokenizer {
    static T: OnceLock<Tokenizer> = OnceLock::new();
    T.get_or_init(|| {
        let file = GgufFile::open(model_path()).expect("opening the default model");
        Tokenizer::from_gguf(file.metadata()).expect("building the tokenizer")
    })
}

/// BOS + the first `n - 1` tokens of the GPL-3 text (real prose).
fn real_tokens(n: usize) -> Vec<u32> {
    let text = include_str!("../data/gpl-3.txt");
    let tok = tokenizer();
    let mut ids = vec![tok.bos_id().expect("Gemma has a BOS token")];
    ids.extend(tok.encode(text, Default::default()).expect("encoding"));
    assert!(ids.len() >= n, "the text has only {} tokens", ids.len());
    ids.truncate(n);
    ids
}

/// How far two computations of the same logits may be apart: the largest |Δlogit| and the
/// mean |Δlogit| over the whole vocabulary (the mean is the robust one; the max is a tail).
#[derive(Debug, Clone, Copy)]
struct Tolerance {
    max: f32,
    mean: f32,
}

/// Two f32 computations that sum in another order (logits reach about 30; measured
/// differences are below 1e-4).
const EXACT: Tolerance = Tolerance {
    max: 2e-3,
    mean: 2e-4,
};

/// One side uses quantized kernels, which round activations to 8 bits (as llama.cpp does):
/// this model amplifies such rounding to about one logit at the extremes (llama.cpp's own
/// f16 and f32 KV caches differ by 2.1 on the golden prompt), while the mean moves little.
/// Wrong maths (SiLU for GELU) is off by 13 at the extremes and 4 on average.
const QUANTIZED_SPREAD: Tolerance = Tolerance {
    max: 2.5,
    mean: 0.3,
};

/// Asserts that `a` and `b` agree within `tol`, printing what was measured.
fn assert_close(what: &str, a: &Tensor, b: &Tensor, tol: Tolerance) -> Result<()> {
    let diff = (a - b)?.abs()?.flatten_all()?;
    let max = diff.max(0)?.to_scalar::<f32>()?;
    let mean = diff.mean(0)?.to_scalar::<f32>()?;
    eprintln!("{what}: max |Δlogit| {max:.2e}, mean {mean:.2e}");
    assert!(max < tol.max, "{what}: max |Δlogit| {max} ≥ {}", tol.max);
    assert!(
        mean < tol.mean,
        "{what}: mean |Δlogit| {mean} ≥ {}",
        tol.mean
    );
    Ok(())
}

fn max_abs_diff(a: &Tensor, b: &Tensor) -> Result<f32> {
    Ok((a - b)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?)
}

fn argmax(row: &Tensor) -> Result<u32> {
    Ok(row.flatten_all()?.argmax(0)?.to_scalar::<u32>()?)
}

/// Logits of `tokens` at `rows`, prefilled in chunks of `chunk`.
/// Rows come back in increasing order.
fn logits_at(model: &Model, tokens: &[u32], chunk: usize, rows: &[usize]) -> Result<Tensor> {
    let mut rows = rows.to_vec();
    rows.sort_unstable();
    rows.dedup();
    let mut cache = FullAttention::new(model.config());
    let mut out = Vec::new();
    for (i, piece) in tokens.chunks(chunk).enumerate() {
        let start = i * chunk;
        let wanted: Vec<usize> = rows
            .iter()
            .filter(|&&r| r >= start && r < start + piece.len())
            .map(|&r| r - start)
            .collect();
        let want = if wanted.is_empty() {
            Logits::None
        } else {
            Logits::Rows(wanted)
        };
        if let Some(l) = model.forward(piece, start, &mut cache, &want)? {
            out.push(l);
        }
    }
    Ok(Tensor::cat(&out, 0)?)
}

#[test]
fn matches_candle_quantized_gemma3_below_512_tokens() -> Result<()> {
    use candle_transformers::models::quantized_gemma3::ModelWeights;
    // candle's quantized_gemma3 uses SiLU in the MLP where Gemma 3 uses GELU-tanh (see the
    // llama.cpp test below, which tells them apart); everything else is compared as is.
    let ours = load(LoadOptions {
        weights: WeightMode::Dequantized,
        activation: Some(Activation::Silu),
    });
    let path = model_path();
    // candle reads CANDLE_DEQUANTIZE_ALL once per thread: load and run on a fresh thread.
    let prompt = real_tokens(300);
    let steps = 20;
    let candle_run = {
        let prompt = prompt.clone();
        std::thread::spawn(move || -> Result<Vec<(Tensor, u32)>> {
            std::env::set_var("CANDLE_DEQUANTIZE_ALL", "1");
            let mut f = std::fs::File::open(&path)?;
            let content = candle_core::quantized::gguf_file::Content::read(&mut f)?;
            let mut m = ModelWeights::from_gguf(content, &mut f, &Device::Cpu)?;
            let mut out = Vec::new();
            let mut logits = m.forward(
                &Tensor::new(prompt.as_slice(), &Device::Cpu)?.unsqueeze(0)?,
                0,
            )?;
            for i in 0..steps {
                let row = logits.squeeze(0)?;
                let next = argmax(&row)?;
                out.push((row, next));
                logits = m.forward(
                    &Tensor::new(&[next], &Device::Cpu)?.unsqueeze(0)?,
                    prompt.len() + i,
                )?;
            }
            Ok(out)
        })
        .join()
        .map_err(|_| anyhow::anyhow!("candle thread panicked"))??
    };
    // Relative to the logits' range (about 30 here): f32 sums in another order.
    const TOLERANCE: f32 = 2e-3;
    let mut cache = FullAttention::new(ours.config());
    let mut logits = ours
        .forward(&prompt, 0, &mut cache, &Logits::Last)?
        .context("logits")?;
    let mut worst = 0f32;
    for (i, (candle_row, candle_next)) in candle_run.iter().enumerate() {
        let row = logits.squeeze(0)?;
        let scale = candle_row.abs()?.max(0)?.to_scalar::<f32>()?;
        let diff = max_abs_diff(&row, candle_row)? / scale;
        worst = worst.max(diff);
        assert!(
            diff < TOLERANCE,
            "step {i}: relative max |Δlogit| {diff} ≥ {TOLERANCE}"
        );
        let next = argmax(&row)?;
        assert_eq!(next, *candle_next, "greedy token differs at step {i}");
        logits = ours
            .forward(&[next], prompt.len() + i, &mut cache, &Logits::Last)?
            .context("logits")?;
    }
    eprintln!("candle parity: worst relative max |Δlogit| over {steps} steps = {worst:.2e}");
    Ok(())
}

#[derive(serde::Deserialize)]
struct Golden {
    tokens: Vec<u32>,
    runs: std::collections::HashMap<String, GoldenRun>,
}

#[derive(serde::Deserialize)]
struct GoldenRun {
    positions: Vec<GoldenPosition>,
}

#[derive(serde::Deserialize)]
struct GoldenPosition {
    position: usize,
    top: Vec<(u32, f32)>,
    logsumexp: f64,
}

/// How our logits at one golden position compare with llama.cpp's.
#[derive(Debug)]
struct Agreement {
    position: usize,
    /// Largest |Δlogit| over llama.cpp's top-64 ids.
    max: f32,
    /// Mean |Δlogit| over those ids.
    mean: f32,
    /// |Δ logsumexp| over the whole vocabulary.
    lse: f64,
    /// Whether the most likely token is the same.
    top1: bool,
}

fn compare_with_llama_cpp(model: &Model) -> Result<Vec<Agreement>> {
    let golden: Golden = serde_json::from_str(include_str!(
        "../../model/tests/data/gemma3_logits_golden.json"
    ))?;
    let run = &golden.runs["kv_f32"];
    let rows: Vec<usize> = run.positions.iter().map(|p| p.position).collect();
    let logits = logits_at(model, &golden.tokens, 512, &rows)?;
    let mut out = Vec::new();
    for (i, p) in run.positions.iter().enumerate() {
        let row: Vec<f32> = logits.get(i)?.to_vec1()?;
        let max = row.iter().cloned().fold(f32::NEG_INFINITY, f32::max) as f64;
        let lse = max
            + row
                .iter()
                .map(|&x| (x as f64 - max).exp())
                .sum::<f64>()
                .ln();
        let diffs: Vec<f32> = p
            .top
            .iter()
            .map(|&(id, v)| (row[id as usize] - v).abs())
            .collect();

        let ours_top = row
            .iter()
            .enumerate()
            .max_by(|a, b| a.1.total_cmp(b.1))
            .map(|(i, _)| i as u32);
        out.push(Agreement {
            position: p.position,
            max: diffs.iter().copied().fold(0f32, f32::max),
            mean: diffs.iter().sum::<f32>() / diffs.len() as f32,
            lse: (lse - p.logsumexp).abs(),
            top1: ours_top == Some(p.top[0].0),
        });
    }
    Ok(out)
}

#[test]
fn matches_llama_cpp_on_1600_real_tokens() -> Result<()> {
    // llama.cpp multiplies with activations rounded to 8 bits, and this model is sensitive to
    // such rounding: llama.cpp's own f16 and f32 KV caches differ by up to 2.1 in a logit on
    // this prompt (the golden's kv_spread). Measured here: max |Δlogit| up to 1.05, mean
    // 0.07-0.36 per position and 0.20 overall, |Δlogsumexp| up to 0.5, top-1 the same at 11
    // of 14 positions. A wrong activation (SiLU, below) is off by 13 and 4.3 on average.
    const POSITION_MEAN: f32 = 0.6;
    const OVERALL_MEAN: f32 = 0.35;
    const LSE: f64 = 0.8;
    for (name, model) in [("exact", exact()), ("hybrid", hybrid())] {
        let cmp = compare_with_llama_cpp(model)?;
        for a in &cmp {
            eprintln!("  {name} position {}: {a:?}", a.position);
            assert!(a.max < QUANTIZED_SPREAD.max, "{name}: {a:?}");
            assert!(a.mean < POSITION_MEAN, "{name}: {a:?}");
            assert!(a.lse < LSE, "{name}: {a:?}");
        }
        let agree = cmp.iter().filter(|a| a.top1).count();
        let mean = cmp.iter().map(|a| a.mean).sum::<f32>() / cmp.len() as f32;
        eprintln!(
            "llama.cpp parity ({name}): mean |Δlogit| {mean:.3}, top-1 agrees at {agree}/{}",
            cmp.len()
        );
        assert!(mean < OVERALL_MEAN, "{name}: mean |Δlogit| {mean}");
        assert!(
            agree * 4 >= cmp.len() * 3,
            "{name}: top-1 agrees at only {agree}/{}",
            cmp.len()
        );
    }
    Ok(())
}

#[test]
fn silu_mlp_does_not_match_llama_cpp() -> Result<()> {
    // The golden comparison can fail: the MLP activation candle uses is far off.
    let silu = load(LoadOptions {
        weights: WeightMode::Dequantized,
        activation: Some(Activation::Silu),
    });
    let cmp = compare_with_llama_cpp(&silu)?;
    let mean = cmp.iter().map(|a| a.mean).sum::<f32>() / cmp.len() as f32;
    let worst = cmp.iter().map(|a| a.max).fold(0f32, f32::max);
    eprintln!("SiLU instead of GELU: mean |Δlogit| {mean:.2}, worst {worst:.2}");
    assert!(
        mean > 1.0 && worst > 3.0,
        "SiLU should be far from llama.cpp: mean {mean}, worst {worst}"
    );
    Ok(())
}

#[test]
fn chunked_prefill_equals_single_shot() -> Result<()> {
    // 700 tokens: past the 512-token sliding window, so chunks cross it.
    let tokens = real_tokens(700);
    let rows: Vec<usize> = (0..700).step_by(37).chain([511, 512, 699]).collect();
    // Hybrid: chunks (and logit rows) of under 16 use the quantized kernels.
    for (name, model, tolerance) in [
        ("exact", exact(), EXACT),
        ("hybrid", hybrid(), QUANTIZED_SPREAD),
    ] {
        let single = logits_at(model, &tokens, tokens.len(), &rows)?;
        for chunk in [300, 97, 64, 8] {
            let chunked = logits_at(model, &tokens, chunk, &rows)?;
            assert_close(
                &format!("{name}: chunks of {chunk}"),
                &single,
                &chunked,
                tolerance,
            )?;
        }
    }
    Ok(())
}

#[test]
fn decode_after_prefill_equals_longer_prefill() -> Result<()> {
    let tokens = real_tokens(560);
    let split = 530;
    let rows: Vec<usize> = (split..tokens.len()).collect();
    // Hybrid decode runs the quantized kernels where prefill multiplies in f32: measured up
    // to 1.0 apart. Exact mode must agree to rounding.
    for (name, model, tolerance) in [
        ("exact", exact(), EXACT),
        ("hybrid", hybrid(), QUANTIZED_SPREAD),
    ] {
        let reference = logits_at(model, &tokens, tokens.len(), &rows)?;
        let mut cache = FullAttention::new(model.config());
        model.forward(&tokens[..split], 0, &mut cache, &Logits::None)?;
        let mut steps = Vec::new();
        for (i, &t) in tokens[split..].iter().enumerate() {
            steps.push(
                model
                    .forward(&[t], split + i, &mut cache, &Logits::Last)?
                    .context("logits")?,
            );
        }
        let decoded = Tensor::cat(&steps, 0)?;
        assert_close(
            &format!("{name}: decode vs prefill"),
            &reference,
            &decoded,
            tolerance,
        )?;
        assert_eq!(
            argmax(&reference.get(rows.len() - 1)?)?,
            argmax(&decoded.get(rows.len() - 1)?)?
        );
    }
    Ok(())
}

#[test]
fn perturbing_one_layer_changes_the_logits() -> Result<()> {
    let model = exact();
    let tokens = real_tokens(64);
    let mut plain = FullAttention::new(model.config());
    let base = model
        .forward(&tokens, 0, &mut plain, &Logits::Last)?
        .context("logits")?;
    let mut inner = FullAttention::new(model.config());
    // One head scaled: a uniform scale would be undone by Gemma's post-attention norm.
    let mut perturbed = |input: &AttentionInput<'_>| {
        let out = inner.attend(input)?;
        if input.layer.index == 7 {
            let scale = Tensor::new(&[1.2f32, 1.0, 1.0, 1.0], out.device())?.reshape((1, 4, 1))?;
            Ok(out.broadcast_mul(&scale)?)
        } else {
            Ok(out)
        }
    };
    let changed = model
        .forward(&tokens, 0, &mut perturbed, &Logits::Last)?
        .context("logits")?;
    let d = max_abs_diff(&base, &changed)?;
    assert!(
        d > 0.05,
        "scaling layer 7's attention by 1.05 moved the logits by only {d}"
    );
    Ok(())
}

#[test]
fn recording_backend_sees_every_layer_and_chunk_in_order() -> Result<()> {
    let model = exact();
    let config = model.config();
    let tokens = real_tokens(600);
    let mut capture = Capture::new(FullAttention::new(config));
    let chunk = 250;
    for (i, piece) in tokens.chunks(chunk).enumerate() {
        model.forward(piece, i * chunk, &mut capture, &Logits::None)?;
    }
    let (cache, calls) = capture.into_parts();
    let chunks = tokens.len().div_ceil(chunk);
    assert_eq!(calls.len(), chunks * config.n_layers());
    let mut next = vec![0usize; config.n_layers()];
    for (i, call) in calls.iter().enumerate() {
        assert_eq!(
            call.layer,
            i % config.n_layers(),
            "layers are called in order"
        );
        assert_eq!(
            call.positions.start, next[call.layer],
            "positions are contiguous"
        );
        next[call.layer] = call.positions.end;
        let t = call.positions.len();
        assert_eq!(call.queries.dims(), [t, config.n_heads, config.head_dim]);
        assert_eq!(call.keys.dims(), [t, config.n_kv_heads, config.head_dim]);
        assert_eq!(call.values.dims(), [t, config.n_kv_heads, config.head_dim]);
    }
    assert!(next.iter().all(|&n| n == tokens.len()));
    // Sliding-window layers keep only what their window can still see; global layers all.
    for spec in &config.layers {
        match spec.kind {
            LayerKind::Global => assert_eq!(cache.cached_tokens(spec.index), tokens.len()),
            LayerKind::SlidingWindow { window } => {
                assert!(cache.cached_tokens(spec.index) < window + chunk)
            }
        }
    }
    Ok(())
}

#[test]
fn captured_keys_are_pre_rope() -> Result<()> {
    // A pre-RoPE key depends only on the token's hidden state, not on its position. In layer 0
    // the hidden state is the token's embedding, so the same token at two positions must give
    // the same captured key and, once rotated, different ones.
    let model = exact();
    let tok = real_tokens(2)[1];
    let tokens = vec![tok; 6];
    let mut capture = Capture::only(FullAttention::new(model.config()), vec![0]);
    model.forward(&tokens, 0, &mut capture, &Logits::None)?;
    let keys = &capture.calls[0].keys;
    let d = max_abs_diff(&keys.get(0)?, &keys.get(5)?)?;
    assert!(
        d < 1e-6,
        "pre-RoPE keys of one token at two positions differ by {d}"
    );
    let rope = kvdb_model::Rope::new(
        &model.config().layers[0].rope,
        model.config().head_dim,
        None,
    );
    let rotated = rope.apply(keys, 0..6)?;
    assert!(max_abs_diff(&rotated.get(0)?, &rotated.get(5)?)? > 1e-2);
    Ok(())
}
