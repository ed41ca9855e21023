//! Bad inputs give typed, actionable errors, never panics, aborts or huge allocations: each
//! test asserts the `ModelError` variant and what its message tells the user.

use std::fs::File;
use std::path::Path;

use anyhow::Result;
use candle_core::quantized::gguf_file::{Content, Value};
use candle_core::Device;
use kvdb_model::{FullAttention, GgufFile, LoadOptions, Logits, Model, ModelError, WeightMode};
use kvdb_tests::{random_tokens, TinyFile, TinyModel};

fn tiny() -> Result<TinyFile> {
    TinyModel {
        context_length: 64,
        ..TinyModel::llama()
    }
    .write_temp()
}

/// The tiny model and its bytes, to edit and open with `open_bytes`.
fn tiny_bytes() -> Result<(TinyFile, Vec<u8>)> {
    let file = tiny()?;
    let bytes = std::fs::read(file.path())?;
    Ok((file, bytes))
}

/// Writes `bytes` next to `file` and opens the result.
fn open_bytes(file: &TinyFile, bytes: &[u8]) -> Result<kvdb_model::Result<GgufFile>> {
    let path = file.dir().join("edited.gguf");
    std::fs::write(&path, bytes)?;
    Ok(GgufFile::open(&path))
}

/// Opens `bytes` as `open_bytes` does; it must fail as `InvalidGguf`, whose error is returned.
/// `what` names the case in a failed assertion.
fn open_invalid(file: &TinyFile, bytes: &[u8], what: &str) -> Result<ModelError> {
    let err = open_bytes(file, bytes)?.unwrap_err();
    assert!(
        matches!(err, ModelError::InvalidGguf { .. }),
        "{what}: {err:?}"
    );
    Ok(err)
}

fn load(path: &Path) -> kvdb_model::Result<Model> {
    let options = LoadOptions {
        weights: WeightMode::Dequantized,
        ..LoadOptions::default()
    };
    Model::load(path, &options, &Device::Cpu)
}

#[test]
fn missing_file() {
    let path = Path::new("/nonexistent/kvdb/tiny.gguf");
    let err = GgufFile::open(path).unwrap_err();
    assert!(
        matches!(&err, ModelError::MissingFile { path: p } if p == path),
        "{err:?}"
    );
    let msg = err.to_string();
    assert!(msg.contains("/nonexistent/kvdb/tiny.gguf"), "{msg}");
    assert!(
        msg.contains("does not exist") && msg.contains("--model"),
        "{msg}"
    );
    // Model::load reports the same.
    assert!(matches!(load(path), Err(ModelError::MissingFile { .. })));
}

#[test]
fn truncated_in_tensor_data() -> Result<()> {
    let (file, bytes) = tiny_bytes()?;
    let data_start = Content::read(&mut File::open(file.path())?)?.tensor_data_offset as usize;
    let cut = data_start + (bytes.len() - data_start) / 2;
    let err = open_bytes(&file, &bytes[..cut])?.unwrap_err();
    match &err {
        ModelError::Truncated {
            tensor,
            needed,
            size,
            ..
        } => {
            assert_eq!(*size, cut as u64);
            assert!(*needed > *size);
            assert!(!tensor.is_empty());
        }
        other => panic!("expected Truncated, got {other:?}"),
    }
    let msg = err.to_string();
    assert!(
        msg.contains("truncated") && msg.contains("re-download"),
        "{msg}"
    );
    assert!(
        msg.contains(&cut.to_string()),
        "the message gives the file size: {msg}"
    );
    Ok(())
}

#[test]
fn truncated_in_header() -> Result<()> {
    let (file, bytes) = tiny_bytes()?;
    let data_start = Content::read(&mut File::open(file.path())?)?.tensor_data_offset as usize;
    // Inside the magic, the counts, the metadata (tokenizer arrays) and the tensor infos.
    for cut in [2, 12, 100, data_start / 2, data_start - 40] {
        let err = open_invalid(&file, &bytes[..cut], &format!("cut at {cut}"))?;
        let msg = err.to_string();
        assert!(
            msg.contains("not a valid GGUF file") && msg.contains("re-download"),
            "cut at {cut}: {msg}"
        );
    }
    Ok(())
}

#[test]
fn bad_magic() -> Result<()> {
    let (file, mut bytes) = tiny_bytes()?;
    bytes[..4].copy_from_slice(b"GGML");
    let err = open_invalid(&file, &bytes, "bad magic")?;
    let msg = err.to_string();
    assert!(msg.contains("magic") && msg.contains("GGUF"), "{msg}");
    Ok(())
}

/// Header layout (GGUF v2/v3): magic (4), version (4), tensor count (8), metadata count (8),
/// then the first key's length (u64) at 24. The first entry the tiny model writes is
/// `general.architecture` (20 bytes), a string: its type at 52, its value's length at 56.
#[test]
fn huge_lengths_in_header() -> Result<()> {
    let (file, bytes) = tiny_bytes()?;
    assert_eq!(&bytes[32..52], b"general.architecture");
    let cases: [(&str, usize, u64); 5] = [
        ("tensor count", 8, u64::MAX),
        ("metadata count", 16, 1 << 40),
        ("key length", 24, u64::MAX - 7),
        ("string value length", 56, 1 << 50),
        ("key length just past the end", 24, bytes.len() as u64),
    ];
    for (what, offset, value) in cases {
        let mut edited = bytes.clone();
        edited[offset..offset + 8].copy_from_slice(&value.to_le_bytes());
        let err = open_invalid(&file, &edited, what)?;
        assert!(
            err.to_string().contains("not a valid GGUF file"),
            "{what}: {err}"
        );
    }
    Ok(())
}

