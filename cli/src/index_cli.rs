//! The index commands of the `kvdb` binary: `index add|remove|list` and `saap train`, and the index
//! update that `ingest` runs after its documents.

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{Context, Result};
use indicatif::{HumanBytes, ProgressBar, ProgressStyle};
use kvdb::read_documents;
use kvdb::store::{Access, Store};
use kvdb::ComputeDevice;
use kvdb::TrainOptions;
use kvdb::{list_indexes, remove_index, saap_registry_path, update_indexes, IndexEvent, IndexInfo};
use kvdb::{train_artifact, SaapTraining, TrainEvent};
use kvdb::{ModelRef, DOCUMENT_SEPARATOR};
use kvdb_index::saap::SaapArtifact;
use kvdb_index::IndexSpec;
use kvdb_model::LoadOptions;

use crate::corpus_cli::{CorpusRef, ProgressMode};

/// Parses an index spec for clap (the error shows the grammar).
pub(crate) fn parse_spec(s: &str) -> Result<IndexSpec, String> {
    s.parse().map_err(|e: kvdb_index::IndexError| e.to_string())
}

#[derive(clap::Subcommand)]
pub(crate) enum IndexCommand {
    /// Build indexes over a corpus's stored keys and save them in the store.
    Add {
        #[command(flatten)]
        target: CorpusRef,
        /// A local GGUF file (default: the default model); it must be the corpus's model.
        #[arg(long)]
        model: Option<PathBuf>,
        /// The SAAP artifact for `saap` specs (default: the one registered for the model).
        #[arg(long)]
        saap: Option<PathBuf>,
        /// How to show progress.
        #[arg(long, value_enum, default_value = "bar")]
        progress: ProgressMode,
        /// Index specs, e.g. `ivf256,np8` `hnsw16,ef128` `lsh:L=32,K=8` `saap1024,l32`
        /// `hip:k512,bq32,bk2` `ihip:2k`, or a kind alone (`ivf`, `hnsw`, ...) for its
        /// default.
        #[arg(required = true, value_parser = parse_spec)]
        specs: Vec<IndexSpec>,
    },
    /// Remove indexes from a corpus: their saved data is deleted and they are no longer
    /// listed (the only index of a corpus stays: add another first).
    Remove {
        #[command(flatten)]
        target: CorpusRef,
        /// Index specs as `kvdb index list` shows them (or any spelling of the same spec).
        #[arg(required = true)]
        specs: Vec<String>,
    },
    /// List a corpus's indexes: spec as asked and as built, keys, build time, bytes.
    List(CorpusRef),
}

#[derive(clap::Subcommand)]
pub(crate) enum SaapCommand {
    /// Train SAAP's centroids and query classifiers for a model on real text, as one artifact
    /// (registered for the model, so `saap<C>,l<P>` specs find it).
    Train(SaapTrainArgs),
}

#[derive(clap::Args)]
pub(crate) struct SaapTrainArgs {
    /// A local GGUF file (default: the default model).
    #[arg(long)]
    model: Option<PathBuf>,
    /// Where to write the artifact (its loss curve goes next to it as `.loss.svg`).
    #[arg(long)]
    out: PathBuf,
    /// Seed of k-means, sampling and initialisation.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Buckets per layer and KV head (the default is what the `saap` spec alone searches).
    #[arg(long, default_value_t = SaapTraining::default().options.centroids)]
    centroids: usize,
    /// Tokens to prefill, at most: the text with its drills, in windows of at most the model's
    /// context, each prefilled on its own.
    #[arg(long, default_value_t = SaapTraining::default().tokens)]
    tokens: usize,
    /// Retrieval drills planted in the text: made-up facts asked for and answered again
    /// 1,536+ tokens later, so the classifiers see the long-range lookups that questions over
    /// a corpus make (prose has few). Each window's text is cut at a paragraph break to leave
    /// its share room; the partition is fitted to the text's keys alone. Last measured on the
    /// needle with 500 drills in 32,768 tokens at 256 buckets (docs/benchmarks.md).
    #[arg(long, default_value_t = SaapTraining::default().drills)]
    drills: usize,
    /// Passes over the training queries.
    #[arg(long, default_value_t = TrainOptions::default().epochs)]
    epochs: usize,
    /// Training queries per layer and KV head (at most).
    #[arg(long, default_value_t = TrainOptions::default().max_samples)]
    max_samples: usize,
    /// Train the paper's plain classifier, without the k-means routing score added to its
    /// logits; its indexes route by the classifier alone, without the geometric expert.
    #[arg(long)]
    no_prior: bool,
    /// Text files (.txt, .md, .html, or without an extension) or folders of them.
    #[arg(required = true)]
    text: Vec<PathBuf>,
}

