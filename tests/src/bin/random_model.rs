//! `random_model`: writes a random-weight GGUF with the shapes of a real model, for speed
//! tests of the forward pass on machines that cannot download the real one.
//!
//! ```text
//! random_model --preset gemma3-270m|llama3-8b|qwen2-0.5b|qwen2.5-7b-1m [--layers N]
//!              [--dtype f32|f16|bf16|q8_0] [--context N] [--seed S] --out PATH
//! ```
//!
//! The file is the one [`TinyModel::write`] writes for the same settings, byte for byte (the
//! tests check it on the tiny presets), but written without holding the model in memory: the
//! header needs only the shapes, so it goes first, and then each tensor is drawn in segments,
//! every core drawing pieces of a segment ([`TinyTensor::fill`] reaches any point of a
//! tensor's random stream at once) while a writer thread writes the previous segment. The
//! file is written as `PATH.partial` and renamed when complete.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use candle_core::quantized::gguf_file::Value;
use candle_core::quantized::GgmlDType;
use clap::{Parser, ValueEnum};
use kvdb_tests::{TinyModel, TinyTensor};
use rayon::prelude::*;

/// Writes a random-weight GGUF model with the shapes of a real one.
#[derive(Debug, Parser)]
#[command(name = "random_model")]
struct Args {
    /// Whose shapes (the tiny-* presets are the test models of kvdb-tests).
    #[arg(long)]
    preset: Preset,
    /// Keep only the first N layers.
    #[arg(long)]
    layers: Option<usize>,
    /// Storage type of the embedding and the projections (norms and biases stay f32).
    #[arg(long, default_value = "bf16")]
    dtype: Dtype,
    /// `context_length` to write instead of the model's.
    #[arg(long)]
    context: Option<usize>,
    /// Seed of the weights (default: the preset's).
    #[arg(long)]
    seed: Option<u64>,
    /// Values drawn per parallel piece (a multiple of 32); for tests of the piecing.
    #[arg(long, default_value_t = 1 << 16, hide = true)]
    piece: usize,
    /// The GGUF file to write.
    #[arg(long)]
    out: PathBuf,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
enum Preset {
    #[value(name = "gemma3-270m")]
    Gemma3_270m,
    #[value(name = "llama3-8b")]
    Llama3_8b,
    #[value(name = "qwen2-0.5b")]
    Qwen2_0_5b,
    #[value(name = "qwen2.5-7b-1m")]
    Qwen2_5_7b1m,
    #[value(name = "tiny-gemma3")]
    TinyGemma3,
    #[value(name = "tiny-llama")]
    TinyLlama,
    #[value(name = "tiny-qwen2")]
    TinyQwen2,
}

impl Preset {
    fn model(self) -> TinyModel {
        match self {
            Self::Gemma3_270m => TinyModel::gemma3_270m(),
            Self::Llama3_8b => TinyModel::llama3_8b(),
            Self::Qwen2_0_5b => TinyModel::qwen2_0_5b(),
            Self::Qwen2_5_7b1m => TinyModel::qwen2_5_7b_1m(),
            Self::TinyGemma3 => TinyModel::gemma3(),
            Self::TinyLlama => TinyModel::llama(),
            Self::TinyQwen2 => TinyModel::qwen2(),
        }
    }

    /// `general.name` of the real-shape presets (the tiny ones keep [`TinyModel`]'s, so that
    /// their files equal what it writes).
    fn name(self) -> Option<&'static str> {
        match self {
            Self::Gemma3_270m => Some("random-gemma3-270m"),
            Self::Llama3_8b => Some("random-llama3-8b"),
            Self::Qwen2_0_5b => Some("random-qwen2-0.5b"),
            Self::Qwen2_5_7b1m => Some("random-qwen2.5-7b-1m"),
            Self::TinyGemma3 | Self::TinyLlama | Self::TinyQwen2 => None,
        }
    }
}

#[derive(Debug, Clone, Copy, ValueEnum)]
enum Dtype {
    F32,
    F16,
    Bf16,
    #[value(name = "q8_0")]
    Q8_0,
}

