//! kvdb-model: GGUF language models (gemma3, llama, qwen2) whose attention is a hook.
//!
//! kvdb stores and queries an LLM's KV cache, so the forward pass is written here: every
//! attention layer hands its pre-RoPE queries, keys and values with their positions to an
//! [`AttentionBackend`]. [`FullAttention`] is the exact backend with its own cache; retrieval
//! backends live in `kvdb-attention`. [`Capture`] records what each layer saw.
//!
//! Tensor layouts are stated once: activations `[tokens, hidden]`; queries
//! `[tokens, n_heads, head_dim]`; keys and values `[tokens, n_kv_heads, head_dim]`; logits
//! `[rows, vocab]`; all f32.
//!
//! ```no_run
//! use kvdb_model::{FullAttention, GgufFile, LoadOptions, Logits, Model};
//! # fn main() -> kvdb_model::Result<()> {
//! let device = candle_core::Device::Cpu;
//! let mut file = GgufFile::open("gemma-3-270m-q4_k_m.gguf")?;
//! let model = Model::from_gguf(&mut file, &LoadOptions::default(), &device)?;
//! let mut cache = FullAttention::new(model.config());
//! let logits = model.forward(&[2, 651, 6037], 0, &mut cache, &Logits::Last)?;
//! # Ok(()) }
//! ```

#![warn(missing_docs, missing_debug_implementations, unreachable_pub)]
#![deny(unused_must_use, unsafe_op_in_unsafe_fn)]

mod backend;
mod config;
mod error;
pub mod fetch;
mod forward;
mod gguf;
#[cfg(feature = "gpu")]
mod gpu;
#[cfg(feature = "gpu")]
mod graphs;
mod model;
mod ops;
mod rope;
pub mod tokenizer;

pub use backend::{
    causal_attention, AttentionBackend, AttentionInput, Capture, CapturedLayer, CausalSpan,
    FullAttention,
};
pub use config::{
    Activation, Architecture, LayerKind, LayerSpec, ModelConfig, RopeConfig, RopeScaling, RopeStyle,
};
pub use error::{ModelError, Result};
pub use forward::{
    greedy_token, sampled_positions, BackendSequence, CpuSequence, Forward, SampledQueries,
    SequenceOptions, StoredKv, CPU_PREFILL_CHUNK,
};
pub use gguf::GgufFile;
#[cfg(feature = "gpu")]
pub use gpu::{
    rope_pairs, Batch, BatchStep, ExternalAttention, GpuModel, LayerAttention, LayerCall, Pick,
    Picked, Precision, MAX_CHUNK as GPU_MAX_CHUNK,
};
#[cfg(feature = "gpu")]
pub use kvdb_kernels::{Gemm, Gpu, KernelError};
pub use model::{LoadOptions, Logits, Model, WeightMode, DENSE_MIN_ROWS};
pub use ops::blas_on_calling_threads;
pub use rope::Rope;
pub use tokenizer::{EncodeOptions, SpecialTokens, StreamDecoder, Tokenizer, TokenizerKind};
