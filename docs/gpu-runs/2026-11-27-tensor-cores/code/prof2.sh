#!/bin/bash
# Usage: prof2.sh TAG : ncu --set full of one route_buckets launch and one attend launch, with
# the SASS lines where warps were sampled most.
cd "$(dirname "$0")"
tag=$1
ncu --kernel-name regex:"route_buckets|attend" --launch-skip 20 --launch-count 2 --set full --import-source no -o $OUT/$tag ./gpu_bench --buckets-only --only llama,131072,4096 --iters 100 > /dev/null 2>&1
ncu --import $OUT/$tag.ncu-rep --page details --print-units base 2>&1 | grep -E "^  [a-z_]+|Duration|Registers Per|Achieved Occupancy|DRAM Throughput|Executed Instructions  |Issue Slots Busy|No Eligible|Warp Cycles Per Issued" 
ncu --import $OUT/$tag.ncu-rep --page source --csv --print-source sass > $OUT/$tag-sass.csv 2>&1
python3 - "$OUT/$tag-sass.csv" <<'PY'
import csv, sys
rows = list(csv.reader(open(sys.argv[1], errors="replace")))
# Several kernels: each starts with a header row containing "Source".
blocks, cur = [], None
for r in rows:
    if r and "Source" in r and ("Address" in r or "# Address" in r):
        cur = {"h": r, "rows": []}; blocks.append(cur); continue
    if cur is not None and len(r) == len(cur["h"]): cur["rows"].append(r)
for b in blocks:
    h = b["h"]
    try:
        si = h.index("Source")
        wi = next(i for i, x in enumerate(h) if x.startswith("Warp Stall Sampling (All"))
    except StopIteration:
        print("columns:", h[:12]); continue
    tot = sum(float(r[wi] or 0) for r in b["rows"])
    print("=== kernel, samples", tot, "instructions", len(b["rows"]))
    top = sorted(b["rows"], key=lambda r: -float(r[wi] or 0))[:25]
    for r in top: print(f"{float(r[wi] or 0)/max(tot,1)*100:5.1f}%  {r[0]:>6} {r[si][:90]}")
PY