/// Builds, catches up and saves a corpus's indexes with a progress bar.
pub(crate) fn update_with_progress(
    store: &Store,
    corpus: &str,
    model: ModelRef<'_>,
    specs: &[IndexSpec],
    saap: Option<&Path>,
    progress: ProgressMode,
) -> Result<Vec<IndexInfo>> {
    let bar = match progress {
        ProgressMode::Bar => ProgressBar::new(0),
        _ => ProgressBar::hidden(),
    };
    bar.set_style(ProgressStyle::with_template(
        "{spinner} [{elapsed_precise}] {bar:30} {pos}/{len} layer/head indexes {msg}",
    )?);
    let started = Instant::now();
    let infos = update_indexes(
        store,
        corpus,
        model,
        specs,
        saap,
        &mut |event| match event {
            IndexEvent::Started { spec, parts } => {
                bar.set_length(bar.length().unwrap_or(0) + parts as u64);
                bar.set_message(format!("index {spec}"));
                if progress == ProgressMode::Json {
                    println!(
                        "{}",
                        serde_json::json!({"event": "index", "spec": spec, "parts": parts})
                    );
                }
            }
            IndexEvent::Part { .. } => bar.inc(1),
            IndexEvent::Warning { spec, message } => {
                bar.println(format!("kvdb: warning: {spec}: {message}"))
            }
        },
    )?;
    bar.finish_and_clear();
    if progress != ProgressMode::Json {
        eprintln!(
            "kvdb: indexes of `{corpus}` up to date in {:.1}s: {}",
            started.elapsed().as_secs_f64(),
            infos
                .iter()
                .map(|i| i.spec.as_str())
                .collect::<Vec<_>>()
                .join(", ")
        );
    }
    Ok(infos)
}

pub(crate) fn index(command: IndexCommand) -> Result<()> {
    match command {
        IndexCommand::Add {
            target,
            model,
            saap,
            progress,
            specs,
        } => {
            if !Store::exists(&target.store) {
                return Err(kvdb::Error::StoreMissing { path: target.store }.into());
            }
            let store = Store::open(&target.store, Access::Write)?;
            store.manifest(&target.corpus)?;
            let loaded = kvdb::load_model(
                model.as_deref(),
                &LoadOptions::default(),
                ComputeDevice::Cpu,
            )?;
            let infos = update_with_progress(
                &store,
                &target.corpus,
                loaded.as_ref(),
                &specs,
                saap.as_deref(),
                progress,
            )?;
            print_infos(&infos);
        }
        IndexCommand::Remove { target, specs } => {
            if !Store::exists(&target.store) {
                return Err(kvdb::Error::StoreMissing { path: target.store }.into());
            }
            let store = Store::open(&target.store, Access::Write)?;
            let mut manifest = store.manifest(&target.corpus)?;
            for spec in &specs {
                manifest = remove_index(&store, &target.corpus, spec)?;
                eprintln!("kvdb: removed index `{spec}` from `{}`", target.corpus);
            }
            print_infos(&list_indexes(&store, &manifest)?);
        }
        IndexCommand::List(target) => {
            let store = Store::open(&target.store, Access::Read)?;
            let manifest = store.manifest(&target.corpus)?;
            print_infos(&list_indexes(&store, &manifest)?);
        }
    }
    Ok(())
}

fn print_infos(infos: &[IndexInfo]) {
    println!(
        "{:<32} {:<32} {:>6} {:>8} {:>9} {:>10}",
        "spec", "built as", "parts", "keys", "build s", "on disk"
    );
    for (i, info) in infos.iter().enumerate() {
        let default = if i == 0 { " (default)" } else { "" };
        println!(
            "{:<32} {:<32} {:>6} {:>8} {:>9.2} {:>10}{default}",
            info.spec,
            info.built,
            info.parts,
            info.keys,
            info.build_seconds,
            HumanBytes(info.bytes_on_disk as u64).to_string()
        );
        for w in &info.warnings {
            println!("    warning: {w}");
        }
    }
}

