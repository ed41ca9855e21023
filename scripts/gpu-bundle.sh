#!/usr/bin/env bash
# Builds the GPU test and bench binaries of kvdb-kernels (feature `cuda`) into .gpu-bundle/
# (ignored by git), stripped, for the device tool to carry (`carry: [".gpu-bundle"]`).
# They link only kvdb-kernels, kvdb-attention (the f64 reference) and small crates: no faiss,
# RocksDB or BLAS; libcuda and libnvrtc are loaded at run time. See README.md, "GPU".
set -euo pipefail
cd "$(dirname "$0")/.."
out=.gpu-bundle
target=${CARGO_TARGET_DIR:-target}

# The bundle must not link the heavy native libraries of the other crates.
if cargo tree -p kvdb-kernels --features cuda -e normal,dev --prefix none |
    grep -Ei '^(faiss|rocksdb|librocksdb|openblas|blas|lapack|intel-mkl|accelerate)'; then
    echo "gpu-bundle: kvdb-kernels' dependencies reach faiss, RocksDB or BLAS" >&2
    exit 1
fi

cargo build --release -p kvdb-kernels --features cuda --example gpu_bench
tests=$(cargo test --release -p kvdb-kernels --features cuda --test gpu --no-run --message-format=json |
    python3 -c 'import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m["target"]["name"] == "gpu" and m.get("executable"):
        print(m["executable"])')

rm -rf "$out"
mkdir -p "$out"
cp "$target/release/examples/gpu_bench" "$out/gpu-bench"
cp "$tests" "$out/gpu-tests"
strip "$out/gpu-bench" "$out/gpu-tests"
for binary in "$out"/*; do
    if ldd "$binary" | grep -Ei 'blas|lapack|rocksdb|faiss|stdc\+\+'; then
        echo "gpu-bundle: $binary links a library it must not" >&2
        exit 1
    fi
done
du -sh "$out"/*
