//! Test support for kvdb's end-to-end tests: tiny random-weight GGUF models.
//!
//! [`TinyModel`] describes a model of one of the architectures kvdb implements (gemma3,
//! llama, qwen2) with every size settable, and writes it as a GGUF file laid out the way
//! llama.cpp writes one: the same metadata keys, tensor names and shapes, a SentencePiece
//! ("llama") tokenizer in the metadata. Weights are seeded random numbers scaled so that
//! activations stay of order one (projections `N(0, 1/fan_in)`, norm scales `N(1, 0.1²)`), which
//! keeps attention away from uniform and logits away from degenerate.
//!
//! ```no_run
//! use kvdb_tests::TinyModel;
//! # fn main() -> anyhow::Result<()> {
//! let file = TinyModel { layers: 3, ..TinyModel::llama() }.write_temp()?;
//! // `file` owns the temporary directory: keep it alive while the path is in use.
//! let path = file.path();
//! # let _ = path; Ok(()) }
//! ```
//!
//! Shapes are given as candle reports them, `[rows, cols]` = `[out, in]` for a projection;
//! GGUF stores the dimensions reversed, which [`candle_core::quantized::gguf_file::write`]
//! takes care of. Quantized types constrain the sizes: every weight's inner (last) dimension
//! must be a multiple of the type's block size (32 for `Q8_0`).

#![warn(missing_docs, missing_debug_implementations, unreachable_pub)]
#![deny(unused_must_use, unsafe_op_in_unsafe_fn)]

mod real_kv;
pub use real_kv::{
    attention_weights, candidates, default_model, gpl_text, last_quarter, mass_recall, real_kv,
    real_kv_whole, RealKv, SINK, WINDOW,
};

use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use candle_core::quantized::gguf_file::{self, Value};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};

/// The architectures a [`TinyModel`] can be written as.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TinyArch {
    /// Gemma 3: QK-norm, sandwich norms, sliding-window layers.
    Gemma3,
    /// Llama: interleaved RoPE, no biases.
    Llama,
    /// Qwen2: Llama with Q/K/V biases and half-split RoPE.
    Qwen2,
}

impl TinyArch {
    /// `general.architecture` and the metadata key prefix.
    pub fn gguf_name(self) -> &'static str {
        match self {
            Self::Gemma3 => "gemma3",
            Self::Llama => "llama",
            Self::Qwen2 => "qwen2",
        }
    }
}

/// A tiny random-weight model. Start from [`TinyModel::llama`], [`TinyModel::qwen2`] or
/// [`TinyModel::gemma3`] and override fields with struct update syntax. The presets
/// [`TinyModel::gemma3_270m`], [`TinyModel::llama3_8b`] and [`TinyModel::qwen2_0_5b`] have the
/// real models' shapes, for speed tests (the `random_model` binary writes them).
#[derive(Debug, Clone, PartialEq)]
pub struct TinyModel {
    /// The architecture.
    pub arch: TinyArch,
    /// Transformer layers (`block_count`).
    pub layers: usize,
    /// Residual width (`embedding_length`).
    pub hidden: usize,
    /// MLP width (`feed_forward_length`).
    pub intermediate: usize,
    /// Query heads.
    pub heads: usize,
    /// Key/value heads.
    pub kv_heads: usize,
    /// Dimension of each head. Written as `attention.key_length`/`value_length` for gemma3,
    /// and for llama/qwen2 only when it differs from `hidden / heads`.
    pub head_dim: usize,
    /// Vocabulary size; at least 259 (3 special tokens and 256 byte tokens).
    pub vocab: usize,
    /// `context_length`.
    pub context_length: usize,
    /// `rope.freq_base` (global layers for gemma3).
    pub rope_base: f32,
    /// `rope.local_freq_base` (gemma3's sliding-window layers), written only when set.
    pub rope_local_base: Option<f32>,
    /// `attention.sliding_window`, written only when set (gemma3 requires it).
    pub sliding_window: Option<usize>,
    /// Gemma3's pattern (every n-th layer is global), written only when set, under both
    /// `attention.sliding_window_pattern` (kvdb's key) and `attention.sliding_window_type`
    /// (candle's key). Both default to 6, which is also what llama.cpp hard-codes.
    pub sliding_window_pattern: Option<usize>,
    /// Biases on the Q/K/V projections (`blk.N.attn_{q,k,v}.bias`).
    pub qkv_bias: bool,
    /// No `output.weight`: the output projection is the embedding.
    pub tied_output: bool,
    /// Storage type of the 2-D weights (embedding and projections); norms and biases are
    /// always F32, as llama.cpp stores them.
    pub dtype: GgmlDType,
    /// `attention.layer_norm_rms_epsilon`.
    pub norm_eps: f32,
    /// Seed of the weights.
    pub seed: u64,
}

