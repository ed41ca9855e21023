//! The forward pass on an NVIDIA GPU (feature `gpu`): the same transformer as
//! [`Model::forward`], written on kvdb-kernels (NVRTC kernels and cuBLASLt GEMMs loaded at run
//! time), so that every machine builds it without a CUDA toolkit.
//!
//! Weights are taken from a CPU [`Model`] loaded with dequantized weights (the same numbers
//! the CPU computes with), converted once to the precision's GEMM type and uploaded. The
//! residual stream and every projection's output are f32; GEMM inputs are bf16
//! ([`Precision::Bf16`]) or f32 ([`Precision::F32`], the exact mode the tests compare with
//! the CPU); each layer's rotated keys and values live in a [`KvCache`] of f16 (or f32),
//! a ring of `window + chunk` rows for sliding-window layers.

use std::marker::PhantomData;
use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use candle_core::{Device, Tensor};
use half::{bf16, f16};
use kvdb_kernels::cudarc::driver::{CudaEvent, CudaSlice, CudaView, CudaViewMut};
use kvdb_kernels::ops::{
    self, GateActivation, Norm, QkvShape, QueryRows, RopePairs, Rotary, StoreRows,
};
use kvdb_kernels::{
    dense_attention, prefill_attention, Causal, Dense, Float, Gemm, Gpu, KernelError, KvCache,
    Query, Workspace,
};
use rayon::prelude::*;

use crate::config::{Activation, LayerKind, ModelConfig, RopeStyle};
use crate::error::{ModelError, Result};
use crate::forward::{
    check_call, preload_widened, sampled_positions, Forward, SampledQueries, SequenceOptions,
    StoredKv,
};
use crate::graphs::StepGraphs;
use crate::model::{Linear, Logits, Model, RmsNorm};

/// Rows one launch sequence processes at most: longer calls run in chunks of this many
/// tokens, which bounds the activations' memory; sliding-window rings hold this many rows
/// beyond the window.
pub const MAX_CHUNK: usize = 4096;

/// The arithmetic of the GPU forward pass.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Precision {
    /// bf16 weights and GEMM inputs, f16 keys, values and queries, f32 accumulation and
    /// residual stream: the fast mode.
    #[default]
    Bf16,
    /// f32 everywhere (GEMMs without TF32): the CPU's numbers to rounding, for tests.
    F32,
}

/// A model's weights on the GPU.
pub struct GpuModel {
    weights: Weights,
}

enum Weights {
    Bf16(Inner<bf16, f16>),
    F32(Inner<f32, f32>),
}

impl std::fmt::Debug for GpuModel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (config, precision, gpu) = match &self.weights {
            Weights::Bf16(m) => (&m.config, Precision::Bf16, &m.gpu),
            Weights::F32(m) => (&m.config, Precision::F32, &m.gpu),
        };
        f.debug_struct("GpuModel")
            .field("architecture", &config.architecture)
            .field("precision", &precision)
            .field("gpu", gpu)
            .finish_non_exhaustive()
    }
}

impl GpuModel {
    /// Uploads `model`'s weights (it must have been loaded with
    /// [`crate::WeightMode::Dequantized`], so that every projection has f32 weights).
    /// Head dimensions other than multiples of 16 up to 256 (bf16) or up to 256 (f32) are
    /// refused here, before any weight is uploaded.
    pub fn new(model: &Model, gpu: Arc<Gpu>, precision: Precision) -> Result<Self> {
        if model.released {
            return Err(ModelError::WeightsReleased);
        }
        let d = model.config().head_dim;
        let supported = match precision {
            Precision::Bf16 => d.is_multiple_of(16) && (16..=256).contains(&d),
            Precision::F32 => d.is_multiple_of(2) && (2..=256).contains(&d),
        };
        if !supported {
            return Err(ModelError::Tensor {
                name: "attention heads".into(),
                reason: format!(
                    "head dimension {d} is not supported on the GPU ({precision:?}: multiples \
                     of 16 up to 256 in bf16, even sizes up to 256 in f32)"
                ),
            });
        }
        let weights = match precision {
            Precision::Bf16 => Weights::Bf16(Inner::new(model, gpu)?),
            Precision::F32 => Weights::F32(Inner::new(model, gpu)?),
        };
        Ok(Self { weights })
    }

    /// The model's configuration.
    pub fn config(&self) -> &ModelConfig {
        match &self.weights {
            Weights::Bf16(m) => &m.config,
            Weights::F32(m) => &m.config,
        }
    }

    /// The device.
    pub fn gpu(&self) -> &Arc<Gpu> {
        match &self.weights {
            Weights::Bf16(m) => &m.gpu,
            Weights::F32(m) => &m.gpu,
        }
    }

    /// Whether calls of a few tokens (decode steps, a sequence's or a batch's) run each
    /// layer's work besides its attention from CUDA graphs, captured at the second call of a
    /// number of tokens and launched once a layer after that: on by default; off, every
    /// kernel is launched as in a prefill. The same kernels run either way, so the results
    /// are the same; a small model's step is faster with them (its kernels are about as short
    /// as their launches). Applies to calls made after it.
    pub fn set_step_graphs(&self, on: bool) {
        match &self.weights {
            Weights::Bf16(m) => m.step_graphs.store(on, Ordering::Relaxed),
            Weights::F32(m) => m.step_graphs.store(on, Ordering::Relaxed),
        }
    }

    /// CUDA graphs of layers launched so far (see [`GpuModel::set_step_graphs`]), over every
    /// sequence of this model.
    pub fn step_graph_launches(&self) -> u64 {
        match &self.weights {
            Weights::Bf16(m) => m.graph_launches.load(Ordering::Relaxed),
            Weights::F32(m) => m.graph_launches.load(Ordering::Relaxed),
        }
    }

    /// A fresh sequence state on the GPU.
    pub fn sequence(&self, options: &SequenceOptions) -> Result<Box<dyn Forward + '_>> {
        Ok(match &self.weights {
            Weights::Bf16(m) => Box::new(Sequence::new(m, options, None)?),
            Weights::F32(m) => Box::new(Sequence::new(m, options, None)?),
        })
    }

    /// A sequence that continues a context of `external.first_position` tokens held
    /// elsewhere: at `external.layers` the caller's [`LayerAttention`] attends (a stored
    /// corpus's retrieval layers), and the sequence keeps only its own tokens' rows there;
    /// the other layers must be preloaded as usual. Needs [`Precision::Bf16`] (the retrieval
    /// kernels take f16 keys) and no [`SequenceOptions::store_kv`].
    pub fn sequence_with<'s>(
        &'s self,
        options: &SequenceOptions,
        external: ExternalAttention<'s>,
    ) -> Result<Box<dyn Forward + 's>> {
        let refuse = |reason: &str| ModelError::Backend {
            layer: external.layers.first().copied().unwrap_or(0),
            reason: reason.into(),
        };
        if options.store_kv {
            return Err(refuse(
                "a sequence with external attention cannot store its rows",
            ));
        }
        match &self.weights {
            Weights::Bf16(m) => Ok(Box::new(Sequence::new(m, options, Some(external))?)),
            Weights::F32(_) => Err(refuse(
                "external attention needs bf16 precision (the retrieval kernels take f16 keys)",
            )),
        }
    }

    /// Sequences decoded together: one per entry of `externals`, each continuing its own
    /// context as [`GpuModel::sequence_with`] makes it (`Some`) or fresh (`None`).
    /// [`Batch::step`] runs one token of several of them through the weights at once.
    pub fn batch_with<'s>(
        &'s self,
        externals: Vec<Option<ExternalAttention<'s>>>,
    ) -> Result<Box<dyn Batch + 's>> {
        let options = SequenceOptions::default();
        match &self.weights {
            Weights::Bf16(m) => Ok(Box::new(SequenceBatch::new(m, &options, externals)?)),
            Weights::F32(m) => match externals.iter().flatten().next() {
                Some(external) => Err(ModelError::Backend {
                    layer: external.layers.first().copied().unwrap_or(0),
                    reason: "external attention needs bf16 precision (the retrieval kernels \
                             take f16 keys)"
                        .into(),
                }),
                None => Ok(Box::new(SequenceBatch::new(m, &options, externals)?)),
            },
        }
    }

    /// Layer `layer`'s pre-RoPE keys and values as the store keeps them (f16, `[n_kv_heads,
    /// tokens, head_dim]` each), uploaded as they are and the keys rotated at `positions` on
    /// the GPU, in a buffer of their own: the corpus side of [`ExternalAttention`]. The
    /// rotation is the one that places a sequence's own rows, so both attend to the same
    /// numbers.
    pub fn rotated_kv(
        &self,
        layer: usize,
        keys: &[f16],
        values: &[f16],
        positions: Range<usize>,
    ) -> Result<KvCache<f16>> {
        let Weights::Bf16(m) = &self.weights else {
            return Err(ModelError::Backend {
                layer,
                reason: "f16 keys come from a bf16 model".into(),
            });
        };
        m.rotated_stored(layer, keys, values, positions)?
            .ok_or_else(|| ModelError::Internal("f16 keys were not uploaded as f16".into()))
    }
}

/// Attention that the caller of [`GpuModel::sequence_with`] computes at some layers.
pub trait LayerAttention {
    /// One forward call's attention at a claimed layer: writes `call.out`.
    fn attend(&mut self, call: LayerCall<'_>) -> Result<()>;
}

/// Which layers a [`LayerAttention`] computes, and where the sequence starts.
pub struct ExternalAttention<'h> {
    /// The claimed layers (global layers only: a sliding-window layer keeps its ring).
    pub layers: Vec<usize>,
    /// Rows the sequence keeps per claimed layer: its own tokens (e.g. a question and its
    /// answer) at most.
    pub tail_capacity: usize,
    /// The position of the sequence's first token (the tokens before it are elsewhere).
    pub first_position: usize,
    /// The attention of the claimed layers.
    pub attention: &'h mut dyn LayerAttention,
}

impl std::fmt::Debug for ExternalAttention<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ExternalAttention")
            .field("layers", &self.layers)
            .field("tail_capacity", &self.tail_capacity)
            .field("first_position", &self.first_position)
            .finish_non_exhaustive()
    }
}