impl Dtype {
    fn ggml(self) -> GgmlDType {
        match self {
            Self::F32 => GgmlDType::F32,
            Self::F16 => GgmlDType::F16,
            Self::Bf16 => GgmlDType::BF16,
            Self::Q8_0 => GgmlDType::Q8_0,
        }
    }
}

/// Segments of a tensor handed to the writer thread: this many pieces each.
const PIECES_PER_SEGMENT: usize = 256;
/// Segments drawn ahead of the writer.
const SEGMENTS_IN_FLIGHT: usize = 2;
/// GGUF data alignment (`general.alignment`, which [`TinyModel`] writes as 32).
const ALIGNMENT: usize = 32;
/// Values per Q8_0 block.
const Q8_BLOCK: usize = 32;

fn main() -> Result<()> {
    let args = Args::parse();
    if args.piece == 0 || !args.piece.is_multiple_of(Q8_BLOCK) {
        bail!("--piece must be a positive multiple of {Q8_BLOCK}");
    }
    let mut model = TinyModel {
        dtype: args.dtype.ggml(),
        ..args.preset.model()
    };
    if let Some(layers) = args.layers {
        model.layers = layers;
    }
    if let Some(context) = args.context {
        model.context_length = context;
    }
    if let Some(seed) = args.seed {
        model.seed = seed;
    }
    model.check()?;
    let mut metadata = model.metadata();
    if let Some(name) = args.preset.name() {
        for (key, value) in &mut metadata {
            if key == "general.name" {
                *value = Value::String(name.to_string());
            }
        }
    }
    let tensors = model.tensors();
    let total: usize = tensors.iter().map(|t| padded(stored_bytes(t))).sum();
    let params = model.parameter_count();
    println!(
        "writing {}: {} with {} layers, hidden {}, vocab {}, {:.1} M weights as {:?}, {:.2} GB, \
         on {} threads",
        args.out.display(),
        model.arch.gguf_name(),
        model.layers,
        model.hidden,
        model.vocab,
        params as f64 / 1e6,
        args.dtype,
        total as f64 / 1e9,
        rayon::current_num_threads(),
    );
    let start = Instant::now();
    let bytes = write(&metadata, &tensors, &args.out, args.piece)?;
    let seconds = start.elapsed().as_secs_f64();
    println!(
        "wrote {}: {:.3} GB in {seconds:.1} s ({:.2} GB/s)",
        args.out.display(),
        bytes as f64 / 1e9,
        bytes as f64 / 1e9 / seconds
    );
    Ok(())
}

/// Writes the whole file through `PATH.partial`; returns its size.
fn write(
    metadata: &[(String, Value)],
    tensors: &[TinyTensor],
    out: &Path,
    piece: usize,
) -> Result<u64> {
    let mut partial = out.as_os_str().to_owned();
    partial.push(".partial");
    let partial = PathBuf::from(partial);
    let file = File::create(&partial).with_context(|| format!("creating {}", partial.display()))?;
    let mut w = BufWriter::with_capacity(1 << 22, file);
    let mut offset = header(&mut w, metadata, tensors)?;
    let (tx, rx) = mpsc::sync_channel::<Vec<u8>>(SEGMENTS_IN_FLIGHT);
    let writer = std::thread::spawn(move || -> std::io::Result<BufWriter<File>> {
        for segment in rx {
            w.write_all(&segment)?;
        }
        Ok(w)
    });
    let drawn = draw_all(tensors, piece, &tx, &mut offset);
    drop(tx);
    let written = writer
        .join()
        .map_err(|_| anyhow::anyhow!("the writer thread panicked"));
    // A failed write closes the channel, which is what stops the drawing: report it first.
    let mut w = written?.with_context(|| format!("writing {}", partial.display()))?;
    drawn?;
    w.flush()?;
    drop(w);
    std::fs::rename(&partial, out)
        .with_context(|| format!("renaming {} to {}", partial.display(), out.display()))?;
    Ok(offset)
}

