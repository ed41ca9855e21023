#!/usr/bin/env bash
# Questions on the GPU end to end: writes random-weight GGUFs with real shapes (Gemma 3 270M;
# Llama-3-8B; Qwen2.5-7B-Instruct-1M), ingests copies of the GPL on the GPU with a flat index
# (and an IVF one), and runs `kvdb decode-bench` on each (full attention, flat top-k, ivf) on
# the GPU, and for Gemma on the CPU too: one process per device, the model loaded and the
# corpus uploaded once, printing time to the first token and ms per token against full
# attention's, and how long the load and upload took. Logs go to $OUT (or ./gpu-query-bench).
#
# Usage (on the GPU machine, from the unpacked bundle of scripts/gpu-bundle.sh):
#   scripts/gpu-query-bench.sh /tmp/kvdb [WORK_DIR]
# COPIES_GEMMA / COPIES_LLAMA / COPIES_QWEN set how many copies of the text each corpus holds
# (0: skip; Qwen is skipped unless asked), PART_BYTES the bytes of the text's start that one
# more, partial copy holds (to reach a length between whole copies: a copy is about 29,900
# tokens, so 4 copies and PART_BYTES=13700 make about 131,072); IVF_GEMMA the IVF spec of Gemma's corpus
# (default: ivf's default spec); IVF_LLAMA / IVF_QWEN an IVF spec for those models too
# (its build takes minutes: 32 layers x 8 KV heads for Llama; with it, the model skips flat
# top-k, whose search on the CPU takes a fifth of a second a token there, and its index); K the
# keys flat top-k retrieves (default: 1% of the corpus); FOLLOW a number of most attended
# tokens to follow in one more mode per index (decode-bench's `--follow`); GEMMA_DEVICES the devices Gemma is asked
# on (default "cuda cpu"); REPEATS the measured answers per mode (default 2, after a warm-up);
# WRAP a command that runs decode-bench (e.g. a profiler's); CONTEXT the context length the
# random models declare (default 262,144: raise it for longer corpora); CONCURRENT numbers of
# questions to answer together besides (e.g. 1,4,16: decode-bench's `--concurrent`); SERVE a
# number of questions sent at once to `kvdb serve --device cuda` on each GPU corpus afterwards
# (each answer, the time they took and the server's count of batched questions go to serve.log);
# DROP_CACHES=1 drops the OS's page cache before each decode-bench (as root), so that opening
# the corpus reads the store from disk, as a first question after a restart would. GPU_KV
# placements to run decode-bench under again on the GPU, separated by spaces (e.g. `host`,
# `host:16G`, `host:0`: the corpus's keys and values in pinned host memory, read in place or
# behind block caches (a selection searched on the CPU) or a routed question's bucket caches;
# full attention is skipped there, so its rows compare with the resident run before them).
# STORE_DIR the folder the stores go in instead of WORK_DIR (e.g. a tmpfs
# for a store larger than the disk left beside the model: the Qwen shape at 1M tokens is
# 57 GB; the model stays in WORK_DIR). INGEST_TIMEOUT cuts an ingest after that many seconds
# (it commits as it goes) and exits with status 75: running the script again with the same
# WORK_DIR (and STORE_DIR) on the same machine resumes the ingest and goes on, so that an
# ingest longer than one device call (the Qwen shape at 1M tokens: more than 10 minutes on an
# H200) spans consecutive calls. MEM_SAMPLE=N writes the host's memory (`free -m`: used,
# cache, available, MiB) every N seconds to mem.log while the script runs: a corpus kept in
# pinned host memory beside a store on a tmpfs fills most of it (119 of 125 GB for the Qwen
# shape at 1M tokens). GPU_MEMORY_MIB=N runs the GPU_KV placements on a GPU of N MiB: another
# process (PyTorch, which the device has) holds the rest of the GPU's memory meanwhile, so that
# `auto` places the corpus as it would on the smaller GPU (81559, an 80 GB H100's, on an H200:
# the Llama-3-8B shape at 512K, docs/benchmarks.md), the resident run before them keeping the
# whole GPU for its baseline.
set -euo pipefail
bundle=${1:?usage: gpu-query-bench.sh BUNDLE_DIR [WORK_DIR]}
work=${2:-$(mktemp -d)}
out=${OUT:-gpu-query-bench}
mkdir -p "$out" "$work"
# Background processes ended with the script, however it ends (a sampler or a holder of GPU
# memory left running would keep the caller waiting, or hold the GPU).
helpers=()
trap 'status=$?; kill "${helpers[@]}" 2>/dev/null || true; exit "$status"' EXIT
if [ -n "${MEM_SAMPLE:-}" ]; then
    while kill -0 $$ 2>/dev/null; do
        free -m | awk -v t="$(date +%T)" '/^Mem/ {print t, $3, $6, $7}'
        sleep "$MEM_SAMPLE"
    done >>"$out/mem.log" 2>&1 &
    helpers+=($!)
