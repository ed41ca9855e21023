#!/bin/bash
# Usage: sweep.sh TAG "ENV-SETTINGS..." : bucket bench (bf16 and f16) under each setting.
cd "$(dirname "$0")"
tag=$1; shift
for setting in "$@"; do
  for dt in ${DTYPES:-bf16 f16}; do
    flag=""; [ $dt = f16 ] && flag=--f16
    log=$OUT/$tag-sweep-$dt-${setting//[^A-Za-z0-9]/_}.log
    extra=""; case "$setting" in *CONTIG*) extra=--contiguous;; esac
    env $setting ./gpu_bench --buckets-only $flag $extra --only llama,131072,4096 > $log 2>&1
    python3 -c "
import json,sys
for l in open('$log'):
    if l.startswith('{') and 'median_us' in l:
        m=json.loads(l); print('$setting', '$dt', m['impl'], round(m['median_us'],2), round(m['graph_us'],2))
"
  done
done