impl TinyModel {
    /// A 2-layer llama with GQA (8 query heads over 2 KV heads of 16 dims), RoPE base 50000
    /// and separate output weights, stored as F32.
    pub fn llama() -> Self {
        Self {
            arch: TinyArch::Llama,
            layers: 2,
            hidden: 128,
            intermediate: 256,
            heads: 8,
            kv_heads: 2,
            head_dim: 16,
            vocab: 320,
            context_length: 256,
            rope_base: 50_000.0,
            rope_local_base: None,
            sliding_window: None,
            sliding_window_pattern: None,
            qkv_bias: false,
            tied_output: false,
            dtype: GgmlDType::F32,
            norm_eps: 1e-5,
            seed: 1,
        }
    }

    /// A 2-layer qwen2 with Q/K/V biases, GQA 8/2, RoPE base 1e6 and tied output.
    pub fn qwen2() -> Self {
        Self {
            arch: TinyArch::Qwen2,
            qkv_bias: true,
            tied_output: true,
            rope_base: 1_000_000.0,
            norm_eps: 1e-6,
            seed: 2,
            ..Self::llama()
        }
    }

    /// A 6-layer gemma3 (five sliding-window layers of 16 tokens, then a global one), 4 query
    /// heads over 2 KV heads of 32 dims (so `heads * head_dim` differs from `hidden`), global
    /// RoPE base 1e6 and local base 10000, tied output.
    pub fn gemma3() -> Self {
        Self {
            arch: TinyArch::Gemma3,
            layers: 6,
            hidden: 64,
            intermediate: 128,
            heads: 4,
            kv_heads: 2,
            head_dim: 32,
            rope_base: 1_000_000.0,
            rope_local_base: Some(10_000.0),
            sliding_window: Some(16),
            tied_output: true,
            norm_eps: 1e-6,
            seed: 3,
            ..Self::llama()
        }
    }

    /// The shapes of Gemma 3 270M (`google/gemma-3-270m`) with random weights, stored as BF16:
    /// 18 layers of width 640 (MLP 2048), 4 query heads over 1 KV head of 256 dims, a
    /// 262144-token vocabulary, 32768 tokens of context, sliding windows of 512 tokens on five
    /// layers of six, RoPE base 1e6 (global) and 1e4 (local), tied output.
    ///
    /// The metadata keys are those of the real GGUF file (llama.cpp's conversion): it has no
    /// `rope.local_freq_base`, `attention.sliding_window_pattern` or attention-scale key, and
    /// readers (kvdb-model, llama.cpp) supply the local base 1e4, the pattern 6 and the scale
    /// `1/sqrt(head_dim)` themselves; `1/sqrt(256)` is the model's `query_pre_attn_scalar` of
    /// 256.
    pub fn gemma3_270m() -> Self {
        Self {
            arch: TinyArch::Gemma3,
            layers: 18,
            hidden: 640,
            intermediate: 2048,
            heads: 4,
            kv_heads: 1,
            head_dim: 256,
            vocab: 262_144,
            context_length: 32_768,
            rope_base: 1_000_000.0,
            rope_local_base: None,
            sliding_window: Some(512),
            sliding_window_pattern: None,
            qkv_bias: false,
            tied_output: true,
            dtype: GgmlDType::BF16,
            norm_eps: 1e-6,
            seed: 270,
        }
    }

