//! `kvdb bench`: every listed index type over the same real KV cache, against full attention.
//!
//! For each context length the harness builds one corpus of real text with needles planted
//! at several depths (all needles of a context share its prefill), holding back the last
//! document so that its keys are *added* to the built indexes (incremental-add cost), and the
//! `eval` tokens that follow the corpus in the text for scoring. Then, per index spec and
//! budget:
//! - **retrieval quality** on the model's own queries over the eval tokens, per retrieval
//!   layer and KV head: attention-mass recall, top-k recall, relative L2 error of the
//!   attention output against full attention (all in f64 from the stored f16 keys and
//!   values), selectivity (keys attended and keys scored, as shares of the eligible keys:
//!   the dense sink + window is excluded and reported apart), search latency per head-query;
//!   a random selection of the same size is measured beside every point as a control;
//! - **cost**: build and add seconds, memory and bytes on disk;
//! - **end to end**: next-token top-1 agreement with full attention, mean KL divergence and
//!   perplexity over the eval tokens, and the needles found.

use std::ops::Range;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use candle_core::Tensor;
use indicatif::ProgressBar;
use kvdb::store::{Access, Kv, Store};
use kvdb::{ingest, ModelRef};
use kvdb::{read_documents, SourceDocument};
use kvdb::{update_indexes, IndexInfo};
use kvdb::{AskOptions, AttentionMode, Corpus, Retrieval};
use kvdb_attention::DensePolicy;
use kvdb_index::{GroupQuery, IndexSpec, SearchParams};
use kvdb_model::{AttentionInput, EncodeOptions, Rope};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};

use crate::metrics::{
    argmax, attended, kl_divergence, mass_recall, mean, negative_log_likelihood, output_over,
    quantile, random_selection, relative_l2, softmax, top_k_recall,
};

/// What went wrong in a bench run.
#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    /// The engine failed (store, ingest, query).
    #[error(transparent)]
    Engine(#[from] kvdb::Error),
    /// The model failed.
    #[error(transparent)]
    Model(#[from] kvdb_model::ModelError),
    /// An index failed.
    #[error(transparent)]
    Index(#[from] kvdb_index::IndexError),
    /// A tensor operation failed.
    #[error(transparent)]
    Tensor(#[from] candle_core::Error),
    /// Reading or writing files failed.
    #[error("{what}: {source}")]
    Io {
        /// What was being read or written.
        what: String,
        /// The cause.
        source: std::io::Error,
    },
    /// The options cannot be served (e.g. too little text for a context length).
    #[error("{0}")]
    Input(String),
    /// Drawing a plot failed.
    #[error("plot {path}: {reason}")]
    Plot {
        /// The plot's file.
        path: PathBuf,
        /// The cause.
        reason: String,
    },
}

/// The crate's result type.
pub type Result<T, E = BenchError> = std::result::Result<T, E>;

/// Ready-made grids.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Preset {
    /// All index types in about 15 minutes on 2 cores: contexts 4K and 16K, 3 depths × 2
    /// needles, budgets 1% and 5%.
    Quick,
    /// The large grid: contexts 4K to 30K, 5 depths × 3 needles, five budgets.
    Full,
}

impl Preset {
    /// Context lengths (corpus tokens).
    pub fn contexts(self) -> Vec<usize> {
        match self {
            Self::Quick => vec![4096, 16384],
            Self::Full => vec![4096, 8192, 16384, 30000],
        }
    }

    /// Needle depths (share of the corpus before the needle).
    pub fn depths(self) -> Vec<f64> {
        match self {
            Self::Quick => vec![0.2, 0.5, 0.8],
            Self::Full => vec![0.1, 0.3, 0.5, 0.7, 0.9],
        }
    }

    /// Needles per depth.
    pub fn needles(self) -> usize {
        match self {
            Self::Quick => 2,
            Self::Full => 3,
        }
    }

    /// Top-k budgets, as shares of the corpus.
    pub fn budgets(self) -> Vec<f64> {
        match self {
            Self::Quick => vec![0.01, 0.05],
            Self::Full => vec![0.0025, 0.005, 0.01, 0.02, 0.05],
        }
    }

    /// Multiples of the budget a spec carries (see [`BenchOptions::sweep`]).
    pub fn sweep(self) -> Vec<f64> {
        match self {
            Self::Quick => vec![0.5, 1.0, 2.0],
            Self::Full => vec![0.25, 0.5, 1.0, 2.0, 4.0],
        }
    }
}

/// One bench run's settings.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct BenchOptions {
    /// Text files (.txt, .md, .html) or folders of them: the haystack, in order.
    pub corpus_text: Vec<PathBuf>,
    /// The index specs compared (`flat` is added as the exact control when absent).
    #[serde(serialize_with = "spec_strings", deserialize_with = "parsed_specs")]
    pub specs: Vec<IndexSpec>,
    /// Corpus lengths in tokens.
    pub contexts: Vec<usize>,
    /// Needle depths in `0..1`.
    pub depths: Vec<f64>,
    /// Needles per depth.
    pub needles: usize,
    /// Top-k budgets as shares of the corpus (top-k indexes; hip, ihip and whole-bucket
    /// indexes carry their budget in their spec).
    pub budgets: Vec<f64>,
    /// Multiples of the budget a spec carries, for the indexes whose budget is not a share
    /// of the corpus: whole-bucket indexes search with these multiples of their lists or
    /// buckets visited (`np`, `ℓ`, as a per-search override of the same built index), hip
    /// and ihip with these multiples of their `k`. Each multiple is one more point, so those
    /// indexes draw a curve too.
    pub sweep: Vec<f64>,
    /// Tokens after the corpus scored for retrieval quality, KL and perplexity.
    pub eval_tokens: usize,
    /// Attention sink and recent window attended densely.
    pub sink: usize,
    /// See `sink`.
    pub window: usize,
    /// Seed of the needles and the random controls.
    pub seed: u64,
    /// SAAP artifact (default: the one registered for the model).
    pub saap: Option<PathBuf>,
    /// [`kvdb::Retrieval::follow`] for every retrieval question (0: off; absent from the
    /// results of runs before it, which had none).
    #[serde(default)]
    pub follow: usize,
}

/// Specs are written as their strings, the form they are given in everywhere.
fn spec_strings<S: serde::Serializer>(specs: &[IndexSpec], s: S) -> Result<S::Ok, S::Error> {
    s.collect_seq(specs.iter().map(IndexSpec::to_string))
}

/// Specs read back from their strings (a `results.json` being re-rendered).
fn parsed_specs<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Vec<IndexSpec>, D::Error> {
    Vec::<String>::deserialize(d)?
        .iter()
        .map(|s| s.parse().map_err(serde::de::Error::custom))
        .collect()
}

impl BenchOptions {
    /// The options of a preset.
    pub fn preset(preset: Preset, corpus_text: Vec<PathBuf>, specs: Vec<IndexSpec>) -> Self {
        Self {
            corpus_text,
            specs,
            contexts: preset.contexts(),
            depths: preset.depths(),
            needles: preset.needles(),
            budgets: preset.budgets(),
            sweep: preset.sweep(),
            eval_tokens: 256,
            sink: 4,
            window: 64,
            seed: 0,
            saap: None,
            follow: 0,
        }
    }

    fn policy(&self) -> DensePolicy {
        DensePolicy {
            sink: self.sink,
            window: self.window,
        }
    }

    /// The specs with `flat` first.
    fn specs_with_flat(&self) -> Vec<IndexSpec> {
        let mut specs = vec![IndexSpec::Flat];
        specs.extend(
            self.specs
                .iter()
                .filter(|s| **s != IndexSpec::Flat)
                .cloned(),
        );
        specs
    }
}

/// One spec at one budget: the unit every measure is reported for.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Point {
    /// The spec string.
    pub spec: String,
    /// Its kind (`flat`, `ivf`, ...).
    pub kind: String,
    /// Keys retrieved per query (top-k indexes, hip and ihip; `None`: the spec's own
    /// budget).
    pub k: Option<usize>,
    /// Lists probed or buckets visited (whole-bucket indexes; `None`: the spec's own).
    pub breadth: Option<usize>,
}

