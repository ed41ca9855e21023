// Causal (optionally sliding-window) attention of a chunk of queries over a layer's K/V
// buffer: the prefill's attention. Three kernels:
//
//   prefill         the fast path, f16/bf16 inputs, FlashAttention-2 style on the tensor cores
//                   (mma.sync m16n8k16, ldmatrix, cp.async double buffering);
//   prefill_hopper  the fast path on Hopper (sm_90a): prefill_hopper.cu, appended to this
//                   file by the launcher, shares the section "What both tensor-core kernels
//                   share" below;
//   prefill_exact   a plain kernel for any input type and head dim <= 256 (the f32 test mode).
//
// Compiled by NVRTC without headers: f16/bf16 are moved as raw 16-bit words and converted by
// PTX instructions. Defines:
//   IN_KIND    element type of queries, keys and values: 0 float, 1 half, 2 bfloat16
//              (prefill: 1 or 2 only)
//   OUT_KIND   element type of the output, same numbering
// prefill and prefill_hopper:
//   HEAD_DIM   row length, a multiple of 16 from 16 to 256 (prefill_hopper: 64, 128, 256)
//   BLOCK_N    keys per tile (a multiple of 16)
// prefill only:
//   WARPS      warps per block
//   M_TILES    16-row query tiles per warp (1 or 2)
//   MIN_BLOCKS blocks per multiprocessor the registers are capped for
// prefill_hopper only:
//   WARPGROUPS warpgroups per block, 64 query rows each
//
// Layouts: queries and out [tokens, heads, head_dim]; keys and values [kv_heads, capacity,
// head_dim], token position p of KV head h at row h * capacity + p % capacity. Query head qh
// uses KV head qh / group. Query i of the chunk sits at position first_position + i and sees
// key positions k with lower(p) <= k <= p, lower(p) = max(0, p - window + 1) (window is
// 0x7fffffff for global attention). The host has checked that every such key is still in
// the buffer: positions [lo_valid, first_position + tokens) are, position lo_valid at row
// lo_row, the next ones after it (wrapping at capacity).
//
// Rows of a block are GQA-packed: packed row r is query token r / group, query head
// kv_head * group + r % group, so that the heads of a group share each key and value tile
// (and a decode step fills `group` rows of a tile instead of one).

typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;

#define NEG_INF __int_as_float(0xff800000)

__device__ __forceinline__ int max_i(int a, int b) { return a > b ? a : b; }
__device__ __forceinline__ u32 min_u(u32 a, u32 b) { return a < b ? a : b; }

// Element i of a buffer of IN_KIND, as f32.
__device__ __forceinline__ float load_in(const void* p, u64 i) {
#if IN_KIND == 0
    return static_cast<const float*>(p)[i];
#elif IN_KIND == 1
    const u16 h = static_cast<const u16*>(p)[i];
    float x;
    asm("cvt.f32.f16 %0, %1;" : "=f"(x) : "h"(h));
    return x;
#else
    return __uint_as_float(static_cast<u32>(static_cast<const u16*>(p)[i]) << 16);
#endif
}

// Writes x to element i of a buffer of OUT_KIND (round to nearest even).
__device__ __forceinline__ void store_out(void* p, u64 i, float x) {
#if OUT_KIND == 0
    static_cast<float*>(p)[i] = x;
#else
    u16 h;
#if OUT_KIND == 1
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(x));
#else
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(x));
#endif
    static_cast<u16*>(p)[i] = h;
#endif
}

// Writes x0, x1 to elements i, i + 1 (i even, the buffer aligned to two elements).
__device__ __forceinline__ void store_out2(void* p, u64 i, float x0, float x1) {
#if OUT_KIND == 0
    *reinterpret_cast<float2*>(static_cast<float*>(p) + i) = make_float2(x0, x1);
#else
    u32 w;
#if OUT_KIND == 1
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(w) : "f"(x1), "f"(x0));
#else
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(w) : "f"(x1), "f"(x0));
#endif
    *reinterpret_cast<u32*>(static_cast<u16*>(p) + i) = w;
#endif
}

// ---------------------------------------------------------------------------------------
// The exact kernel: one warp per (query token, query head), keys one after the other with
// an online softmax in f32; the lanes split the head dimension (up to 8 columns each).

