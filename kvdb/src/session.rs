//! Queries over a stored corpus: the question is appended after the corpus in a per-query
//! tail, and every retrieval layer attends to the keys its index selects plus the dense part
//! (attention sinks, recent tokens and the whole tail), merged exactly. Sliding-window layers
//! attend densely to their stored window. Nothing a query does changes the corpus, so any
//! number of queries share one [`Corpus`].

use std::collections::{BTreeMap, HashMap};
use std::ops::Range;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use candle_core::Tensor;
use kvdb_attention::{attend, Attended, DenseKv, DensePolicy, Estimate, KvSource, RetrievalQuery};
use kvdb_index::{Found, GroupQuery, IndexSpec, KeyIndex, SearchParams, Searcher, Selection};
use kvdb_model::{
    AttentionBackend, AttentionInput, BackendSequence, EncodeOptions, FullAttention, Logits, Rope,
};
use rayon::prelude::*;
use serde::Serialize;

use crate::error::{Error, Result};
use crate::generate::{continue_generation, BatchSteps, GenerateOptions, Generation, StopReason};
#[cfg(feature = "gpu")]
pub use crate::gpu_session::{GpuFootprint, GpuUpload};
use crate::indexes::{load_indexes, IndexSet, LayerIndexes};
use crate::ingest::{check_model, ModelRef};
use crate::ram_tier::{RamTier, TierStats};
use crate::store::{interleave_heads, CorpusManifest, DocumentRecord, LayerPolicy, Store};

/// Tokens per provenance passage (passages are aligned to their document's first token).
pub const PASSAGE_TOKENS: usize = 32;

/// Default retrieved keys per retrieval layer and KV head.
pub const DEFAULT_K: usize = 64;

/// Tokens a question follows by default in `kvdb ask` and the server ([`Retrieval::follow`]):
/// following the 8 most attended found needles' last digits that hip and ivf lost at 16K and
/// 32K tokens (docs/benchmarks.md, "What hip and ihip lose on a needle") for a few ids a
/// search. On the GPU, through an index routed there, it costs nothing measurable for one
/// question and about a quarter of the throughput of 16 answered together (4.11x full
/// attention's against 5.37x; "Following on the GPU without the host").
/// [`Retrieval::default`] follows nothing: a library caller asks for it.
pub const DEFAULT_FOLLOW: usize = 8;

/// How a query attends to the corpus in its retrieval layers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AttentionMode {
    /// Exact attention over every corpus token: the reference, and the baseline of benchmarks.
    Full,
    /// Retrieval attention: the keys an index selects per layer and KV head, plus the dense
    /// part.
    Retrieval(Retrieval),
}

/// The options of retrieval attention.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Retrieval {
    /// The index to search (`None`: the corpus's first).
    pub index: Option<IndexSpec>,
    /// Keys retrieved per retrieval layer and KV head per query token (`None`: the spec's
    /// own budget for hip and ihip, else [`DEFAULT_K`]; whole-bucket indexes ignore it).
    pub k: Option<usize>,
    /// The dense part.
    pub policy: DensePolicy,
    /// Bucket indexes (ivf, saap) add an estimate of the attention their unvisited buckets
    /// would have received (RetroInfer's idea); off by default.
    pub estimate: bool,
    /// Lists probed (ivf), buckets visited (saap) or the graph's candidate list (hnsw) for
    /// this query, overriding the index's spec (`None`: the spec's own).
    pub breadth: Option<usize>,
    /// At every step, each KV head also attends the token after each of the `follow`
    /// retrieved tokens its attention weighted most at the step before (0: off). A model
    /// that copies text (a number, a name) attends one position further each step, as
    /// MInference's slash lines show; an index searched with the next step's query can miss
    /// that next key, and this adds it without scoring anything. On the CPU and the GPU (an
    /// index routed on the GPU ranks and attends what it follows there).
    pub follow: usize,
}

impl AttentionMode {
    /// Retrieval with `k` keys from the corpus's default index and `policy`.
    pub fn top_k(k: usize, policy: DensePolicy) -> Self {
        Self::Retrieval(Retrieval {
            index: None,
            k: Some(k),
            policy,
            estimate: false,
            breadth: None,
            follow: 0,
        })
    }
}

impl Default for AttentionMode {
    fn default() -> Self {
        Self::Retrieval(Retrieval::default())
    }
}

/// What the retrieval of one answer cost and selected, summed over its searches (one per
/// query token, retrieval layer and KV head).
#[derive(Debug, Clone, Default, Serialize)]
pub struct RetrievalStats {
    /// The index searched, as built.
    pub index: String,
    /// Searches.
    pub searches: usize,
    /// Vectors scored by the searches (keys, centroids, graph distances).
    pub scored: usize,
    /// Keys selected (attended besides the dense part).
    pub selected: usize,
    /// Keys the searches could have selected (corpus tokens outside the dense part).
    pub eligible: usize,
    /// Wall seconds the searches took (all KV heads of a layer in parallel).
    pub search_seconds: f64,
    /// Wall seconds of attention on the CPU over the selections: the whole retrieval
    /// attention on the CPU; none on the GPU (attention and provenance run there).
    pub cpu_attention_seconds: f64,
    /// Wall seconds a GPU query waited for its queries to reach the host, once per retrieval
    /// layer and call (the GPU's work queued before them included).
    pub transfer_seconds: f64,
}

impl RetrievalStats {
    /// Selected keys as a share of the eligible ones.
    pub fn selectivity(&self) -> f64 {
        self.selected as f64 / self.eligible.max(1) as f64
    }

    /// Scored vectors as a share of the eligible keys.
    pub fn scored_share(&self) -> f64 {
        self.scored as f64 / self.eligible.max(1) as f64
    }
}

/// Options of one query.
#[derive(Debug, Clone, Default)]
pub struct AskOptions {
    /// Retrieval or full attention.
    pub mode: AttentionMode,
    /// Sampling and stopping.
    pub generate: GenerateOptions,
    /// A prompt template with `{question}` where the question goes (for instruction-tuned
    /// models); `None` appends the question verbatim.
    pub template: Option<String>,
    /// On a GPU, time each retrieval stage of every step with CUDA events
    /// ([`Timings::gpu_stage_seconds`]); the events add a little work to every layer.
    pub profile: bool,
}

/// A document's share of the attention mass while answering.
#[derive(Debug, Clone, Serialize)]
pub struct DocumentShare {
    /// Its number in the corpus.
    pub number: usize,
    /// Its title.
    pub title: String,
    /// Share of the attention mass that reached corpus tokens outside the sink.
    pub share: f64,
}

/// A passage's share of the attention mass while answering.
#[derive(Debug, Clone, Serialize)]
pub struct PassageShare {
    /// Its document's number.
    pub document: usize,
    /// Its document's title.
    pub title: String,
    /// Its tokens in the corpus's context.
    pub tokens: Range<usize>,
    /// Share of the attention mass that reached corpus tokens outside the sink.
    pub share: f64,
    /// Its text.
    pub text: String,
}

/// Which documents and passages an answer attended to.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Provenance {
    /// Documents by share, largest first.
    pub documents: Vec<DocumentShare>,
    /// The passages with the largest shares, largest first.
    pub passages: Vec<PassageShare>,
}

/// Where a query's time went.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Timings {
    /// Seconds from the start of the query to the first answer token (question prefill,
    /// retrieval, first sample).
    pub first_token_seconds: f64,
    /// Seconds generating the rest.
    pub decode_seconds: f64,
    /// Answer tokens per second after the first.
    pub tokens_per_second: f64,
    /// With [`AskOptions::profile`] on a GPU: seconds of GPU time per stage of the
    /// attention layers the query computes itself (`attention`, or `routing and attention`
    /// for a query routed on the GPU, and `provenance`),
    /// over the question and the answer; the rest of a step is the model's own work.
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub gpu_stage_seconds: BTreeMap<&'static str, f64>,
}