fi
export LD_LIBRARY_PATH=$bundle/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
kvdb=$bundle/bin/kvdb

# hold_gpu MIB: another process takes all of the GPU's memory but MIB (nothing when the GPU
# has no more) until release_gpu; returns once it holds it.
hold_gpu() {
    local total take held=$work/gpu-held
    total=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
    take=$((total - $1))
    [ "$take" -gt 0 ] || return 0
    rm -f "$held"
    python3 -c "import time, torch
x = torch.empty($take << 20, dtype=torch.uint8, device='cuda')
open('$held', 'w').close()
time.sleep(86400)" &
    holder=$!
    helpers+=("$holder")
    until [ -e "$held" ]; do
        if ! kill -0 "$holder" 2>/dev/null; then
            echo "could not hold $take MiB of the GPU's $total" | tee -a "$log"
            exit 1
        fi
        sleep 1
    done
    echo "the GPU limited to $1 MiB: another process holds $take of its $total MiB" \
        "(used, free: $(nvidia-smi --query-gpu=memory.used,memory.free --format=csv,noheader | head -1))" |
        tee -a "$log"
}
release_gpu() {
    [ -z "${holder:-}" ] || { kill "$holder" 2>/dev/null; wait "$holder" 2>/dev/null || true; }
    holder=
}

