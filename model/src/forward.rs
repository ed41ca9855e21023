//! The device seam: a model together with its sequence state, which prefills chunks and
//! decodes steps whatever device it runs on. Generation and ingest are written against
//! [`Forward`]; [`Model::sequence`] makes the CPU's, and `GpuModel::sequence` (feature
//! `gpu`) the GPU's.

use std::ops::Range;

use candle_core::{DType, Tensor};
use half::f16;

use crate::backend::{AttentionBackend, AttentionInput, FullAttention};
use crate::config::{LayerKind, ModelConfig};
use crate::error::{ModelError, Result};
use crate::model::{Logits, Model};

/// A model with its sequence state (its KV cache), on some device.
///
/// ```no_run
/// use kvdb_model::{Forward, GgufFile, LoadOptions, Logits, Model, SequenceOptions};
/// # fn main() -> kvdb_model::Result<()> {
/// let model = Model::load("gemma-3-270m-q4_k_m.gguf", &LoadOptions::default(), &candle_core::Device::Cpu)?;
/// let mut sequence = model.sequence(&SequenceOptions::default())?;
/// sequence.forward(&[2, 651], &Logits::None)?;
/// let logits = sequence.forward(&[6037], &Logits::Last)?; // [1, vocab] on the host
/// # Ok(()) }
/// ```
pub trait Forward {
    /// The model's configuration.
    fn config(&self) -> &ModelConfig;

    /// Tokens the state holds: the position of the next token.
    fn position(&self) -> usize;

    /// Tokens per forward call that prefill works best with on this device (longer calls
    /// are still taken).
    fn prefill_chunk(&self) -> usize {
        CPU_PREFILL_CHUNK
    }

    /// Whether [`Forward::forward`] without logits returns before the device has finished
    /// (a GPU's queue), so that the caller's own work overlaps the computation.
    fn runs_ahead(&self) -> bool {
        false
    }

    /// Runs `tokens` at positions `position()..` and keeps them in the state. Returns the
    /// logits `[rows, vocab]` (f32, on the host) asked for (`None` for [`Logits::None`]).
    fn forward(&mut self, tokens: &[u32], logits: &Logits) -> Result<Option<Tensor>>;

    /// Runs one token at `position()` and returns the greedy choice of the next
    /// ([`greedy_token`] of its logits). A GPU picks it there and copies only the token to
    /// the host, not a vocabulary of logits.
    fn forward_greedy(&mut self, token: u32) -> Result<u32> {
        let logits = self
            .forward(&[token], &Logits::Last)?
            .ok_or_else(|| ModelError::Internal("no logits for the last token".into()))?;
        greedy_token(&logits.squeeze(0)?)
    }

    /// Takes earlier tokens' pre-RoPE keys and values (`[tokens, n_kv_heads, head_dim]`
    /// each, f32) at `positions` into the state of `layer` without attending: a stored
    /// corpus that later calls continue. Every layer must be given the same end; a
    /// sliding-window layer needs at least its last `window - 1` tokens.
    fn preload(
        &mut self,
        layer: usize,
        keys: &[f32],
        values: &[f32],
        positions: Range<usize>,
    ) -> Result<()>;

    /// [`Forward::preload`] from the store's own layout: pre-RoPE keys and values in f16,
    /// `[n_kv_heads, tokens, head_dim]` each (what the store's GPU reader hands out). A GPU
    /// uploads a global layer's rows as they are and rotates the keys there: an ingest resumed
    /// at 1M tokens preloads tens of GB, and widened to f32 and placed a chunk of rows at a time
    /// on one core they took minutes. The default widens them to the rows `preload` takes.
    fn preload_stored(
        &mut self,
        layer: usize,
        keys: &[f16],
        values: &[f16],
        positions: Range<usize>,
    ) -> Result<()> {
        preload_widened(self, layer, keys, values, positions)
    }

    /// The pre-RoPE keys and values the last [`Forward::forward`] call produced for `layer`
    /// at its token indices `rows` (a sliding-window layer's store needs only its last ones),
    /// in f16 as the store keeps them (`[rows, n_kv_heads, head_dim]` each), taken out of the
    /// state. `None` unless the state was made with
    /// [`SequenceOptions::store_kv`].
    fn take_stored(&mut self, layer: usize, rows: Range<usize>) -> Result<Option<StoredKv>>;