pub(crate) fn saap(command: SaapCommand) -> Result<()> {
    let SaapCommand::Train(args) = command;
    let documents = read_documents(&args.text)?;
    let loaded = kvdb::load_model(
        args.model.as_deref(),
        &LoadOptions::default(),
        ComputeDevice::Cpu,
    )?;
    let text: String = documents
        .iter()
        .map(|d| format!("{}{DOCUMENT_SEPARATOR}", d.text))
        .collect();
    let training = SaapTraining {
        options: TrainOptions {
            centroids: args.centroids,
            max_samples: args.max_samples,
            epochs: args.epochs,
            seed: args.seed,
            prior: !args.no_prior,
            ..TrainOptions::default()
        },
        tokens: args.tokens,
        drills: args.drills,
    };
    let bar = ProgressBar::new(0);
    bar.set_style(ProgressStyle::with_template(
        "{spinner} [{elapsed_precise}] {bar:30} {pos}/{len} tokens, {per_sec}, ETA {eta}",
    )?);
    let epochs_style = ProgressStyle::with_template(
        "{spinner} [{elapsed_precise}] {bar:30} {pos}/{len} epochs, ETA {eta} {msg}",
    )?;
    let started = Instant::now();
    let mut epochs_total = 0;
    let mut prefilled = false;
    let artifact = train_artifact(&loaded, &text, &training, &mut |event| match event {
        TrainEvent::Text {
            tokens,
            windows,
            drills,
            heads,
        } => {
            bar.suspend(|| {
                eprintln!(
                    "kvdb: prefilling {tokens} tokens of training text in {windows} window(s) \
                     ({drills} retrieval drills planted)"
                )
            });
            bar.set_length(tokens as u64);
            epochs_total = heads * training.options.epochs;
        }
        TrainEvent::Prefilled(done) => bar.set_position(done as u64),
        TrainEvent::Head { layer, kv_head } => {
            if !prefilled {
                prefilled = true;
                // The prefill is over: the same bar counts the classifiers' epochs.
                bar.set_style(epochs_style.clone());
                bar.set_length(epochs_total as u64);
                bar.set_position(0);
                bar.reset_eta();
            }
            bar.set_message(format!("layer {layer} KV head {kv_head}: k-means, targets"));
        }
        TrainEvent::Epoch {
            layer,
            kv_head,
            epoch,
        } => {
            bar.set_message(format!(
                "layer {layer} KV head {kv_head}: KL {:.4} (validation {:.4})",
                epoch.train, epoch.validation
            ));
            bar.inc(1);
        }
    })?;
    bar.finish_and_clear();
    artifact
        .write(&args.out)
        .with_context(|| format!("writing {}", args.out.display()))?;
    let registered = saap_registry_path(&artifact.model_sha256, artifact.centroids)?;
    if let Some(dir) = registered.parent() {
        std::fs::create_dir_all(dir)?;
    }
    artifact
        .write(&registered)
        .with_context(|| format!("registering {}", registered.display()))?;
    let svg = args.out.with_extension("loss.svg");
    plot_losses(&artifact, &svg)?;
    for (layer, head, losses) in &artifact.losses {
        if let (Some(first), Some(last)) = (losses.first(), losses.last()) {
            eprintln!(
                "kvdb: layer {layer} KV head {head}: KL {:.4} → {:.4} (validation {:.4} → {:.4})",
                first.train, last.train, first.validation, last.validation
            );
        }
    }
    eprintln!(
        "kvdb: trained SAAP ({} buckets, {} tokens, seed {}) in {:.0}s: {} (registered as {}); \
         loss curves in {}",
        artifact.centroids,
        artifact.tokens,
        artifact.seed,
        started.elapsed().as_secs_f64(),
        args.out.display(),
        registered.display(),
        svg.display()
    );
    Ok(())
}

/// The training and validation KL of every head over the epochs, as an SVG line chart.
fn plot_losses(artifact: &SaapArtifact, path: &Path) -> Result<()> {
    use plotters::prelude::*;
    let epochs = artifact
        .losses
        .iter()
        .map(|(_, _, l)| l.len())
        .max()
        .unwrap_or(1)
        .max(2);
    let top = artifact
        .losses
        .iter()
        .flat_map(|(_, _, l)| l.iter().flat_map(|e| [e.train, e.validation]))
        .fold(0.0f64, f64::max)
        .max(1e-6);
    let root = SVGBackend::new(path, (800, 500)).into_drawing_area();
    root.fill(&WHITE)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(
            "SAAP classifiers: KL per epoch (thick: training, thin: validation)",
            ("sans-serif", 20),
        )
        .margin(10)
        .x_label_area_size(35)
        .y_label_area_size(55)
        .build_cartesian_2d(1f64..epochs as f64, 0f64..top * 1.05)?;
    chart
        .configure_mesh()
        .x_desc("epoch")
        .y_desc("KL (nats)")
        .draw()?;
    for (i, (layer, head, losses)) in artifact.losses.iter().enumerate() {
        let color = Palette99::pick(i).to_rgba();
        chart
            .draw_series(LineSeries::new(
                losses.iter().map(|e| (e.epoch as f64, e.train)),
                color.stroke_width(2),
            ))?
            .label(format!("layer {layer} head {head} train"))
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color));
        chart.draw_series(LineSeries::new(
            losses.iter().map(|e| (e.epoch as f64, e.validation)),
            color.stroke_width(1),
        ))?;
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()?;
    root.present()?;
    Ok(())
}
