//! kvdb-server: the axum HTTP API over the kvdb engine (corpora, background ingest, streamed
//! queries with provenance, OpenAI-compatible completions).
//!
//! Nothing is implemented yet: the HTTP API issue fills this crate.