    /// The pre-RoPE queries the last [`Forward::forward`] call produced for global layer
    /// `layer` at the positions the state samples ([`SequenceOptions::query_sample`]), taken
    /// out of the state: what an ingest keeps for indexes that learn from queries. `None`
    /// where the state keeps no queries (only one made with [`SequenceOptions::store_kv`]
    /// and a sample, on the CPU or the GPU, does; never a sliding-window layer's), or where
    /// they were taken already.
    fn take_queries(&mut self, layer: usize) -> Result<Option<SampledQueries>> {
        let _ = layer;
        Ok(None)
    }
}

/// One layer's sampled pre-RoPE queries of a forward call ([`Forward::take_queries`]): the
/// positions, rising, and their queries (`[positions, n_heads, head_dim]`, f16).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SampledQueries {
    /// The sampled positions.
    pub positions: Vec<usize>,
    /// Their queries, one `n_heads · head_dim` row each.
    pub queries: Vec<f16>,
}

/// The positions of `start..start + tokens` a sample of one in `every` keeps: those `p` with
/// `(p + 1) % every == 0`, so that a corpus's sample does not depend on how its ingest cut it
/// into chunks (on the GPU, `kvdb_kernels::ops::sampled_rows` counts them and the attention
/// inputs kernel picks the same). `every` 0 keeps none.
pub fn sampled_positions(start: usize, tokens: usize, every: usize) -> impl Iterator<Item = usize> {
    let (step, end) = match every {
        0 => (1, 0),
        every => (every, start + tokens),
    };
    let first = (start + 1).div_ceil(step) * step - 1;
    (first..end).step_by(step)
}

/// One layer's keys and values for the store, as [`Forward::take_stored`] hands them over:
/// f16, `[rows, n_kv_heads, head_dim]` each (the precision the store keeps, so that nothing
/// is widened to f32 on the way from the device to the disk).
pub type StoredKv = (Vec<f16>, Vec<f16>);

/// [`Forward::preload_stored`] through [`Forward::preload`]: the head-major f16 rows widened
/// to token-major f32.
pub(crate) fn preload_widened<F: Forward + ?Sized>(
    sequence: &mut F,
    layer: usize,
    keys: &[f16],
    values: &[f16],
    positions: Range<usize>,
) -> Result<()> {
    let (heads, d) = (sequence.config().n_kv_heads, sequence.config().head_dim);
    let tokens = positions.len();
    let widen = |halves: &[f16]| -> Result<Vec<f32>> {
        if halves.len() != heads * tokens * d {
            return Err(ModelError::Backend {
                layer,
                reason: format!(
                    "preload of {tokens} positions needs {} key and value halves, got {}",
                    heads * tokens * d,
                    halves.len()
                ),
            });
        }
        let mut rows = vec![0f32; halves.len()];
        for (head, from) in halves.chunks_exact((tokens * d).max(1)).enumerate() {
            for (token, from) in from.chunks_exact(d.max(1)).enumerate() {
                let at = (token * heads + head) * d;
                for (to, x) in rows[at..at + d].iter_mut().zip(from) {
                    *to = x.to_f32();
                }
            }
        }
        Ok(rows)
    };
    let (keys, values) = (widen(keys)?, widen(values)?);
    sequence.preload(layer, &keys, &values, positions)
}

/// Tokens per CPU forward call in prefill: bounds the memory of attention scores.
pub const CPU_PREFILL_CHUNK: usize = 512;

/// How a sequence state is made.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct SequenceOptions {
    /// Round every layer's keys and values to f16 before attending, as the store holds
    /// them, and keep each call's for [`Forward::take_stored`] (ingest).
    pub store_kv: bool,
    /// With `store_kv`, keep too each call's pre-RoPE queries of every global layer at one
    /// position in this many ([`sampled_positions`]) for [`Forward::take_queries`]; 0 keeps
    /// none.
    pub query_sample: usize,
}

/// Checks a forward call's arguments: the chunk fits the context, its ids the vocabulary,
/// and the rows asked for exist. Shared by every device.
pub(crate) fn check_call(
    config: &ModelConfig,
    tokens: &[u32],
    start: usize,
    logits: &Logits,
) -> Result<()> {
    let t = tokens.len();
    if start + t > config.context_length {
        return Err(ModelError::ContextOverflow {
            tokens: start + t,
            context: config.context_length,
        });
    }
    if let Some(&id) = tokens.iter().find(|&&id| id as usize >= config.vocab_size) {
        return Err(ModelError::TokenOutOfRange {
            id,
            vocab: config.vocab_size,
        });
    }
    if let Logits::Rows(rows) = logits {
        if let Some(&row) = rows.iter().find(|&&r| r >= t) {
            return Err(ModelError::LogitRow { row, tokens: t });
        }
    }
    Ok(())
}

