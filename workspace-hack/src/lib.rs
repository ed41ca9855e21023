//! Nothing to use: this crate exists for its build-dependencies, which pin the features of
//! the build tools that compile RocksDB and faiss so that every cargo command shares one
//! build of them (see Cargo.toml).
