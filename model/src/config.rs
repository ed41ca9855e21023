//! The typed model configuration, read once from GGUF metadata.
//!
//! Everything the forward pass and the attention backends need to know about a model lives
//! here: sizes, the per-layer attention policy (global or sliding window, RoPE base) and the
//! architecture's small differences (norms, activation, biases).

use std::collections::HashMap;

use candle_core::quantized::gguf_file::{Content, Value};

use crate::error::{ModelError, Result};

/// The transformer families kvdb implements.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Architecture {
    /// Gemma 3: QK-norm, sandwich norms, GELU, sliding-window layers with a local RoPE base.
    Gemma3,
    /// Llama 2/3, Mistral and SmolLM-style models.
    Llama,
    /// Qwen2: Llama with biases on the Q/K/V projections.
    Qwen2,
}

impl Architecture {
    /// The names kvdb accepts in `general.architecture`.
    pub const SUPPORTED: &'static str = "gemma3, llama, qwen2";

    /// Parses `general.architecture`.
    pub fn from_gguf_name(name: &str) -> Result<Self> {
        match name {
            "gemma3" => Ok(Self::Gemma3),
            "llama" => Ok(Self::Llama),
            "qwen2" => Ok(Self::Qwen2),
            other => Err(ModelError::UnsupportedArchitecture {
                arch: other.to_string(),
                supported: Self::SUPPORTED,
            }),
        }
    }

    /// The metadata prefix of this architecture.
    pub fn gguf_name(self) -> &'static str {
        match self {
            Self::Gemma3 => "gemma3",
            Self::Llama => "llama",
            Self::Qwen2 => "qwen2",
        }
    }
}

/// The MLP's gate activation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Activation {
    /// GELU with the tanh approximation (Gemma).
    GeluTanh,
    /// SiLU / swish (Llama, Qwen2).
    Silu,
}

/// How RoPE pairs the dimensions of a head.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RopeStyle {
    /// Adjacent pairs (2i, 2i+1): llama GGUF files, whose Q/K rows are permuted for it.
    Interleaved,
    /// Pairs (i, i + d/2): Gemma and Qwen2 ("neox" style).
    Halves,
}

/// How RoPE frequencies are stretched beyond the trained length.
#[derive(Debug, Clone, PartialEq)]
pub enum RopeScaling {
    /// Plain RoPE.
    None,
    /// Positions divided by `factor` (linear interpolation).
    Linear {
        /// The divisor.
        factor: f32,
    },
    /// Per-frequency divisors (Llama 3.1's `rope_freqs.weight`).
    Frequencies(Vec<f32>),
}

/// RoPE parameters of one layer.
#[derive(Debug, Clone, PartialEq)]
pub struct RopeConfig {
    /// The base θ of the frequencies θ^(-2i/d).
    pub base: f32,
    /// The pairing of dimensions.
    pub style: RopeStyle,
    /// Frequency scaling.
    pub scaling: RopeScaling,
}

/// Which past tokens a layer's queries attend to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LayerKind {
    /// Every earlier token (a "retrieval layer" in kvdb's terms).
    Global,
    /// The last `window` tokens, the query's own included: key position k is seen from query
    /// position p when `p - window < k <= p` (the convention of HF transformers and llama.cpp).
    SlidingWindow {
        /// Tokens seen, the query's own included.
        window: usize,
    },
}

/// The attention policy of one layer.
#[derive(Debug, Clone, PartialEq)]
pub struct LayerSpec {
    /// Layer index, from 0.
    pub index: usize,
    /// Global or sliding window.
    pub kind: LayerKind,
    /// RoPE of this layer.
    pub rope: RopeConfig,
}

