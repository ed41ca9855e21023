//! `kvdb bench`: compare index types on a real KV cache against full attention.

use std::path::PathBuf;

use anyhow::{Context, Result};
use indicatif::{ProgressBar, ProgressStyle};
use kvdb::ComputeDevice;
use kvdb_benches::harness::{run, BenchOptions, Preset};
use kvdb_benches::report::{read_results, write_report};
use kvdb_index::IndexSpec;
use kvdb_model::LoadOptions;

use crate::index_cli::parse_spec;

#[derive(Clone, Copy, clap::ValueEnum)]
pub(crate) enum PresetArg {
    /// Contexts 4K and 16K, 3 depths × 2 needles, budgets 1% and 5% (about 15 minutes on
    /// 2 cores for every index type).
    Quick,
    /// Contexts 4K to 30K, 5 depths × 3 needles, five budgets.
    Full,
}

#[derive(clap::Args)]
pub(crate) struct BenchArgs {
    /// A local GGUF file (default: the default model).
    #[arg(long)]
    model: Option<PathBuf>,
    /// Real text (.txt, .md, .html files, files without an extension, or folders) for the
    /// haystacks and the eval text.
    #[arg(long = "corpus-text", required_unless_present = "rerender", num_args = 1..)]
    corpus_text: Vec<PathBuf>,
    /// Index specs to compare (`flat`, the exact control, is always added).
    #[arg(long = "index", required_unless_present = "rerender", num_args = 1.., value_parser = parse_spec)]
    index: Vec<IndexSpec>,
    /// Folder for report.md, results.json and the plots.
    #[arg(long)]
    out: PathBuf,
    /// Measure nothing: draw the report and plots of the run saved in `--out` again from its
    /// results.json (after a kvdb update that adds plots or columns).
    #[arg(long, conflicts_with_all = ["corpus_text", "index"])]
    rerender: bool,
    /// The grid to run; the options below override parts of it.
    #[arg(long, value_enum, default_value = "quick")]
    preset: PresetArg,
    /// Context lengths in tokens, e.g. `4096,16384`.
    #[arg(long, value_delimiter = ',')]
    contexts: Option<Vec<usize>>,
    /// Needle depths in 0..1, e.g. `0.2,0.5,0.8`.
    #[arg(long, value_delimiter = ',')]
    depths: Option<Vec<f64>>,
    /// Needles per depth.
    #[arg(long)]
    needles: Option<usize>,
    /// Top-k budgets as shares of the corpus, e.g. `0.01,0.05`.
    #[arg(long, value_delimiter = ',')]
    budgets: Option<Vec<f64>>,
    /// Multiples of the budget a spec carries, for whole-bucket indexes (lists probed, `ℓ`)
    /// and hip/ihip (`k`), e.g. `0.5,1,2`: each is one more point of their curves.
    #[arg(long, value_delimiter = ',')]
    sweep: Option<Vec<f64>>,
    /// Tokens after each corpus scored for quality, KL and perplexity.
    #[arg(long, default_value_t = 256)]
    eval_tokens: usize,
    /// Seed of the needles and the random controls.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// SAAP artifact (default: the one registered for the model).
    #[arg(long)]
    saap: Option<PathBuf>,
    /// Every answer step also attends the token after each of the N retrieved tokens the
    /// step before attended most (`kvdb ask --follow`); it acts across decode steps, so on
    /// the needles' answers, not on the per-query retrieval measures.
    #[arg(long, default_value_t = 0, value_name = "N", value_parser = crate::retrieval_follow)]
    follow: usize,
}

pub(crate) fn bench(args: BenchArgs) -> Result<()> {
    if args.rerender {
        let result = read_results(&args.out)?;
        let files = write_report(&result, &args.out)
            .with_context(|| format!("writing the report into {}", args.out.display()))?;
        return list(files);
    }
    let preset = match args.preset {
        PresetArg::Quick => Preset::Quick,
        PresetArg::Full => Preset::Full,
    };
    let mut options = BenchOptions::preset(preset, args.corpus_text, args.index);
    options.contexts = args.contexts.unwrap_or(options.contexts);
    options.depths = args.depths.unwrap_or(options.depths);
    options.needles = args.needles.unwrap_or(options.needles);
    options.budgets = args.budgets.unwrap_or(options.budgets);
    options.sweep = args.sweep.unwrap_or(options.sweep);
    options.eval_tokens = args.eval_tokens;
    options.seed = args.seed;
    options.saap = args.saap;
    options.follow = args.follow;
    anyhow::ensure!(
        options.depths.iter().all(|d| (0.0..=1.0).contains(d)),
        "depths must lie in 0..1"
    );
    anyhow::ensure!(
        options.budgets.iter().all(|b| *b > 0.0 && *b <= 1.0),
        "budgets are shares of the corpus, in (0, 1]"
    );
    anyhow::ensure!(
        options.sweep.iter().all(|m| m.is_finite() && *m > 0.0),
        "sweep multiples must be positive"
    );
    let loaded = kvdb::load_model(
        args.model.as_deref(),
        &LoadOptions::default(),
        ComputeDevice::Cpu,
    )?;
    let bar = ProgressBar::new_spinner();
    bar.set_style(ProgressStyle::with_template(
        "{spinner} [{elapsed_precise}] {msg}",
    )?);
    bar.enable_steady_tick(std::time::Duration::from_millis(200));
    let mut result = run(loaded.as_ref(), &options, &bar)?;
    bar.finish_and_clear();
    result.command = std::env::args().collect::<Vec<_>>().join(" ");
    let files = write_report(&result, &args.out)
        .with_context(|| format!("writing the report into {}", args.out.display()))?;
    eprintln!("kvdb: bench done in {:.0} s", result.seconds);
    list(files)
}

/// Prints the files a report wrote, one per line.
fn list(files: Vec<PathBuf>) -> Result<()> {
    for file in files {
        println!("{}", file.display());
    }
    Ok(())
}
