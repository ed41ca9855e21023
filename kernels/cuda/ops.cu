// The element-wise kernels of the model's forward pass: embedding lookup, RMSNorm (alone and
// fused with the residual add), the fused Q/K/V post-processing of attention's inputs
// (bias, per-head norms, f16 rounding, the store's copy, RoPE, the KV buffer write), the
// RoPE of keys already in a KV buffer (a stored corpus's), the gated activation of the MLP,
// type conversion, a bias add and the greedy choice of a row of logits.
//
// Compiled by NVRTC, once per entry point and element types, after gate.cuh, with these
// defines:
//   TABLE_T, IN_T, OUT_T, KV_T  element types (float, __half or __nv_bfloat16): the embedding
//                  table, convert's input, an output, attention's queries and KV buffer
//   NORMED          ops_add_rms_norm: 1 to normalise y before adding it, 0 to add it as is
//   THEN            ops_add_rms_norm: 1 to also write RMSNorm of the new residual to
//                   next_out (OUT_T), 0 not to
//
// Layouts are row-major and every row is contiguous. The residual stream, projection outputs
// and norm weights are float. Arithmetic is float, in the CPU's order where it matters:
// `--use_fast_math` is on, so division and square root use the `__fdiv_rn`/`__fsqrt_rn`
// intrinsics (IEEE round-to-nearest whatever the flags) and RoPE's products `__fmul_rn`
// (never contracted into an FMA), as the CPU computes them. `exp` is `__expf` (a few ulp).

// No headers: NVRTC 13.0 has no built-in cuda_fp16.h / cuda_bf16.h and `Gpu` passes no
// include path, so the two 16-bit types (named as `Float::NAME` names them) and their
// conversions are written here, as in attend.cu.
struct __half {
    unsigned short bits;
};
struct __nv_bfloat16 {
    unsigned short bits;
};

// Element types an entry point does not use still need a definition: the whole file is
// compiled for each entry.
#ifndef TABLE_T
#define TABLE_T float
#endif
#ifndef OUT_T
#define OUT_T float
#endif
#ifndef IN_T
#define IN_T float
#endif
#ifndef KV_T
#define KV_T float
#endif
#ifndef NORMED
#define NORMED 0
#endif
#ifndef THEN
#define THEN 0
#endif

typedef unsigned int u32;
typedef unsigned long long u64;

// Threads of the row kernels: 8 warps.
#define ROW_THREADS 256
#define WARPS (ROW_THREADS / 32)
// Threads of the norms (one block per row): a decode step normalises one row, so the block
// alone reads it, and its latency is that of its loads. 1,024 threads each with NORM_UNROLL
// independent loads in flight read a row of 4,096 in one round trip.
#define NORM_THREADS 1024
#define ARGMAX_THREADS 256
#define NORM_UNROLL 4
// The longest head ops_attention_inputs handles (its per-warp buffer in shared memory).
#define MAX_HEAD_DIM 512

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x.bits));
    return f;
}
__device__ __forceinline__ float to_float(__nv_bfloat16 x) {
    return __uint_as_float((u32)x.bits << 16);
}

// Rounds to the element type (nearest even).
template <typename X> __device__ __forceinline__ X from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_float<__half>(float x) {
    __half h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h.bits) : "f"(x));
    return h;
}
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
    __nv_bfloat16 h;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h.bits) : "f"(x));
    return h;
}

// Sum over a warp; every lane gets the same bits (each butterfly step adds the same two
// numbers on both lanes, a + b == b + a).
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// Sum over the block (a whole number of warps, at most 32), in the same order on every run:
// no atomics. Every thread gets the total. `scratch` holds 32 floats.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
    v = warp_sum(v);
    const u32 warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = lane < blockDim.x / 32 ? scratch[lane] : 0.0f;
    v = warp_sum(v);
    // Before anyone writes scratch again.
    __syncthreads();
    return v;
}

// RMSNorm's divisor, as candle's CPU kernel computes it: sqrt(sum(x²) / n + eps).
__device__ __forceinline__ float rms(float sum_squares, u32 n, float eps) {
    return __fsqrt_rn(__fdiv_rn(sum_squares, (float)n) + eps);
}

// One element of a norm: x / rms * (weight + offset), the CPU's order.
__device__ __forceinline__ float normed(float x, float rms, float weight, float offset) {
    return __fmul_rn(__fdiv_rn(x, rms), weight + offset);
}