/// One forward call at a claimed layer: the call's tokens at `positions`.
#[derive(Debug)]
pub struct LayerCall<'a> {
    /// The device, with the stream the call's work is queued on.
    pub gpu: &'a Gpu,
    /// Whether that stream is a lane of a batched step, which the step waits for as a
    /// whole: work queued there after the attention delays only the rows queued after it
    /// on the lane, so side work may go there rather than to a stream of its own (which
    /// costs an event record and wait each way).
    pub own_stream: bool,
    /// The layer.
    pub layer: usize,
    /// The positions of the call's tokens.
    pub positions: Range<usize>,
    /// Scale of `q · k`.
    pub scale: f32,
    /// Queries rotated at their positions, `[tokens, heads, head_dim]`.
    pub queries: CudaView<'a, f16>,
    /// The same queries before RoPE (what indexes search with), f32.
    pub raw_queries: CudaView<'a, f32>,
    /// The call's keys before RoPE and values, `[tokens, kv_heads, head_dim]` each.
    pub raw_keys: CudaView<'a, f16>,
    /// See `raw_keys`.
    pub raw_values: CudaView<'a, f16>,
    /// The sequence's own rows at this layer, rotated: position `p` (from the first
    /// position on, this call's included) at row `p % tail.tokens()` of every KV head.
    pub tail: &'a KvCache<f16>,
    /// The attention output, `[tokens, heads, head_dim]`.
    pub out: CudaViewMut<'a, f32>,
}

/// An attention element type: f16 attends decode steps with the flash-decoding kernel,
/// which splits the keys over blocks (a global layer's prefix, a sliding window's rows of
/// its ring); f32 (the exact mode) with the prefill kernel.
trait AttentionType: Float {
    /// Whether [`AttentionType::flash_decode`] exists for this type.
    const FLASH_DECODE: bool;

    /// Runs one decode step's attention over `runs` of `kv`'s rows (at most two) with flash
    /// decoding.
    fn flash_decode(
        gpu: &Gpu,
        workspace: &mut Workspace,
        query: &CudaSlice<Self>,
        scale: f32,
        kv: &KvCache<Self>,
        runs: &[Range<u32>],
        out: &mut CudaViewMut<'_, f32>,
    ) -> Result<()>;

    /// Hands a claimed layer's call to `attention` (f16 only; [`GpuModel::sequence_with`]
    /// makes no other).
    fn external(attention: &mut dyn LayerAttention, call: ExternalCall<'_, Self>) -> Result<()>;

    /// Stored keys and values (f16, `[kv_heads, tokens, head_dim]` each) uploaded as they are,
    /// `None` where this type is not the store's (f32: the exact mode widens them on the host).
    fn upload_stored(
        gpu: &Gpu,
        keys: &[f16],
        values: &[f16],
        kv_heads: usize,
        head_dim: usize,
    ) -> Result<Option<KvCache<Self>>>;
}

/// A claimed layer's call before it is typed as f16.
struct ExternalCall<'a, A> {
    gpu: &'a Gpu,
    own_stream: bool,
    layer: usize,
    positions: Range<usize>,
    scale: f32,
    queries: CudaView<'a, A>,
    raw_queries: CudaView<'a, f32>,
    raw_keys: CudaView<'a, f16>,
    raw_values: CudaView<'a, f16>,
    tail: &'a KvCache<A>,
    out: CudaViewMut<'a, f32>,
}

impl AttentionType for f16 {
    const FLASH_DECODE: bool = true;

    fn flash_decode(
        gpu: &Gpu,
        workspace: &mut Workspace,
        query: &CudaSlice<Self>,
        scale: f32,
        kv: &KvCache<Self>,
        runs: &[Range<u32>],
        out: &mut CudaViewMut<'_, f32>,
    ) -> Result<()> {
        let heads = query.as_view();
        let query = Query {
            heads: &heads,
            scale,
        };
        Ok(dense_attention(
            gpu,
            workspace,
            query,
            Dense { kv, runs },
            out,
        )?)
    }

    fn external(attention: &mut dyn LayerAttention, call: ExternalCall<'_, Self>) -> Result<()> {
        attention.attend(LayerCall {
            gpu: call.gpu,
            own_stream: call.own_stream,
            layer: call.layer,
            positions: call.positions,
            scale: call.scale,
            queries: call.queries,
            raw_queries: call.raw_queries,
            raw_keys: call.raw_keys,
            raw_values: call.raw_values,
            tail: call.tail,
            out: call.out,
        })
    }

    fn upload_stored(
        gpu: &Gpu,
        keys: &[f16],
        values: &[f16],
        kv_heads: usize,
        head_dim: usize,
    ) -> Result<Option<KvCache<Self>>> {
        Ok(Some(KvCache::upload(
            gpu, keys, values, kv_heads, head_dim,
        )?))
    }
}

impl AttentionType for f32 {
    const FLASH_DECODE: bool = false;

    fn flash_decode(
        _: &Gpu,
        _: &mut Workspace,
        _: &CudaSlice<Self>,
        _: f32,
        _: &KvCache<Self>,
        _: &[Range<u32>],
        _: &mut CudaViewMut<'_, f32>,
    ) -> Result<()> {
        Err(ModelError::Backend {
            layer: 0,
            reason: "no flash decoding for f32 keys".into(),
        })
    }

    fn external(_: &mut dyn LayerAttention, call: ExternalCall<'_, Self>) -> Result<()> {
        Err(ModelError::Backend {
            layer: call.layer,
            reason: "external attention takes f16 keys".into(),
        })
    }

    fn upload_stored(
        _: &Gpu,
        _: &[f16],
        _: &[f16],
        _: usize,
        _: usize,
    ) -> Result<Option<KvCache<Self>>> {
        Ok(None)
    }
}

/// Sequences decoded together ([`GpuModel::batch_with`]): a step runs one token of each of
/// several sequences through every layer's weights once, as the rows of one product, and
/// attends each row in its own sequence (its own positions, rows and external attention).
/// At batch 1 a decode step reads all of the weights for one token; here for all of them.
/// Prompts and preloads go through each sequence's own [`Forward`].
pub trait Batch {
    /// Sequences in the batch.
    fn sequences(&self) -> usize;

    /// Sequence `b`, for what runs it alone (its prompt, its preloaded rows).
    fn sequence(&mut self, b: usize) -> Result<&mut dyn Forward>;

    /// One decode step: each `(b, id)` runs token `id` at sequence `b`'s next position
    /// (a sequence at most once per step). Returns what `pick` asks of each token's logits,
    /// in the order given.
    fn step(&mut self, tokens: &[(usize, u32)], pick: Pick) -> Result<BatchStep>;
}

/// What a decode step returns for each of its tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pick {
    /// The logits, to sample from on the host.
    Logits,
    /// Only the greedy choice of the next token ([`crate::greedy_token`]), picked on the GPU:
    /// 4 bytes a token cross to the host instead of a vocabulary's logits.
    Greedy,
}

/// What a decode step returned, as [`Pick`] asked.
#[derive(Debug)]
pub enum Picked {
    /// The logits `[tokens, vocab]` (f32, on the host).
    Logits(Tensor),
    /// Each token's greedy choice of the next.
    Greedy(Vec<u32>),
}

/// What a [`Batch::step`] gives back.
#[derive(Debug)]
pub struct BatchStep {
    /// What the step picked, in the order of its tokens.
    pub picked: Picked,
    /// Seconds the host spent queuing the layers' work; the rest of the step waited for the
    /// GPU to run it and copied the logits. Where this is most of the step, the step is
    /// bound by the host's launches, not by the GPU.
    pub queued_seconds: f64,
}

/// The GPU's [`Batch`].
struct SequenceBatch<'m, T, A> {
    model: &'m Inner<T, A>,
    sequences: Vec<Sequence<'m, T, A>>,
    /// The step's activations, a row per token.
    scratch: Option<Scratch<T, A>>,
    picks: PickBuffers,
    /// The streams the rows' attention runs on in a step of several rows, up to
    /// [`LANES`]; made on the first such step.
    lanes: Vec<Lane>,
    /// Recorded on the model's stream once a layer's projections are written, for the
    /// lanes to wait for.
    projected: CudaEvent,
    /// The step's pre-RoPE rows at a layer that every row's sequence claims.
    raw: Option<RawRows>,
}

/// A stream of a batched step's attention. A decode step's attention of one row is a few
/// small launches that fill a fraction of the GPU (one query group a KV head, a step's
/// selection), one after another; on one stream the rows of a step queue behind each
/// other, on lanes they run side by side, and the model's stream waits for each lane's
/// `done` before the output projection reads the rows.
struct Lane {
    gpu: Gpu,
    done: CudaEvent,
}

/// Lanes of a batched step: row `r` goes to lane `r % LANES`. Each lane costs three driver
/// calls a layer (its wait for the projections, its record, the model stream's wait; about
/// 2.5 µs each measured on an H200), and the step is bound by the host queuing launches,
/// not by the GPU running a lane's rows one after another: with four lanes instead of one
/// a question (and one conversion for all rows), 16 questions of the Llama-3-8B shape took
/// 17.9 ms a step instead of 22.6 (docs/benchmarks.md, "Fewer driver calls a question").
const LANES: usize = 4;

impl<'m, T: Float, A: AttentionType> SequenceBatch<'m, T, A> {
    fn new(
        model: &'m Inner<T, A>,
        options: &SequenceOptions,
        externals: Vec<Option<ExternalAttention<'m>>>,
    ) -> Result<Self> {
        Ok(Self {
            model,
            sequences: externals
                .into_iter()
                .map(|external| Sequence::new(model, options, external))
                .collect::<Result<_>>()?,
            scratch: None,
            picks: PickBuffers::new(&model.gpu)?,
            lanes: Vec::new(),
            projected: model.gpu.event()?,
            raw: None,
        })
    }
}