extern "C" __global__ void __launch_bounds__(128) prefill_exact(
    const void* __restrict__ q, const void* __restrict__ k, const void* __restrict__ v,
    void* __restrict__ out, u32 tokens, u32 heads, u32 group, u32 head_dim, u32 capacity,
    int first_position, int window, int lo_valid, u32 lo_row, float scale) {
    const u32 lane = threadIdx.x % 32;
    const u64 item = (u64)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    if (item >= (u64)tokens * heads) return;  // the whole warp: no barrier follows
    const u32 t = (u32)(item / heads), qh = (u32)(item % heads), kvh = qh / group;
    const int p = first_position + (int)t;
    const int lo = max_i(0, p - window + 1);

    float qv[8], o[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) {
        const u32 d = lane + 32 * j;
        qv[j] = d < head_dim ? load_in(q, item * head_dim + d) : 0.0f;
        o[j] = 0.0f;
    }
    float m = NEG_INF, l = 0.0f;
    for (int pos = lo; pos <= p; ++pos) {
        u32 row = lo_row + (u32)(pos - lo_valid);
        if (row >= capacity) row -= capacity;
        const u64 base = ((u64)kvh * capacity + row) * head_dim;
        float s = 0.0f;
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            const u32 d = lane + 32 * j;
            if (d < head_dim) s += qv[j] * load_in(k, base + d);
        }
        // A butterfly: every lane ends with the same sum (each step adds the same two
        // numbers, in either order).
#pragma unroll
        for (int x = 16; x > 0; x >>= 1) s += __shfl_xor_sync(0xffffffffu, s, x);
        s *= scale;
        const float m_new = fmaxf(m, s);
        const float alpha = __expf(m - m_new), e = __expf(s - m_new);
        l = l * alpha + e;
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            const u32 d = lane + 32 * j;
            if (d < head_dim) o[j] = o[j] * alpha + e * load_in(v, base + d);
        }
        m = m_new;
    }
    const float inv = 1.0f / l;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
        const u32 d = lane + 32 * j;
        if (d < head_dim) store_out(out, item * head_dim + d, o[j] * inv);
    }
}

// ---------------------------------------------------------------------------------------
// What both tensor-core kernels share: this section, with HEAD_DIM and BLOCK_N defined;
// WARPGROUPS (prefill_hopper.cu) or WARPS and M_TILES (below) choose the kernel.
#ifdef HEAD_DIM

#ifdef WARPGROUPS
#define THREADS (WARPGROUPS * 128)
#else
#define THREADS (WARPS * 32)
#endif
// 16-byte chunks of a row.
#define CHUNKS (HEAD_DIM / 8)

#if IN_KIND == 2
#define MMA_TYPE "bf16"
#else
#define MMA_TYPE "f16"
#endif

__device__ __forceinline__ u32 smem_address(const void* p) {
    u32 a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}

// 16 bytes from global to shared memory, or 16 zero bytes when !valid.
__device__ __forceinline__ void copy16(u32 dst, const void* src, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src),
                 "r"(valid ? 16 : 0)
                 : "memory");
}

__device__ __forceinline__ void commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }

template <int N>
__device__ __forceinline__ void wait_copies() {
    asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

// Two f32 as a pair of the input type, x0 in the low half.
__device__ __forceinline__ u32 pack(float x0, float x1) {
    u32 w;
#if IN_KIND == 2
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(w) : "f"(x1), "f"(x0));
#else
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(w) : "f"(x1), "f"(x0));
#endif
    return w;
}

// Where a tile's keys are: positions [lo_valid, hi) are in the buffer, lo_valid at row lo_row.
struct Ring {
    u64 head_row;  // kv_head * capacity
    u32 capacity, lo_row;
    int lo_valid, hi;
};