// Every kernel here is a programmatic dependent launch (`Gpu::launch_raw`, Hopper on): its
// blocks may be resident before the launch before it on the stream has finished, so that a
// decode step's chain of short kernels does not pay each launch's start-up in turn. So each
// first waits for that launch (griddepcontrol.wait: it has finished and its writes are
// visible; a no-op when launched plainly) before it touches any buffer, then lets the launch
// after it start its blocks (which wait in turn, or, as `gemv`, read only their weights
// first). Called by every entry point of this file before it reads any buffer but the
// model's constants (attention's inputs compute their RoPE angles first).
__device__ __forceinline__ void follow_previous_launch() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;");
#endif
}

// out [rows, hidden] (float) = table[ids[row]] * scale; a row of zeros for an id >= vocab.
// Grid: rows × (blocks per row), the row's elements strided over its blocks' threads.
extern "C" __global__ void __launch_bounds__(ROW_THREADS)
    ops_embed(const TABLE_T* __restrict__ table, u32 vocab, u32 hidden, const u32* __restrict__ ids,
              float scale, float* __restrict__ out) {
    follow_previous_launch();
    const u32 id = ids[blockIdx.x];
    float* dst = out + (u64)blockIdx.x * hidden;
    const u32 first = blockIdx.y * blockDim.x + threadIdx.x, stride = gridDim.y * blockDim.x;
    if (id >= vocab) {
        for (u32 j = first; j < hidden; j += stride) dst[j] = 0.0f;
        return;
    }
    const TABLE_T* src = table + (u64)id * hidden;
    for (u32 j = first; j < hidden; j += stride) dst[j] = to_float(src[j]) * scale;
}

// v[u] = p[base + u * NORM_THREADS] for the NORM_UNROLL elements of one step of a norm's
// strided loop (0 past width): independent loads, all issued before any is used.
__device__ __forceinline__ void load_step(const float* __restrict__ p, u32 width, u32 base,
                                          float (&v)[NORM_UNROLL]) {
#pragma unroll
    for (int u = 0; u < NORM_UNROLL; ++u) {
        const u32 j = base + u * NORM_THREADS;
        v[u] = j < width ? p[j] : 0.0f;
    }
}

// sum(row[j]²) over the block: thread t sums elements t, t + NORM_THREADS, ... in order,
// NORM_UNROLL loads issued before any is used; then block_sum.
__device__ __forceinline__ float sum_squares(const float* __restrict__ row, u32 width,
                                             float* scratch) {
    float ss = 0.0f;
    for (u32 base = threadIdx.x; base < width; base += NORM_THREADS * NORM_UNROLL) {
        float v[NORM_UNROLL];
        load_step(row, width, base, v);
#pragma unroll
        for (int u = 0; u < NORM_UNROLL; ++u) ss += v[u] * v[u];
    }
    return block_sum(ss, scratch);
}

// dst [width] (OUT_T) = row [width] normed by its 1/rms r and weight (ops_rms_norm's loop,
// also the one after a residual add): each thread its elements in the sums' order.
__device__ __forceinline__ void store_normed(const float* row, u32 width, float r,
                                             const float* __restrict__ weight, float offset,
                                             OUT_T* __restrict__ dst) {
    for (u32 base = threadIdx.x; base < width; base += NORM_THREADS * NORM_UNROLL) {
        float v[NORM_UNROLL], w[NORM_UNROLL];
        load_step(row, width, base, v);
        load_step(weight, width, base, w);
#pragma unroll
        for (int u = 0; u < NORM_UNROLL; ++u) {
            const u32 j = base + u * NORM_THREADS;
            if (j < width) dst[j] = from_float<OUT_T>(normed(v[u], r, w[u], offset));
        }
    }
}

// out [rows, width] (OUT_T) = RMSNorm(x [rows, width]) with weight [width]. Grid: one block
// of NORM_THREADS per row.
extern "C" __global__ void __launch_bounds__(NORM_THREADS)
    ops_rms_norm(const float* __restrict__ x, u32 width, const float* __restrict__ weight,
                 float eps, float offset, OUT_T* __restrict__ out) {
    follow_previous_launch();
    __shared__ float scratch[32];
    const float* row = x + (u64)blockIdx.x * width;
    const float r = rms(sum_squares(row, width, scratch), width, eps);
    store_normed(row, width, r, weight, offset, out + (u64)blockIdx.x * width);
}

