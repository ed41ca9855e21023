#!/usr/bin/env bash
# The default model on a GPU machine, CPU against GPU in one command: joins the model's
# pieces (the device tool carries 64 MiB a call, so the GGUF arrives as `split -b` pieces
# named part-*), checks its sha256, generates 32 greedy tokens on the CPU (`--weights exact`)
# and on the GPU for a short and a 1,938-token prompt and compares them, then plants a needle
# in the GPL, ingests it on the GPU and asks for it through the corpus's index and with full
# attention, and runs the retrieval tests (kvdb/tests/retrieval.rs: every token selected
# against full attention, needles at five depths, every index at its default spec, saap) with
# `KVDB_TEST_DEVICE=cuda`, ingest and questions on the GPU, into test-retrieval.log (about 3
# minutes on an H200 before the saap test also asked a CPU-ingested corpus, not timed since; TEST_TIMEOUT, default 400 s, bounds it; they read the GPL from the
# repository's path at build time, which the device's copy of the tree has). The log goes to
# $OUT/default-model.log (or ./gpu-default-model/).
#
# Usage (on the GPU machine, from the unpacked bundle of scripts/gpu-bundle.sh):
#   scripts/gpu-default-model.sh BUNDLE_DIR PIECES_DIR
set -uo pipefail
bundle=${1:?usage: gpu-default-model.sh BUNDLE_DIR PIECES_DIR}
pieces=${2:?usage: gpu-default-model.sh BUNDLE_DIR PIECES_DIR}
out=${OUT:-gpu-default-model}
work=$(mktemp -d)
mkdir -p "$out"
log=$out/default-model.log
export LD_LIBRARY_PATH=$bundle/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH} KVDB_HOME=$work/home
kvdb=$bundle/bin/kvdb
model=$work/gemma-3-270m.gguf
cat "$pieces"/part-* >"$model"
sum=$(sha256sum "$model" | cut -c1-64)
echo "sha256 $sum" | tee "$log"
[ "$sum" = a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818 ] ||
    { echo "not the default model" | tee -a "$log"; exit 1; }

license=/usr/share/common-licenses/GPL-3
short="The GNU General Public License is a free, copyleft license for software and other kinds of works."
long="$(head -c 9000 "$license")"
for device in cpu cuda; do
    weights=()
    [ $device = cpu ] && weights=(--weights exact)
    for prompt in short long; do
        "$kvdb" generate --model "$model" --device $device "${weights[@]}" --max-tokens 32 \
            --prompt "${!prompt}" >"$work/$prompt-$device.txt" 2>>"$log"
    done
done
for prompt in short long; do
    if cmp -s "$work/$prompt-cpu.txt" "$work/$prompt-cuda.txt"; then
        echo "$prompt prompt: CPU and GPU greedy tokens identical"
    else
        echo "$prompt prompt: CPU and GPU greedy tokens DIFFER"
    fi
done | tee -a "$log"
for f in "$work"/*.txt; do
    echo "== $(basename "$f")"
    cat "$f"
    echo
done >>"$log"

mkdir -p "$work/needle"
{
    head -c 20000 "$license"
    printf '\nThe secret number of the archive is 8046215.\n\n'
    tail -c +20001 "$license"
} >"$work/needle/gpl.txt"
"$kvdb" ingest --model "$model" --store "$work/store" --corpus gpl --device cuda \
    --progress none "$work/needle/gpl.txt" 2>&1 | tail -3 | tee -a "$log"
for how in "" --full-attention; do
    answer=$("$kvdb" ask --model "$model" --store "$work/store" --corpus gpl $how --max-tokens 8 \
        'What is the secret number of the archive? The secret number of the archive is' 2>>"$log")
    echo "ask ${how:-(index)}: $answer" | tee -a "$log"
done
mkdir -p "$KVDB_HOME/models"
ln -sf "$model" "$KVDB_HOME/models/gemma-3-270m-q4_k_m.gguf"
KVDB_TEST_DEVICE=cuda timeout "${TEST_TIMEOUT:-400}" "$bundle/bin/test-retrieval" --nocapture \
    >"$out/test-retrieval.log" 2>&1
echo "retrieval tests on the GPU: exit $? ($(grep -h "^test result" "$out/test-retrieval.log"))" |
    tee -a "$log"
rm -rf "$work"