/// A model's configuration, read from GGUF metadata.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    /// The architecture.
    pub architecture: Architecture,
    /// `general.name`, if present.
    pub name: Option<String>,
    /// Vocabulary size (rows of the embedding).
    pub vocab_size: usize,
    /// Residual stream width.
    pub hidden_size: usize,
    /// MLP inner width.
    pub intermediate_size: usize,
    /// Query heads.
    pub n_heads: usize,
    /// Key/value heads (GQA: `n_heads` is a multiple of it).
    pub n_kv_heads: usize,
    /// Dimension of each head (queries, keys and values).
    pub head_dim: usize,
    /// The trained context length in tokens.
    pub context_length: usize,
    /// RMS norm epsilon.
    pub norm_eps: f64,
    /// MLP activation.
    pub activation: Activation,
    /// RMS norms on each head's query and key (Gemma 3).
    pub qk_norm: bool,
    /// Norms after attention and after the MLP, before the residual add (Gemma).
    pub sandwich_norms: bool,
    /// Embeddings are multiplied by this (Gemma: sqrt(hidden_size)).
    pub embedding_scale: Option<f32>,
    /// Attention logits are multiplied by this.
    pub attention_scale: f32,
    /// Q/K/V projections have biases (Qwen2).
    pub qkv_bias: bool,
    /// Per-layer attention policy, one entry per layer.
    pub layers: Vec<LayerSpec>,
}

/// Gemma 3 puts a global layer after every five sliding-window layers (llama.cpp and HF
/// transformers hard-code the same pattern when the file does not say).
const GEMMA3_SLIDING_PATTERN: usize = 6;
/// Gemma 3's RoPE base on sliding-window layers when the file does not say.
const GEMMA3_LOCAL_ROPE_BASE: f32 = 10_000.0;

/// Typed access to GGUF metadata with errors that name the key.
pub(crate) struct Metadata<'a> {
    map: &'a HashMap<String, Value>,
    prefix: &'static str,
}

impl<'a> Metadata<'a> {
    pub(crate) fn new(map: &'a HashMap<String, Value>, prefix: &'static str) -> Self {
        Self { map, prefix }
    }

    fn arch_key(&self, key: &str) -> String {
        format!("{}.{key}", self.prefix)
    }

    fn bad(key: &str, reason: impl ToString) -> ModelError {
        ModelError::Metadata {
            key: key.to_string(),
            reason: reason.to_string(),
        }
    }

    /// An unsigned integer, whatever its stored width.
    pub(crate) fn uint(&self, key: &str) -> Result<Option<u64>> {
        let Some(value) = self.map.get(key) else {
            return Ok(None);
        };
        let v = match value {
            Value::U8(v) => *v as u64,
            Value::U16(v) => *v as u64,
            Value::U32(v) => *v as u64,
            Value::U64(v) => *v,
            Value::I8(v) if *v >= 0 => *v as u64,
            Value::I16(v) if *v >= 0 => *v as u64,
            Value::I32(v) if *v >= 0 => *v as u64,
            Value::I64(v) if *v >= 0 => *v as u64,
            other => {
                return Err(Self::bad(
                    key,
                    format!("expected an unsigned integer, found {other:?}"),
                ))
            }
        };
        Ok(Some(v))
    }

    pub(crate) fn float(&self, key: &str) -> Result<Option<f64>> {
        match self.map.get(key) {
            None => Ok(None),
            Some(Value::F32(v)) => Ok(Some(*v as f64)),
            Some(Value::F64(v)) => Ok(Some(*v)),
            Some(other) => Err(Self::bad(key, format!("expected a float, found {other:?}"))),
        }
    }

    pub(crate) fn string(&self, key: &str) -> Result<Option<&'a str>> {
        match self.map.get(key) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s.as_str())),
            Some(other) => Err(Self::bad(
                key,
                format!("expected a string, found {other:?}"),
            )),
        }
    }

    fn required_uint(&self, key: &str) -> Result<usize> {
        let full = self.arch_key(key);
        self.uint(&full)?
            .map(|v| v as usize)
            .ok_or_else(|| Self::bad(&full, "missing"))
    }

    fn optional_uint(&self, key: &str) -> Result<Option<usize>> {
        Ok(self.uint(&self.arch_key(key))?.map(|v| v as usize))
    }

    fn optional_float(&self, key: &str) -> Result<Option<f64>> {
        self.float(&self.arch_key(key))
    }
}