// residual [rows, width] += RMSNorm(y) (NORMED 1) or y (NORMED 0); with THEN 1, also
// next_out [rows, width] (OUT_T) = RMSNorm(new residual) by next_weight: the norm that
// follows a sublayer's residual add (Gemma's post-norm, then the next sublayer's input norm)
// in one launch, with the numbers ops_rms_norm would give (each thread sums the squares of
// the elements it wrote in ops_rms_norm's order, then block_sum). Grid: one block of
// NORM_THREADS per row.
extern "C" __global__ void __launch_bounds__(NORM_THREADS)
    ops_add_rms_norm(float* __restrict__ residual, const float* __restrict__ y, u32 width,
                     const float* __restrict__ weight, float eps, float offset,
                     const float* __restrict__ next_weight, float next_eps, float next_offset,
                     OUT_T* __restrict__ next_out) {
    follow_previous_launch();
    const float* row = y + (u64)blockIdx.x * width;
    float* dst = residual + (u64)blockIdx.x * width;
#if NORMED || THEN
    __shared__ float scratch[32];
#endif
#if NORMED
    const float r = rms(sum_squares(row, width, scratch), width, eps);
#endif
#if THEN
    float ss = 0.0f;
#endif
    for (u32 base = threadIdx.x; base < width; base += NORM_THREADS * NORM_UNROLL) {
        float v[NORM_UNROLL], old[NORM_UNROLL];
        load_step(row, width, base, v);
        load_step(dst, width, base, old);
#if NORMED
        float w[NORM_UNROLL];
        load_step(weight, width, base, w);
#endif
#pragma unroll
        for (int u = 0; u < NORM_UNROLL; ++u) {
            const u32 j = base + u * NORM_THREADS;
#if NORMED
            const float sum = __fadd_rn(old[u], normed(v[u], r, w[u], offset));
#else
            const float sum = __fadd_rn(old[u], v[u]);
#endif
            if (j < width) dst[j] = sum;
#if THEN
            // Past the width both loads gave 0, and so does the sum: ops_rms_norm's 0 too.
            ss += sum * sum;
#endif
        }
    }
#if THEN
    // Each thread reads back only what it wrote itself.
    const float r_next = rms(block_sum(ss, scratch), width, next_eps);
    store_normed(dst, width, r_next, next_weight, next_offset, next_out + (u64)blockIdx.x * width);
#endif
}

// RoPE of one pair, as the CPU computes it: products rounded separately, then the sum.
__device__ __forceinline__ float2 rotate(float x0, float x1, float c, float s) {
    return make_float2(__fsub_rn(__fmul_rn(x0, c), __fmul_rn(x1, s)),
                       __fadd_rn(__fmul_rn(x0, s), __fmul_rn(x1, c)));
}

// cos_t/sin_t [half_dim] (shared) = the angles of position's pairs: in double, rounded to
// float. Every thread of the block calls it; they all see the table on return.
__device__ __forceinline__ void rope_table(u64 position, const double* __restrict__ inv_freq,
                                           u32 half_dim, float* cos_t, float* sin_t) {
    for (u32 i = threadIdx.x; i < half_dim; i += blockDim.x) {
        double s, c;
        sincos((double)position * inv_freq[i], &s, &c);
        cos_t[i] = (float)c;
        sin_t[i] = (float)s;
    }
    __syncthreads();
}

