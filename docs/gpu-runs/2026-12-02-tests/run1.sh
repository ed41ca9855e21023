#!/usr/bin/env bash
# Every GPU test binary on this tree's build (one call).
set -x
rm -rf /tmp/kvdb; mkdir -p /tmp/kvdb && tar -xJf .gpu-bundle/bundle.tar.xz -C /tmp/kvdb
export LD_LIBRARY_PATH=/tmp/kvdb/lib
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $OUT/device.txt
mkdir -p $OUT/tests
(cd /tmp && timeout 60 /tmp/kvdb/bin/test-ops --test-threads 4) > $OUT/tests/test-ops.log 2>&1
(cd /tmp && timeout 90 /tmp/kvdb/bin/test-gpu_model --skip real_shapes --nocapture) > $OUT/tests/test-gpu_model.log 2>&1
(cd /tmp && KVDB_BIN=/tmp/kvdb/bin/kvdb timeout 120 /tmp/kvdb/bin/test-gpu_query) > $OUT/tests/test-gpu_query.log 2>&1
(cd /tmp && timeout 300 /tmp/kvdb/bin/test-gpu --test-threads 1 --nocapture) > $OUT/tests/test-gpu.log 2>&1 &
(cd /tmp && timeout 200 /tmp/kvdb/bin/test-prefill --nocapture) > $OUT/tests/test-prefill.log 2>&1
wait
grep -h "test result" $OUT/tests/*.log
tail -n 3 $OUT/tests/*.log
