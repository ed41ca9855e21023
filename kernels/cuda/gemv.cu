// Matrix-vector products: out [n] = w [n, k] · x [k] (+ bias [n]) (+ out), every projection
// of a decode step at batch 1. Each warp streams one weight row, 16 bytes a lane with
// several loads in flight, and x (a few KiB, read by every warp) stays in L1. On an H200
// this matches cuBLASLt on Llama-3-8B's large matrices and is faster on small ones (Gemma 3
// 270M's), where cuBLASLt's tiles, made for many rows, leave the GPU idle.
//
// Compiled by NVRTC after gate.cuh with:
//   W_BF16     1 for bf16 weights and inputs, 0 for f16
//   X_F32      1 for f32 inputs, each rounded to the weights' type as it is read (the numbers
//              of converting x first: a decode step's attention output goes straight into
//              the output projection), 0 for inputs in the weights' type
//
// Layouts are row-major; k is a multiple of 8 and w and x are 16-byte aligned (the caller
// checks). Products and sums are f32: each lane sums its columns in order, then the warp
// adds its lanes' sums in a butterfly, so a row's result does not depend on the launch.

#ifndef W_BF16
#define W_BF16 1
#endif
#ifndef X_F32
#define X_F32 0
#endif

typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;

// 8 warps a block; loads of 16 bytes each lane keeps in flight.
#define THREADS 256
#define UNROLL 4

// Weights are read once: no room for them in L1, which holds x.
__device__ __forceinline__ uint4 load_streaming(const uint4* p) {
    uint4 v;
    asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
        : "l"(p));
    return v;
}

// The two 16-bit elements of a word as f32, low first.
__device__ __forceinline__ void unpack2(u32 word, float& lo, float& hi) {
#if W_BF16
    lo = __uint_as_float(word << 16);
    hi = __uint_as_float(word & 0xffff0000u);
#else
    asm("cvt.f32.f16 %0, %1;" : "=f"(lo) : "h"((u16)(word & 0xffffu)));
    asm("cvt.f32.f16 %0, %1;" : "=f"(hi) : "h"((u16)(word >> 16)));
#endif
}

// acc + the dot product of 8 weights and 8 inputs, in column order.
__device__ __forceinline__ float dot8(float acc, uint4 w, uint4 x) {
    const u32 ws[4] = {w.x, w.y, w.z, w.w};
    const u32 xs[4] = {x.x, x.y, x.z, x.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        float w0, w1, x0, x1;
        unpack2(ws[i], w0, w1);
        unpack2(xs[i], x0, x1);
        acc = fmaf(w0, x0, acc);
        acc = fmaf(w1, x1, acc);
    }
    return acc;
}

// Two f32 rounded to the weights' type (nearest even), lo in the low half.
__device__ __forceinline__ u32 round_pair(float lo, float hi) {
    u32 d;
#if W_BF16
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
#else
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
#endif
    return d;
}

// Chunk c of x (8 inputs) in the weights' type: 16 bytes as they are, or 32 bytes of f32
// rounded.
#if X_F32
typedef float4 XChunk;
__device__ __forceinline__ uint4 load_x(const XChunk* __restrict__ x, u32 c) {
    const float4 a = __ldg(x + 2 * c), b = __ldg(x + 2 * c + 1);
    return make_uint4(round_pair(a.x, a.y), round_pair(a.z, a.w), round_pair(b.x, b.y),
                      round_pair(b.z, b.w));
}
#else
typedef uint4 XChunk;
__device__ __forceinline__ uint4 load_x(const XChunk* __restrict__ x, u32 c) {
    return __ldg(x + c);
}
#endif

// The UNROLL chunks of a row from chunk `base` on (zeros past its end), loaded before any is
// used.
__device__ __forceinline__ void load_batch(const uint4* w_row, u32 base, u32 chunks,
                                           uint4 (&wv)[UNROLL]) {
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
        const u32 c = base + u * 32;
        const uint4 zero = {0u, 0u, 0u, 0u};
        wv[u] = c < chunks ? load_streaming(w_row + c) : zero;
    }
}

