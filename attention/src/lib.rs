//! kvdb-attention: retrieval attention for one query token and one KV head's GQA group.
//!
//! A retrieval layer does not attend to every past token. It attends densely to a small part
//! (the first `sink` tokens and the last `window` tokens, [`DensePolicy`]) and to the
//! [`Selection`](kvdb_index::Selection) a key index returned. Each part gives a [`Partial`]
//! result (unnormalised output, running max, sum of exponentials); partials over disjoint
//! token sets [`merge`] exactly by log-sum-exp, so with every token selected the result equals
//! full attention to rounding. [`attend`] runs the whole step; [`reference`]
//! holds the exact f64 attention it is tested against.
//!
//! | item | job |
//! |---|---|
//! | [`DensePolicy`] | the dense part of a query at a position, and the candidate ids left to an index |
//! | [`KvSource`], [`DenseKv`] | where pre-RoPE keys and values of ids come from (store, RAM tier, a request's tail) |
//! | [`logits`], [`Partial`], [`merge`] | scaled dot products, partial softmax attention and the exact merge |
//! | [`attend`] | rotate, gather, score, merge, normalise; reports each token's attention share |
//! | [`reference`] | exact f64 attention over all tokens or any id set |
//!
//! Layouts are stated once. A token id is a `u32`, the token's position in the context (token
//! `i` sits at RoPE position `i`). All matrices are row-major f32 slices: queries
//! `[heads, head_dim]` (the query heads of one GQA group, one token), keys and values
//! `[tokens, head_dim]` (one layer, one KV head; keys pre-RoPE unless a name says rotated),
//! logits and weights `[heads, tokens]`, outputs `[heads, head_dim]`.
//!
//! ```
//! use kvdb_attention::{attend, DenseKv, DensePolicy, RetrievalQuery};
//! use kvdb_index::Selection;
//! use kvdb_model::{Rope, RopeConfig, RopeScaling, RopeStyle};
//! # fn main() -> kvdb_attention::Result<()> {
//! let config = RopeConfig { base: 10_000.0, style: RopeStyle::Halves, scaling: RopeScaling::None };
//! let rope = Rope::new(&config, 4, None);
//! let kv = DenseKv::new(vec![0.5; 4 * 10], (0..40).map(|i| i as f32).collect(), 4)?;
//! let selection = Selection::new(vec![5, 8, 9]); // 9 falls in the window: dropped
//! let query = RetrievalQuery {
//!     queries: &[1.0; 4 * 2], // two query heads share the KV head
//!     position: 9,
//!     rope: &rope,
//!     scale: 0.5,
//!     policy: DensePolicy { sink: 2, window: 3 },
//!     selection: &selection,
//!     estimate: None,
//! };
//! let attended = attend(&query, &kv)?;
//! assert_eq!(attended.ids, vec![0, 1, 7, 8, 9, 5]);
//! let first_head: f32 = attended.weights[..6].iter().sum();
//! assert!((first_head - 1.0).abs() < 1e-6);
//! # Ok(()) }
//! ```

#![warn(missing_docs, missing_debug_implementations, unreachable_pub)]
#![deny(unused_must_use, unsafe_op_in_unsafe_fn)]

mod error;
mod partial;
mod policy;
pub mod reference;
mod retrieval;
mod source;

pub use error::{AttentionError, Result};
pub use partial::{logits, merge, Partial};
pub use policy::DensePolicy;
pub use retrieval::{attend, Attended, Estimate, RetrievalQuery};
pub use source::{DenseKv, KvSource};
