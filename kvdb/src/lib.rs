//! kvdb: an LLM's KV cache as a persistent vector database, queried with attention as
//! retrieval.
//!
//! A tour, in the order data flows:
//! - [`documents`] reads the files an ingest is given (text, Markdown, HTML).
//! - [`ingest`] prefills them through the model in chunks and commits each chunk's keys and
//!   values to the [`store`] (RocksDB; layout in its module doc).
//! - [`session`] answers a question over a stored corpus: the question is appended after the
//!   corpus and every retrieval layer attends to the keys its index selects plus a dense part
//!   (sinks and recent tokens), reading keys and values through the [`ram_tier`]; the answer
//!   comes with provenance.
//! - [`generate`] is the decoding loop both plain generation and queries share. With a model
//!   on the GPU (feature `gpu`), a query's forward runs there and its retrieval layers attend
//!   through the retrieval kernels over the corpus's keys and values on the GPU, searched on
//!   CPU threads; the session's selection, dense policy and provenance are the CPU's.
//! - [`saap_training`] trains the SAAP artifact a model's `saap` indexes route with.
//!
//! Keys and values are `[tokens, head_dim]` rows per layer and KV head, pre-RoPE keys, f16 in
//! the store and f32 in memory.

#![warn(missing_docs, missing_debug_implementations, unreachable_pub)]
#![deny(unused_must_use, unsafe_op_in_unsafe_fn)]

pub mod documents;
pub mod error;
pub mod generate;
#[cfg(feature = "gpu")]
mod gpu_session;
pub mod indexes;
pub mod ingest;
pub mod models;
pub mod ram_tier;
pub mod saap_training;
pub mod session;
pub mod store;

pub use error::{Error, Result};
