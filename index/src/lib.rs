//! kvdb-index: the `KeyIndex` trait and its implementations (flat, ivf, hnsw, lsh, saap, hip,
//! infinitehip), the `IndexSpec` parser and index save/load.
//!
//! Nothing is implemented yet: the store/retrieval issue adds `KeyIndex`, `Selection` and
//! `flat`; the index-family issue adds the others. The crate exists so that the workspace has
//! the shape of ARCHITECTURE.md from the start.
