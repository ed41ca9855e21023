//! Resolving which model a command uses: `--model PATH`, or the default model, fetched into
//! the cache when it is absent.

use std::path::{Path, PathBuf};

use anyhow::Context;
use candle_core::Device;
use kvdb_model::{GgufFile, LoadOptions, Model, Tokenizer};

/// The model file to use: `explicit` if given (it must exist), else the default model,
/// fetched first if the cache lacks it (progress lines go to stderr).
pub fn resolve(explicit: Option<&Path>) -> anyhow::Result<PathBuf> {
    match explicit {
        Some(path) => {
            if !path.exists() {
                anyhow::bail!(kvdb_model::ModelError::MissingFile {
                    path: path.to_path_buf()
                });
            }
            Ok(path.to_path_buf())
        }
        None => Ok(kvdb_model::fetch::ensure_default_model(&mut |line| {
            eprintln!("kvdb: {line}")
        })?),
    }
}

/// A model with its tokenizer, loaded from one GGUF file.
#[derive(Debug)]
pub struct LoadedModel {
    /// The file it came from.
    pub path: PathBuf,
    /// The weights and configuration.
    pub model: Model,
    /// The tokenizer from the file's metadata.
    pub tokenizer: Tokenizer,
}

/// Loads the model `explicit` names (or the default model) on the CPU.
pub fn load(explicit: Option<&Path>, options: &LoadOptions) -> anyhow::Result<LoadedModel> {
    let path = resolve(explicit)?;
    let mut file = GgufFile::open(&path)?;
    let tokenizer = Tokenizer::from_gguf(file.metadata())
        .with_context(|| format!("reading the tokenizer of {}", path.display()))?;
    let model = Model::from_gguf(&mut file, options, &Device::Cpu)?;
    Ok(LoadedModel {
        path,
        model,
        tokenizer,
    })
}
