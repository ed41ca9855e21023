//! [`KvSource`]: where the keys and values of token ids come from.

use crate::error::{length, rows};
use crate::{AttentionError, Result};

/// Keys and values of one layer and one KV head, fetched by token id. The store's RAM tier
/// implements it for the corpus; [`DenseKv`] for a request's tail and for tests.
pub trait KvSource: Sync {
    /// Appends the **pre-RoPE** key rows and the value rows of `ids`, in order, to `keys`
    /// and `values`. Fails on an id the source does not hold.
    fn gather(&self, ids: &[u32], keys: &mut Vec<f32>, values: &mut Vec<f32>) -> Result<()>;
}

/// Keys and values held in memory, `[tokens, head_dim]` each, token `i` at row `i`.
#[derive(Clone, PartialEq)]
pub struct DenseKv {
    keys: Vec<f32>,
    values: Vec<f32>,
    head_dim: usize,
}

impl std::fmt::Debug for DenseKv {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DenseKv")
            .field("head_dim", &self.head_dim)
            .field("len", &self.len())
            .finish_non_exhaustive()
    }
}

impl DenseKv {
    /// Pre-RoPE keys and values `[tokens, head_dim]` of tokens `0..tokens`. Fails unless both
    /// are whole rows of the same count and `head_dim > 0`.
    pub fn new(keys: Vec<f32>, values: Vec<f32>, head_dim: usize) -> Result<Self> {
        rows("keys", keys.len(), head_dim)?;
        length("values", keys.len(), values.len())?;
        Ok(Self {
            keys,
            values,
            head_dim,
        })
    }

    /// Appends rows of keys and values for the next tokens; adds nothing on a shape error.
    pub fn push(&mut self, keys: &[f32], values: &[f32]) -> Result<()> {
        rows("keys", keys.len(), self.head_dim)?;
        length("values", keys.len(), values.len())?;
        self.keys.extend_from_slice(keys);
        self.values.extend_from_slice(values);
        Ok(())
    }

    /// Number of tokens held.
    pub fn len(&self) -> usize {
        self.keys.len() / self.head_dim
    }

    /// Whether no token is held.
    pub fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }

    /// Length of each key and value row.
    pub fn head_dim(&self) -> usize {
        self.head_dim
    }

    /// Pre-RoPE keys `[tokens, head_dim]`.
    pub fn keys(&self) -> &[f32] {
        &self.keys
    }

    /// Values `[tokens, head_dim]`.
    pub fn values(&self) -> &[f32] {
        &self.values
    }
}

impl KvSource for DenseKv {
    fn gather(&self, ids: &[u32], keys: &mut Vec<f32>, values: &mut Vec<f32>) -> Result<()> {
        let len = self.len();
        if let Some(&id) = ids.iter().find(|&&id| id as usize >= len) {
            return Err(AttentionError::IdOutOfRange { id, len });
        }
        let d = self.head_dim;
        keys.reserve(ids.len() * d);
        values.reserve(ids.len() * d);
        for &id in ids {
            let rows = id as usize * d..(id as usize + 1) * d;
            keys.extend_from_slice(&self.keys[rows.clone()]);
            values.extend_from_slice(&self.values[rows]);
        }
        Ok(())
    }
}