impl Point {
    /// The `k` a search gets: the point's, else the spec's own (hip, ihip); whole-bucket
    /// indexes ignore it.
    fn budget(&self) -> usize {
        let own = self
            .spec
            .parse::<IndexSpec>()
            .ok()
            .and_then(|s| s.default_k());
        self.k.or(own).unwrap_or(usize::MAX)
    }

    /// Whether the point searches with its spec's own budget.
    fn is_own(&self) -> bool {
        self.k.is_none() && self.breadth.is_none()
    }

    /// `spec`, `spec @k=K` or `spec @np=P` (`@l=P` for saap).
    pub fn label(&self) -> String {
        let mut label = self.spec.clone();
        if let Some(k) = self.k {
            label += &format!(" @k={k}");
        }
        if let Some(b) = self.breadth {
            let spec = self.spec.parse::<IndexSpec>().ok();
            let name = spec
                .as_ref()
                .and_then(|s| s.breadth())
                .map_or("breadth", |b| b.0);
            label += &format!(" @{name}={b}");
        }
        label
    }
}

/// Retrieval quality of one point on one retrieval layer and KV head (means over the eval
/// queries and the group's heads).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct HeadQuality {
    /// The layer.
    pub layer: usize,
    /// The KV head.
    pub kv_head: usize,
    /// What was measured there (results.json keeps its fields beside the layer's).
    #[serde(flatten)]
    pub quality: Quality,
}

