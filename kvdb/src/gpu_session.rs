//! Queries on the GPU (feature `gpu`): the model's forward pass runs on the device, and at
//! every retrieval layer [`GpuSession`] attends with the retrieval kernels over the corpus's
//! keys and values, resident on the GPU ([`GpuCorpusKv`]: rotated once per corpus and shared
//! by every query), and the query's own tail, which the sequence keeps. Selection, the dense
//! policy and provenance are the CPU's [`Session`]; only the attention runs here.
//!
//! Every index type searches on CPU threads for now (bucket routing on the GPU is to come):
//! each retrieval layer copies its queries to the host once per call and uploads the
//! selection, with the corpus's part of the dense policy, as each KV head's list; the tail is
//! the dense part. Under full attention every corpus row is attended densely, with the tail
//! as the list. Provenance reruns the answer's retrieval steps on the CPU once the answer is
//! complete, so that it ranks passages exactly as the CPU path does.

use std::ops::Range;
use std::sync::Arc;

use candle_core::Tensor;
use half::f16;
use kvdb_index::Found;
use kvdb_kernels::cudarc::driver::CudaView;
use kvdb_kernels::{retrieval_attention, Csr, Dense, KvCache, Query, Selected, Workspace};
use kvdb_model::{
    ExternalAttention, Forward, GpuModel, LayerAttention, LayerCall, Logits, ModelError, Rope,
    SequenceOptions,
};
use rayon::prelude::*;

use crate::error::{Error, Result};
use crate::generate::{continue_generation, GenerateOptions, Generation};
use crate::ingest::ModelRef;
use crate::session::{Corpus, Session, Step, StepPlace};

/// Retrieval steps (a layer's call each) whose provenance waits for the answer's end at
/// most; more are computed in a batch on the way.
const PROVENANCE_STEPS: usize = 512;

/// Host bytes of f32 rows a corpus upload reads ahead of the GPU at most.
const READ_BYTES: usize = 4 << 30;

/// A corpus's retrieval layers' keys (rotated at their positions) and values on one GPU,
/// f16 `[kv_heads, tokens, head_dim]` per layer: what every query's retrieval reads.
pub(crate) struct GpuCorpusKv {
    /// Per layer of the model; `None` for layers that do not retrieve.
    layers: Vec<Option<KvCache<f16>>>,
    /// The GPU they are on.
    gpu: Arc<kvdb_model::Gpu>,
}

impl std::fmt::Debug for GpuCorpusKv {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GpuCorpusKv")
            .field(
                "layers",
                &self.layers.iter().filter(|l| l.is_some()).count(),
            )
            .finish_non_exhaustive()
    }
}

impl GpuCorpusKv {
    /// Reads every retrieval layer's keys and values from the store and uploads them,
    /// rotated by the same kernel that rotates the model's own keys.
    pub(crate) fn build(
        corpus: &Corpus,
        model: ModelRef<'_>,
        gpu: &GpuModel,
        retrieval_layers: &[usize],
        n: usize,
    ) -> Result<Self> {
        let config = model.model.config();
        let (kv_heads, d) = (config.n_kv_heads, config.head_dim);
        // Said before anything is read, rather than as the driver's out-of-memory error
        // halfway through; the rest of the query needs far less than the 1/16 kept free.
        let needed = retrieval_layers.len() * 2 * kv_heads * n * d * size_of::<f16>();
        let free = gpu.gpu().free_memory().map_err(ModelError::from)?;
        if needed > free - free / 16 {
            return Err(Error::GpuMemory {
                corpus: corpus.manifest().name.clone(),
                needed,
                free,
            });
        }
        // Layers are read from the store in parallel, a few at a time (each is f32 on the
        // host until it is uploaded), and uploaded in order.
        let layer_bytes = 2 * kv_heads * n * d * size_of::<f32>();
        let at_once = (READ_BYTES / layer_bytes.max(1)).clamp(1, rayon::current_num_threads());
        let mut layers: Vec<Option<KvCache<f16>>> = (0..config.n_layers()).map(|_| None).collect();
        for group in retrieval_layers.chunks(at_once) {
            let rows = group
                .par_iter()
                .map(|&layer| corpus.layer_kv(layer, 0..n))
                .collect::<Result<Vec<_>>>()?;
            for (&layer, (keys, values)) in group.iter().zip(rows) {
                layers[layer] = Some(gpu.rotated_kv(layer, &keys, &values, 0..n)?);
            }
        }
        Ok(Self {
            layers,
            gpu: gpu.gpu().clone(),
        })
    }

