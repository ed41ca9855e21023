#!/usr/bin/env bash
# Llama-3-8B shape at 131,231 tokens: this tree's kvdb, decode-bench twice.
set -x
rm -rf /tmp/kvdb; mkdir -p /tmp/kvdb && tar -xJf .gpu-bundle/bundle.tar.xz -C /tmp/kvdb
export LD_LIBRARY_PATH=/tmp/kvdb/lib
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $OUT/device.txt
mkdir -p $OUT/l
OUT=$OUT/l COPIES_GEMMA=0 COPIES_LLAMA=4 PART_BYTES=13700 IVF_LLAMA=ivf256,np8,norope,all REPEATS=2 STORE_DIR=/dev/shm/lb bash /tmp/kvdb/gpu-query-bench.sh /tmp/kvdb /tmp/lb > $OUT/l/script.log 2>&1
for b in kvdb kvdb; do
  echo "=== $b"
  /tmp/kvdb/bin/$b decode-bench --device cuda --model /tmp/lb/llama3-8b.gguf --store /dev/shm/lb/store-llama3-8b --corpus c --index ivf256,np8,norope,all --tokens 32 --repeats 3 --question "What does the license say about warranty?"
done > $OUT/l/decode.log 2>&1
grep -E "full attention|ivf256" $OUT/l/decode.log | grep -v "^kvdb:"