/// Retrieval quality measures: of one layer and KV head, or their mean over all of them
/// ([`crate::report::overall`]).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Quality {
    /// Share of the eligible attention mass covered.
    pub mass_recall: f64,
    /// The same for a random selection of the same size.
    pub random_mass_recall: f64,
    /// Share of the exact top-|selection| found.
    pub top_k_recall: f64,
    /// Relative L2 error of the attention output against full attention.
    pub output_error: f64,
    /// The same for a random selection of the same size.
    pub random_output_error: f64,
    /// Keys attended (selected) as a share of the eligible keys.
    pub selectivity: f64,
    /// Keys (and centroids, representatives, graph nodes) scored, as a share of the
    /// eligible keys.
    pub scored: f64,
    /// Search latency per head-query, microseconds: median.
    pub latency_p50_us: f64,
    /// The 99th percentile.
    pub latency_p99_us: f64,
}

/// Cost of one index spec on one corpus.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Cost {
    /// The spec as asked and as built.
    pub spec: String,
    /// As built (e.g. fewer IVF lists on a small corpus).
    pub built: String,
    /// Seconds of the builds, all layers and KV heads.
    pub build_seconds: f64,
    /// Seconds to add the held-back document's keys.
    pub add_seconds: f64,
    /// Keys added.
    pub added_keys: usize,
    /// Bytes in memory.
    pub memory_bytes: usize,
    /// Bytes in the store.
    pub disk_bytes: usize,
}

/// End-to-end accuracy of one point (or full attention) over the eval tokens.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct EndToEnd {
    /// `full` or the point's label.
    pub label: String,
    /// Share of positions whose most likely next token equals full attention's.
    pub top1_agreement: f64,
    /// Mean KL(full ‖ this) of the next-token distributions, nats.
    pub kl: f64,
    /// Perplexity of the eval text.
    pub perplexity: f64,
    /// Keys selected per retrieval as a share of the eligible keys (engine's count).
    pub selectivity: f64,
}

/// One planted needle and who found it.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct NeedleResult {
    /// Depth in `0..1`.
    pub depth: f64,
    /// The sentence planted.
    pub needle: String,
    /// `(label, answer, found)` for full attention and every point at its needle budget.
    pub answers: Vec<(String, String, bool)>,
}

/// Everything measured on one context length.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ContextResult {
    /// Corpus tokens.
    pub tokens: usize,
    /// Seconds to prefill and store the corpus.
    pub prefill_seconds: f64,
    /// Index costs, per spec.
    pub costs: Vec<Cost>,
    /// Retrieval quality: per point, per retrieval layer and KV head.
    pub quality: Vec<(Point, Vec<HeadQuality>)>,
    /// Full attention first, then every point.
    pub end_to_end: Vec<EndToEnd>,
    /// The needles.
    pub needles: Vec<NeedleResult>,
}

/// A whole bench run.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct BenchResult {
    /// The command line that made the run, as the report shows it (empty until the caller
    /// sets it; absent from runs saved before it was recorded).
    #[serde(default)]
    pub command: String,
    /// The settings.
    pub options: BenchOptions,
    /// The model file and its sha256.
    pub model: String,
    /// Its sha256.
    pub model_sha256: String,
    /// Threads available.
    pub threads: usize,
    /// Per context length.
    pub contexts: Vec<ContextResult>,
    /// Wall seconds of the whole run.
    pub seconds: f64,
}

/// The objects and numbers of planted needles ("The special magic number for the blue door
/// is 2099391.", as in RULER).
const OBJECTS: [&str; 16] = [
    "blue door",
    "red kettle",
    "green bicycle",
    "silver lantern",
    "yellow umbrella",
    "copper kettle",
    "purple notebook",
    "orange tractor",
    "white piano",
    "black canoe",
    "golden compass",
    "brown satchel",
    "pink lighthouse",
    "grey typewriter",
    "crimson scarf",
    "amber lantern",
];

/// One context's inputs: the corpus documents (the last held back for the add measure),
/// the eval tokens and the needles.
struct Case {
    documents: Vec<SourceDocument>,
    eval: Vec<u32>,
    needles: Vec<(f64, String, String, String)>,
}

/// Runs the bench with `model` and writes nothing: see [`crate::report`] for the files.
pub fn run(model: ModelRef<'_>, options: &BenchOptions, bar: &ProgressBar) -> Result<BenchResult> {
    let started = Instant::now();
    if options.contexts.is_empty() || options.eval_tokens < 2 {
        return Err(BenchError::Input(
            "at least one context length and two eval tokens are needed".into(),
        ));
    }
    let texts = read_documents(&options.corpus_text)?;
    let paragraphs: Vec<String> = texts.iter().flat_map(|d| paragraphs(&d.text)).collect();
    let mut contexts = Vec::new();
    for &tokens in &options.contexts {
        contexts.push(run_context(model, options, &paragraphs, tokens, bar)?);
    }
    Ok(BenchResult {
        command: String::new(),
        options: options.clone(),
        model: model.record.name.clone(),
        model_sha256: model.record.sha256.clone(),
        threads: rayon::current_num_threads(),
        contexts,
        seconds: started.elapsed().as_secs_f64(),
    })
}

/// Characters of a paragraph at most (about 500 tokens of English): the haystack is built
/// from whole paragraphs, so a text without blank lines would otherwise be one paragraph
/// longer than the context.
const PARAGRAPH_CHARS: usize = 2000;