impl ModelConfig {
    /// Reads the configuration from a parsed GGUF header (metadata, and the tensor list for
    /// optional tensors such as biases and `rope_freqs.weight`).
    pub fn from_gguf(content: &Content) -> Result<Self> {
        let arch_name = match content.metadata.get("general.architecture") {
            Some(Value::String(s)) => s.clone(),
            Some(other) => {
                return Err(ModelError::Metadata {
                    key: "general.architecture".into(),
                    reason: format!("expected a string, found {other:?}"),
                })
            }
            None => {
                return Err(ModelError::Metadata {
                    key: "general.architecture".into(),
                    reason: "missing: this GGUF file does not say which model it holds".into(),
                })
            }
        };
        let architecture = Architecture::from_gguf_name(&arch_name)?;
        let md = Metadata::new(&content.metadata, architecture.gguf_name());
        let hidden_size = md.required_uint("embedding_length")?;
        let n_layers = md.required_uint("block_count")?;
        let n_heads = md.required_uint("attention.head_count")?;
        let n_kv_heads = md
            .optional_uint("attention.head_count_kv")?
            .unwrap_or(n_heads);
        let intermediate_size = md.required_uint("feed_forward_length")?;
        let context_length = md.required_uint("context_length")?;
        let head_dim = match md.optional_uint("attention.key_length")? {
            Some(d) => d,
            None if n_heads > 0 => hidden_size / n_heads,
            None => 0,
        };
        if n_heads == 0 || n_kv_heads == 0 || n_heads % n_kv_heads != 0 || head_dim == 0 {
            return Err(ModelError::Metadata {
                key: format!("{arch_name}.attention.head_count"),
                reason: format!(
                    "{n_heads} query heads, {n_kv_heads} KV heads and head dim {head_dim} do not make a valid attention"
                ),
            });
        }
        if head_dim % 2 != 0 {
            return Err(ModelError::Metadata {
                key: format!("{arch_name}.attention.key_length"),
                reason: format!("head dim {head_dim} is odd; RoPE needs pairs"),
            });
        }
        if let Some(v) = md.optional_uint("attention.value_length")? {
            if v != head_dim {
                return Err(ModelError::Metadata {
                    key: format!("{arch_name}.attention.value_length"),
                    reason: format!("value length {v} differs from key length {head_dim}, which kvdb does not support"),
                });
            }
        }
        if let Some(rot) = md.optional_uint("rope.dimension_count")? {
            if rot != head_dim {
                return Err(ModelError::Metadata {
                    key: format!("{arch_name}.rope.dimension_count"),
                    reason: format!(
                        "partial rotary embeddings ({rot} of {head_dim} dims) are not supported"
                    ),
                });
            }
        }
        let norm_eps = md
            .optional_float("attention.layer_norm_rms_epsilon")?
            .ok_or_else(|| ModelError::Metadata {
                key: format!("{arch_name}.attention.layer_norm_rms_epsilon"),
                reason: "missing".into(),
            })?;
        let vocab_size = content
            .tensor_infos
            .get("token_embd.weight")
            .map(|t| t.shape.dims()[0])
            .ok_or_else(|| ModelError::Tensor {
                name: "token_embd.weight".into(),
                reason: "missing".into(),
            })?;
        let name = md.string("general.name")?.map(str::to_string);
        let rope_base = md.optional_float("rope.freq_base")?.unwrap_or(10_000.0) as f32;
        let scaling = rope_scaling(&md, content)?;

        let mut config = ModelConfig {
            architecture,
            name,
            vocab_size,
            hidden_size,
            intermediate_size,
            n_heads,
            n_kv_heads,
            head_dim,
            context_length,
            norm_eps,
            activation: Activation::Silu,
            qk_norm: false,
            sandwich_norms: false,
            embedding_scale: None,
            attention_scale: 1.0 / (head_dim as f32).sqrt(),
            qkv_bias: false,
            layers: Vec::with_capacity(n_layers),
        };
        match architecture {
            Architecture::Gemma3 => {
                config.activation = Activation::GeluTanh;
                config.qk_norm = true;
                config.sandwich_norms = true;
                config.embedding_scale = Some((hidden_size as f32).sqrt());
                // Gemma 3 27B scales by hidden/heads instead of the head dim (its
                // query_pre_attn_scalar); every smaller size uses the head dim.
                if n_layers == 62 {
                    config.attention_scale = 1.0 / ((hidden_size / n_heads) as f32).sqrt();
                }
                let window = md.optional_uint("attention.sliding_window")?;
                let pattern = md
                    .optional_uint("attention.sliding_window_pattern")?
                    .unwrap_or(GEMMA3_SLIDING_PATTERN)
                    .max(1);
                let local_base = md
                    .optional_float("rope.local_freq_base")?
                    .map(|b| b as f32)
                    .unwrap_or(GEMMA3_LOCAL_ROPE_BASE);
                for index in 0..n_layers {
                    let sliding = (index + 1) % pattern != 0;
                    let (kind, rope) = match (sliding, window) {
                        (true, Some(window)) => (
                            LayerKind::SlidingWindow { window },
                            RopeConfig {
                                base: local_base,
                                style: RopeStyle::Halves,
                                scaling: RopeScaling::None,
                            },
                        ),
                        _ => (
                            LayerKind::Global,
                            RopeConfig {
                                base: rope_base,
                                style: RopeStyle::Halves,
                                scaling: scaling.clone(),
                            },
                        ),
                    };
                    config.layers.push(LayerSpec { index, kind, rope });
                }
            }
            Architecture::Llama | Architecture::Qwen2 => {
                let style = if architecture == Architecture::Llama {
                    RopeStyle::Interleaved
                } else {
                    RopeStyle::Halves
                };
                config.qkv_bias = content.tensor_infos.contains_key("blk.0.attn_q.bias");
                let kind = match md.optional_uint("attention.sliding_window")? {
                    Some(window) if window > 0 => LayerKind::SlidingWindow { window },
                    _ => LayerKind::Global,
                };
                for index in 0..n_layers {
                    config.layers.push(LayerSpec {
                        index,
                        kind,
                        rope: RopeConfig {
                            base: rope_base,
                            style,
                            scaling: scaling.clone(),
                        },
                    });
                }
            }
        }
        if n_layers == 0 {
            return Err(ModelError::Metadata {
                key: format!("{arch_name}.block_count"),
                reason: "the model has no layers".into(),
            });
        }
        Ok(config)
    }

