//! The `random_model` binary: its files equal what [`TinyModel::write`] writes, byte for byte,
//! and kvdb-model reads the real-shape presets as the models they imitate.

use std::path::Path;
use std::process::Command;
use std::time::Instant;

use anyhow::{ensure, Result};
use candle_core::quantized::gguf_file::{Content, TensorInfo, VersionedMagic};
use candle_core::quantized::GgmlDType;
use candle_core::Device;
use kvdb_model::{
    Architecture, EncodeOptions, FullAttention, GgufFile, LayerKind, LoadOptions, Logits, Model,
    ModelConfig, RopeStyle, Tokenizer,
};
use kvdb_tests::TinyModel;

/// Runs the binary, failing with its stderr.
fn random_model(args: &[&str]) -> Result<()> {
    let out = Command::new(env!("CARGO_BIN_EXE_random_model"))
        .args(args)
        .output()?;
    ensure!(
        out.status.success(),
        "random_model {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(())
}

fn path_arg(path: &Path) -> &str {
    path.to_str().expect("temporary paths are UTF-8")
}

#[test]
fn streamed_files_equal_tiny_model_files() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let presets = [
        ("tiny-llama", TinyModel::llama()),
        ("tiny-qwen2", TinyModel::qwen2()),
        ("tiny-gemma3", TinyModel::gemma3()),
    ];
    let dtypes = [
        ("f32", GgmlDType::F32),
        ("f16", GgmlDType::F16),
        ("bf16", GgmlDType::BF16),
        ("q8_0", GgmlDType::Q8_0),
    ];
    for (preset, model) in &presets {
        for (flag, dtype) in dtypes {
            let expected = TinyModel {
                dtype,
                seed: 11,
                ..model.clone()
            }
            .write_temp()?;
            let out = dir.path().join(format!("{preset}-{flag}.gguf"));
            // Pieces of 64 values: every tensor is drawn in many pieces and segments.
            random_model(&[
                "--preset",
                preset,
                "--dtype",
                flag,
                "--seed",
                "11",
                "--piece",
                "64",
                "--out",
                path_arg(&out),
            ])?;
            ensure!(
                std::fs::read(&out)? == std::fs::read(expected.path())?,
                "{preset} as {flag}: the streamed file differs from TinyModel::write's"
            );
        }
    }
    Ok(())
}

/// The configuration kvdb-model reads from a preset's metadata and tensor list, all layers,
/// without drawing a weight.
fn config_of(model: &TinyModel) -> Result<ModelConfig> {
    let content = Content {
        magic: VersionedMagic::GgufV2,
        metadata: model.metadata().into_iter().collect(),
        tensor_infos: model
            .tensors()
            .into_iter()
            .map(|t| {
                let info = TensorInfo {
                    ggml_dtype: t.dtype,
                    shape: t.shape.clone().into(),
                    offset: 0,
                };
                (t.name, info)
            })
            .collect(),
        tensor_data_offset: 0,
    };
    Ok(ModelConfig::from_gguf(&content)?)
}