impl<T: Float, A: AttentionType> Batch for SequenceBatch<'_, T, A> {
    fn sequences(&self) -> usize {
        self.sequences.len()
    }

    fn sequence(&mut self, b: usize) -> Result<&mut dyn Forward> {
        let n = self.sequences.len();
        match self.sequences.get_mut(b) {
            Some(sequence) => Ok(sequence),
            None => Err(ModelError::BatchStep(format!(
                "sequence {b} of a batch of {n}"
            ))),
        }
    }

    fn step(&mut self, tokens: &[(usize, u32)], pick: Pick) -> Result<BatchStep> {
        let model = self.model;
        let (gpu, c) = (&*model.gpu, &model.config);
        let rows = tokens.len();
        if rows > MAX_CHUNK {
            return Err(ModelError::BatchStep(format!(
                "{rows} tokens in one step, at most {MAX_CHUNK}"
            )));
        }
        let mut seen = vec![false; self.sequences.len()];
        for &(b, id) in tokens {
            let Some(sequence) = self.sequences.get(b) else {
                return Err(ModelError::BatchStep(format!(
                    "sequence {b} of a batch of {}",
                    self.sequences.len()
                )));
            };
            if std::mem::replace(&mut seen[b], true) {
                return Err(ModelError::BatchStep(format!(
                    "sequence {b} given twice in one step"
                )));
            }
            check_call(c, &[id], sequence.position, &Logits::Last)?;
        }
        if rows == 0 {
            return Ok(BatchStep {
                picked: HostPicks::empty(pick).into_picked(0, c.vocab_size)?,
                queued_seconds: 0.0,
            });
        }
        for &(b, _) in tokens {
            self.sequences[b].prepare(1)?;
        }
        let mut s = match self.scratch.take() {
            Some(s) if s.rows >= rows => s,
            _ => Scratch::new(gpu, c, rows.next_power_of_two().min(MAX_CHUNK))?,
        };
        let lanes = match rows {
            1 => 0,
            _ => rows.min(LANES),
        };
        while self.lanes.len() < lanes {
            self.lanes.push(Lane {
                gpu: gpu.fork()?,
                done: gpu.event()?,
            });
        }
        let ids: Vec<u32> = tokens.iter().map(|&(_, id)| id).collect();
        let (q_dim, qkv_dim) = attention_dims(c);
        let kv_dim = c.n_kv_heads * c.head_dim;
        let mut raw = RawRows::at_least(self.raw.take(), gpu, c, rows)?;
        let (sequences, projected) = (&mut self.sequences, &self.projected);
        let lanes = &self.lanes[..lanes];
        let started = std::time::Instant::now();
        let ran = run_layers(model, &mut s, &ids, &mut |i, s| {
            // Where every row's sequence claims the layer, one launch places all rows'
            // inputs rather than one a row.
            let placed = tokens.iter().all(|&(b, _)| sequences[b].claims(i));
            if placed {
                place_step_rows(model, i, sequences, tokens, s, &mut raw)?;
            }
            if !lanes.is_empty() {
                gpu.record(projected)?;
            }
            for lane in lanes {
                lane.gpu.wait(projected)?;
            }
            // Rows whose attention came in f32, as runs of consecutive rows.
            let mut staged: Vec<Range<usize>> = Vec::new();
            for (row, &(b, _)) in tokens.iter().enumerate() {
                let (q, qkv) = (
                    row * q_dim..(row + 1) * q_dim,
                    row * qkv_dim..(row + 1) * qkv_dim,
                );
                // Rows disjoint in the scratch: each lane writes its own.
                let lane = lanes.get(row % LANES).map(|l| &l.gpu);
                let f32_row = match placed {
                    true => {
                        sequences[b].attend_placed(
                            lane,
                            i,
                            1,
                            s.queries.slice(q.clone()),
                            raw.views(row..row + 1, q_dim, kv_dim),
                            s.f32_out.slice_mut(q),
                        )?;
                        true
                    }
                    false => sequences[b].attend_layer(
                        lane,
                        i,
                        1,
                        &s.qkv.slice(qkv),
                        &mut s.queries.slice_mut(q.clone()),
                        &mut s.attention.slice_mut(q.clone()),
                        &mut s.f32_out.slice_mut(q),
                    )?,
                };
                match staged.last_mut() {
                    Some(run) if f32_row && run.end == row => run.end += 1,
                    _ if f32_row => staged.push(row..row + 1),
                    _ => {}
                }
            }
            for lane in lanes {
                lane.gpu.record(&lane.done)?;
                gpu.wait(&lane.done)?;
            }
            if staged.is_empty() {
                return converge_attention::<A, T>(gpu, s, rows, i, None, q_dim);
            }
            for run in staged {
                converge_attention::<A, T>(gpu, s, rows, i, Some(run), q_dim)?;
            }
            Ok(())
        });
        let queued_seconds = started.elapsed().as_secs_f64();
        self.raw = Some(raw);
        let picked = ran.and_then(|()| {
            for &(b, _) in tokens {
                self.sequences[b].position += 1;
            }
            let all: Vec<usize> = (0..rows).collect();
            pick_rows(model, &mut s, &all, &mut self.picks, pick)
        });
        self.scratch = Some(s);
        Ok(BatchStep {
            picked: picked?.into_picked(rows, c.vocab_size)?,
            queued_seconds,
        })
    }
}

/// An RMS norm's scale on the GPU.
struct GpuNorm {
    weight: CudaSlice<f32>,
    eps: f32,
}

/// One transformer layer's weights. Projections are `[out, in]` in `T`.
struct GpuLayer<T> {
    attn_norm: GpuNorm,
    /// Q, K and V stacked, `[(heads + 2 kv_heads) · head_dim, hidden]`.
    qkv: CudaSlice<T>,
    qkv_bias: Option<CudaSlice<f32>>,
    wo: CudaSlice<T>,
    q_norm: Option<GpuNorm>,
    k_norm: Option<GpuNorm>,
    post_attn_norm: Option<GpuNorm>,
    ffn_norm: GpuNorm,
    /// Gate and up stacked, `[2 · intermediate, hidden]`.
    gate_up: CudaSlice<T>,
    down: CudaSlice<T>,
    post_ffn_norm: Option<GpuNorm>,
    inv_freq: CudaSlice<f64>,
    pairs: RopePairs,
    window: Option<usize>,
}

