#!/bin/bash
# Usage: run.sh TAG [tests|bench|both]
set -o pipefail
tag=$1; what=${2:-both}
cd "$(dirname "$0")"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader | tee $OUT/$tag-device.txt
if [ "$what" != tests ]; then
  ./gpu_bench --buckets-only --only llama,131072,4096 2>&1 | tee $OUT/$tag-buckets-bf16.log | cut -c1-400
  ./gpu_bench --buckets-only --f16 --only llama,131072,4096 2>&1 | tee $OUT/$tag-buckets-f16.log | cut -c1-400
fi
if [ "$what" != bench ]; then
  timeout ${TEST_TIMEOUT:-420} ./test-gpu --test-threads 1 --nocapture ${TESTS:-} > $OUT/$tag-test-gpu.log 2>&1; echo "tests rc $?"
  grep -E "test result|FAILED|panicked|^Error|failures" $OUT/$tag-test-gpu.log | head -20
  echo "worst tensor cores == scalar:"; grep -E "tensor cores == scalar" $OUT/$tag-test-gpu.log | awk '{print $NF}' | sort -g | tail -2
  echo "worst TC vs reference:"; grep -E "tensor cores (true|)" $OUT/$tag-test-gpu.log | grep -v "== scalar\|false" | awk '{print $NF}' | sort -g | tail -2
  echo "worst all-tokens==flash:"; grep "== flash_decode" $OUT/$tag-test-gpu.log | awk '{print $NF}' | sort -g | tail -2
fi
