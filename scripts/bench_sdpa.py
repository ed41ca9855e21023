#!/usr/bin/env python3
"""PyTorch's full-attention decode step, the baseline of kvdb-kernels' GPU benchmark.

One query token attends to N cached tokens through torch.nn.functional.scaled_dot_product_attention
with the flash backend forced (sdpa_kernel(FLASH_ATTENTION)) and with the cuDNN backend, for
the shapes and lengths the Rust bench (kernels/examples/gpu_bench.rs) runs, in bf16. Timing as
there: CUDA events around each call, the median of >= 100 timed calls after a warm-up, K/V
rotated over copies whose total exceeds 200 MB so that L2 (50 MB) holds none of them between
calls. Writes one JSON object per line (to --out, and a summary to stdout); the Rust bench
reads the file and puts the ratios in its table.

Usage: python3 scripts/bench_sdpa.py --out sdpa.jsonl [--quick]
"""

import argparse
import json
import math
import statistics

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

SHAPES = {"llama": (32, 8, 128), "gemma": (4, 1, 256)}  # query heads, KV heads, head dim
LENGTHS = [32 * 1024, 128 * 1024, 512 * 1024, 1024 * 1024]
BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}
ROTATE_BYTES = 200e6


def median_us(fn, iters, warmup=10):
    """Median and mean in microseconds of `fn(i)` over `iters` calls, each between events."""
    for i in range(warmup):
        fn(i)
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    for i in range(iters):
        starts[i].record()
        fn(i)
        ends[i].record()
    torch.cuda.synchronize()
    times = [s.elapsed_time(e) * 1e3 for s, e in zip(starts, ends)]
    return statistics.median(times), statistics.fmean(times)


def copy_bandwidth():
    """Device-to-device copy of 1 GiB, bytes read plus written over time, in GB/s."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    med, _ = median_us(lambda i: dst.copy_(src), 20, warmup=3)
    return 2 * src.numel() / (med * 1e-6) / 1e9


def run(shape, n, backend, iters, dtype=torch.bfloat16):
    hq, hkv, d = SHAPES[shape]
    kv_bytes = 2 * hkv * n * d * 2
    copies = max(1, math.ceil(ROTATE_BYTES / kv_bytes))
    gen = torch.Generator(device="cuda").manual_seed(n)
    ks = [torch.rand(1, hkv, n, d, device="cuda", dtype=dtype, generator=gen) * 2 - 1 for _ in range(copies)]
    vs = [torch.rand(1, hkv, n, d, device="cuda", dtype=dtype, generator=gen) * 2 - 1 for _ in range(copies)]
    qs = [torch.rand(1, hq, 1, d, device="cuda", dtype=dtype, generator=gen) * 2 - 1 for _ in range(64)]
    result = {"impl": f"sdpa_{backend}", "shape": shape, "n": n, "copies": copies}
    with sdpa_kernel(BACKENDS[backend]):
        # enable_gqa lets the backend read each KV head once for its query group; where the
        # backend refuses it, K/V are expanded to the query heads (more bytes read: noted).
        for mode in ("gqa", "expanded"):
            if mode == "expanded":
                ks = [k.repeat_interleave(hq // hkv, dim=1) for k in ks]
                vs = [v.repeat_interleave(hq // hkv, dim=1) for v in vs]
            gqa = mode == "gqa" and hq != hkv

            def step(i):
                return F.scaled_dot_product_attention(qs[i % len(qs)], ks[i % copies], vs[i % copies], enable_gqa=gqa)

            try:
                step(0)
                torch.cuda.synchronize()
            except RuntimeError as e:
                result.setdefault("errors", []).append(f"{mode}: {str(e).splitlines()[0][:200]}")
                continue
            med, mean = median_us(step, iters)
            result.update(mode=mode, median_us=med, mean_us=mean)
            break
    del ks, vs, qs
    torch.cuda.empty_cache()
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--quick", action="store_true", help="one length per shape")
    args = parser.parse_args()
    lengths = LENGTHS[:1] if args.quick else LENGTHS
    props = torch.cuda.get_device_properties(0)
    rows = [{"impl": "device", "name": props.name, "torch": torch.__version__,
             "cudnn": torch.backends.cudnn.version(), "copy_gbps": copy_bandwidth()}]
    print(json.dumps(rows[0]), flush=True)
    for shape in SHAPES:
        for n in lengths:
            for backend in BACKENDS:
                rows.append(run(shape, n, backend, args.iters))
                print(json.dumps(rows[-1]), flush=True)
    with open(args.out, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
