//! Ingest: documents appended in order to a corpus's context, prefilled in chunks with exact
//! attention over everything before, and committed chunk by chunk.
//!
//! Every chunk attends to the *stored* keys and values (rounded to f16 exactly as the store
//! keeps them), and chunk boundaries are fixed relative to each document's first token, so
//! an ingest resumed after a crash, or one appended later, computes bit for bit what one
//! uninterrupted run does. Each chunk is one atomic batch: its key/value blocks, its tokens
//! and the manifest (the commit point) with the interrupted document's progress, so a crash
//! loses at most the chunk in flight.

use std::collections::HashMap;
use std::ops::ControlFlow;
use std::time::Instant;

use kvdb_model::{
    EncodeOptions, Forward, LayerKind, Logits, Model, ModelConfig, SequenceOptions, Tokenizer,
};

use crate::documents::SourceDocument;
use crate::error::{Error, Result};
use crate::store::{
    validate_corpus_name, BlockKey, CorpusManifest, DocumentRecord, Kv, ModelRecord,
    PendingDocument, PrefillRecord, Store, StoredLayer, DEFAULT_BLOCK_SIZE,
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
    /// Of those, seconds in the model: prefill and the copy of its keys and values to the
    /// host (the rest is the store: blocks, batches, commits).
    pub model_seconds: f64,
    /// Tokens in the corpus afterwards.
    pub corpus_tokens: usize,
}

