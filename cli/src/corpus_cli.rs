//! The corpus commands of the `kvdb` binary: `ingest`, `ask` and `corpus list|info|delete`.

use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;

use crate::parse_bytes;
use anyhow::{Context, Result};
use indicatif::{HumanBytes, ProgressBar, ProgressStyle};
use kvdb::read_documents;
use kvdb::store::{Access, LayerPolicy, Store};
use kvdb::ComputeDevice;
use kvdb::{ingest as run_ingest, IngestEvent};
use kvdb::{AskOptions, AttentionMode, Corpus, Retrieval};
use kvdb_attention::DensePolicy;
use kvdb_index::IndexSpec;
use kvdb_model::LoadOptions;

use crate::index_cli::{parse_spec, update_with_progress};
use crate::SamplingArgs;
use kvdb::check_specs;

/// How ingest reports progress.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum ProgressMode {
    /// A progress bar on stderr.
    Bar,
    /// One JSON object per event on stdout (for scripts and tests).
    Json,
    /// Nothing but the summary.
    None,
}

/// Which corpus of which store a command works on.
#[derive(clap::Args)]
pub(crate) struct CorpusRef {
    /// The store's folder (`ingest` creates it when absent).
    #[arg(long)]
    pub(crate) store: PathBuf,
    /// The corpus (`ingest` creates it when absent).
    #[arg(long)]
    pub(crate) corpus: String,
}

#[derive(clap::Args)]
pub(crate) struct IngestArgs {
    #[command(flatten)]
    target: CorpusRef,
    /// A local GGUF file (default: the default model, fetched when absent). A corpus keeps
    /// the model it was created with.
    #[arg(long)]
    model: Option<PathBuf>,
    /// How to show progress.
    #[arg(long, value_enum, default_value = "bar")]
    progress: ProgressMode,
    /// An index to build (repeatable; a new corpus gets `flat` when none is named). Every
    /// index of the corpus is brought up to date with the new documents.
    #[arg(long = "index", value_parser = parse_spec)]
    indexes: Vec<IndexSpec>,
    /// The SAAP artifact for `saap` specs (default: the one registered for the model).
    #[arg(long)]
    saap: Option<PathBuf>,
    /// Where the prefill runs: `cpu`, or `cuda` / `cuda:N` (an NVIDIA GPU; needs a build
    /// with feature `gpu`).
    #[arg(long, default_value = "cpu")]
    device: ComputeDevice,
    /// Files (.txt, .md, .html, or without an extension: text) or folders of them, appended in
    /// this order.
    #[arg(required = true)]
    paths: Vec<PathBuf>,
}

#[derive(clap::Args)]
pub(crate) struct AskArgs {
    #[command(flatten)]
    open: OpenArgs,
    /// The index to retrieve with (default: the corpus's first; `kvdb index list` shows them).
    #[arg(long, value_parser = parse_spec)]
    index: Option<IndexSpec>,
    /// Keys retrieved per retrieval layer and KV head at every step (default: the spec's own
    /// budget for hip and ihip, else 64; bucket indexes attend whole buckets).
    #[arg(long, value_parser = crate::retrieval_k)]
    k: Option<usize>,
    /// Attention sink: the first tokens of the corpus, always attended.
    #[arg(long, default_value_t = DensePolicy::default().sink)]
    sink: usize,
    /// Recent tokens always attended (the question and answer are always attended too).
    #[arg(long, default_value_t = DensePolicy::default().window)]
    window: usize,
    /// With a bucket index (ivf, saap): estimate the attention of the unvisited buckets from
    /// their sizes, centroids and mean values (RetroInfer's idea).
    #[arg(long)]
    estimate: bool,
    /// Lists probed (ivf), buckets visited (saap) or hnsw's `ef` for this question,
    /// overriding the index's spec without rebuilding it.
    #[arg(long)]
    breadth: Option<usize>,
    /// At every step also attend the token after each of the N retrieved tokens the step
    /// before attended most, per KV head (helps an answer that copies a number or a name
    /// from the corpus); 0 turns it off.
    #[arg(long, default_value_t = kvdb::DEFAULT_FOLLOW, value_name = "N", value_parser = crate::retrieval_follow)]
    follow: usize,
    /// Attend to every corpus token exactly instead of retrieving (the reference).
    #[arg(long)]
    full_attention: bool,
    /// A prompt template with `{question}` where the question goes (for instruction-tuned
    /// models); by default the question follows the corpus verbatim.
    #[arg(long)]
    template: Option<String>,
    #[command(flatten)]
    sampling: SamplingArgs,
    /// Print one JSON object (answer, tokens, provenance, timings) instead of text.
    #[arg(long)]
    json: bool,
    /// The question.
    question: String,
}

