//! The crate's error type.

use kvdb_index::IndexError;

/// What can go wrong in retrieval attention.
#[derive(Debug, thiserror::Error)]
pub enum AttentionError {
    /// A slice of floats is not a whole number of rows (or the row length is zero).
    #[error("{what}: {len} floats are not whole rows of {row} floats")]
    Shape {
        /// Which argument.
        what: &'static str,
        /// Its length in floats.
        len: usize,
        /// The row length it must be a multiple of.
        row: usize,
    },
    /// A slice does not have the length its companions imply.
    #[error("{what}: expected {expected} floats, found {found}")]
    Length {
        /// Which argument.
        what: &'static str,
        /// The length implied by the other arguments.
        expected: usize,
        /// Its actual length.
        found: usize,
    },
    /// An argument that needs at least one row or head has none.
    #[error("{what} is empty")]
    Empty {
        /// Which argument.
        what: &'static str,
    },
    /// Two partials of different shapes cannot merge.
    #[error("cannot merge partials of [{a_heads}, {a_dim}] and [{b_heads}, {b_dim}]")]
    PartialMismatch {
        /// Heads of the first.
        a_heads: usize,
        /// Head dimension of the first.
        a_dim: usize,
        /// Heads of the second.
        b_heads: usize,
        /// Head dimension of the second.
        b_dim: usize,
    },
    /// A token id beyond what a source holds.
    #[error("token id {id} is out of range: the source holds {len} tokens")]
    IdOutOfRange {
        /// The id asked for.
        id: u32,
        /// Tokens the source holds.
        len: usize,
    },
    /// A query position whose token id would not fit in a `u32`.
    #[error("position {position} is beyond the largest token id")]
    Position {
        /// The position.
        position: usize,
    },
    /// A [`crate::KvSource`] could not read keys or values (e.g. the store failed); its
    /// error is the source.
    #[error("reading keys and values")]
    Source(#[source] Box<dyn std::error::Error + Send + Sync>),
    /// An estimate of unvisited buckets that does not fit the query (a bug of the caller).
    #[error("bucket estimate: {0}")]
    Estimate(String),
    /// An index failed (for callers that search and attend in one go).
    #[error(transparent)]
    Index(#[from] IndexError),
}

/// The crate's result type.
pub type Result<T> = std::result::Result<T, AttentionError>;

/// Number of `row`-float rows in `len` floats, or an [`AttentionError::Shape`] error.
pub(crate) fn rows(what: &'static str, len: usize, row: usize) -> Result<usize> {
    match len.checked_rem(row) {
        Some(0) => Ok(len / row),
        _ => Err(AttentionError::Shape { what, len, row }),
    }
}

/// Like [`rows`], but at least one row is required.
pub(crate) fn some_rows(what: &'static str, len: usize, row: usize) -> Result<usize> {
    match rows(what, len, row)? {
        0 => Err(AttentionError::Empty { what }),
        n => Ok(n),
    }
}

/// An error unless `found == expected`.
pub(crate) fn length(what: &'static str, expected: usize, found: usize) -> Result<()> {
    if found == expected {
        Ok(())
    } else {
        Err(AttentionError::Length {
            what,
            expected,
            found,
        })
    }
}
