#!/usr/bin/env python3
"""PyTorch's prefill attention, the baseline of kvdb-kernels' prefill benchmark.

The configurations of kernels/examples/prefill_bench.rs, in bf16:
- prefill: a whole sequence, torch.nn.functional.scaled_dot_product_attention with the flash
  backend forced (sdpa_kernel(FLASH_ATTENTION)), is_causal=True;
- chunked: chunks of 4096 queries over the prefix up to their end, the flash backend with a
  lower-right causal mask (torch.nn.attention.bias.causal_lower_right), one timed call being
  the whole sequence;
- decode: one query over the last keys (no mask needed);
- sliding windows (-w512): SDPA has no window argument and its flash backend takes no mask,
  so these run FlexAttention (torch.compile'd flex_attention with a sliding-window block
  mask), only with --flex (compiling takes a while): "impl" says which ran.
GQA: enable_gqa=True where the backend takes it, else K/V expanded to the query heads
(recorded in "impl"). Timing as in the Rust bench: CUDA events around each call, one
warm-up, the median of 3 to 30 calls (about half a second). Writes one JSON object per line
to --out (flushed per line); prefill_bench --sdpa FILE puts the ratios in its table.

Usage: python3 scripts/bench_prefill_sdpa.py --out sdpa.jsonl [--quick] [--flex]
"""

import argparse
import json
import statistics

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

SHAPES = {"llama": (32, 8, 128), "gemma": (4, 1, 256)}  # query heads, KV heads, head dim
LENGTHS = [4096, 32768, 131072]
CHUNK = 4096
WINDOW = 512


def median_ms(fn):
    """Median milliseconds of fn() between two events, after one warm-up call."""

    def once():
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)

    first = once()
    reps = min(30, max(3, int(500.0 / max(first, 1e-3))))
    times = [once() for _ in range(reps)]
    return statistics.median(times), reps


def flops(shape, n, window, first):
    hq, _, d = SHAPES[shape]
    pairs = sum(min(p + 1, window) if window else p + 1 for p in range(first, n))
    return 4.0 * hq * d * pairs


def tensors(shape, n, n_q):
    hq, hkv, d = SHAPES[shape]
    gen = torch.Generator(device="cuda").manual_seed(n)

    def rand(*size):
        return torch.rand(*size, device="cuda", dtype=torch.bfloat16, generator=gen) * 2 - 1

    return rand(1, hq, n_q, d), rand(1, hkv, n, d), rand(1, hkv, n, d)


def with_gqa(call, q, k, v):
    """call(q, k, v, gqa) with native GQA, else with K/V expanded; (fn, how)."""
    group = q.shape[1] // k.shape[1]
    try:
        call(q, k, v, group > 1)
        torch.cuda.synchronize()
        return (lambda: call(q, k, v, group > 1)), "gqa"
    except Exception as e:  # noqa: BLE001 (a backend refusing GQA raises several kinds)
        first_error = str(e).splitlines()[0][:160]
    ke, ve = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    call(q, ke, ve, False)
    torch.cuda.synchronize()
    return (lambda: call(q, ke, ve, False)), f"expanded KV (gqa: {first_error})"


def sdpa(q, k, v, gqa, **kw):
    return F.scaled_dot_product_attention(q, k, v, enable_gqa=gqa, **kw)


def run_sdpa(shape, n, mode):
    """One configuration through SDPA's flash backend."""
    from torch.nn.attention.bias import causal_lower_right

    decode = mode.startswith("decode")
    # A decode step attends to the last keys: all n, or the window's.
    window = int(mode.split("-w")[1]) if "-w" in mode else None
    first = n - 1 if decode else 0
    q, k, v = tensors(shape, min(n, window or n), n - first)
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        if mode == "prefill":
            fn, how = with_gqa(lambda q, k, v, g: sdpa(q, k, v, g, is_causal=True), q, k, v)
        elif decode:
            fn, how = with_gqa(lambda q, k, v, g: sdpa(q, k, v, g), q, k, v)
        else:
            masks = {}

            def chunked(q, k, v, g):
                for start in range(0, n, CHUNK):
                    end = min(start + CHUNK, n)
                    if end - start not in masks:
                        masks[end - start] = {}
                    mask = masks[end - start].setdefault(end, causal_lower_right(end - start, end))
                    sdpa(q[:, :, start:end], k[:, :, :end], v[:, :, :end], g, attn_mask=mask)

            fn, how = with_gqa(chunked, q, k, v)
        ms, reps = median_ms(fn)
    return {"impl": f"sdpa_flash ({how})", "shape": shape, "n": n, "mode": mode, "ms": ms,
            "reps": reps, "tflops": flops(shape, n, window, first) / (ms * 1e-3) / 1e12}


