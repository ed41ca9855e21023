#!/usr/bin/env python3
"""PyTorch baseline of the model forward pass, to compare with kvdb's own GPU forward.

A plain PyTorch forward in bf16 with random weights, for the shapes that `random_model`
(crate kvdb-tests) writes:
- gemma3-270m: 18 layers, hidden 640, MLP 2048 (GELU-tanh gate), 4 query heads over 1 KV head
  of 256 dims, QK-norm, sandwich norms, embeddings scaled by sqrt(hidden), sliding windows of
  512 tokens on five layers of six (RoPE base 1e4 there, 1e6 on the global layers), tied
  output, vocabulary 262144;
- llama3-8b: 32 layers, hidden 4096, MLP 14336 (SiLU gate), 32 query heads over 8 KV heads of
  128 dims, RoPE base 500000, separate output, vocabulary 128256.
Norms are torch.nn.functional.rms_norm; Gemma's (1 + w) scale is folded into the stored
weight (the same product, one op fewer). Q/K/V and gate/up are fused into one GEMM each.

What runs where:
- prefill, one whole-sequence forward computing only the last row's logits. Global layers:
  scaled_dot_product_attention(is_causal=True) restricted to the flash backend, with
  enable_gqa=True where the backend takes it, else K/V expanded to the query heads.
  Sliding-window layers: SDPA has no window argument and its flash backend takes no mask, so
  queries go in blocks of 512, each over the 1024 keys that can fall in its blocks' windows,
  with an explicit boolean window mask (the memory-efficient backend where it takes the
  mask, else math); half the scores computed there are masked. A length that runs out of
  GPU memory is prefilled in chunks of 16384 with a KV cache (global layers:
  causal_lower_right masks over the cache; sliding layers: a ring buffer of the last 512
  keys); "mode" says which ran.
- decode, batch 1, one token per step, greedy (argmax fed back on the GPU), over a static
  preallocated cache holding `context` tokens (random keys and values: prefilling them would
  only cost time) plus room for the steps; global layers attend to the whole static cache
  with a position mask, sliding-window layers to a ring buffer of 512. Decode attention is
  two batched products over each KV head's query group with a softmax in f32 (graph-safe,
  reads each key once; SDPA would need a mask, which its flash backend does not take, or a
  cache sliced per step, which CUDA graphs cannot replay; --sdpa-decode times that eager
  variant too, SDPA over the filled part of the cache). Timed eagerly and as a captured
  CUDA graph of one step (torch.compile is not used: its compile time would not fit the
  budget). The median of the per-step times over --steps steps (CUDA events between steps).
- gemm: torch.mm of 8192x8192x8192 bf16, the measured peak that MFU is relative to.

Flops: 2 * (layer parameters) * tokens + attention (4 * head_dim * heads per query-key pair
that the mask lets through, causal or windowed) + 2 * vocab * hidden per row of logits.
Decode also reports bandwidth: bytes of weights plus the keys and values attended, per
second.

Timing: CUDA events around each call; one warm-up call, then the median of --repeats calls.
--check compares, on a short sequence, the whole-sequence prefill with the chunked one and
with a decode step after a prefill (a wiring check of masks, caches and ring buffers; bf16
differences are of order 1e-2, a wiring bug of order 1). --quick: tiny shapes, short
lengths, the check included; with --device cpu it runs in seconds.

Usage:
  python3 scripts/bench_model_torch.py --out torch.jsonl
  python3 scripts/bench_model_torch.py --shapes llama3-8b --lengths 4096,32768
  python3 scripts/bench_model_torch.py --quick --device cpu
"""

import argparse
import gc
import json
import math
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

