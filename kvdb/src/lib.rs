//! kvdb: an LLM's KV cache as a persistent vector database, queried with attention as
//! retrieval.
//!
//! This crate holds the engine and the `kvdb` command line. Today it generates with full
//! attention over [`kvdb_model`]; the store (RocksDB), ingest and retrieval queries come with
//! the next issues (see ARCHITECTURE.md).

#![warn(missing_docs, missing_debug_implementations, unreachable_pub)]
#![deny(unused_must_use, unsafe_op_in_unsafe_fn)]

pub mod generate;
pub mod models;
