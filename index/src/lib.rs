//! kvdb-index: the [`KeyIndex`] trait and its implementations.
//!
//! A key index answers one question for one KV head of one layer: which stored tokens does
//! this query group attend to most strongly? It returns a [`Selection`] of token ids; the
//! attention crate then scores those tokens exactly and merges them with the dense part
//! (attention sinks and the recent window).
//!
//! | item | job |
//! |---|---|
//! | [`KeyIndex`] | the seam: `add` pre-RoPE keys, `search` with a [`GroupQuery`] and per-call [`SearchParams`] |
//! | [`FlatIndex`] | exact maximum inner product search over every stored key (rayon, SIMD-friendly dots) |
//! | [`Selection`] | sorted, duplicate-free token ids |
//! | [`kernel`] | the dot product the indexes and the attention crate share |
//!
//! Layouts are stated once. A token id is a `u32`, the token's position in the corpus
//! context: token `i` sits at RoPE position `i`. Keys and queries are row-major f32 slices,
//! `[rows, head_dim]`: keys are handed over **pre-RoPE** and get ids `len()..` in order; the
//! queries of a [`GroupQuery`] are the pre-RoPE vectors `[group_heads, head_dim]` of one token,
//! rotated by the index at the token's position.
//!
//! ```
//! use kvdb_index::{FlatIndex, GroupQuery, KeyIndex, SearchParams};
//! use kvdb_model::{Rope, RopeConfig, RopeScaling, RopeStyle};
//! # fn main() -> kvdb_index::Result<()> {
//! let config = RopeConfig { base: 10_000.0, style: RopeStyle::Halves, scaling: RopeScaling::None };
//! let mut index = FlatIndex::new(Rope::new(&config, 8, None));
//! index.add(&[0.0; 8 * 100])?; // 100 keys, ids 0..100
//! let query = GroupQuery { queries: &[1.0; 8 * 2], position: 100 }; // 2 query heads
//! let found = index.search(&query, &SearchParams { k: 10, candidates: 4..90 })?;
//! assert_eq!(found.len(), 10);
//! assert!(found.ids().iter().all(|id| (4..90).contains(id)));
//! # Ok(()) }
//! ```

#![warn(missing_docs, missing_debug_implementations, unreachable_pub)]
#![deny(unused_must_use, unsafe_op_in_unsafe_fn)]

mod error;
mod flat;
pub mod kernel;
mod key_index;
mod selection;

pub use error::{IndexError, Result};
pub use flat::FlatIndex;
pub use key_index::{GroupQuery, KeyIndex, SearchParams};
pub use selection::Selection;