/// A query's result.
#[derive(Debug, Clone, Serialize)]
pub struct Answer {
    /// The answer text.
    pub answer: String,
    /// The answer's token ids.
    pub tokens: Vec<u32>,
    /// Why generation stopped.
    pub stop: StopReason,
    /// Tokens of the corpus the question followed.
    pub corpus_tokens: usize,
    /// Tokens of the question (with its template).
    pub question_tokens: usize,
    /// Documents and passages attended to (empty with full attention).
    pub provenance: Provenance,
    /// What retrieval selected (`None` with full attention).
    pub retrieval: Option<RetrievalStats>,
    /// Timings.
    pub timings: Timings,
}

/// Where a corpus's retrieval layers' keys and values are kept for questions decoded on a
/// GPU (they are uploaded by the first GPU question, or by [`Corpus::upload_to_gpu`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum GpuKv {
    /// On the GPU when they fit its free memory (a sixteenth kept spare), else as
    /// [`GpuKv::Split`] over seven eighths of that memory.
    #[default]
    Auto,
    /// On the GPU, read in place by every step; the upload fails when they do not fit.
    Resident,
    /// Whole retrieval layers on the GPU, the first ones, while they fit in `gpu_bytes` (and
    /// in its free memory); the rest as [`GpuKv::Host`], behind caches of half the GPU memory
    /// left. A step then reads most layers at GPU speed and only the rest over PCIe; full
    /// attention needs every layer on the GPU.
    Split {
        /// GPU memory for the resident layers.
        gpu_bytes: usize,
    },
    /// In pinned host memory mapped into the GPU's address space, for corpora larger than the
    /// GPU; questions must retrieve (full attention reads every key). Bucket indexes the GPU
    /// routes read the visited buckets' rows in place, over PCIe; indexes searched on the CPU
    /// copy each step's selected blocks into a GPU cache of hot blocks of `cache_bytes` in all
    /// (`None`: half the GPU's free memory; `Some(0)`: no cache, their rows read in place as
    /// well), split evenly over the retrieval layers; a layer's cache is allocated by the
    /// first question that searches it on the CPU.
    Host {
        /// GPU memory of the caches, all layers together.
        cache_bytes: Option<usize>,
    },
}

/// A corpus opened for queries: its manifest, documents, RAM tier, stored sliding windows
/// and indexes (the default one loaded on open, others on first use). Shared by concurrent
/// queries.
#[derive(Debug)]
pub struct Corpus {
    store: Arc<Store>,
    manifest: CorpusManifest,
    documents: Vec<DocumentRecord>,
    tokens: Vec<u32>,
    tier: RamTier,
    /// The sliding-window layers' stored windows.
    windows: Vec<StoredWindow>,
    /// Layers that retrieve.
    retrieval_layers: Vec<usize>,
    /// Loaded indexes by spec (canonical spelling).
    indexes: Mutex<HashMap<String, Arc<IndexSet>>>,
    /// The retrieval layers' keys and values on the GPU, uploaded by the first GPU query.
    #[cfg(feature = "gpu")]
    gpu_kv: Mutex<Option<Arc<crate::gpu_session::GpuCorpusKv>>>,
    /// Where they are kept for GPU questions.
    gpu_placement: GpuKv,
}

impl Corpus {
    /// Opens corpus `name` for queries with `model` (which must be the corpus's model),
    /// reading keys and values through a RAM tier of `ram_budget` bytes.
    pub fn open(
        store: Arc<Store>,
        name: &str,
        model: ModelRef<'_>,
        ram_budget: usize,
    ) -> Result<Self> {
        let manifest = store.manifest(name)?;
        check_model(&manifest, model.record)?;
        let config = model.model.config();
        if manifest.layers.len() != config.n_layers() {
            return Err(Error::Corrupt(format!(
                "corpus `{name}` records {} layers, the model has {}",
                manifest.layers.len(),
                config.n_layers()
            )));
        }
        let n = manifest.tokens;
        if n == 0 {
            return Err(Error::CorpusEmpty {
                corpus: name.to_string(),
            });
        }
        let documents = store.documents(&manifest)?;
        let tokens = store.tokens(&manifest, 0..n)?;
        let (heads, d) = (config.n_kv_heads, config.head_dim);
        let mut windows = Vec::new();
        for spec in &config.layers {
            match manifest.layers[spec.index] {
                LayerPolicy::Last { .. } => {
                    let range = manifest.stored_range(spec.index, n);
                    let (keys, values) = store.layer_kv(&manifest, spec.index, range.clone())?;
                    let shape = (range.len(), heads, d);
                    let device = model.model.device();
                    windows.push(StoredWindow {
                        layer: spec.index,
                        keys: Tensor::from_vec(keys, shape, device)?,
                        values: Tensor::from_vec(values, shape, device)?,
                        positions: range,
                    });
                }
                LayerPolicy::All => {}
            }
        }
        let tier = RamTier::new(store.clone(), &manifest, ram_budget);
        let corpus = Self {
            retrieval_layers: manifest.retrieval_layers(),
            store,
            manifest,
            documents,
            tokens,
            tier,
            windows,
            indexes: Mutex::default(),
            #[cfg(feature = "gpu")]
            gpu_kv: Mutex::default(),
            gpu_placement: GpuKv::default(),
        };
        corpus.index(model, &corpus.default_index()?)?;
        Ok(corpus)
    }

    /// The same corpus, its keys and values kept for GPU questions as `placement` says
    /// (default [`GpuKv::Auto`]); set before the first GPU question, which uploads them.
    pub fn with_gpu_kv(mut self, placement: GpuKv) -> Self {
        self.gpu_placement = placement;
        self
    }

    /// Where the corpus's keys and values are kept for GPU questions.
    pub fn gpu_placement(&self) -> GpuKv {
        self.gpu_placement
    }

    /// The spec queries use when they name none: the corpus's first index.
    pub fn default_index(&self) -> Result<IndexSpec> {
        Ok(self
            .manifest
            .indexes
            .first()
            .map_or(Ok(IndexSpec::Flat), |s| s.parse())?)
    }

    /// The indexes of `spec`, loaded on first use.
    pub fn index(&self, model: ModelRef<'_>, spec: &IndexSpec) -> Result<Arc<IndexSet>> {
        let key = spec.to_string();
        if let Some(set) = self.lock_indexes()?.get(&key) {
            return Ok(set.clone());
        }
        // Loaded outside the lock (it can take a while); a racing load of the same spec
        // wastes work but stores an equal set.
        let set = Arc::new(load_indexes(&self.store, &self.manifest, model, spec)?);
        Ok(self.lock_indexes()?.entry(key).or_insert(set).clone())
    }