/// An array count claiming more elements than the file holds (the tokenizer's token list).
#[test]
fn huge_array_count() -> Result<()> {
    let (file, mut bytes) = tiny_bytes()?;
    let key = b"tokenizer.ggml.tokens";
    let at = bytes
        .windows(key.len())
        .position(|w| w == key)
        .ok_or_else(|| anyhow::anyhow!("no token list"))?;
    // key, value type (u32 = array), element type (u32 = string), then the count.
    let count = at + key.len() + 8;
    bytes[count..count + 8].copy_from_slice(&(1u64 << 60).to_le_bytes());
    open_invalid(&file, &bytes, "huge array count")?;
    Ok(())
}

#[test]
fn unsupported_architecture() -> Result<()> {
    let mut gguf = TinyModel::llama().gguf()?;
    gguf.set("general.architecture", Value::String("mamba".into()));
    let file = gguf.write_temp()?;
    let err = load(file.path()).unwrap_err();
    assert!(
        matches!(&err, ModelError::UnsupportedArchitecture { arch, .. } if arch == "mamba"),
        "{err:?}"
    );
    let msg = err.to_string();
    assert!(msg.contains("`mamba`"), "{msg}");
    for supported in ["gemma3", "llama", "qwen2"] {
        assert!(
            msg.contains(supported),
            "the message lists {supported}: {msg}"
        );
    }
    Ok(())
}

#[test]
fn prompt_longer_than_context() -> Result<()> {
    let file = tiny()?;
    let model = load(file.path())?;
    assert_eq!(model.config().context_length, 64);
    let tokens = random_tokens(65, model.config().vocab_size, 1);

    // Forwards `chunk` at `pos`, which must overflow the context: 65 tokens of 64.
    let overflow = |chunk: &[u32], pos: usize, cache: &mut FullAttention| {
        let err = model.forward(chunk, pos, cache, &Logits::Last).unwrap_err();
        assert!(
            matches!(
                err,
                ModelError::ContextOverflow {
                    tokens: 65,
                    context: 64
                }
            ),
            "{err:?}"
        );
        err
    };

    let err = overflow(&tokens, 0, &mut FullAttention::new(model.config()));
    let msg = err.to_string();
    assert!(
        msg.contains("65") && msg.contains("64") && msg.contains("shorten"),
        "{msg}"
    );

    // The same when the overflow comes from a later chunk, and the cache stays usable.
    let mut cache = FullAttention::new(model.config());
    model.forward(&tokens[..60], 0, &mut cache, &Logits::None)?;
    overflow(&tokens[60..], 60, &mut cache);
    let last = model.forward(&tokens[60..64], 60, &mut cache, &Logits::Last)?;
    assert!(last.is_some());
    Ok(())
}

/// A model whose weights went to a GPU (`Model::release_weights`) keeps what its callers
/// read (configuration, RoPE) and refuses to run on the CPU, where it would have nothing to
/// multiply by, with its own error, whether its cache has run before or is fresh.
#[test]
fn released_weights_refuse_the_cpu() -> Result<()> {
    let file = tiny()?;
    let mut model = load(file.path())?;
    let tokens = random_tokens(8, model.config().vocab_size, 3);
    let mut cache = FullAttention::new(model.config());
    assert!(model
        .forward(&tokens, 0, &mut cache, &Logits::Last)?
        .is_some());
    let layers = model.config().n_layers();
    model.release_weights();
    assert_eq!(model.config().n_layers(), layers);
    assert!((0..layers).all(|layer| model.rope(layer).is_some()));
    for cache in [&mut cache, &mut FullAttention::new(model.config())] {
        let err = model.forward(&tokens, 0, cache, &Logits::Last).unwrap_err();
        assert!(matches!(err, ModelError::WeightsReleased), "{err:?}");
        assert!(err.to_string().contains("on the GPU only"), "{err}");
    }
    Ok(())
}

#[test]
fn token_out_of_vocabulary() -> Result<()> {
    let file = tiny()?;
    let model = load(file.path())?;
    let vocab = model.config().vocab_size;
    let mut cache = FullAttention::new(model.config());
    let tokens = [1, 5, vocab as u32, 7];
    let err = model
        .forward(&tokens, 0, &mut cache, &Logits::Last)
        .unwrap_err();
    assert!(
        matches!(err, ModelError::TokenOutOfRange { id, vocab: v } if id == vocab as u32 && v == vocab),
        "{err:?}"
    );
    let msg = err.to_string();
    assert!(
        msg.contains(&vocab.to_string()) && msg.contains("vocabulary"),
        "{msg}"
    );
    // Nothing was cached: a valid chunk at position 0 still works.
    assert!(model
        .forward(&[1, 5], 0, &mut cache, &Logits::Last)?
        .is_some());
    Ok(())
}
