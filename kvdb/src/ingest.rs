//! Ingest: documents appended in order to a corpus's context, prefilled in chunks with exact
//! attention over everything before, and committed chunk by chunk.
//!
//! Every chunk attends to the *stored* keys and values (rounded to f16 exactly as the store
//! keeps them), and chunk boundaries are fixed relative to each document's first token, so
//! an ingest resumed after a crash, or one appended later, computes bit for bit what one
//! uninterrupted run does. Chunks are committed in batches (one chunk each on the CPU; a few
//! on a GPU, by a committer thread while the model prefills the next ones): their key/value
//! blocks, their tokens and the manifest (the commit point) with the interrupted document's
//! progress, so a crash loses at most the chunks not yet committed.

use std::collections::HashMap;
use std::ops::{ControlFlow, Range};
use std::sync::mpsc;
use std::time::Instant;

use half::f16;
use kvdb_model::{
    EncodeOptions, Forward, Logits, Model, ModelConfig, SampledQueries, SequenceOptions, Tokenizer,
};
use rayon::prelude::*;

use crate::documents::SourceDocument;
use crate::error::{Error, Result};
use crate::store::{
    validate_corpus_name, Batch, BlockKey, CorpusManifest, DocumentRecord, Kv, LayerPolicy,
    ModelRecord, PendingDocument, PrefillRecord, QueryKey, Store, DEFAULT_BLOCK_SIZE,
    QUERY_SAMPLE_STRIDE,
};

/// Tokens prefilled (and committed) per step on the CPU, counted from each document's first
/// token; a new corpus takes its device's chunk ([`Forward::prefill_chunk`]) and keeps it
/// (`CorpusManifest::prefill`).
pub const INGEST_CHUNK: usize = kvdb_model::CPU_PREFILL_CHUNK;

/// Appended after every document so that documents (and the question after the corpus) do
/// not run together.
pub const DOCUMENT_SEPARATOR: &str = "\n\n";

/// What an ingest reports as it goes.
#[derive(Debug, Clone)]
pub enum IngestEvent<'a> {
    /// The plan, before any work: documents to add and their tokens.
    Planned {
        /// Documents that will be added (or finished).
        documents: usize,
        /// Their tokens still to prefill.
        tokens: usize,
    },
    /// One more layer of what the corpus holds is loaded into the model's state: an ingest
    /// that appends to a corpus (or resumes one) first loads every layer's stored keys and
    /// values, tens of GB at a million tokens.
    Loaded {
        /// Layers loaded so far.
        layers: usize,
        /// Layers to load.
        of: usize,
        /// Tokens in the corpus.
        tokens: usize,
    },
    /// A document is skipped.
    Skipped {
        /// Its title.
        title: &'a str,
        /// Why.
        reason: String,
    },
    /// A document starts (or resumes).
    Started {
        /// Its title.
        title: &'a str,
        /// Its tokens.
        tokens: usize,
        /// Tokens of it already stored by an interrupted ingest.
        resumed_at: usize,
    },
    /// A chunk is committed.
    Committed {
        /// The document's title.
        title: &'a str,
        /// Tokens of the document stored so far.
        done: usize,
        /// Its tokens.
        total: usize,
        /// Tokens in the corpus now.
        corpus_tokens: usize,
        /// Tokens in this chunk.
        chunk: usize,
    },
}

/// What an ingest did.
#[derive(Debug, Clone, Default)]
pub struct IngestReport {
    /// Titles of the documents added.
    pub added: Vec<String>,
    /// Titles skipped, with the reason.
    pub skipped: Vec<(String, String)>,
    /// Tokens prefilled.
    pub tokens: usize,
    /// Seconds spent prefilling and committing.
    pub seconds: f64,
    /// Of those, seconds the ingest waited for the store: commits that the model's work did
    /// not hide (all of them on the CPU, where each chunk is committed before the next) and
    /// the deletions and flush that end an ingest.
    pub store_seconds: f64,
    /// Tokens in the corpus afterwards.
    pub corpus_tokens: usize,
}

/// The record of `model` for a corpus manifest.
pub(crate) fn model_record(config: &ModelConfig, sha256: &str, fallback_name: &str) -> ModelRecord {
    ModelRecord {
        sha256: sha256.to_string(),
        name: config
            .name
            .clone()
            .unwrap_or_else(|| fallback_name.to_string()),
        architecture: config.architecture.gguf_name().to_string(),
        n_layers: config.n_layers(),
        n_heads: config.n_heads,
        n_kv_heads: config.n_kv_heads,
        head_dim: config.head_dim,
        context_length: config.context_length,
    }
}

/// Checks that `manifest` was made with the model `record` describes.
pub fn check_model(manifest: &CorpusManifest, record: &ModelRecord) -> Result<()> {
    if manifest.model.sha256 != record.sha256 {
        return Err(Error::ModelMismatch {
            corpus: manifest.name.clone(),
            expected_name: manifest.model.name.clone(),
            expected: manifest.model.sha256.clone(),
            found: record.sha256.clone(),
        });
    }
    Ok(())
}