// Starts copying the rows of positions kb .. kb + BLOCK_N - 1 of one buffer, src0, or of two
// (keys and values: one address computation serves both, which spares registers) into
// shared memory, chunk c of tile row r at dst + Layout::at(r, c) (zeros for positions not in
// the buffer: the mask hides them, and zeros keep 0 * garbage out of the sums).
template <class Layout, int BUFFERS>
__device__ __forceinline__ void load_rows(u32 dst0, const u16* __restrict__ src0, u32 dst1,
                                          const u16* __restrict__ src1, int kb,
                                          const Ring& ring) {
    // Most tiles lie inside the buffer on consecutive rows: one row number for the tile.
    u32 first = ring.lo_row + (u32)(kb - ring.lo_valid);
    if (first >= ring.capacity) first -= ring.capacity;
    if (kb >= ring.lo_valid && kb + BLOCK_N <= ring.hi && first + BLOCK_N <= ring.capacity) {
        const u64 base = (ring.head_row + first) * HEAD_DIM;
#pragma unroll
        for (int j = 0; j < (BLOCK_N * CHUNKS + THREADS - 1) / THREADS; ++j) {
            const int i = threadIdx.x + j * THREADS;
            if (BLOCK_N * CHUNKS % THREADS != 0 && i >= BLOCK_N * CHUNKS) break;
            const int r = i / CHUNKS, c = i % CHUNKS;
            const u64 at = base + r * HEAD_DIM + c * 8;
            copy16(dst0 + Layout::at(r, c), src0 + at, true);
            if (BUFFERS == 2) copy16(dst1 + Layout::at(r, c), src1 + at, true);
        }
        return;
    }
#pragma unroll
    for (int j = 0; j < (BLOCK_N * CHUNKS + THREADS - 1) / THREADS; ++j) {
        const int i = threadIdx.x + j * THREADS;
        if (BLOCK_N * CHUNKS % THREADS != 0 && i >= BLOCK_N * CHUNKS) break;
        const int r = i / CHUNKS, c = i % CHUNKS;
        const int pos = kb + r;
        const bool valid = pos >= ring.lo_valid && pos < ring.hi;
        u32 row = ring.lo_row + (u32)(pos - ring.lo_valid);
        if (row >= ring.capacity) row -= ring.capacity;
        const u64 at = valid ? (ring.head_row + row) * HEAD_DIM + c * 8 : 0;
        copy16(dst0 + Layout::at(r, c), src0 + at, valid);
        if (BUFFERS == 2) copy16(dst1 + Layout::at(r, c), src1 + at, valid);
    }
}

// A block's share of the work. Grid: one block per (KV head, BM packed rows), x = block;
// heads vary fastest and the last rows (the most key tiles) come first, so that the long
// blocks start in the first wave. Its keys are positions [k_lo, k_hi]; tile t starts at
// k_hi + 1 - (t + 1) BLOCK_N, so that the tiles go down from the diagonal.
struct BlockPlan {
    u32 kvh, m0, rows;
    int k_hi, n_tiles;
    // A tile needs the mask if it reaches past the first row's position, or below the last
    // row's lowest key.
    int causal_above, window_below;
    Ring ring;

    __device__ __forceinline__ int tile_start(int t) const { return k_hi + 1 - (t + 1) * BLOCK_N; }
    __device__ __forceinline__ bool masked(int kb) const {
        return kb + BLOCK_N - 1 > causal_above || kb < window_below;
    }
};

template <int BM>
__device__ __forceinline__ BlockPlan plan_block(u32 tokens, u32 group, u32 kv_heads,
                                                u32 capacity, int first_position, int window,
                                                int lo_valid, u32 lo_row, u32 m_blocks) {
    BlockPlan b;
    b.kvh = blockIdx.x % kv_heads;
    b.m0 = (m_blocks - 1 - blockIdx.x / kv_heads) * BM;
    b.rows = tokens * group;
    const int p_min = first_position + (int)(b.m0 / group);
    const int p_max = first_position + (int)((min_u(b.rows, b.m0 + BM) - 1) / group);
    const int k_lo = max_i(0, p_min - window + 1);
    b.k_hi = p_max;
    b.n_tiles = (b.k_hi - k_lo + BLOCK_N) / BLOCK_N;
    b.causal_above = p_min;
    b.window_below = max_i(0, p_max - window + 1);
    b.ring = {(u64)b.kvh * capacity, capacity, lo_row, lo_valid, first_position + (int)tokens};
    return b;
}

// Starts copying the block's BM packed query rows into shared memory (zeros past the last
// token), chunk c of row r at dst + Layout::at(r, c).
template <int BM, class Layout>
__device__ __forceinline__ void load_queries(u32 dst, const u16* __restrict__ q,
                                             const BlockPlan& b, u32 heads, u32 group) {
#pragma unroll
    for (int j = 0; j < (BM * CHUNKS + THREADS - 1) / THREADS; ++j) {
        const u32 i = threadIdx.x + j * THREADS;
        if (BM * CHUNKS % THREADS != 0 && i >= BM * CHUNKS) break;
        const u32 r = i / CHUNKS, c = i % CHUNKS;
        const u32 row = b.m0 + r;
        const bool valid = row < b.rows;
        const u32 t = row / group, g = row - t * group;
        const u64 at = valid ? ((u64)t * heads + b.kvh * group + g) * HEAD_DIM + c * 8 : 0;
        copy16(dst + Layout::at(r, c), q + at, valid);
    }
}

