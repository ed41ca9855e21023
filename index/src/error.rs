//! The crate's error type.

/// What can go wrong when adding to or searching an index.
#[derive(Debug, thiserror::Error)]
pub enum IndexError {
    /// A slice of floats is not a whole number of rows (or the head dimension is zero).
    #[error("{what}: {len} floats are not whole rows of head_dim {head_dim}")]
    Shape {
        /// Which argument.
        what: &'static str,
        /// Its length in floats.
        len: usize,
        /// The row length it must be a multiple of.
        head_dim: usize,
    },
    /// An argument that needs at least one row has none.
    #[error("{what} is empty")]
    Empty {
        /// Which argument.
        what: &'static str,
    },
    /// A spec string that does not parse.
    #[error(
        "bad index spec `{spec}` at `{token}`: {problem}\n{}",
        crate::spec::GRAMMAR
    )]
    Spec {
        /// The whole spec.
        spec: String,
        /// The token that is wrong.
        token: String,
        /// What is wrong with it.
        problem: String,
    },
    /// Saved index bytes that cannot be read back.
    #[error("corrupt saved index: {0}")]
    Corrupt(String),
    /// A build that cannot be done with what it was given (e.g. saap without its trained
    /// artifact, ivf in a build without faiss).
    #[error("cannot build `{spec}`: {reason}")]
    Build {
        /// The spec.
        spec: String,
        /// Why.
        reason: String,
    },
    /// hnsw_rs saves and loads graphs through files: writing or reading them failed.
    #[error("hnsw graph files: {0}")]
    GraphFiles(String),
    /// An error from faiss.
    #[cfg(feature = "faiss")]
    #[error("faiss: {0}")]
    Faiss(#[from] faiss::error::Error),
    /// faiss handed back what an IVF index cannot hold (a bug of ours or of faiss).
    #[error("faiss returned {0}")]
    FaissOutput(String),
    /// A tensor computation on the CPU failed (candle).
    #[error("computing {what}")]
    Compute {
        /// What was being computed.
        what: &'static str,
        /// candle's error.
        #[source]
        source: candle_core::Error,
    },
    /// [`crate::load_from`] was given keys from an id other than the ones the saved index
    /// reads from ([`crate::SavedInfo::keys_from`]).
    #[error(
        "loading was given the keys from id {first}; this saved index needs them from id {needed}"
    )]
    KeysFrom {
        /// The first id given.
        first: usize,
        /// The first id it needs.
        needed: usize,
    },
    /// Token ids are `u32`: an index holds at most `u32::MAX` keys.
    #[error("cannot add {adding} keys to an index of {len}: token ids are u32")]
    TooManyKeys {
        /// Keys already in the index.
        len: usize,
        /// Keys being added.
        adding: usize,
    },
}

/// The crate's result type.
pub type Result<T> = std::result::Result<T, IndexError>;

/// Number of `head_dim` rows in `len` floats, or a [`IndexError::Shape`] error.
pub(crate) fn rows(what: &'static str, len: usize, head_dim: usize) -> Result<usize> {
    match len.checked_rem(head_dim) {
        Some(0) => Ok(len / head_dim),
        _ => Err(IndexError::Shape {
            what,
            len,
            head_dim,
        }),
    }
}
