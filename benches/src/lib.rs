//! kvdb-benches: the bench harness's shared parts.
//!
//! | item | job |
//! |---|---|
//! | [`key_model`] | a distribution fitted to the default model's real keys, values and queries (committed in `data/key-model.bin`, refitted by the `fit_keys` binary); corpora of any size and head dimension drawn from it |
//! | [`harness`] | `kvdb bench`: a real KV cache per context length, every index spec at every budget against full attention (retrieval quality on the model's own queries, cost, end-to-end accuracy, needles) |
//! | [`metrics`] | the measures as plain functions over exact attention weights |
//! | [`report`] | `report.md`, `results.json` and the SVG plots of a run |
//! | [`micro`] | what the criterion micro-benches share: corpus sizes, the smoke run under `cargo test`, criterion's settings, the on-disk cache of built indexes |
//!
//! The criterion micro-benches are `benches/search.rs` (one search per index type at 16K,
//! 128K and 1M keys, head dims 128 and 256) and `benches/merge.rs` (retrieval attention,
//! sink + window + selection merged by log-sum-exp, against full attention). Run them with
//! `cargo bench -p kvdb-benches`; `docs/benchmarks.md` has the figures.
//!
//! Layouts as everywhere in kvdb: row-major f32, keys and values `[tokens, head_dim]`
//! (keys pre-RoPE, token `i` at position `i`), queries `[tokens, group, head_dim]`.

#![warn(missing_docs, missing_debug_implementations, unreachable_pub)]
#![deny(unused_must_use, unsafe_op_in_unsafe_fn)]

pub mod harness;
pub mod key_model;
pub mod metrics;
pub mod micro;
pub mod report;