// Attention's inputs of one chunk of tokens, from the fused projection's output
// qkv [tokens, heads + 2 * kv_heads, head_dim] (float): per head, in order,
//   1. + bias [(heads + 2 * kv_heads) * head_dim] (if bias != 0);
//   2. RMSNorm over head_dim: query heads by q_weight, key heads by k_weight (if != 0);
//   3. keys and values rounded to f16 and back (if round_kv);
//   4. keys and values copied to store_keys/store_values [tokens, kv_heads, head_dim] as
//      f16 (if != 0): the store keeps keys before RoPE; queries before RoPE copied to
//      store_query [heads, head_dim] (float, if != 0: this token's row of the store's
//      queries, which its kernel finds): what searches take;
//   5. queries and keys rotated at position first_position + token: angle in double,
//      cos/sin rounded to float, pairs (i, i + d/2) or (2i, 2i + 1) if interleaved;
//   6. queries written to queries [tokens, heads, head_dim] (KV_T), keys and values to row
//      kv_head * capacity + position % capacity of keys/values (KV_T).
// Grid: tokens × (blocks per token), each warp one head at a time (heads strided over the
// token's blocks' warps), the head in shared memory. The body below places token `token` at
// `position` of keys/values; the two kernels after it say where those come from.
__device__ __forceinline__ void attention_inputs(
    const float* __restrict__ qkv, const float* __restrict__ bias, u32 heads, u32 kv_heads,
    u32 head_dim, const float* __restrict__ q_weight, float q_eps, float q_offset,
    const float* __restrict__ k_weight, float k_eps, float k_offset,
    const double* __restrict__ inv_freq, u32 interleaved, u32 round_kv,
    __half* __restrict__ store_keys, __half* __restrict__ store_values,
    float* __restrict__ store_query, KV_T* __restrict__ queries, u32 token, u64 position,
    KV_T* __restrict__ keys, KV_T* __restrict__ values, u32 capacity) {
    __shared__ float cos_t[MAX_HEAD_DIM / 2], sin_t[MAX_HEAD_DIM / 2];
    __shared__ float buffer[WARPS][MAX_HEAD_DIM];
    const u32 half_dim = head_dim / 2;
    // The angles depend on nothing the launch before writes: computed (in double, the
    // slowest part of a decode step's call) while it finishes.
    rope_table(position, inv_freq, half_dim, cos_t, sin_t);
    follow_previous_launch();

    const u32 warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const u32 all_heads = heads + 2 * kv_heads;
    const u64 slot = position % capacity;
    float* x = buffer[warp];
    // The loop bounds are the same on all lanes of a warp, so __syncwarp is safe.
    for (u32 h = blockIdx.y * WARPS + warp; h < all_heads; h += WARPS * gridDim.y) {
        const bool is_query = h < heads, is_value = h >= heads + kv_heads;
        const u32 kv_head = is_query ? 0 : (is_value ? h - heads - kv_heads : h - heads);
        const float* src = qkv + ((u64)token * all_heads + h) * head_dim;
        float ss = 0.0f;
        for (u32 j = lane; j < head_dim; j += 32) {
            float v = src[j];
            if (bias) v = __fadd_rn(v, bias[(u64)h * head_dim + j]);
            x[j] = v;
            ss += v * v;
        }
        const float* weight = is_query ? q_weight : (is_value ? nullptr : k_weight);
        if (weight) {
            const float r = rms(warp_sum(ss), head_dim, is_query ? q_eps : k_eps);
            const float offset = is_query ? q_offset : k_offset;
            for (u32 j = lane; j < head_dim; j += 32) x[j] = normed(x[j], r, weight[j], offset);
        }
        if (is_query && store_query) {
            float* dst = store_query + (u64)h * head_dim;
            for (u32 j = lane; j < head_dim; j += 32) dst[j] = x[j];
        }
        if (!is_query) {
            const u64 store_row = ((u64)token * kv_heads + kv_head) * head_dim;
            __half* store = is_value ? store_values : store_keys;
            for (u32 j = lane; j < head_dim; j += 32) {
                const __half rounded = from_float<__half>(x[j]);
                if (round_kv) x[j] = to_float(rounded);
                if (store) store[store_row + j] = rounded;
            }
        }
        if (is_value) {
            KV_T* dst = values + ((u64)kv_head * capacity + slot) * head_dim;
            for (u32 j = lane; j < head_dim; j += 32) dst[j] = from_float<KV_T>(x[j]);
        } else {
            KV_T* dst = is_query ? queries + ((u64)token * heads + h) * head_dim
                              : keys + ((u64)kv_head * capacity + slot) * head_dim;
            // Pairs mix lanes: everything this warp wrote to x first.
            __syncwarp();
            for (u32 i = lane; i < half_dim; i += 32) {
                const u32 a = interleaved ? 2 * i : i, b = interleaved ? 2 * i + 1 : i + half_dim;
                const float2 y = rotate(x[a], x[b], cos_t[i], sin_t[i]);
                dst[a] = from_float<KV_T>(y.x);
                dst[b] = from_float<KV_T>(y.y);
            }
        }
        // Before the next head overwrites x.
        __syncwarp();
    }
}

