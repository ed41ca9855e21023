//! Resolving which model a command uses: `--model PATH`, or the default model, fetched into
//! the cache when it is absent.

use std::fmt;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::time::Instant;

use candle_core::Device;
use kvdb_model::{GgufFile, LoadOptions, Model, ModelError, Tokenizer, WeightMode};

use crate::error::Result;
use crate::ingest::{model_record, ModelRef};
use crate::store::ModelRecord;

/// The model file to use: `explicit` if given (it must exist), else the default model,
/// fetched first if the cache lacks it (progress lines go to stderr).
pub fn resolve_model(explicit: Option<&Path>) -> Result<PathBuf> {
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

/// Where a model's forward pass runs: `cpu` (the default) or `cuda` / `cuda:N` (an NVIDIA
/// GPU, in a build with feature `gpu`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ComputeDevice {
    /// The CPU.
    #[default]
    Cpu,
    /// CUDA device `ordinal`.
    Cuda {
        /// The device number, from 0.
        ordinal: usize,
    },
}

impl FromStr for ComputeDevice {
    type Err = String;

    fn from_str(s: &str) -> std::result::Result<Self, String> {
        let bad = || format!("unknown device `{s}`: use cpu, cuda or cuda:N");
        match s {
            "cpu" => Ok(Self::Cpu),
            "cuda" => Ok(Self::Cuda { ordinal: 0 }),
            _ => {
                let ordinal = s.strip_prefix("cuda:").ok_or_else(bad)?;
                let ordinal = ordinal.parse().map_err(|_| bad())?;
                Ok(Self::Cuda { ordinal })
            }
        }
    }
}

impl fmt::Display for ComputeDevice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Cpu => f.write_str("cpu"),
            Self::Cuda { ordinal } => write!(f, "cuda:{ordinal}"),
        }
    }
}

/// A model with its tokenizer and identity, loaded from one GGUF file.
#[derive(Debug)]
pub struct LoadedModel {
    /// The file it came from.
    pub path: PathBuf,
    /// The weights and configuration on the CPU (queries' retrieval sessions run here).
    pub model: Model,
    /// The same weights on the GPU when loaded for `cuda`: generation and ingest run there.
    #[cfg(feature = "gpu")]
    pub gpu: Option<kvdb_model::GpuModel>,
    /// The tokenizer from the file's metadata.
    pub tokenizer: Tokenizer,
    /// What a corpus records of it (the file's sha256 and the configuration).
    pub record: ModelRecord,
    /// Seconds each stage of the load took, in order (e.g. `reading the weights`): a
    /// many-gigabyte model takes a while, and a user should see where.
    pub stages: Vec<(&'static str, f64)>,
}

impl LoadedModel {
    /// The model as ingest and queries take it.
    pub fn as_ref(&self) -> ModelRef<'_> {
        ModelRef {
            model: &self.model,
            #[cfg(feature = "gpu")]
            gpu: self.gpu.as_ref(),
            tokenizer: &self.tokenizer,
            record: &self.record,
        }
    }
}

/// Loads the model `explicit` names (or the default model) and hashes its file; for a CUDA
/// `device`, also uploads its weights to that GPU (bf16). Asking for CUDA in a build without
/// feature `gpu`, or on a machine without a driver or device, is an error.
pub fn load_model(
    explicit: Option<&Path>,
    options: &LoadOptions,
    device: ComputeDevice,
) -> Result<LoadedModel> {
    // The device first: without one, fail before reading gigabytes of weights.
    #[cfg(feature = "gpu")]
    let gpu = match device {
        ComputeDevice::Cpu => None,
        ComputeDevice::Cuda { ordinal } => Some(kvdb_kernels_gpu(ordinal)?),
    };
    #[cfg(not(feature = "gpu"))]
    if let ComputeDevice::Cuda { .. } = device {
        return Err(crate::error::Error::NoGpuSupport);
    }
    let path = resolve_model(explicit)?;
    let mut file = GgufFile::open(&path)?;
    let tokenizer = Tokenizer::from_gguf(file.metadata())?;
    let options = match device {
        ComputeDevice::Cpu => options.clone(),
        // The GPU takes the dequantized f32 weights, converted once to bf16.
        ComputeDevice::Cuda { .. } => LoadOptions {
            weights: WeightMode::Dequantized,
            ..options.clone()
        },
    };
    // The file's hash (the model's identity in every corpus manifest) is computed on its own
    // thread while the weights load: it reads the whole file again (13 s for 16 GB). Should
    // the load fail, the thread finishes its read and its result is dropped.
    let hashing = {
        let path = path.clone();
        std::thread::spawn(move || {
            let started = Instant::now();
            kvdb_model::fetch::sha256_file(&path).map(|sha| (sha, started.elapsed()))
        })
    };
    let mut stages = Vec::new();
    let mut timed = |stage: &'static str, started: Instant| {
        stages.push((stage, started.elapsed().as_secs_f64()));
    };
    let started = Instant::now();
    #[cfg_attr(not(feature = "gpu"), allow(unused_mut))]
    let mut model = Model::from_gguf(&mut file, &options, &Device::Cpu)?;
    timed("reading the weights", started);
    #[cfg(feature = "gpu")]
    let gpu = {
        let started = Instant::now();
        let gpu = gpu
            .map(|gpu| kvdb_model::GpuModel::new(&model, gpu, kvdb_model::Precision::Bf16))
            .transpose()?;
        if gpu.is_some() {
            timed("copying them to the GPU", started);
            // Everything that runs the model runs it on the GPU from here on (`ModelRef`
            // dispatches there); the host keeps what it reads besides: configuration, RoPE,
            // tokenizer. The f32 weights would hold twice the file's size in host memory,
            // beside the pinned memory of a corpus kept on the host.
            model.release_weights();
        }
        gpu
    };
    let (sha256, hashed) = hashing
        .join()
        .map_err(|_| crate::error::Error::Internal("the hashing thread panicked".into()))??;
    stages.push(("hashing the file (alongside)", hashed.as_secs_f64()));
    let file_name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let record = model_record(model.config(), &sha256, &file_name);
    Ok(LoadedModel {
        path,
        model,
        #[cfg(feature = "gpu")]
        gpu,
        tokenizer,
        record,
        stages,
    })
}

/// Opens CUDA device `ordinal`, keeping its compiled kernels in `$KVDB_HOME/ptx` (beside
/// the models) so that later commands skip their compilation.
#[cfg(feature = "gpu")]
fn kvdb_kernels_gpu(ordinal: usize) -> Result<std::sync::Arc<kvdb_model::Gpu>> {
    let mut gpu = kvdb_model::Gpu::new(ordinal).map_err(ModelError::from)?;
    if let Some(home) = kvdb_model::fetch::models_dir()?.parent() {
        gpu = gpu.with_ptx_cache(home.join("ptx"));
    }
    Ok(std::sync::Arc::new(gpu))
}