/// Views of a layer's attention-input parameters, for [`ops::attention_inputs`] and
/// batched steps' rows ([`InputViews::parts`]).
struct InputViews<'a> {
    bias: Option<CudaView<'a, f32>>,
    q_norm: Option<(CudaView<'a, f32>, f32)>,
    k_norm: Option<(CudaView<'a, f32>, f32)>,
    inv_freq: CudaView<'a, f64>,
    pairs: RopePairs,
}

impl<'a> InputViews<'a> {
    fn of<T>(layer: &'a GpuLayer<T>) -> Self {
        let norm = |n: &'a Option<GpuNorm>| n.as_ref().map(|n| (n.weight.as_view(), n.eps));
        Self {
            bias: layer.qkv_bias.as_ref().map(|b| b.as_view()),
            q_norm: norm(&layer.q_norm),
            k_norm: norm(&layer.k_norm),
            inv_freq: layer.inv_freq.as_view(),
            pairs: layer.pairs,
        }
    }

    /// The bias, query and key norms and rotary embedding.
    fn parts(
        &self,
    ) -> (
        Option<&CudaView<'a, f32>>,
        Option<Norm<'_>>,
        Option<Norm<'_>>,
        Rotary<'_>,
    ) {
        (
            self.bias.as_ref(),
            norm_of(&self.q_norm),
            norm_of(&self.k_norm),
            Rotary {
                inv_freq: &self.inv_freq,
                pairs: self.pairs,
            },
        )
    }
}

/// A norm's weight and eps as [`Norm`] (the GGUF weights hold Gemma's `1 +` already).
fn norm_of<'b>(norm: &'b Option<(CudaView<'_, f32>, f32)>) -> Option<Norm<'b>> {
    norm.as_ref().map(|(weight, eps)| Norm {
        weight,
        eps: *eps,
        offset: 0.0,
    })
}

/// The weights of one precision: `T` the GEMM type, `A` the attention type.
struct Inner<T, A> {
    gpu: Arc<Gpu>,
    gemm: Gemm,
    config: ModelConfig,
    activation: GateActivation,
    /// `[vocab, hidden]`, also the output projection when the model ties them.
    embedding: CudaSlice<T>,
    embedding_scale: f32,
    layers: Vec<GpuLayer<T>>,
    output_norm: GpuNorm,
    /// `[vocab, hidden]`; `None` when tied to the embedding.
    output: Option<CudaSlice<T>>,
    /// Whether short calls run their layers from CUDA graphs ([`GpuModel::set_step_graphs`]).
    step_graphs: AtomicBool,
    /// CUDA graphs launched so far ([`GpuModel::step_graph_launches`]).
    graph_launches: AtomicU64,
    _attention: PhantomData<A>,
}

/// f32 values of a CPU tensor, row-major.
fn host_f32(t: &Tensor) -> Result<Vec<f32>> {
    Ok(t.flatten_all()?.to_vec1::<f32>()?)
}

/// Appends a CPU tensor's f32 values, row-major, to `out` as `T`, converted on every core
/// straight from the tensor's storage: loading a model onto the GPU converts gigabytes of
/// weights, and a copy per tensor (and per stacking) made that stage most of the load.
fn extend_converted<T: Float>(out: &mut Vec<T>, t: &Tensor) -> Result<()> {
    let (storage, layout) = t.storage_and_layout();
    if let (candle_core::Storage::Cpu(cpu), Some((start, end))) =
        (&*storage, layout.contiguous_offsets())
    {
        let values = &cpu.as_slice::<f32>()?[start..end];
        out.par_extend(values.par_iter().map(|&x| T::from_f32(x)));
        return Ok(());
    }
    // Not a contiguous CPU tensor (the loader makes none such): through a copy.
    drop(storage);
    let values = host_f32(t)?;
    out.par_extend(values.par_iter().map(|&x| T::from_f32(x)));
    Ok(())
}

/// A CPU tensor's f32 values as `T`, row-major.
fn converted<T: Float>(t: &Tensor) -> Result<Vec<T>> {
    let mut out = Vec::with_capacity(t.elem_count());
    extend_converted(&mut out, t)?;
    Ok(out)
}

/// The kernels' name for which dimensions a RoPE style pairs.
pub fn rope_pairs(style: RopeStyle) -> RopePairs {
    match style {
        RopeStyle::Halves => RopePairs::Halves,
        RopeStyle::Interleaved => RopePairs::Interleaved,
    }
}

fn upload_norm(gpu: &Gpu, norm: &RmsNorm) -> Result<GpuNorm> {
    Ok(GpuNorm {
        weight: gpu.upload(&host_f32(&norm.weight)?)?,
        eps: norm.eps,
    })
}

/// The weights of projections computed together as `T`, stacked by rows, and their f32
/// biases (zeros for a part without one) when any part has one.
fn stacked<T: Float>(parts: &[&Linear]) -> Result<(Vec<T>, Option<Vec<f32>>)> {
    let weights = parts
        .iter()
        .map(|part| {
            part.dense.as_ref().ok_or_else(|| ModelError::Tensor {
                name: "projection".into(),
                reason: "the GPU model needs dequantized weights (WeightMode::Dequantized)".into(),
            })
        })
        .collect::<Result<Vec<&Tensor>>>()?;
    let mut stacked = Vec::with_capacity(weights.iter().map(|w| w.elem_count()).sum());
    let mut widths = Vec::new();
    for w in &weights {
        widths.push(w.dim(0)?);
        extend_converted(&mut stacked, w)?;
    }
    let bias = if parts.iter().any(|p| p.bias.is_some()) {
        let mut bias = Vec::new();
        for (part, width) in parts.iter().zip(&widths) {
            match &part.bias {
                Some(b) => bias.extend(host_f32(b)?),
                None => bias.extend(std::iter::repeat_n(0.0, *width)),
            }
        }
        Some(bias)
    } else {
        None
    };
    Ok((stacked, bias))
}

impl<T: Float, A: AttentionType> Inner<T, A> {
    /// Layer `layer`'s stored keys and values (f16, `[n_kv_heads, tokens, head_dim]` each)
    /// uploaded as they are and the keys rotated at `positions` on the GPU, in a buffer of
    /// their own (`None` where `A` is not f16). The rotation is the one that places a
    /// sequence's own rows, so both attend to the same numbers.
    fn rotated_stored(
        &self,
        layer: usize,
        keys: &[f16],
        values: &[f16],
        positions: Range<usize>,
    ) -> Result<Option<KvCache<A>>> {
        let c = &self.config;
        let gpu_layer = self.layers.get(layer).ok_or_else(|| ModelError::Backend {
            layer,
            reason: format!("the model has {} layers", self.layers.len()),
        })?;
        let expected = c.n_kv_heads * positions.len() * c.head_dim;
        if keys.len() != expected || values.len() != expected {
            return Err(ModelError::Backend {
                layer,
                reason: format!(
                    "{} positions of keys and values need {expected} halves each, got {} and {}",
                    positions.len(),
                    keys.len(),
                    values.len()
                ),
            });
        }
        let Some(mut kv) = A::upload_stored(&self.gpu, keys, values, c.n_kv_heads, c.head_dim)?
        else {
            return Ok(None);
        };
        let inv_freq = gpu_layer.inv_freq.as_view();
        let rotary = Rotary {
            inv_freq: &inv_freq,
            pairs: gpu_layer.pairs,
        };
        ops::rotate_keys(&self.gpu, &mut kv, &rotary, positions.start)?;
        Ok(Some(kv))
    }

    fn new(model: &Model, gpu: Arc<Gpu>) -> Result<Self> {
        let gemm = Gemm::new(&gpu)?;
        let config = model.config().clone();
        let g = &*gpu;
        let mut layers = Vec::with_capacity(config.n_layers());
        for (layer, spec) in model.layers.iter().zip(&config.layers) {
            let (qkv, qkv_bias) = stacked::<T>(&layer.qkv.parts.iter().collect::<Vec<_>>())?;
            let (gate_up, _) = stacked::<T>(&layer.gate_up.parts.iter().collect::<Vec<_>>())?;
            let (wo, _) = stacked::<T>(&[&layer.wo])?;
            let (down, _) = stacked::<T>(&[&layer.down])?;
            let optional = |n: &Option<RmsNorm>| n.as_ref().map(|n| upload_norm(g, n)).transpose();
            let inv_freq: Vec<f64> = layer.rope.inv_freq().to_vec();
            layers.push(GpuLayer {
                attn_norm: upload_norm(g, &layer.attn_norm)?,
                qkv: g.upload(&qkv)?,
                qkv_bias: qkv_bias.map(|b| g.upload(&b)).transpose()?,
                wo: g.upload(&wo)?,
                q_norm: optional(&layer.q_norm)?,
                k_norm: optional(&layer.k_norm)?,
                post_attn_norm: optional(&layer.post_attn_norm)?,
                ffn_norm: upload_norm(g, &layer.ffn_norm)?,
                gate_up: g.upload(&gate_up)?,
                down: g.upload(&down)?,
                post_ffn_norm: optional(&layer.post_ffn_norm)?,
                inv_freq: g.upload(&inv_freq)?,
                pairs: rope_pairs(spec.rope.style),
                window: match spec.kind {
                    LayerKind::Global => None,
                    LayerKind::SlidingWindow { window } => Some(window),
                },
            });
        }
        let embedding = converted::<T>(&model.embedding.dequantize(&candle_core::Device::Cpu)?)?;
        let output = match &model.output.dense {
            Some(w) if !model.output_tied => Some(g.upload(&converted::<T>(w)?)?),
            Some(_) => None,
            None => {
                return Err(ModelError::Tensor {
                    name: "output.weight".into(),
                    reason: "the GPU model needs dequantized weights (WeightMode::Dequantized)"
                        .into(),
                })
            }
        };
        Ok(Self {
            gemm,
            activation: match model.activation {
                Activation::GeluTanh => GateActivation::GeluTanh,
                Activation::Silu => GateActivation::Silu,
            },
            embedding: g.upload(&embedding)?,
            embedding_scale: config.embedding_scale.unwrap_or(1.0),
            layers,
            output_norm: upload_norm(g, &model.output_norm)?,
            output,
            config,
            gpu,
            step_graphs: AtomicBool::new(true),
            graph_launches: AtomicU64::new(0),
            _attention: PhantomData,
        })
    }
}

/// Activations of one chunk, grown to the longest chunk seen.
struct Scratch<T, A> {
    rows: usize,
    ids: CudaSlice<u32>,
    /// Residual stream `[rows, hidden]`.
    x: CudaSlice<f32>,
    /// Normed input of a projection `[rows, max(hidden, ...)]`.
    h: CudaSlice<T>,
    qkv: CudaSlice<f32>,
    queries: CudaSlice<A>,
    attention: CudaSlice<T>,
    /// Attention computed in f32 `[rows, heads · head_dim]` (see
    /// [`Sequence::attend_layer`]): read by the output projection itself in a decode step
    /// ([`attention_in_f32`]), otherwise converted into `attention` (in a batched step, all
    /// rows in one launch once the lanes are done).
    f32_out: CudaSlice<f32>,
    /// A projection's output before its post-norm `[rows, hidden]`.
    projected: CudaSlice<f32>,
    gate_up: CudaSlice<f32>,
    gated: CudaSlice<T>,
    /// The graphs of calls of these buffers.
    graphs: StepGraphs,
}

impl<T: Float, A: Float> Scratch<T, A> {
    fn new(gpu: &Gpu, c: &ModelConfig, rows: usize) -> Result<Self> {
        let (q_dim, qkv_dim) = attention_dims(c);
        Ok(Self {
            rows,
            ids: gpu.zeros(rows)?,
            x: gpu.zeros(rows * c.hidden_size)?,
            h: gpu.zeros(rows * c.hidden_size)?,
            qkv: gpu.zeros(rows * qkv_dim)?,
            queries: gpu.zeros(rows * q_dim)?,
            attention: gpu.zeros(rows * q_dim)?,
            f32_out: gpu.zeros(rows * q_dim)?,
            projected: gpu.zeros(rows * c.hidden_size)?,
            gate_up: gpu.zeros(rows * 2 * c.intermediate_size)?,
            gated: gpu.zeros(rows * c.intermediate_size)?,
            graphs: StepGraphs::default(),
        })
    }
}

/// One decode step's attention buffers for the flash-decoding kernel, which takes whole
/// buffers of one token's heads.
struct DecodeBuffers<A> {
    workspace: Workspace,
    queries: CudaSlice<A>,
}

/// The store's copy of one layer's chunk: pre-RoPE keys and values in f16, and a global
/// layer's sampled pre-RoPE queries (f32, `[sampled, heads, head_dim]`: only the sample, as
/// every row would take 4 bytes a query dimension of the chunk in every layer), each taken
/// once.
struct StoredChunk {
    keys: CudaSlice<f16>,
    values: CudaSlice<f16>,
    queries: CudaSlice<f32>,
    /// One position in this many keeps its queries ([`SequenceOptions::query_sample`]; 0 in
    /// a sliding-window layer or without a sample).
    every: usize,
    /// The call's first position and tokens.
    start: usize,
    tokens: usize,
    taken: bool,
    queries_taken: bool,
}

impl StoredChunk {
    /// Query elements the chunk's sample holds.
    fn query_len(&self, q_dim: usize) -> usize {
        match self.every {
            0 => 0,
            every => ops::sampled_rows(self.start, self.tokens, every) * q_dim,
        }
    }
}

/// Layer `layer`'s stored chunk where the part that `taken` flags was not taken yet, marked
/// taken: each part of a call's chunk is handed over once.
fn untaken(
    stored: &mut Option<Vec<StoredChunk>>,
    layer: usize,
    taken: fn(&mut StoredChunk) -> &mut bool,
) -> Option<&mut StoredChunk> {
    let chunk = stored.as_mut()?.get_mut(layer)?;
    let flag = taken(chunk);
    if *flag {
        return None;
    }
    *flag = true;
    Some(chunk)
}

/// A sequence's claimed layers ([`ExternalAttention`]) and the buffers of their calls.
struct External<'h> {
    attention: &'h mut dyn LayerAttention,
    /// Per layer of the model.
    claimed: Vec<bool>,
    /// Positions past this one do not fit the claimed layers' rings.
    end: usize,
    /// One call's pre-RoPE rows (taken while the call runs).
    raw: Option<RawRows>,
}

/// Pre-RoPE queries, keys and values of `rows` tokens (`[rows, heads · head_dim]` f32,
/// `[rows, kv_heads · head_dim]` f16 each), for what a claimed layer's attention searches
/// and stores.
struct RawRows {
    queries: CudaSlice<f32>,
    keys: CudaSlice<f16>,
    values: CudaSlice<f16>,
    rows: usize,
}

impl RawRows {
    /// `raw` if it holds `rows` rows, else new buffers that do.
    fn at_least(raw: Option<Self>, gpu: &Gpu, c: &ModelConfig, rows: usize) -> Result<Self> {
        match raw {
            Some(raw) if raw.rows >= rows => Ok(raw),
            _ => {
                let (q, kv) = (c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim);
                Ok(Self {
                    queries: gpu.zeros(rows * q)?,
                    keys: gpu.zeros(rows * kv)?,
                    values: gpu.zeros(rows * kv)?,
                    rows,
                })
            }
        }
    }

    /// Views of rows `rows` (query rows `heads · head_dim` long, key and value rows
    /// `kv_heads · head_dim`).
    fn views(&self, rows: Range<usize>, q: usize, kv: usize) -> RawViews<'_> {
        RawViews {
            queries: self.queries.slice(rows.start * q..rows.end * q),
            keys: self.keys.slice(rows.start * kv..rows.end * kv),
            values: self.values.slice(rows.start * kv..rows.end * kv),
        }
    }
}

/// Rows of a [`RawRows`].
struct RawViews<'a> {
    queries: CudaView<'a, f32>,
    keys: CudaView<'a, f16>,
    values: CudaView<'a, f16>,
}

impl<'h> External<'h> {
    fn new(
        c: &ModelConfig,
        windows: &[Option<usize>],
        external: ExternalAttention<'h>,
    ) -> Result<Self> {
        let mut claimed = vec![false; c.n_layers()];
        for &layer in &external.layers {
            match windows.get(layer) {
                Some(None) => claimed[layer] = true,
                found => {
                    return Err(ModelError::Backend {
                        layer,
                        reason: match found {
                            Some(Some(_)) => {
                                "a sliding-window layer's attention cannot be external".into()
                            }
                            _ => format!("the model has {} layers", c.n_layers()),
                        },
                    })
                }
            }
        }
        if external.tail_capacity == 0 {
            return Err(ModelError::Backend {
                layer: external.layers.first().copied().unwrap_or(0),
                reason: "external attention needs room for at least one token".into(),
            });
        }
        Ok(Self {
            attention: external.attention,
            claimed,
            end: external.first_position + external.tail_capacity,
            raw: None,
        })
    }
}