SHAPES = {
    "gemma3-270m": dict(
        arch="gemma3", layers=18, hidden=640, inter=2048, heads=4, kv_heads=1, head_dim=256,
        vocab=262144, window=512, pattern=6, rope_global=1e6, rope_local=1e4, tied=True,
        eps=1e-6,
    ),
    "llama3-8b": dict(
        arch="llama", layers=32, hidden=4096, inter=14336, heads=32, kv_heads=8, head_dim=128,
        vocab=128256, window=None, pattern=None, rope_global=5e5, rope_local=None, tied=False,
        eps=1e-5,
    ),
}
# --quick: the same architectures, tiny (windows of 16, so every path is exercised).
QUICK_SHAPES = {
    "gemma3-270m": dict(SHAPES["gemma3-270m"], layers=6, hidden=64, inter=128, heads=4,
                        kv_heads=1, head_dim=32, vocab=512, window=16),
    "llama3-8b": dict(SHAPES["llama3-8b"], layers=2, hidden=128, inter=256, heads=8,
                      kv_heads=2, head_dim=16, vocab=512),
}
CHUNK = 16384
CACHE_ROOM = 256  # decode steps a cache has room for past its context


class Timer:
    """Milliseconds between marks: CUDA events on a GPU, the wall clock on the CPU."""

    def __init__(self, device):
        self.cuda = device.type == "cuda"

    def mark(self):
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def elapsed(self, marks):
        """Milliseconds between consecutive marks (synchronises)."""
        if self.cuda:
            marks[-1].synchronize()
            return [a.elapsed_time(b) for a, b in zip(marks, marks[1:])]
        return [(b - a) * 1e3 for a, b in zip(marks, marks[1:])]

    def call_ms(self, fn):
        marks = [self.mark()]
        out = fn()
        marks.append(self.mark())
        return self.elapsed(marks)[0], out


class Attention:
    """SDPA calls with the backend choices recorded: which ran is part of the result."""

    def __init__(self, device):
        self.cuda = device.type == "cuda"
        self.causal_gqa = None  # "flash+gqa" or "flash, kv expanded"
        self.masked = None  # "efficient" or "math"

    def causal(self, q, k, v, scale):
        """Whole-sequence causal attention, q [1,H,T,d], k/v [1,KV,T,d]."""
        if not self.cuda:
            self.causal_gqa = "cpu default"
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                                  enable_gqa=True)
        if self.causal_gqa in (None, "flash+gqa"):
            try:
                with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
                    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                                         enable_gqa=True)
                self.causal_gqa = "flash+gqa"
                return out
            except torch.OutOfMemoryError:
                raise
            except RuntimeError:
                if self.causal_gqa is not None:
                    raise
        self.causal_gqa = "flash, kv expanded"
        g = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)

    def with_mask(self, q, k, v, mask, scale):
        """Attention with an explicit mask (K/V already expanded to the query heads)."""
        if not self.cuda:
            self.masked = "cpu default"
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
        if self.masked in (None, "efficient"):
            try:
                with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]):
                    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
                self.masked = "efficient"
                return out
            except torch.OutOfMemoryError:
                raise
            except RuntimeError:
                if self.masked is not None:
                    raise
        self.masked = "math"
        with sdpa_kernel([SDPBackend.MATH]):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)

    def lower_right(self, q, k, v, scale):
        """Chunk queries over a longer prefix (bottom-right aligned causal mask)."""
        g = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
        bias = causal_lower_right(q.shape[2], k.shape[2])
        if not self.cuda:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=scale)
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=scale)


