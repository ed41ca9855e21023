#!/usr/bin/env bash
# Builds everything the GPU machine runs, with feature `gpu`, into .gpu-bundle/ (ignored by
# git) as one xz archive small enough for the device tool to carry (`carry:
# [".gpu-bundle"]`, 64 MiB a call): the `kvdb` binary, the GPU test binaries (kernels' gpu,
# ops and prefill tests, the model's gpu_model test, the GPU ingest and query tests, the
# needle retrieval test, run there with KVDB_TEST_DEVICE=cuda), the kernels'
# benches, the store's commit bench, the random-model writer, and the shared libraries `kvdb` links that the GPU machine's image lacks (OpenBLAS
# and its Fortran runtime). libcuda, NVRTC and cuBLASLt are loaded there at run time.
#
# On the GPU machine: `tar -xJf .gpu-bundle/bundle.tar.xz -C /tmp/kvdb` then
# `LD_LIBRARY_PATH=/tmp/kvdb/lib /tmp/kvdb/bin/kvdb ...`. See README.md, "GPU".
set -euo pipefail
cd "$(dirname "$0")/.."
out=.gpu-bundle
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
mkdir -p "$stage/bin" "$stage/lib"
features=kvdb-cli/gpu,kvdb-tests/gpu,kvdb-kernels/gpu

# The executable of one test or bench target (`test`/`bench`), by name, from cargo's JSON
# messages.
target_binary() {
    local kind=$1 package=$2 target=$3
    # `cargo bench` builds with the bench profile (release) and takes no `--release`.
    local release=--release
    [ "$kind" = bench ] && release=
    cargo "$kind" $release --workspace --features "$features" --no-run --message-format=json \
        -p "$package" "--$kind" "$target" |
        python3 -c 'import json, sys
package, name = sys.argv[1:]
for line in sys.stdin:
    m = json.loads(line)
    # `--workspace` builds every package'"'"'s target of that name: keep the package'"'"'s own
    # (its id ends `#name@version`, or `#version` where the folder is the name).
    pid = m.get("package_id", "")
    own = f"#{package}@" in pid or pid.split("#")[0].endswith("/" + package)
    if m.get("reason") == "compiler-artifact" and own and m["target"]["name"] == name and m.get("executable"):
        print(m["executable"])' "$package" "$target"
}

# The retrieval kernels compiled with NVRTC here first: a source NVRTC refuses would fail every
# test on the GPU machine and cost a device call.
python3 scripts/nvrtc-check.py
cargo build --release --workspace --features "$features" --bins --examples
target=${CARGO_TARGET_DIR:-target}
cp "$target/release/kvdb" "$target/release/random_model" "$target/release/gpu_model_bench" "$stage/bin/"
cp "$target/release/examples/gpu_bench" "$target/release/examples/prefill_bench" "$stage/bin/"
for t in kvdb-kernels:gpu kvdb-kernels:ops kvdb-kernels:prefill kvdb-tests:gpu_model kvdb-cli:gpu_ingest kvdb-cli:gpu_query kvdb:retrieval; do
    cp "$(target_binary test "${t%%:*}" "${t##*:}")" "$stage/bin/test-${t##*:}"
done
cp "$(target_binary bench kvdb-benches store)" "$stage/bin/bench-store"
strip "$stage"/bin/*

# The libraries `kvdb` links beyond glibc, libstdc++ and libgcc (which every image has).
for lib in $(ldd "$stage/bin/kvdb" | awk '/=>/ {print $3}'); do
    case "$(basename "$lib")" in
    libc.so* | libm.so* | libstdc++* | libgcc_s* | ld-linux*) ;;
    *) cp -L "$lib" "$stage/lib/" ;;
    esac
done
cp scripts/bench_model_torch.py scripts/bench_prefill_sdpa.py scripts/bench_sdpa.py scripts/gpu-model-bench.sh scripts/gpu-ingest-bench.sh scripts/gpu-query-bench.sh scripts/gpu-default-model.sh "$stage/"

rm -rf "$out"
mkdir -p "$out"
tar -C "$stage" -cf - . | xz -T0 -6 >"$out/bundle.tar.xz"
ls -la "$stage/bin" "$stage/lib"
du -sh "$out/bundle.tar.xz"
