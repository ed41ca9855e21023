//! The transformer forward pass for gemma3, llama and qwen2, written here so that attention is
//! a hook ([`AttentionBackend`]) and the pre-RoPE queries, keys and values come out of it.
//!
//! Weights are immutable and shared; sequence state (the KV cache) belongs to the backend
//! passed to [`Model::forward`].

use std::sync::Arc;

use candle_core::quantized::{GgmlDType, QMatMul, QTensor};
use candle_core::{DType, Device, IndexOp, Module, Tensor};

use crate::backend::{AttentionBackend, AttentionInput};
use crate::config::{Activation, ModelConfig, RopeScaling};
use crate::error::{ModelError, Result};
use crate::forward::{check_call, CpuSequence, SequenceOptions};
use crate::gguf::GgufFile;
use crate::ops::{gated_activation, matmul, q8_0_small_matmul, small_matmul, Rhs};
use crate::rope::Rope;

/// How projection weights are held and multiplied.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum WeightMode {
    /// Dequantized to f32 at load: exact f32 products (what candle does with
    /// `CANDLE_DEQUANTIZE_ALL=1`). The reference mode.
    Dequantized,
    /// Kept quantized; products through candle's quantized kernels, which round activations
    /// to 8 bits. Least memory.
    Quantized,
    /// Both: f32 products for chunks of at least [`DENSE_MIN_ROWS`] tokens (prefill, where
    /// they are fastest), quantized kernels for fewer rows (decode, where reading fewer
    /// weight bytes wins) for the storage types candle has SIMD kernels for.
    #[default]
    Hybrid,
}

/// In [`WeightMode::Hybrid`], chunks of at least this many tokens use f32 products.
pub const DENSE_MIN_ROWS: usize = 16;

/// Options for loading a model.
#[derive(Debug, Clone, Default)]
pub struct LoadOptions {
    /// How projection weights are held.
    pub weights: WeightMode,
    /// Overrides the MLP activation read from the architecture. Only for comparisons with
    /// implementations that use another one (candle's quantized_gemma3 uses SiLU).
    pub activation: Option<Activation>,
}

/// Which positions of a forward call produce logits.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Logits {
    /// None (prefill of context that will not be sampled from).
    None,
    /// The chunk's last token.
    Last,
    /// Every token of the chunk.
    All,
    /// These token indices within the chunk.
    Rows(Vec<usize>),
}

/// A projection `y = x Wᵀ (+ b)`.
#[derive(Debug, Clone)]
pub(crate) struct Linear {
    pub(crate) dense: Option<Tensor>,
    pub(crate) quantized: Option<QMatMul>,
    pub(crate) bias: Option<Tensor>,
}

/// Storage types whose quantized products candle vectorises on x86 (AVX2) and ARM; others
/// (Q5_0, Q4_1, ...) run a scalar loop slower than an f32 product.
fn has_fast_quantized_kernel(dtype: GgmlDType) -> bool {
    use GgmlDType::*;
    matches!(dtype, Q4_0 | Q8_0 | Q2K | Q3K | Q4K | Q5K | Q6K)
}

impl Linear {
    fn new(weight: QTensor, bias: Option<Tensor>, mode: WeightMode) -> Result<Self> {
        let weight = Arc::new(weight);
        let float = matches!(
            weight.dtype(),
            GgmlDType::F32 | GgmlDType::F16 | GgmlDType::BF16
        );
        let dense = match mode {
            WeightMode::Quantized if !float => None,
            _ => Some(weight.dequantize(&weight.device())?),
        };
        let quantized = match mode {
            WeightMode::Quantized if !float => Some(QMatMul::QTensor(weight)),
            WeightMode::Hybrid if has_fast_quantized_kernel(weight.dtype()) => {
                Some(QMatMul::QTensor(weight))
            }
            _ => None,
        };
        Ok(Self {
            dense,
            quantized,
            bias,
        })
    }