/// `text`'s paragraphs (split at blank lines), each cut into pieces of at most
/// [`PARAGRAPH_CHARS`] at sentence ends, else at spaces, else anywhere (on a char boundary).
fn paragraphs(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    for paragraph in text.split("\n\n").map(str::trim).filter(|p| !p.is_empty()) {
        let mut rest = paragraph;
        while rest.len() > PARAGRAPH_CHARS {
            let mut limit = PARAGRAPH_CHARS;
            while !rest.is_char_boundary(limit) {
                limit -= 1;
            }
            let head = &rest[..limit];
            let cut = [". ", "? ", "! ", ".\n", "\n"]
                .iter()
                .filter_map(|end| head.rfind(end).map(|at| at + 1))
                .max()
                .or_else(|| head.rfind(char::is_whitespace))
                .filter(|&at| at > 0)
                .unwrap_or(limit);
            out.push(rest[..cut].trim().to_string());
            rest = rest[cut..].trim_start();
        }
        if !rest.is_empty() {
            out.push(rest.to_string());
        }
    }
    out
}

fn plain() -> EncodeOptions {
    EncodeOptions {
        add_bos: false,
        add_eos: false,
        parse_special: false,
    }
}

/// Paragraphs of real text until `tokens`, the needles planted at their depths, split into
/// documents of about 16 paragraphs; then `eval` tokens of the text that follows.
fn build_case(
    model: ModelRef<'_>,
    options: &BenchOptions,
    paragraphs: &[String],
    tokens: usize,
) -> Result<Case> {
    let tokenizer = model.tokenizer;
    let count = |text: &str| -> Result<usize> { Ok(tokenizer.encode(text, plain())?.len()) };
    let mut rng = StdRng::seed_from_u64(options.seed ^ tokens as u64);
    let mut needles = Vec::new();
    let mut objects = OBJECTS.to_vec();
    for &depth in &options.depths {
        for _ in 0..options.needles {
            if objects.is_empty() {
                return Err(BenchError::Input(format!(
                    "at most {} needles per context",
                    OBJECTS.len()
                )));
            }
            let object = objects.remove(rng.random_range(0..objects.len()));
            let number = rng.random_range(1_000_000..10_000_000u32).to_string();
            let sentence = format!("The special magic number for the {object} is {number}.");
            needles.push((depth, object.to_string(), number, sentence));
        }
    }
    let needle_tokens: usize = needles
        .iter()
        .map(|n| count(&n.3).map(|c| c + 2))
        .sum::<Result<_>>()?;
    let mut haystack: Vec<(String, usize)> = Vec::new();
    let mut used = needle_tokens;
    let mut rest = paragraphs.iter();
    for p in rest.by_ref() {
        if used >= tokens {
            break;
        }
        let n = count(p)? + 2;
        used += n;
        haystack.push((p.clone(), n));
    }
    let mut eval = Vec::new();
    for p in rest {
        if eval.len() >= options.eval_tokens {
            break;
        }
        eval.extend(tokenizer.encode(&format!("{p}\n\n"), plain())?);
    }
    if used < tokens || eval.len() < options.eval_tokens {
        return Err(BenchError::Input(format!(
            "the corpus text is too short for a {tokens}-token context plus {} eval tokens: \
             it holds about {} tokens in {} paragraphs (needles included); pass more \
             --corpus-text",
            options.eval_tokens,
            used + eval.len(),
            paragraphs.len()
        )));
    }
    eval.truncate(options.eval_tokens);
    // Plant each needle before the paragraph where its depth (in tokens) falls.
    let total: usize = haystack.iter().map(|(_, n)| n).sum();
    let mut planted: Vec<String> = Vec::new();
    let mut pending: Vec<&(f64, String, String, String)> = needles.iter().collect();
    pending.sort_by(|a, b| a.0.total_cmp(&b.0));
    let mut seen = 0usize;
    for (p, n) in &haystack {
        while let Some(needle) = pending.first() {
            if (seen as f64) < needle.0 * total as f64 {
                break;
            }
            planted.push(needle.3.clone());
            pending.remove(0);
        }
        planted.push(p.clone());
        seen += n;
    }
    planted.extend(pending.iter().map(|n| n.3.clone()));
    let documents = planted
        .chunks(16)
        .enumerate()
        .map(|(i, chunk)| {
            let text = chunk.join("\n\n") + "\n\n";
            SourceDocument {
                path: format!("bench/{tokens}/part{i:03}.txt").into(),
                title: format!("part{i:03}"),
                sha256: kvdb_model::fetch::sha256_hex(text.as_bytes()),
                bytes: text.len(),
                text,
            }
        })
        .collect();
    Ok(Case {
        documents,
        eval,
        needles,
    })
}

