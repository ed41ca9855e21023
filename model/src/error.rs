//! The crate's error type: every variant says what failed and carries the values a user needs
//! to act on it.

use std::path::PathBuf;

/// Errors of kvdb-model.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    /// The model file does not exist.
    #[error("model file {path} does not exist (run `kvdb model fetch` for the default model, or pass --model PATH to a local GGUF file)")]
    MissingFile {
        /// The path that was asked for.
        path: PathBuf,
    },
    /// The file could not be read.
    #[error("cannot read {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
    /// The file is not a readable GGUF file (bad magic, truncated, corrupt header).
    #[error("{path} is not a valid GGUF file ({reason}); re-download it or check that it is a GGUF model")]
    InvalidGguf {
        /// The file.
        path: PathBuf,
        /// What the parser said.
        reason: String,
    },
    /// The GGUF header is readable but the tensor data ends early.
    #[error("{path} is truncated: tensor `{tensor}` needs bytes up to offset {needed} but the file has {size}; re-download it")]
    Truncated {
        /// The file.
        path: PathBuf,
        /// The first tensor that does not fit.
        tensor: String,
        /// The end offset that tensor needs.
        needed: u64,
        /// The file's size.
        size: u64,
    },
    /// The architecture named in the file is not one kvdb implements.
    #[error("unsupported architecture `{arch}` (kvdb supports {supported})")]
    UnsupportedArchitecture {
        /// `general.architecture` of the file.
        arch: String,
        /// The supported ones, for the message.
        supported: &'static str,
    },
    /// A metadata key the architecture needs is missing or has the wrong type.
    #[error("GGUF metadata `{key}`: {reason}")]
    Metadata {
        /// The key.
        key: String,
        /// What is wrong with it.
        reason: String,
    },
    /// A tensor the architecture needs is missing or has the wrong shape.
    #[error("tensor `{name}`: {reason}")]
    Tensor {
        /// The tensor name in the GGUF file.
        name: String,
        /// What is wrong with it.
        reason: String,
    },
    /// The sequence would not fit in the model's context.
    #[error(
        "{tokens} tokens do not fit the model's context of {context} tokens; shorten the prompt"
    )]
    ContextOverflow {
        /// Tokens the sequence would hold.
        tokens: usize,
        /// The model's context length.
        context: usize,
    },
    /// Logits were asked for a row the chunk does not have.
    #[error("logits asked for row {row} of a {tokens}-token chunk")]
    LogitRow {
        /// The row asked for.
        row: usize,
        /// Tokens in the chunk.
        tokens: usize,
    },
    /// Stored keys and values were asked for rows the last call did not have.
    #[error("stored keys and values asked for rows {start}..{end} of a {tokens}-token call")]
    StoredRows {
        /// First row asked for.
        start: usize,
        /// End of the rows asked for.
        end: usize,
        /// Tokens in the call.
        tokens: usize,
    },
    /// A token id outside the vocabulary.
    #[error("token id {id} is outside the vocabulary of {vocab} tokens")]
    TokenOutOfRange {
        /// The id.
        id: u32,
        /// The vocabulary size.
        vocab: usize,
    },
    /// A batched decode step named a sequence the batch does not have, or one twice.
    #[error("batched step: {0}")]
    BatchStep(String),
    /// The tokenizer metadata is inconsistent or of an unsupported kind.
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    /// An attention backend was called in a way it cannot serve.
    #[error("attention backend, layer {layer}: {reason}")]
    Backend {
        /// The layer index.
        layer: usize,
        /// What went wrong.
        reason: String,
    },
    /// The caller's attention backend failed; its error is the source (the caller can take
    /// its own error type back out of it).
    #[error("attention in layer {layer} failed")]
    BackendFailed {
        /// The layer index.
        layer: usize,
        /// The backend's error.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// The model's CPU weights were released after their upload to a GPU
    /// ([`crate::Model::release_weights`]), and something asked the CPU to run it.
    #[error(
        "this model's weights are on the GPU only; run it there, or load it again for the CPU"
    )]
    WeightsReleased,
    /// Fetching the default model failed.
    #[error("{0}")]
    Fetch(String),
    /// The GPU failed: no driver or device, a kernel or cuBLAS error, out of memory.
    #[cfg(feature = "gpu")]
    #[error(transparent)]
    Gpu(#[from] kvdb_kernels::KernelError),
    /// A tensor operation failed (a bug or an out-of-memory condition, not bad input).
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
    /// A broken invariant of the model code itself (shapes or layouts its own callers
    /// guarantee): a bug, never the user's input.
    #[error("internal error in the model (a bug in kvdb): {0}")]
    Internal(String),
}

/// The crate's result type.
pub type Result<T, E = ModelError> = std::result::Result<T, E>;