/// The model an ingest or query runs, with what identifies it.
#[derive(Debug, Clone, Copy)]
pub struct ModelRef<'a> {
    /// Weights.
    pub model: &'a Model,
    /// The same weights on a GPU, when loaded there: ingest and generation run on it.
    #[cfg(feature = "gpu")]
    pub gpu: Option<&'a kvdb_model::GpuModel>,
    /// Tokenizer.
    pub tokenizer: &'a Tokenizer,
    /// Its manifest record (hash, config).
    pub record: &'a ModelRecord,
}

impl<'a> ModelRef<'a> {
    /// A fresh sequence state (the model with an empty KV cache) on the model's device.
    pub fn sequence(&self, options: &SequenceOptions) -> Result<Box<dyn Forward + 'a>> {
        #[cfg(feature = "gpu")]
        if let Some(gpu) = self.gpu {
            return Ok(gpu.sequence(options)?);
        }
        Ok(Box::new(self.model.sequence(options)?))
    }

    /// Tokens per ingest step on the model's device.
    pub fn prefill_chunk(&self) -> usize {
        #[cfg(feature = "gpu")]
        if self.gpu.is_some() {
            return kvdb_model::GPU_MAX_CHUNK;
        }
        INGEST_CHUNK
    }

    /// Where the forward pass runs.
    pub fn device(&self) -> &'static str {
        #[cfg(feature = "gpu")]
        if self.gpu.is_some() {
            return "cuda";
        }
        "cpu"
    }
}

/// Appends `documents` to corpus `name` (created when absent), calling `on_event` as it goes.
pub fn ingest(
    store: &Store,
    name: &str,
    model: ModelRef<'_>,
    documents: &[SourceDocument],
    on_event: &mut dyn FnMut(IngestEvent<'_>),
) -> Result<IngestReport> {
    ingest_until(store, name, model, documents, &mut |event| {
        on_event(event);
        ControlFlow::Continue(())
    })
}

/// [`ingest`] that the caller can stop: every event but `Skipped` comes at a commit point
/// (before any write, before a document, after a chunk's commit), and `on_event` returning
/// `Break` there stops the ingest with [`Error::Cancelled`], keeping what was committed (an
/// interrupted document resumes when the same documents are ingested again). On a GPU the
/// chunks already prefilled when it stops are committed too.
pub fn ingest_until(
    store: &Store,
    name: &str,
    model: ModelRef<'_>,
    documents: &[SourceDocument],
    on_event: &mut dyn FnMut(IngestEvent<'_>) -> ControlFlow<()>,
) -> Result<IngestReport> {
    validate_corpus_name(name)?;
    let manifest = open_corpus(store, name, model)?;
    let mut report = IngestReport::default();
    let planned = plan(store, &manifest, model, documents, &mut report, on_event)?;
    let tokens = planned
        .iter()
        .map(|p| p.first + p.tokens.len() - p.first.max(manifest.tokens))
        .sum();
    if on_event(IngestEvent::Planned {
        documents: planned.len(),
        tokens,
    })
    .is_break()
    {
        return Err(cancelled(&manifest));
    }
    if planned.is_empty() {
        report.corpus_tokens = manifest.tokens;
        return Ok(report);
    }
    let started = Instant::now();
    let committed = prefill_and_commit(store, &manifest, model, &planned, on_event, &mut report)?;
    let garbage = Instant::now();
    collect_garbage(store, &committed)?;
    // Every chunk is durable already; writing the memtables out lets RocksDB delete the
    // write-ahead log, so a store at rest keeps none to replay or to grow.
    store.flush()?;
    report.store_seconds += garbage.elapsed().as_secs_f64();
    report.seconds = started.elapsed().as_secs_f64();
    report.corpus_tokens = committed.tokens;
    Ok(report)
}

/// The error of an ingest stopped by its caller, with what `committed` holds.
fn cancelled(committed: &CorpusManifest) -> Error {
    Error::Cancelled {
        corpus: committed.name.clone(),
        tokens: committed.tokens,
    }
}

/// Corpus `name`'s manifest, or a new corpus's (created by its first commit, so that a
/// failed plan writes nothing), checked against `model` and marked with its device.
fn open_corpus(store: &Store, name: &str, model: ModelRef<'_>) -> Result<CorpusManifest> {
    let mut manifest = match store.manifest(name) {
        Ok(m) => m,
        Err(Error::CorpusMissing { .. }) => CorpusManifest {
            format_version: crate::store::FORMAT_VERSION,
            name: name.to_string(),
            id: 0,
            model: model.record.clone(),
            block_size: DEFAULT_BLOCK_SIZE,
            layers: LayerPolicy::for_model(model.model.config()),
            indexes: vec!["flat".to_string()],
            tokens: 0,
            documents: 0,
            pending: None,
            prefill: PrefillRecord {
                device: model.device().into(),
                chunk: model.prefill_chunk(),
            },
        },
        Err(e) => return Err(e),
    };
    check_model(&manifest, model.record)?;
    manifest.prefill.device = model.device().into();
    Ok(manifest)
}

/// A document an ingest adds (or finishes): its tokens and where they start in the corpus.
struct PlannedDocument<'d> {
    doc: &'d SourceDocument,
    first: usize,
    tokens: Vec<u32>,
}

/// The plan: which documents to add, in which order (an interrupted one first), with their
/// tokens. Documents already in the corpus, or given twice, are skipped (reported in
/// `report` and to `on_event`). Writes nothing.
fn plan<'d>(
    store: &Store,
    manifest: &CorpusManifest,
    model: ModelRef<'_>,
    documents: &'d [SourceDocument],
    report: &mut IngestReport,
    on_event: &mut dyn FnMut(IngestEvent<'_>) -> ControlFlow<()>,
) -> Result<Vec<PlannedDocument<'d>>> {
    let existing = if manifest.id == 0 {
        Vec::new()
    } else {
        store.documents(manifest)?
    };
    let mut known: HashMap<&str, String> = existing
        .iter()
        .map(|d| {
            (
                d.sha256.as_str(),
                format!("already in the corpus as `{}`", d.title),
            )
        })
        .collect();
    let mut plan: Vec<&SourceDocument> = Vec::new();
    for doc in documents {
        if let Some(reason) = known.get(doc.sha256.as_str()) {
            report.skipped.push((doc.title.clone(), reason.clone()));
            // Planning writes nothing, so a stop here is as good as one at the plan.
            let _ = on_event(IngestEvent::Skipped {
                title: &doc.title,
                reason: reason.clone(),
            });
            continue;
        }
        known.insert(&doc.sha256, format!("the same content as `{}`", doc.title));
        plan.push(doc);
    }
    if let Some(pending) = &manifest.pending {
        match plan.iter().position(|d| d.sha256 == pending.sha256) {
            Some(i) => {
                let doc = plan.remove(i);
                plan.insert(0, doc);
            }
            None => {
                return Err(Error::Interrupted {
                    corpus: manifest.name.clone(),
                    title: pending.title.clone(),
                    done: manifest.tokens - pending.start,
                    total: pending.total,
                })
            }
        }
    }
    let context = model.model.config().context_length;
    let mut first = manifest
        .pending
        .as_ref()
        .map_or(manifest.tokens, |p| p.start);
    let mut planned = Vec::with_capacity(plan.len());
    for doc in plan {
        let tokens = document_tokens(model.tokenizer, &doc.text, first == 0)?;
        let end = first + tokens.len();
        if end > context {
            return Err(Error::ContextOverflow {
                corpus: manifest.name.clone(),
                what: format!("`{}` ({} tokens)", doc.title, tokens.len()),
                tokens: end,
                context,
            });
        }
        planned.push(PlannedDocument { doc, first, tokens });
        first = end;
    }
    Ok(planned)
}