def run_flex(shape, n, mode, window):
    """A sliding-window configuration through compiled FlexAttention."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    flex = torch.compile(flex_attention, dynamic=False)
    q, k, v = tensors(shape, n, n)

    def sliding(b, h, qi, ki):
        return (qi >= ki) & (qi - ki < window)

    def shifted(b, h, qi, ki):
        # Keys start window - 1 positions before the chunk's first query.
        return (ki >= qi) & (ki <= qi + window - 1)

    if mode.startswith("prefill"):
        bm = create_block_mask(sliding, None, None, n, n, device="cuda")
        fn = lambda: flex(q, k, v, block_mask=bm, enable_gqa=True)  # noqa: E731
    else:
        first = create_block_mask(sliding, None, None, CHUNK, CHUNK, device="cuda")
        later = create_block_mask(shifted, None, None, CHUNK, CHUNK + window - 1, device="cuda")

        def fn():
            for start in range(0, n, CHUNK):
                end = min(start + CHUNK, n)
                if start == 0:
                    flex(q[:, :, :end], k[:, :, :end], v[:, :, :end], block_mask=first, enable_gqa=True)
                else:
                    lo = start - (window - 1)
                    flex(q[:, :, start:end], k[:, :, lo:end], v[:, :, lo:end], block_mask=later,
                         enable_gqa=True)

    fn()
    torch.cuda.synchronize()
    ms, reps = median_ms(fn)
    return {"impl": "flex_attention (sliding-window block mask)", "shape": shape, "n": n,
            "mode": mode, "ms": ms, "reps": reps,
            "tflops": flops(shape, n, window, 0) / (ms * 1e-3) / 1e12}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--quick", action="store_true", help="4K and 32K only")
    parser.add_argument("--flex", action="store_true", help="only the sliding windows, by FlexAttention")
    args = parser.parse_args()
    lengths = LENGTHS[:2] if args.quick else LENGTHS
    jobs = []
    if args.flex:
        for n in lengths:
            jobs.append(lambda n=n: run_flex("gemma", n, f"prefill-w{WINDOW}", WINDOW))
        for n in lengths[1:]:
            jobs.append(lambda n=n: run_flex("gemma", n, f"chunked-w{WINDOW}", WINDOW))
    else:
        for shape in SHAPES:
            for n in lengths:
                jobs.append(lambda shape=shape, n=n: run_sdpa(shape, n, "prefill"))
            for n in lengths[1:]:
                jobs.append(lambda shape=shape, n=n: run_sdpa(shape, n, "chunked"))
        jobs.append(lambda: run_sdpa("llama", 1024, "decode"))
        jobs.append(lambda: run_sdpa("llama", 32768, "decode"))
        jobs.append(lambda: run_sdpa("gemma", 100000, "decode-w1024"))
    props = torch.cuda.get_device_properties(0)
    with open(args.out, "w") as out:
        head = {"impl": "device", "name": props.name, "torch": torch.__version__}
        for row in [head] + [None] * len(jobs):
            if row is None:
                try:
                    row = jobs.pop(0)()
                except Exception as e:  # one failed configuration does not stop the others
                    row = {"impl": "error", "error": f"{type(e).__name__}: {str(e)[:300]}"}
                torch.cuda.empty_cache()
            line = json.dumps(row)
            print(line, flush=True)
            out.write(line + "\n")
            out.flush()


if __name__ == "__main__":
    main()