// One warp per weight row at a time (rows strided over the grid's warps). Lane l reads the
// row's 16-byte chunks l, l + 32, l + 64, ..., UNROLL of them before it uses any.
//
// Launched as a programmatic dependent launch: the weights are not the previous launch's
// output, so each warp loads its first row's first chunks before it waits for that launch
// (griddepcontrol.wait; a no-op when launched plainly), and the weight stream starts while a
// norm, the gated product or the attention still runs. Nothing the previous launch writes or reads (x, out) is
// touched before the wait. A row's first chunks are likewise loaded before the row before it
// is summed across the warp.
extern "C" __global__ void __launch_bounds__(THREADS)
    gemv(const uint4* __restrict__ w, const XChunk* __restrict__ x,
         const float* __restrict__ bias, u32 n, u32 k, u32 accumulate, float* __restrict__ out) {
    const u32 lane = threadIdx.x & 31;
    const u32 chunks = k / 8;
    const u32 warps = gridDim.x * (THREADS / 32);
    u32 row = blockIdx.x * (THREADS / 32) + threadIdx.x / 32;
    // Invariant at the top of each row: wv holds its chunks from `lane` on.
    uint4 wv[UNROLL];
    if (row < n) load_batch(w + (u64)row * chunks, lane, chunks, wv);
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
    // The launch after this one (a norm, attention's inputs, the attention: programmatic
    // dependent launches that wait for this grid first) may start its blocks now.
    asm volatile("griddepcontrol.launch_dependents;");
#endif
    for (; row < n; row += warps) {
        const uint4* w_row = w + (u64)row * chunks;
        float acc = 0.0f;
        for (u32 base = lane; base < chunks; base += 32 * UNROLL) {
            if (base != lane) load_batch(w_row, base, chunks, wv);
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) {
                const u32 c = base + u * 32;
                if (c < chunks) acc = dot8(acc, wv[u], load_x(x, c));
            }
        }
        if (row + warps < n) load_batch(w + (u64)(row + warps) * chunks, lane, chunks, wv);
#pragma unroll
        for (int offset = 16; offset > 0; offset >>= 1)
            acc += __shfl_xor_sync(0xffffffffu, acc, offset);
        if (lane == 0) {
            if (bias != nullptr) acc += bias[row];
            out[row] = accumulate ? out[row] + acc : acc;
        }
    }
}

// The element type's bits of x, rounded to nearest even.
__device__ __forceinline__ u16 round16(float x) {
    u16 h;
#if W_BF16
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(x));
#else
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(x));
#endif
    return h;
}

// The MLP's first product and its gated activation in one launch: out [n] (16-bit) =
// act(w[r] · x) * (w[n + r] · x) for the gate rows r < n and the up rows after them of
// w [2n, k], each dot product exactly as `gemv` sums it and the activation as
// ops_gated_activation computes it (gate_activation), so that the result equals `gemv` then
// ops_gated_activation to the bit. One warp per gate row at a time, streaming its gate and
// up rows together; a programmatic dependent launch as `gemv`.
extern "C" __global__ void __launch_bounds__(THREADS)
    gemv_gated(const uint4* __restrict__ w, const XChunk* __restrict__ x, u32 n, u32 k, u32 act,
               u16* __restrict__ out) {
    const u32 lane = threadIdx.x & 31;
    const u32 chunks = k / 8;
    const u32 warps = gridDim.x * (THREADS / 32);
    u32 row = blockIdx.x * (THREADS / 32) + threadIdx.x / 32;
    uint4 gv[UNROLL], uv[UNROLL];
    if (row < n) {
        load_batch(w + (u64)row * chunks, lane, chunks, gv);
        load_batch(w + (u64)(n + row) * chunks, lane, chunks, uv);
    }
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;");
#endif
    for (; row < n; row += warps) {
        const uint4* g_row = w + (u64)row * chunks;
        const uint4* u_row = w + (u64)(n + row) * chunks;
        float g = 0.0f, u = 0.0f;
        for (u32 base = lane; base < chunks; base += 32 * UNROLL) {
            if (base != lane) {
                load_batch(g_row, base, chunks, gv);
                load_batch(u_row, base, chunks, uv);
            }
#pragma unroll
            for (int i = 0; i < UNROLL; ++i) {
                const u32 c = base + i * 32;
                if (c < chunks) {
                    const uint4 xc = load_x(x, c);
                    g = dot8(g, gv[i], xc);
                    u = dot8(u, uv[i], xc);
                }
            }
        }
        if (row + warps < n) {
            load_batch(w + (u64)(row + warps) * chunks, lane, chunks, gv);
            load_batch(w + (u64)(n + row + warps) * chunks, lane, chunks, uv);
        }
#pragma unroll
        for (int offset = 16; offset > 0; offset >>= 1) {
            g += __shfl_xor_sync(0xffffffffu, g, offset);
            u += __shfl_xor_sync(0xffffffffu, u, offset);
        }
        if (lane == 0) out[row] = round16(gate_activation(g, u, act));
    }
}
