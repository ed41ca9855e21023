#!/usr/bin/env bash
# The GPU tests this change touches: routing with an always-visited list, the refusals,
# route-and-attend and the bucket attention (test-gpu), the GPU ingest's query sample
# against the CPU's (test-gpu_model, test-gpu_ingest), and `ivf16,np4,hot50,norope,all`
# answered on the GPU as on the CPU, followed, from host memory (test-gpu_query).
set -x
rm -rf /tmp/kvdb; mkdir -p /tmp/kvdb && tar -xJf .gpu-bundle/bundle.tar.xz -C /tmp/kvdb
export LD_LIBRARY_PATH=/tmp/kvdb/lib
B=/tmp/kvdb/bin
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $OUT/device.txt
mkdir -p $OUT/tests
(cd /tmp && timeout 300 $B/test-gpu --test-threads 1 --nocapture routing_matches_reference \
    route_and_attend bad_arguments bucket_attention_matches_reference) > $OUT/tests/test-gpu.log 2>&1 &
(cd /tmp && timeout 150 $B/test-gpu_model --nocapture stored) > $OUT/tests/test-gpu_model.log 2>&1
(cd /tmp && KVDB_BIN=$B/kvdb timeout 200 $B/test-gpu_ingest --nocapture) > $OUT/tests/test-gpu_ingest.log 2>&1
(cd /tmp && KVDB_BIN=$B/kvdb timeout 200 $B/test-gpu_query --nocapture) > $OUT/tests/test-gpu_query.log 2>&1
wait
grep -h "^test \|test result" $OUT/tests/*.log
