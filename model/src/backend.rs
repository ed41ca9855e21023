//! The attention hook: every attention layer of the forward pass hands its queries and the
//! new keys and values to an [`AttentionBackend`], which returns the attention output.
//!
//! Tensor layouts (f32): queries and outputs `[tokens, n_heads, head_dim]`; keys and values
//! `[tokens, n_kv_heads, head_dim]`. Queries and keys arrive *pre-RoPE* (after Gemma's
//! q_norm/k_norm, before rotation); the backend rotates them with `input.rope` at the
//! positions it is given, which is what lets kvdb store pre-RoPE keys and remap positions.

use std::ops::Range;

use candle_core::{Device, Tensor, D};

use crate::config::{LayerKind, LayerSpec, ModelConfig};
use crate::error::{ModelError, Result};
use crate::ops::{causal_softmax, matmul, Rhs};
use crate::rope::Rope;

/// What one attention layer hands to the backend for one chunk of tokens.
#[derive(Debug, Clone)]
pub struct AttentionInput<'a> {
    /// The layer's policy: index, global or sliding window, RoPE configuration.
    pub layer: &'a LayerSpec,
    /// The layer's RoPE, ready to apply.
    pub rope: &'a Rope,
    /// Attention logits are multiplied by this.
    pub scale: f32,
    /// Pre-RoPE queries, `[tokens, n_heads, head_dim]`.
    pub queries: &'a Tensor,
    /// Pre-RoPE keys of the new tokens, `[tokens, n_kv_heads, head_dim]`.
    pub keys: &'a Tensor,
    /// Values of the new tokens, `[tokens, n_kv_heads, head_dim]`.
    pub values: &'a Tensor,
    /// Positions of the new tokens (consecutive).
    pub positions: Range<usize>,
}