/// The GPU's [`Forward`].
struct Sequence<'m, T, A> {
    model: &'m Inner<T, A>,
    /// Attention the caller computes at some layers.
    external: Option<External<'m>>,
    position: usize,
    kv: Vec<KvCache<A>>,
    scratch: Option<Scratch<T, A>>,
    decode: Option<DecodeBuffers<A>>,
    stored: Option<Vec<StoredChunk>>,
    picks: PickBuffers,
}

impl<'m, T: Float, A: AttentionType> Sequence<'m, T, A> {
    fn new(
        model: &'m Inner<T, A>,
        options: &SequenceOptions,
        external: Option<ExternalAttention<'m>>,
    ) -> Result<Self> {
        let c = &model.config;
        let gpu = &*model.gpu;
        let windows: Vec<Option<usize>> = model.layers.iter().map(|l| l.window).collect();
        let position = external.as_ref().map_or(0, |e| e.first_position);
        let tail = external.as_ref().map_or(0, |e| e.tail_capacity);
        let external = external
            .map(|e| External::new(c, &windows, e))
            .transpose()?;
        let kv = model
            .layers
            .iter()
            .enumerate()
            .map(|(i, l)| {
                let claimed = external.as_ref().is_some_and(|e| e.claimed[i]);
                let capacity = match l.window {
                    Some(w) => w + MAX_CHUNK,
                    None if claimed => tail,
                    None => MAX_CHUNK.min(c.context_length),
                };
                KvCache::zeros(gpu, c.n_kv_heads, capacity, c.head_dim)
            })
            .collect::<kvdb_kernels::Result<Vec<_>>>()?;
        let stored = options
            .store_kv
            .then(|| {
                model
                    .layers
                    .iter()
                    .map(|layer| {
                        Ok(StoredChunk {
                            keys: gpu.zeros(1)?,
                            values: gpu.zeros(1)?,
                            queries: gpu.zeros(1)?,
                            every: if layer.window.is_none() {
                                options.query_sample
                            } else {
                                0
                            },
                            start: 0,
                            tokens: 0,
                            taken: true,
                            queries_taken: true,
                        })
                    })
                    .collect::<Result<Vec<_>>>()
            })
            .transpose()?;
        Ok(Self {
            model,
            external,
            position,
            kv,
            scratch: None,
            decode: None,
            stored,
            picks: PickBuffers::new(gpu)?,
        })
    }

    /// Makes sure global layers' buffers hold positions up to `end`.
    fn reserve(&mut self, end: usize) -> Result<()> {
        let gpu = &*self.model.gpu;
        let context = self.model.config.context_length;
        let external = self.external.as_ref();
        for (i, (kv, layer)) in self.kv.iter_mut().zip(&self.model.layers).enumerate() {
            let claimed = external.is_some_and(|e| e.claimed[i]);
            if layer.window.is_none() && !claimed && kv.tokens() < end {
                let capacity = end.max(2 * kv.tokens()).min(context).max(end);
                kv.grow(gpu, capacity, self.position)?;
            }
        }
        Ok(())
    }

    /// Makes the sequence's buffers ready for a call of `t` tokens at its position: the
    /// global layers' caches, the decode step's buffers, the external call's and the
    /// store's copy.
    fn prepare(&mut self, t: usize) -> Result<()> {
        let model = self.model;
        let (gpu, c) = (&*model.gpu, &model.config);
        let start = self.position;
        self.reserve(start + t)?;
        if t == 1 && A::FLASH_DECODE && self.decode.is_none() {
            let q_dim = c.n_heads * c.head_dim;
            self.decode = Some(DecodeBuffers {
                workspace: Workspace::new(gpu)?,
                queries: gpu.zeros(q_dim)?,
            });
        }
        if let Some(external) = self.external.as_mut() {
            if start + t > external.end {
                return Err(ModelError::ContextOverflow {
                    tokens: start + t,
                    context: external.end,
                });
            }
            external.raw = Some(RawRows::at_least(external.raw.take(), gpu, c, t)?);
        }
        if let Some(stored) = self.stored.as_mut() {
            let kv_rows = t * c.n_kv_heads * c.head_dim;
            for chunk in stored.iter_mut() {
                if chunk.keys.len() < kv_rows {
                    chunk.keys = gpu.zeros(kv_rows)?;
                    chunk.values = gpu.zeros(kv_rows)?;
                }
                (chunk.start, chunk.tokens) = (start, t);
                let query_len = chunk.query_len(c.n_heads * c.head_dim);
                if chunk.queries.len() < query_len {
                    chunk.queries = gpu.zeros(query_len)?;
                }
                chunk.taken = false;
                chunk.queries_taken = false;
            }
        }
        Ok(())
    }

    /// Whether layer `i`'s attention is the caller's ([`ExternalAttention`]).
    fn claims(&self, i: usize) -> bool {
        self.external.as_ref().is_some_and(|e| e.claimed[i])
    }

    /// Layer `i`'s attention for the sequence's next `t` tokens (made ready by
    /// [`Sequence::prepare`]): their projections `qkv` (`[t, (heads + 2 kv_heads) ·
    /// head_dim]`) place the keys and values, `queries` holds their rotated queries, and
    /// the attention goes to `attention` (`[t, heads · head_dim]`), or, where it is
    /// computed in f32 (a claimed layer, a decode step of a global layer), to `f32_out`
    /// (the same shape) for the caller to convert: returns whether it went there. Queued on the model's stream, or on `lane`'s (a lane of a
    /// batched step).
    #[allow(clippy::too_many_arguments)]
    fn attend_layer(
        &mut self,
        lane: Option<&Gpu>,
        i: usize,
        t: usize,
        qkv: &CudaView<'_, f32>,
        queries: &mut CudaViewMut<'_, A>,
        attention: &mut CudaViewMut<'_, T>,
        f32_out: &mut CudaViewMut<'_, f32>,
    ) -> Result<bool> {
        let model = self.model;
        let (gpu, c) = (lane.unwrap_or(&model.gpu), &model.config);
        let layer = &model.layers[i];
        let start = self.position;
        let (heads, kv_heads, d) = (c.n_heads, c.n_kv_heads, c.head_dim);
        let (q_dim, qkv_dim) = (heads * d, (heads + 2 * kv_heads) * d);
        let shape = QkvShape {
            tokens: t,
            heads,
            kv_heads,
            head_dim: d,
        };
        let views = InputViews::of(layer);
        let (bias, q_norm, k_norm, rotary) = views.parts();
        let store = self.stored.is_some();
        let decode = self.decode.as_mut().filter(|_| t == 1);
        let mut store_views = self.stored.as_mut().map(|stored| {
            let chunk = &mut stored[i];
            let n = t * kv_heads * d;
            let sampled = chunk.query_len(q_dim);
            (
                chunk.keys.slice_mut(..n),
                chunk.values.slice_mut(..n),
                (chunk.every > 0).then(|| (chunk.queries.slice_mut(..sampled), chunk.every)),
            )
        });
        let store_rows = store_views.as_mut().map(|(k, v, q)| StoreRows {
            keys: k,
            values: v,
            queries: q.as_mut().map(|(rows, every)| QueryRows {
                rows,
                every: *every,
            }),
        });
        let kv = &mut self.kv[i];
        // The call's first `rows` tokens' queries into `queries`, keys and values into
        // `kv` (rounded to f16 first if `round`) and `store`.
        let place = |rows: usize,
                     round: bool,
                     queries: &mut CudaViewMut<'_, A>,
                     kv: &mut KvCache<A>,
                     store: Option<StoreRows<'_, '_>>| {
            ops::attention_inputs(
                gpu,
                &qkv.slice(..rows * qkv_dim),
                &shape,
                bias,
                q_norm.as_ref(),
                k_norm.as_ref(),
                &rotary,
                round,
                queries,
                ops::KvPlacement::Chunk {
                    kv,
                    first_position: start,
                },
                store,
            )
        };
        let external = self.external.as_mut().filter(|e| e.claimed[i]);
        let n = t * q_dim;
        match (external, decode) {
            (Some(e), _) => {
                // Taken while the call runs, which borrows the sequence.
                let mut raw = e.raw.take().ok_or_else(|| ModelError::Backend {
                    layer: i,
                    reason: "a claimed layer's call before its buffers were made".into(),
                })?;
                let kv_n = t * kv_heads * d;
                place(
                    t,
                    false,
                    &mut queries.slice_mut(..n),
                    kv,
                    Some(StoreRows {
                        keys: &mut raw.keys.slice_mut(..kv_n),
                        values: &mut raw.values.slice_mut(..kv_n),
                        queries: Some(QueryRows {
                            rows: &mut raw.queries.slice_mut(..n),
                            every: 1,
                        }),
                    }),
                )?;
                let called = self.attend_placed(
                    lane,
                    i,
                    t,
                    queries.slice(..n),
                    raw.views(0..t, q_dim, kv_heads * d),
                    f32_out.slice_mut(..n),
                );
                if let Some(e) = self.external.as_mut() {
                    e.raw = Some(raw);
                }
                called?;
                return Ok(true);
            }
            (None, Some(buffers)) => {
                place(1, store, &mut buffers.queries.as_view_mut(), kv, store_rows)?;
                // The step's keys: a global layer's prefix, or a sliding window's rows of its
                // ring.
                let lowest = layer.window.map_or(0, |w| (start + 1).saturating_sub(w));
                let runs: Vec<Range<u32>> = kv.rows_of(lowest..start + 1).collect();
                A::flash_decode(
                    gpu,
                    &mut buffers.workspace,
                    &buffers.queries,
                    c.attention_scale,
                    kv,
                    &runs,
                    &mut f32_out.slice_mut(..q_dim),
                )?;
                return Ok(true);
            }
            (None, None) => {
                place(t, store, &mut queries.slice_mut(..n), kv, store_rows)?;
                prefill_attention(
                    gpu,
                    &queries.slice(..n),
                    heads,
                    kv,
                    &Causal {
                        first_position: start,
                        window: layer.window,
                    },
                    c.attention_scale,
                    &mut attention.slice_mut(..n),
                )?;
            }
        }
        Ok(false)
    }