def window_attention(attn, q, k, v, q_start, k_start, window, scale):
    """Sliding-window attention of q [1,H,Tq,d] (positions q_start..) over k/v [1,KV,Tk,d]
    (positions k_start.. up to the last query's). Key position kp is seen from query position
    p when p - window < kp <= p. Queries go in blocks of `window`; block b sees the keys from
    its first query's position - window on, 2 * window of them."""
    _, h, tq, d = q.shape
    kv = k.shape[1]
    b = window
    nb = -(-tq // b)
    pad_q = nb * b - tq
    off = q_start - k_start  # index in k of the first query's position
    # Keys padded by `window` on the left and to whole blocks on the right: in the padded
    # tensor, block i's keys start at off + i * b.
    kp = F.pad(k, (0, 0, window, pad_q))[:, :, off:off + nb * b + window]
    vp = F.pad(v, (0, 0, window, pad_q))[:, :, off:off + nb * b + window]
    # unfold: [1, KV, nb, d, b + window] -> [nb, KV, b + window, d], then the query heads.
    kb = kp.unfold(2, b + window, b).permute(0, 2, 1, 4, 3).reshape(nb, kv, b + window, d)
    vb = vp.unfold(2, b + window, b).permute(0, 2, 1, 4, 3).reshape(nb, kv, b + window, d)
    kb, vb = kb.repeat_interleave(h // kv, 1), vb.repeat_interleave(h // kv, 1)
    qb = F.pad(q, (0, 0, 0, pad_q)).view(1, h, nb, b, d).permute(0, 2, 1, 3, 4)
    qb = qb.reshape(nb, h, b, d)
    # Query i of block n is at q_start + n*b + i, key j at q_start + n*b - window + j.
    i = torch.arange(b, device=q.device)[:, None]
    j = torch.arange(b + window, device=q.device)[None, :]
    in_window = (j > i) & (j <= i + window)
    # Keys before k_start are padding: key index off + n*b - window + j must be >= 0.
    first_real = window - off - b * torch.arange(nb, device=q.device)
    real = j >= first_real[:, None]
    mask = (in_window[None] & real[:, None, :]).unsqueeze(1)  # [nb, 1, b, b + window]
    out = attn.with_mask(qb, kb, vb, mask, scale)  # [nb, H, b, d]
    out = out.view(1, nb, h, b, d).permute(0, 2, 1, 3, 4).reshape(1, h, nb * b, d)
    return out[:, :, :tq]


def rope_table(base, head_dim, length, device, dtype):
    inv = 1.0 / (base ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float64)
                          / head_dim))
    angles = torch.arange(length, device=device, dtype=torch.float64)[:, None] * inv[None]
    return angles.cos().to(dtype), angles.sin().to(dtype)