fn run_context(
    model: ModelRef<'_>,
    options: &BenchOptions,
    paragraphs: &[String],
    tokens: usize,
    bar: &ProgressBar,
) -> Result<ContextResult> {
    let case = build_case(model, options, paragraphs, tokens)?;
    let dir = tempfile::tempdir().map_err(|source| BenchError::Io {
        what: "a temporary store".into(),
        source,
    })?;
    let store = Arc::new(Store::open(dir.path(), Access::Write)?);
    let name = "bench";
    let specs = options.specs_with_flat();
    let (first, last) = case
        .documents
        .split_at(case.documents.len().saturating_sub(1).max(1));
    phase(bar, format!("{tokens}-token context: prefilling"));
    let prefill = Instant::now();
    ingest(&store, name, model, first, &mut |_| bar.tick())?;
    let mut prefill_seconds = prefill.elapsed().as_secs_f64();
    phase(bar, format!("{tokens}-token context: building indexes"));
    let built = update_indexes(
        &store,
        name,
        model,
        &specs,
        options.saap.as_deref(),
        &mut |_| bar.tick(),
    )?;
    let prefill = Instant::now();
    ingest(&store, name, model, last, &mut |_| bar.tick())?;
    prefill_seconds += prefill.elapsed().as_secs_f64();
    phase(
        bar,
        format!("{tokens}-token context: adding the last document"),
    );
    let added = update_indexes(
        &store,
        name,
        model,
        &[],
        options.saap.as_deref(),
        &mut |_| bar.tick(),
    )?;
    let corpus = Corpus::open(store.clone(), name, model, usize::MAX)?;
    let n = corpus.manifest().tokens;
    let costs = costs(model, &corpus, &built, &added)?;
    let points = points(&specs, options, n);

    phase(
        bar,
        format!("{tokens}-token context: full attention over the eval text"),
    );
    let mut captured = Vec::new();
    let retrieval_layers = corpus.manifest().retrieval_layers();
    let full_logits =
        corpus.score_observed(model, &case.eval, AttentionMode::Full, &mut |input| {
            if retrieval_layers.contains(&input.layer.index) {
                captured.push(Captured::new(input)?);
            }
            Ok(())
        })?;
    phase(bar, format!("{tokens}-token context: retrieval quality"));
    let quality = quality(model, options, &store, &corpus, &captured, &points, bar)?;

    phase(bar, format!("{tokens}-token context: end to end"));
    let mut end_to_end = vec![end_to_end(
        "full",
        &full_logits,
        &full_logits,
        &case.eval,
        1.0,
    )?];
    for point in &points {
        let mode = retrieval_mode(point, options)?;
        let logits = corpus.score(model, &case.eval, mode)?;
        end_to_end.push(end_to_end_of(
            point,
            &logits,
            &full_logits,
            &case.eval,
            &quality,
        )?);
        bar.tick();
    }

    phase(bar, format!("{tokens}-token context: needles"));
    let needles = needles(model, options, &corpus, &case, &points, n)?;
    Ok(ContextResult {
        tokens: n,
        prefill_seconds,
        costs,
        quality,
        end_to_end,
        needles,
    })
}

/// Shows the run's current phase: on the spinner, or as a timestamped line on stderr when
/// the spinner is hidden (output to a file or a pipe), so that a logged run shows progress.
fn phase(bar: &ProgressBar, message: String) {
    if bar.is_hidden() {
        eprintln!("kvdb: [{:>5.0} s] {message}", bar.elapsed().as_secs_f64());
    }
    bar.set_message(message);
}

/// Every spec at every budget it takes: top-k indexes at each share of the corpus; the
/// others at each multiple of the budget their spec carries (whole-bucket indexes: lists
/// probed or buckets visited; hip and ihip: `k`), the spec's own budget first.
fn points(specs: &[IndexSpec], options: &BenchOptions, n: usize) -> Vec<Point> {
    let mut points = Vec::new();
    for spec in specs {
        let point = |k, breadth| Point {
            spec: spec.to_string(),
            kind: spec.kind().to_string(),
            k,
            breadth,
        };
        // The spec's own budget, then each other multiple of it once.
        let multiples = |own: usize| {
            let mut values = vec![own];
            for m in &options.sweep {
                let v = ((own as f64 * m).round() as usize).max(1);
                if !values.contains(&v) {
                    values.push(v);
                }
            }
            values.into_iter().map(move |v| (v != own).then_some(v))
        };
        match (spec.breadth(), spec.default_k()) {
            (Some((_, own)), _) if spec.attends_whole_buckets() => {
                points.extend(multiples(own).map(|b| point(None, b)));
            }
            (_, Some(own)) => points.extend(multiples(own).map(|k| point(k, None))),
            _ => points.extend(
                options
                    .budgets
                    .iter()
                    .map(|b| point(Some(((b * n as f64).round() as usize).max(1)), None)),
            ),
        }
    }
    points
}

fn retrieval_mode(point: &Point, options: &BenchOptions) -> Result<AttentionMode> {
    Ok(AttentionMode::Retrieval(Retrieval {
        index: Some(point.spec.parse()?),
        k: point.k,
        policy: options.policy(),
        breadth: point.breadth,
        follow: options.follow,
        ..Retrieval::default()
    }))
}

