//! Resolving which model a command uses: `--model PATH`, or the default model, fetched into
//! the cache when it is absent.

use std::path::{Path, PathBuf};

use candle_core::Device;
use kvdb_model::{GgufFile, LoadOptions, Model, ModelError, Tokenizer};

use crate::error::Result;
use crate::ingest::{model_record, ModelRef};
use crate::store::ModelRecord;

/// The model file to use: `explicit` if given (it must exist), else the default model,
/// fetched first if the cache lacks it (progress lines go to stderr).
pub fn resolve(explicit: Option<&Path>) -> Result<PathBuf> {
    match explicit {
        Some(path) => {
            if !path.exists() {
                return Err(ModelError::MissingFile {
                    path: path.to_path_buf(),
                }
                .into());
            }
            Ok(path.to_path_buf())
        }
        None => Ok(kvdb_model::fetch::ensure_default_model(&mut |line| {
            eprintln!("kvdb: {line}")
        })?),
    }
}

/// A model with its tokenizer and identity, loaded from one GGUF file.
#[derive(Debug)]
pub struct LoadedModel {
    /// The file it came from.
    pub path: PathBuf,
    /// The weights and configuration.
    pub model: Model,
    /// The tokenizer from the file's metadata.
    pub tokenizer: Tokenizer,
    /// What a corpus records of it (the file's sha256 and the configuration).
    pub record: ModelRecord,
}

impl LoadedModel {
    /// The model as ingest and queries take it.
    pub fn as_ref(&self) -> ModelRef<'_> {
        ModelRef {
            model: &self.model,
            tokenizer: &self.tokenizer,
            record: &self.record,
        }
    }
}

/// Loads the model `explicit` names (or the default model) on the CPU and hashes its file.
pub fn load(explicit: Option<&Path>, options: &LoadOptions) -> Result<LoadedModel> {
    let path = resolve(explicit)?;
    let mut file = GgufFile::open(&path)?;
    let tokenizer = Tokenizer::from_gguf(file.metadata())?;
    let model = Model::from_gguf(&mut file, options, &Device::Cpu)?;
    let sha256 = kvdb_model::fetch::sha256_file(&path)?;
    let file_name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let record = model_record(model.config(), &sha256, &file_name);
    Ok(LoadedModel {
        path,
        model,
        tokenizer,
        record,
    })
}