// One sequence's chunk: token t at position first_position + t of keys/values. The store
// keeps the queries of the positions p with (p + 1) % query_every == 0 only (a sample, one
// row each in order; query_every 1 keeps every token's).
extern "C" __global__ void __launch_bounds__(ROW_THREADS) ops_attention_inputs(
    const float* __restrict__ qkv, const float* __restrict__ bias, u32 heads, u32 kv_heads,
    u32 head_dim, const float* __restrict__ q_weight, float q_eps, float q_offset,
    const float* __restrict__ k_weight, float k_eps, float k_offset,
    const double* __restrict__ inv_freq, u32 interleaved, u64 first_position, u32 round_kv,
    __half* __restrict__ store_keys, __half* __restrict__ store_values,
    float* __restrict__ store_queries, u32 query_every, KV_T* __restrict__ queries,
    KV_T* __restrict__ keys, KV_T* __restrict__ values, u32 capacity) {
    const u64 position = first_position + blockIdx.x, after = position + 1;
    float* store_query = nullptr;
    if (store_queries && after % query_every == 0) {
        // The sampled positions before this one, less those before the chunk.
        const u64 row = after / query_every - 1 - first_position / query_every;
        store_query = store_queries + row * heads * head_dim;
    }
    attention_inputs(qkv, bias, heads, kv_heads, head_dim, q_weight, q_eps, q_offset, k_weight,
                     k_eps, k_offset, inv_freq, interleaved, round_kv, store_keys, store_values,
                     store_query, queries, blockIdx.x, position, keys, values, capacity);
}

// Where each row of a batched decode step goes: one token of each of up to MAX_TARGET_ROWS
// sequences, row t at position[t] of its own keys/values (addresses) of capacity[t] rows a
// KV head. A launch parameter, so that a step's layer places all its rows in one launch
// with nothing to upload first.
#define MAX_TARGET_ROWS 32
struct RowTargets {
    u64 position[MAX_TARGET_ROWS];
    u64 keys[MAX_TARGET_ROWS];
    u64 values[MAX_TARGET_ROWS];
    u64 capacity[MAX_TARGET_ROWS];
};

// A batched decode step's rows, token t (one row of qkv, queries and the store's rows) to
// targets' row t.
extern "C" __global__ void __launch_bounds__(ROW_THREADS) ops_attention_inputs_rows(
    const float* __restrict__ qkv, const float* __restrict__ bias, u32 heads, u32 kv_heads,
    u32 head_dim, const float* __restrict__ q_weight, float q_eps, float q_offset,
    const float* __restrict__ k_weight, float k_eps, float k_offset,
    const double* __restrict__ inv_freq, u32 interleaved, u32 round_kv,
    __half* __restrict__ store_keys, __half* __restrict__ store_values,
    float* __restrict__ store_queries, KV_T* __restrict__ queries, const RowTargets targets) {
    const u32 t = blockIdx.x;
    attention_inputs(qkv, bias, heads, kv_heads, head_dim, q_weight, q_eps, q_offset, k_weight,
                     k_eps, k_offset, inv_freq, interleaved, round_kv, store_keys, store_values,
                     store_queries ? store_queries + (u64)t * heads * head_dim : nullptr,
                     queries, t, targets.position[t],
                     reinterpret_cast<KV_T*>(targets.keys[t]),
                     reinterpret_cast<KV_T*>(targets.values[t]), (u32)targets.capacity[t]);
}

// Rotates keys [kv_heads, tokens, head_dim] (KV_T, a KV buffer's layout) in place, row t at
// position first_position + t, exactly as ops_attention_inputs rotates a key whose value is
// already rounded to KV_T: a stored corpus's keys (f16, pre-RoPE) uploaded as they are give
// the numbers the model's own keys would have. Grid: one block per token.
extern "C" __global__ void __launch_bounds__(ROW_THREADS)
    ops_rotate_keys(KV_T* __restrict__ keys, u32 kv_heads, u32 tokens, u32 head_dim,
                    const double* __restrict__ inv_freq, u32 interleaved, u64 first_position) {
    follow_previous_launch();
    __shared__ float cos_t[MAX_HEAD_DIM / 2], sin_t[MAX_HEAD_DIM / 2];
    const u32 token = blockIdx.x, half_dim = head_dim / 2;
    rope_table(first_position + token, inv_freq, half_dim, cos_t, sin_t);
    for (u32 k = threadIdx.x; k < kv_heads * half_dim; k += blockDim.x) {
        const u32 head = k / half_dim, i = k % half_dim;
        KV_T* row = keys + ((u64)head * tokens + token) * head_dim;
        const u32 a = interleaved ? 2 * i : i, b = interleaved ? 2 * i + 1 : i + half_dim;
        const float2 y = rotate(to_float(row[a]), to_float(row[b]), cos_t[i], sin_t[i]);
        row[a] = from_float<KV_T>(y.x);
        row[b] = from_float<KV_T>(y.y);
    }
}