    /// The shapes of Llama 3 8B with random weights, stored as BF16: 32 layers of width 4096
    /// (MLP 14336), 32 query heads over 8 KV heads of 128 dims, a 128256-token vocabulary,
    /// 131072 tokens of context (Llama 3.1's, without its `rope_freqs.weight` scaling), RoPE
    /// base 500000, separate output weights. The tokenizer is [`TinyModel`]'s SentencePiece
    /// one padded to the vocabulary, not Llama 3's BPE.
    pub fn llama3_8b() -> Self {
        Self {
            arch: TinyArch::Llama,
            layers: 32,
            hidden: 4096,
            intermediate: 14_336,
            heads: 32,
            kv_heads: 8,
            head_dim: 128,
            vocab: 128_256,
            context_length: 131_072,
            rope_base: 500_000.0,
            rope_local_base: None,
            sliding_window: None,
            sliding_window_pattern: None,
            qkv_bias: false,
            tied_output: false,
            dtype: GgmlDType::BF16,
            norm_eps: 1e-5,
            seed: 8,
        }
    }

    /// The shapes of Qwen2 0.5B with random weights, stored as BF16: 24 layers of width 896
    /// (MLP 4864), 14 query heads over 2 KV heads of 64 dims with Q/K/V biases, a
    /// 151936-token vocabulary, 32768 tokens of context, RoPE base 1e6, tied output.
    pub fn qwen2_0_5b() -> Self {
        Self {
            arch: TinyArch::Qwen2,
            layers: 24,
            hidden: 896,
            intermediate: 4864,
            heads: 14,
            kv_heads: 2,
            head_dim: 64,
            vocab: 151_936,
            context_length: 32_768,
            rope_base: 1_000_000.0,
            rope_local_base: None,
            sliding_window: None,
            sliding_window_pattern: None,
            qkv_bias: true,
            tied_output: true,
            dtype: GgmlDType::BF16,
            norm_eps: 1e-6,
            seed: 5,
        }
    }

    /// The shapes of Qwen2.5-7B-Instruct-1M (a real million-token model) with random
    /// weights, stored as BF16: 28 layers of width 3584 (MLP 18944), 28 query heads over 4
    /// KV heads of 128 dims with Q/K/V biases (56 KiB of f16 keys and values per token), a
    /// 152064-token vocabulary, 1,010,000 tokens of context, RoPE base 1e7, separate output.
    pub fn qwen2_5_7b_1m() -> Self {
        Self {
            layers: 28,
            hidden: 3584,
            intermediate: 18_944,
            heads: 28,
            kv_heads: 4,
            head_dim: 128,
            vocab: 152_064,
            context_length: 1_010_000,
            rope_base: 10_000_000.0,
            tied_output: false,
            seed: 7,
            ..Self::qwen2_0_5b()
        }
    }

    /// Weights in the file (embedding and output included), from the shapes alone.
    pub fn parameter_count(&self) -> usize {
        self.tensors().iter().map(TinyTensor::elem_count).sum()
    }

    /// Checks that the sizes make a model and a tokenizer (what [`TinyModel::gguf`] checks
    /// before drawing anything).
    pub fn check(&self) -> Result<()> {
        if self.vocab < FIRST_PIECE as usize {
            bail!(
                "a tiny model needs a vocabulary of at least {FIRST_PIECE} tokens, got {}",
                self.vocab
            );
        }
        if self.heads == 0 || self.heads.checked_rem(self.kv_heads) != Some(0) {
            bail!(
                "{} query heads do not group over {} KV heads",
                self.heads,
                self.kv_heads
            );
        }
        Ok(())
    }

    /// The metadata and tensors of the file, for tests that edit them before writing.
    pub fn gguf(&self) -> Result<TinyGguf> {
        self.check()?;
        let mut gguf = TinyGguf {
            metadata: self.metadata(),
            tensors: Vec::new(),
        };
        self.add_tensors(&mut gguf)?;
        Ok(gguf)
    }

    /// Writes the model to `path`.
    pub fn write(&self, path: impl AsRef<Path>) -> Result<()> {
        self.gguf()?.write(path)
    }

    /// Writes the model into a fresh temporary directory.
    pub fn write_temp(&self) -> Result<TinyFile> {
        self.gguf()?.write_temp()
    }