    fn lock_indexes(&self) -> Result<std::sync::MutexGuard<'_, HashMap<String, Arc<IndexSet>>>> {
        self.indexes
            .lock()
            .map_err(|_| Error::Internal("an earlier query panicked while loading an index".into()))
    }

    /// The retrieval layers' keys and values on `gpu`'s device, uploaded on first use (by
    /// one query at a time: the others wait rather than upload them again).
    #[cfg(feature = "gpu")]
    pub(crate) fn gpu_kv(
        &self,
        model: ModelRef<'_>,
        gpu: &kvdb_model::GpuModel,
    ) -> Result<Arc<crate::gpu_session::GpuCorpusKv>> {
        let mut cached = self.gpu_kv.lock().map_err(|_| {
            Error::Internal("an earlier query panicked uploading the corpus".into())
        })?;
        if let Some(kv) = cached.as_ref().filter(|kv| kv.is_on(gpu)) {
            return Ok(kv.clone());
        }
        let kv = Arc::new(crate::gpu_session::GpuCorpusKv::build(
            self,
            model,
            gpu,
            &self.retrieval_layers,
            self.manifest.tokens,
            self.gpu_placement,
        )?);
        *cached = Some(kv.clone());
        Ok(kv)
    }

    /// Uploads the retrieval layers' keys and values to the model's GPU now rather than at
    /// the first question (a server or a benchmark does it before taking questions);
    /// returns what the upload did (nothing for a model without a GPU).
    #[cfg(feature = "gpu")]
    pub fn upload_to_gpu(&self, model: ModelRef<'_>) -> Result<GpuUpload> {
        match model.gpu {
            Some(gpu) => Ok(self.gpu_kv(model, gpu)?.upload()),
            None => Ok(Default::default()),
        }
    }

    /// What the corpus holds for the GPU (nothing before its first GPU query): bytes of GPU
    /// memory (resident layers' keys and values, and the block caches in front of the rest),
    /// bytes of pinned host memory, and the block caches' lookups so far.
    #[cfg(feature = "gpu")]
    pub fn gpu_footprint(&self) -> GpuFootprint {
        self.gpu_kv
            .lock()
            .ok()
            .and_then(|kv| kv.as_ref().map(|kv| kv.footprint()))
            .unwrap_or_default()
    }

    /// Rows `range` of `layer`'s keys and values, f16 `[n_kv_heads, rows, head_dim]` each,
    /// as stored.
    #[cfg(feature = "gpu")]
    pub(crate) fn layer_kv_f16(
        &self,
        layer: usize,
        range: Range<usize>,
    ) -> Result<(Vec<half::f16>, Vec<half::f16>)> {
        self.store.layer_kv_f16(&self.manifest, layer, range)
    }

    /// The layers that retrieve.
    #[cfg(feature = "gpu")]
    pub(crate) fn retrieval_layers(&self) -> &[usize] {
        &self.retrieval_layers
    }

    /// The sliding-window layers' stored windows.
    #[cfg(feature = "gpu")]
    pub(crate) fn windows(&self) -> &[StoredWindow] {
        &self.windows
    }

    /// The manifest the corpus was opened at.
    pub fn manifest(&self) -> &CorpusManifest {
        &self.manifest
    }

    /// Its complete documents.
    pub fn documents(&self) -> &[DocumentRecord] {
        &self.documents
    }

    /// The RAM tier's counters.
    pub fn tier_stats(&self) -> TierStats {
        self.tier.stats()
    }

    /// Bytes the loaded indexes hold.
    pub fn index_bytes(&self) -> usize {
        self.lock_indexes()
            .map_or(0, |sets| sets.values().map(|set| set.memory_bytes()).sum())
    }

    /// Answers `question`, streaming the answer's text to `on_text`: [`Corpus::session`],
    /// then [`Session::answer`].
    pub fn ask(
        &self,
        model: ModelRef<'_>,
        question: &str,
        options: &AskOptions,
        on_text: &mut dyn FnMut(&str) -> Result<()>,
    ) -> Result<Answer> {
        self.session(model, question, options)?.answer(on_text)
    }

    /// One query: `question` (in `options.template` when given) checked against the corpus
    /// and the model's context and tokenised, and the index it searches loaded, ready to
    /// [`Session::answer`]. Every error a question can cause is raised here, before any
    /// answer text exists.
    pub fn session<'a>(
        &'a self,
        model: ModelRef<'a>,
        question: &str,
        options: &'a AskOptions,
    ) -> Result<Session<'a>> {
        check_model(&self.manifest, model.record)?;
        let text = match &options.template {
            Some(t) if t.contains("{question}") => t.replace("{question}", question),
            Some(_) => return Err(Error::TemplatePlaceholder),
            None => question.to_string(),
        };
        let ids = model.tokenizer.encode(
            &text,
            EncodeOptions {
                add_bos: false,
                add_eos: false,
                parse_special: options.template.is_some(),
            },
        )?;
        if ids.is_empty() {
            return Err(Error::EmptyInput {
                what: "question",
                hint: "",
            });
        }
        let n = self.manifest.tokens;
        let context = model.model.config().context_length;
        if n + ids.len() >= context {
            return Err(Error::TooLongForContext {
                what: "question",
                tokens: ids.len(),
                corpus_tokens: n,
                context,
                room: context.saturating_sub(n + 1),
            });
        }
        let set = self.index_for(model, &options.mode)?;
        Ok(Session {
            corpus: self,
            model,
            options,
            ids,
            set,
        })
    }

    /// Answers `ids` after the corpus on the model's device: the GPU when the model has
    /// one, else the CPU. Returns the generation and the session, which holds the attention
    /// mass and retrieval statistics.
    fn generate<'c>(
        &'c self,
        model: ModelRef<'_>,
        session: QueryState<'c>,
        mode: &AttentionMode,
        ids: &[u32],
        options: &GenerateOptions,
        on_text: &mut dyn FnMut(&str) -> Result<()>,
    ) -> Result<(Generation, QueryState<'c>)> {
        #[cfg(feature = "gpu")]
        if let Some(gpu) = model.gpu {
            return crate::gpu_session::generate(self, model, gpu, session, ids, options, on_text);
        }
        let mut cpu = CpuSession {
            full: self.dense_attention(model, mode)?,
            session,
        };
        let n = self.manifest.tokens;
        let generation = continue_generation(
            &mut BackendSequence::new(model.model, &mut cpu, n),
            model.tokenizer,
            ids,
            options,
            on_text,
        )?;
        Ok((generation, cpu.session))
    }

    /// Runs `ids` after the corpus in one chunk and returns the logits `[ids, vocab]` of every
    /// position: scoring text against the corpus (equivalence tests, perplexity).
    /// On the GPU when the model has one.
    pub fn score(&self, model: ModelRef<'_>, ids: &[u32], mode: AttentionMode) -> Result<Tensor> {
        #[cfg(feature = "gpu")]
        if let Some(gpu) = model.gpu {
            self.check_score(model, ids)?;
            let set = self.index_for(model, &mode)?;
            let session = self.query_state(model, &mode, set.as_deref(), None)?;
            return crate::gpu_session::score(self, model, gpu, session, ids);
        }
        self.score_observed(model, ids, mode, &mut |_| Ok(()))
    }

    /// Checks that `ids` can be scored after the corpus.
    fn check_score(&self, model: ModelRef<'_>, ids: &[u32]) -> Result<()> {
        check_model(&self.manifest, model.record)?;
        let n = self.manifest.tokens;
        let context = model.model.config().context_length;
        if ids.is_empty() {
            return Err(Error::EmptyInput {
                what: "text to score",
                hint: "",
            });
        }
        if n + ids.len() > context {
            return Err(Error::TooLongForContext {
                what: "text to score",
                tokens: ids.len(),
                corpus_tokens: n,
                context,
                room: context.saturating_sub(n),
            });
        }
        Ok(())
    }

    /// [`Corpus::score`] on the CPU, showing `observe` every layer's attention input first
    /// (the model's own queries on real text, for benches that measure retrieval on them).
    pub fn score_observed(
        &self,
        model: ModelRef<'_>,
        ids: &[u32],
        mode: AttentionMode,
        observe: &mut dyn FnMut(&AttentionInput<'_>) -> Result<()>,
    ) -> Result<Tensor> {
        self.check_score(model, ids)?;
        let n = self.manifest.tokens;
        let set = self.index_for(model, &mode)?;
        let mut session = CpuSession {
            full: self.dense_attention(model, &mode)?,
            session: self.query_state(model, &mode, set.as_deref(), None)?,
        };
        let mut observed = |input: &AttentionInput<'_>| -> kvdb_model::Result<Tensor> {
            observe(input).map_err(|e| backend_failed(input.layer.index, e))?;
            session.attend(input)
        };
        model
            .model
            .forward(ids, n, &mut observed, &Logits::All)?
            .ok_or_else(|| Error::Internal("the model returned no logits".into()))
    }

    /// The index set a mode searches (`None` for full attention).
    fn index_for(
        &self,
        model: ModelRef<'_>,
        mode: &AttentionMode,
    ) -> Result<Option<Arc<IndexSet>>> {
        match mode {
            AttentionMode::Full => Ok(None),
            AttentionMode::Retrieval(r) => {
                let spec = match &r.index {
                    Some(spec) => spec.clone(),
                    None => self.default_index()?,
                };
                Ok(Some(self.index(model, &spec)?))
            }
        }
    }

    /// A fresh per-query state: under retrieval an empty tail and a searcher per retrieval
    /// layer and KV head. Attention mass counts for provenance from position `answer_from`
    /// on (`None`: not at all).
    fn query_state<'c>(
        &'c self,
        model: ModelRef<'_>,
        mode: &AttentionMode,
        set: Option<&'c IndexSet>,
        answer_from: Option<usize>,
    ) -> Result<QueryState<'c>> {
        let config = model.model.config();
        let mut layers: Vec<LayerState<'c>> =
            (0..config.n_layers()).map(|_| LayerState::Dense).collect();
        let retriever = match (mode, set) {
            (AttentionMode::Retrieval(r), Some(set)) => {
                let d = config.head_dim;
                for LayerIndexes { layer, heads } in set.layers() {
                    let means = if r.estimate {
                        Some(self.bucket_means(*layer, heads, d, r)?)
                    } else {
                        None
                    };
                    let state = layers.get_mut(*layer).ok_or_else(|| {
                        Error::Internal(format!("an index for layer {layer}, past the model's"))
                    })?;
                    *state = LayerState::Retrieval(retrieval_heads(heads, d, means)?);
                }
                if let Some(layer) = (self.retrieval_layers.iter())
                    .find(|&&l| !matches!(layers[l], LayerState::Retrieval(_)))
                {
                    return Err(Error::Internal(format!(
                        "retrieval layer {layer} has no index"
                    )));
                }
                Some(self.retriever(r, set)?)
            }
            _ => None,
        };
        Ok(QueryState {
            corpus: self,
            layers,
            retriever,
            mass: vec![0.0; self.manifest.tokens],
            answer_from,
            #[cfg(feature = "gpu")]
            set,
            #[cfg(feature = "gpu")]
            profile: false,
            gpu_stages: BTreeMap::new(),
        })
    }

    /// Full attention with the stored sliding windows preloaded, and for
    /// [`AttentionMode::Full`] every retrieval layer's corpus keys and values too.
    fn dense_attention(&self, model: ModelRef<'_>, mode: &AttentionMode) -> Result<FullAttention> {
        let config = model.model.config();
        let mut full = FullAttention::new(config);
        let rope = |layer: usize| {
            model
                .model
                .rope(layer)
                .ok_or_else(|| Error::Internal(format!("the model has no layer {layer}")))
        };
        for window in &self.windows {
            full.preload(
                &config.layers[window.layer],
                rope(window.layer)?,
                &window.keys,
                &window.values,
                window.positions.clone(),
            )?;
        }
        if *mode == AttentionMode::Full {
            let n = self.manifest.tokens;
            let ids: Vec<u32> = (0..n as u32).collect();
            for &layer in &self.retrieval_layers {
                let (mut keys, mut values) = (Vec::new(), Vec::new());
                for head in 0..config.n_kv_heads {
                    let (mut k, mut v) = (Vec::new(), Vec::new());
                    self.tier.gather(layer, head, &ids, &mut k, &mut v)?;
                    keys.push(k);
                    values.push(v);
                }
                let (d, dev) = (config.head_dim, model.model.device());
                let shape = (n, config.n_kv_heads, d);
                full.preload(
                    &config.layers[layer],
                    rope(layer)?,
                    &Tensor::from_vec(interleave_heads(&keys, d), shape, dev)?,
                    &Tensor::from_vec(interleave_heads(&values, d), shape, dev)?,
                    0..n,
                )?;
            }
        }
        Ok(full)
    }

    /// The budget and empty statistics of a query's retrieval through `set`.
    fn retriever(&self, r: &Retrieval, set: &IndexSet) -> Result<Retriever> {
        let built = set.built_spec();
        let spec = r.index.clone().map_or_else(|| self.default_index(), Ok)?;
        Ok(Retriever {
            budget: Budget {
                search: SearchParams {
                    breadth: r.breadth,
                    ..SearchParams::top(r.k.or(spec.default_k()).unwrap_or(DEFAULT_K), 0..0)
                },
                policy: r.policy,
                follow: r.follow,
            },
            stats: RetrievalStats {
                index: built,
                ..RetrievalStats::default()
            },
        })
    }

    /// Per KV head of `layer` (its indexes `heads`), the mean value of each bucket of a
    /// bucket index (an error for other indexes). Reads every value once.
    fn bucket_means(
        &self,
        layer: usize,
        heads: &[Box<dyn KeyIndex>],
        d: usize,
        r: &Retrieval,
    ) -> Result<Vec<Vec<f32>>> {
        let n = self.manifest.tokens;
        let ids: Vec<u32> = (0..n as u32).collect();
        let mut per_head = Vec::with_capacity(heads.len());
        for (head, index) in heads.iter().enumerate() {
            let Some(buckets) = index.as_buckets() else {
                let spec = r.index.clone().map_or_else(|| self.default_index(), Ok)?;
                return Err(Error::NotBucketIndex {
                    spec: spec.to_string(),
                });
            };
            let (mut keys, mut values) = (Vec::new(), Vec::new());
            self.tier
                .gather(layer, head, &ids, &mut keys, &mut values)?;
            let mut sums = vec![0f64; buckets.buckets() * d];
            let mut counts = vec![0usize; buckets.buckets()];
            for (row, &b) in values.chunks_exact(d).zip(&buckets.assignments()) {
                counts[b as usize] += 1;
                for (s, v) in sums[b as usize * d..(b as usize + 1) * d]
                    .iter_mut()
                    .zip(row)
                {
                    *s += *v as f64;
                }
            }
            let means = sums
                .chunks_exact(d)
                .zip(&counts)
                .flat_map(|(s, &c)| s.iter().map(move |x| (x / c.max(1) as f64) as f32))
                .collect();
            per_head.push(means);
        }
        Ok(per_head)
    }

    /// Documents and passages ranked by the attention mass they received (sink excluded: it
    /// soaks up attention without carrying content).
    fn provenance(&self, model: ModelRef<'_>, mass: &[f64], sink: usize) -> Result<Provenance> {
        let total: f64 = mass.iter().skip(sink).sum();
        if total <= 0.0 {
            return Ok(Provenance::default());
        }
        let mut documents = Vec::new();
        let mut passages = Vec::new();
        let mut spans: Vec<(usize, String, Range<usize>)> = self
            .documents
            .iter()
            .map(|d| (d.number, d.title.clone(), d.tokens.clone()))
            .collect();
        if let Some(p) = &self.manifest.pending {
            spans.push((
                self.documents.len(),
                format!("{} (incomplete)", p.title),
                p.start..self.manifest.tokens,
            ));
        }
        for (number, title, tokens) in spans {
            let share = |r: Range<usize>| {
                mass[r.start.max(sink)..r.end.max(sink)].iter().sum::<f64>() / total
            };
            documents.push(DocumentShare {
                number,
                title: title.clone(),
                share: share(tokens.clone()),
            });
            let mut at = tokens.start;
            while at < tokens.end {
                let end = (at + PASSAGE_TOKENS).min(tokens.end);
                passages.push((number, title.clone(), at..end, share(at..end)));
                at = end;
            }
        }
        documents.sort_by(|a, b| b.share.total_cmp(&a.share));
        passages.sort_by(|a, b| b.3.total_cmp(&a.3));
        let passages = passages
            .into_iter()
            .take(5)
            .map(|(document, title, tokens, share)| {
                let text = model.tokenizer.decode(
                    &self.tokens[tokens.clone()],
                    kvdb_model::SpecialTokens::Skip,
                )?;
                Ok(PassageShare {
                    document,
                    title,
                    tokens,
                    share,
                    text,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Provenance {
            documents,
            passages,
        })
    }
}

/// What each search of a query's retrieval gets.
#[derive(Debug, Clone)]
struct Budget {
    /// The search's `k` and breadth override ([`Retrieval::breadth`]); its candidates are
    /// each position's ([`Budget::params`]).
    search: SearchParams,
    /// The dense part, excluded from the candidates.
    policy: DensePolicy,
    /// [`Retrieval::follow`].
    follow: usize,
}

impl Budget {
    /// The parameters of a search at `position` after `n` corpus tokens.
    fn params(&self, position: usize, n: usize, estimate: bool) -> SearchParams {
        SearchParams {
            candidates: self.policy_at(position, n).candidates(position),
            estimate,
            ..self.search.clone()
        }
    }

    /// The dense part at `position` after `n` corpus tokens: the tail is never indexed, so
    /// the window always covers it.
    fn policy_at(&self, position: usize, n: usize) -> DensePolicy {
        DensePolicy {
            sink: self.policy.sink,
            window: self.policy.window.max(position + 1 - n),
        }
    }

    /// How many of the `n` corpus tokens a search at `position` may select.
    fn eligible(&self, position: usize, n: usize) -> usize {
        let candidates = self.policy_at(position, n).candidates(position);
        candidates
            .end
            .min(n as u32)
            .saturating_sub(candidates.start) as usize
    }
}

/// A query's retrieval: what every search gets, and what they selected so far.
struct Retriever {
    budget: Budget,
    stats: RetrievalStats,
}

/// A sliding-window layer's stored window: pre-RoPE keys and values `[t, n_kv, d]` of the
/// positions `positions`.
#[derive(Debug)]
pub(crate) struct StoredWindow {
    pub(crate) layer: usize,
    pub(crate) keys: Tensor,
    pub(crate) values: Tensor,
    pub(crate) positions: Range<usize>,
}

/// A query's state at one KV head of a retrieval layer.
struct RetrievalHead<'c> {
    /// The tail's (question and answer so far) pre-RoPE keys and values.
    tail: DenseKv,
    searcher: Box<dyn Searcher + 'c>,
    /// With estimation, the mean value of every bucket `[buckets, head_dim]`.
    bucket_means: Option<Vec<f32>>,
    /// The corpus tokens after the ones the last step attended most ([`Retrieval::follow`]),
    /// which the next search's selection gains.
    followed: Vec<u32>,
}

/// How a query attends at one layer.
enum LayerState<'c> {
    /// Through [`FullAttention`]: sliding-window and dense layers, and every layer under
    /// full attention.
    Dense,
    /// Retrieval, per KV head.
    Retrieval(Vec<RetrievalHead<'c>>),
}

/// One query on a corpus (ARCHITECTURE's `Session`), made by [`Corpus::session`]: the
/// question checked and tokenised, the index it searches loaded. [`Session::answer`] runs
/// it; the per-step state it decodes with (`QueryState`) lives only while it answers.
#[derive(Debug)]
pub struct Session<'a> {
    corpus: &'a Corpus,
    model: ModelRef<'a>,
    options: &'a AskOptions,
    /// The question's tokens, as they follow the corpus.
    ids: Vec<u32>,
    /// The indexes it searches (`None` under full attention).
    set: Option<Arc<IndexSet>>,
}