# serve_questions PRESET MODEL STORE N INDEX: N greedy questions at once to a GPU server on
# STORE (its default batching), each answer and the batched count logged to serve.log.
serve_questions() {
    local preset=$1 model=$2 store=$3 n=$4 index=$5 addr=127.0.0.1:18080 slog=$out/serve.log
    echo "# $preset: $n questions at once to kvdb serve --device cuda (index $index)" >>"$slog"
    # The server runs the models of its folder: this one, linked there.
    mkdir -p "$work/home/models"
    ln -sf "$model" "$work/home/models/"
    KVDB_HOME=$work/home "$kvdb" serve --device cuda --store "$store" --addr "$addr" \
        >>"$out/serve-stderr.log" 2>&1 &
    local server=$! i
    for i in $(seq 120); do curl -sf "http://$addr/health" >/dev/null && break; sleep 1; done
    local s=$(date +%s.%N)
    for i in $(seq "$n"); do
        curl -s "http://$addr/v1/corpora/c/query" -H 'content-type: application/json' \
            -d "{\"question\": \"Question $i: what does the license say about warranty?\", \"index\": \"$index\", \"max_tokens\": 32}" \
            >"$out/serve-answer-$preset-$i.json" &
    done
    wait $(jobs -p | grep -v "^$server\$") 2>/dev/null || true
    echo "$n answers in $(awk "BEGIN{print $(date +%s.%N) - $s}") s (the first query uploads the corpus)" >>"$slog"
    for i in $(seq "$n"); do head -c 300 "$out/serve-answer-$preset-$i.json" >>"$slog"; echo >>"$slog"; done
    curl -s "http://$addr/metrics" | grep -E "^kvdb_queries_batched_total|^kvdb_queries_total" >>"$slog" || true
    kill "$server"; wait "$server" 2>/dev/null || true
    tee -a "$log" <"$slog" >/dev/null
}
text=${TEXT:-/usr/share/common-licenses/GPL-3}
log=$out/query.log
echo "# $(date -u +%FT%TZ) $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)" | tee "$log"
for spec in "gemma3-270m:${COPIES_GEMMA:-4}:${IVF_GEMMA:-ivf256,np8,hot8,norope,all}" "llama3-8b:${COPIES_LLAMA:-1}:${IVF_LLAMA:-none}" \
    "qwen2.5-7b-1m:${COPIES_QWEN:-0}:${IVF_QWEN:-none}"; do
    IFS=: read -r preset copies ivf <<<"$spec"
    [ "$copies" -gt 0 ] || continue
    model=$work/$preset.gguf
    store=${STORE_DIR:-$work}/store-$preset
    [ -f "$model" ] || "$bundle/bin/random_model" --preset "$preset" --dtype bf16 \
        --context "${CONTEXT:-262144}" --out "$model" 2>&1 | tail -1
    # A store left by an earlier run on this machine is asked again as it is, unless that
    # run's ingest was cut (INGEST_TIMEOUT; `$store.cut` marks it): this run resumes it.
    if [ ! -d "$store" ] || [ -e "$store.cut" ]; then
        mkdir -p "$work/docs-$preset"
        for i in $(seq "$copies"); do
            { echo "Copy $i of the license."; cat "$text"; } >"$work/docs-$preset/copy-$i.txt"
        done
        if [ "${PART_BYTES:-0}" -gt 0 ]; then
            { echo "Part of the license."; head -c "$PART_BYTES" "$text"; } >"$work/docs-$preset/part.txt"
        fi
        # The IVF index first: the corpus's default, which opening the corpus loads.
        indexes=()
        [ "$ivf" = none ] || indexes+=(--index "$ivf")
        [ "$preset" = gemma3-270m ] || [ "$ivf" = none ] && indexes+=(--index flat)
        s=$(date +%s) status=0
        mkdir -p "${STORE_DIR:-$work}"
        touch "$store.cut"
        # Its progress events, each stamped with the seconds since the ingest began, go to
        # the ingest's log (a resumed ingest first loads the stored layers: `loaded`).
        timeout "${INGEST_TIMEOUT:-0}" "$kvdb" ingest --device cuda --model "$model" --store "$store" \
            --corpus c --progress json "${indexes[@]}" "$work/docs-$preset" 2>&1 |
            while IFS= read -r line; do echo "[$(($(date +%s) - s)) s] $line"; done |
            tee -a "$out/ingest-$preset.log" | tail -1 | tee -a "$log" || status=$?
        if [ "$status" -eq 124 ]; then
            echo "$preset: ingest cut after $INGEST_TIMEOUT s; run this again on this machine to resume it" |
                tee -a "$log"
            exit 75
        fi
        [ "$status" -eq 0 ] || exit "$status"
        rm "$store.cut"
        echo "$preset: ingest and index build $(($(date +%s) - s)) s" | tee -a "$log"
    fi
    devices=cuda
    [ "$preset" = gemma3-270m ] && devices=${GEMMA_DEVICES:-cuda cpu}
    # Flat top-k searches on the CPU: a fifth of a second a token for Llama at 120K tokens.
    modes=(--index flat)
    [ "$preset" != gemma3-270m ] && [ "$ivf" != none ] && modes=()
    [ "$ivf" = none ] || modes+=(--index "$ivf")
    for device in $devices; do
        echo "$preset on $device:" | tee -a "$log"
        if [ -n "${DROP_CACHES:-}" ]; then
            sync
            if echo 3 2>/dev/null >/proc/sys/vm/drop_caches; then
                echo "$preset: page cache dropped (the store is read from disk)" | tee -a "$log"
            else
                echo "$preset: could not drop the page cache (not root)" | tee -a "$log"
            fi
        fi
        ${WRAP:-} "$kvdb" decode-bench --device "$device" --model "$model" --store "$store" \
            --corpus c "${modes[@]}" ${K:+--k "$K"} ${FOLLOW:+--follow "$FOLLOW"} --tokens 32 --repeats "${REPEATS:-2}" ${CONCURRENT:+--concurrent "$CONCURRENT"} \
            --question "What does the license say about warranty?" \
            --json "$out/decode-$preset-$device.json" 2>>"$out/stderr.log" | tee -a "$log" ||
            echo "FAILED (stderr.log says why)" | tee -a "$log"
        { grep "^kvdb: \(loaded\|opened\)" "$out/stderr.log" || true; } | tail -n 2 | tee -a "$log"
        [ "$device" = cuda ] || continue
        [ -z "${GPU_KV:-}" ] || [ -z "${GPU_MEMORY_MIB:-}" ] || hold_gpu "$GPU_MEMORY_MIB"
        for placement in ${GPU_KV:-}; do
            echo "$preset on $device, --gpu-kv $placement:" | tee -a "$log"
            "$kvdb" decode-bench --device cuda --gpu-kv "$placement" --model "$model" \
                --store "$store" --corpus c "${modes[@]}" ${K:+--k "$K"} ${FOLLOW:+--follow "$FOLLOW"} --tokens 32 \
                --repeats "${REPEATS:-2}" --question "What does the license say about warranty?" \
                --json "$out/decode-$preset-$device-gpu-kv-${placement//:/-}.json" 2>>"$out/stderr.log" |
                tee -a "$log" || echo "FAILED (stderr.log says why)" | tee -a "$log"
            { grep "^kvdb: \(loaded\|opened\)" "$out/stderr.log" || true; } | tail -n 2 | tee -a "$log"
        done
        release_gpu
    done
    if [ -n "${SERVE:-}" ]; then
        serve_questions "$preset" "$model" "$store" "$SERVE" "${modes[-1]}"
    fi
done