def rope(x, cos, sin):
    """Halves-style RoPE of x [T, heads, d] with cos/sin [T, 1, d/2]."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class Layer:
    pass


class Model:
    """Random weights of one shape; the forward passes; immutable."""

    def __init__(self, shape, device, dtype, seed, max_positions):
        self.s = s = shape
        self.device, self.dtype = device, dtype
        self.gemma = s["arch"] == "gemma3"
        self.h, self.kv, self.d = s["heads"], s["kv_heads"], s["head_dim"]
        self.scale = 1.0 / math.sqrt(self.d)  # Gemma 3 270M: query_pre_attn_scalar = 256 = d
        gen = torch.Generator(device=device)
        gen.manual_seed(seed)

        def weight(rows, cols, std=None):
            t = torch.randn(rows, cols, generator=gen, device=device, dtype=dtype)
            return t.mul_(std if std is not None else 1.0 / math.sqrt(cols))

        def norm(n):  # the effective scale ((1 + w) for Gemma), about 1
            return torch.randn(n, generator=gen, device=device, dtype=dtype).mul_(0.1).add_(1.0)

        hid, inter, h, kv, d = s["hidden"], s["inter"], self.h, self.kv, self.d
        self.embed = weight(s["vocab"], hid)
        # sqrt(hidden) rounded to the weights' type, as HF's Gemma does; a Python float, so
        # that graph capture needs no host-to-device copy.
        self.embed_scale = (torch.tensor(math.sqrt(hid), dtype=dtype).item()
                            if self.gemma else None)
        self.out = self.embed if s["tied"] else weight(s["vocab"], hid)
        self.final_norm = norm(hid)
        self.layers = []
        for i in range(s["layers"]):
            L = Layer()
            L.sliding = self.gemma and (i + 1) % s["pattern"] != 0
            L.attn_norm, L.ffn_norm = norm(hid), norm(hid)
            L.wqkv = weight((h + 2 * kv) * d, hid)
            L.wo = weight(hid, h * d)
            L.wgu = weight(2 * inter, hid)
            L.wdown = weight(hid, inter)
            if self.gemma:
                L.q_norm, L.k_norm = norm(d), norm(d)
                L.post_attn_norm, L.post_ffn_norm = norm(hid), norm(hid)
            self.layers.append(L)
        self.rope_global = rope_table(s["rope_global"], d, max_positions, device, dtype)
        self.rope_local = (rope_table(s["rope_local"], d, max_positions, device, dtype)
                           if self.gemma else None)
        self.layer_params = sum(
            t.numel() for L in self.layers for t in vars(L).values() if torch.is_tensor(t))

    def rms(self, x, w):
        return F.rms_norm(x, (x.shape[-1],), w, self.s["eps"])

    def layer(self, L, x, cos, sin, attend):
        """One transformer block over x [T, hidden]; attend(L, q, k, v) does the attention
        of q [1,H,T,d] over k/v [1,KV,T,d] (keeping what its cache needs)."""
        t, h, kv, d = x.shape[0], self.h, self.kv, self.d
        qkv = F.linear(self.rms(x, L.attn_norm), L.wqkv)
        q, k, v = qkv.split([h * d, kv * d, kv * d], dim=-1)
        q, k, v = q.view(t, h, d), k.view(t, kv, d), v.view(t, kv, d)
        if self.gemma:
            q, k = self.rms(q, L.q_norm), self.rms(k, L.k_norm)
        q, k = rope(q, cos, sin), rope(k, cos, sin)
        q, k, v = (y.transpose(0, 1).unsqueeze(0) for y in (q, k, v))
        o = attend(L, q, k, v).squeeze(0).transpose(0, 1).reshape(t, h * d)
        o = F.linear(o, L.wo)
        if self.gemma:
            o = self.rms(o, L.post_attn_norm)
        x = x + o
        gate, up = F.linear(self.rms(x, L.ffn_norm), L.wgu).chunk(2, dim=-1)
        a = (F.gelu(gate, approximate="tanh") if self.gemma else F.silu(gate)) * up
        o = F.linear(a, L.wdown)
        if self.gemma:
            o = self.rms(o, L.post_ffn_norm)
        return x + o

    def embed_tokens(self, tokens):
        x = F.embedding(tokens, self.embed)
        return x * self.embed_scale if self.gemma else x

    def logits(self, x_last):
        return F.linear(self.rms(x_last, self.final_norm), self.out)

    def tables(self, positions):
        """RoPE cos/sin [T, 1, d/2] at `positions` for global (False) and sliding (True)
        layers."""
        def at(table):
            cos, sin = table
            return cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)
        local = at(self.rope_local) if self.gemma else None
        return {False: at(self.rope_global), True: local}

    def prefill(self, attn, tokens):
        """Whole-sequence forward; the last row's logits [1, vocab]."""
        t = tokens.shape[0]
        positions = torch.arange(t, device=self.device)
        window = self.s["window"]

        def attend(L, q, k, v):
            if L.sliding:
                return window_attention(attn, q, k, v, 0, 0, window, self.scale)
            return attn.causal(q, k, v, self.scale)

        x = self.embed_tokens(tokens)
        tables = self.tables(positions)
        for L in self.layers:
            x = self.layer(L, x, *tables[L.sliding], attend)
        return self.logits(x[-1:])

    def prefill_chunked(self, attn, tokens, cache, chunk):
        """Forward in chunks of `chunk` tokens through `cache`; the last row's logits."""
        window = self.s["window"]
        logits = None
        for s in range(0, tokens.shape[0], chunk):
            part = tokens[s:s + chunk]
            t = part.shape[0]
            positions = torch.arange(s, s + t, device=self.device)

            def attend(L, q, k, v, s=s, t=t):
                ck, cv = cache.k[L], cache.v[L]
                if not L.sliding:
                    ck[:, :, s:s + t] = k
                    cv[:, :, s:s + t] = v
                    return attn.lower_right(q, ck[:, :, :s + t], cv[:, :, :s + t], self.scale)
                # The ring holds positions s - window .. s - 1 at slots position % window.
                first = max(0, s - window)
                slots = torch.arange(first, s, device=self.device) % window
                kk = torch.cat((ck.index_select(2, slots), k), dim=2)
                vv = torch.cat((cv.index_select(2, slots), v), dim=2)
                out = window_attention(attn, q, kk, vv, s, first, window, self.scale)
                n = min(t, window)
                slots = torch.arange(s + t - n, s + t, device=self.device) % window
                ck.index_copy_(2, slots, k[:, :, t - n:])
                cv.index_copy_(2, slots, v[:, :, t - n:])
                return out

            x = self.embed_tokens(part)
            tables = self.tables(positions)
            for L in self.layers:
                x = self.layer(L, x, *tables[L.sliding], attend)
            logits = self.logits(x[-1:])
        return logits

    def decode_step(self, token, pos, cache, sdpa_len=None):
        """One token (token, pos: [1] int64 on the device) through `cache`; logits [1, vocab].
        Graph-safe: no host synchronisation, no shape depending on pos; unless `sdpa_len`
        (pos + 1, known on the host) is given: global layers then attend through
        scaled_dot_product_attention over the cache's first sdpa_len tokens (GQA in the
        call, PyTorch's choice of backend), a shape that changes every step."""
        h, kv, d = self.h, self.kv, self.d
        g = h // kv
        ninf = float("-inf")
        global_mask = torch.where(cache.global_index <= pos, 0.0, ninf)
        ring_mask = (torch.where(cache.ring_index <= pos, 0.0, ninf)
                     if cache.ring_index is not None else None)
        ring_slot = pos % self.s["window"] if self.gemma else None

        def attend(L, q, k, v):
            ck, cv = cache.k[L], cache.v[L]
            slot, mask = (ring_slot, ring_mask) if L.sliding else (pos, global_mask)
            ck.index_copy_(2, slot, k)
            cv.index_copy_(2, slot, v)
            if sdpa_len is not None and not L.sliding:
                return F.scaled_dot_product_attention(
                    q, ck[:, :, :sdpa_len], cv[:, :, :sdpa_len], scale=self.scale,
                    enable_gqa=True)
            n = ck.shape[2]
            scores = torch.bmm(q.reshape(kv, g, d), ck.view(kv, n, d).transpose(1, 2))
            p = torch.softmax(scores.float() * self.scale + mask, dim=-1).to(self.dtype)
            return torch.bmm(p, cv.view(kv, n, d)).view(1, h, 1, d)

        x = self.embed_tokens(token)
        tables = self.tables(pos)
        for L in self.layers:
            x = self.layer(L, x, *tables[L.sliding], attend)
        return self.logits(x)


