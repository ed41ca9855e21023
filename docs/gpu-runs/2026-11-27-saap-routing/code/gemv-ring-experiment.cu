// Matrix-vector products: out [n] = w [n, k] · x [k] (+ bias [n]) (+ out), every projection
// of a decode step at batch 1. SPLIT warps of a block share a weight row, each lane
// streaming 16-byte chunks of it with DEPTH loads always in flight, and x (a few KiB, read by
// every warp) stays in L1. On an H200 this matches cuBLASLt on Llama-3-8B's large matrices
// and is faster on small ones (Gemma 3 270M's), where cuBLASLt's tiles, made for many rows,
// leave the GPU idle.
//
// Compiled by NVRTC with:
//   W_BF16     1 for bf16 weights and inputs, 0 for f16
//   SPLIT      warps per row (1, 2, 4 or 8): rows few against the GPU's warps are split, so
//              that every resident warp streams
//   DEPTH      16-byte loads each lane keeps in flight (a ring of registers: the slot just
//              used is refilled at once, with the next row's chunks past a row's end)
//
// Layouts are row-major; k is a multiple of 8 and w and x are 16-byte aligned (the caller
// checks). Products and sums are f32: each lane sums its columns in order, each warp adds its
// lanes' sums in a butterfly and the row's first warp adds the warps' sums in order, so a
// row's result depends on SPLIT but not on the grid.

#ifndef W_BF16
#define W_BF16 1
#endif
#ifndef SPLIT
#define SPLIT 1
#endif
#ifndef DEPTH
#define DEPTH 4
#endif

typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;

// 8 warps a block, SLOTS rows at a time.
#define THREADS 256
#define SLOTS (THREADS / 32 / SPLIT)

// Weights are read once: no room for them in L1, which holds x.
__device__ __forceinline__ uint4 load_streaming(const uint4* p) {
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
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

// The sequence of 16-byte chunks one lane reads: `steps` of each of its rows (row, row +
// stride, ...), chunk (step * SPLIT + part) * 32 + lane of the row at each step (zeros past
// the row's end, so every lane of the row's warps runs the same steps). `next` loads the
// sequence's next chunk (zeros past its end).
struct Cursor {
    const uint4* w;
    u32 row, step, left;
    __device__ __forceinline__ uint4 next(u32 chunks, u32 steps, u32 stride, u32 part, u32 lane) {
        uint4 v = {0u, 0u, 0u, 0u};
        if (left > 0) {
            const u32 c = (step * SPLIT + part) * 32 + lane;
            if (c < chunks) v = load_streaming(w + (u64)row * chunks + c);
            --left;
            if (++step == steps) {
                step = 0;
                row += stride;
            }
        }
        return v;
    }
};

// Each slot of SPLIT warps takes rows first, first + stride, ... (stride: the grid's slots).
//
// Launched as a programmatic dependent launch: the weights are not the previous launch's
// output, so each lane loads its first DEPTH chunks before it waits for that launch
// (griddepcontrol.wait; a no-op when launched plainly), and the weight stream starts while a
// norm or an activation still runs. Nothing the previous launch writes or reads (x, out) is
// touched before the wait.
extern "C" __global__ void __launch_bounds__(THREADS)
    gemv(const uint4* __restrict__ w, const uint4* __restrict__ x,
         const float* __restrict__ bias, u32 n, u32 k, u32 accumulate, float* __restrict__ out) {
    const u32 lane = threadIdx.x & 31, warp = threadIdx.x / 32;
    const u32 slot = warp / SPLIT, part = warp % SPLIT;
    const u32 chunks = k / 8;
    const u32 steps = (chunks + 32 * SPLIT - 1) / (32 * SPLIT);
    const u32 stride = gridDim.x * SLOTS, first = blockIdx.x * SLOTS + slot;
    const u32 rows = first < n ? (n - 1 - first) / stride + 1 : 0;
    const u32 total = rows * steps;
    Cursor loads = {w, first, 0, total};
    uint4 ring[DEPTH];
#pragma unroll
    for (int u = 0; u < DEPTH; ++u) ring[u] = loads.next(chunks, steps, stride, part, lane);
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
#if SPLIT > 1
    // Each warp's sum of a row, by the row's parity: the row's first warp reads row r's
    // after the slot's barrier, and the others write row r + 1's before the next one.
    __shared__ float sums[2][SLOTS][SPLIT];
    u32 parity = 0;
#endif
    u32 row = first, step = 0;
    float acc = 0.0f;
    for (u32 t0 = 0; t0 < total; t0 += DEPTH) {
#pragma unroll
        for (int u = 0; u < DEPTH; ++u) {
            if (t0 + u < total) {
                const u32 c = (step * SPLIT + part) * 32 + lane;
                if (c < chunks) acc = dot8(acc, ring[u], __ldg(x + c));
                ring[u] = loads.next(chunks, steps, stride, part, lane);
                if (++step == steps) {
#pragma unroll
                    for (int offset = 16; offset > 0; offset >>= 1)
                        acc += __shfl_xor_sync(0xffffffffu, acc, offset);
#if SPLIT > 1
                    if (lane == 0) sums[parity][slot][part] = acc;
                    // The slot's warps only (named barrier 1 + slot; 0 is __syncthreads').
                    asm volatile("bar.sync %0, %1;" ::"r"(1 + slot), "r"(SPLIT * 32) : "memory");
                    acc = 0.0f;
                    if (part == 0) {
#pragma unroll
                        for (int s = 0; s < SPLIT; ++s) acc += sums[parity][slot][s];
                    }
                    parity ^= 1;
#endif
                    if (part == 0 && lane == 0) {
                        if (bias != nullptr) acc += bias[row];
                        out[row] = accumulate ? out[row] + acc : acc;
                    }
                    acc = 0.0f;
                    step = 0;
                    row += stride;
                }
            }
        }
    }
}