/// The record of `model` for a corpus manifest.
pub fn model_record(config: &ModelConfig, sha256: &str, fallback_name: &str) -> ModelRecord {
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

/// The layer policy of a new corpus: global layers store everything, sliding-window layers
/// only what their window can still see.
pub fn layer_policy(config: &ModelConfig) -> Vec<StoredLayer> {
    config
        .layers
        .iter()
        .map(|l| match l.kind {
            LayerKind::Global => StoredLayer::All,
            LayerKind::SlidingWindow { window } => StoredLayer::Last {
                keep: window.saturating_sub(1),
            },
        })
        .collect()
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
/// interrupted document resumes when the same documents are ingested again).
pub fn ingest_until(
    store: &Store,
    name: &str,
    model: ModelRef<'_>,
    documents: &[SourceDocument],
    on_event: &mut dyn FnMut(IngestEvent<'_>) -> ControlFlow<()>,
) -> Result<IngestReport> {
    validate_corpus_name(name)?;
    let config = model.model.config();
    let mut manifest = match store.manifest(name) {
        Ok(m) => m,
        Err(Error::CorpusMissing { .. }) => {
            // Created in the first commit below, so a failed plan writes nothing.
            CorpusManifest {
                format_version: crate::store::FORMAT_VERSION,
                name: name.to_string(),
                id: 0,
                model: model.record.clone(),
                block_size: DEFAULT_BLOCK_SIZE,
                layers: layer_policy(config),
                indexes: vec!["flat".to_string()],
                tokens: 0,
                documents: 0,
                pending: None,
                prefill: PrefillRecord {
                    device: model.device().into(),
                    chunk: model.prefill_chunk(),
                },
            }
        }
        Err(e) => return Err(e),
    };
    check_model(&manifest, model.record)?;
    manifest.prefill.device = model.device().into();
    let existing = if manifest.id == 0 {
        Vec::new()
    } else {
        store.documents(&manifest)?
    };

    // The plan: which documents to add, in which order, with their tokens.
    let mut report = IngestReport::default();
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
    let mut start = manifest
        .pending
        .as_ref()
        .map_or(manifest.tokens, |p| p.start);
    let mut planned = Vec::with_capacity(plan.len());
    let mut to_prefill = 0;
    for doc in &plan {
        let tokens = document_tokens(model.tokenizer, &doc.text, start == 0)?;
        let end = start + tokens.len();
        if end > config.context_length {
            return Err(Error::ContextOverflow {
                corpus: manifest.name.clone(),
                what: format!("`{}` ({} tokens)", doc.title, tokens.len()),
                tokens: end,
                context: config.context_length,
            });
        }
        to_prefill += end - start.max(manifest.tokens);
        planned.push((*doc, start, tokens));
        start = end;
    }
    let stop = |manifest: &CorpusManifest| Error::Cancelled {
        corpus: manifest.name.clone(),
        tokens: manifest.tokens,
    };
    if on_event(IngestEvent::Planned {
        documents: planned.len(),
        tokens: to_prefill,
    })
    .is_break()
    {
        return Err(stop(&manifest));
    }
    if planned.is_empty() {
        report.corpus_tokens = manifest.tokens;
        return Ok(report);
    }

    let started = Instant::now();
    let chunk_size = manifest.prefill.chunk.max(1);
    let mut writer = Writer::open(store, &mut manifest, model)?;
    for (index, (doc, first, tokens)) in planned.iter().enumerate() {
        let (doc, first) = (*doc, *first);
        let resumed_at = match &writer.manifest.pending {
            Some(p) if p.sha256 == doc.sha256 => {
                let stored = store.tokens(writer.manifest, first..writer.manifest.tokens)?;
                if p.total != tokens.len() || !tokens.starts_with(&stored) {
                    return Err(Error::Corrupt(format!(
                        "the interrupted document `{}` no longer tokenizes as it did",
                        doc.title
                    )));
                }
                stored.len()
            }
            _ => 0,
        };
        if on_event(IngestEvent::Started {
            title: &doc.title,
            tokens: tokens.len(),
            resumed_at,
        })
        .is_break()
        {
            return Err(stop(writer.manifest));
        }
        let mut done = resumed_at;
        while done < tokens.len() {
            let chunk = &tokens[done..(done + chunk_size).min(tokens.len())];
            let complete = done + chunk.len() == tokens.len();
            // The chunk after this one (the next document's first when this one ends), which
            // the model computes while this one is committed. Only the first planned document
            // can resume in the middle, so the others start at their first token.
            let next = if complete {
                planned
                    .get(index + 1)
                    .map(|(_, _, t)| &t[..chunk_size.min(t.len())])
            } else {
                let from = done + chunk.len();
                Some(&tokens[from..(from + chunk_size).min(tokens.len())])
            };
            let record = DocumentRecord {
                number: writer.manifest.documents,
                sha256: doc.sha256.clone(),
                title: doc.title.clone(),
                source: doc.path.display().to_string(),
                tokens: first..first + tokens.len(),
                bytes: doc.bytes,
            };
            writer.append(chunk, &record, complete, next)?;
            done += chunk.len();
            report.tokens += chunk.len();
            if on_event(IngestEvent::Committed {
                title: &doc.title,
                done,
                total: tokens.len(),
                corpus_tokens: writer.manifest.tokens,
                chunk: chunk.len(),
            })
            .is_break()
            {
                return Err(stop(writer.manifest));
            }
        }
        report.added.push(doc.title.clone());
    }
    // Every chunk is durable in the write-ahead log already; writing the memtables out lets
    // RocksDB delete that log, so a store at rest keeps none to replay or to grow.
    store.flush()?;
    report.seconds = started.elapsed().as_secs_f64();
    report.model_seconds = writer.model_seconds;
    report.corpus_tokens = writer.manifest.tokens;
    Ok(report)
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

/// The rows of the last, incomplete block of each layer/KV head (pre-RoPE keys, values) and of
/// the tokens, so that a commit can rewrite that block whole.
struct Writer<'s, 'm> {
    store: &'s Store,
    manifest: &'m mut CorpusManifest,
    /// The model with the corpus's keys and values so far, on its device; keys and values
    /// are rounded to f16 as the store keeps them.
    sequence: Box<dyn Forward + 's>,
    /// `[layer][head]` (keys, values) rows of the open block.
    open: Vec<Vec<(Vec<f32>, Vec<f32>)>>,
    open_tokens: Vec<u32>,
    /// Seconds in the model so far (prefill and the copy of its keys and values).
    model_seconds: f64,
    /// The chunk the model was started on ahead of its append, if any.
    started: Option<Vec<u32>>,
}

impl<'s, 'm> Writer<'s, 'm> {
    /// Loads the stored state the next chunk continues: every layer's stored keys and values
    /// into the model's sequence state, and the open block.
    fn open(
        store: &'s Store,
        manifest: &'m mut CorpusManifest,
        model: ModelRef<'s>,
    ) -> Result<Writer<'s, 'm>> {
        let config = model.model.config();
        let (n, b, heads) = (manifest.tokens, manifest.block_size, config.n_kv_heads);
        let mut sequence = model.sequence(&SequenceOptions { store_kv: true })?;
        let block_start = n - n % b;
        let mut open = Vec::with_capacity(config.n_layers());
        for spec in &config.layers {
            let range = manifest.stored_range(spec.index, n);
            // The last block is always stored whole, even where a window keeps less.
            let layer_open = (0..heads)
                .map(|head| {
                    Ok((
                        store.rows(manifest, Kv::Keys, spec.index, head, block_start..n)?,
                        store.rows(manifest, Kv::Values, spec.index, head, block_start..n)?,
                    ))
                })
                .collect::<Result<Vec<_>>>()?;
            if !range.is_empty() {
                let (keys, values) = store.layer_kv(manifest, spec.index, range.clone())?;
                sequence.preload(spec.index, &keys, &values, range)?;
            }
            open.push(layer_open);
        }
        let open_tokens = store.tokens(manifest, block_start..n)?;
        Ok(Writer {
            store,
            manifest,
            sequence,
            open,
            open_tokens,
            model_seconds: 0.0,
            started: None,
        })
    }

    /// Prefills `chunk` at the end of the corpus (unless the previous call started it) and
    /// commits it, with the document's record when `complete`. Starts `next` on the model
    /// before committing, so that a GPU computes it while the store writes this one.
    fn append(
        &mut self,
        chunk: &[u32],
        record: &DocumentRecord,
        complete: bool,
        next: Option<&[u32]>,
    ) -> Result<()> {
        let start = self.manifest.tokens;
        let model_started = Instant::now();
        match self.started.take() {
            Some(started) if started == chunk => {}
            Some(_) => {
                return Err(Error::Corrupt(
                    "the chunk the model computed ahead is not the one appended".into(),
                ))
            }
            None => {
                if self.sequence.position() != start {
                    return Err(Error::Corrupt(format!(
                        "the model's state ends at token {} but the corpus at {start}",
                        self.sequence.position()
                    )));
                }
                self.sequence.forward(chunk, &Logits::None)?;
            }
        }
        let (b, end) = (self.manifest.block_size, start + chunk.len());
        // Rows before the first block the store keeps of a layer (a sliding window's early
        // rows) are not copied from the model; they count as zeros below and are never written.
        let captured = (0..self.open.len())
            .map(|layer| {
                let keep = self.manifest.stored_range(layer, end).start / b * b;
                let from = keep.saturating_sub(start).min(chunk.len());
                let rows = self.sequence.take_stored(layer, from..chunk.len())?;
                let (keys, values) = rows.ok_or_else(|| {
                    Error::Corrupt(format!("layer {layer} produced no keys for the chunk"))
                })?;
                Ok((from, keys, values))
            })
            .collect::<Result<Vec<_>>>()?;
        // Only where the model runs ahead: on the CPU this would only delay a stop.
        if let Some(next) = next.filter(|_| self.sequence.runs_ahead()) {
            self.sequence.forward(next, &Logits::None)?;
            self.started = Some(next.to_vec());
        }
        self.model_seconds += model_started.elapsed().as_secs_f64();
        if self.manifest.id == 0 {
            // The corpus's first commit creates it.
            let created = self.store.create_corpus(
                &self.manifest.name,
                self.manifest.model.clone(),
                self.manifest.layers.clone(),
                self.manifest.block_size,
                self.manifest.prefill.clone(),
            )?;
            self.manifest.id = created.id;
        }
        let id = self.manifest.id;
        let d = self.manifest.model.head_dim;
        let mut batch = self.store.batch();
        let first_block = start / b;
        let heads = self.manifest.model.n_kv_heads;
        for (layer, (from, keys, values)) in captured.into_iter().enumerate() {
            let head_rows = |rows: &[f32], head: usize| -> Vec<f32> {
                let mut out = vec![0f32; from * d];
                out.extend(
                    rows.chunks_exact(heads * d)
                        .flat_map(|token| &token[head * d..(head + 1) * d]),
                );
                out
            };
            for (head, (open_k, open_v)) in self.open[layer].iter_mut().enumerate() {
                let k = head_rows(&keys, head);
                let v = head_rows(&values, head);
                let stored = self.manifest.stored_range(layer, end);
                let key = |block: usize| BlockKey {
                    corpus: id,
                    layer: layer as u16,
                    head: head as u16,
                    block: block as u32,
                };
                flush_blocks(open_k, &k, d, first_block, b, |block, rows| {
                    if (block + 1) * b > stored.start {
                        batch.put_block(Kv::Keys, key(block), rows)?;
                    }
                    Ok(())
                })?;
                flush_blocks(open_v, &v, d, first_block, b, |block, rows| {
                    if (block + 1) * b > stored.start {
                        batch.put_block(Kv::Values, key(block), rows)?;
                    }
                    Ok(())
                })?;
                // Blocks a sliding window no longer sees.
                let was = self.manifest.stored_range(layer, start).start / b;
                let now = stored.start / b;
                if now > was {
                    batch.delete_blocks(id, layer, head, was..now)?;
                }
            }
        }
        flush_blocks(
            &mut self.open_tokens,
            chunk,
            1,
            first_block,
            b,
            |block, ids| batch.put_tokens(id, block, ids),
        )?;
        let mut next = self.manifest.clone();
        next.tokens = end;
        if complete {
            batch.put_document(id, record)?;
            next.documents += 1;
            next.pending = None;
        } else {
            next.pending = Some(PendingDocument {
                sha256: record.sha256.clone(),
                title: record.title.clone(),
                start: record.tokens.start,
                total: record.tokens.len(),
            });
        }
        batch.put_manifest(&next)?;
        self.store.commit(batch)?;
        *self.manifest = next;
        Ok(())
    }
}

/// Appends `new` rows (`width` items each) to the open block `open`, which starts at block
/// `first_block`; hands every block the rows touch to `put`, whole from its first row; and
/// leaves `open` holding the rows of the last block when it is incomplete.
fn flush_blocks<T: Copy>(
    open: &mut Vec<T>,
    new: &[T],
    width: usize,
    first_block: usize,
    block_size: usize,
    mut put: impl FnMut(usize, &[T]) -> Result<()>,
) -> Result<()> {
    open.extend_from_slice(new);
    let per_block = block_size * width;
    for (i, rows) in open.chunks(per_block).enumerate() {
        put(first_block + i, rows)?;
    }
    let keep = open.len() % per_block;
    open.drain(..open.len() - keep);
    Ok(())
}
