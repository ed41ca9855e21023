#!/usr/bin/env python3
"""Compiles the retrieval kernels (kernels/cuda: attend.cu, route.cu, follow.cu, fill.cu) and the
model's element-wise and matrix-vector kernels (gate.cuh before ops.cu and gemv.cu) with NVRTC on this machine, which has no GPU, so that a source NVRTC refuses is found before a
bundle goes to the GPU machine (where kvdb-kernels compiles them at run time, and a refusal
costs a device call). scripts/gpu-bundle.sh runs it first.

NVRTC comes from PyPI (`nvidia-cuda-nvrtc-cu12`, CUDA 12.9: the GPU machine's CUDA 13 takes
what 12.9 takes for these sources), downloaded once into ~/.cache/kvdb/nvrtc, or from
$NVRTC_LIB. The sources are compiled as kvdb-kernels assembles them (blocks.cuh before
attend.cu, route.cu and follow.cu) with the defines it passes, over the element types, head
dimensions, GQA groups and attention paths it launches, for compute_90 (the H100/H200).

Usage: scripts/nvrtc-check.py   (exit status 1 and NVRTC's log when a source fails)
"""

import ctypes
import glob
import itertools
import os
import subprocess
import sys
import zipfile

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "kernels", "cuda")
CACHE = os.path.expanduser("~/.cache/kvdb/nvrtc")
WHEEL = "nvidia-cuda-nvrtc-cu12==12.9.86"
ARCH = "--gpu-architecture=compute_90"
# `THREADS` and `UNROLL` of kernels/src/gpu.rs.
THREADS, UNROLL = 128, 4


def library():
    """libnvrtc's path: $NVRTC_LIB, or the wheel's, downloaded and unpacked when missing."""
    if os.environ.get("NVRTC_LIB"):
        return os.environ["NVRTC_LIB"]
    found = glob.glob(os.path.join(CACHE, "nvidia/cuda_nvrtc/lib/libnvrtc.so.*"))
    if not found:
        os.makedirs(CACHE, exist_ok=True)
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", WHEEL, "-d", CACHE],
            check=True,
        )
        for wheel in glob.glob(os.path.join(CACHE, "*.whl")):
            with zipfile.ZipFile(wheel) as archive:
                archive.extractall(CACHE)
        found = glob.glob(os.path.join(CACHE, "nvidia/cuda_nvrtc/lib/libnvrtc.so.*"))
    if not found:
        sys.exit(f"nvrtc-check: no libnvrtc in {CACHE}")
    # The versioned library itself, not the builtins library beside it.
    return sorted(p for p in found if "builtins" not in p)[0]


def compile_source(nvrtc, source, name, defines):
    """NVRTC's result and log for `source` compiled with `defines` (name -> value)."""
    program = ctypes.c_void_p()
    status = nvrtc.nvrtcCreateProgram(
        ctypes.byref(program), source.encode(), name.encode(), 0, None, None
    )
    if status != 0:
        return status, f"nvrtcCreateProgram: {status}"
    options = [ARCH, "--use_fast_math"] + [f"-D{k}={v}" for k, v in defines.items()]
    encoded = (ctypes.c_char_p * len(options))(*[o.encode() for o in options])
    status = nvrtc.nvrtcCompileProgram(program, len(options), encoded)
    size = ctypes.c_size_t()
    nvrtc.nvrtcGetProgramLogSize(program, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    nvrtc.nvrtcGetProgramLog(program, log)
    nvrtc.nvrtcDestroyProgram(ctypes.byref(program))
    return status, log.value.decode(errors="replace")


def cases():
    """(file, source, defines) for every variant checked."""
    read = lambda f: open(os.path.join(ROOT, f)).read()
    blocks = read("blocks.cuh")
    attend, route = blocks + read("attend.cu"), blocks + read("route.cu")
    # Head dim 256 has no tensor-core path (MMA: head dims 64 and 128).
    paths = [(64, 0), (64, 1), (128, 0), (128, 1), (256, 0)]
    for bf16, (head_dim, mma), group in itertools.product((0, 1), paths, (1, 4, 8)):
        yield "attend.cu", attend, {
            "KV_BF16": bf16,
            "HEAD_DIM": head_dim,
            "GROUP": group,
            "THREADS": THREADS,
            "UNROLL": UNROLL,
            "MMA": mma,
        }
    for head_dim, group in itertools.product((64, 128, 256), (1, 4, 16)):
        yield "route.cu", route, {"GROUP": group, "HEAD_DIM": head_dim}
    yield "follow.cu", blocks + read("follow.cu"), {}
    yield "fill.cu", read("fill.cu"), {}
    # ops.cu is compiled whole for each entry point, with the element types and the norms'
    # switches the model passes.
    gate = read("gate.cuh")
    ops = gate + read("ops.cu")
    types = ("float", "__half", "__nv_bfloat16")
    for normed, then, out in itertools.product((0, 1), (0, 1), types):
        yield "ops.cu", ops, {"NORMED": normed, "THEN": then, "OUT_T": out}
    for t in types:
        yield "ops.cu", ops, {"TABLE_T": t, "IN_T": t, "KV_T": t}
    for bf16, x_f32 in itertools.product((0, 1), (0, 1)):
        yield "gemv.cu", gate + read("gemv.cu"), {"W_BF16": bf16, "X_F32": x_f32}


def main():
    nvrtc = ctypes.CDLL(library())
    failed = 0
    checked = 0
    for name, source, defines in cases():
        status, log = compile_source(nvrtc, source, name, defines)
        checked += 1
        if status != 0:
            failed += 1
            print(f"nvrtc-check: {name} {defines}: NVRTC error {status}\n{log[:4000]}")
    print(f"nvrtc-check: {checked - failed} of {checked} kernel variants compile")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