#[test]
fn presets_have_the_real_shapes() -> Result<()> {
    // Parameter counts as published (embeddings included; tied outputs counted once).
    let gemma = TinyModel::gemma3_270m();
    assert_eq!(gemma.parameter_count(), 268_098_176);
    let c = config_of(&gemma)?;
    assert_eq!(c.architecture, Architecture::Gemma3);
    assert_eq!(
        (c.hidden_size, c.intermediate_size, c.n_heads, c.n_kv_heads),
        (640, 2048, 4, 1)
    );
    assert_eq!(
        (c.head_dim, c.vocab_size, c.context_length),
        (256, 262_144, 32_768)
    );
    assert_eq!(c.n_layers(), 18);
    assert_eq!(c.global_layers(), vec![5, 11, 17]);
    for layer in &c.layers {
        let (kind, base) = if (layer.index + 1) % 6 == 0 {
            (LayerKind::Global, 1e6)
        } else {
            (LayerKind::SlidingWindow { window: 512 }, 1e4)
        };
        assert_eq!(
            (layer.kind, layer.rope.base),
            (kind, base),
            "layer {}",
            layer.index
        );
        assert_eq!(layer.rope.style, RopeStyle::Halves);
    }
    // query_pre_attn_scalar 256 = head_dim.
    assert_eq!(c.attention_scale, 1.0 / 16.0);
    assert_eq!(c.embedding_scale, Some(640f32.sqrt()));
    assert!(c.qk_norm && c.sandwich_norms && !c.qkv_bias);

    let llama = TinyModel::llama3_8b();
    assert_eq!(llama.parameter_count(), 8_030_261_248);
    let c = config_of(&llama)?;
    assert_eq!(c.architecture, Architecture::Llama);
    assert_eq!(
        (c.hidden_size, c.intermediate_size, c.n_heads, c.n_kv_heads),
        (4096, 14_336, 32, 8)
    );
    assert_eq!(
        (c.head_dim, c.vocab_size, c.context_length),
        (128, 128_256, 131_072)
    );
    assert_eq!(c.global_layers(), (0..32).collect::<Vec<_>>());
    assert!(c
        .layers
        .iter()
        .all(|l| l.rope.base == 500_000.0 && l.rope.style == RopeStyle::Interleaved));
    assert!(!c.qkv_bias && !c.qk_norm);
    assert!(llama.tensors().iter().any(|t| t.name == "output.weight"));

    let qwen = TinyModel::qwen2_0_5b();
    assert_eq!(qwen.parameter_count(), 494_032_768);
    let c = config_of(&qwen)?;
    assert_eq!(c.architecture, Architecture::Qwen2);
    assert_eq!(
        (c.hidden_size, c.intermediate_size, c.n_heads, c.n_kv_heads),
        (896, 4864, 14, 2)
    );
    assert_eq!(
        (c.head_dim, c.vocab_size, c.context_length),
        (64, 151_936, 32_768)
    );
    assert_eq!(c.n_layers(), 24);
    assert!(c.qkv_bias);
    assert!(c.layers.iter().all(|l| l.rope.base == 1e6));

    let qwen = TinyModel::qwen2_5_7b_1m();
    assert_eq!(qwen.parameter_count(), 7_615_616_512);
    let c = config_of(&qwen)?;
    assert_eq!(c.architecture, Architecture::Qwen2);
    assert_eq!(
        (c.hidden_size, c.intermediate_size, c.n_heads, c.n_kv_heads),
        (3584, 18_944, 28, 4)
    );
    assert_eq!(
        (c.head_dim, c.vocab_size, c.context_length),
        (128, 152_064, 1_010_000)
    );
    assert_eq!(c.n_layers(), 28);
    assert!(c.qkv_bias);
    assert!(c.layers.iter().all(|l| l.rope.base == 1e7));
    assert!(qwen.tensors().iter().any(|t| t.name == "output.weight"));
    Ok(())
}

#[test]
fn two_layer_gemma3_270m_loads_and_runs() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("gemma3-270m-2.gguf");
    let start = Instant::now();
    random_model(&[
        "--preset",
        "gemma3-270m",
        "--layers",
        "2",
        "--dtype",
        "f32",
        "--out",
        path_arg(&path),
    ])?;
    let written = start.elapsed();

    let start = Instant::now();
    let mut file = GgufFile::open(&path)?;
    let c = file.config()?;
    assert_eq!(c.architecture, Architecture::Gemma3);
    assert_eq!(c.name.as_deref(), Some("random-gemma3-270m"));
    assert_eq!(
        (c.hidden_size, c.intermediate_size, c.n_heads, c.n_kv_heads),
        (640, 2048, 4, 1)
    );
    assert_eq!(
        (c.head_dim, c.vocab_size, c.context_length),
        (256, 262_144, 32_768)
    );
    assert_eq!(c.n_layers(), 2);
    assert!(c
        .layers
        .iter()
        .all(|l| l.kind == LayerKind::SlidingWindow { window: 512 } && l.rope.base == 1e4));
    assert_eq!(
        file.tensor_dtype("blk.1.ffn_down.weight"),
        Some(GgmlDType::F32)
    );

    let tokenizer = Tokenizer::from_gguf(file.metadata())?;
    assert_eq!(tokenizer.vocab_size(), 262_144);
    let tokens = tokenizer.encode(
        "hello world, the cat sat on the mat",
        EncodeOptions {
            add_bos: true,
            add_eos: false,
            parse_special: false,
        },
    )?;
    let tokenized = start.elapsed();

    let start = Instant::now();
    let model = Model::from_gguf(&mut file, &LoadOptions::default(), &Device::Cpu)?;
    let mut cache = FullAttention::new(model.config());
    let logits = model
        .forward(&tokens, 0, &mut cache, &Logits::Last)?
        .expect("a non-empty forward call returns logits");
    assert_eq!(logits.dims(), &[1, 262_144]);
    let logits = logits.flatten_all()?.to_vec1::<f32>()?;
    assert!(logits.iter().all(|v| v.is_finite()));
    let spread = logits.iter().fold(f32::MIN, |m, v| m.max(*v))
        - logits.iter().fold(f32::MAX, |m, v| m.min(*v));
    assert!(spread > 1.0, "logits nearly constant: spread {spread}");
    eprintln!(
        "gemma3-270m, 2 layers, f32: written in {written:.1?}, header and tokenizer read in \
         {tokenized:.1?}, loaded and run over {} tokens in {:.1?}",
        tokens.len(),
        start.elapsed()
    );
    Ok(())
}