// out [rows, width] (OUT_T) = act(gate) * up (gate_activation, gate.cuh), each row of
// gate_up [rows, 2 * width] being [gate, up]. Grid-stride over the n = rows * width outputs.
extern "C" __global__ void ops_gated_activation(const float* __restrict__ gate_up, u32 width,
                                                u64 n, u32 act, OUT_T* __restrict__ out) {
    follow_previous_launch();
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (u64)gridDim.x * blockDim.x) {
        const u64 row = i / width, col = i % width;
        const float g = gate_up[2 * row * width + col], u = gate_up[(2 * row + 1) * width + col];
        out[i] = from_float<OUT_T>(gate_activation(g, u, act));
    }
}

// out[i] = x[i] converted from IN_T to OUT_T (through float). Grid-stride.
extern "C" __global__ void ops_convert(const IN_T* __restrict__ x, u64 n, OUT_T* __restrict__ out) {
    follow_previous_launch();
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (u64)gridDim.x * blockDim.x)
        out[i] = from_float<OUT_T>(to_float(x[i]));
}

// The greedy choice of each row of logits [rows, n] (float): the first index of the row's
// largest value, as candle's CPU argmax scans a row (it replaces its pick only by a strictly
// larger value, so NaNs are never picked, unless the row starts with one: then 0). Values are
// compared by their bits alone (no float arithmetic, so neither fast math nor flushed
// denormals change a pick): each candidate is a 64-bit key, the value's bits mapped to an
// order-preserving unsigned integer above the index's complement, and the largest key wins.
// A row (blockIdx.x) is split over gridDim.y blocks of `per_block` values (one block reading a 256K-token
// vocabulary alone took 117 us on an H200): each folds its best key into the row's `keys`
// entry with an atomic max, and the row's last block to finish (counted in `done`) writes the
// pick and sets both entries back to zero for the next launch (they start at zero).
__device__ __forceinline__ u64 argmax_key(float x, u32 i) {
    u32 b = __float_as_uint(x);
    if ((b & 0x7fffffffu) > 0x7f800000u) return 0;  // NaN: below every number's key
    if (b == 0x80000000u) b = 0;                    // -0 equals +0
    const u32 ordered = (b & 0x80000000u) ? ~b : (b | 0x80000000u);
    return ((u64)ordered << 32) | (u64)(0xffffffffu - i);
}

__device__ __forceinline__ u64 warp_max_u64(u64 v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const u64 other = __shfl_xor_sync(0xffffffffu, v, o);
        v = other > v ? other : v;
    }
    return v;
}

extern "C" __global__ void __launch_bounds__(ARGMAX_THREADS)
    ops_argmax_rows(const float* __restrict__ logits, u32 n, u32 per_block,
                    unsigned long long* __restrict__ keys, u32* __restrict__ done,
                    u32* __restrict__ out) {
    follow_previous_launch();
    __shared__ u64 scratch[ARGMAX_THREADS / 32];
    const u32 row = blockIdx.x;
    const float* x = logits + (u64)row * n;
    const u32 start = blockIdx.y * per_block;
    const u32 end = min(n, start + per_block);
    u64 best = 0;
    for (u32 i = start + threadIdx.x; i < end; i += blockDim.x) {
        const u64 key = argmax_key(x[i], i);
        best = key > best ? key : best;
    }
    best = warp_max_u64(best);
    const u32 warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (lane == 0) scratch[warp] = best;
    __syncthreads();
    if (threadIdx.x != 0) return;
    for (u32 w = 1; w < blockDim.x / 32; ++w) best = scratch[w] > best ? scratch[w] : best;
    atomicMax(&keys[row], (unsigned long long)best);
    // The max is visible before the count that lets the last block read it.
    __threadfence();
    if (atomicAdd(&done[row], 1u) + 1 != gridDim.y) return;
    best = atomicExch(&keys[row], 0ull);
    done[row] = 0;
    // A NaN first, or a row of NaNs (no key above 0): candle keeps index 0.
    const bool first_nan = (__float_as_uint(x[0]) & 0x7fffffffu) > 0x7f800000u;
    out[row] = first_nan || best == 0 ? 0u : 0xffffffffu - (u32)best;
}

// out [rows, n] += bias [n] (float). Grid-stride over the rows * n elements.
extern "C" __global__ void ops_add_bias(float* __restrict__ out, const float* __restrict__ bias,
                                        u32 n, u64 len) {
    follow_previous_launch();
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < len;
         i += (u64)gridDim.x * blockDim.x)
        out[i] = __fadd_rn(out[i], bias[i % n]);
}