// The per-fragment steps of both kernels. A warp's 16 score rows are the m16n8 C fragments
// of its n8 tiles: element e of tile nt is row lane / 4 + 8 (e >> 1), key nt * 8 + (lane % 4)
// * 2 + (e & 1); a quad of lanes shares each row.

// The positions of a lane's two fragment rows, block-packed rows row0 and row0 + 8, and the
// lowest key each sees.
__device__ __forceinline__ void row_positions(u32 row0, int first_position, u32 group,
                                              int window, int (&p_row)[2], int (&p_low)[2]) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        p_row[h] = first_position + (int)((row0 + h * 8) / group);
        p_low[h] = max_i(0, p_row[h] - window + 1);
    }
}

// Scores of keys outside a row's [low, position] become -inf.
template <int NT>
__device__ __forceinline__ void mask_scores(float (&s)[NT][4], int kb, u32 lane,
                                            const int (&p_row)[2], const int (&p_low)[2]) {
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int pos = kb + nt * 8 + (lane % 4) * 2 + (e & 1);
            const int h = e >> 1;
            if (pos > p_row[h] || pos < p_low[h]) s[nt][e] = NEG_INF;
        }
}

// One online-softmax step over a tile's scores: the row maxima m (in base 2, scaled) and the
// lane's partial sums l move on, the scores become exp2(scale · s - m) in place, and alpha is
// what the output accumulated so far must be multiplied by. Returns whether any of the lane's
// rows has alpha != 1.
template <int NT>
__device__ __forceinline__ bool softmax_step(float (&s)[NT][4], float (&m)[2], float (&l)[2],
                                             float (&alpha)[2], float scale_log2) {
    bool rescale = false;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        float mx = NEG_INF;
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) mx = fmaxf(mx, fmaxf(s[nt][2 * h], s[nt][2 * h + 1]));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        // Scores in base 2 (scale_log2 > 0); a row that has seen no key yet keeps its max at
        // -inf and subtracts 0, so that no -inf - -inf appears. alpha is exactly 1 when the
        // max stays, so that skipping the multiply by it changes no bit.
        const float m_new = fmaxf(m[h], mx * scale_log2);
        const float base = m_new == NEG_INF ? 0.0f : m_new;
        alpha[h] = m_new == m[h] ? 1.0f : exp2f(m[h] - base);
        rescale |= m_new != m[h];
        m[h] = m_new;
        float sum = 0.0f;
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int j = 0; j < 2; ++j) {
                const float e = exp2f(fmaf(s[nt][2 * h + j], scale_log2, -base));
                s[nt][2 * h + j] = e;
                sum += e;
            }
        l[h] = l[h] * alpha[h] + sum;
    }
    return rescale;
}

template <int DT>
__device__ __forceinline__ void rescale_output(float (&o)[DT][4], const float (&alpha)[2]) {
#pragma unroll
    for (int dt = 0; dt < DT; ++dt)
#pragma unroll
        for (int e = 0; e < 4; ++e) o[dt][e] *= alpha[e >> 1];
}

// The probabilities of keys 16 kk .. 16 kk + 15 as the A fragment of a 16-key step: the C
// layout of two 8-key tiles is the A layout of one m16n8k16 step.
template <int NT>
__device__ __forceinline__ void probabilities(u32 (&a)[4], const float (&s)[NT][4], int kk) {
    a[0] = pack(s[2 * kk][0], s[2 * kk][1]);
    a[1] = pack(s[2 * kk][2], s[2 * kk][3]);
    a[2] = pack(s[2 * kk + 1][0], s[2 * kk + 1][1]);
    a[3] = pack(s[2 * kk + 1][2], s[2 * kk + 1][3]);
}

