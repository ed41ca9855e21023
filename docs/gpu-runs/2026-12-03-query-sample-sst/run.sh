#!/usr/bin/env bash
# Second call: the Llama-3-8B shape ingest of ../2026-12-03-query-sample/run2.sh (3 copies of the GPL, 89,734
# tokens, store on a tmpfs) for the builds ORDER names in turn: new (this tree), wal
# (8423322), 3fa (no sample). Usage: ORDER="new wal 3fa new wal 3fa".
set -x
rm -rf /tmp/kvdb; mkdir -p /tmp/kvdb && tar -xJf .gpu-bundle/bundle.tar.xz -C /tmp/kvdb
export LD_LIBRARY_PATH=/tmp/kvdb/lib
B=/tmp/kvdb/bin
mkdir -p $OUT/ingest
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
done | tee -a $OUT/ingest/summary.txt