class Cache:
    """Per layer: a static [1, KV, max_len, d] cache (global layers) or a ring of the last
    `window` positions (sliding layers)."""

    def __init__(self, model, max_len):
        m, w = model, model.s["window"]
        self.k, self.v = {}, {}
        for L in m.layers:
            n = w if L.sliding else max_len
            self.k[L] = torch.zeros(1, m.kv, n, m.d, device=m.device, dtype=m.dtype)
            self.v[L] = torch.zeros(1, m.kv, n, m.d, device=m.device, dtype=m.dtype)
        self.global_index = torch.arange(max_len, device=m.device)
        self.ring_index = torch.arange(w, device=m.device) if m.gemma else None

    def fill_random(self):
        for t in list(self.k.values()) + list(self.v.values()):
            t.normal_()

    def nbytes(self):
        return sum(t.numel() * t.element_size() for t in list(self.k.values()) + list(self.v.values()))


def attention_pairs(t, window):
    """Query-key pairs of a causal (window None) or windowed prefill of t tokens."""
    if window is None or t <= window:
        return t * (t + 1) // 2
    return window * (window + 1) // 2 + (t - window) * window


def prefill_flops(m, t):
    s = m.s
    attn = sum(4 * m.d * m.h * attention_pairs(t, s["window"] if L.sliding else None)
               for L in m.layers)
    return 2 * m.layer_params * t + attn + 2 * s["vocab"] * s["hidden"]