/// The model and corpus a command that asks questions opens.
#[derive(clap::Args)]
pub(crate) struct OpenArgs {
    #[command(flatten)]
    pub(crate) target: CorpusRef,
    /// A local GGUF file (default: the default model); it must be the corpus's model.
    #[arg(long)]
    pub(crate) model: Option<PathBuf>,
    /// Bytes of keys and values held in memory on the CPU (e.g. 512M, 2G); beyond it blocks
    /// are evicted and read again from the store.
    #[arg(long, default_value = "1G", value_parser = parse_bytes)]
    pub(crate) ram_budget: usize,
    /// Where answers are decoded: `cpu`, or `cuda` / `cuda:N` (an NVIDIA GPU, bf16 weights;
    /// the corpus's retrieval layers are uploaded once; needs a build with feature `gpu`).
    #[arg(long, default_value = "cpu")]
    pub(crate) device: ComputeDevice,
    /// Where a GPU keeps the corpus's keys and values: `resident` (on the GPU), `host`
    /// (pinned host memory, for corpora larger than the GPU; questions must retrieve: bucket
    /// indexes routed on the GPU read their buckets' rows there in place, the other indexes'
    /// selections go through a GPU cache of hot blocks of half the free GPU memory),
    /// `host:SIZE` (a cache of SIZE, e.g. 8G; `host:0`: none, every row read in place),
    /// `split:SIZE` (whole layers on the GPU up to SIZE, the rest as `host`), or `auto`
    /// (resident when they fit, else split over most of the free GPU memory).
    #[arg(long, default_value = "auto", value_parser = crate::parse_gpu_kv)]
    pub(crate) gpu_kv: kvdb::GpuKv,
}

#[derive(clap::Subcommand)]
pub(crate) enum CorpusCommand {
    /// List the corpora of a store.
    List {
        /// The store's folder.
        #[arg(long)]
        store: PathBuf,
    },
    /// Show a corpus: model, documents, tokens, bytes.
    Info(CorpusRef),
    /// Delete a corpus and everything it stored.
    Delete(CorpusRef),
}

/// A model and a corpus opened for questions (the corpus's keys and values already on the
/// model's GPU when it has one).
pub(crate) struct OpenedCorpus {
    pub(crate) model: kvdb::LoadedModel,
    pub(crate) corpus: Corpus,
}

