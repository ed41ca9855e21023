// The Hopper kernel, prefill_hopper: prefill.cu's causal attention on warpgroup MMAs
// (wgmma, sm_90a). The launcher appends this file to prefill.cu's source and defines
// WARPGROUPS besides HEAD_DIM (64, 128 or 256), BLOCK_N, IN_KIND (1 or 2) and OUT_KIND;
// masks, layouts and the grid are prefill.cu's.
//
// FlashAttention-3's intra-warpgroup pipelining, without its producer warps and bulk
// copies: a block of WARPGROUPS warpgroups takes 64 GQA-packed query rows per warpgroup.
// Queries, keys and values sit in shared memory in the 128-byte swizzled layout wgmma reads
// through matrix descriptors: a row is cut in panels of 64 elements, a panel's rows are 128
// bytes apart, 8 of them an atom of 1024 bytes, and 16-byte chunk c of row r lies at chunk
// c ^ (r % 8). For key tile j a warpgroup issues S_j = Q K_jᵀ (both from shared memory) and
// O += P_{j-1} V_{j-1} (P from registers), waits for S_j alone and runs the softmax of S_j
// while the tensor cores still work on P V. Keys are double-buffered, values too, one tile
// behind: the copies of V_j and K_{j+1} run during iteration j.
#if defined(HEAD_DIM) && defined(WARPGROUPS)

#define BLOCK_M (WARPGROUPS * 64)
#define N_TILES (BLOCK_N / 8)
#define D_TILES (HEAD_DIM / 8)
#define TILE_BYTES (BLOCK_N * HEAD_DIM * 2)

// Chunk c of row r of a swizzled tile of ROWS rows.
template <int ROWS>
struct Swizzled {
    static __device__ __forceinline__ u32 at(u32 r, u32 c) {
        return (c / 8) * (ROWS * 128) + r * 128 + (((c % 8) ^ (r % 8)) * 16);
    }
};

// A wgmma descriptor of swizzled rows at shared address `address`: `leading` bytes between
// panels (read only for MN-major operands), `stride` bytes between groups of 8 rows.
__device__ __forceinline__ u64 descriptor(u32 address, u32 leading, u32 stride) {
    return (u64)((address & 0x3ffff) >> 4) | (u64)((leading >> 4) & 0x3fff) << 16 |
           (u64)((stride >> 4) & 0x3fff) << 32 | 1ull << 62;
}

__device__ __forceinline__ void wgmma_fence() {
    asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
}

__device__ __forceinline__ void wgmma_commit() {
    asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
}

template <int N>
__device__ __forceinline__ void wgmma_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}

// Ties registers that an asynchronous wgmma writes or reads to this point: the compiler
// neither reads them earlier nor reuses them before it.
template <int T>
__device__ __forceinline__ void hold(float (&d)[T][4]) {
#pragma unroll
    for (int t = 0; t < T; ++t)
#pragma unroll
        for (int e = 0; e < 4; ++e) asm volatile("" : "+f"(d[t][e])::"memory");
}

template <int T>
__device__ __forceinline__ void hold(u32 (&a)[T][4]) {
#pragma unroll
    for (int t = 0; t < T; ++t)
#pragma unroll
        for (int e = 0; e < 4; ++e) asm volatile("" : "+r"(a[t][e])::"memory");
}

