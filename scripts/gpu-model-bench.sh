#!/usr/bin/env bash
# The model benchmark on a GPU machine, both sides in one command: writes random-weight
# GGUF models with the shapes of Gemma 3 270M and Llama-3-8B (bf16), times kvdb's GPU
# forward pass (gpu_model_bench) and PyTorch's (scripts/bench_model_torch.py, bf16, SDPA) on
# the same GPU, and leaves JSON lines and logs in $OUT (or ./gpu-model-bench).
#
# Usage (on the GPU machine, from the unpacked bundle of scripts/gpu-bundle.sh):
#   scripts/gpu-model-bench.sh /tmp/kvdb [--quick]
set -euo pipefail
bundle=${1:?usage: gpu-model-bench.sh BUNDLE_DIR [--quick]}
quick=${2:-}
out=${OUT:-gpu-model-bench}
mkdir -p "$out"
models=$(mktemp -d)
export LD_LIBRARY_PATH=$bundle/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
lengths=4096,32768,131072
if [ "$quick" = --quick ]; then lengths=4096,32768; fi
for shape in gemma3-270m llama3-8b; do
    "$bundle/bin/random_model" --preset "$shape" --dtype bf16 --out "$models/$shape.gguf" 2>&1 | tail -1
    "$bundle/bin/gpu_model_bench" --model "$models/$shape.gguf" --name "$shape" \
        --lengths "$lengths" --out "$out/kvdb.jsonl" 2>&1 | tee -a "$out/kvdb.log"
    rm -f "$models/$shape.gguf"
done
PYTHONUNBUFFERED=1 python3 "$bundle/bench_model_torch.py" --lengths "$lengths" \
    --repeats 1 --out "$out/torch.jsonl" 2>&1 | tee "$out/torch.log"