/// Tokens of `planned` already stored by an interrupted ingest (0 unless it is that one).
fn resumed_at(
    store: &Store,
    manifest: &CorpusManifest,
    planned: &PlannedDocument,
) -> Result<usize> {
    match &manifest.pending {
        Some(p) if p.sha256 == planned.doc.sha256 => {
            let stored = store.tokens(manifest, planned.first..manifest.tokens)?;
            if p.total != planned.tokens.len() || !planned.tokens.starts_with(&stored) {
                return Err(Error::Corrupt(format!(
                    "the interrupted document `{}` no longer tokenizes as it did",
                    planned.doc.title
                )));
            }
            Ok(stored.len())
        }
        _ => Ok(0),
    }
}

/// Why the chunk loop ended before the plan did.
enum Halt {
    /// The caller stopped it.
    Stopped,
    Failed(Error),
}

/// Prefills the planned documents chunk by chunk and commits them, telling `on_event` of
/// each document's start and each committed chunk; returns the corpus as committed.
fn prefill_and_commit(
    store: &Store,
    manifest: &CorpusManifest,
    model: ModelRef<'_>,
    planned: &[PlannedDocument<'_>],
    on_event: &mut dyn FnMut(IngestEvent<'_>) -> ControlFlow<()>,
    report: &mut IngestReport,
) -> Result<CorpusManifest> {
    let chunk_size = manifest.prefill.chunk.max(1);
    let mut prefiller = Prefiller::open(store, manifest, model, on_event)?;
    // On a device that runs ahead (a GPU), the store commits on a thread of its own while the
    // model prefills the next chunks, a few chunks a commit; on the CPU, whose chunks take
    // far longer than their commit, every chunk is committed before the next starts, so an
    // ingest stopped at a commit stops right there.
    let pipelined = prefiller.sequence.runs_ahead();
    let commit_every = if pipelined {
        PIPELINED_COMMIT_CHUNKS
    } else {
        1
    };
    std::thread::scope(|scope| -> Result<CorpusManifest> {
        let (jobs, queue) = mpsc::sync_channel::<Job>(1);
        let (acks, acked) = mpsc::channel::<Vec<ChunkDone>>();
        let committer = scope.spawn({
            let manifest = manifest.clone();
            move || Committer::open(store, manifest)?.run(queue, acks, commit_every)
        });
        // The committer's error when it stopped (its channels close with it).
        let failed =
            |committer: std::thread::ScopedJoinHandle<'_, Result<CorpusManifest>>| match committer
                .join()
            {
                Ok(Err(e)) => e,
                Ok(Ok(_)) => {
                    Error::Internal("the store's committer stopped early without an error".into())
                }
                Err(panic) => std::panic::resume_unwind(panic),
            };
        let mut waited = 0.0;
        let titles: Vec<&str> = planned.iter().map(|p| p.doc.title.as_str()).collect();
        let mut halt = None;
        'documents: for (index, planned_doc) in planned.iter().enumerate() {
            let PlannedDocument { doc, first, tokens } = planned_doc;
            let resumed_at = match resumed_at(store, manifest, planned_doc) {
                Ok(at) => at,
                Err(e) => {
                    halt = Some(Halt::Failed(e));
                    break;
                }
            };
            if on_event(IngestEvent::Started {
                title: &doc.title,
                tokens: tokens.len(),
                resumed_at,
            })
            .is_break()
            {
                halt = Some(Halt::Stopped);
                break;
            }
            for PlannedChunk { chunk, next, done } in
                document_chunks(planned, index, resumed_at, chunk_size)
            {
                let rows = match prefiller.prefill(chunk, next) {
                    Ok(rows) => rows,
                    Err(e) => {
                        halt = Some(Halt::Failed(e));
                        break 'documents;
                    }
                };
                report.tokens += chunk.len();
                let job = Job {
                    document: index,
                    record: DocumentRecord {
                        // Planned documents complete in order, the interrupted one first.
                        number: manifest.documents + index,
                        sha256: doc.sha256.clone(),
                        title: doc.title.clone(),
                        source: doc.path.display().to_string(),
                        tokens: *first..first + tokens.len(),
                        bytes: doc.bytes,
                    },
                    tokens: chunk.to_vec(),
                    done,
                    rows,
                };
                let wait = Instant::now();
                if jobs.send(job).is_err() {
                    return Err(failed(committer));
                }
                let acked = if pipelined {
                    acked.try_iter().flatten().collect()
                } else {
                    match acked.recv() {
                        Ok(acked) => acked,
                        Err(_) => return Err(failed(committer)),
                    }
                };
                waited += wait.elapsed().as_secs_f64();
                if !announce(on_event, &titles, acked) {
                    halt = Some(Halt::Stopped);
                    break 'documents;
                }
            }
            report.added.push(doc.title.clone());
        }
        // The committer commits what it holds once the queue closes; a finished ingest waits
        // for that and tells of it.
        let wait = Instant::now();
        drop(jobs);
        let rest: Vec<ChunkDone> = acked.iter().flatten().collect();
        let committed = committer
            .join()
            .unwrap_or_else(|panic| std::panic::resume_unwind(panic))?;
        waited += wait.elapsed().as_secs_f64();
        report.store_seconds = waited;
        if halt.is_none() && !announce(on_event, &titles, rest) {
            halt = Some(Halt::Stopped);
        }
        match halt {
            None => Ok(committed),
            // What was committed by the time the committer finished counts.
            Some(Halt::Stopped) => Err(cancelled(&committed)),
            Some(Halt::Failed(e)) => Err(e),
        }
    })
}

/// One chunk of a planned document to prefill.
#[derive(Debug, PartialEq)]
struct PlannedChunk<'a> {
    chunk: &'a [u32],
    /// The chunk after it (the next document's first when this one ends), which a device
    /// that runs ahead computes while this one is committed.
    next: Option<&'a [u32]>,
    /// The document's tokens done once it is committed.
    done: usize,
}

