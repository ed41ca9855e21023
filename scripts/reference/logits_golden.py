#!/usr/bin/env python3
"""Logits goldens for kvdb's Gemma 3 forward pass, made with llama.cpp (through llama-cpp-python).

Independent of kvdb. The prompt is BOS + the llama.cpp tokenization of the start of
tests/data/gpl-3.txt (special parsing on, as kvdb's prompt options do), cut to exactly 1600
tokens. The prompt is evaluated in batches of 512 with logits for every position; for a fixed
set of positions the file keeps the 64 largest logits (id, logit) and the log-sum-exp over the
whole vocabulary (computed in float64).

Two runs are recorded: `runs.kv_f32` keeps the KV cache in f32 (type_k = type_v =
GGML_TYPE_F32 = 0), the tighter reference; `runs.kv_f16` uses llama.cpp's default KV cache type
(f16). Their difference shows how much the reference itself moves with KV precision.

Usage (from the repository root):
    pip install -r scripts/reference/requirements.txt
    python3 scripts/reference/logits_golden.py \
        [--model ~/.cache/kvdb/models/gemma-3-270m-q4_k_m.gguf] \
        [--out model/tests/data/gemma3_logits_golden.json]
"""

import gc
import json
import os
import sys
import time

import numpy as np

import llama_cpp
import llama_cpp.llama_cpp as llama_api
from llama_cpp import Llama

from common import GPL_PATH, golden_path, parse_args, read_gpl, sha256

DEFAULT_OUT = golden_path("gemma3_logits_golden.json")

N_TOKENS = 1600
TEXT_CHARS = 9000  # characters of gpl-3.txt tokenized; must give >= N_TOKENS - 1 tokens
POSITIONS = [0, 1, 7, 100, 255, 511, 512, 513, 700, 1023, 1024, 1200, 1500, 1599]
TOP_K = 64
N_CTX = 4096
N_BATCH = 512
N_THREADS = 2
GGML_TYPE_F32 = 0
GGML_TYPE_F16 = 1


def plain_cpu_model_params():
    """llama.cpp's default model params without extra CPU buffer types.

    The extra buffer types repack weights for AMX / AVX kernels; the AMX path segfaults in
    some VMs (seen on a Sapphire Rapids VM), and the plain ggml kernels are the same on every
    x86 machine. llama-cpp-python does not expose the switch, so the default is patched.
    """
    params = _default_model_params()
    params.use_extra_bufts = False
    return params


# llama.py calls llama_cpp.llama_cpp.llama_model_default_params(); patch it there.
_default_model_params = llama_api.llama_model_default_params
llama_api.llama_model_default_params = plain_cpu_model_params


def run(model, tokens, kv_type):
    kw = {} if kv_type is None else {"type_k": kv_type, "type_v": kv_type}
    llm = Llama(
        model_path=model,
        n_ctx=N_CTX,
        logits_all=True,
        n_threads=N_THREADS,
        n_batch=N_BATCH,
        seed=0,
        verbose=False,
        **kw,
    )
    t0 = time.time()
    llm.reset()
    llm.eval(tokens)
    elapsed = time.time() - t0
    scores = np.array(llm.scores[: len(tokens)], dtype=np.float32)
    params = llm.context_params
    assert not llm.model_params.use_extra_bufts
    info = {
        "type_k": int(params.type_k),
        "type_v": int(params.type_v),
        "flash_attn_type": int(params.flash_attn_type),
        "n_ubatch": int(params.n_ubatch),
        "eval_seconds": round(elapsed, 1),
    }
    del llm
    gc.collect()
    positions = []
    for p in POSITIONS:
        row = scores[p]
        top = np.argsort(-row, kind="stable")[:TOP_K]
        r64 = row.astype(np.float64)
        m = r64.max()
        lse = float(m + np.log(np.exp(r64 - m).sum()))
        positions.append(
            {
                "position": p,
                "top": [[int(i), float(row[i])] for i in top],
                "logsumexp": lse,
            }
        )
    return info, positions, scores[POSITIONS]


def main():
    args = parse_args(__doc__, DEFAULT_OUT)

    text = read_gpl()[:TEXT_CHARS]
    vocab_llm = Llama(model_path=args.model, vocab_only=True, verbose=False)
    body = vocab_llm.tokenize(text.encode("utf-8"), add_bos=False, special=True)
    bos = vocab_llm.token_bos()
    del vocab_llm
    if len(body) < N_TOKENS - 1:
        sys.exit(f"only {len(body)} tokens in {TEXT_CHARS} characters; raise TEXT_CHARS")
    tokens = [bos] + body[: N_TOKENS - 1]

    runs = {}
    rows = {}
    for name, kv in (("kv_f32", GGML_TYPE_F32), ("kv_f16", None)):
        info, positions, r = run(args.model, tokens, kv)
        runs[name] = {"settings": info, "positions": positions}
        rows[name] = r
        print(f"{name}: {info}", file=sys.stderr)
    diff = np.abs(rows["kv_f32"].astype(np.float64) - rows["kv_f16"].astype(np.float64))
    spread = {
        "max_abs_logit_diff": float(diff.max()),
        "mean_abs_logit_diff": float(diff.mean()),
        "note": "kv_f32 vs kv_f16 over the full vocabulary at the recorded positions",
    }
    print(f"f32 vs f16 KV: {spread}", file=sys.stderr)

    golden = {
        "generator": f"llama-cpp-python {llama_cpp.__version__}",
        "script": "scripts/reference/logits_golden.py",
        "llama_cpp_system_info": llama_cpp.llama_print_system_info().decode().strip(),
        "model": os.path.basename(args.model),
        "model_sha256": sha256(args.model),
        "settings": {
            "n_ctx": N_CTX,
            "n_batch": N_BATCH,
            "n_threads": N_THREADS,
            "seed": 0,
            "logits_all": True,
            "flash_attn": False,
            "use_extra_bufts": False,
            "kv_cache": "runs.kv_f32: type_k = type_v = 0 (GGML_TYPE_F32); runs.kv_f16: "
            "llama.cpp default (type_k = type_v = 1, GGML_TYPE_F16)",
        },
        "text_file": GPL_PATH,
        "text_chars": TEXT_CHARS,
        "tokenize_call": "[BOS] + llama_tokenize(text[:text_chars], add_special=false, "
        "parse_special=true)[:n_tokens - 1]",
        "n_tokens": N_TOKENS,
        "tokens": tokens,
        "top_k": TOP_K,
        "primary_run": "kv_f32",
        "kv_spread": spread,
        "runs": runs,
    }
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(golden, f, separators=(",", ":"))
        f.write("\n")
    print(f"wrote {args.out} ({os.path.getsize(args.out)} bytes)", file=sys.stderr)


if __name__ == "__main__":
    main()