    /// Drops the weight and bias ([`Model::release_weights`]).
    fn release(&mut self) {
        self.dense = None;
        self.quantized = None;
        self.bias = None;
    }

    /// `x`: `[rows, in]` → `[rows, out]`.
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let rows = x.dim(0)?;
        let small = rows < DENSE_MIN_ROWS;
        let y = match (&self.dense, &self.quantized) {
            (Some(w), _) if !small => matmul(x, w, Rhs::Transposed)?,
            (_, Some(QMatMul::QTensor(q)))
                if small && q.dtype() == GgmlDType::Q8_0 && x.device().is_cpu() =>
            {
                match q8_0_small_matmul(x, q)? {
                    Some(y) => y,
                    None => QMatMul::QTensor(q.clone()).forward(x)?,
                }
            }
            (_, Some(q)) => q.forward(x)?,
            (Some(w), None) if w.device().is_cpu() => small_matmul(x, w)?,
            (Some(w), None) => matmul(x, w, Rhs::Transposed)?,
            (None, None) => {
                return Err(ModelError::Internal("a projection without weights".into()))
            }
        };
        Ok(match &self.bias {
            Some(b) => y.broadcast_add(b)?,
            None => y,
        })
    }
}

/// Projections of one input computed together: one matrix product over the stacked f32
/// weights for prefill chunks (fewer, larger products pack the input once), and part by part
/// for decode (quantized kernels or small products).
#[derive(Debug, Clone)]
pub(crate) struct Fused {
    pub(crate) stacked: Option<Tensor>,
    pub(crate) parts: Vec<Linear>,
}

impl Fused {
    /// Drops the stacked weight and its parts ([`Model::release_weights`]).
    fn release(&mut self) {
        self.stacked = None;
        self.parts.clear();
    }

    fn new(mut parts: Vec<Linear>) -> Result<Self> {
        let dense: Option<Vec<Tensor>> = parts.iter().map(|p| p.dense.clone()).collect();
        let stacked = match dense {
            Some(weights) if weights.len() > 1 => {
                let stacked = Tensor::cat(&weights, 0)?;
                // The parts keep views into the stacked weight, not copies.
                let mut offset = 0;
                for part in &mut parts {
                    let width = part.dense.as_ref().map_or(Ok(0), |w| w.dim(0))?;
                    part.dense = Some(stacked.narrow(0, offset, width)?);
                    offset += width;
                }
                Some(stacked)
            }
            _ => None,
        };
        Ok(Self { stacked, parts })
    }

    /// `x`: `[rows, in]` → one `[rows, out_i]` per part.
    fn forward(&self, x: &Tensor) -> Result<Vec<Tensor>> {
        let Some(stacked) = self
            .stacked
            .as_ref()
            .filter(|_| x.dim(0).is_ok_and(|r| r >= DENSE_MIN_ROWS))
        else {
            return self.parts.iter().map(|p| p.forward(x)).collect();
        };
        let y = matmul(x, stacked, Rhs::Transposed)?;
        let mut offset = 0;
        let mut out = Vec::with_capacity(self.parts.len());
        for part in &self.parts {
            let width = part.dense.as_ref().map_or(Ok(0), |w| w.dim(0))?;
            let yi = y.narrow(1, offset, width)?;
            out.push(match &part.bias {
                Some(b) => yi.broadcast_add(b)?,
                None => yi.contiguous()?,
            });
            offset += width;
        }
        Ok(out)
    }
}

/// RMS norm with a learned scale (GGUF stores Gemma's scale with its +1 already added).
#[derive(Debug, Clone)]
pub(crate) struct RmsNorm {
    pub(crate) weight: Tensor,
    pub(crate) eps: f32,
}

impl RmsNorm {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        Ok(candle_nn::ops::rms_norm(
            &x.contiguous()?,
            &self.weight,
            self.eps,
        )?)
    }
}

