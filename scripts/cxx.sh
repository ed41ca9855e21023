#!/bin/sh
# The C++ compiler of Cargo's build scripts (.cargo/config.toml points CXX here; a CXX set in
# your environment wins). RocksDB's ~340 sources are most of a first build, and clang++
# compiles them in about a fifth less CPU time than g++ (README, "Run the tests"), so RocksDB
# gets clang++ where it is installed (scripts/setup.sh installs it: bindgen needs libclang
# anyway). Everything else gets the system's c++, faiss among them: its OpenMP is libgomp's,
# which clang does not generate code for. Cargo names the crate a build script belongs to in
# CARGO_PKG_NAME, which cc and cmake pass on to the compiler they run.
if [ "${CARGO_PKG_NAME:-}" = librocksdb-sys ] && command -v clang++ >/dev/null 2>&1; then
    exec clang++ "$@"
fi
exec c++ "$@"