impl Session<'_> {
    /// The question's tokens (template included).
    pub fn question_tokens(&self) -> usize {
        self.ids.len()
    }

    /// The spec of the index the question searches, as built (`None` under full
    /// attention).
    pub fn index_spec(&self) -> Option<String> {
        self.set.as_ref().map(|set| set.built_spec())
    }

    /// Decodes the answer on the model's device, streaming its text to `on_text`, and
    /// returns it with its provenance, retrieval statistics and timings.
    pub fn answer(self, on_text: &mut dyn FnMut(&str) -> Result<()>) -> Result<Answer> {
        let state = self.state()?;
        let started = Instant::now();
        let mut first_token = None;
        let mut stream = |piece: &str| {
            if first_token.is_none() {
                first_token = Some(started.elapsed().as_secs_f64());
            }
            on_text(piece)
        };
        let (generation, state) = self.corpus.generate(
            self.model,
            state,
            &self.options.mode,
            &self.ids,
            &self.options.generate,
            &mut stream,
        )?;
        let first = first_token.unwrap_or(generation.prefill_seconds);
        let decode = started.elapsed().as_secs_f64() - first;
        let (model, options, question) = (self.model, self.options, self.ids.len());
        (self.corpus).answer_of(model, options, question, generation, state, first, decode)
    }

    /// The question's fresh per-query state. Attention mass counts for provenance from its
    /// last token on, which produces the first answer token.
    fn state(&self) -> Result<QueryState<'_>> {
        let answer_from = Some(self.corpus.manifest.tokens + self.ids.len() - 1);
        let mode = &self.options.mode;
        #[allow(unused_mut)]
        let mut state =
            (self.corpus).query_state(self.model, mode, self.set.as_deref(), answer_from)?;
        #[cfg(feature = "gpu")]
        {
            state.profile = self.options.profile;
        }
        Ok(state)
    }
}