#[derive(Debug, Clone)]
pub(crate) struct Layer {
    pub(crate) attn_norm: RmsNorm,
    /// Q, K and V.
    pub(crate) qkv: Fused,
    pub(crate) wo: Linear,
    pub(crate) q_norm: Option<RmsNorm>,
    pub(crate) k_norm: Option<RmsNorm>,
    pub(crate) post_attn_norm: Option<RmsNorm>,
    pub(crate) ffn_norm: RmsNorm,
    /// The MLP's gate and up projections.
    pub(crate) gate_up: Fused,
    pub(crate) down: Linear,
    pub(crate) post_ffn_norm: Option<RmsNorm>,
    pub(crate) rope: Rope,
}

/// A loaded model: configuration and weights.
#[derive(Debug, Clone)]
pub struct Model {
    pub(crate) config: ModelConfig,
    pub(crate) embedding: Arc<QTensor>,
    pub(crate) layers: Vec<Layer>,
    pub(crate) output_norm: RmsNorm,
    pub(crate) output: Linear,
    pub(crate) activation: Activation,
    /// The output projection is the embedding (no `output.weight` in the file).
    #[cfg_attr(not(feature = "gpu"), allow(dead_code))]
    pub(crate) output_tied: bool,
    pub(crate) device: Device,
    /// The projections' weights were dropped ([`Model::release_weights`]): the configuration,
    /// norms, RoPE and embedding remain, and [`Model::forward`] refuses to run.
    pub(crate) released: bool,
}

impl Model {
    /// Loads a model from a GGUF file on `device`.
    pub fn load(
        path: impl AsRef<std::path::Path>,
        options: &LoadOptions,
        device: &Device,
    ) -> Result<Self> {
        let mut file = GgufFile::open(path)?;
        Self::from_gguf(&mut file, options, device)
    }