    /// Claimed layer `i`'s attention of the sequence's next `t` tokens, their inputs placed
    /// (the tail's keys and values in the sequence's buffer, `queries` rotated, `raw` before
    /// RoPE): into `out` (`[t, heads · head_dim]`), queued on the model's stream or on
    /// `lane`'s.
    fn attend_placed(
        &mut self,
        lane: Option<&Gpu>,
        i: usize,
        t: usize,
        queries: CudaView<'_, A>,
        raw: RawViews<'_>,
        out: CudaViewMut<'_, f32>,
    ) -> Result<()> {
        let model = self.model;
        let external = self
            .external
            .as_mut()
            .filter(|e| e.claimed[i])
            .ok_or_else(|| ModelError::Backend {
                layer: i,
                reason: "the layer's attention is not external".into(),
            })?;
        A::external(
            &mut *external.attention,
            ExternalCall {
                gpu: lane.unwrap_or(&model.gpu),
                own_stream: lane.is_some(),
                layer: i,
                positions: self.position..self.position + t,
                scale: model.config.attention_scale,
                queries,
                raw_queries: raw.queries,
                raw_keys: raw.keys,
                raw_values: raw.values,
                tail: &self.kv[i],
                out,
            },
        )
    }

    /// One chunk of at most [`MAX_CHUNK`] tokens; returns what `pick` asks of the logits of
    /// `rows` (chunk indices).
    fn chunk(&mut self, tokens: &[u32], rows: &[usize], pick: Pick) -> Result<HostPicks> {
        let model = self.model;
        let t = tokens.len();
        self.prepare(t)?;
        let mut s = match self.scratch.take() {
            Some(s) if s.rows >= t => s,
            _ => Scratch::new(
                &model.gpu,
                &model.config,
                t.next_power_of_two().min(MAX_CHUNK),
            )?,
        };
        let (q_dim, qkv_dim) = attention_dims(&model.config);
        let gpu = &*model.gpu;
        let ran = run_layers(model, &mut s, tokens, &mut |i, s| {
            let n = t * q_dim;
            let staged = self.attend_layer(
                None,
                i,
                t,
                &s.qkv.slice(..t * qkv_dim),
                &mut s.queries.slice_mut(..n),
                &mut s.attention.slice_mut(..n),
                &mut s.f32_out.slice_mut(..n),
            )?;
            converge_attention::<A, T>(gpu, s, t, i, staged.then_some(0..t), q_dim)
        });
        let picked = ran.and_then(|()| {
            self.position += t;
            pick_rows(model, &mut s, rows, &mut self.picks, pick)
        });
        self.scratch = Some(s);
        picked
    }
}

/// Computes layer `i`'s attention of a scratch's rows ([`run_layers`]).
type LayerAttend<'a, T, A> = dyn FnMut(usize, &mut Scratch<T, A>) -> Result<()> + 'a;

/// The forward pass of `tokens` (one per row of `s`) through every layer into `s.x`, with
/// `attend(i, s)` computing layer `i`'s attention from the rows' projections in `s.qkv` into
/// `s.attention` (`s.queries` is its to use): a sequence's chunk, or one token of each
/// sequence of a batch, whose weights are read once for all rows.
fn run_layers<T: Float, A: AttentionType>(
    model: &Inner<T, A>,
    s: &mut Scratch<T, A>,
    tokens: &[u32],
    attend: &mut LayerAttend<'_, T, A>,
) -> Result<()> {
    let gpu = &*model.gpu;
    let t = tokens.len();
    gpu.stream()
        .memcpy_htod(tokens, &mut s.ids.slice_mut(..t))
        .map_err(|e| KernelError::Driver {
            op: "copying token ids",
            source: e,
        })?;
    // Out of the scratch while its buffers are borrowed.
    let mut graphs = std::mem::take(&mut s.graphs);
    let ran = graphs.run(
        gpu,
        model.step_graphs.load(Ordering::Relaxed).then_some(t),
        model.layers.len() + 1,
        s,
        |s, k| layer_piece(model, s, t, k),
        |s, i| attend(i, s),
    );
    s.graphs = graphs;
    model
        .graph_launches
        .fetch_add(ran? as u64, Ordering::Relaxed);
    Ok(())
}

/// Piece `k` of a call's layers between their attention launches (see `graphs`): the
/// embedding (`k = 0`) or the rest of layer `k - 1` after its attention (output projection,
/// MLP), then layer `k` up to its attention (its norm and Q/K/V projection into `s.qkv`),
/// for `t` rows. Nothing here depends on the position, so it can be replayed.
fn layer_piece<T: Float, A: AttentionType>(
    model: &Inner<T, A>,
    s: &mut Scratch<T, A>,
    t: usize,
    k: usize,
) -> Result<()> {
    let (gpu, c) = (&*model.gpu, &model.config);
    let (hidden, inter) = (c.hidden_size, c.intermediate_size);
    let (q_dim, qkv_dim) = attention_dims(c);
    match k.checked_sub(1).map(|i| &model.layers[i]) {
        None => ops::embed(
            gpu,
            &model.embedding.as_view(),
            hidden,
            &s.ids.slice(..t),
            model.embedding_scale,
            &mut s.x.slice_mut(..t * hidden),
        )?,
        Some(layer) => {
            // The residual add, then the MLP's input norm.
            let n = t * q_dim;
            let attention = match attention_in_f32::<A>(t) {
                true => ProjectionInput::F32 {
                    x: s.f32_out.slice(..n),
                    staging: s.attention.slice_mut(..n),
                },
                false => ProjectionInput::Typed(s.attention.slice(..n)),
            };
            project_residual(
                gpu,
                &model.gemm,
                attention,
                &layer.wo,
                q_dim,
                layer.post_attn_norm.as_ref(),
                &mut s.projected,
                &mut s.x.slice_mut(..t * hidden),
                hidden,
                Some((&layer.ffn_norm, &mut s.h.slice_mut(..t * hidden))),
            )?;
            // MLP.
            model.gemm.gated_linear(
                gpu,
                &s.h.slice(..t * hidden),
                &layer.gate_up.as_view(),
                hidden,
                model.activation,
                &mut s.gate_up.slice_mut(..t * 2 * inter),
                &mut s.gated.slice_mut(..t * inter),
            )?;
            // The residual add, then the next layer's input norm (the last layer's output
            // norm is the logits' own).
            let mut h = s.h.slice_mut(..t * hidden);
            project_residual(
                gpu,
                &model.gemm,
                ProjectionInput::Typed(s.gated.slice(..t * inter)),
                &layer.down,
                inter,
                layer.post_ffn_norm.as_ref(),
                &mut s.projected,
                &mut s.x.slice_mut(..t * hidden),
                hidden,
                model.layers.get(k).map(|next| (&next.attn_norm, &mut h)),
            )?;
        }
    }
    if let Some(layer) = model.layers.get(k) {
        // Attention's inputs (the first layer's norm after the embedding; the others' came
        // with the residual add before).
        if k == 0 {
            norm_into(gpu, &s.x, t, hidden, &layer.attn_norm, &mut s.h)?;
        }
        model.gemm.linear(
            gpu,
            &s.h.slice(..t * hidden),
            &layer.qkv.as_view(),
            hidden,
            None,
            false,
            &mut s.qkv.slice_mut(..t * qkv_dim),
        )?;
    }
    Ok(())
}

