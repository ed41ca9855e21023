//! What the kvdb test binaries share: the tiny random-weight gemma3 on the CPU.

use anyhow::Result;
use kvdb::{load_model, ComputeDevice, LoadedModel};
use kvdb_model::LoadOptions;
use kvdb_tests::{TinyFile, TinyModel};

/// The tiny gemma3 (one global layer of five, two KV heads) with a context of 8192 tokens,
/// loaded on the CPU (keep the file alive while the model is used).
pub fn tiny_gemma3() -> Result<(TinyFile, LoadedModel)> {
    let file = TinyModel {
        context_length: 8192,
        ..TinyModel::gemma3()
    }
    .write_temp()?;
    let model = load_model(
        Some(file.path()),
        &LoadOptions::default(),
        ComputeDevice::Cpu,
    )?;
    Ok((file, model))
}
