//! kvdb: an LLM's KV cache as a persistent vector database, queried with attention as
//! retrieval.
//!
//! A tour, in the order data flows (the modules are private; what they export is listed
//! below, on purpose):
//! - [`load_model`] loads a GGUF model (the default one, fetched into the cache, when none is
//!   named) on a [`ComputeDevice`]; [`LoadedModel::as_ref`] is the [`ModelRef`] every call
//!   below takes.
//! - [`read_documents`] reads the files an ingest is given (text, Markdown, HTML).
//! - [`ingest`] prefills them through the model in chunks and commits each chunk's keys and
//!   values to the [`Store`] (RocksDB; layout in [`store`]'s module doc), reporting
//!   [`IngestEvent`]s; [`ingest_until`] can stop between chunks and resume later.
//! - [`update_indexes`] builds and saves each spec's key indexes ([`IndexSet`]: per retrieval
//!   layer and KV head) and catches them up as the corpus grows; [`train_artifact`] trains the
//!   SAAP artifact a model's `saap` indexes route with.
//! - [`Corpus`] answers a question over a stored corpus ([`Corpus::ask`], or
//!   [`Corpus::session`] and [`Session::answer`]): one query's [`Session`] appends the
//!   question after the corpus, and every retrieval layer attends to the
//!   keys its index selects plus a dense part (sinks and recent tokens), reading keys and
//!   values through a RAM tier; the [`Answer`] comes with [`Provenance`]. With a model on the
//!   GPU (feature `gpu`), the query's forward runs there and its retrieval layers attend
//!   through the retrieval kernels over the corpus's keys and values on the GPU; bucket
//!   indexes route there, top-k indexes search on CPU threads. The CPU and GPU sessions
//!   share the selection, dense policy and provenance.
//! - [`generate`] is plain generation; queries decode through the same loop.
//!
//! Keys and values are `[tokens, head_dim]` rows per layer and KV head, pre-RoPE keys, f16 in
//! the store and f32 in memory.

#![warn(missing_docs, missing_debug_implementations, unreachable_pub)]
#![deny(unused_must_use, unsafe_op_in_unsafe_fn)]

mod documents;
mod error;
mod generate;
#[cfg(feature = "gpu")]
mod gpu_session;
mod indexes;
mod ingest;
mod models;
mod ram_tier;
mod saap_training;
mod session;
pub mod store;

// The engine's API, on purpose: what a program (the CLI, the server, the benches) needs to
// ingest documents, index them, ask questions and generate. Everything else is private; the
// store is a public module because its layout (families, keys, records) is part of the
// product: tools and tests read it.

pub use error::{Error, Result};

// Models.
pub use ingest::ModelRef;
pub use models::{load_model, resolve_model, ComputeDevice, LoadedModel};

// Documents and ingest.
pub use documents::{
    document_from_bytes, is_supported_document, read_document, read_documents, SourceDocument,
};
pub use ingest::{
    check_model, ingest, ingest_until, IngestEvent, IngestReport, DOCUMENT_SEPARATOR, INGEST_CHUNK,
};
pub use store::{Access, Store};

// Indexes.
pub use indexes::{
    check_specs, list_indexes, remove_index, saap_registry_path, update_indexes,
    update_indexes_until, IndexEvent, IndexInfo, IndexSet, LayerIndexes,
};
pub use saap_training::{
    train_artifact, train_head, SaapTraining, TrainEvent, TrainOptions, TrainingData,
};

// Questions over a stored corpus.
pub use ram_tier::TierStats;
pub use session::{
    Answer, AskOptions, AttentionMode, Corpus, DocumentShare, GpuKv, PassageShare, Provenance,
    Retrieval, RetrievalStats, Session, Timings, Together, DEFAULT_FOLLOW, DEFAULT_K,
    PASSAGE_TOKENS,
};
#[cfg(feature = "gpu")]
pub use session::{GpuFootprint, GpuUpload};

// Generation, and the limits the CLI and the server check options against.
pub use generate::{
    checked_follow, checked_k, checked_temperature, checked_top_p, generate, BatchSteps,
    GenerateOptions, Generation, OptionError, StopReason, MAX_K, MAX_TEMPERATURE,
};
