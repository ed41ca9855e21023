#!/usr/bin/env bash
# `kvdb ask --device cuda` end to end on a GPU machine: writes random-weight GGUFs with real
# shapes (Gemma 3 270M; Llama-3-8B), ingests copies of the GPL on the GPU with a flat index
# (and an IVF one), and asks one question per mode (full attention, flat top-k, ivf) on the GPU,
# and for Gemma on the CPU too, printing each answer's timings (`--json`: time to the first
# token, tokens per second after it, keys selected). Logs go to $OUT (or ./gpu-query-bench).
#
# Usage (on the GPU machine, from the unpacked bundle of scripts/gpu-bundle.sh):
#   scripts/gpu-query-bench.sh /tmp/kvdb [WORK_DIR]
# COPIES_GEMMA / COPIES_LLAMA set how many copies of the text each corpus holds (0: skip); IVF_LLAMA
# an IVF spec for Llama too (its build takes minutes: 32 layers x 8 KV heads; with it, Llama skips
# flat top-k, whose search on the CPU takes a fifth of a second a token there, and its index); K the keys flat top-k
# retrieves (default: 1% of the corpus); GEMMA_DEVICES the devices Gemma is asked on (default
# "cuda cpu").
set -euo pipefail
bundle=${1:?usage: gpu-query-bench.sh BUNDLE_DIR [WORK_DIR]}
work=${2:-$(mktemp -d)}
out=${OUT:-gpu-query-bench}
mkdir -p "$out" "$work"
export LD_LIBRARY_PATH=$bundle/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
kvdb=$bundle/bin/kvdb
text=${TEXT:-/usr/share/common-licenses/GPL-3}
log=$out/query.log
echo "# $(date -u +%FT%TZ) $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)" | tee "$log"
cat >"$work/summary.py" <<'PY'
import json, sys
a = json.load(sys.stdin)
t, r = a["timings"], a.get("retrieval") or {}
selected = r.get("selected", 0) / max(r.get("eligible", 0), 1)
rate = t["tokens_per_second"]
# Per token of the answer and its question, in ms: search, CPU attention, waits for queries.
steps = len(a["tokens"]) + a["question_tokens"]
parts = ", ".join(
    f"{name} {1000 * r.get(key, 0.0) / steps:.2f}"
    for name, key in [("search", "search_seconds"), ("cpu attention", "cpu_attention_seconds"),
                      ("query copies", "transfer_seconds")]
)
print(
    f"first token {t['first_token_seconds']:.3f} s, {rate:.1f} tok/s after it "
    f"({1000 / max(rate, 1e-9):.2f} ms/token), {len(a['tokens'])} tokens, "
    f"selected {selected:.4f}, corpus {a['corpus_tokens']} tokens; ms per token: {parts}"
)
PY
summary() { python3 "$work/summary.py"; }
for spec in "gemma3-270m:${COPIES_GEMMA:-4}:ivf256,np8,norope,all" "llama3-8b:${COPIES_LLAMA:-1}:${IVF_LLAMA:-none}"; do
    IFS=: read -r preset copies ivf <<<"$spec"
    [ "$copies" -gt 0 ] || continue
    model=$work/$preset.gguf
    [ -f "$model" ] || "$bundle/bin/random_model" --preset "$preset" --dtype bf16 \
        --context 262144 --out "$model" 2>&1 | tail -1
    # A store left by an earlier run on this machine is asked again as it is.
    if [ ! -d "$work/store-$preset" ]; then
        mkdir -p "$work/docs-$preset"
        for i in $(seq "$copies"); do
            { echo "Copy $i of the license."; cat "$text"; } >"$work/docs-$preset/copy-$i.txt"
        done
        indexes=(--index flat)
        [ "$ivf" = none ] || indexes+=(--index "$ivf")
        [ "$preset" = llama3-8b ] && [ "$ivf" != none ] && indexes=(--index "$ivf")
        s=$(date +%s)
        "$kvdb" ingest --device cuda --model "$model" --store "$work/store-$preset" --corpus c \
            --progress none "${indexes[@]}" "$work/docs-$preset" 2>&1 | tail -1 | tee -a "$log"
        echo "$preset: ingest and index build $(($(date +%s) - s)) s" | tee -a "$log"
    fi
    devices=cuda
    [ "$preset" = gemma3-270m ] && devices=${GEMMA_DEVICES:-cuda cpu}
    for device in $devices; do
        modes=("--full-attention" "--index flat")
        [ "$preset" = llama3-8b ] && [ "$ivf" != none ] && modes=("--full-attention")
        [ "$ivf" = none ] || modes+=("--index $ivf")
        for mode in "${modes[@]}"; do
            echo -n "$preset $device $mode: " | tee -a "$log"
            k=()
            if [ "$mode" = "--index flat" ]; then
                tokens=$("$kvdb" corpus info --store "$work/store-$preset" --corpus c |
                    sed -n 's/^tokens: *\([0-9]*\).*/\1/p')
                k=(--k "${K:-$((tokens / 100))}")
            fi
            # shellcheck disable=SC2086
            "$kvdb" ask --device "$device" --model "$model" --store "$work/store-$preset" \
                --corpus c $mode "${k[@]}" --max-tokens 32 --json \
                "What does the license say about warranty?" 2>>"$out/stderr.log" |
                summary | tee -a "$log" || echo "FAILED (stderr.log says why)" | tee -a "$log"
        done
    done
done