/// The greedy choice from `logits` (`[vocab]`): the first index of the largest value, NaNs
/// never chosen unless the first value is one (candle's `argmax`, which greedy sampling
/// uses; the GPU's `argmax_rows` picks the same).
pub fn greedy_token(logits: &Tensor) -> Result<u32> {
    Ok(logits
        .to_dtype(DType::F32)?
        .argmax(candle_core::D::Minus1)?
        .to_scalar::<u32>()?)
}

/// The CPU's [`Forward`]: the model's forward pass with exact attention
/// ([`FullAttention`]), optionally over f16-rounded keys and values kept for the store.
#[derive(Debug)]
pub struct CpuSequence<'m> {
    model: &'m Model,
    attention: FullAttention,
    /// Per layer, the last call's rounded keys and values and its sampled pre-RoPE
    /// queries; `None` when not storing.
    stored: Option<Vec<Option<StoredLayer>>>,
    /// One position in this many keeps its queries (0: none).
    query_sample: usize,
}

/// One layer's tensors of the last call, kept for [`Forward::take_stored`] and
/// [`Forward::take_queries`] (each takes its part).
#[derive(Debug, Clone)]
struct StoredLayer {
    kv: Option<(Tensor, Tensor)>,
    queries: Option<SampledQueries>,
}

impl<'m> CpuSequence<'m> {
    pub(crate) fn new(model: &'m Model, options: &SequenceOptions) -> Self {
        let layers = model.config().n_layers();
        Self {
            model,
            attention: FullAttention::new(model.config()),
            stored: options.store_kv.then(|| vec![None; layers]),
            query_sample: options.query_sample,
        }
    }
}

/// Exact attention that rounds keys and values to f16 first and keeps them per layer, with
/// a global layer's queries at one position in `query_sample` (0: none).
struct Rounding<'a> {
    attention: &'a mut FullAttention,
    stored: &'a mut [Option<StoredLayer>],
    query_sample: usize,
}

impl Rounding<'_> {
    /// `input`'s sampled queries, where its layer keeps them.
    fn sample(&self, input: &AttentionInput<'_>) -> Result<Option<SampledQueries>> {
        if self.query_sample == 0 || input.layer.kind != LayerKind::Global {
            return Ok(None);
        }
        let (start, tokens) = (input.positions.start, input.positions.len());
        let positions: Vec<usize> = sampled_positions(start, tokens, self.query_sample).collect();
        let rows: Vec<u32> = positions.iter().map(|p| (p - start) as u32).collect();
        let rows = Tensor::new(rows.as_slice(), input.queries.device())?;
        let queries = input
            .queries
            .index_select(&rows, 0)?
            .flatten_all()?
            .to_dtype(DType::F16)?
            .to_vec1::<f16>()?;
        Ok(Some(SampledQueries { positions, queries }))
    }
}

impl AttentionBackend for Rounding<'_> {
    fn attend(&mut self, input: &AttentionInput<'_>) -> Result<Tensor> {
        let round = |t: &Tensor| t.to_dtype(DType::F16)?.to_dtype(DType::F32);
        let keys = round(input.keys)?;
        let values = round(input.values)?;
        let out = self.attention.attend(&AttentionInput {
            keys: &keys,
            values: &values,
            ..input.clone()
        })?;
        let queries = self.sample(input)?;
        if let Some(slot) = self.stored.get_mut(input.layer.index) {
            *slot = Some(StoredLayer {
                kv: Some((keys, values)),
                queries,
            });
        }
        Ok(out)
    }
}