/// The chunks of planned document `index` from token `resumed_at` on, `chunk_size` tokens
/// each. Only the first planned document can resume in the middle, so a next document's
/// first chunk starts at its first token.
fn document_chunks<'a>(
    planned: &'a [PlannedDocument<'_>],
    index: usize,
    resumed_at: usize,
    chunk_size: usize,
) -> impl Iterator<Item = PlannedChunk<'a>> {
    let tokens: &[u32] = &planned[index].tokens;
    let first_of = |p: &'a PlannedDocument<'_>| &p.tokens[..chunk_size.min(p.tokens.len())];
    let following = planned.get(index + 1).map(first_of);
    let starts = (resumed_at..tokens.len()).step_by(chunk_size.max(1));
    starts.map(move |from| {
        let to = (from + chunk_size).min(tokens.len());
        PlannedChunk {
            chunk: &tokens[from..to],
            next: if to == tokens.len() {
                following
            } else {
                Some(&tokens[to..(to + chunk_size).min(tokens.len())])
            },
            done: to,
        }
    })
}

/// A document's tokens in the corpus: its text and the separator, after a BOS token when it
/// opens the corpus and the model uses one. Control-token text in documents stays text.
fn document_tokens(tokenizer: &Tokenizer, text: &str, first: bool) -> Result<Vec<u32>> {
    let options = EncodeOptions {
        add_bos: first && tokenizer.prompt_options().add_bos,
        add_eos: false,
        parse_special: false,
    };
    let body = format!("{}{DOCUMENT_SEPARATOR}", text.trim_end());
    Ok(tokenizer.encode(&body, options)?)
}

