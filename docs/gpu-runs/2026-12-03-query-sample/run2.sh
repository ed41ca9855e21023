#!/usr/bin/env bash
# The kernel tests again (bad_lengths_are_errors fixed: its accepted query-sample launch now
# writes rotated queries of its own), then the Llama-3-8B shape ingest of run.sh again with
# the store on a tmpfs (/dev/shm), so that the disk's share of the ingest does not hide the
# GPU's: ORDER names the builds in turn (new: this one; 3fa: no query sample on the GPU;
# eaa: every query row of every layer kept on the GPU). Usage: ORDER="new 3fa eaa" TESTS=1.
set -x
if [ ! -d /tmp/kvdb/bin ]; then
    rm -rf /tmp/kvdb; mkdir -p /tmp/kvdb && tar -xJf .gpu-bundle/bundle.tar.xz -C /tmp/kvdb
fi
export LD_LIBRARY_PATH=/tmp/kvdb/lib
B=/tmp/kvdb/bin
mkdir -p $OUT/ingest
if [ -n "${TESTS:-}" ]; then
    (cd /tmp && timeout 100 $B/test-ops --nocapture attention_inputs bad_lengths_are_errors) > $OUT/test-ops.log 2>&1
    grep -h "^test \|test result" $OUT/test-ops.log
fi
W=/tmp/qs; mkdir -p $W/docs
[ -f $W/llama.gguf ] || $B/random_model --preset llama3-8b --dtype bf16 --context 262144 --out $W/llama.gguf 2>&1 | tail -1
for i in 1 2 3; do { echo "Copy $i of the license."; cat /usr/share/common-licenses/GPL-3; } > $W/docs/copy-$i.txt; done
for name in $ORDER; do
    case $name in new) bin=$B/kvdb ;; *) bin=/tmp/old/kvdb-$name ;; esac
    nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 100 > /tmp/$name.gpu-mib &
    smi=$!
    timeout 150 $bin ingest --device cuda --model $W/llama.gguf --store /dev/shm/store-$name --corpus c $W/docs > /tmp/$name.log 2>&1
    rc=$?
    kill $smi
    echo "$name rc $rc: GPU memory peak $(sort -n /tmp/$name.gpu-mib | tail -1) MiB; $(grep -o 'added.*' /tmp/$name.log)"
    rm -rf /dev/shm/store-$name
done | tee -a $OUT/ingest/summary-$(echo $ORDER | tr ' ' -).txt
