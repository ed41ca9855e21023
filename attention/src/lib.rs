//! kvdb-attention: retrieval attention over a `Selection` (sinks + recent window + retrieved
//! ids), `Partial` results (unnormalised output, running max, sum of exponentials) and their
//! exact log-sum-exp `merge`, sparse prefill patterns, and exact references.
//!
//! Nothing is implemented yet: the store/retrieval issue fills this crate. It implements
//! `kvdb_model::AttentionBackend`, the hook every attention layer of the model calls.