/// Chunks a pipelined ingest commits together (a GPU's: 8 × 4,096 tokens, a quarter of a
/// second of Gemma 3 270M's prefill on an H100). Fewer, larger commits write a sliding
/// window's blocks once per commit instead of once per chunk (Gemma 3's 15 sliding layers
/// write as much per chunk as its 3 global ones) and sync less often; a crash loses at most
/// these chunks, which a rerun prefills again.
const PIPELINED_COMMIT_CHUNKS: usize = 8;

/// Pending key and value bytes past which a pipelined ingest commits even before
/// [`PIPELINED_COMMIT_CHUNKS`] (a big model's chunk alone is hundreds of megabytes).
const COMMIT_BYTES: usize = 256 << 20;

/// Says `done`'s chunks are committed, in order; false when the caller stops the ingest.
fn announce(
    on_event: &mut dyn FnMut(IngestEvent<'_>) -> ControlFlow<()>,
    titles: &[&str],
    done: Vec<ChunkDone>,
) -> bool {
    done.into_iter().all(|c| {
        on_event(IngestEvent::Committed {
            title: titles[c.document],
            done: c.done,
            total: c.total,
            corpus_tokens: c.corpus_tokens,
            chunk: c.tokens,
        })
        .is_continue()
    })
}

/// The model side of an ingest: the model with the corpus's keys and values so far, on its
/// device (rounded to f16 as the store keeps them), which prefills chunk after chunk and hands
/// over the rows each layer stores.
struct Prefiller<'s> {
    sequence: Box<dyn Forward + 's>,
    /// The corpus's layer policy and block size (its token counts are not kept up to date).
    layout: CorpusManifest,
    /// Tokens in the model's state once the chunks handed over so far are in.
    position: usize,
    /// The chunk the model was started on ahead of its turn, if any.
    started: Option<Vec<u32>>,
}

