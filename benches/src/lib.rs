//! kvdb-benches: the bench harness.
//!
//! | item | job |
//! |---|---|
//! | [`harness`] | `kvdb bench`: a real KV cache per context length, every index spec at every budget against full attention (retrieval quality on the model's own queries, cost, end-to-end accuracy, needles) |
//! | [`metrics`] | the measures as plain functions over exact attention weights |
//! | [`report`] | `report.md`, `results.json` and the SVG plots of a run |

#![warn(missing_docs, missing_debug_implementations, unreachable_pub)]
#![deny(unused_must_use, unsafe_op_in_unsafe_fn)]

pub mod harness;
pub mod metrics;
pub mod report;