/// Questions answered together ([`Corpus::ask_together`]).
#[derive(Debug, Clone, Serialize)]
pub struct Together {
    /// The answers, in the order of the questions. Each one's first-token time counts from
    /// the start of the call; its decode seconds from its first token to its last.
    pub answers: Vec<Answer>,
    /// How the decode went: on a GPU the prompts' prefill, then the batched steps; on the
    /// CPU the answers one after another, a step per token.
    pub steps: BatchSteps,
}

impl Corpus {
    /// Answers several questions on this corpus together, in the order given, streaming
    /// answer `i`'s text as `on_text(i, piece)`. On a GPU the questions are prefilled one
    /// after another and the answers then decode as one batch: every step runs a token of
    /// each unfinished answer through the model at once, so the weights are read once for
    /// all of them, and each attends through its own retrieval (its own routing or search,
    /// its own provenance). On the CPU they are answered one after another.
    ///
    /// Where `on_text(i, ..)` returns [`Error::Abandoned`] (answer `i`'s reader went away),
    /// answer `i` stops as [`crate::StopReason::Abandoned`] and the others go on: on a GPU
    /// it leaves the batch at once; on the CPU it runs to its end unseen.
    pub fn ask_together(
        &self,
        model: ModelRef<'_>,
        questions: &[&str],
        options: &AskOptions,
        on_text: &mut dyn FnMut(usize, &str) -> Result<()>,
    ) -> Result<Together> {
        let sessions = questions
            .iter()
            .map(|question| self.session(model, question, options))
            .collect::<Result<Vec<_>>>()?;
        #[cfg(feature = "gpu")]
        if let Some(gpu) = model.gpu {
            let states = sessions
                .iter()
                .map(Session::state)
                .collect::<Result<Vec<_>>>()?;
            let ids: Vec<Vec<u32>> = sessions.iter().map(|s| s.ids.clone()).collect();
            let started = Instant::now();
            let mut firsts = vec![None; ids.len()];
            let mut stream = |i: usize, piece: &str| {
                firsts[i].get_or_insert_with(|| started.elapsed().as_secs_f64());
                on_text(i, piece)
            };
            let (results, steps) = crate::gpu_session::generate_together(
                self,
                model,
                gpu,
                states,
                &ids,
                &options.generate,
                &mut stream,
            )?;
            let answers = results
                .into_iter()
                .zip(firsts)
                .zip(&ids)
                .map(|(((generation, state), first), ids)| {
                    let first = first.unwrap_or(generation.prefill_seconds);
                    let decode = generation.decode_seconds;
                    self.answer_of(model, options, ids.len(), generation, state, first, decode)
                })
                .collect::<Result<Vec<_>>>()?;
            return Ok(Together { answers, steps });
        }
        let mut steps = BatchSteps::default();
        let answers = sessions
            .into_iter()
            .enumerate()
            .map(|(i, session)| {
                let gone = std::cell::Cell::new(false);
                let mut answer = session.answer(&mut |piece| {
                    crate::generate::unless_gone(&gone, || on_text(i, piece))
                })?;
                if gone.get() {
                    answer.stop = crate::StopReason::Abandoned;
                }
                steps.prefill_seconds += answer.timings.first_token_seconds;
                steps.decode_seconds += answer.timings.decode_seconds;
                let later = answer.tokens.len().saturating_sub(1);
                steps.steps += later;
                steps.tokens += later;
                Ok(answer)
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Together { answers, steps })
    }

    /// A question's answer from its generation and its state: provenance from the attention
    /// mass under retrieval, the retrieval statistics, and the timings (`first` seconds to
    /// the first token, `decode` from it to the last).
    #[allow(clippy::too_many_arguments)]
    fn answer_of(
        &self,
        model: ModelRef<'_>,
        options: &AskOptions,
        question_tokens: usize,
        generation: Generation,
        mut state: QueryState<'_>,
        first: f64,
        decode: f64,
    ) -> Result<Answer> {
        let provenance = match &options.mode {
            AttentionMode::Retrieval(r) => self.provenance(model, &state.mass, r.policy.sink)?,
            AttentionMode::Full => Provenance::default(),
        };
        let retrieval = state.retriever.take().map(|r| r.stats);
        let later = generation.tokens.len().saturating_sub(1);
        Ok(Answer {
            answer: generation.text,
            tokens: generation.tokens,
            stop: generation.stop,
            corpus_tokens: self.manifest.tokens,
            question_tokens,
            provenance,
            retrieval,
            timings: Timings {
                first_token_seconds: first,
                decode_seconds: decode,
                tokens_per_second: later as f64 / decode.max(1e-9),
                gpu_stage_seconds: std::mem::take(&mut state.gpu_stages),
            },
        })
    }
}

/// A retrieval layer's per-KV-head state for one query over its indexes `heads`: an empty
/// tail, a fresh searcher, and the bucket means when the query estimates.
fn retrieval_heads<'c>(
    heads: &'c [Box<dyn KeyIndex>],
    d: usize,
    means: Option<Vec<Vec<f32>>>,
) -> Result<Vec<RetrievalHead<'c>>> {
    let mut means = means.map(Vec::into_iter);
    heads
        .iter()
        .map(|index| {
            Ok(RetrievalHead {
                tail: DenseKv::new(Vec::new(), Vec::new(), d)?,
                searcher: index.searcher(),
                bucket_means: means.as_mut().and_then(Iterator::next),
                followed: Vec::new(),
            })
        })
        .collect()
}