/// Loads the model on `args.device`, opens the corpus and, on a GPU, uploads the corpus's
/// retrieval layers, saying on stderr how long each stage took (a 16 GB model or a 128K-token
/// corpus takes a while, and that time is not the answer's). Refuses first any of `indexes`
/// the corpus has not built (flat needs none).
pub(crate) fn open_for_questions<'i>(
    args: &OpenArgs,
    indexes: impl IntoIterator<Item = &'i IndexSpec>,
) -> Result<OpenedCorpus> {
    let (target, device) = (&args.target, args.device);
    let store = Arc::new(Store::open(&target.store, Access::Read)?);
    let manifest = store.manifest(&target.corpus)?;
    for index in indexes {
        let name = index.to_string();
        if *index != IndexSpec::Flat && !manifest.indexes.contains(&name) {
            anyhow::bail!(
                "corpus `{}` has no index `{name}`; it has: {} (add one with `kvdb index add`)",
                target.corpus,
                manifest.indexes.join(", ")
            );
        }
    }
    let started = std::time::Instant::now();
    let model = kvdb::load_model(args.model.as_deref(), &LoadOptions::default(), device)?;
    eprintln!(
        "kvdb: loaded {} for {device} in {:.1}s ({})",
        model.record.name,
        started.elapsed().as_secs_f64(),
        stage_times(&model.stages)
    );
    let started = std::time::Instant::now();
    let corpus = Corpus::open(store, &target.corpus, model.as_ref(), args.ram_budget)?
        .with_gpu_kv(args.gpu_kv);
    #[cfg(feature = "gpu")]
    {
        let upload = corpus.upload_to_gpu(model.as_ref())?;
        let resident = upload.bytes - upload.cache_bytes;
        let kept = [
            (resident > 0).then(|| format!("{} on the GPU", HumanBytes(resident as u64))),
            (upload.host_bytes > 0).then(|| {
                let host = HumanBytes(upload.host_bytes as u64);
                match upload.cache_budget {
                    0 => format!("{host} in pinned host memory, read in place"),
                    budget => format!(
                        "{host} in pinned host memory behind {} of GPU caches: block caches \
                         taken when a question searched on the CPU first needs them, or each \
                         question routed on the GPU its own caches of buckets",
                        HumanBytes(budget as u64)
                    ),
                }
            }),
        ];
        let kept: Vec<String> = kept.into_iter().flatten().collect();
        // Nothing uploaded: the model is on the CPU.
        if !kept.is_empty() {
            let kept = kept.join(", ");
            eprintln!(
                "kvdb: opened corpus `{}` and uploaded its retrieval layers ({kept}) in {:.1}s ({})",
                target.corpus,
                started.elapsed().as_secs_f64(),
                stage_times(&upload.stages)
            );
        }
    }
    Ok(OpenedCorpus { model, corpus })
}

/// `stage 1.2s, stage 0.3s`.
fn stage_times(stages: &[(&str, f64)]) -> String {
    let parts: Vec<String> = stages.iter().map(|(s, t)| format!("{s} {t:.1}s")).collect();
    parts.join(", ")
}

/// Writes a piece of streamed text and flushes it.
pub(crate) fn emit(out: &mut impl Write, piece: &str) -> kvdb::Result<()> {
    let io = |source| kvdb::Error::Io {
        context: "writing the answer".into(),
        source,
    };
    write!(out, "{piece}").map_err(io)?;
    out.flush().map_err(io)
}

pub(crate) fn ingest(args: IngestArgs) -> Result<()> {
    kvdb::store::validate_corpus_name(&args.target.corpus)?;
    // Read and check every input before touching the store: a bad file writes nothing.
    let documents = read_documents(&args.paths)?;
    let loaded = kvdb::load_model(args.model.as_deref(), &LoadOptions::default(), args.device)?;
    // And every index spec: one that cannot be built fails here, before any document is
    // committed, not after.
    check_specs(&args.indexes, &loaded.record.sha256, args.saap.as_deref())?;
    let fresh = !Store::exists(&args.target.store) && !args.target.store.exists();
    let store = Store::open(&args.target.store, Access::Write)?;
    let result = ingest_into(&store, &args, &documents, &loaded);
    if result.is_err() && fresh {
        // A store this ingest created and then wrote nothing to is removed again.
        drop(store);
        let _ = std::fs::remove_dir_all(&args.target.store);
    }
    result
}

