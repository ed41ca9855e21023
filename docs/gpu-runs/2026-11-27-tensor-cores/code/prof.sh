#!/bin/bash
# Usage: prof.sh TAG : ncu of one tensor-core attend launch and one scalar one (bf16 bench).
cd "$(dirname "$0")"
tag=$1
ncu --kernel-name attend --launch-skip 10 --launch-count 1 --set full -o $OUT/$tag-tc ./gpu_bench --buckets-only --only llama,131072,4096 --iters 100 > /dev/null 2>&1
ncu --kernel-name attend --launch-skip 40 --launch-count 1 --set full -o $OUT/$tag-scalar ./gpu_bench --buckets-only --only llama,131072,4096 --iters 100 > /dev/null 2>&1
for k in tc scalar; do
  echo "=== $k"
  ncu --import $OUT/$tag-$k.ncu-rep --page details --print-units base 2>&1 | grep -E "Duration|Registers Per|Achieved Occupancy|Theoretical Occupancy|Block Limit|Memory Throughput|DRAM Throughput|Executed Instructions |Issue Slots Busy|Grid Size|No Eligible|Active Warps|L2 Hit|L1/TEX Hit|Warp Cycles Per Issued|Eligible Warps" | head -30
  ncu --import $OUT/$tag-$k.ncu-rep --page raw --print-units base 2>&1 | grep -E "smsp__average_warp_latency_issue_stalled|smsp__pcsamp_warps_issue_stalled_(long_scoreboard|barrier|wait|short_scoreboard|math|mio|lg_throttle|no_instruction|membar|branch|drain|imc|selected|not_selected|dispatch|sleeping|tex) " | head -30
done