/// Layer `i`'s attention inputs of a batched step's rows (every row's sequence claims the
/// layer), in one launch on the model's stream: row `r`'s rotated queries into `s.queries`,
/// its keys and values into its sequence's tail at the sequence's position, its pre-RoPE
/// rows into `raw`'s row `r`.
fn place_step_rows<T: Float, A: AttentionType>(
    model: &Inner<T, A>,
    i: usize,
    sequences: &mut [Sequence<'_, T, A>],
    tokens: &[(usize, u32)],
    s: &mut Scratch<T, A>,
    raw: &mut RawRows,
) -> Result<()> {
    let (gpu, c) = (&*model.gpu, &model.config);
    let rows = tokens.len();
    let (q_dim, qkv_dim) = attention_dims(c);
    let kv_dim = c.n_kv_heads * c.head_dim;
    let shape = QkvShape {
        tokens: rows,
        heads: c.n_heads,
        kv_heads: c.n_kv_heads,
        head_dim: c.head_dim,
    };
    let positions: Vec<usize> = sequences.iter().map(|s| s.position).collect();
    // Each sequence's tail at this layer, taken in the step's row order (a sequence is in
    // a step at most once).
    let mut tails: Vec<Option<&mut KvCache<A>>> =
        sequences.iter_mut().map(|s| s.kv.get_mut(i)).collect();
    let mut targets = tokens
        .iter()
        .map(|&(b, _)| {
            let kv = tails.get_mut(b).and_then(Option::take).ok_or_else(|| {
                ModelError::BatchStep(format!("sequence {b} twice in a step, or none such"))
            })?;
            Ok(ops::RowTarget {
                kv,
                position: positions[b],
            })
        })
        .collect::<Result<Vec<_>>>()?;
    let views = InputViews::of(&model.layers[i]);
    let (bias, q_norm, k_norm, rotary) = views.parts();
    ops::attention_inputs(
        gpu,
        &s.qkv.slice(..rows * qkv_dim),
        &shape,
        bias,
        q_norm.as_ref(),
        k_norm.as_ref(),
        &rotary,
        false,
        &mut s.queries.slice_mut(..rows * q_dim),
        ops::KvPlacement::Rows(&mut targets),
        Some(StoreRows {
            keys: &mut raw.keys.slice_mut(..rows * kv_dim),
            values: &mut raw.values.slice_mut(..rows * kv_dim),
            queries: Some(QueryRows {
                rows: &mut raw.queries.slice_mut(..rows * q_dim),
                every: 1,
            }),
        }),
    )?;
    Ok(())
}

/// The device buffers a step's picks pass through on their way to the host.
struct PickBuffers {
    /// Logits of a run of rows.
    logits: CudaSlice<f32>,
    /// The rows' greedy choices.
    tokens: CudaSlice<u32>,
    /// What picking them keeps between blocks.
    argmax: ops::ArgmaxScratch,
}

impl PickBuffers {
    fn new(gpu: &Gpu) -> Result<Self> {
        Ok(Self {
            logits: gpu.zeros(1)?,
            tokens: gpu.zeros(1)?,
            argmax: ops::ArgmaxScratch::new(gpu, 1)?,
        })
    }
}

/// What [`pick_rows`] copied to the host.
enum HostPicks {
    /// `[rows, vocab]` row-major.
    Logits(Vec<f32>),
    /// A token per row.
    Greedy(Vec<u32>),
}

impl HostPicks {
    fn empty(pick: Pick) -> Self {
        match pick {
            Pick::Logits => Self::Logits(Vec::new()),
            Pick::Greedy => Self::Greedy(Vec::new()),
        }
    }

    fn into_picked(self, rows: usize, vocab: usize) -> Result<Picked> {
        Ok(match self {
            Self::Logits(logits) => {
                Picked::Logits(Tensor::from_vec(logits, (rows, vocab), &Device::Cpu)?)
            }
            Self::Greedy(tokens) => Picked::Greedy(tokens),
        })
    }
}

/// What `pick` asks of the logits of `s`'s rows `rows` (after [`run_layers`]; `s.h` holds
/// their norms), in the order of `rows`, computed one run of consecutive rows at a time
/// through `buffers`: the logits `[rows, vocab]` on the host, or each row's greedy choice
/// (picked on the GPU; only the tokens are copied).
fn pick_rows<T: Float, A: Float>(
    model: &Inner<T, A>,
    s: &mut Scratch<T, A>,
    rows: &[usize],
    buffers: &mut PickBuffers,
    pick: Pick,
) -> Result<HostPicks> {
    let (gpu, c) = (&*model.gpu, &model.config);
    let (hidden, vocab) = (c.hidden_size, c.vocab_size);
    let output = model.output.as_ref().unwrap_or(&model.embedding);
    let mut picked = HostPicks::empty(pick);
    match &mut picked {
        HostPicks::Logits(logits) => logits.resize(rows.len() * vocab, 0.0),
        HostPicks::Greedy(tokens) => tokens.resize(rows.len(), 0),
    }
    if pick == Pick::Greedy && buffers.tokens.len() < rows.len() {
        buffers.tokens = gpu.zeros(rows.len())?;
    }
    let device_logits = &mut buffers.logits;
    let mut i = 0;
    while i < rows.len() {
        let mut run = 1;
        while i + run < rows.len() && rows[i + run] == rows[i] + run {
            run += 1;
        }
        if device_logits.len() < run * vocab {
            *device_logits = gpu.zeros(run * vocab)?;
        }
        if pick == Pick::Greedy && buffers.argmax.rows() < run {
            buffers.argmax = ops::ArgmaxScratch::new(gpu, run)?;
        }
        let first = rows[i];
        let norm_weight = model.output_norm.weight.as_view();
        ops::rms_norm(
            gpu,
            &s.x.slice(first * hidden..(first + run) * hidden),
            hidden,
            &Norm {
                weight: &norm_weight,
                eps: model.output_norm.eps,
                offset: 0.0,
            },
            &mut s.h.slice_mut(..run * hidden),
        )?;
        model.gemm.linear(
            gpu,
            &s.h.slice(..run * hidden),
            &output.as_view(),
            hidden,
            None,
            false,
            &mut device_logits.slice_mut(..run * vocab),
        )?;
        match &mut picked {
            HostPicks::Logits(logits) => {
                gpu.stream()
                    .memcpy_dtoh(
                        &device_logits.slice(..run * vocab),
                        &mut logits[i * vocab..(i + run) * vocab],
                    )
                    .map_err(|e| KernelError::Driver {
                        op: "copying logits",
                        source: e,
                    })?;
                gpu.synchronize()?;
            }
            HostPicks::Greedy(_) => ops::argmax_rows(
                gpu,
                &device_logits.slice(..run * vocab),
                vocab,
                &mut buffers.argmax,
                &mut buffers.tokens.slice_mut(i..i + run),
            )?,
        }
        i += run;
    }
    if let HostPicks::Greedy(tokens) = &mut picked {
        gpu.stream()
            .memcpy_dtoh(&buffers.tokens.slice(..rows.len()), tokens)
            .map_err(|e| KernelError::Driver {
                op: "copying greedy tokens",
                source: e,
            })?;
        gpu.synchronize()?;
    }
    Ok(picked)
}

/// Widths of a token's queries and of its stacked query, key and value projections.
fn attention_dims(c: &ModelConfig) -> (usize, usize) {
    let q_dim = c.n_heads * c.head_dim;
    (q_dim, q_dim + 2 * c.n_kv_heads * c.head_dim)
}

/// Places pre-RoPE keys and values (`[tokens, n_kv_heads, head_dim]` f32 each) at
/// `positions` into `kv`, rotated and rounded to f16 (a ring keeps the last ones). The rows
/// go through the kernel that places a chunk's own keys (no norms: they are stored normed),
/// so a corpus continued from the store attends to bit for bit the keys an uninterrupted
/// ingest held.
fn place_rows<T: Float, A: AttentionType>(
    model: &Inner<T, A>,
    layer: usize,
    kv: &mut KvCache<A>,
    keys: &[f32],
    values: &[f32],
    positions: Range<usize>,
) -> Result<()> {
    let (gpu, c) = (&*model.gpu, &model.config);
    let gpu_layer = &model.layers[layer];
    let (heads, kv_heads, d) = (c.n_heads, c.n_kv_heads, c.head_dim);
    let row = kv_heads * d;
    if keys.len() != positions.len() * row || values.len() != keys.len() {
        return Err(ModelError::Backend {
            layer,
            reason: format!(
                "preload of {} positions needs {} key and value floats, got {} and {}",
                positions.len(),
                positions.len() * row,
                keys.len(),
                values.len()
            ),
        });
    }
    // A ring keeps its last `capacity` positions.
    let skip = positions.len().saturating_sub(kv.tokens());
    let qkv_dim = (heads + 2 * kv_heads) * d;
    let mut scratch_q: CudaSlice<A> = gpu.zeros(MAX_CHUNK.min(positions.len()) * heads * d)?;
    let mut qkv_device: CudaSlice<f32> = gpu.zeros(MAX_CHUNK.min(positions.len()) * qkv_dim)?;
    let inv_freq = gpu_layer.inv_freq.as_view();
    let rotary = Rotary {
        inv_freq: &inv_freq,
        pairs: gpu_layer.pairs,
    };
    let mut i = skip;
    while i < positions.len() {
        let t = MAX_CHUNK.min(positions.len() - i);
        let mut qkv = vec![0f32; t * qkv_dim];
        for (j, token) in qkv.chunks_exact_mut(qkv_dim).enumerate() {
            let at = (i + j) * row;
            token[heads * d..heads * d + row].copy_from_slice(&keys[at..at + row]);
            token[heads * d + row..].copy_from_slice(&values[at..at + row]);
        }
        gpu.stream()
            .memcpy_htod(&qkv, &mut qkv_device.slice_mut(..t * qkv_dim))
            .map_err(|e| KernelError::Driver {
                op: "copying stored keys and values",
                source: e,
            })?;
        ops::attention_inputs(
            gpu,
            &qkv_device.slice(..t * qkv_dim),
            &QkvShape {
                tokens: t,
                heads,
                kv_heads,
                head_dim: d,
            },
            None,
            None,
            None,
            &rotary,
            true,
            &mut scratch_q.slice_mut(..t * heads * d),
            ops::KvPlacement::Chunk {
                kv,
                first_position: positions.start + i,
            },
            None,
        )?;
        // `qkv` is a temporary the copy reads.
        gpu.synchronize()?;
        i += t;
    }
    Ok(())
}

/// `out[..rows]` = RMSNorm of `x[..rows]`.
fn norm_into<T: Float>(
    gpu: &Gpu,
    x: &CudaSlice<f32>,
    rows: usize,
    width: usize,
    norm: &GpuNorm,
    out: &mut CudaSlice<T>,
) -> Result<()> {
    let weight = norm.weight.as_view();
    ops::rms_norm(
        gpu,
        &x.slice(..rows * width),
        width,
        &Norm {
            weight: &weight,
            eps: norm.eps,
            offset: 0.0,
        },
        &mut out.slice_mut(..rows * width),
    )?;
    Ok(())
}

/// What a projection reads: inputs in the weights' type, or f32 rounded to it
/// ([`Gemm::linear_of_f32`], through `staging` where the product cannot round as it reads).
enum ProjectionInput<'a, T> {
    Typed(CudaView<'a, T>),
    F32 {
        x: CudaView<'a, f32>,
        staging: CudaViewMut<'a, T>,
    },
}

impl<T: Float> ProjectionInput<'_, T> {
    /// `out = input · wᵀ (+ out, if accumulate)` ([`Gemm::linear`]).
    fn project(
        &mut self,
        gpu: &Gpu,
        gemm: &Gemm,
        w: &CudaSlice<T>,
        k: usize,
        accumulate: bool,
        out: &mut CudaViewMut<'_, f32>,
    ) -> Result<()> {
        let w = w.as_view();
        match self {
            Self::Typed(x) => gemm.linear(gpu, x, &w, k, None, accumulate, out)?,
            Self::F32 { x, staging } => {
                gemm.linear_of_f32(gpu, x, staging, &w, k, None, accumulate, out)?
            }
        }
        Ok(())
    }
}

/// Layer `i`'s attention of a call of `t` rows where the output projection reads it: rows
/// `staged` (attention in `f32_out`) converted into `attention`, unless the projection reads
/// the f32 itself ([`attention_in_f32`]), which needs every row staged.
fn converge_attention<A: AttentionType, T: Float>(
    gpu: &Gpu,
    s: &mut Scratch<T, A>,
    t: usize,
    i: usize,
    staged: Option<Range<usize>>,
    q_dim: usize,
) -> Result<()> {
    if attention_in_f32::<A>(t) {
        return match staged {
            Some(rows) if rows == (0..t) => Ok(()),
            _ => Err(ModelError::Backend {
                layer: i,
                reason: "a decode step's attention was not written in f32".into(),
            }),
        };
    }
    if let Some(rows) = staged {
        let n = rows.start * q_dim..rows.end * q_dim;
        ops::convert(
            gpu,
            &s.f32_out.slice(n.clone()),
            &mut s.attention.slice_mut(n),
        )?;
    }
    Ok(())
}

/// Whether a call of `t` rows finds every layer's attention in `f32_out` instead of
/// `attention`: a decode step's single row, whose attention `flash_decode` or the caller's
/// kernel (a claimed layer) writes in f32. Its output projection then rounds the f32 as it
/// reads it, with no conversion launched between the two.
fn attention_in_f32<A: AttentionType>(t: usize) -> bool {
    t == 1 && A::FLASH_DECODE
}

