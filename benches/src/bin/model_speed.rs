//! Prefill and decode speed of kvdb's forward pass against candle-transformers'
//! `quantized_gemma3`, measured side by side in one process.
//!
//! `cargo run --release -p kvdb-benches --bin model_speed -- [--model PATH]`

use std::time::Instant;

use anyhow::Result;
use candle_core::{Device, Tensor};
use candle_transformers::models::quantized_gemma3::ModelWeights as CandleGemma3;
use clap::Parser;
use kvdb_model::{FullAttention, GgufFile, LoadOptions, Logits, Model, WeightMode};

#[derive(Parser)]
struct Args {
    /// GGUF model (default: the cached default model).
    #[arg(long)]
    model: Option<std::path::PathBuf>,
    /// Prompt lengths to prefill.
    #[arg(long, value_delimiter = ',', default_values_t = vec![512, 2048])]
    prefill: Vec<usize>,
    /// Context length before the decode steps.
    #[arg(long, default_value_t = 2048)]
    decode_context: usize,
    /// Decode steps timed.
    #[arg(long, default_value_t = 32)]
    decode_steps: usize,
    /// kvdb's weight mode: hybrid, dequantized or quantized.
    #[arg(long, default_value = "hybrid")]
    weights: String,
    /// Time only kvdb (for profiling).
    #[arg(long)]
    ours_only: bool,
    /// Repetitions of each measurement (the best is kept).
    #[arg(long, default_value_t = 2)]
    repeat: usize,
}

fn tokens(n: usize, vocab: usize) -> Vec<u32> {
    // A fixed pseudo-random sequence: speed does not depend on which tokens they are.
    let mut s: u64 = 0x9E37_79B9_7F4A_7C15;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s % vocab as u64) as u32
        })
        .collect()
}

fn load_candle(path: &std::path::Path, dequantize: bool) -> Result<CandleGemma3> {
    // candle reads CANDLE_DEQUANTIZE_ALL once per thread: load on a fresh thread.
    let path = path.to_path_buf();
    std::thread::spawn(move || -> Result<CandleGemma3> {
        // SAFETY-free in edition 2021: set before candle's thread-local first reads it.
        std::env::set_var("CANDLE_DEQUANTIZE_ALL", if dequantize { "1" } else { "0" });
        let mut f = std::fs::File::open(&path)?;
        let content = candle_core::quantized::gguf_file::Content::read(&mut f)?;
        Ok(CandleGemma3::from_gguf(content, &mut f, &Device::Cpu)?)
    })
    .join()
    .map_err(|_| anyhow::anyhow!("loading thread panicked"))?
}

fn main() -> Result<()> {
    let args = Args::parse();
    let path = args
        .model
        .unwrap_or_else(|| kvdb_model::fetch::default_model_path().unwrap_or_default());
    let device = Device::Cpu;
    let ours = Model::from_gguf(
        &mut GgufFile::open(&path)?,
        &LoadOptions {
            weights: match args.weights.as_str() {
                "dequantized" => WeightMode::Dequantized,
                "quantized" => WeightMode::Quantized,
                _ => WeightMode::Hybrid,
            },
            ..Default::default()
        },
        &device,
    )?;
    let vocab = ours.config().vocab_size;
    if args.ours_only {
        for &n in &args.prefill {
            let toks = tokens(n, vocab);
            let mut cache = FullAttention::new(ours.config());
            let t = Instant::now();
            ours.forward(&toks, 0, &mut cache, &Logits::Last)?;
            println!(
                "prefill {n}: {:.1} tok/s",
                n as f64 / t.elapsed().as_secs_f64()
            );
        }
        let ctx = tokens(args.decode_context, vocab);
        let mut cache = FullAttention::new(ours.config());
        ours.forward(&ctx, 0, &mut cache, &Logits::None)?;
        let t = Instant::now();
        for (i, &tok) in tokens(args.decode_steps, vocab).iter().enumerate() {
            ours.forward(&[tok], ctx.len() + i, &mut cache, &Logits::Last)?;
        }
        println!(
            "decode: {:.2} ms/token",
            t.elapsed().as_secs_f64() * 1e3 / args.decode_steps as f64
        );
        return Ok(());
    }
    let candle_f32 = load_candle(&path, true)?;
    let candle_q = load_candle(&path, false)?;
    println!("model: {}", path.display());
    println!("cores: {}", cores());

    println!("\n| prefill tokens | kvdb tok/s | candle f32 tok/s | ratio |");
    println!("|---:|---:|---:|---:|");
    for &n in &args.prefill {
        let toks = tokens(n, vocab);
        // Interleaved, best of `repeat` each: the two see the same machine conditions.
        let (mut ours_s, mut candle_s) = (f64::INFINITY, f64::INFINITY);
        for _ in 0..args.repeat {
            let mut cache = FullAttention::new(ours.config());
            let t = Instant::now();
            ours.forward(&toks, 0, &mut cache, &Logits::Last)?;
            ours_s = ours_s.min(t.elapsed().as_secs_f64());
            let mut m = candle_f32.clone();
            let input = Tensor::new(toks.as_slice(), &device)?.unsqueeze(0)?;
            let t = Instant::now();
            m.forward(&input, 0)?;
            candle_s = candle_s.min(t.elapsed().as_secs_f64());
        }
        println!(
            "| {n} | {:.1} | {:.1} | {:.2}x |",
            n as f64 / ours_s,
            n as f64 / candle_s,
            candle_s / ours_s
        );
    }

    let ctx = tokens(args.decode_context, vocab);
    let steps = tokens(args.decode_steps, vocab);
    println!(
        "\n| decode at {} context | ms/token | tok/s |",
        args.decode_context
    );
    println!("|---|---:|---:|");
    let mut cache = FullAttention::new(ours.config());
    ours.forward(&ctx, 0, &mut cache, &Logits::None)?;
    let t = Instant::now();
    for (i, &tok) in steps.iter().enumerate() {
        ours.forward(&[tok], ctx.len() + i, &mut cache, &Logits::Last)?;
    }
    let ours_ms = t.elapsed().as_secs_f64() * 1e3 / steps.len() as f64;
    println!(
        "| kvdb (hybrid weights) | {ours_ms:.2} | {:.1} |",
        1e3 / ours_ms
    );
    let mut best_candle = f64::INFINITY;
    for (name, model) in [
        ("candle f32 (CANDLE_DEQUANTIZE_ALL=1)", &candle_f32),
        ("candle quantized", &candle_q),
    ] {
        let mut m = model.clone();
        m.forward(&Tensor::new(ctx.as_slice(), &device)?.unsqueeze(0)?, 0)?;
        let t = Instant::now();
        for (i, &tok) in steps.iter().enumerate() {
            m.forward(&Tensor::new(&[tok], &device)?.unsqueeze(0)?, ctx.len() + i)?;
        }
        let ms = t.elapsed().as_secs_f64() * 1e3 / steps.len() as f64;
        best_candle = best_candle.min(ms);
        println!("| {name} | {ms:.2} | {:.1} |", 1e3 / ms);
    }
    println!(
        "\ndecode speed ratio kvdb / best candle: {:.2}x",
        best_candle / ours_ms
    );
    Ok(())
}

/// Cores available to this process (rayon, OpenBLAS tasks and candle all use them).
fn cores() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}