def decode_cost(m, ctx):
    """Flops and bytes read of one decode step at position ctx (ctx tokens cached)."""
    s, el = m.s, m.embed.element_size()
    flops = 2 * m.layer_params + 2 * s["vocab"] * s["hidden"]
    nbytes = (m.layer_params + s["vocab"] * s["hidden"]) * el
    for L in m.layers:
        seen = min(ctx + 1, s["window"]) if L.sliding else ctx + 1
        flops += 4 * m.d * m.h * seen
        nbytes += 2 * m.kv * m.d * seen * el
    return flops, nbytes


def free_memory():
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def gemm_tflops(device, timer, n, repeats):
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        torch.mm(a, b)
    times = [timer.call_ms(lambda: torch.mm(a, b))[0] for _ in range(repeats)]
    ms = statistics.median(times)
    return 2 * n ** 3 / (ms * 1e-3) / 1e12, ms


def bench_prefill(m, attn, timer, t, args, emit):
    tokens = torch.randint(0, m.s["vocab"], (t,), device=m.device)
    mode = args.prefill
    cache = None
    if timer.cuda:
        torch.cuda.reset_peak_memory_stats()
    if mode in ("auto", "whole"):
        try:
            timer.call_ms(lambda: m.prefill(attn, tokens))  # warm-up
            mode = "whole"
        except torch.OutOfMemoryError:
            if args.prefill == "whole":
                raise
            mode = None
        if mode is None:
            free_memory()
            mode = "chunked"
    if mode == "chunked":
        cache = Cache(m, t)
        timer.call_ms(lambda: m.prefill_chunked(attn, tokens, cache, args.chunk))
    if mode == "whole":
        run = lambda: m.prefill(attn, tokens)  # noqa: E731
    else:
        run = lambda: m.prefill_chunked(attn, tokens, cache, args.chunk)  # noqa: E731
    times = [timer.call_ms(run)[0] for _ in range(args.repeats)]
    ms = statistics.median(times)
    flops = prefill_flops(m, t)
    peak = torch.cuda.max_memory_allocated() / 2**30 if timer.cuda else None
    emit(dict(phase="prefill", tokens=t,
              mode=mode if mode == "whole" else f"chunked {args.chunk}",
              ms=ms, times_ms=times, tok_s=t / (ms * 1e-3), tflops=flops / (ms * 1e-3) / 1e12,
              flops=flops, peak_gib=peak))
    del cache
    free_memory()