    /// Loads a model from an open GGUF file.
    pub fn from_gguf(file: &mut GgufFile, options: &LoadOptions, device: &Device) -> Result<Self> {
        let config = file.config()?;
        let (hidden, heads, kv_heads, head_dim) = (
            config.hidden_size,
            config.n_heads,
            config.n_kv_heads,
            config.head_dim,
        );
        let (q_dim, kv_dim) = (heads * head_dim, kv_heads * head_dim);
        let mode = options.weights;
        let eps = config.norm_eps as f32;
        let norm = |file: &mut GgufFile, name: &str, len: usize| -> Result<RmsNorm> {
            Ok(RmsNorm {
                weight: file.tensor(name, &[len], device)?.dequantize(device)?,
                eps,
            })
        };
        let linear = |file: &mut GgufFile, name: &str, out: usize, inp: usize| -> Result<Linear> {
            let weight = file.tensor(&format!("{name}.weight"), &[out, inp], device)?;
            let bias_name = format!("{name}.bias");
            let bias = if file.has_tensor(&bias_name) {
                Some(
                    file.tensor(&bias_name, &[out], device)?
                        .dequantize(device)?,
                )
            } else {
                None
            };
            Linear::new(weight, bias, mode)
        };
        let freq_factors = if file.has_tensor("rope_freqs.weight") {
            let t = file.tensor("rope_freqs.weight", &[head_dim / 2], device)?;
            Some(t.dequantize(device)?.to_vec1::<f32>()?)
        } else {
            None
        };

        // Layers with the same RoPE share one (and its table).
        let mut ropes: Vec<(crate::config::RopeConfig, Rope)> = Vec::new();
        let embedding =
            Arc::new(file.tensor("token_embd.weight", &[config.vocab_size, hidden], device)?);
        let mut layers = Vec::with_capacity(config.n_layers());
        for spec in &config.layers {
            let p = format!("blk.{}", spec.index);
            let optional_norm = |file: &mut GgufFile, suffix: &str, len: usize, wanted: bool| {
                wanted
                    .then(|| norm(file, &format!("{p}.{suffix}.weight"), len))
                    .transpose()
            };
            if matches!(spec.rope.scaling, RopeScaling::Frequencies(_)) && freq_factors.is_none() {
                return Err(ModelError::Tensor {
                    name: "rope_freqs.weight".into(),
                    reason: "missing".into(),
                });
            }
            layers.push(Layer {
                attn_norm: norm(file, &format!("{p}.attn_norm.weight"), hidden)?,
                qkv: Fused::new(vec![
                    linear(file, &format!("{p}.attn_q"), q_dim, hidden)?,
                    linear(file, &format!("{p}.attn_k"), kv_dim, hidden)?,
                    linear(file, &format!("{p}.attn_v"), kv_dim, hidden)?,
                ])?,
                wo: linear(file, &format!("{p}.attn_output"), hidden, q_dim)?,
                q_norm: optional_norm(file, "attn_q_norm", head_dim, config.qk_norm)?,
                k_norm: optional_norm(file, "attn_k_norm", head_dim, config.qk_norm)?,
                post_attn_norm: optional_norm(
                    file,
                    "post_attention_norm",
                    hidden,
                    config.sandwich_norms,
                )?,
                ffn_norm: norm(file, &format!("{p}.ffn_norm.weight"), hidden)?,
                gate_up: Fused::new(vec![
                    linear(
                        file,
                        &format!("{p}.ffn_gate"),
                        config.intermediate_size,
                        hidden,
                    )?,
                    linear(
                        file,
                        &format!("{p}.ffn_up"),
                        config.intermediate_size,
                        hidden,
                    )?,
                ])?,
                down: linear(
                    file,
                    &format!("{p}.ffn_down"),
                    hidden,
                    config.intermediate_size,
                )?,
                post_ffn_norm: optional_norm(file, "post_ffw_norm", hidden, config.sandwich_norms)?,
                rope: match ropes.iter().find(|(c, _)| c == &spec.rope) {
                    Some((_, r)) => r.clone(),
                    None => {
                        let r = Rope::new(&spec.rope, head_dim, freq_factors.as_deref());
                        ropes.push((spec.rope.clone(), r.clone()));
                        r
                    }
                },
            });
        }
        let output_norm = norm(file, "output_norm.weight", hidden)?;
        // Models without `output.weight` tie the output projection to the embedding.
        let output_tied = !file.has_tensor("output.weight");
        let output_name = if !output_tied {
            "output.weight"
        } else {
            "token_embd.weight"
        };
        let output = Linear::new(
            file.tensor(output_name, &[config.vocab_size, hidden], device)?,
            None,
            mode,
        )?;
        Ok(Self {
            activation: options.activation.unwrap_or(config.activation),
            config,
            embedding,
            layers,
            output_norm,
            output,
            output_tied,
            released: false,
            device: device.clone(),
        })
    }

    /// Drops the weights of every projection (attention, MLP and output), keeping what
    /// callers of a model that runs elsewhere still read: the configuration, the RoPE of each
    /// layer, the norms and the embedding. A model uploaded to a GPU (`GpuModel::new` copies
    /// what it needs) holds its projections there; on the host they are the dequantized f32
    /// weights, twice a bf16 file's size (30 GB for a 7B model), which would otherwise stay
    /// beside the pinned memory a large corpus needs. [`Model::forward`] (and the CPU
    /// sequence) then fails with [`ModelError::WeightsReleased`].
    pub fn release_weights(&mut self) {
        for layer in &mut self.layers {
            layer.qkv.release();
            layer.gate_up.release();
            layer.wo.release();
            layer.down.release();
        }
        self.output.release();
        self.released = true;
    }