fn costs(
    model: ModelRef<'_>,
    corpus: &Corpus,
    built: &[IndexInfo],
    added: &[IndexInfo],
) -> Result<Vec<Cost>> {
    built
        .iter()
        .map(|b| {
            let after = added.iter().find(|a| a.spec == b.spec).unwrap_or(b);
            let set = corpus.index(model, &b.spec.parse()?)?;
            let memory_bytes = set.memory_bytes();
            Ok(Cost {
                spec: b.spec.clone(),
                built: b.built.clone(),
                build_seconds: b.build_seconds,
                add_seconds: after.add_seconds,
                added_keys: after.keys.saturating_sub(b.keys),
                memory_bytes,
                disk_bytes: after.bytes_on_disk,
            })
        })
        .collect()
}

/// One retrieval layer's attention input over the eval tokens, as plain vectors.
struct Captured {
    layer: usize,
    rope: Rope,
    scale: f32,
    first: usize,
    heads: usize,
    kv_heads: usize,
    d: usize,
    /// Pre-RoPE `[t, heads, d]`.
    queries: Vec<f32>,
    /// Pre-RoPE `[t, kv_heads, d]`.
    keys: Vec<f32>,
    /// `[t, kv_heads, d]`.
    values: Vec<f32>,
}

impl Captured {
    fn new(input: &AttentionInput<'_>) -> kvdb::Result<Self> {
        let (_, heads, d) = input
            .queries
            .dims3()
            .map_err(kvdb_model::ModelError::from)?;
        let kv_heads = input.keys.dim(1).map_err(kvdb_model::ModelError::from)?;
        let flat = |t: &Tensor| -> kvdb::Result<Vec<f32>> {
            Ok(t.flatten_all()
                .and_then(|t| t.to_vec1())
                .map_err(kvdb_model::ModelError::from)?)
        };
        Ok(Self {
            layer: input.layer.index,
            rope: input.rope.clone(),
            scale: input.scale,
            first: input.positions.start,
            heads,
            kv_heads,
            d,
            queries: flat(input.queries)?,
            keys: flat(input.keys)?,
            values: flat(input.values)?,
        })
    }

    fn tokens(&self) -> usize {
        self.keys.len() / (self.kv_heads * self.d)
    }

    /// KV head `g`'s rows of `[t, kv_heads, d]` data.
    fn head_rows(&self, data: &[f32], g: usize) -> Vec<f32> {
        data.chunks_exact(self.d)
            .skip(g)
            .step_by(self.kv_heads)
            .flatten()
            .copied()
            .collect()
    }
}

/// The measures of every point on every retrieval layer and KV head.
fn quality(
    model: ModelRef<'_>,
    options: &BenchOptions,
    store: &Store,
    corpus: &Corpus,
    captured: &[Captured],
    points: &[Point],
    bar: &ProgressBar,
) -> Result<Vec<(Point, Vec<HeadQuality>)>> {
    let n = corpus.manifest().tokens;
    let policy = options.policy();
    let mut out: Vec<(Point, Vec<HeadQuality>)> =
        points.iter().map(|p| (p.clone(), Vec::new())).collect();
    for cap in captured {
        let (d, group) = (cap.d, cap.heads / cap.kv_heads);
        for g in 0..cap.kv_heads {
            // The head's keys and values: the stored corpus, then the eval tokens.
            let manifest = corpus.manifest();
            let mut keys = store.rows(manifest, Kv::Keys, cap.layer, g, 0..n)?;
            let mut values = store.rows(manifest, Kv::Values, cap.layer, g, 0..n)?;
            keys.extend(cap.head_rows(&cap.keys, g));
            values.extend(cap.head_rows(&cap.values, g));
            cap.rope.rotate_rows(&mut keys, 0);
            let set = points
                .iter()
                .map(|p| {
                    corpus
                        .index(model, &p.spec.parse()?)
                        .map_err(BenchError::from)
                })
                .collect::<Result<Vec<_>>>()?;
            let mut searchers: Vec<_> = set
                .iter()
                .map(|s| {
                    s.layer(cap.layer)
                        .and_then(|heads| heads.get(g))
                        .map(|index| index.searcher())
                        .ok_or_else(|| {
                            BenchError::Input(format!("no index for layer {} head {g}", cap.layer))
                        })
                })
                .collect::<Result<_>>()?;
            let mut sums = vec![Sums::default(); points.len()];
            let mut rng = StdRng::seed_from_u64(options.seed ^ (cap.layer * 31 + g) as u64);
            for i in 0..cap.tokens() {
                let position = cap.first + i;
                // The session widens the window over the unindexed tail the same way.
                let at = DensePolicy {
                    sink: policy.sink,
                    window: policy.window.max(position + 1 - n),
                };
                let eligible = at.candidates(position);
                let dense = at.dense_ranges(position);
                let raw = &cap.queries[(i * cap.heads + g * group) * d..][..group * d];
                let exact = ExactHeads::new(raw, &keys, &values, position, cap);
                for ((point, searcher), sums) in points.iter().zip(&mut searchers).zip(&mut sums) {
                    let params = SearchParams {
                        breadth: point.breadth,
                        ..SearchParams::top(point.budget(), eligible.clone())
                    };
                    let query = GroupQuery {
                        queries: raw,
                        position,
                    };
                    let timer = Instant::now();
                    let found = searcher.search(&query, &params)?;
                    sums.latency_us.push(timer.elapsed().as_secs_f64() * 1e6);
                    let ids = found.selection.ids();
                    let random = random_selection(eligible.clone(), ids.len(), &mut rng);
                    let e = eligible.start as usize..eligible.end as usize;
                    sums.add(&exact, &e, &dense, ids, &random, found.scored, &values, d);
                }
            }
            for ((_, per_head), sums) in out.iter_mut().zip(&sums) {
                per_head.push(sums.finish(cap.layer, g));
            }
            bar.tick();
        }
    }
    Ok(out)
}