impl Forward for CpuSequence<'_> {
    fn config(&self) -> &ModelConfig {
        self.model.config()
    }

    fn position(&self) -> usize {
        self.attention.position()
    }

    fn forward(&mut self, tokens: &[u32], logits: &Logits) -> Result<Option<Tensor>> {
        let start = self.attention.position();
        match &mut self.stored {
            None => self
                .model
                .forward(tokens, start, &mut self.attention, logits),
            Some(stored) => {
                let mut backend = Rounding {
                    attention: &mut self.attention,
                    stored,
                    query_sample: self.query_sample,
                };
                self.model.forward(tokens, start, &mut backend, logits)
            }
        }
    }

    fn preload(
        &mut self,
        layer: usize,
        keys: &[f32],
        values: &[f32],
        positions: Range<usize>,
    ) -> Result<()> {
        let config = self.model.config();
        let (spec, rope) = match (config.layers.get(layer), self.model.rope(layer)) {
            (Some(spec), Some(rope)) => (spec, rope),
            _ => {
                return Err(ModelError::Backend {
                    layer,
                    reason: format!("the model has {} layers", config.n_layers()),
                })
            }
        };
        let shape = (positions.len(), config.n_kv_heads, config.head_dim);
        let device = self.model.device();
        let keys = Tensor::from_slice(keys, shape, device)?;
        let values = Tensor::from_slice(values, shape, device)?;
        self.attention
            .preload(spec, rope, &keys, &values, positions)
    }

    fn take_stored(&mut self, layer: usize, rows: Range<usize>) -> Result<Option<StoredKv>> {
        let taken = self
            .stored
            .as_mut()
            .and_then(|stored| stored.get_mut(layer))
            .and_then(Option::as_mut)
            .and_then(|stored| stored.kv.take());
        let Some((keys, values)) = taken else {
            return Ok(None);
        };
        let tokens = keys.dim(0)?;
        if rows.start > rows.end || rows.end > tokens {
            return Err(ModelError::StoredRows {
                start: rows.start,
                end: rows.end,
                tokens,
            });
        }
        // The rows were rounded to f16 before attention, so this conversion is exact.
        let flat = |t: Tensor| {
            t.narrow(0, rows.start, rows.len())?
                .flatten_all()?
                .to_dtype(DType::F16)?
                .to_vec1::<f16>()
        };
        Ok(Some((flat(keys)?, flat(values)?)))
    }

    fn take_queries(&mut self, layer: usize) -> Result<Option<SampledQueries>> {
        Ok(self
            .stored
            .as_mut()
            .and_then(|stored| stored.get_mut(layer))
            .and_then(Option::as_mut)
            .and_then(|stored| stored.queries.take()))
    }
}

/// The CPU forward pass through any [`AttentionBackend`] that already holds the sequence up to
/// `position` (e.g. a retrieval session over a stored corpus), as a [`Forward`]. It keeps no
/// state of its own: preloading goes through the backend itself.
pub struct BackendSequence<'a> {
    model: &'a Model,
    backend: &'a mut dyn AttentionBackend,
    position: usize,
}

impl std::fmt::Debug for BackendSequence<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BackendSequence")
            .field("position", &self.position)
            .finish_non_exhaustive()
    }
}

impl<'a> BackendSequence<'a> {
    /// The model over `backend`, whose state ends at `position`.
    pub fn new(model: &'a Model, backend: &'a mut dyn AttentionBackend, position: usize) -> Self {
        Self {
            model,
            backend,
            position,
        }
    }
}

impl Forward for BackendSequence<'_> {
    fn config(&self) -> &ModelConfig {
        self.model.config()
    }

    fn position(&self) -> usize {
        self.position
    }

    fn forward(&mut self, tokens: &[u32], logits: &Logits) -> Result<Option<Tensor>> {
        let out = self
            .model
            .forward(tokens, self.position, self.backend, logits)?;
        self.position += tokens.len();
        Ok(out)
    }

    fn preload(&mut self, layer: usize, _: &[f32], _: &[f32], _: Range<usize>) -> Result<()> {
        Err(ModelError::Backend {
            layer,
            reason: "a backend sequence is preloaded through its backend".into(),
        })
    }

    fn take_stored(&mut self, _: usize, _: Range<usize>) -> Result<Option<StoredKv>> {
        Ok(None)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A corpus's sample does not depend on its chunks: the samples of consecutive chunks,
    /// wherever they are cut, are the whole range's, and every sampled position ends a run
    /// of `every`.
    #[test]
    fn sampled_positions_do_not_depend_on_chunks() {
        assert_eq!(
            sampled_positions(5, 100, 0).count(),
            0,
            "one in 0 keeps none"
        );
        for every in [1, 3, 16] {
            let whole: Vec<usize> = sampled_positions(0, 200, every).collect();
            assert!(whole.iter().all(|p| (p + 1).is_multiple_of(every)));
            assert_eq!(whole.len(), 200 / every);
            for cuts in [
                vec![0, 1, 200],
                vec![0, 15, 16, 17, 90, 200],
                vec![0, 77, 200],
            ] {
                let chunked: Vec<usize> = cuts
                    .windows(2)
                    .flat_map(|w| sampled_positions(w[0], w[1] - w[0], every))
                    .collect();
                assert_eq!(chunked, whole, "every {every}, cut at {cuts:?}");
            }
        }
    }
}