impl<'s> Prefiller<'s> {
    /// Loads every layer's stored keys and values into a fresh sequence state, telling
    /// `on_event` after each layer (which may stop it there: nothing is written yet).
    fn open(
        store: &Store,
        manifest: &CorpusManifest,
        model: ModelRef<'s>,
        on_event: &mut dyn FnMut(IngestEvent<'_>) -> ControlFlow<()>,
    ) -> Result<Self> {
        let mut sequence = model.sequence(&SequenceOptions {
            store_kv: true,
            query_sample: QUERY_SAMPLE_STRIDE,
        })?;
        let stored: Vec<(usize, Range<usize>)> = (0..manifest.layers.len())
            .map(|layer| (layer, manifest.stored_range(layer, manifest.tokens)))
            .filter(|(_, range)| !range.is_empty())
            .collect();
        for (done, (layer, range)) in stored.iter().enumerate() {
            // As stored (f16, head-major, read on every core): a GPU uploads them so.
            let (keys, values) = store.layer_kv_f16(manifest, *layer, range.clone())?;
            sequence.preload_stored(*layer, &keys, &values, range.clone())?;
            let loaded = IngestEvent::Loaded {
                layers: done + 1,
                of: stored.len(),
                tokens: manifest.tokens,
            };
            if on_event(loaded).is_break() {
                return Err(cancelled(manifest));
            }
        }
        Ok(Self {
            sequence,
            layout: manifest.clone(),
            position: manifest.tokens,
            started: None,
        })
    }

    /// Prefills `chunk` at the end of the corpus (unless the previous call started it),
    /// starts `next` where the model runs ahead, and returns each layer's rows to store:
    /// `(first chunk row, keys, values)`, from the first row of the first block the layer
    /// keeps (a sliding window's earlier rows never leave the device).
    fn prefill(&mut self, chunk: &[u32], next: Option<&[u32]>) -> Result<Vec<LayerRows>> {
        let start = self.position;
        match self.started.take() {
            Some(started) if started == chunk => {}
            Some(_) => {
                return Err(Error::Internal(
                    "the chunk the model computed ahead is not the one appended".into(),
                ))
            }
            None => {
                if self.sequence.position() != start {
                    return Err(Error::Internal(format!(
                        "the model's state ends at token {} but the corpus at {start}",
                        self.sequence.position()
                    )));
                }
                self.sequence.forward(chunk, &Logits::None)?;
            }
        }
        let (b, end) = (self.layout.block_size, start + chunk.len());
        let rows = (0..self.layout.layers.len())
            .map(|layer| {
                let keep = self.layout.stored_range(layer, end).start / b * b;
                let from = keep.saturating_sub(start).min(chunk.len());
                let (keys, values) = self
                    .sequence
                    .take_stored(layer, from..chunk.len())?
                    .ok_or_else(|| {
                        Error::Internal(format!("layer {layer} produced no keys for the chunk"))
                    })?;
                let sampled = self.sample_queries(layer)?;
                Ok(LayerRows {
                    from,
                    keys,
                    values,
                    sampled,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        // Only where the model runs ahead: on the CPU this would only delay a stop.
        if let Some(next) = next.filter(|_| self.sequence.runs_ahead()) {
            self.sequence.forward(next, &Logits::None)?;
            self.started = Some(next.to_vec());
        }
        self.position = end;
        Ok(rows)
    }

    /// The sampled queries ([`QUERY_SAMPLE_STRIDE`]) of a retrieval layer's chunk, where
    /// the model keeps its queries (on the CPU and the GPU); empty otherwise.
    fn sample_queries(&mut self, layer: usize) -> Result<SampledQueries> {
        if self.layout.layers[layer] != LayerPolicy::All {
            return Ok(SampledQueries::default());
        }
        Ok(self.sequence.take_queries(layer)?.unwrap_or_default())
    }
}

/// One layer's rows of a prefilled chunk, `[rows, n_kv_heads, head_dim]` f16 each, starting
/// at chunk row `from` (the rows before it are not stored).
struct LayerRows {
    from: usize,
    keys: Vec<f16>,
    values: Vec<f16>,
    sampled: SampledQueries,
}

/// A prefilled chunk on its way to a commit.
struct Job {
    /// Its document's index in the plan.
    document: usize,
    /// Its document's record, written when the chunk ends it.
    record: DocumentRecord,
    tokens: Vec<u32>,
    /// The document's tokens stored once this chunk is.
    done: usize,
    /// Per layer.
    rows: Vec<LayerRows>,
}

/// A committed chunk, for its [`IngestEvent::Committed`].
struct ChunkDone {
    document: usize,
    done: usize,
    total: usize,
    corpus_tokens: usize,
    tokens: usize,
}

/// The store side of an ingest: turns prefilled chunks into blocks and commits them. It
/// keeps the rows of the last, incomplete block of each layer/KV head and of the tokens, so
/// that a commit can rewrite that block whole.
struct Committer<'s> {
    store: &'s Store,
    /// The corpus as committed.
    manifest: CorpusManifest,
    /// The corpus with the pending chunks.
    next: CorpusManifest,
    batch: Batch<'s>,
    /// The pending chunks and their key/value bytes.
    pending: Vec<ChunkDone>,
    pending_bytes: usize,
    /// `[layer][head]` (keys, values) rows of the open block.
    open: Vec<Vec<(OpenBlock<f16>, OpenBlock<f16>)>>,
    open_tokens: OpenBlock<u32>,
    /// Per layer, the block below which the store holds nothing: blocks a sliding window
    /// no longer sees are deleted up to there (see [`Committer::collect`]).
    collected: Vec<usize>,
}

impl<'s> Committer<'s> {
    /// Reads the open blocks the next chunk continues.
    fn open(store: &'s Store, manifest: CorpusManifest) -> Result<Self> {
        let (n, b) = (manifest.tokens, manifest.block_size);
        let d = manifest.model.head_dim;
        let block_start = n - n % b;
        let open = (0..manifest.layers.len())
            .map(|layer| {
                (0..manifest.model.n_kv_heads)
                    .map(|head| {
                        // Stored rows are f16, so narrowing them back is exact.
                        let rows = |kv| -> Result<OpenBlock<f16>> {
                            let rows = store.rows(&manifest, kv, layer, head, block_start..n)?;
                            Ok(OpenBlock {
                                width: d,
                                rows: rows.into_iter().map(f16::from_f32).collect(),
                            })
                        };
                        Ok((rows(Kv::Keys)?, rows(Kv::Values)?))
                    })
                    .collect::<Result<Vec<_>>>()
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Self {
            store,
            open_tokens: OpenBlock {
                width: 1,
                rows: store.tokens(&manifest, block_start..n)?,
            },
            collected: vec![0; open.len()],
            open,
            batch: store.batch(),
            pending: Vec::new(),
            pending_bytes: 0,
            next: manifest.clone(),
            manifest,
        })
    }

    /// Commits the queue's chunks, `commit_every` at a time (sooner past [`COMMIT_BYTES`]),
    /// acknowledging each commit, until the queue closes; then commits what is pending and
    /// returns the corpus as committed.
    fn run(
        mut self,
        queue: mpsc::Receiver<Job>,
        acks: mpsc::Sender<Vec<ChunkDone>>,
        commit_every: usize,
    ) -> Result<CorpusManifest> {
        for job in queue {
            self.add(job)?;
            if self.pending.len() >= commit_every || self.pending_bytes >= COMMIT_BYTES {
                let done = self.commit()?;
                // A closed channel means the ingest stops; the commit stands.
                let _ = acks.send(done);
            }
        }
        if !self.pending.is_empty() {
            let done = self.commit()?;
            let _ = acks.send(done);
        }
        Ok(self.manifest)
    }

    /// Adds a chunk's blocks, tokens and records to the pending batch.
    fn add(&mut self, job: Job) -> Result<()> {
        if self.manifest.id == 0 {
            // The corpus's first commit creates it.
            let m = &self.manifest;
            let created = self.store.create_corpus(
                &m.name,
                m.model.clone(),
                m.layers.clone(),
                m.block_size,
                m.prefill.clone(),
            )?;
            self.manifest.id = created.id;
            self.next.id = created.id;
        }
        let (id, b, d) = (self.next.id, self.next.block_size, self.next.model.head_dim);
        let heads = self.next.model.n_kv_heads;
        let start = self.next.tokens;
        let end = start + job.tokens.len();
        let first_block = start / b;
        // Layers are independent: their blocks are cut on all cores, then put in order.
        let next = &self.next;
        let blocks = self
            .open
            .par_iter_mut()
            .zip(job.rows.into_par_iter())
            .enumerate()
            .map(|(layer, (open, rows))| {
                let stored = next.stored_range(layer, end);
                let mut blocks = Vec::new();
                for (head, (open_k, open_v)) in open.iter_mut().enumerate() {
                    let split = |all: &[f16]| -> Vec<f16> {
                        let mut out = vec![f16::ZERO; rows.from * d];
                        out.extend(
                            all.chunks_exact(heads * d)
                                .flat_map(|token| &token[head * d..(head + 1) * d]),
                        );
                        out
                    };
                    let key = |block: usize| BlockKey::new(id, layer, head, block);
                    for (kv, open, new) in [
                        (Kv::Keys, &mut *open_k, split(&rows.keys)),
                        (Kv::Values, &mut *open_v, split(&rows.values)),
                    ] {
                        open.append(&new, first_block, b, |block, rows| {
                            if (block + 1) * b > stored.start {
                                blocks.push((kv, key(block), rows.to_vec()));
                            }
                            Ok(())
                        })?;
                    }
                }
                Ok((layer, stored.start / b, blocks, rows.sampled))
            })
            .collect::<Result<Vec<_>>>()?;
        let row = self.next.model.n_heads * d;
        for (layer, unread, blocks, sampled) in blocks {
            for (&position, queries) in sampled
                .positions
                .iter()
                .zip(sampled.queries.chunks_exact(row))
            {
                self.batch
                    .put_queries(QueryKey::new(id, layer, position), queries);
            }
            for (kv, key, rows) in blocks {
                self.pending_bytes += rows.len() * 2;
                self.batch.put_block(kv, key, rows);
            }
            // Blocks of this batch that the window has left since they were put.
            for head in 0..heads {
                self.batch.forget_blocks(id, layer, head, 0..unread);
            }
        }
        self.open_tokens
            .append(&job.tokens, first_block, b, |block, ids| {
                self.batch.put_tokens(id, block, ids)
            })?;
        self.next.tokens = end;
        let total = job.record.tokens.len();
        if job.done == total {
            if job.record.number != self.next.documents {
                return Err(Error::Corrupt(format!(
                    "document `{}` completes as number {} of a corpus of {}",
                    job.record.title, job.record.number, self.next.documents
                )));
            }
            self.batch.put_document(id, &job.record)?;
            self.next.documents += 1;
            self.next.pending = None;
        } else {
            self.next.pending = Some(PendingDocument {
                sha256: job.record.sha256.clone(),
                title: job.record.title.clone(),
                start: job.record.tokens.start,
                total,
            });
        }
        self.pending.push(ChunkDone {
            document: job.document,
            done: job.done,
            total,
            corpus_tokens: end,
            tokens: job.tokens.len(),
        });
        Ok(())
    }

    /// Commits the pending batch with its manifest.
    fn commit(&mut self) -> Result<Vec<ChunkDone>> {
        let mut batch = std::mem::replace(&mut self.batch, self.store.batch());
        collect(&mut batch, &self.manifest, &mut self.collected)?;
        batch.put_manifest(&self.next)?;
        self.store.commit(batch)?;
        self.manifest = self.next.clone();
        self.pending_bytes = 0;
        Ok(std::mem::take(&mut self.pending))
    }
}

/// Adds to `batch` the deletion of the blocks that the committed `manifest` no longer reads
/// (a sliding window's old ones) and `collected` does not cover yet. Not those the manifest
/// of `batch` stops reading: block deletions apply before a batch commits
/// ([`Batch::delete_blocks`]), and a crash in between must leave the committed state
/// readable. So they go one commit late, and the first commit of every ingest (whose
/// `collected` starts at 0) also deletes what an interrupted one left.
fn collect(
    batch: &mut Batch<'_>,
    manifest: &CorpusManifest,
    collected: &mut [usize],
) -> Result<()> {
    let b = manifest.block_size;
    for (layer, collected) in collected.iter_mut().enumerate() {
        let unread = manifest.stored_range(layer, manifest.tokens).start / b;
        if unread > *collected {
            for head in 0..manifest.model.n_kv_heads {
                batch.delete_blocks(manifest.id, layer, head, *collected..unread)?;
            }
            *collected = unread;
        }
    }
    Ok(())
}

/// Deletes every block the committed corpus no longer reads, once its last chunk is in.
fn collect_garbage(store: &Store, manifest: &CorpusManifest) -> Result<()> {
    let mut batch = store.batch();
    collect(&mut batch, manifest, &mut vec![0; manifest.layers.len()])?;
    store.commit(batch)
}

/// The rows of the last, incomplete block of a layer's KV head (or of the tokens), `width`
/// items a row, which the next commit rewrites whole.
struct OpenBlock<T> {
    width: usize,
    rows: Vec<T>,
}

impl<T: Copy> OpenBlock<T> {
    /// Appends `new` rows to the open block, which is block `first_block` of `block_size`
    /// rows; hands every block the rows touch to `put`, whole from its first row; and keeps
    /// the rows of the last block when it is incomplete.
    fn append(
        &mut self,
        new: &[T],
        first_block: usize,
        block_size: usize,
        mut put: impl FnMut(usize, &[T]) -> Result<()>,
    ) -> Result<()> {
        self.rows.extend_from_slice(new);
        let per_block = block_size * self.width;
        for (i, rows) in self.rows.chunks(per_block).enumerate() {
            put(first_block + i, rows)?;
        }
        let keep = self.rows.len() % per_block;
        self.rows.drain(..self.rows.len() - keep);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A resumed document's chunks start where it stopped, each names the one after it,
    /// and the last names the next document's first chunk (or none after the last).
    #[test]
    fn document_chunks_resume_and_look_one_chunk_ahead() {
        let doc = SourceDocument {
            title: "t".into(),
            path: "t".into(),
            text: String::new(),
            sha256: String::new(),
            bytes: 0,
        };
        let planned = [
            PlannedDocument {
                doc: &doc,
                first: 0,
                tokens: (0..10).collect(),
            },
            PlannedDocument {
                doc: &doc,
                first: 10,
                tokens: (10..13).collect(),
            },
        ];
        let chunks: Vec<_> = document_chunks(&planned, 0, 3, 4).collect();
        let (a, b): (Vec<u32>, Vec<u32>) = ((3..7).collect(), (7..10).collect());
        let next: Vec<u32> = (10..13).collect();
        assert_eq!(
            chunks,
            vec![
                PlannedChunk {
                    chunk: &a,
                    next: Some(&b),
                    done: 7
                },
                PlannedChunk {
                    chunk: &b,
                    next: Some(&next),
                    done: 10
                },
            ]
        );
        let last: Vec<_> = document_chunks(&planned, 1, 0, 2).collect();
        assert_eq!(last.len(), 2);
        assert_eq!(last[0].next, Some(&[12][..]));
        assert_eq!(
            (last[1].chunk, last[1].next, last[1].done),
            (&[12][..], None, 3)
        );
        assert_eq!(document_chunks(&planned, 0, 10, 4).count(), 0);
    }

    /// Blocks of 4 rows of 2 items: an open block of 3 rows (block 5) gets 6 more rows; it
    /// is handed over whole with the next full block and the rest, and the 1 row past them
    /// stays open. A fresh open block at a boundary hands over only what it fills.
    #[test]
    fn open_block_hands_over_every_touched_block_whole() -> Result<()> {
        let mut open = OpenBlock {
            width: 2,
            rows: (0..6).collect::<Vec<u32>>(),
        };
        let mut put = Vec::new();
        open.append(&(6..18).collect::<Vec<u32>>(), 5, 4, |block, rows| {
            put.push((block, rows.to_vec()));
            Ok(())
        })?;
        assert_eq!(
            put,
            vec![
                (5, (0..8).collect()),
                (6, (8..16).collect()),
                (7, (16..18).collect()),
            ]
        );
        assert_eq!(open.rows, vec![16, 17]);

        let mut whole = OpenBlock {
            width: 1,
            rows: Vec::new(),
        };
        let mut blocks = Vec::new();
        whole.append(&[1, 2, 3, 4], 2, 4, |block, rows| {
            blocks.push((block, rows.to_vec()));
            Ok(())
        })?;
        assert_eq!(blocks, vec![(2, vec![1, 2, 3, 4])]);
        assert!(whole.rows.is_empty());
        Ok(())
    }
}