// Divides the lane's two output rows by their sums and stores them; row0 is the block-packed
// row of fragment row lane / 4 (the other is row0 + 8), rows past `rows` are padding.
template <int DT>
__device__ __forceinline__ void store_rows(void* out, const float (&o)[DT][4],
                                           const float (&l)[2], u32 row0, u32 rows, u32 heads,
                                           u32 group, u32 kvh, u32 lane) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        float sum = l[h];
        sum += __shfl_xor_sync(0xffffffffu, sum, 1);
        sum += __shfl_xor_sync(0xffffffffu, sum, 2);
        const float inv = 1.0f / sum;
        const u32 row = row0 + h * 8;
        if (row >= rows) continue;
        const u32 t = row / group, g = row - t * group;
        const u64 at = ((u64)t * heads + kvh * group + g) * HEAD_DIM + (lane % 4) * 2;
#pragma unroll
        for (int dt = 0; dt < DT; ++dt)
            store_out2(out, at + dt * 8, o[dt][2 * h] * inv, o[dt][2 * h + 1] * inv);
    }
}

// ---------------------------------------------------------------------------------------
// The mma.sync kernel (FlashAttention-2 style), for every GPU since Ampere.
#ifndef WARPGROUPS

#define BLOCK_M (WARPS * 16 * M_TILES)
// A shared-memory row padded by one chunk: an odd number of chunks apart, the 8 rows one
// ldmatrix reads fall in 8 different bank groups.
#define ROW (HEAD_DIM + 8)
#define N_TILES (BLOCK_N / 8)
#define D_TILES (HEAD_DIM / 8)

// Rows of ROW elements.
struct Padded {
    static __device__ __forceinline__ u32 at(u32 r, u32 c) { return (r * ROW + c * 8) * 2; }
};

__device__ __forceinline__ void ldmatrix4(u32 (&r)[4], u32 address) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(address));
}

__device__ __forceinline__ void ldmatrix4_trans(u32 (&r)[4], u32 address) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(address));
}