/// Exact attention of a group's heads at one position: weights over `0..=position` and the
/// full output.
struct ExactHeads {
    weights: Vec<Vec<f64>>,
    outputs: Vec<Vec<f64>>,
}

impl ExactHeads {
    fn new(raw: &[f32], keys: &[f32], values: &[f32], position: usize, cap: &Captured) -> Self {
        let d = cap.d;
        let all: Vec<usize> = (0..=position).collect();
        let (weights, outputs) = raw
            .chunks_exact(d)
            .map(|q| {
                let mut q = q.to_vec();
                cap.rope.rotate(&mut q, position);
                let logits: Vec<f64> = keys[..(position + 1) * d]
                    .chunks_exact(d)
                    .map(|k| {
                        cap.scale as f64
                            * q.iter()
                                .zip(k)
                                .map(|(a, b)| *a as f64 * *b as f64)
                                .sum::<f64>()
                    })
                    .collect();
                let w = softmax(&logits);
                let o = output_over(&w, values, d, &all);
                (w, o)
            })
            .unzip();
        Self { weights, outputs }
    }
}

/// Running sums of one point's measures on one layer and KV head.
#[derive(Debug, Clone, Default)]
struct Sums {
    mass: Vec<f64>,
    random_mass: Vec<f64>,
    top_k: Vec<f64>,
    error: Vec<f64>,
    random_error: Vec<f64>,
    selectivity: Vec<f64>,
    scored: Vec<f64>,
    latency_us: Vec<f64>,
}

impl Sums {
    #[allow(clippy::too_many_arguments)]
    fn add(
        &mut self,
        exact: &ExactHeads,
        eligible: &Range<usize>,
        dense: &[Range<u32>],
        ids: &[u32],
        random: &[u32],
        scored: usize,
        values: &[f32],
        d: usize,
    ) {
        let size = eligible.len().max(1) as f64;
        self.selectivity.push(ids.len() as f64 / size);
        self.scored.push(scored as f64 / size);
        for (w, full) in exact.weights.iter().zip(&exact.outputs) {
            self.mass.push(mass_recall(w, eligible.clone(), ids));
            self.random_mass
                .push(mass_recall(w, eligible.clone(), random));
            self.top_k.push(top_k_recall(w, eligible.clone(), ids));
            let error =
                |sel: &[u32]| relative_l2(&output_over(w, values, d, &attended(dense, sel)), full);
            self.error.push(error(ids));
            self.random_error.push(error(random));
        }
    }

    fn finish(&self, layer: usize, kv_head: usize) -> HeadQuality {
        HeadQuality {
            layer,
            kv_head,
            quality: Quality {
                mass_recall: mean(&self.mass),
                random_mass_recall: mean(&self.random_mass),
                top_k_recall: mean(&self.top_k),
                output_error: mean(&self.error),
                random_output_error: mean(&self.random_error),
                selectivity: mean(&self.selectivity),
                scored: mean(&self.scored),
                latency_p50_us: quantile(&self.latency_us, 0.5),
                latency_p99_us: quantile(&self.latency_us, 0.99),
            },
        }
    }
}

/// Next-token agreement, KL and perplexity of `logits` against full attention's.
fn end_to_end(
    label: &str,
    logits: &Tensor,
    full: &Tensor,
    eval: &[u32],
    selectivity: f64,
) -> Result<EndToEnd> {
    let rows: Vec<Vec<f32>> = logits.to_vec2()?;
    let full: Vec<Vec<f32>> = full.to_vec2()?;
    let mut agree = 0usize;
    let mut kl = Vec::new();
    let mut nll = Vec::new();
    for (i, (row, reference)) in rows.iter().zip(&full).enumerate() {
        agree += (argmax(row) == argmax(reference)) as usize;
        kl.push(kl_divergence(reference, row));
        if let Some(&next) = eval.get(i + 1) {
            nll.push(negative_log_likelihood(row, next));
        }
    }
    Ok(EndToEnd {
        label: label.to_string(),
        top1_agreement: agree as f64 / rows.len().max(1) as f64,
        kl: mean(&kl),
        perplexity: mean(&nll).exp(),
        selectivity,
    })
}