/// `x += post_norm(input · wᵀ)`, or `x += input · wᵀ` accumulated by the GEMM itself when
/// there is no post-norm (rows of `width`); then, with `then`, its `out = RMSNorm(x)` by its
/// norm (the next sublayer's input), in the same launch as the post-norm's residual add
/// where there is one.
#[allow(clippy::too_many_arguments)]
fn project_residual<T: Float>(
    gpu: &Gpu,
    gemm: &Gemm,
    mut input: ProjectionInput<'_, T>,
    w: &CudaSlice<T>,
    k: usize,
    post_norm: Option<&GpuNorm>,
    projected: &mut CudaSlice<f32>,
    x: &mut CudaViewMut<'_, f32>,
    width: usize,
    then: Option<(&GpuNorm, &mut CudaViewMut<'_, T>)>,
) -> Result<()> {
    let (next_norm, out) = match then {
        Some((norm, out)) => (Some(norm), Some(out)),
        None => (None, None),
    };
    let next_weight = next_norm.map(|norm| norm.weight.as_view());
    let next = next_norm
        .zip(next_weight.as_ref())
        .map(|(norm, weight)| Norm {
            weight,
            eps: norm.eps,
            offset: 0.0,
        });
    match post_norm {
        None => {
            input.project(gpu, gemm, w, k, true, x)?;
            if let (Some(next), Some(out)) = (next, out) {
                ops::rms_norm(gpu, &x.as_view(), width, &next, out)?;
            }
        }
        Some(norm) => {
            let n = x.len();
            input.project(gpu, gemm, w, k, false, &mut projected.slice_mut(..n))?;
            let weight = norm.weight.as_view();
            let post = Norm {
                weight: &weight,
                eps: norm.eps,
                offset: 0.0,
            };
            let y = projected.slice(..n);
            match (next, out) {
                (Some(next), Some(out)) => {
                    ops::add_rms_norm_then_norm(gpu, x, &y, width, Some(&post), &next, out)?
                }
                _ => ops::add_rms_norm(gpu, x, &y, width, Some(&post))?,
            }
        }
    }
    Ok(())
}

impl<T: Float, A: AttentionType> Forward for Sequence<'_, T, A> {
    fn config(&self) -> &ModelConfig {
        &self.model.config
    }

    fn position(&self) -> usize {
        self.position
    }

    fn prefill_chunk(&self) -> usize {
        MAX_CHUNK
    }

    fn runs_ahead(&self) -> bool {
        true
    }

    fn forward_greedy(&mut self, token: u32) -> Result<u32> {
        check_call(&self.model.config, &[token], self.position, &Logits::Last)?;
        match self.chunk(&[token], &[0], Pick::Greedy)? {
            HostPicks::Greedy(tokens) if tokens.len() == 1 => Ok(tokens[0]),
            _ => Err(ModelError::Internal(
                "a greedy step returned no token".into(),
            )),
        }
    }

    fn forward(&mut self, tokens: &[u32], logits: &Logits) -> Result<Option<Tensor>> {
        let t = tokens.len();
        if t == 0 {
            return Ok(None);
        }
        check_call(&self.model.config, tokens, self.position, logits)?;
        let rows: Vec<usize> = match logits {
            Logits::None => Vec::new(),
            Logits::Last => vec![t - 1],
            Logits::All => (0..t).collect(),
            Logits::Rows(rows) => rows.clone(),
        };
        let mut out = Vec::with_capacity(rows.len() * self.model.config.vocab_size);
        let mut order = Vec::with_capacity(rows.len());
        for (c, chunk) in tokens.chunks(MAX_CHUNK).enumerate() {
            let first = c * MAX_CHUNK;
            let mut here: Vec<usize> = rows
                .iter()
                .filter(|&&r| (first..first + chunk.len()).contains(&r))
                .map(|&r| r - first)
                .collect();
            here.sort_unstable();
            here.dedup();
            let HostPicks::Logits(chunk_logits) = self.chunk(chunk, &here, Pick::Logits)? else {
                return Err(ModelError::Internal("a chunk returned no logits".into()));
            };
            order.extend(here.iter().map(|&r| r + first));
            out.extend(chunk_logits);
        }
        if matches!(logits, Logits::None) {
            return Ok(None);
        }
        let vocab = self.model.config.vocab_size;
        // Rows come back in ascending order; put them in the order asked for.
        let mut result = Vec::with_capacity(rows.len() * vocab);
        for r in &rows {
            let at = order
                .binary_search(r)
                .map_err(|_| ModelError::LogitRow { row: *r, tokens: t })?;
            result.extend_from_slice(&out[at * vocab..(at + 1) * vocab]);
        }
        Ok(Some(Tensor::from_vec(
            result,
            (rows.len(), vocab),
            &candle_core::Device::Cpu,
        )?))
    }

    fn preload(
        &mut self,
        layer: usize,
        keys: &[f32],
        values: &[f32],
        positions: Range<usize>,
    ) -> Result<()> {
        let model = self.model;
        let (gpu, c) = (&*model.gpu, &model.config);
        let claimed = self.external.as_ref().is_some_and(|e| e.claimed[layer]);
        let (Some(gpu_layer), Some(kv)) = (model.layers.get(layer), self.kv.get_mut(layer)) else {
            return Err(ModelError::Backend {
                layer,
                reason: format!("the model has {} layers", c.n_layers()),
            });
        };
        if claimed {
            return Err(ModelError::Backend {
                layer,
                reason: "the layer's attention is external: it takes no preload".into(),
            });
        }
        if gpu_layer.window.is_none() {
            if positions.start != 0 {
                return Err(ModelError::Backend {
                    layer,
                    reason: "a global layer's preload must start at position 0".into(),
                });
            }
            kv.grow(gpu, positions.end, 0)?;
        }
        place_rows(model, layer, kv, keys, values, positions.clone())?;
        self.position = self.position.max(positions.end);
        Ok(())
    }

    fn preload_stored(
        &mut self,
        layer: usize,
        keys: &[f16],
        values: &[f16],
        positions: Range<usize>,
    ) -> Result<()> {
        // A global layer's rows start at position 0 and fill its buffer: uploaded whole. A
        // ring's window (and every refusal `preload` words) goes through `preload`.
        let model = self.model;
        let claimed = self.external.as_ref().is_some_and(|e| e.claimed[layer]);
        let global = model.layers.get(layer).is_some_and(|l| l.window.is_none());
        if global && !claimed && positions.start == 0 && !positions.is_empty() {
            if let Some(kv) = model.rotated_stored(layer, keys, values, positions.clone())? {
                self.kv[layer] = kv;
                self.position = self.position.max(positions.end);
                return Ok(());
            }
        }
        preload_widened(self, layer, keys, values, positions)
    }

    fn take_stored(&mut self, layer: usize, rows: Range<usize>) -> Result<Option<StoredKv>> {
        let gpu = &*self.model.gpu;
        let c = &self.model.config;
        let Some(chunk) = untaken(&mut self.stored, layer, |chunk| &mut chunk.taken) else {
            return Ok(None);
        };
        if rows.start > rows.end || rows.end > chunk.tokens {
            return Err(ModelError::StoredRows {
                start: rows.start,
                end: rows.end,
                tokens: chunk.tokens,
            });
        }
        let row = c.n_kv_heads * c.head_dim;
        let (from, n) = (rows.start * row, rows.len() * row);
        let mut keys = vec![f16::ZERO; n];
        let mut values = vec![f16::ZERO; n];
        let copy = |e| KernelError::Driver {
            op: "copying stored keys and values",
            source: e,
        };
        let stream = gpu.stream();
        stream
            .memcpy_dtoh(&chunk.keys.slice(from..from + n), &mut keys)
            .map_err(copy)?;
        stream
            .memcpy_dtoh(&chunk.values.slice(from..from + n), &mut values)
            .map_err(copy)?;
        gpu.synchronize()?;
        Ok(Some((keys, values)))
    }

    fn take_queries(&mut self, layer: usize) -> Result<Option<SampledQueries>> {
        let gpu = &*self.model.gpu;
        let q_dim = self.model.config.n_heads * self.model.config.head_dim;
        let Some(chunk) = untaken(&mut self.stored, layer, |chunk| &mut chunk.queries_taken) else {
            return Ok(None);
        };
        if chunk.every == 0 {
            return Ok(None);
        }
        // The sample's rows lie together: one copy (none where the chunk holds no sampled
        // position).
        let mut queries = vec![0f32; chunk.query_len(q_dim)];
        if !queries.is_empty() {
            gpu.stream()
                .memcpy_dtoh(&chunk.queries.slice(..queries.len()), &mut queries)
                .map_err(|e| KernelError::Driver {
                    op: "copying stored queries",
                    source: e,
                })?;
            gpu.synchronize()?;
        }
        Ok(Some(SampledQueries {
            positions: sampled_positions(chunk.start, chunk.tokens, chunk.every).collect(),
            queries: queries.into_iter().map(f16::from_f32).collect(),
        }))
    }
}

#[cfg(test)]
mod tests {
    use candle_core::{Device, Tensor};

    use super::*;

    /// The GPU's stored sample holds as many rows as the positions the CPU samples: the
    /// kernel's count and the host's positions follow one rule.
    #[test]
    fn sampled_rows_count_the_sampled_positions() {
        for every in [0, 1, 2, 16, 17] {
            for start in [0, 1, 14, 15, 16, 31, 1000] {
                for tokens in [0, 1, 15, 16, 33, 512] {
                    assert_eq!(
                        ops::sampled_rows(start, tokens, every),
                        sampled_positions(start, tokens, every).count(),
                        "every {every}, {tokens} tokens from {start}"
                    );
                }
            }
        }
    }

    /// Stacked projections come out as the rows of each part in turn, each value rounded
    /// once (as converting a copy of it would), with zero biases for a part without one;
    /// a tensor that is not contiguous (a transposed view) goes through the copy instead.
    #[test]
    fn stacking_converts_each_part_in_order() -> Result<()> {
        let values = |rows: usize, cols: usize, seed: f32| -> Result<Tensor> {
            let v: Vec<f32> = (0..rows * cols)
                .map(|i| ((i as f32 + seed) * 0.7311).sin() * 3.0)
                .collect();
            Ok(Tensor::from_vec(v, (rows, cols), &Device::Cpu)?)
        };
        let linear = |dense: Tensor, bias: Option<Tensor>| Linear {
            dense: Some(dense),
            quantized: None,
            bias,
        };
        let q = linear(values(6, 4, 0.0)?, Some(values(1, 6, 1.0)?.flatten_all()?));
        let k = linear(values(4, 2, 2.0)?.t()?, None);
        assert!(k.dense.as_ref().is_some_and(|w| !w.is_contiguous()));
        let v = linear(values(2, 4, 3.0)?, None);
        let (weights, bias) = stacked::<bf16>(&[&q, &k, &v])?;
        let mut want = Vec::new();
        for part in [&q, &k, &v] {
            if let Some(w) = &part.dense {
                want.extend(host_f32(w)?.into_iter().map(bf16::from_f32));
            }
        }
        assert_eq!(weights, want);
        // q's 6 biases, then zeros for k's 2 rows and v's 2.
        let mut want_bias = match &q.bias {
            Some(b) => host_f32(b)?,
            None => Vec::new(),
        };
        want_bias.extend([0.0; 4]);
        assert_eq!(bias, Some(want_bias));
        // Without biases there is none; a quantized-only part is refused.
        assert_eq!(stacked::<f32>(&[&v])?.1, None);
        let quantized = Linear {
            dense: None,
            quantized: None,
            bias: None,
        };
        assert!(stacked::<f32>(&[&v, &quantized]).is_err());
        Ok(())
    }
}