fn ingest_into(
    store: &Store,
    args: &IngestArgs,
    documents: &[kvdb::SourceDocument],
    loaded: &kvdb::LoadedModel,
) -> Result<()> {
    let bar = match args.progress {
        ProgressMode::Bar => ProgressBar::new(0),
        _ => ProgressBar::hidden(),
    };
    bar.set_style(
        ProgressStyle::with_template(
            "{spinner} [{elapsed_precise}] {bar:30} {pos}/{len} tokens, {per_sec}, ETA {eta} {msg}",
        )?
        .progress_chars("=> "),
    );
    let json = args.progress == ProgressMode::Json;
    let mut total_docs = 0;
    let mut doc_index = 0;
    let report = run_ingest(
        store,
        &args.target.corpus,
        loaded.as_ref(),
        documents,
        &mut |event| {
            match &event {
                IngestEvent::Planned { documents, tokens } => {
                    total_docs = *documents;
                    bar.set_length(*tokens as u64);
                }
                IngestEvent::Loaded { layers, of, tokens } => {
                    bar.set_message(format!(
                        "loading the corpus's {tokens} stored tokens: layer {layers}/{of}"
                    ));
                }
                IngestEvent::Skipped { title, reason } => {
                    bar.println(format!("kvdb: skipped {title}: {reason}"));
                }
                IngestEvent::Started { title, .. } => {
                    doc_index += 1;
                    bar.set_message(format!("document {doc_index}/{total_docs}: {title}"));
                }
                IngestEvent::Committed { chunk, .. } => bar.inc(*chunk as u64),
            }
            if json {
                println!("{}", event_json(&event));
            }
        },
    )?;
    bar.finish_and_clear();
    update_with_progress(
        store,
        &args.target.corpus,
        loaded.as_ref(),
        &args.indexes,
        args.saap.as_deref(),
        args.progress,
    )?;
    eprintln!(
        "kvdb: corpus `{}`: added {} documents ({} tokens in {:.1}s, {:.0} tokens/s on {}, {:.0}% \
         of it waiting for the store), skipped {}; it now holds {} tokens",
        args.target.corpus,
        report.added.len(),
        report.tokens,
        report.seconds,
        report.tokens as f64 / report.seconds.max(1e-9),
        args.device,
        100.0 * report.store_seconds / report.seconds.max(1e-9),
        report.skipped.len(),
        report.corpus_tokens
    );
    Ok(())
}

fn event_json(event: &IngestEvent<'_>) -> serde_json::Value {
    match event {
        IngestEvent::Planned { documents, tokens } => {
            serde_json::json!({"event": "planned", "documents": documents, "tokens": tokens})
        }
        IngestEvent::Loaded { layers, of, tokens } => {
            serde_json::json!({"event": "loaded", "layers": layers, "of": of, "tokens": tokens})
        }
        IngestEvent::Skipped { title, reason } => {
            serde_json::json!({"event": "skipped", "title": title, "reason": reason})
        }
        IngestEvent::Started {
            title,
            tokens,
            resumed_at,
        } => serde_json::json!({"event": "started", "title": title, "tokens": tokens,
                                "resumed_at": resumed_at}),
        IngestEvent::Committed {
            title,
            done,
            total,
            corpus_tokens,
            chunk,
        } => serde_json::json!({"event": "committed", "title": title, "done": done,
                                "total": total, "corpus_tokens": corpus_tokens, "chunk": chunk}),
    }
}

pub(crate) fn ask(args: AskArgs) -> Result<()> {
    let opened = open_for_questions(&args.open, args.index.iter())?;
    let (loaded, corpus) = (&opened.model, &opened.corpus);
    let options = AskOptions {
        profile: false,
        mode: if args.full_attention {
            AttentionMode::Full
        } else {
            AttentionMode::Retrieval(Retrieval {
                index: args.index,
                k: args.k,
                estimate: args.estimate,
                breadth: args.breadth,
                follow: args.follow,
                policy: DensePolicy {
                    sink: args.sink,
                    window: args.window,
                },
            })
        },
        generate: args.sampling.options(),
        template: args.template,
    };
    let mut stdout = std::io::stdout().lock();
    let answer = if args.json {
        corpus.ask(loaded.as_ref(), &args.question, &options, &mut |_| Ok(()))?
    } else {
        let a = corpus.ask(loaded.as_ref(), &args.question, &options, &mut |piece| {
            emit(&mut stdout, piece)
        })?;
        writeln!(stdout)?;
        a
    };
    if args.json {
        let mut value = serde_json::to_value(&answer)?;
        let tier = corpus.tier_stats();
        value["tier"] = serde_json::json!({
            "hits": tier.hits,
            "misses": tier.misses,
            "evictions": tier.evictions,
        });
        writeln!(stdout, "{value}")?;
        return Ok(());
    }
    if !answer.provenance.passages.is_empty() {
        writeln!(stdout, "\nsources (share of attention to the corpus):")?;
        for d in answer.provenance.documents.iter().take(3) {
            writeln!(stdout, "  {:5.1}%  {}", 100.0 * d.share, d.title)?;
        }
        writeln!(stdout, "passages:")?;
        for p in answer.provenance.passages.iter().take(3) {
            let text: String = p.text.split_whitespace().collect::<Vec<_>>().join(" ");
            writeln!(
                stdout,
                "  {:5.1}%  {} tokens {}..{}: \"{}\"",
                100.0 * p.share,
                p.title,
                p.tokens.start,
                p.tokens.end,
                text
            )?;
        }
    }
    let t = &answer.timings;
    eprintln!(
        "kvdb: {} corpus + {} question tokens; first token after {:.2}s, {} tokens at {:.1} tok/s",
        answer.corpus_tokens,
        answer.question_tokens,
        t.first_token_seconds,
        answer.tokens.len(),
        t.tokens_per_second
    );
    if let Some(r) = &answer.retrieval {
        eprintln!(
            "kvdb: index {}: {} searches selected {:.2}% of the eligible keys, scoring {:.2}%",
            r.index,
            r.searches,
            100.0 * r.selectivity(),
            100.0 * r.scored_share()
        );
        match args.open.device {
            ComputeDevice::Cpu => eprintln!(
                "kvdb: of the answer's time: {:.2}s searching, {:.2}s attending",
                r.search_seconds, r.cpu_attention_seconds,
            ),
            // Routed indexes search on the GPU: neither counts them.
            _ => eprintln!(
                "kvdb: of the answer's time: {:.2}s searching on the CPU, {:.2}s waiting for \
                 queries to reach it",
                r.search_seconds, r.transfer_seconds,
            ),
        }
    }
    Ok(())
}