    /// The metadata entries of the file, in file order (the tokenizer's included).
    pub fn metadata(&self) -> Vec<(String, Value)> {
        let arch = self.arch.gguf_name();
        let u32v = |v: usize| Value::U32(v as u32);
        let mut md = vec![
            (
                "general.architecture".to_string(),
                Value::String(arch.into()),
            ),
            (
                "general.name".to_string(),
                Value::String(format!("tiny-{arch}")),
            ),
            ("general.alignment".to_string(), Value::U32(32)),
        ];
        let mut put = |key: &str, value: Value| md.push((format!("{arch}.{key}"), value));
        put("context_length", u32v(self.context_length));
        put("embedding_length", u32v(self.hidden));
        put("block_count", u32v(self.layers));
        put("feed_forward_length", u32v(self.intermediate));
        put("attention.head_count", u32v(self.heads));
        put("attention.head_count_kv", u32v(self.kv_heads));
        put(
            "attention.layer_norm_rms_epsilon",
            Value::F32(self.norm_eps),
        );
        put("rope.freq_base", Value::F32(self.rope_base));
        put("rope.dimension_count", u32v(self.head_dim));
        put("vocab_size", u32v(self.vocab));
        if self.arch == TinyArch::Gemma3 || self.head_dim * self.heads != self.hidden {
            put("attention.key_length", u32v(self.head_dim));
            put("attention.value_length", u32v(self.head_dim));
        }
        if let Some(base) = self.rope_local_base {
            put("rope.local_freq_base", Value::F32(base));
        }
        if let Some(window) = self.sliding_window {
            put("attention.sliding_window", u32v(window));
        }
        if let Some(pattern) = self.sliding_window_pattern {
            put("attention.sliding_window_pattern", u32v(pattern));
            put("attention.sliding_window_type", u32v(pattern));
        }
        md.extend(tokenizer_metadata(self.vocab));
        md
    }

    fn add_tensors(&self, gguf: &mut TinyGguf) -> Result<()> {
        for tensor in self.tensors() {
            let values = tensor.generate()?;
            gguf.tensors.push((tensor.name, values));
        }
        Ok(())
    }

    /// The tensors of the file in file order, before their values are drawn: what
    /// [`TinyModel::gguf`] generates, for writers that draw them piece by piece.
    pub fn tensors(&self) -> Vec<TinyTensor> {
        let (h, q_dim, kv_dim, ff) = (
            self.hidden,
            self.heads * self.head_dim,
            self.kv_heads * self.head_dim,
            self.intermediate,
        );
        let fan_in = |n: usize| 1.0 / (n as f32).sqrt();
        let vector = |name: String, len: usize, mean: f32, std: f32| TinyTensor {
            name,
            shape: vec![len],
            dtype: GgmlDType::F32,
            mean,
            std,
            seed: self.seed,
        };
        let weight = |name: String, rows: usize, cols: usize, std: f32| TinyTensor {
            name,
            shape: vec![rows, cols],
            dtype: self.dtype,
            mean: 0.0,
            std,
            seed: self.seed,
        };
        let mut plan = Vec::new();
        let mut add = |t: TinyTensor| plan.push(t);
        add(weight("token_embd.weight".into(), self.vocab, h, fan_in(h)));
        add(vector("output_norm.weight".into(), h, 1.0, 0.1));
        if !self.tied_output {
            add(weight("output.weight".into(), self.vocab, h, fan_in(h)));
        }
        for i in 0..self.layers {
            let n = |suffix: &str| format!("blk.{i}.{suffix}");
            add(vector(n("attn_norm.weight"), h, 1.0, 0.1));
            // Queries and keys a little larger than unit scale, so that attention is peaked.
            add(weight(n("attn_q.weight"), q_dim, h, 1.5 * fan_in(h)));
            add(weight(n("attn_k.weight"), kv_dim, h, 1.5 * fan_in(h)));
            add(weight(n("attn_v.weight"), kv_dim, h, fan_in(h)));
            if self.qkv_bias {
                add(vector(n("attn_q.bias"), q_dim, 0.0, 0.5));
                add(vector(n("attn_k.bias"), kv_dim, 0.0, 0.5));
                add(vector(n("attn_v.bias"), kv_dim, 0.0, 0.5));
            }
            add(weight(n("attn_output.weight"), h, q_dim, fan_in(q_dim)));
            if self.arch == TinyArch::Gemma3 {
                let d = self.head_dim;
                add(vector(n("attn_q_norm.weight"), d, 1.0, 0.1));
                add(vector(n("attn_k_norm.weight"), d, 1.0, 0.1));
                add(vector(n("post_attention_norm.weight"), h, 1.0, 0.1));
                add(vector(n("post_ffw_norm.weight"), h, 1.0, 0.1));
            }
            add(vector(n("ffn_norm.weight"), h, 1.0, 0.1));
            add(weight(n("ffn_gate.weight"), ff, h, fan_in(h)));
            add(weight(n("ffn_up.weight"), ff, h, fan_in(h)));
            add(weight(n("ffn_down.weight"), h, ff, fan_in(ff)));
        }
        plan
    }
}