// Shared memory written by cp.async becomes visible to the tensor cores' reads.
__device__ __forceinline__ void async_proxy_fence() {
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

// m64nNk16 with f32 accumulators, N = 64, 128 or 256: d is the warp's 16 rows as m16n8 C
// fragments of N / 8 tiles. The accumulators are the asm's first N / 2 operands; then A
// (a descriptor, or the warp's four m16n8k16 A fragment registers), B's descriptor and
// whether to add to d (scale-d: 0 makes d = A · B).

// The accumulators' operand names, %0 to %(N / 2 - 1).
#define REGS_32 \
    "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, " \
    "%12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, " \
    "%24, %25, %26, %27, %28, %29, %30, %31"
#define REGS_64 \
    REGS_32 ", " \
    "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, " \
    "%44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, " \
    "%56, %57, %58, %59, %60, %61, %62, %63"
#define REGS_128 \
    REGS_64 ", " \
    "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, " \
    "%76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, " \
    "%88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, " \
    "%100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, " \
    "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, " \
    "%124, %125, %126, %127"

// Their constraints, two n8 tiles at a time.
#define ACC_2(t)                                                                         \
    "+f"(d[t][0]), "+f"(d[t][1]), "+f"(d[t][2]), "+f"(d[t][3]), "+f"(d[t + 1][0]),       \
        "+f"(d[t + 1][1]), "+f"(d[t + 1][2]), "+f"(d[t + 1][3])
#define ACC_32 ACC_2(0), ACC_2(2), ACC_2(4), ACC_2(6)
#define ACC_64 ACC_32, ACC_2(8), ACC_2(10), ACC_2(12), ACC_2(14)
#define ACC_128 ACC_64, ACC_2(16), ACC_2(18), ACC_2(20), ACC_2(22), ACC_2(24), ACC_2(26), \
                ACC_2(28), ACC_2(30)

// S += A · Bᵀ, A and B K-major in shared memory; operands A, B and scale-d numbered after the
// accumulators.
#define WGMMA_SS(N, REGS, A, B, SCALE)                                                    \
    "{ .reg .pred p; setp.ne.b32 p, %" SCALE ", 0;\n"                                     \
    "wgmma.mma_async.sync.aligned.m64n" N "k16.f32." MMA_TYPE "." MMA_TYPE " {" REGS "}, " \
    "%" A ", %" B ", p, 1, 1, 0, 0; }"
// O += A · B, A in registers, B MN-major (transposed) in shared memory.
#define WGMMA_RS(N, REGS, A0, A1, A2, A3, B, SCALE)                                         \
    "{ .reg .pred p; setp.ne.b32 p, %" SCALE ", 0;\n"                                       \
    "wgmma.mma_async.sync.aligned.m64n" N "k16.f32." MMA_TYPE "." MMA_TYPE " {" REGS "}, "   \
    "{%" A0 ", %" A1 ", %" A2 ", %" A3 "}, %" B ", p, 1, 1, 1; }"

template <int N>
struct Wgmma;

template <>
struct Wgmma<64> {
    static __device__ __forceinline__ void ss(float (&d)[8][4], u64 a, u64 b, u32 scale) {
        asm volatile(WGMMA_SS("64", REGS_32, "32", "33", "34")
                     : ACC_32
                     : "l"(a), "l"(b), "r"(scale));
    }
    static __device__ __forceinline__ void rs(float (&d)[8][4], const u32 (&a)[4], u64 b,
                                              u32 scale) {
        asm volatile(WGMMA_RS("64", REGS_32, "32", "33", "34", "35", "36", "37")
                     : ACC_32
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(scale));
    }
};

template <>
struct Wgmma<128> {
    static __device__ __forceinline__ void ss(float (&d)[16][4], u64 a, u64 b, u32 scale) {
        asm volatile(WGMMA_SS("128", REGS_64, "64", "65", "66")
                     : ACC_64
                     : "l"(a), "l"(b), "r"(scale));
    }
    static __device__ __forceinline__ void rs(float (&d)[16][4], const u32 (&a)[4], u64 b,
                                              u32 scale) {
        asm volatile(WGMMA_RS("128", REGS_64, "64", "65", "66", "67", "68", "69")
                     : ACC_64
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(scale));
    }
};

template <>
struct Wgmma<256> {
    static __device__ __forceinline__ void rs(float (&d)[32][4], const u32 (&a)[4], u64 b,
                                              u32 scale) {
        asm volatile(WGMMA_RS("256", REGS_128, "128", "129", "130", "131", "132", "133")
                     : ACC_128
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(scale));
    }
};

// S = Q Kᵀ for a warpgroup's 64 query rows at q_rows and a key tile (issued, not awaited).
__device__ __forceinline__ void issue_scores(float (&s)[N_TILES][4], u32 q_rows, u32 keys) {
#pragma unroll
    for (int ks = 0; ks < HEAD_DIM / 16; ++ks) {
        const u32 column = (ks % 4) * 32;
        const u64 a = descriptor(q_rows + (ks / 4) * (BLOCK_M * 128) + column, 16, 1024);
        const u64 b = descriptor(keys + (ks / 4) * (BLOCK_N * 128) + column, 16, 1024);
        Wgmma<BLOCK_N>::ss(s, a, b, ks > 0);
    }
}

// O += P V for a value tile (issued, not awaited).
__device__ __forceinline__ void issue_output(float (&o)[D_TILES][4],
                                             const u32 (&p)[BLOCK_N / 16][4], u32 values) {
#pragma unroll
    for (int kk = 0; kk < BLOCK_N / 16; ++kk)
        Wgmma<HEAD_DIM>::rs(o, p[kk], descriptor(values + kk * 16 * 128, BLOCK_N * 128, 1024),
                            1);
}

extern "C" __global__ void __launch_bounds__(THREADS, 1)
    prefill_hopper(const u16* __restrict__ q, const u16* __restrict__ k,
                   const u16* __restrict__ v, void* __restrict__ out, u32 tokens, u32 heads,
                   u32 group, u32 kv_heads, u32 capacity, int first_position, int window,
                   int lo_valid, u32 lo_row, u32 m_blocks, float scale_log2) {
    extern __shared__ __align__(1024) unsigned char smem[];
    // The swizzle reads address bits 4-9: tiles start at multiples of 1024 bytes.
    const u32 sq = (smem_address(smem) + 1023) & ~1023u;
    const u32 sk = sq + BLOCK_M * HEAD_DIM * 2;  // two key tiles
    const u32 sv = sk + 2 * TILE_BYTES;          // two value tiles

    const BlockPlan blk = plan_block<BLOCK_M>(tokens, group, kv_heads, capacity, first_position,
                                            window, lo_valid, lo_row, m_blocks);
    const u32 wg = threadIdx.x / 128, warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;

    // Copies: the queries and K_0, then V_0 and K_1.
    load_queries<BLOCK_M, Swizzled<BLOCK_M>>(sq, q, blk, heads, group);
    load_rows<Swizzled<BLOCK_N>, 1>(sk, k, 0, k, blk.tile_start(0), blk.ring);
    commit();
    load_rows<Swizzled<BLOCK_N>, 1>(sv, v, 0, v, blk.tile_start(0), blk.ring);
    if (blk.n_tiles > 1)
        load_rows<Swizzled<BLOCK_N>, 1>(sk + TILE_BYTES, k, 0, k, blk.tile_start(1), blk.ring);
    commit();

    // This thread's rows: fragment rows lane / 4 and lane / 4 + 8 of its warp's 16.
    const u32 row0 = blk.m0 + wg * 64 + warp * 16 + lane / 4;
    int p_row[2], p_low[2];
    row_positions(row0, first_position, group, window, p_row, p_low);
    const u32 q_rows = sq + wg * 64 * 128;

    float o[D_TILES][4], s[N_TILES][4], m[2] = {NEG_INF, NEG_INF}, l[2] = {0.0f, 0.0f};
    u32 p[BLOCK_N / 16][4];
#pragma unroll
    for (int dt = 0; dt < D_TILES; ++dt)
#pragma unroll
        for (int e = 0; e < 4; ++e) o[dt][e] = 0.0f;

    // Tile 0: its scores and probabilities.
    wait_copies<1>();
    async_proxy_fence();
    __syncthreads();
    wgmma_fence();
    issue_scores(s, q_rows, sk);
    wgmma_commit();
    wgmma_wait<0>();
    hold(s);
    {
        const int kb = blk.tile_start(0);
        if (blk.masked(kb)) mask_scores(s, kb, lane, p_row, p_low);
        float alpha[2];  // O is still zero
        softmax_step(s, m, l, alpha, scale_log2);
#pragma unroll
        for (int kk = 0; kk < BLOCK_N / 16; ++kk) probabilities(p[kk], s, kk);
    }

    for (int j = 1; j < blk.n_tiles; ++j) {
        const int kb = blk.tile_start(j);
        // K_j and V_{j-1} have arrived, and every warpgroup is done with K_{j-1} and V_{j-2},
        // whose buffers the next copies fill.
        wait_copies<0>();
        async_proxy_fence();
        __syncthreads();
        load_rows<Swizzled<BLOCK_N>, 1>(sv + (j % 2) * TILE_BYTES, v, 0, v, kb, blk.ring);
        if (j + 1 < blk.n_tiles)
            load_rows<Swizzled<BLOCK_N>, 1>(sk + ((j + 1) % 2) * TILE_BYTES, k, 0, k,
                                            kb - BLOCK_N, blk.ring);
        commit();

        wgmma_fence();
        issue_scores(s, q_rows, sk + (j % 2) * TILE_BYTES);
        wgmma_commit();
        issue_output(o, p, sv + ((j - 1) % 2) * TILE_BYTES);
        wgmma_commit();
        wgmma_wait<1>();
        hold(s);
        // The mask, on the diagonal and window-edge tiles only.
        if (blk.masked(kb)) mask_scores(s, kb, lane, p_row, p_low);
        float alpha[2];
        const bool rescale = softmax_step(s, m, l, alpha, scale_log2);
        wgmma_wait<0>();
        hold(o);
        hold(p);
        // Far from the diagonal the maxima seldom grow: most tiles skip rescaling O.
        if (__any_sync(0xffffffffu, rescale)) rescale_output(o, alpha);
#pragma unroll
        for (int kk = 0; kk < BLOCK_N / 16; ++kk) probabilities(p[kk], s, kk);
    }

    // The last tile's values.
    wait_copies<0>();
    async_proxy_fence();
    __syncthreads();
    wgmma_fence();
    issue_output(o, p, sv + ((blk.n_tiles - 1) % 2) * TILE_BYTES);
    wgmma_commit();
    wgmma_wait<0>();
    hold(o);
    store_rows(out, o, l, row0, blk.rows, heads, group, blk.kvh, lane);
}

#endif  // HEAD_DIM && WARPGROUPS