def bench_decode(m, timer, ctx, args, emit):
    cache = Cache(m, ctx + CACHE_ROOM)
    cache.fill_random()
    token = torch.zeros(1, dtype=torch.long, device=m.device)
    pos = torch.full((1,), ctx, dtype=torch.long, device=m.device)

    def step():
        logits = m.decode_step(token, pos, cache)
        token.copy_(logits.argmax(dim=-1))
        pos.add_(1)

    # The same step with SDPA over the filled part of the cache: the position is also kept
    # on the host, so the step cannot be captured in a graph.
    host = dict(pos=ctx)

    def step_sdpa():
        logits = m.decode_step(token, pos, cache, sdpa_len=host["pos"] + 1)
        token.copy_(logits.argmax(dim=-1))
        pos.add_(1)
        host["pos"] += 1

    def per_step_ms(run, n):
        marks = [timer.mark()]
        for _ in range(n):
            run()
            marks.append(timer.mark())
        return timer.elapsed(marks)

    flops, nbytes = decode_cost(m, ctx + args.steps // 2)
    variants = [("eager", step)]
    if args.sdpa_decode:
        variants.append(("eager sdpa", step_sdpa))
    if timer.cuda and not args.no_graphs:
        try:
            pos.fill_(ctx)
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(3):
                    step()
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                step()
            variants.append(("cuda graph", graph.replay))
        except Exception as e:  # keep the eager figures
            print(f"  decode {ctx}: CUDA graph capture failed: {e!r}", flush=True)
            torch.cuda.synchronize()
    for name, run in variants:
        pos.fill_(ctx)
        host["pos"] = ctx
        per_step_ms(run, 5)  # warm-up
        pos.fill_(ctx)
        host["pos"] = ctx
        times = per_step_ms(run, args.steps)
        ms = statistics.median(times)
        emit(dict(phase="decode", tokens=ctx, mode=name, ms=ms, steps=args.steps,
                  tok_s=1e3 / ms, tflops=flops / (ms * 1e-3) / 1e12, flops=flops,
                  gb_s=nbytes / (ms * 1e-3) / 1e9, cache_gib=cache.nbytes() / 2**30))
    del cache
    free_memory()


def check(m, attn, window, device):
    """Whole-sequence prefill against chunked prefill and against prefill + one decode step,
    on a sequence over three windows long with chunks that do not align with windows."""
    w = window or 64
    t = 3 * w + 37
    chunk = w + 7
    tokens = torch.randint(0, m.s["vocab"], (t,), device=device)
    whole = m.prefill(attn, tokens).float()
    chunked = m.prefill_chunked(attn, tokens, Cache(m, t), chunk).float()
    cache = Cache(m, t + 8)
    m.prefill_chunked(attn, tokens[:-1], cache, chunk)
    pos = torch.full((1,), t - 1, dtype=torch.long, device=device)
    decoded = m.decode_step(tokens[-1:], pos, cache).float()
    scale = whole.abs().max().item()
    err = dict(chunked=(chunked - whole).abs().max().item() / scale,
               decode=(decoded - whole).abs().max().item() / scale)
    return t, chunk, err


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="gemma3-270m,llama3-8b",
                   help=f"comma-separated, of {', '.join(SHAPES)}")
    p.add_argument("--lengths", default=None, help="prefill lengths (default 4096,32768,131072)")
    p.add_argument("--contexts", default=None, help="decode cache lengths (default 4096,32768)")
    p.add_argument("--steps", type=int, default=64, help="timed decode steps (>= 50)")
    p.add_argument("--repeats", type=int, default=3, help="timed prefill calls")
    p.add_argument("--prefill", choices=["auto", "whole", "chunked"], default="auto",
                   help="auto: whole, chunked if that runs out of memory")
    p.add_argument("--chunk", type=int, default=CHUNK)
    p.add_argument("--gemm", type=int, default=8192, help="size of the square GEMM")
    p.add_argument("--no-graphs", action="store_true", help="decode eagerly only")
    p.add_argument("--sdpa-decode", action="store_true",
                   help="decode also with scaled_dot_product_attention over the filled cache "
                        "(eager: its shape changes every step)")
    p.add_argument("--check", action="store_true", help="run the consistency check first")
    p.add_argument("--quick", action="store_true",
                   help="tiny shapes and lengths, the check included (runs on a CPU)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--layers", type=int, default=None,
                   help="keep only the first N layers of each shape (as random_model --layers)")
    p.add_argument("--out", default=None, help="append JSON lines here")
    args = p.parse_args()

    shapes = QUICK_SHAPES if args.quick else SHAPES
    if args.layers:
        shapes = {k: dict(v, layers=min(args.layers, v["layers"])) for k, v in shapes.items()}
    names = [s for s in args.shapes.split(",") if s]
    for n in names:
        if n not in shapes:
            sys.exit(f"unknown shape {n!r}; known: {', '.join(shapes)}")
    default_lengths = "64,200" if args.quick else "4096,32768,131072"
    default_contexts = "48,96" if args.quick else "4096,32768"
    lengths = [int(x) for x in (args.lengths or default_lengths).split(",") if x]
    contexts = [int(x) for x in (args.contexts or default_contexts).split(",") if x]
    if args.quick:
        args.gemm = min(args.gemm, 256)
        args.check = True
        args.chunk = min(args.chunk, 48)
    device = torch.device(args.device)
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)
    dtype = torch.bfloat16
    timer = Timer(device)
    out = open(args.out, "a") if args.out else None
    env = dict(torch=torch.__version__,
               device=(torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"))
    print(f"torch {env['torch']} on {env['device']}", flush=True)
    rows = []

    def emit(record):
        record = dict(env, **record)
        rows.append(record)
        if out:
            out.write(json.dumps(record) + "\n")
            out.flush()
        line = (f"  {record.get('shape', ''):12} {record['phase']:8} "
                f"{record.get('tokens', ''):>7} {record.get('mode', ''):18} "
                f"{record['ms']:10.3f} ms")
        if "tok_s" in record:
            line += f" {record['tok_s']:12.1f} tok/s"
        if "tflops" in record:
            line += f" {record['tflops']:8.2f} TFLOP/s"
        if record.get("mfu") is not None:
            line += f" MFU {100 * record['mfu']:5.1f}%"
        if "gb_s" in record:
            line += f" {record['gb_s']:8.1f} GB/s"
        print(line, flush=True)

    with torch.inference_mode():
        gemm, gemm_ms = gemm_tflops(device, timer, args.gemm, 10)
        print("  shape        phase     tokens mode                       median ...", flush=True)
        emit(dict(phase="gemm", shape=f"bf16 {args.gemm}^3", ms=gemm_ms, tflops=gemm))
        for name in names:
            shape = shapes[name]
            max_positions = max(lengths + [c + CACHE_ROOM for c in contexts] + [4 * 512])
            t0 = time.perf_counter()
            m = Model(shape, device, dtype, args.seed, max_positions)
            attn = Attention(device)
            print(f"{name}: {m.layer_params / 1e6:.1f} M layer parameters, "
                  f"{sum(1 for L in m.layers if L.sliding)} of {len(m.layers)} layers "
                  f"sliding, built in {time.perf_counter() - t0:.1f} s", flush=True)

            def emit_shape(record, name=name, attn=attn):
                record["shape"] = name
                if "tflops" in record:
                    record["mfu"] = record["tflops"] / gemm
                record["attention"] = dict(causal=attn.causal_gqa, windowed=attn.masked)
                emit(record)

            if args.check:
                t, chunk, err = check(m, attn, shape["window"], device)
                print(f"  check ({t} tokens, chunks of {chunk}): relative max error of the "
                      f"last logits, chunked {err['chunked']:.2e}, prefill + decode "
                      f"{err['decode']:.2e}", flush=True)
                emit_shape(dict(phase="check", tokens=t, mode=f"chunks of {chunk}", ms=0.0,
                                errors=err))
                if max(err.values()) > 0.1:
                    print(f"  WARNING {name}: the forward passes disagree: {err}", flush=True)
            # The longest prefills last, so that a time limit cuts them rather than decode.
            runs = ([("prefill", t) for t in lengths if t <= 32768]
                    + [("decode", c) for c in contexts]
                    + [("prefill", t) for t in lengths if t > 32768])
            for phase, n in runs:
                try:
                    if phase == "prefill":
                        bench_prefill(m, attn, timer, n, args, emit_shape)
                    else:
                        bench_decode(m, timer, n, args, emit_shape)
                except Exception as e:  # report and go on with the next measurement
                    print(f"  {name} {phase} {n}: FAILED: {e!r}", flush=True)
                    emit_shape(dict(phase=phase, tokens=n, mode="failed", ms=float("nan"),
                                    error=repr(e)))
                    free_memory()
            del m
            free_memory()
    if out:
        out.close()


if __name__ == "__main__":
    main()
