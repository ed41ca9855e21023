//! The [`KeyIndex`] seam and its per-call arguments.

use std::ops::Range;

use crate::{Result, Selection};

/// Per-call search options.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SearchParams {
    /// At most this many ids are returned (fewer when fewer are eligible).
    pub k: usize,
    /// Only ids inside this range are eligible. The caller excludes the attention sink and
    /// the recent window this way (they are attended densely anyway); the range may reach
    /// past the index's length.
    pub candidates: Range<u32>,
}

/// The query of one token for the query heads of one GQA group.
#[derive(Debug, Clone, Copy)]
pub struct GroupQuery<'a> {
    /// Pre-RoPE query vectors `[group_heads, head_dim]` (the number of heads is
    /// `queries.len() / head_dim`).
    pub queries: &'a [f32],
    /// The token's position; the index rotates the queries with its RoPE at this position.
    pub position: usize,
}

/// An index over the pre-RoPE keys of one KV head of one layer.
///
/// Keys get consecutive ids in the order they are added, so that id = RoPE position.
pub trait KeyIndex: Send + Sync + std::fmt::Debug {
    /// Length of each key and query vector.
    fn head_dim(&self) -> usize;

    /// Number of keys stored (the next id to be given out).
    fn len(&self) -> usize;

    /// Whether no key is stored.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Appends pre-RoPE key rows `[rows, head_dim]`; they get ids `len()..len() + rows`.
    /// Fails, adding nothing, when `keys.len()` is not a multiple of `head_dim`.
    fn add(&mut self, keys: &[f32]) -> Result<()>;

    /// The ids (at most `params.k`, all inside `params.candidates`) whose keys the group's
    /// queries attend to most strongly. Fails when the queries are not whole, non-empty
    /// rows of `head_dim`.
    fn search(&self, query: &GroupQuery<'_>, params: &SearchParams) -> Result<Selection>;

    /// Heap bytes the index holds.
    fn memory_bytes(&self) -> usize;
}