    /// Whether these rows are on `gpu`'s device.
    pub(crate) fn is_on(&self, gpu: &GpuModel) -> bool {
        Arc::ptr_eq(&self.gpu, gpu.gpu())
    }

    /// GPU memory the rows take.
    pub(crate) fn bytes(&self) -> usize {
        self.layers
            .iter()
            .flatten()
            .map(|kv| 2 * kv.kv_heads() * kv.tokens() * kv.head_dim() * size_of::<f16>())
            .sum()
    }
}

/// Answers `ids` after `corpus` on the GPU: the sequence keeps the sliding windows and the
/// tail, [`GpuSession`] attends at the retrieval layers.
pub(crate) fn generate<'c>(
    corpus: &'c Corpus,
    model: ModelRef<'_>,
    gpu: &GpuModel,
    session: Session<'c>,
    ids: &[u32],
    options: &GenerateOptions,
    on_text: &mut dyn FnMut(&str) -> Result<()>,
) -> Result<(Generation, Session<'c>)> {
    let tail = ids.len() + options.max_tokens;
    with_sequence(corpus, model, gpu, session, tail, &mut |sequence| {
        continue_generation(sequence, model.tokenizer, ids, options, on_text)
    })
}

/// The logits `[ids, vocab]` of `ids` run after `corpus` in one call on the GPU.
pub(crate) fn score(
    corpus: &Corpus,
    model: ModelRef<'_>,
    gpu: &GpuModel,
    session: Session<'_>,
    ids: &[u32],
) -> Result<Tensor> {
    let (logits, _) = with_sequence(corpus, model, gpu, session, ids.len(), &mut |sequence| {
        sequence
            .forward(ids, &Logits::All)?
            .ok_or_else(|| Error::Internal("the model returned no logits".into()))
    })?;
    Ok(logits)
}

/// Runs `work` on a GPU sequence after `corpus` with room for `tail` tokens of its own, its
/// retrieval layers attended by `session` (returned with `work`'s result).
fn with_sequence<'c, R>(
    corpus: &'c Corpus,
    model: ModelRef<'_>,
    gpu: &GpuModel,
    session: Session<'c>,
    tail: usize,
    work: &mut dyn FnMut(&mut dyn Forward) -> Result<R>,
) -> Result<(R, Session<'c>)> {
    if session.estimates() {
        return Err(Error::NotOnGpu {
            what: "estimating unvisited buckets (`estimate`)",
        });
    }
    let kv = corpus.gpu_kv(model, gpu)?;
    let config = model.model.config();
    let n = corpus.manifest().tokens;
    let ropes = (0..config.n_layers())
        .map(|l| model.model.rope(l))
        .collect::<Option<Vec<&Rope>>>()
        .ok_or_else(|| Error::Internal("a layer of the model has no RoPE".into()))?;
    let mut attention = GpuSession {
        session,
        kv,
        ropes,
        workspace: Workspace::new(gpu.gpu()).map_err(ModelError::from)?,
        lists: Csr::from_lists::<&[u32]>(gpu.gpu(), &[]).map_err(ModelError::from)?,
        n,
        heads: (config.n_heads, config.n_kv_heads, config.head_dim),
        provenance: Vec::new(),
    };
    let result = {
        let mut sequence = gpu.sequence_with(
            &SequenceOptions::default(),
            ExternalAttention {
                layers: corpus.retrieval_layers().to_vec(),
                tail_capacity: tail.min(config.context_length.saturating_sub(n)).max(1),
                first_position: n,
                attention: &mut attention,
            },
        )?;
        for window in corpus.windows() {
            let host = |t: &Tensor| -> Result<Vec<f32>> { Ok(t.flatten_all()?.to_vec1()?) };
            sequence.preload(
                window.layer,
                &host(&window.keys)?,
                &host(&window.values)?,
                window.positions.clone(),
            )?;
        }
        work(&mut *sequence)?
    };
    let GpuSession {
        mut session,
        provenance,
        ..
    } = attention;
    session.add_mass_of(&provenance)?;
    Ok((result, session))
}