/// One tensor of a [`TinyModel`] before its values are drawn: name, shape, storage type and
/// the normal distribution of its values. Any range of the values can be drawn on its own
/// ([`TinyTensor::fill`]), so a writer can draw a large tensor in parallel pieces and stream
/// it; the pieces equal what [`TinyTensor::generate`] (and so [`TinyModel::gguf`]) draws.
#[derive(Debug, Clone, PartialEq)]
pub struct TinyTensor {
    /// The GGUF tensor name.
    pub name: String,
    /// The candle shape (`[out, in]` for a projection).
    pub shape: Vec<usize>,
    /// The storage type.
    pub dtype: GgmlDType,
    /// Mean of the values.
    pub mean: f32,
    /// Standard deviation of the values.
    pub std: f32,
    /// The model's seed (the stream is seeded by it and the name).
    seed: u64,
}

impl TinyTensor {
    /// Number of values.
    pub fn elem_count(&self) -> usize {
        self.shape.iter().product()
    }

    /// Values `offset..offset + out.len()` in row-major order into `out`.
    pub fn fill(&self, offset: usize, out: &mut [f32]) {
        let mut rng = Normal::new(self.seed, &self.name);
        rng.skip(2 * offset as u64);
        rng.fill(out, self.mean, self.std);
    }

    /// All values, stored as [`TinyTensor::dtype`].
    pub fn generate(&self) -> Result<QTensor> {
        let values =
            Normal::new(self.seed, &self.name).take(self.elem_count(), self.mean, self.std);
        let t = Tensor::from_vec(values, self.shape.as_slice(), &Device::Cpu)?;
        QTensor::quantize(&t, self.dtype).with_context(|| {
            format!(
                "quantizing `{}` {:?} to {:?}",
                self.name, self.shape, self.dtype
            )
        })
    }
}

/// A GGUF file's contents before writing: metadata entries and tensors, in file order.
#[derive(Debug)]
pub struct TinyGguf {
    /// Metadata key/value pairs.
    pub metadata: Vec<(String, Value)>,
    /// Tensors by name, candle shapes (`[out, in]`).
    pub tensors: Vec<(String, QTensor)>,
}

impl TinyGguf {
    /// Sets `key` to `value`, replacing an existing entry in place or appending a new one.
    pub fn set(&mut self, key: &str, value: Value) {
        match self.metadata.iter_mut().find(|(k, _)| k == key) {
            Some((_, v)) => *v = value,
            None => self.metadata.push((key.to_string(), value)),
        }
    }

    /// Removes the entry `key`, if present.
    pub fn remove(&mut self, key: &str) {
        self.metadata.retain(|(k, _)| k != key);
    }

    /// Removes the tensor `name`, if present.
    pub fn remove_tensor(&mut self, name: &str) {
        self.tensors.retain(|(n, _)| n != name);
    }

    /// Writes the file to `path`.
    pub fn write(&self, path: impl AsRef<Path>) -> Result<()> {
        let path = path.as_ref();
        let file =
            std::fs::File::create(path).with_context(|| format!("creating {}", path.display()))?;
        let mut w = BufWriter::new(file);
        let metadata: Vec<(&str, &Value)> =
            self.metadata.iter().map(|(k, v)| (k.as_str(), v)).collect();
        let tensors: Vec<(&str, &QTensor)> =
            self.tensors.iter().map(|(k, t)| (k.as_str(), t)).collect();
        gguf_file::write(&mut w, &metadata, &tensors)
            .with_context(|| format!("writing {}", path.display()))?;
        w.flush()?;
        Ok(())
    }

