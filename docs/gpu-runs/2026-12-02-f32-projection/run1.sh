#!/usr/bin/env bash
# Gemma 3 270M at 119,645 tokens: this tree's kvdb, decode-bench twice, and the tests.
set -x
rm -rf /tmp/kvdb; mkdir -p /tmp/kvdb && tar -xJf .gpu-bundle/bundle.tar.xz -C /tmp/kvdb
export LD_LIBRARY_PATH=/tmp/kvdb/lib
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $OUT/device.txt
mkdir -p $OUT/tests $OUT/g
(cd /tmp && timeout 120 /tmp/kvdb/bin/test-ops --test-threads 4) > $OUT/tests/test-ops.log 2>&1
(cd /tmp && timeout 120 /tmp/kvdb/bin/test-gpu_model --skip real_shapes --nocapture) > $OUT/tests/test-gpu_model.log 2>&1
(cd /tmp && KVDB_BIN=/tmp/kvdb/bin/kvdb timeout 150 /tmp/kvdb/bin/test-gpu_query) > $OUT/tests/test-gpu_query.log 2>&1
OUT=$OUT/g COPIES_GEMMA=4 COPIES_LLAMA=0 GEMMA_DEVICES=cuda REPEATS=2 bash /tmp/kvdb/gpu-query-bench.sh /tmp/kvdb /tmp/gb > $OUT/g/script.log 2>&1
for b in kvdb kvdb; do
  echo "=== $b"
  /tmp/kvdb/bin/$b decode-bench --device cuda --model /tmp/gb/gemma3-270m.gguf --store /tmp/gb/store-gemma3-270m --corpus c --index ivf256,np8,norope,all --tokens 32 --repeats 3
done > $OUT/g/decode.log 2>&1
tail -n 5 $OUT/tests/*.log
grep -E "full attention|ivf256" $OUT/g/decode.log | grep -v "^kvdb:"
