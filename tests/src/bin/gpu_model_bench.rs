//! `gpu_model_bench`: prefill and decode speed of kvdb's GPU forward pass (bf16) on one GGUF
//! model, the kvdb side of `scripts/gpu-model-bench.sh` (which runs PyTorch's baseline in the
//! same command).
//!
//! ```text
//! gpu_model_bench --model PATH --name gemma3-270m [--lengths 4096,32768,131072]
//!                 [--contexts 4096,32768] [--steps 64] [--out FILE]
//! ```
//!
//! Prefill: one whole-sequence forward of random tokens (the model splits it into chunks of
//! `GPU_MAX_CHUNK`), logits of the last token only; wall time to the logits on the host,
//! after a warm-up call; the median of 3 calls at 4K and below, one call above. Decode: after
//! a prefill of `context` tokens, `steps` single-token forwards with their logits, median
//! step. Prints a table and appends JSON lines to `--out`.

use std::io::Write;
use std::sync::Arc;
use std::time::Instant;

use anyhow::Result;
use candle_core::Device;
use clap::Parser;
use kvdb_model::{
    Gpu, GpuModel, LoadOptions, Logits, Model, Precision, SequenceOptions, WeightMode,
};
use kvdb_tests::random_tokens;

#[derive(Debug, Parser)]
struct Args {
    /// The GGUF file.
    #[arg(long)]
    model: std::path::PathBuf,
    /// A name for the table.
    #[arg(long)]
    name: String,
    /// Prefill lengths.
    #[arg(long, value_delimiter = ',', default_value = "4096,32768,131072")]
    lengths: Vec<usize>,
    /// Decode context lengths.
    #[arg(long, value_delimiter = ',', default_value = "4096,32768")]
    contexts: Vec<usize>,
    /// Timed decode steps.
    #[arg(long, default_value_t = 64)]
    steps: usize,
    /// Append JSON lines here.
    #[arg(long)]
    out: Option<std::path::PathBuf>,
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() -> Result<()> {
    let args = Args::parse();
    let started = Instant::now();
    let options = LoadOptions {
        weights: WeightMode::Dequantized,
        ..LoadOptions::default()
    };
    let model = Model::load(&args.model, &options, &Device::Cpu)?;
    let gpu = Arc::new(Gpu::new(0)?);
    let gpu_model = GpuModel::new(&model, gpu.clone(), Precision::Bf16)?;
    drop(model);
    let config = gpu_model.config().clone();
    eprintln!(
        "{}: loaded and uploaded in {:.1}s on {}",
        args.name,
        started.elapsed().as_secs_f64(),
        gpu.name()?
    );
    let mut lines = Vec::new();
    let mut record = |line: String| {
        println!("{line}");
        lines.push(line);
    };
    let prefill = |n: usize| -> Result<f64> {
        let tokens = random_tokens(n, config.vocab_size, n as u64);
        let mut sequence = gpu_model.sequence(&SequenceOptions::default())?;
        let t = Instant::now();
        sequence.forward(&tokens, &Logits::Last)?;
        Ok(t.elapsed().as_secs_f64())
    };
    prefill(4096.min(config.context_length))?;
    for &n in &args.lengths {
        if n > config.context_length {
            eprintln!(
                "{}: {n} tokens exceed the context of {}",
                args.name, config.context_length
            );
            continue;
        }
        let runs = if n <= 4096 { 3 } else { 1 };
        let seconds = median((0..runs).map(|_| prefill(n)).collect::<Result<_>>()?);
        record(format!(
            "{{\"impl\":\"kvdb\",\"shape\":\"{}\",\"phase\":\"prefill\",\"tokens\":{n},\"ms\":{:.3},\"tok_s\":{:.1}}}",
            args.name,
            seconds * 1e3,
            n as f64 / seconds
        ));
    }
    for &n in &args.contexts {
        if n + args.steps > config.context_length {
            continue;
        }
        let tokens = random_tokens(n + args.steps, config.vocab_size, 7);
        let mut sequence = gpu_model.sequence(&SequenceOptions::default())?;
        sequence.forward(&tokens[..n], &Logits::Last)?;
        let mut steps = Vec::with_capacity(args.steps);
        for &token in &tokens[n..] {
            let t = Instant::now();
            sequence.forward(&[token], &Logits::Last)?;
            steps.push(t.elapsed().as_secs_f64());
        }
        let step = median(steps);
        record(format!(
            "{{\"impl\":\"kvdb\",\"shape\":\"{}\",\"phase\":\"decode\",\"tokens\":{n},\"ms\":{:.3},\"tok_s\":{:.1}}}",
            args.name,
            step * 1e3,
            1.0 / step
        ));
    }
    if let Some(path) = &args.out {
        let mut file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)?;
        for line in &lines {
            writeln!(file, "{line}")?;
        }
    }
    Ok(())
}
