#!/usr/bin/env bash
# `kvdb ingest --device cuda` end to end on a GPU machine, with the prefill alone measured in
# the same command: writes a random-weight GGUF with Gemma 3 270M's shapes (bf16, a 262,144-
# token context), four documents of real text (copies of the GPL, each with its own first
# line so that none is skipped as a duplicate, ~120K tokens together), times
# `gpu_model_bench`'s prefill of as many tokens (the model alone, chunks of 4,096), ingests
# the documents into fresh stores `RUNS` times, and runs the store's commit bench
# (`bench-store`) on the same disk. Logs go to $OUT (or ./gpu-ingest-bench).
#
# Usage (on the GPU machine, from the unpacked bundle of scripts/gpu-bundle.sh):
#   scripts/gpu-ingest-bench.sh /tmp/kvdb [WORK_DIR]
set -euo pipefail
bundle=${1:?usage: gpu-ingest-bench.sh BUNDLE_DIR [WORK_DIR]}
work=${2:-$(mktemp -d)}
out=${OUT:-gpu-ingest-bench}
runs=${RUNS:-3}
mkdir -p "$out" "$work/docs"
export LD_LIBRARY_PATH=$bundle/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
text=${TEXT:-/usr/share/common-licenses/GPL-3}
model=$work/gemma3-270m.gguf
[ -f "$model" ] || "$bundle/bin/random_model" --preset gemma3-270m --dtype bf16 \
    --context 262144 --out "$model" 2>&1 | tail -1
for i in 1 2 3 4; do
    { echo "Copy $i of the license."; cat "$text"; } >"$work/docs/copy-$i.txt"
done
{
    echo "# $(date -u +%FT%TZ) $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)"
    echo "# disk of the stores: $(df -h "$work" | tail -1)"
    for run in $(seq "$runs"); do
        rm -rf "$work/store"
        "$bundle/bin/kvdb" ingest --device cuda --model "$model" --store "$work/store" \
            --corpus c --progress none "$work/docs"
    done
} 2>&1 | tee "$out/ingest.log"
tokens=$("$bundle/bin/kvdb" corpus info --store "$work/store" --corpus c |
    sed -n 's/^tokens: *\([0-9]*\).*/\1/p')
echo "# the prefill alone of $tokens tokens (gpu_model_bench):" | tee -a "$out/ingest.log"
"$bundle/bin/gpu_model_bench" --model "$model" --name gemma3-270m --lengths "$tokens" \
    --contexts 4096 --steps 8 --out "$out/prefill.jsonl" 2>&1 | tee -a "$out/ingest.log"
KVDB_BENCH_DIR=$work "$bundle/bin/bench-store" --bench 2>&1 | tee "$out/store-bench.log"
