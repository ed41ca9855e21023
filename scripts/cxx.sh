#!/bin/sh
# The C++ compiler of Cargo's build scripts (.cargo/config.toml points CXX here; a CXX of
# your own wins). RocksDB's ~340 sources, most of a first build, compile in about a fifth
# less CPU time with clang++ than with g++ (README, "Run the tests"), so RocksDB gets
# clang++ where it is installed (scripts/setup.sh installs it: bindgen needs libclang
# anyway). Everything else gets the system's c++: faiss among them, whose OpenMP is
# libgomp's. cc and cmake call this with the build's own paths, which name the crate.
case "$*" in
*librocksdb-sys-*)
    if command -v clang++ >/dev/null 2>&1; then
        exec clang++ "$@"
    fi
    ;;
esac
exec c++ "$@"