/// One query's attention at the retrieval layers of a GPU sequence.
struct GpuSession<'c, 'm> {
    session: Session<'c>,
    kv: Arc<GpuCorpusKv>,
    /// Per layer, the CPU's RoPE (the CPU attention that provenance recomputes rotates).
    ropes: Vec<&'m Rope>,
    workspace: Workspace,
    /// The lists of the last launch, rewritten for each.
    lists: Csr,
    /// Corpus tokens.
    n: usize,
    /// Query heads, KV heads, head dim.
    heads: (usize, usize, usize),
    /// The answer's retrieval steps and their selections, whose attention the CPU
    /// recomputes for provenance once the answer is complete (off each token's path), or
    /// every [`PROVENANCE_STEPS`].
    provenance: Vec<(Step<'m>, Vec<Vec<Found>>)>,
}

impl LayerAttention for GpuSession<'_, '_> {
    fn attend(&mut self, call: LayerCall<'_>) -> kvdb_model::Result<()> {
        let layer = call.layer;
        self.attend_call(call).map_err(|e| ModelError::Backend {
            layer,
            reason: e.to_string(),
        })
    }
}

impl GpuSession<'_, '_> {
    fn attend_call(&mut self, mut call: LayerCall<'_>) -> Result<()> {
        let (h, kv_heads, d) = self.heads;
        let q = h * d;
        let n = self.n;
        let gpu = call.gpu;
        let corpus = self
            .kv
            .layers
            .get(call.layer)
            .and_then(Option::as_ref)
            .ok_or_else(|| {
                Error::Internal(format!("layer {} has no keys on the GPU", call.layer))
            })?;
        let capacity = call.tail.tokens();
        let first = call.positions.start;
        let found = match self.session.retrieves(call.layer) {
            false => None,
            true => {
                let started = std::time::Instant::now();
                let step = host_step(&call, &self.ropes, self.heads, self.n)?;
                self.session.add_transfer(started.elapsed().as_secs_f64());
                let found = self
                    .session
                    .select(&step)?
                    .ok_or_else(|| Error::Internal("a retrieval layer selected nothing".into()))?;
                Some((step, found))
            }
        };
        for i in 0..call.positions.len() {
            let position = first + i;
            let queries = call.queries.slice(i * q..(i + 1) * q);
            let query = Query {
                heads: &queries,
                scale: call.scale,
            };
            let mut out = call.out.slice_mut(i * q..(i + 1) * q);
            match found.as_ref().map(|(_, found)| found) {
                // Full attention: the corpus densely, the tail's rows as every head's list.
                None => {
                    let rows: Vec<u32> = tail_rows(n..position + 1, capacity).flatten().collect();
                    self.lists
                        .write_lists(gpu, &vec![rows; kv_heads])
                        .map_err(ModelError::from)?;
                    let all = 0..n as u32;
                    let dense = Dense {
                        kv: corpus,
                        runs: std::slice::from_ref(&all),
                    };
                    let selected = Selected::resident(call.tail, &self.lists);
                    retrieval_attention(gpu, &mut self.workspace, query, dense, selected, &mut out)
                        .map_err(ModelError::from)?;
                }
                // Retrieval: the tail densely; per KV head the corpus's dense ids (sinks and
                // the window's part before the tail) and the retrieved ones as its list.
                Some(found) => {
                    let policy = self
                        .session
                        .policy_at(position)
                        .ok_or_else(|| Error::Internal("retrieval without a budget".into()))?;
                    let corpus_dense: Vec<u32> = policy
                        .dense_ranges(position)
                        .into_iter()
                        .flat_map(|r| r.start.min(n as u32)..r.end.min(n as u32))
                        .collect();
                    let lists: Vec<Vec<u32>> = found
                        .iter()
                        .map(|per_token| {
                            let mut ids = corpus_dense.clone();
                            ids.extend(policy.retrieved(position, per_token[i].selection.ids()));
                            ids
                        })
                        .collect();
                    self.lists
                        .write_lists(gpu, &lists)
                        .map_err(ModelError::from)?;
                    let runs: Vec<Range<u32>> = tail_rows(n..position + 1, capacity).collect();
                    let dense = Dense {
                        kv: call.tail,
                        runs: &runs,
                    };
                    let selected = Selected::resident(corpus, &self.lists);
                    retrieval_attention(gpu, &mut self.workspace, query, dense, selected, &mut out)
                        .map_err(ModelError::from)?;
                }
            }
        }
        // Provenance: the CPU recomputes the answer tokens' attention over the same
        // selections later, so that it ranks passages exactly as the CPU path does.
        if let Some((step, found)) = found.filter(|(step, _)| self.session.counts_mass(step)) {
            self.provenance.push((step, found));
            // Bounds the rows held for a long answer, still in parallel batches.
            if self.provenance.len() >= PROVENANCE_STEPS {
                self.session.add_mass_of(&self.provenance)?;
                self.provenance.clear();
            }
        }
        Ok(())
    }
}

/// The call's pre-RoPE queries, keys and values on the host, as the CPU session's step.
fn host_step<'r>(
    call: &LayerCall<'_>,
    ropes: &[&'r Rope],
    (h, kv_heads, d): (usize, usize, usize),
    n: usize,
) -> Result<Step<'r>> {
    let t = call.positions.len();
    let queries = download(call.gpu, &call.raw_queries)?;
    let (keys, values) = (
        download(call.gpu, &call.raw_keys)?,
        download(call.gpu, &call.raw_values)?,
    );
    call.gpu.synchronize().map_err(ModelError::from)?;
    let wide = |v: Vec<f16>| -> Vec<f32> { v.iter().map(|x| x.to_f32()).collect() };
    let place = StepPlace {
        layer: call.layer,
        first: call.positions.start,
        scale: call.scale,
        rope: ropes[call.layer],
    };
    Step::from_rows(
        place,
        (t, h, kv_heads, d),
        n,
        queries,
        wide(keys),
        wide(values),
    )
}