/// Draws every tensor segment by segment and sends the bytes (padding included) to the
/// writer; `offset` counts the file's bytes.
fn draw_all(
    tensors: &[TinyTensor],
    piece: usize,
    tx: &mpsc::SyncSender<Vec<u8>>,
    offset: &mut u64,
) -> Result<()> {
    let total: u64 = tensors.iter().map(|t| padded(stored_bytes(t)) as u64).sum();
    let (start, data_start) = (Instant::now(), *offset);
    let mut last_report = Instant::now();
    let send = |bytes: Vec<u8>| {
        tx.send(bytes)
            .map_err(|_| anyhow::anyhow!("the writer stopped"))
    };
    for tensor in tensors {
        let n = tensor.elem_count();
        let segment = piece * PIECES_PER_SEGMENT;
        let mut first = 0;
        while first < n {
            let len = segment.min(n - first);
            send(encode(tensor, first, len, piece)?)?;
            first += len;
        }
        let bytes = stored_bytes(tensor);
        send(vec![0u8; padded(bytes) - bytes])?;
        *offset += padded(bytes) as u64;
        if last_report.elapsed().as_secs_f64() >= 2.0 {
            last_report = Instant::now();
            let done = *offset - data_start;
            eprintln!(
                "  {:5.1}%  {:.2} of {:.2} GB  {:.1} s  (up to {})",
                100.0 * done as f64 / total as f64,
                done as f64 / 1e9,
                total as f64 / 1e9,
                start.elapsed().as_secs_f64(),
                tensor.name
            );
        }
    }
    Ok(())
}

/// Values `first..first + len` of `tensor` in its storage type, drawn in parallel pieces.
fn encode(tensor: &TinyTensor, first: usize, len: usize, piece: usize) -> Result<Vec<u8>> {
    let (block, type_size) = (tensor.dtype.block_size(), tensor.dtype.type_size());
    if !len.is_multiple_of(block) || !first.is_multiple_of(block) {
        bail!(
            "`{}` has {} values, not a multiple of {:?}'s block of {block}",
            tensor.name,
            tensor.elem_count(),
            tensor.dtype
        );
    }
    let mut out = vec![0u8; len / block * type_size];
    let piece_bytes = piece / block * type_size;
    out.par_chunks_mut(piece_bytes)
        .enumerate()
        .try_for_each(|(i, bytes)| {
            let mut values = vec![0f32; bytes.len() / type_size * block];
            tensor.fill(first + i * piece, &mut values);
            store(tensor.dtype, &values, bytes)
        })?;
    Ok(out)
}

/// `values` as `dtype` into `out` (exactly its size), as candle's `QTensor::quantize` stores
/// them.
fn store(dtype: GgmlDType, values: &[f32], out: &mut [u8]) -> Result<()> {
    match dtype {
        GgmlDType::F32 => {
            for (v, o) in values.iter().zip(out.chunks_exact_mut(4)) {
                o.copy_from_slice(&v.to_le_bytes());
            }
        }
        GgmlDType::F16 => {
            for (v, o) in values.iter().zip(out.chunks_exact_mut(2)) {
                o.copy_from_slice(&half::f16::from_f32(*v).to_le_bytes());
            }
        }
        GgmlDType::BF16 => {
            for (v, o) in values.iter().zip(out.chunks_exact_mut(2)) {
                o.copy_from_slice(&half::bf16::from_f32(*v).to_le_bytes());
            }
        }
        GgmlDType::Q8_0 => {
            // ggml's reference quantize_row_q8_0, as candle's `BlockQ8_0::from_float`: one
            // f16 scale `max |x| / 127` and 32 rounded quotients per block.
            for (xs, o) in values
                .chunks_exact(Q8_BLOCK)
                .zip(out.chunks_exact_mut(2 + Q8_BLOCK))
            {
                let amax = xs.iter().fold(0f32, |m, x| m.max(x.abs()));
                let d = amax / 127.0;
                let id = if d != 0.0 { 1.0 / d } else { 0.0 };
                o[..2].copy_from_slice(&half::f16::from_f32(d).to_le_bytes());
                for (q, x) in o[2..].iter_mut().zip(xs) {
                    *q = (f32::round(x * id) as i8) as u8;
                }
            }
        }
        other => bail!("random_model does not write {other:?}"),
    }
    Ok(())
}

/// Bytes of a tensor's data, padding excluded.
fn stored_bytes(t: &TinyTensor) -> usize {
    t.elem_count() / t.dtype.block_size() * t.dtype.type_size()
}

/// `bytes` rounded up to the alignment.
fn padded(bytes: usize) -> usize {
    bytes.div_ceil(ALIGNMENT) * ALIGNMENT
}