    /// The model's configuration.
    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// The device the weights live on.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// A fresh sequence state of this model on the CPU (exact attention with its own KV
    /// cache), as the device-neutral [`crate::Forward`].
    pub fn sequence(&self, options: &SequenceOptions) -> Result<CpuSequence<'_>> {
        Ok(CpuSequence::new(self, options))
    }

    /// The RoPE of layer `layer` (what its backend receives as `AttentionInput::rope`), or
    /// `None` past the last layer.
    pub fn rope(&self, layer: usize) -> Option<&Rope> {
        self.layers.get(layer).map(|l| &l.rope)
    }

    /// Runs `tokens`, which sit at positions `start..start + tokens.len()`, through the
    /// model, calling `backend` once per layer. Returns the logits `[rows, vocab]` asked for
    /// by `logits` (`None` for [`Logits::None`]).
    pub fn forward(
        &self,
        tokens: &[u32],
        start: usize,
        backend: &mut dyn AttentionBackend,
        logits: &Logits,
    ) -> Result<Option<Tensor>> {
        if self.released {
            return Err(ModelError::WeightsReleased);
        }
        let cfg = &self.config;
        let t = tokens.len();
        if t == 0 {
            return Ok(None);
        }
        check_call(cfg, tokens, start, logits)?;
        let ids = Tensor::new(tokens, &self.device)?;
        let mut x = self.embedding.embedding(&ids)?;
        if let Some(scale) = cfg.embedding_scale {
            x = (x * scale as f64)?;
        }
        let positions = start..start + t;
        for (layer, spec) in self.layers.iter().zip(&cfg.layers) {
            let h = layer.attn_norm.forward(&x)?;
            let [q, k, v]: [Tensor; 3] = layer
                .qkv
                .forward(&h)?
                .try_into()
                .map_err(|_| ModelError::Internal("q/k/v projections are not three".into()))?;
            let q = q.reshape((t, cfg.n_heads, cfg.head_dim))?;
            let k = k.reshape((t, cfg.n_kv_heads, cfg.head_dim))?;
            let v = v.reshape((t, cfg.n_kv_heads, cfg.head_dim))?;
            let q = match &layer.q_norm {
                Some(n) => n.forward(&q)?,
                None => q,
            };
            let k = match &layer.k_norm {
                Some(n) => n.forward(&k)?,
                None => k,
            };
            let input = AttentionInput {
                layer: spec,
                rope: &layer.rope,
                scale: cfg.attention_scale,
                queries: &q,
                keys: &k,
                values: &v,
                positions: positions.clone(),
            };
            let attn = backend.attend(&input)?;
            if attn.dims() != [t, cfg.n_heads, cfg.head_dim] {
                return Err(ModelError::Backend {
                    layer: spec.index,
                    reason: format!(
                        "returned shape {:?}, expected {:?}",
                        attn.dims(),
                        [t, cfg.n_heads, cfg.head_dim]
                    ),
                });
            }
            let attn = layer
                .wo
                .forward(&attn.reshape((t, cfg.n_heads * cfg.head_dim))?)?;
            let attn = match &layer.post_attn_norm {
                Some(n) => n.forward(&attn)?,
                None => attn,
            };
            x = (x + attn)?;

            let h = layer.ffn_norm.forward(&x)?;
            let [gate, up]: [Tensor; 2] = layer
                .gate_up
                .forward(&h)?
                .try_into()
                .map_err(|_| candle_core::Error::Msg("gate/up projections".into()))?;
            let gated = gated_activation(self.activation, &gate, &up)?;
            let mlp = layer.down.forward(&gated)?;
            let mlp = match &layer.post_ffn_norm {
                Some(n) => n.forward(&mlp)?,
                None => mlp,
            };
            x = (x + mlp)?;
        }
        let rows = match logits {
            Logits::None => return Ok(None),
            Logits::Last => x.i(t - 1..t)?,
            Logits::All => x,
            Logits::Rows(rows) => {
                let idx: Vec<u32> = rows.iter().map(|&r| r as u32).collect();
                x.index_select(&Tensor::new(idx, &self.device)?, 0)?
            }
        };
        let h = self.output_norm.forward(&rows)?;
        Ok(Some(self.output.forward(&h)?.to_dtype(DType::F32)?))
    }
}