/// One query's state, whatever device it runs on: how each layer attends, the retrieval
/// budget and statistics, and the attention mass the corpus received.
pub(crate) struct QueryState<'c> {
    pub(crate) corpus: &'c Corpus,
    /// Per layer of the model.
    layers: Vec<LayerState<'c>>,
    /// `None` under full attention.
    retriever: Option<Retriever>,
    /// Attention mass each corpus token received while answering.
    pub(crate) mass: Vec<f64>,
    /// Mass counts from this position on (`None`: not at all).
    answer_from: Option<usize>,
    /// The indexes the query retrieves through (what a GPU session routes with).
    #[cfg(feature = "gpu")]
    set: Option<&'c IndexSet>,
    /// Whether a GPU session times its stages ([`AskOptions::profile`]).
    #[cfg(feature = "gpu")]
    pub(crate) profile: bool,
    /// GPU seconds per stage, when profiled.
    pub(crate) gpu_stages: BTreeMap<&'static str, f64>,
}

impl<'c> QueryState<'c> {
    /// Whether `layer` retrieves (else it attends densely, or to the whole corpus).
    pub(crate) fn retrieves(&self, layer: usize) -> bool {
        self.retriever.is_some() && matches!(self.layers.get(layer), Some(LayerState::Retrieval(_)))
    }

    /// Whether the query attends to every key (no retrieval).
    #[cfg(feature = "gpu")]
    pub(crate) fn full_attention(&self) -> bool {
        self.retriever.is_none()
    }

    /// The dense part of a query at `position` (`None` under full attention).
    #[cfg(feature = "gpu")]
    pub(crate) fn policy_at(&self, position: usize) -> Option<DensePolicy> {
        let n = self.corpus.manifest.tokens;
        self.retriever
            .as_ref()
            .map(|r| r.budget.policy_at(position, n))
    }

    /// Whether the query estimates unvisited buckets.
    #[cfg(feature = "gpu")]
    pub(crate) fn estimates(&self) -> bool {
        self.layers.iter().any(|l| match l {
            LayerState::Retrieval(heads) => heads.iter().any(|h| h.bucket_means.is_some()),
            LayerState::Dense => false,
        })
    }

    /// How many of the most attended tokens the query follows ([`Retrieval::follow`]; 0:
    /// none).
    #[cfg(feature = "gpu")]
    pub(crate) fn follow(&self) -> usize {
        self.retriever.as_ref().map_or(0, |r| r.budget.follow)
    }

    /// Sets what each KV head of retrieval layer `layer` follows at the next step from its
    /// retrieved ids and the weights the GPU's attention gave them (`[kv head]`), as the
    /// CPU's attention does from its own ([`Retrieval::follow`]).
    #[cfg(feature = "gpu")]
    pub(crate) fn follow_weighted(
        &mut self,
        layer: usize,
        weighted: Vec<Vec<(f32, u32)>>,
        n: usize,
    ) -> Result<()> {
        let follow = self.retriever.as_ref().map_or(0, |r| r.budget.follow);
        let Some(LayerState::Retrieval(heads)) = self.layers.get_mut(layer) else {
            return Err(Error::Internal(format!("layer {layer} does not retrieve")));
        };
        for (head, weighted) in heads.iter_mut().zip(weighted) {
            head.followed = successors_of_most_attended(weighted, follow, n);
        }
        Ok(())
    }

    /// A retrieval layer's chunk: its keys and values join the tail, and every KV head's
    /// searcher selects per token (`[kv head][token]`), counted in the statistics. `None` for
    /// a layer that does not retrieve.
    pub(crate) fn select(&mut self, step: &Step<'_>) -> Result<Option<Vec<Vec<Found>>>> {
        let (Some(LayerState::Retrieval(heads)), Some(retriever)) =
            (self.layers.get_mut(step.layer), self.retriever.as_mut())
        else {
            return Ok(None);
        };
        for i in 0..step.t {
            for (g, head) in heads.iter_mut().enumerate() {
                head.tail
                    .push(step.row(&step.keys, i, g), step.row(&step.values, i, g))?;
            }
        }
        let started = Instant::now();
        let found = search(heads, &retriever.budget, step)?;
        retriever.stats.search_seconds += started.elapsed().as_secs_f64();
        record(&mut retriever.stats, &found, &retriever.budget, step);
        Ok(Some(found))
    }

    /// Counts `seconds` of waiting for a GPU's queries in the statistics.
    #[cfg(feature = "gpu")]
    pub(crate) fn add_transfer(&mut self, seconds: f64) {
        if let Some(r) = self.retriever.as_mut() {
            r.stats.transfer_seconds += seconds;
        }
    }

    /// Whether attention at `position` counts for provenance.
    #[cfg(feature = "gpu")]
    pub(crate) fn counts_mass_at(&self, position: usize) -> bool {
        self.answer_from.is_some_and(|from| position >= from)
    }