/// The seam between the model and attention: called once per layer per forward call, in
/// layer order, with the chunk's tokens. Returns `[tokens, n_heads, head_dim]`.
///
/// Closures implement it too, which keeps test backends small:
/// ```
/// # use kvdb_model::{AttentionBackend, AttentionInput};
/// let mut calls = 0;
/// let mut counting = |input: &AttentionInput<'_>| {
///     calls += 1;
///     Ok(input.queries.clone())
/// };
/// # let _ = &mut counting as &mut dyn AttentionBackend;
/// ```
pub trait AttentionBackend {
    /// Attends the chunk's queries to everything the backend keeps for this layer plus the
    /// chunk's own keys and values, which it takes into its state.
    fn attend(&mut self, input: &AttentionInput<'_>) -> Result<Tensor>;
}

impl<F> AttentionBackend for F
where
    F: FnMut(&AttentionInput<'_>) -> Result<Tensor>,
{
    fn attend(&mut self, input: &AttentionInput<'_>) -> Result<Tensor> {
        self(input)
    }
}

/// Queries per block in prefill: large enough for efficient matrix products, small enough
/// that causal and sliding-window blocks skip most of the masked area.
const QUERY_BLOCK: usize = 256;

/// One layer's keys (rotated) and values, `[n_kv_heads, capacity, head_dim]`, of which the
/// first `len` tokens are valid; token `i` sits at position `first_position + i`.
#[derive(Debug, Clone)]
struct LayerCache {
    keys: Tensor,
    values: Tensor,
    len: usize,
    first_position: usize,
}

impl LayerCache {
    fn empty(n_kv_heads: usize, head_dim: usize, device: &Device) -> Result<Self> {
        Ok(Self {
            keys: Tensor::zeros((n_kv_heads, 0, head_dim), candle_core::DType::F32, device)?,
            values: Tensor::zeros((n_kv_heads, 0, head_dim), candle_core::DType::F32, device)?,
            len: 0,
            first_position: 0,
        })
    }

    fn next_position(&self) -> usize {
        self.first_position + self.len
    }

    /// Appends `[n_kv, t, d]` keys and values, first dropping what a sliding window will never
    /// see again (`keep` tokens are kept) when the buffer is full.
    fn append(&mut self, keys: &Tensor, values: &Tensor, keep: Option<usize>) -> Result<()> {
        let (n_kv, t, d) = keys.dims3()?;
        let capacity = self.keys.dim(1)?;
        if self.len + t > capacity {
            let kept = keep.map_or(self.len, |k| k.min(self.len));
            let dropped = self.len - kept;
            let new_capacity = match keep {
                Some(k) => (kept + t).max(2 * k + 64),
                None => (kept + t).max(2 * capacity),
            };
            let device = self.keys.device().clone();
            let grow = |old: &Tensor| -> Result<Tensor> {
                let fresh =
                    Tensor::zeros((n_kv, new_capacity, d), candle_core::DType::F32, &device)?;
                if kept > 0 {
                    fresh.slice_set(&old.narrow(1, dropped, kept)?.contiguous()?, 1, 0)?;
                }
                Ok(fresh)
            };
            self.keys = grow(&self.keys)?;
            self.values = grow(&self.values)?;
            self.len = kept;
            self.first_position += dropped;
        }
        self.keys.slice_set(&keys.contiguous()?, 1, self.len)?;
        self.values.slice_set(&values.contiguous()?, 1, self.len)?;
        self.len += t;
        Ok(())
    }
}

/// Exact attention with its own KV cache: the reference every other backend is measured
/// against. Sliding-window layers keep only what their window can still see.
#[derive(Debug, Clone)]
pub struct FullAttention {
    layers: Vec<Option<LayerCache>>,
    n_kv_heads: usize,
    head_dim: usize,
}

impl FullAttention {
    /// An empty cache for a model of this configuration.
    pub fn new(config: &ModelConfig) -> Self {
        Self {
            layers: vec![None; config.n_layers()],
            n_kv_heads: config.n_kv_heads,
            head_dim: config.head_dim,
        }
    }

    /// Tokens processed so far (the next position).
    pub fn position(&self) -> usize {
        self.layers
            .iter()
            .flatten()
            .map(LayerCache::next_position)
            .max()
            .unwrap_or(0)
    }

    /// Tokens kept for `layer` (less than [`FullAttention::position`] on sliding-window layers).
    pub fn cached_tokens(&self, layer: usize) -> usize {
        self.layers
            .get(layer)
            .and_then(Option::as_ref)
            .map_or(0, |c| c.len)
    }

    /// Takes earlier tokens' pre-RoPE keys and values `[t, n_kv_heads, head_dim]` at
    /// `positions` into the cache of `layer` without attending, e.g. a stored corpus that
    /// later calls continue. The layer's cache must be empty or end where `positions` start;
    /// a sliding-window layer needs at least its last `window - 1` tokens.
    pub fn preload(
        &mut self,
        layer: &LayerSpec,
        rope: &Rope,
        keys: &Tensor,
        values: &Tensor,
        positions: Range<usize>,
    ) -> Result<()> {
        let cache = self.layer_cache(layer.index, positions.start, true, keys.device())?;
        let (cos, sin) = rope.tables(positions, keys.device())?;
        let k = rope.apply_with(keys, &cos, &sin)?;
        cache.append(
            &k.transpose(0, 1)?,
            &values.transpose(0, 1)?,
            sliding_keep(layer),
        )
    }

    /// The cache of layer `index`, created empty when absent (beginning at `start` when
    /// `anywhere`, else at 0); an error when the layer does not exist or the cache does not
    /// end at `start`.
    fn layer_cache(
        &mut self,
        index: usize,
        start: usize,
        anywhere: bool,
        device: &Device,
    ) -> Result<&mut LayerCache> {
        let n_layers = self.layers.len();
        let cache = match self.layers.get_mut(index) {
            Some(slot) => match slot {
                Some(c) => c,
                None => {
                    let mut empty = LayerCache::empty(self.n_kv_heads, self.head_dim, device)?;
                    if anywhere {
                        empty.first_position = start;
                    }
                    slot.insert(empty)
                }
            },
            None => {
                return Err(ModelError::Backend {
                    layer: index,
                    reason: format!("the cache was made for {n_layers} layers"),
                })
            }
        };
        if cache.next_position() != start {
            return Err(ModelError::Backend {
                layer: index,
                reason: format!(
                    "positions must continue the cache: expected {}, got {start}",
                    cache.next_position(),
                ),
            });
        }
        Ok(cache)
    }
}

/// How many tokens a layer's cache must keep: a sliding window never looks further back
/// than `window - 1` tokens before the newest.
fn sliding_keep(layer: &LayerSpec) -> Option<usize> {
    match layer.kind {
        LayerKind::Global => None,
        LayerKind::SlidingWindow { window } => Some(window.saturating_sub(1)),
    }
}

impl AttentionBackend for FullAttention {
    fn attend(&mut self, input: &AttentionInput<'_>) -> Result<Tensor> {
        let device = input.queries.device().clone();
        let cache = self.layer_cache(input.layer.index, input.positions.start, false, &device)?;
        let (cos, sin) = input.rope.tables(input.positions.clone(), &device)?;
        let q = input.rope.apply_with(input.queries, &cos, &sin)?;
        let k = input.rope.apply_with(input.keys, &cos, &sin)?;
        let window = match input.layer.kind {
            LayerKind::Global => None,
            LayerKind::SlidingWindow { window } => Some(window),
        };
        cache.append(
            &k.transpose(0, 1)?,
            &input.values.transpose(0, 1)?,
            sliding_keep(input.layer),
        )?;
        let span = CausalSpan {
            first_query: input.positions.start,
            first_key: cache.first_position,
            window,
            scale: input.scale,
        };
        causal_attention(
            &q,
            &cache.keys.narrow(1, 0, cache.len)?,
            &cache.values.narrow(1, 0, cache.len)?,
            span,
        )
    }
}

/// Where the queries and keys of a [`causal_attention`] call sit, and how they attend.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CausalSpan {
    /// Position of the first query.
    pub first_query: usize,
    /// Position of the first key.
    pub first_key: usize,
    /// A sliding window: a query at `p` sees keys after `p - window` (`None`: all before it).
    pub window: Option<usize>,
    /// Scale of `q · k`.
    pub scale: f32,
}

/// Causal (optionally sliding-window) attention of rotated queries `[t, h, d]` at positions
/// `first_query..first_query + t` over keys and values `[n_kv, s, d]` at positions
/// `first_key..first_key + s` (`span`). GQA: query head `i` reads KV head `i / (h / n_kv)`.
/// Returns `[t, h, d]`.
pub fn causal_attention(
    q: &Tensor,
    keys: &Tensor,
    values: &Tensor,
    span: CausalSpan,
) -> Result<Tensor> {
    let CausalSpan {
        first_query,
        first_key,
        window,
        scale,
    } = span;
    let (t, h, d) = q.dims3()?;
    let (n_kv, s, _) = keys.dims3()?;
    let group = h / n_kv;
    // [t, h, d] -> [n_kv, group * t, d]: the rows of one KV head's query group, head-major.
    let q = (q * scale as f64)?
        .transpose(0, 1)?
        .contiguous()?
        .reshape((n_kv, group * t, d))?;
    let mut blocks = Vec::with_capacity(t.div_ceil(QUERY_BLOCK));
    let mut t0 = 0;
    while t0 < t {
        let tb = QUERY_BLOCK.min(t - t0);
        let first = first_query + t0;
        let last = first + tb - 1;
        // Keys this block can see: positions lo..=last.
        let lo = window
            .map_or(0, |w| (first + 1).saturating_sub(w))
            .max(first_key);
        let hi = (last + 1).min(first_key + s);
        let (k0, kn) = (lo - first_key, hi.saturating_sub(lo));
        let qb = q
            .reshape((n_kv, group, t, d))?
            .narrow(2, t0, tb)?
            .reshape((n_kv, group * tb, d))?;
        let kb = keys.narrow(1, k0, kn)?;
        let vb = values.narrow(1, k0, kn)?;
        let scores = matmul(&qb, &kb, Rhs::Transposed)?; // [n_kv, group * tb, kn]
        let probs = causal_softmax(&scores, tb, first, lo, window)?;
        let out = matmul(&probs, &vb, Rhs::AsIs)?; // [n_kv, group * tb, d]
        blocks.push(out.reshape((h, tb, d))?);
        t0 += tb;
    }
    let out = if blocks.len() == 1 {
        blocks
            .pop()
            .ok_or_else(|| candle_core::Error::Msg("no block".into()))?
    } else {
        Tensor::cat(&blocks, D::Minus2)?
    };
    Ok(out.transpose(0, 1)?.contiguous()?)
}

/// One attention call as a [`Capture`] saw it.
#[derive(Debug, Clone)]
pub struct CapturedLayer {
    /// Layer index.
    pub layer: usize,
    /// Positions of the chunk.
    pub positions: Range<usize>,
    /// Pre-RoPE queries `[tokens, n_heads, head_dim]`.
    pub queries: Tensor,
    /// Pre-RoPE keys `[tokens, n_kv_heads, head_dim]`.
    pub keys: Tensor,
    /// Values `[tokens, n_kv_heads, head_dim]`.
    pub values: Tensor,
}

/// Wraps a backend and keeps every layer's pre-RoPE queries, keys and values (for the store
/// and for benches), passing each call on unchanged.
#[derive(Debug)]
pub struct Capture<B> {
    inner: B,
    /// What was seen, in call order.
    pub calls: Vec<CapturedLayer>,
    layers: Option<Vec<usize>>,
}

impl<B: AttentionBackend> Capture<B> {
    /// Captures every layer.
    pub fn new(inner: B) -> Self {
        Self {
            inner,
            calls: Vec::new(),
            layers: None,
        }
    }

    /// Captures only the calls of these layers.
    pub fn only(inner: B, layers: Vec<usize>) -> Self {
        Self {
            inner,
            calls: Vec::new(),
            layers: Some(layers),
        }
    }

    /// The wrapped backend.
    pub fn inner(&self) -> &B {
        &self.inner
    }

    /// The wrapped backend and the captured calls.
    pub fn into_parts(self) -> (B, Vec<CapturedLayer>) {
        (self.inner, self.calls)
    }
}

impl<B: AttentionBackend> AttentionBackend for Capture<B> {
    fn attend(&mut self, input: &AttentionInput<'_>) -> Result<Tensor> {
        if self
            .layers
            .as_ref()
            .is_none_or(|l| l.contains(&input.layer.index))
        {
            self.calls.push(CapturedLayer {
                layer: input.layer.index,
                positions: input.positions.clone(),
                queries: input.queries.clone(),
                keys: input.keys.clone(),
                values: input.values.clone(),
            });
        }
        self.inner.attend(input)
    }
}