    /// Number of transformer layers.
    pub fn n_layers(&self) -> usize {
        self.layers.len()
    }

    /// Query heads per KV head.
    pub fn group_size(&self) -> usize {
        self.n_heads / self.n_kv_heads
    }

    /// Indices of the layers that attend to the whole context.
    pub fn global_layers(&self) -> Vec<usize> {
        self.layers
            .iter()
            .filter(|l| l.kind == LayerKind::Global)
            .map(|l| l.index)
            .collect()
    }
}

fn rope_scaling(md: &Metadata<'_>, content: &Content) -> Result<RopeScaling> {
    if content.tensor_infos.contains_key("rope_freqs.weight") {
        // The factors themselves are read with the weights; the config records the kind.
        return Ok(RopeScaling::Frequencies(Vec::new()));
    }
    let kind = md.string(&md.arch_key("rope.scaling.type"))?;
    let factor = md.optional_float("rope.scaling.factor")?;
    match (kind, factor) {
        (Some("none"), _) | (None, None) => Ok(RopeScaling::None),
        (Some("linear") | None, Some(f)) if f > 0.0 && f != 1.0 => {
            Ok(RopeScaling::Linear { factor: f as f32 })
        }
        (Some("linear") | None, Some(_)) => Ok(RopeScaling::None),
        (Some("linear"), None) => Ok(RopeScaling::None),
        (Some(other), _) => Err(ModelError::Metadata {
            key: md.arch_key("rope.scaling.type"),
            reason: format!("RoPE scaling `{other}` is not supported (none and linear are)"),
        }),
    }
}