    /// The indexes the query retrieves through (`None` under full attention).
    #[cfg(feature = "gpu")]
    pub(crate) fn index_set(&self) -> Option<&'c IndexSet> {
        self.set
    }

    /// The query's breadth override ([`Retrieval::breadth`]).
    #[cfg(feature = "gpu")]
    pub(crate) fn breadth(&self) -> Option<usize> {
        self.retriever
            .as_ref()
            .and_then(|r| r.budget.search.breadth)
    }

    /// Counts one token's searches at a layer whose buckets were routed elsewhere (on a
    /// GPU): one search per KV head of `scored` scores each, over the eligible keys at
    /// `position`. What they selected is counted by [`QueryState::add_selected`].
    #[cfg(feature = "gpu")]
    pub(crate) fn record_routed(&mut self, position: usize, kv_heads: usize, scored: usize) {
        let n = self.corpus.manifest.tokens;
        if let Some(r) = self.retriever.as_mut() {
            r.stats.searches += kv_heads;
            r.stats.scored += kv_heads * scored;
            r.stats.eligible += kv_heads * r.budget.eligible(position, n);
        }
    }

    /// Counts `selected` keys of searches routed elsewhere.
    #[cfg(feature = "gpu")]
    pub(crate) fn add_selected(&mut self, selected: usize) {
        if let Some(r) = self.retriever.as_mut() {
            r.stats.selected += selected;
        }
    }

    /// Adds attention mass each corpus token received, computed elsewhere (on a GPU).
    #[cfg(feature = "gpu")]
    pub(crate) fn add_mass(&mut self, mass: &[f32]) {
        for (total, &m) in self.mass.iter_mut().zip(mass) {
            *total += f64::from(m);
        }
    }

    /// The CPU's attention of a retrieval layer's chunk over its selections `found`; the
    /// mass the corpus received counts for provenance.
    pub(crate) fn attend(
        &mut self,
        step: &Step<'_>,
        found: &[Vec<Found>],
    ) -> Result<ChunkAttention> {
        let started = Instant::now();
        let attended = {
            let (rows, budget) = self.head_rows(step.layer)?;
            attend_selected(self.corpus, &rows, &budget, step, found)?
        };
        self.count_attention(started);
        if let Some(from) = self.answer_from {
            attended.add_mass(from, step, &mut self.mass);
        }
        let follow = self.retriever.as_ref().map_or(0, |r| r.budget.follow);
        if let (true, Some(LayerState::Retrieval(heads))) =
            (follow > 0, self.layers.get_mut(step.layer))
        {
            // The chunk's last token decides what the next step follows.
            let last = step.t - 1;
            for (g, head) in heads.iter_mut().enumerate() {
                let weighted = retrieved_weights(
                    &attended.0[last * step.n_kv + g],
                    &found[g][last].selection,
                    step.group,
                );
                head.followed = successors_of_most_attended(weighted, follow, step.n);
            }
        }
        Ok(attended)
    }

    /// What a retrieval layer's CPU attention reads besides the corpus, and the budget.
    fn head_rows(&self, layer: usize) -> Result<(HeadRows<'_>, Budget)> {
        let (Some(LayerState::Retrieval(heads)), Some(retriever)) =
            (self.layers.get(layer), self.retriever.as_ref())
        else {
            return Err(Error::Internal(format!("layer {layer} does not retrieve")));
        };
        let rows = HeadRows {
            tails: heads.iter().map(|head| &head.tail).collect(),
            means: heads.iter().map(|h| h.bucket_means.as_deref()).collect(),
        };
        Ok((rows, retriever.budget.clone()))
    }

    fn count_attention(&mut self, started: Instant) {
        if let Some(r) = self.retriever.as_mut() {
            r.stats.cpu_attention_seconds += started.elapsed().as_secs_f64();
        }
    }
}

/// Each KV head's tail and bucket means (with estimation) at a retrieval layer: what its
/// CPU attention reads besides the corpus. The searchers stay behind, so that these can be
/// shared between threads.
struct HeadRows<'s> {
    tails: Vec<&'s DenseKv>,
    means: Vec<Option<&'s [f32]>>,
}

/// The CPU's query state: the shared [`QueryState`] for retrieval layers, [`FullAttention`]
/// (stored windows preloaded, and every corpus token under full attention) for the others.
struct CpuSession<'c> {
    session: QueryState<'c>,
    full: FullAttention,
}

/// Corpus rows through the RAM tier, tail rows from memory.
struct SessionSource<'a> {
    tier: &'a RamTier,
    layer: usize,
    head: usize,
    corpus_tokens: usize,
    tail: &'a DenseKv,
}

impl KvSource for SessionSource<'_> {
    fn gather(
        &self,
        ids: &[u32],
        keys: &mut Vec<f32>,
        values: &mut Vec<f32>,
    ) -> kvdb_attention::Result<()> {
        // Rows come back in the order of `ids`: each run of corpus (or tail) ids goes to its
        // side in one call.
        let n = self.corpus_tokens as u32;
        let mut rest = ids;
        while let Some(&first) = rest.first() {
            let in_corpus = first < n;
            let run = rest.iter().take_while(|&&id| (id < n) == in_corpus).count();
            let (now, later) = rest.split_at(run);
            if in_corpus {
                self.tier
                    .gather(self.layer, self.head, now, keys, values)
                    .map_err(|e| kvdb_attention::AttentionError::Source(Box::new(e)))?;
            } else {
                let shifted: Vec<u32> = now.iter().map(|&id| id - n).collect();
                self.tail.gather(&shifted, keys, values)?;
            }
            rest = later;
        }
        Ok(())
    }
}

impl AttentionBackend for CpuSession<'_> {
    fn attend(&mut self, input: &AttentionInput<'_>) -> kvdb_model::Result<Tensor> {
        let layer = input.layer.index;
        if !self.session.retrieves(layer) {
            return self.full.attend(input);
        }
        let session = &mut self.session;
        Step::new(input, session.corpus.manifest.tokens)
            .and_then(|step| {
                let found = session.select(&step)?.unwrap_or_default();
                session
                    .attend(&step, &found)?
                    .output(&step, input.queries.device())
            })
            .map_err(|e| backend_failed(layer, e))
    }
}

/// `e`, raised by kvdb's attention inside the model's forward pass, as the model reports it;
/// [`Error`]'s conversion from the model's error takes `e` back out.
pub(crate) fn backend_failed(layer: usize, e: Error) -> kvdb_model::ModelError {
    kvdb_model::ModelError::BackendFailed {
        layer,
        source: Box::new(e),
    }
}

/// A retrieval layer's input for a chunk of query tokens, as flat host rows.
pub(crate) struct Step<'a> {
    pub(crate) layer: usize,
    /// The position of the chunk's first token.
    first: usize,
    scale: f32,
    rope: &'a Rope,
    /// Query tokens, query heads, head dim, KV heads, query heads per KV head.
    pub(crate) t: usize,
    h: usize,
    d: usize,
    n_kv: usize,
    group: usize,
    /// Corpus tokens.
    n: usize,
    /// Pre-RoPE queries `[t, h, d]`, keys and values `[t, n_kv, d]`.
    queries: Vec<f32>,
    keys: Vec<f32>,
    values: Vec<f32>,
}

/// Where a [`Step`] is: its layer, the position of its first token, and the layer's
/// attention scale and RoPE.
pub(crate) struct StepPlace<'a> {
    pub(crate) layer: usize,
    pub(crate) first: usize,
    pub(crate) scale: f32,
    pub(crate) rope: &'a Rope,
}

impl<'a> Step<'a> {
    fn new(input: &AttentionInput<'a>, n: usize) -> Result<Self> {
        let (t, h, d) = input.queries.dims3()?;
        let n_kv = input.keys.dim(1)?;
        let rows = |x: &Tensor| -> Result<Vec<f32>> { Ok(x.flatten_all()?.to_vec1()?) };
        let place = StepPlace {
            layer: input.layer.index,
            first: input.positions.start,
            scale: input.scale,
            rope: input.rope,
        };
        Self::from_rows(
            place,
            (t, h, n_kv, d),
            n,
            rows(input.queries)?,
            rows(input.keys)?,
            rows(input.values)?,
        )
    }

    /// A step of `t` tokens from host rows: pre-RoPE `queries` `[t, h, d]`, `keys` and
    /// `values` `[t, n_kv, d]`, after `n` corpus tokens.
    pub(crate) fn from_rows(
        place: StepPlace<'a>,
        (t, h, n_kv, d): (usize, usize, usize, usize),
        n: usize,
        queries: Vec<f32>,
        keys: Vec<f32>,
        values: Vec<f32>,
    ) -> Result<Self> {
        if n_kv == 0
            || !h.is_multiple_of(n_kv)
            || queries.len() != t * h * d
            || keys.len() != t * n_kv * d
            || values.len() != keys.len()
        {
            return Err(Error::Internal(format!(
                "a step of {t} tokens, {h} heads, {n_kv} KV heads of {d} got {} query, {} key and {} value floats",
                queries.len(), keys.len(), values.len()
            )));
        }
        Ok(Self {
            layer: place.layer,
            first: place.first,
            scale: place.scale,
            rope: place.rope,
            t,
            h,
            d,
            n_kv,
            group: h / n_kv,
            n,
            queries,
            keys,
            values,
        })
    }

    pub(crate) fn position(&self, i: usize) -> usize {
        self.first + i
    }

    /// The queries of KV head `g`'s group at token `i`, `[group, d]`.
    fn group_queries(&self, i: usize, g: usize) -> &[f32] {
        let (h, d, group) = (self.h, self.d, self.group);
        &self.queries[(i * h + g * group) * d..(i * h + (g + 1) * group) * d]
    }

    /// Token `i`'s key or value row of KV head `g`.
    fn row<'r>(&self, rows: &'r [f32], i: usize, g: usize) -> &'r [f32] {
        let at = (i * self.n_kv + g) * self.d;
        &rows[at..at + self.d]
    }
}