    /// Writes the file as `model.gguf` in a fresh temporary directory.
    pub fn write_temp(&self) -> Result<TinyFile> {
        let dir = tempfile::tempdir()?;
        let path = dir.path().join("model.gguf");
        self.write(&path)?;
        Ok(TinyFile { dir, path })
    }
}

/// A written tiny model; the temporary directory (and the file) live as long as this value.
#[derive(Debug)]
pub struct TinyFile {
    dir: tempfile::TempDir,
    path: PathBuf,
}

impl TinyFile {
    /// The GGUF file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The temporary directory holding it (for writing variants next to it).
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }
}

/// Unknown, begin and end of sequence: ids 0, 1 and 2, as in Llama's SentencePiece vocab.
const SPECIALS: [&str; 3] = ["<unk>", "<s>", "</s>"];
/// Byte tokens `<0x00>`..`<0xFF>` take ids 3..259; word pieces follow.
const FIRST_PIECE: u32 = 3 + 256;
/// Word pieces after the byte tokens, with merge chains so that SentencePiece's pairwise
/// merging can reach the whole words.
const PIECES: &[&str] = &[
    "▁", "a", "b", "c", "d", "e", "f", "g", "h", "i", "j", "k", "l", "m", "n", "o", "p", "q", "r",
    "s", "t", "u", "v", "w", "x", "y", "z", "▁t", "he", "▁the", "▁a", "▁c", "▁ca", "▁cat", "▁s",
    "▁sa", "▁sat", "▁o", "▁on", "▁m", "▁ma", "▁mat", "in", "▁in", "er", "▁h", "▁he", "ll", "▁hell",
    "▁hello", "▁w", "or", "▁wor", "▁world",
];

/// `tokenizer.ggml.*` entries of a SentencePiece ("llama") tokenizer with `vocab` tokens:
/// `<unk>`, `<s>`, `</s>`, the 256 byte tokens, [`PIECES`] with scores, then unused fillers.
fn tokenizer_metadata(vocab: usize) -> Vec<(String, Value)> {
    // llama.cpp token types.
    const NORMAL: i32 = 1;
    const UNKNOWN: i32 = 2;
    const CONTROL: i32 = 3;
    const UNUSED: i32 = 5;
    const BYTE: i32 = 6;
    let mut tokens = Vec::with_capacity(vocab);
    let mut scores = Vec::with_capacity(vocab);
    let mut types = Vec::with_capacity(vocab);
    for (i, s) in SPECIALS.iter().enumerate() {
        tokens.push(s.to_string());
        scores.push(0.0);
        types.push(if i == 0 { UNKNOWN } else { CONTROL });
    }
    for b in 0..=255u8 {
        tokens.push(format!("<0x{b:02X}>"));
        scores.push(0.0);
        types.push(BYTE);
    }
    for (i, piece) in PIECES.iter().enumerate() {
        if tokens.len() == vocab {
            break;
        }
        tokens.push(piece.to_string());
        // Longer pieces score higher, so merges prefer them.
        scores.push(piece.chars().count() as f32 - i as f32 / 100.0);
        types.push(NORMAL);
    }
    while tokens.len() < vocab {
        tokens.push(format!("<unused{}>", tokens.len()));
        scores.push(-1000.0);
        types.push(UNUSED);
    }
    let array = |v: Vec<Value>| Value::Array(v);
    vec![
        ("tokenizer.ggml.model".into(), Value::String("llama".into())),
        (
            "tokenizer.ggml.tokens".into(),
            array(tokens.into_iter().map(Value::String).collect()),
        ),
        (
            "tokenizer.ggml.scores".into(),
            array(scores.into_iter().map(Value::F32).collect()),
        ),
        (
            "tokenizer.ggml.token_type".into(),
            array(types.into_iter().map(Value::I32).collect()),
        ),
        ("tokenizer.ggml.unknown_token_id".into(), Value::U32(0)),
        ("tokenizer.ggml.bos_token_id".into(), Value::U32(1)),
        ("tokenizer.ggml.eos_token_id".into(), Value::U32(2)),
        ("tokenizer.ggml.add_bos_token".into(), Value::Bool(true)),
        ("tokenizer.ggml.add_eos_token".into(), Value::Bool(false)),
    ]
}