// c += a · b for a 16x16 tile a (row-major fragments) and a 16x8 tile b (column-major).
__device__ __forceinline__ void mma(float (&c)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32." MMA_TYPE "." MMA_TYPE ".f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Grid and tiles: see BlockPlan.
extern "C" __global__ void __launch_bounds__(THREADS, MIN_BLOCKS)
    prefill(const u16* __restrict__ q, const u16* __restrict__ k, const u16* __restrict__ v,
            void* __restrict__ out, u32 tokens, u32 heads, u32 group, u32 kv_heads,
            u32 capacity, int first_position, int window, int lo_valid, u32 lo_row,
            u32 m_blocks, float scale_log2) {
    extern __shared__ __align__(16) unsigned char smem[];
    const u32 sq = smem_address(smem);
    // Stage s: keys at sq + (BLOCK_M + 2s BLOCK_N) rows, values BLOCK_N rows after them.
    const u32 skv = sq + BLOCK_M * ROW * 2;
    const u32 stage_bytes = 2 * BLOCK_N * ROW * 2;

    const BlockPlan blk = plan_block<BLOCK_M>(tokens, group, kv_heads, capacity, first_position,
                                            window, lo_valid, lo_row, m_blocks);
    const u32 kvh = blk.kvh, m0 = blk.m0, rows = blk.rows;
    const u32 warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    load_queries<BLOCK_M, Padded>(sq, q, blk, heads, group);
    load_rows<Padded, 2>(skv, k, skv + BLOCK_N * ROW * 2, v, blk.tile_start(0), blk.ring);
    commit();

    // This thread's rows: fragment rows lane / 4 and lane / 4 + 8 of each of its m tiles.
    const u32 warp_row = warp * 16 * M_TILES;
    const bool warp_live = m0 + warp_row < rows;
    int p_row[M_TILES][2], p_low[M_TILES][2];
#pragma unroll
    for (int mt = 0; mt < M_TILES; ++mt)
        row_positions(m0 + warp_row + mt * 16 + lane / 4, first_position, group, window,
                      p_row[mt], p_low[mt]);

    float o[M_TILES][D_TILES][4];
    float m[M_TILES][2], l[M_TILES][2];
#pragma unroll
    for (int mt = 0; mt < M_TILES; ++mt) {
#pragma unroll
        for (int dt = 0; dt < D_TILES; ++dt)
#pragma unroll
            for (int e = 0; e < 4; ++e) o[mt][dt][e] = 0.0f;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            m[mt][h] = NEG_INF;
            l[mt][h] = 0.0f;
        }
    }

    // ldmatrix addresses of this lane: A (queries) rows lane % 16, columns (lane / 16) * 8;
    // B of S (keys) rows (lane / 16) * 8 + lane % 8, columns ((lane / 8) % 2) * 8;
    // B of O (values, transposed) rows ((lane / 8) % 2) * 8 + lane % 8, columns (lane / 16) * 8.
    const u32 a_off = ((warp_row + lane % 16) * ROW + (lane / 16) * 8) * 2;
    const u32 k_off = (((lane / 16) * 8 + lane % 8) * ROW + ((lane / 8) % 2) * 8) * 2;
    const u32 v_off = ((((lane / 8) % 2) * 8 + lane % 8) * ROW + (lane / 16) * 8) * 2;

    for (int it = 0; it < blk.n_tiles; ++it) {
        const int kb = blk.tile_start(it);
        const u32 sk = skv + (it & 1) * stage_bytes, sv = sk + BLOCK_N * ROW * 2;
        if (it + 1 < blk.n_tiles) {
            const u32 nk = skv + ((it + 1) & 1) * stage_bytes;
            load_rows<Padded, 2>(nk, k, nk + BLOCK_N * ROW * 2, v, kb - BLOCK_N, blk.ring);
            commit();
            wait_copies<1>();
        } else {
            wait_copies<0>();
        }
        __syncthreads();

        if (warp_live) {
            // S = Q Kᵀ.
            float s[M_TILES][N_TILES][4];
#pragma unroll
            for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
                for (int nt = 0; nt < N_TILES; ++nt)
#pragma unroll
                    for (int e = 0; e < 4; ++e) s[mt][nt][e] = 0.0f;
#pragma unroll
            for (int ks = 0; ks < HEAD_DIM / 16; ++ks) {
                u32 a[M_TILES][4];
#pragma unroll
                for (int mt = 0; mt < M_TILES; ++mt)
                    ldmatrix4(a[mt], sq + a_off + (mt * 16 * ROW + ks * 16) * 2);
#pragma unroll
                for (int np = 0; np < N_TILES / 2; ++np) {
                    u32 b[4];
                    ldmatrix4(b, sk + k_off + (np * 16 * ROW + ks * 16) * 2);
#pragma unroll
                    for (int mt = 0; mt < M_TILES; ++mt) {
                        mma(s[mt][2 * np], a[mt], b[0], b[1]);
                        mma(s[mt][2 * np + 1], a[mt], b[2], b[3]);
                    }
                }
            }

            // The mask, on the diagonal and window-edge tiles only.
            if (blk.masked(kb)) {
#pragma unroll
                for (int mt = 0; mt < M_TILES; ++mt)
                    mask_scores(s[mt], kb, lane, p_row[mt], p_low[mt]);
            }
            float alpha[M_TILES][2];
            bool rescale = false;
#pragma unroll
            for (int mt = 0; mt < M_TILES; ++mt)
                rescale |= softmax_step(s[mt], m[mt], l[mt], alpha[mt], scale_log2);
            // Far from the diagonal the maxima seldom grow: most tiles skip rescaling O.
            if (__any_sync(0xffffffffu, rescale)) {
#pragma unroll
                for (int mt = 0; mt < M_TILES; ++mt) rescale_output(o[mt], alpha[mt]);
            }

            // O += P V, P from the score registers.
#pragma unroll
            for (int kk = 0; kk < BLOCK_N / 16; ++kk) {
                u32 a[M_TILES][4];
#pragma unroll
                for (int mt = 0; mt < M_TILES; ++mt) probabilities(a[mt], s[mt], kk);
#pragma unroll
                for (int dp = 0; dp < D_TILES / 2; ++dp) {
                    u32 b[4];
                    ldmatrix4_trans(b, sv + v_off + (kk * 16 * ROW + dp * 16) * 2);
#pragma unroll
                    for (int mt = 0; mt < M_TILES; ++mt) {
                        mma(o[mt][2 * dp], a[mt], b[0], b[1]);
                        mma(o[mt][2 * dp + 1], a[mt], b[2], b[3]);
                    }
                }
            }
        }
        // Every warp is done with this stage before the next iteration refills it.
        __syncthreads();
    }

    if (!warp_live) return;
#pragma unroll
    for (int mt = 0; mt < M_TILES; ++mt)
        store_rows(out, o[mt], l[mt], m0 + warp_row + mt * 16 + lane / 4, rows, heads, group,
                   kvh, lane);
}

#endif  // !WARPGROUPS
#endif  // HEAD_DIM