/// What one retrieval layer attended to for a chunk: per (token, KV head), in token-major
/// order.
pub(crate) struct ChunkAttention(Vec<Attended>);

impl ChunkAttention {
    /// Adds the attention the corpus tokens received from positions `from` on to `mass`.
    fn add_mass(&self, from: usize, step: &Step<'_>, mass: &mut [f64]) {
        for (j, attended) in self.0.iter().enumerate() {
            if step.position(j / step.n_kv) < from {
                continue;
            }
            let m = attended.ids.len();
            for (k, &id) in attended.ids.iter().enumerate() {
                if (id as usize) < step.n {
                    let w: f32 = (0..step.group).map(|hh| attended.weights[hh * m + k]).sum();
                    mass[id as usize] += w as f64;
                }
            }
        }
    }

    /// The layer's output `[t, h, d]`.
    fn output(&self, step: &Step<'_>, device: &candle_core::Device) -> Result<Tensor> {
        let mut out = Vec::with_capacity(step.t * step.h * step.d);
        for attended in &self.0 {
            out.extend_from_slice(&attended.output);
        }
        Ok(Tensor::from_vec(out, (step.t, step.h, step.d), device)?)
    }
}

/// Every KV head's selections, `[kv head][token]`: searches run in token order per KV head (a
/// searcher may carry state from one step to the next), KV heads in parallel.
fn search(
    heads: &mut [RetrievalHead<'_>],
    budget: &Budget,
    step: &Step<'_>,
) -> Result<Vec<Vec<Found>>> {
    heads
        .par_iter_mut()
        .enumerate()
        .map(|(g, head)| {
            let estimate = head.bucket_means.is_some();
            (0..step.t)
                .map(|i| {
                    let position = step.position(i);
                    let query = GroupQuery {
                        queries: step.group_queries(i, g),
                        position,
                    };
                    let params = budget.params(position, step.n, estimate);
                    let found = head.searcher.search(&query, &params)?;
                    Ok(with_followed(found, &head.followed, &params.candidates))
                })
                .collect::<Result<Vec<_>>>()
        })
        .collect()
}

/// `found` with the `followed` ids among `candidates` added to its selection (nothing is
/// scored for them).
fn with_followed(mut found: Found, followed: &[u32], candidates: &Range<u32>) -> Found {
    for &id in followed.iter().filter(|id| candidates.contains(id)) {
        found.selection.insert(id);
    }
    found
}

/// The ids of `selection` (the retrieved ids, not the dense part) that `attended` weighed,
/// with their weight summed over the group's heads.
fn retrieved_weights(attended: &Attended, selection: &Selection, group: usize) -> Vec<(f32, u32)> {
    let m = attended.ids.len();
    attended
        .ids
        .iter()
        .enumerate()
        .filter(|(_, &id)| selection.contains(id))
        .map(|(k, &id)| ((0..group).map(|h| attended.weights[h * m + k]).sum(), id))
        .collect()
}

/// The tokens after the `count` retrieved ids of `weighted` (id and weight) that were weighed
/// most, ties to the lower id, inside a corpus of `n` tokens (the tail after it is attended
/// densely anyway): what a KV head's next selection gains ([`Retrieval::follow`]), on the CPU
/// and the GPU alike.
fn successors_of_most_attended(mut weighted: Vec<(f32, u32)>, count: usize, n: usize) -> Vec<u32> {
    let order = |a: &(f32, u32), b: &(f32, u32)| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1));
    // A selection holds thousands of ids (whole buckets) and a step follows a few: the
    // `count` first found in linear time, then only they sorted.
    if count == 0 {
        return Vec::new();
    }
    if count < weighted.len() {
        weighted.select_nth_unstable_by(count - 1, order);
        weighted.truncate(count);
    }
    weighted.sort_by(order);
    weighted
        .into_iter()
        .take(count)
        .filter_map(|(_, id)| id.checked_add(1))
        .filter(|&id| (id as usize) < n)
        .collect()
}

/// Adds a chunk's searches to the query's statistics.
fn record(stats: &mut RetrievalStats, found: &[Vec<Found>], budget: &Budget, step: &Step<'_>) {
    let n = step.n;
    for i in 0..step.t {
        let position = step.position(i);
        let eligible = budget.eligible(position, n);
        for per_head in found {
            stats.searches += 1;
            stats.scored += per_head[i].scored;
            stats.selected += per_head[i].selection.len();
            stats.eligible += eligible;
        }
    }
}

/// Each (token, KV head)'s attention over its selection and the dense part, merged, with the
/// estimate of unvisited buckets where the query asked for one.
fn attend_selected(
    corpus: &Corpus,
    rows: &HeadRows<'_>,
    budget: &Budget,
    step: &Step<'_>,
    found: &[Vec<Found>],
) -> Result<ChunkAttention> {
    let HeadRows { tails, means } = rows;
    let jobs: Vec<(usize, usize)> = (0..step.t)
        .flat_map(|i| (0..step.n_kv).map(move |g| (i, g)))
        .collect();
    let attended = jobs
        .par_iter()
        .map(|&(i, g)| -> Result<_> {
            let position = step.position(i);
            let found = &found[g][i];
            let estimate = match means[g] {
                Some(means) => Some(Estimate::new(
                    &found.unvisited,
                    means,
                    step.group,
                    step.d,
                    step.scale,
                )?),
                None => None,
            };
            let source = SessionSource {
                tier: &corpus.tier,
                layer: step.layer,
                head: g,
                corpus_tokens: step.n,
                tail: tails[g],
            };
            Ok(attend(
                &RetrievalQuery {
                    queries: step.group_queries(i, g),
                    position,
                    rope: step.rope,
                    scale: step.scale,
                    policy: budget.policy_at(position, step.n),
                    selection: &found.selection,
                    estimate: estimate.as_ref(),
                },
                &source,
            )?)
        })
        .collect::<Result<Vec<_>>>()?;
    Ok(ChunkAttention(attended))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_most_attended_retrieved_tokens_are_followed() {
        // Dense part 0 and 1 (the sink takes most of the weight), retrieved 10, 20, 30; two
        // query heads. Summed over the heads: 10 → 0.5, 20 → 0.25, 30 → 0.5 (a tie, to 10).
        let attended = Attended {
            output: Vec::new(),
            ids: vec![0, 1, 10, 20, 30],
            weights: vec![
                0.9, 0.0, 0.05, 0.05, 0.0, //
                0.1, 0.0, 0.45, 0.2, 0.5,
            ],
        };
        let selection = Selection::new(vec![10, 20, 30]);
        let weighted = retrieved_weights(&attended, &selection, 2);
        let follow = |count, n| successors_of_most_attended(weighted.clone(), count, n);
        assert_eq!(follow(2, 100), vec![11, 31]);
        assert_eq!(follow(9, 100), vec![11, 31, 21]);
        assert!(follow(0, 100).is_empty());
        // A successor past the corpus is the tail's, attended densely: not followed.
        assert_eq!(follow(9, 31), vec![11, 21]);
        // Many ids with ties: the same as sorting them all.
        let many: Vec<(f32, u32)> = (0..5_000u32)
            .map(|id| ((id.wrapping_mul(2_654_435_761) % 97) as f32, id))
            .collect();
        let mut sorted = many.clone();
        sorted.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
        for count in [1, 8, 200, 4_999, 5_000] {
            let want: Vec<u32> = sorted[..count].iter().map(|&(_, id)| id + 1).collect();
            assert_eq!(
                successors_of_most_attended(many.clone(), count, 10_000),
                want
            );
        }
    }

    #[test]
    fn followed_ids_join_the_selection_inside_the_candidates_only() {
        let found = Found {
            selection: Selection::new(vec![5, 9]),
            scored: 7,
            unvisited: Vec::new(),
        };
        // 10 joins; 9 is already there; 2 is in the sink, 40 in the window.
        let with = with_followed(found, &[10, 9, 2, 40], &(4..30));
        assert_eq!(with.selection.ids(), &[5, 9, 10]);
        assert_eq!(with.scored, 7, "following scores nothing");
    }
}