/// Queues a copy of a view's elements to the host; the caller waits for the stream once
/// after all of a step's copies.
fn download<T: kvdb_kernels::cudarc::driver::DeviceRepr + Default + Clone>(
    gpu: &kvdb_model::Gpu,
    view: &CudaView<'_, T>,
) -> Result<Vec<T>> {
    let mut host = vec![T::default(); view.len()];
    gpu.stream().memcpy_dtoh(view, &mut host).map_err(|e| {
        ModelError::from(kvdb_model::KernelError::Driver {
            op: "copying a retrieval step's queries, keys and values to the host",
            source: e,
        })
    })?;
    Ok(host)
}

/// The rows of a ring of `capacity` rows that hold `positions` (row `p % capacity`), as at
/// most two runs.
fn tail_rows(positions: Range<usize>, capacity: usize) -> impl Iterator<Item = Range<u32>> {
    let start = positions.start % capacity;
    let len = positions.len().min(capacity);
    let first = start..(start + len).min(capacity);
    let wrapped = 0..(start + len).saturating_sub(capacity);
    [first, wrapped]
        .into_iter()
        .filter(|r| !r.is_empty())
        .map(|r| r.start as u32..r.end as u32)
}

#[cfg(test)]
mod tests {
    use super::tail_rows;

    #[test]
    fn tail_rows_wrap_around_the_ring() {
        let rows = |p: std::ops::Range<usize>, c| tail_rows(p, c).collect::<Vec<_>>();
        assert_eq!(rows(100..101, 8), vec![4..5]);
        assert_eq!(rows(100..104, 8), vec![4..8]);
        assert_eq!(rows(100..106, 8), vec![4..8, 0..2]);
        assert_eq!(rows(96..104, 8), vec![0..8]);
        assert_eq!(rows(5..5, 8), Vec::<std::ops::Range<u32>>::new());
    }
}