pub(crate) fn corpus(command: CorpusCommand) -> Result<()> {
    match command {
        CorpusCommand::List { store } => {
            let store = Store::open(&store, Access::Read)?;
            let corpora = store.corpora()?;
            if corpora.is_empty() {
                println!("no corpora");
            }
            for m in corpora {
                println!(
                    "{}\t{} documents\t{} tokens\t{}",
                    m.name, m.documents, m.tokens, m.model.name
                );
            }
        }
        CorpusCommand::Info(CorpusRef { store, corpus }) => {
            let store = Store::open(&store, Access::Read)?;
            let m = store.manifest(&corpus)?;
            let docs = store.documents(&m)?;
            let kv_bytes = m.kv_bytes();
            let retrieval = m.retrieval_layers();
            println!("corpus:      {}", m.name);
            println!("model:       {} (sha256 {})", m.model.name, m.model.sha256);
            println!("documents:   {}", m.documents);
            println!("tokens:      {} of {}", m.tokens, m.model.context_length);
            println!(
                "layers:      {} retrieval ({:?}), {} sliding-window",
                retrieval.len(),
                retrieval,
                m.layers
                    .iter()
                    .filter(|l| matches!(l, LayerPolicy::Last { .. }))
                    .count()
            );
            println!(
                "stored K/V:  {} (f16, blocks of {} tokens)",
                HumanBytes(kv_bytes),
                m.block_size
            );
            println!(
                "prefill:     chunks of {} tokens (last ingest on {})",
                m.prefill.chunk, m.prefill.device
            );
            println!("indexes:     {}", m.indexes.join(", "));
            if let Some(p) = &m.pending {
                println!(
                    "interrupted: {} ({} of {} tokens stored; ingest it again to finish)",
                    p.title,
                    m.tokens - p.start,
                    p.total
                );
            }
            for d in docs {
                println!(
                    "  #{:<4} {:>7} tokens  {:>9}  {}",
                    d.number,
                    d.tokens.len(),
                    HumanBytes(d.bytes as u64).to_string(),
                    d.title
                );
            }
        }
        CorpusCommand::Delete(CorpusRef { store, corpus }) => {
            let path = store.clone();
            if !Store::exists(&path) {
                return Err(kvdb::Error::StoreMissing { path }.into());
            }
            let store = Store::open(&store, Access::Write)
                .with_context(|| format!("opening {} to delete a corpus", path.display()))?;
            let m = store.delete_corpus(&corpus)?;
            println!(
                "deleted corpus `{}` ({} documents, {} tokens)",
                m.name, m.documents, m.tokens
            );
        }
    }
    Ok(())
}