fn end_to_end_of(
    point: &Point,
    logits: &Tensor,
    full: &Tensor,
    eval: &[u32],
    quality: &[(Point, Vec<HeadQuality>)],
) -> Result<EndToEnd> {
    let selectivity = quality
        .iter()
        .find(|(p, _)| p == point)
        .map_or(0.0, |(_, heads)| {
            mean(
                &heads
                    .iter()
                    .map(|h| h.quality.selectivity)
                    .collect::<Vec<_>>(),
            )
        });
    end_to_end(&point.label(), logits, full, eval, selectivity)
}

/// Asks for every needle with full attention and every spec at its needle budget (the
/// budget nearest 1% of the corpus for top-k indexes, the spec's own for the others).
fn needles(
    model: ModelRef<'_>,
    options: &BenchOptions,
    corpus: &Corpus,
    case: &Case,
    points: &[Point],
    n: usize,
) -> Result<Vec<NeedleResult>> {
    let target = n as f64 / 100.0;
    let mut chosen: Vec<&Point> = Vec::new();
    for point in points {
        match chosen.iter_mut().find(|c| c.spec == point.spec) {
            Some(c) => {
                // The spec's own budget wins; among top-k budgets, the one nearest 1%.
                let distance = |p: &Point| match p.k {
                    _ if p.is_own() => -1.0,
                    Some(k) => (k as f64 - target).abs(),
                    None => f64::INFINITY,
                };
                if distance(point) < distance(c) {
                    *c = point;
                }
            }
            None => chosen.push(point),
        }
    }
    let mut results = Vec::new();
    for (depth, object, number, sentence) in &case.needles {
        let question = format!(
            "What is the special magic number for the {object}? The special magic number for \
             the {object} is"
        );
        let ask = |mode| -> Result<String> {
            let options = AskOptions {
                profile: false,
                mode,
                generate: kvdb::GenerateOptions {
                    max_tokens: 10,
                    ..Default::default()
                },
                template: None,
            };
            Ok(corpus
                .ask(model, &question, &options, &mut |_| Ok(()))?
                .answer)
        };
        let mut answers = Vec::new();
        let full = ask(AttentionMode::Full)?;
        answers.push((
            "full".to_string(),
            full.clone(),
            full.contains(number.as_str()),
        ));
        for point in &chosen {
            let answer = ask(retrieval_mode(point, options)?)?;
            let found = answer.contains(number.as_str());
            answers.push((point.label(), answer, found));
        }
        results.push(NeedleResult {
            depth: *depth,
            needle: sentence.clone(),
            answers,
        });
    }
    Ok(results)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Top-k indexes get one point per share of the corpus; whole-bucket indexes one per
    /// multiple of their breadth and hip one per multiple of its k, their own first, each
    /// value once.
    #[test]
    fn long_paragraphs_are_cut_at_sentence_ends() {
        let sentence = "The quick brown fox jumps over the lazy dog again. ";
        let line = sentence.repeat(200);
        let text = format!("short one\n\n{line}\n\n{}", "x".repeat(5000));
        let parts = paragraphs(&text);
        assert_eq!(parts[0], "short one");
        let total: usize = parts.iter().map(|p| p.len()).sum();
        // Nothing lost but the spaces at the cuts.
        assert!(total + 200 >= text.len() - 4, "{total} of {}", text.len());
        for p in &parts {
            assert!(p.len() <= PARAGRAPH_CHARS, "{}", p.len());
        }
        // The sentences are cut after their full stop, the unbroken run anywhere.
        for p in &parts[1..parts.len() - 3] {
            assert!(p.ends_with('.'), "{p}");
        }
        assert_eq!(
            parts.last().map(|p| p.len()),
            Some(5000 - 2 * PARAGRAPH_CHARS)
        );
        let multibyte = "é".repeat(3000);
        assert!(paragraphs(&multibyte)
            .iter()
            .all(|p| p.len() <= PARAGRAPH_CHARS));
    }

    #[test]
    fn points_sweep_each_kind_of_budget() {
        let specs: Vec<IndexSpec> = [
            "flat",
            "ivf128,np4,norope,all",
            "saap64,l1",
            "hip:k256,bq1,bk1",
        ]
        .iter()
        .map(|s| s.parse().unwrap())
        .collect();
        let mut options = BenchOptions::preset(Preset::Quick, Vec::new(), specs.clone());
        options.budgets = vec![0.01, 0.05];
        options.sweep = vec![0.25, 0.5, 1.0, 2.0];
        let got: Vec<String> = points(&specs, &options, 10_000)
            .iter()
            .map(Point::label)
            .collect();
        assert_eq!(
            got,
            [
                "flat @k=100",
                "flat @k=500",
                "ivf128,np4,norope,all",
                "ivf128,np4,norope,all @np=1",
                "ivf128,np4,norope,all @np=2",
                "ivf128,np4,norope,all @np=8",
                "saap64,l1",
                "saap64,l1 @l=2",
                "hip:k256,bq1,bk1",
                "hip:k256,bq1,bk1 @k=64",
                "hip:k256,bq1,bk1 @k=128",
                "hip:k256,bq1,bk1 @k=512",
            ]
        );
    }
}