/// GGUF's code of a storage type (candle keeps its own mapping crate-private).
fn ggml_code(dtype: GgmlDType) -> Result<u32> {
    Ok(match dtype {
        GgmlDType::F32 => 0,
        GgmlDType::F16 => 1,
        GgmlDType::Q8_0 => 8,
        GgmlDType::BF16 => 30,
        other => bail!("random_model does not write {other:?}"),
    })
}

/// Writes the header as candle's `gguf_file::write` does (version 2, tensor offsets from
/// the data start, each tensor aligned) and pads it; returns its length.
fn header(w: &mut impl Write, metadata: &[(String, Value)], tensors: &[TinyTensor]) -> Result<u64> {
    let mut h = Vec::new();
    h.extend_from_slice(&0x4655_4747u32.to_le_bytes());
    h.extend_from_slice(&2u32.to_le_bytes());
    h.extend_from_slice(&(tensors.len() as u64).to_le_bytes());
    h.extend_from_slice(&(metadata.len() as u64).to_le_bytes());
    for (key, value) in metadata {
        put_string(&mut h, key);
        h.extend_from_slice(&value_code(value)?.to_le_bytes());
        put_value(&mut h, value).with_context(|| format!("metadata `{key}`"))?;
    }
    let mut offset = 0u64;
    for t in tensors {
        put_string(&mut h, &t.name);
        h.extend_from_slice(&(t.shape.len() as u32).to_le_bytes());
        for &dim in t.shape.iter().rev() {
            h.extend_from_slice(&(dim as u64).to_le_bytes());
        }
        h.extend_from_slice(&ggml_code(t.dtype)?.to_le_bytes());
        h.extend_from_slice(&offset.to_le_bytes());
        offset += padded(stored_bytes(t)) as u64;
    }
    h.resize(padded(h.len()), 0);
    w.write_all(&h)?;
    Ok(h.len() as u64)
}

fn put_string(h: &mut Vec<u8>, s: &str) {
    h.extend_from_slice(&(s.len() as u64).to_le_bytes());
    h.extend_from_slice(s.as_bytes());
}

/// GGUF's code of a metadata value's type.
fn value_code(value: &Value) -> Result<u32> {
    Ok(match value {
        Value::U8(_) => 0,
        Value::I8(_) => 1,
        Value::U16(_) => 2,
        Value::I16(_) => 3,
        Value::U32(_) => 4,
        Value::I32(_) => 5,
        Value::F32(_) => 6,
        Value::Bool(_) => 7,
        Value::String(_) => 8,
        Value::Array(_) => 9,
        Value::U64(_) => 10,
        Value::I64(_) => 11,
        Value::F64(_) => 12,
    })
}

fn put_value(h: &mut Vec<u8>, value: &Value) -> Result<()> {
    match value {
        Value::U8(v) => h.push(*v),
        Value::I8(v) => h.extend_from_slice(&v.to_le_bytes()),
        Value::U16(v) => h.extend_from_slice(&v.to_le_bytes()),
        Value::I16(v) => h.extend_from_slice(&v.to_le_bytes()),
        Value::U32(v) => h.extend_from_slice(&v.to_le_bytes()),
        Value::I32(v) => h.extend_from_slice(&v.to_le_bytes()),
        Value::U64(v) => h.extend_from_slice(&v.to_le_bytes()),
        Value::I64(v) => h.extend_from_slice(&v.to_le_bytes()),
        Value::F32(v) => h.extend_from_slice(&v.to_le_bytes()),
        Value::F64(v) => h.extend_from_slice(&v.to_le_bytes()),
        Value::Bool(v) => h.push(u8::from(*v)),
        Value::String(s) => put_string(h, s),
        Value::Array(items) => {
            // candle writes an empty array's element type as U32.
            let code = match items.first() {
                Some(first) => value_code(first)?,
                None => 4,
            };
            if items.iter().any(|v| value_code(v).ok() != Some(code)) {
                bail!("an array mixes value types");
            }
            h.extend_from_slice(&code.to_le_bytes());
            h.extend_from_slice(&(items.len() as u64).to_le_bytes());
            for item in items {
                put_value(h, item)?;
            }
        }
    }
    Ok(())
}