/// Seeded normal samples: splitmix64 for uniforms, Box-Muller for normals. Each tensor gets
/// its own stream (seeded by the model seed and its name), so adding a tensor leaves the
/// others unchanged.
#[derive(Debug)]
struct Normal {
    state: u64,
}

impl Normal {
    fn new(seed: u64, name: &str) -> Self {
        // FNV-1a of the name, mixed with the seed.
        let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
        for b in name.bytes() {
            hash = (hash ^ b as u64).wrapping_mul(0x0100_0000_01b3);
        }
        Self {
            state: hash ^ seed.wrapping_mul(0x9e37_79b9_7f4a_7c15),
        }
    }

    fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in (0, 1].
    fn uniform(&mut self) -> f64 {
        ((self.next_u64() >> 11) + 1) as f64 / (1u64 << 53) as f64
    }

    /// Moves the stream `n` draws of [`Normal::next_u64`] ahead: splitmix64's state after `n`
    /// draws is the state plus `n` increments, so any point of the stream is reached at once.
    fn skip(&mut self, n: u64) {
        self.state = self
            .state
            .wrapping_add(n.wrapping_mul(0x9e37_79b9_7f4a_7c15));
    }

    /// One normal sample (two uniforms).
    fn sample(&mut self, mean: f32, std: f32) -> f32 {
        let (u1, u2) = (self.uniform(), self.uniform());
        let z = (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos();
        mean + std * z as f32
    }

    fn take(&mut self, n: usize, mean: f32, std: f32) -> Vec<f32> {
        (0..n).map(|_| self.sample(mean, std)).collect()
    }

    fn fill(&mut self, out: &mut [f32], mean: f32, std: f32) {
        for v in out {
            *v = self.sample(mean, std);
        }
    }
}

/// `n` seeded token ids in `0..vocab`, none of them `<unk>`, `<s>` or `</s>`.
pub fn random_tokens(n: usize, vocab: usize, seed: u64) -> Vec<u32> {
    let mut rng = Normal::new(seed, "tokens");
    let span = vocab.saturating_sub(3).max(1) as u64;
    (0..n).map(|_| (3 + rng.next_u64() % span) as u32).collect()
}

/// `max |actual - expected| / max |expected|`: the error relative to the reference's scale.
pub fn relative_max_error(actual: &Tensor, expected: &Tensor) -> Result<f32> {
    if actual.dims() != expected.dims() {
        bail!(
            "shapes differ: {:?} vs {:?}",
            actual.dims(),
            expected.dims()
        );
    }
    let a = actual.flatten_all()?.to_vec1::<f32>()?;
    let e = expected.flatten_all()?.to_vec1::<f32>()?;
    let scale = e.iter().fold(0f32, |m, v| m.max(v.abs()));
    let diff = a
        .iter()
        .zip(&e)
        .fold(0f32, |m, (x, y)| m.max((x - y).abs()));
    if a.iter().chain(&e).any(|v| !v.is_finite()) {
        bail!("non-finite values in a comparison");
    }
    Ok(if scale > 0.0 { diff / scale } else { diff })
}

/// A random generator for tests on fresh inputs: seeded from `KVDB_TEST_SEED` when set (to
/// replay a failure), else at random. Returns the seed so assertion messages can print it.
pub fn seeded() -> (u64, rand::rngs::StdRng) {
    use rand::{Rng, SeedableRng};
    let seed = std::env::var("KVDB_TEST_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| rand::rng().random());
    (seed, rand::rngs::StdRng::seed_from_u64(seed))
}

/// A plain RoPE (base 10000, no scaling) of `style` for heads of `head_dim`.
pub fn test_rope(style: kvdb_model::RopeStyle, head_dim: usize) -> kvdb_model::Rope {
    let config = kvdb_model::RopeConfig {
        base: 10_000.0,
        style,
        scaling: kvdb_model::RopeScaling::None,
    };
    kvdb_model::Rope::new(&config, head_dim, None)
}

/// `len` values drawn uniformly from [-1, 1).
pub fn random_vec(rng: &mut rand::rngs::StdRng, len: usize) -> Vec<f32> {
    use rand::Rng;
    (0..len).map(|_| rng.random_range(-1.0f32..1.0)).collect()
}
