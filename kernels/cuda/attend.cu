// One decode step of attention for every KV head of a layer, split into work items and
// merged by log-sum-exp in the same launch.
//
// Compiled by NVRTC (no headers but blocks.cuh, which comes before this file: f16/bf16 are
// converted by hand) with these defines:
//   KV_BF16   1 for bfloat16 keys, values and queries, 0 for float16
//   HEAD_DIM  row length, HEAD_DIM / 8 a power of two <= 32
//   GROUP     query heads per KV head (GQA group), 1..8
//   THREADS   threads per block
//   UNROLL    rows each team loads before it uses any (loads in flight)
//   MMA       1 for the tensor-core path of `attend` (HEAD_DIM 64 or 128): each warp takes
//             16 rows at a time and computes their logits and their share of the output
//             with mma.sync (see attend_rows_mma); 0 (or absent) for the scalar path, where
//             teams of HEAD_DIM / 8 lanes share a row. `attention_mass` is the same either way.
//
// Layouts: queries [kv_heads, GROUP, HEAD_DIM] (query head h*GROUP+g uses KV head h); keys
// and values are rows of HEAD_DIM elements, KV head h's rows starting at row h*stride of
// their buffer; out [kv_heads, GROUP, HEAD_DIM] f32.
//
// Grid: (kv_heads, items), so that blocks are dispatched item by item across the heads (the
// dense and run items first). Item x < dense_items attends to a slice of the dense part (up to
// two runs of consecutive rows of the dense buffer: sinks and window, or a query's own
// tail). The other items are the list part, rows of the list buffer: first slices of its
// own runs (up to two: a stored corpus's sinks and window), then the head's list: in list
// mode a slice of `list_chunk` rows of it, in bucket mode an equal share of the ids of the
// head's visited buckets (CSR offsets), read as one sequence; bucket ids inside the list
// buffer's runs are skipped, so no token counts twice.
// A programmatic dependent launch on Hopper: the blocks may start before the launch before
// it on the stream has finished. Launched right after the routing kernel that writes the
// visits (`after_route`), only the bucket items wait for it (griddepcontrol.wait) before
// reading the visits: everything else they read was written before routing started (every
// routing block waits for its own predecessor before it lets this launch start). After any
// other launch every block waits for it first.
// Each item writes a partial (unnormalised output, max, sum of exponentials, in base 2); the
// last block of a head to finish merges the head's partials into `out` (and, when asked, each
// query head's log-sum-exp into `lse`) and resets its counter for the next launch.
//
// `attention_mass` walks the list part again after `attend`: each row's attention weight
// (summed over the group's heads, from the logits and `lse`) is added to `mass[row]`, the
// attention each stored token received: what provenance ranks passages by. `attend` keeps
// its queries in `q_keep` and its log-sum-exp in `lse` for it. Rows of a block cache are
// slots' rows, not tokens: there `slot_token[row >> slot_shift] + (row & slot mask)` is the
// token (`slot_token` null: the row is the token). `attention_weights` walks a selection's
// lists the same way and writes each item's weight at its place in them instead: what a
// query that follows its most attended tokens ranks them by.
//
// A bucket launch over rows in host memory may have a GPU cache of whole buckets
// (`slot_of` not null: `BucketCache` in cache.rs): a visited bucket whose `slot_of` entry is
// not NO_ROW is read from the cache's rows `slot_of[bucket]` onwards (its ids in order, their
// tokens in `token_of`), the others in place. An item's share of the visited ids is then
// visited bucket by bucket, each segment from where its rows are (`CachedRows`).

typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;

#define LANES (HEAD_DIM / 8)
#define TEAMS (THREADS / LANES)
#define STEP (TEAMS * UNROLL)
#define NO_ROW 0xffffffffu
#ifndef MMA
#define MMA 0
#endif
// The partial states a block combines at its end: one per team, or one per warp.
#if MMA
#define PARTS (THREADS / 32)
#else
#define PARTS TEAMS
#endif
#define NEG_INF __int_as_float(0xff800000)
// A partial: out [GROUP][HEAD_DIM], then max [GROUP], then sum [GROUP], padded to whole
// float4s so that merges read the outputs 16 bytes at a time.
#define PARTIAL ((GROUP * (HEAD_DIM + 2) + 3) / 4 * 4)
// float4s of a partial's outputs each thread of a merge sums, and partials it reads per
// batch: 12 float4 loads in flight per thread whatever the shape (more would cost registers
// the main loop needs for its occupancy).
#define MERGE_VECS ((GROUP * HEAD_DIM / 4 + THREADS - 1) / THREADS)
#define MERGE_BATCH (12 / MERGE_VECS)

__device__ __forceinline__ u32 min_u32(u32 a, u32 b) { return a < b ? a : b; }

// Eight elements (16 bytes) to f32.
__device__ __forceinline__ void unpack8(uint4 raw, float* x) {
    const u32 w[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
#if KV_BF16
        x[2 * i] = __uint_as_float(w[i] << 16);
        x[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
#else
        const u16 lo = (u16)(w[i] & 0xffffu), hi = (u16)(w[i] >> 16);
        asm("cvt.f32.f16 %0, %1;" : "=f"(x[2 * i]) : "h"(lo));
        asm("cvt.f32.f16 %0, %1;" : "=f"(x[2 * i + 1]) : "h"(hi));
#endif
    }
}

// Running softmax state of one thread: its 8 columns of every group head's output, and the
// rows its team attended (not NO_ROW).
struct State {
    float m[GROUP];
    float l[GROUP];
    float o[GROUP][8];
    u32 rows;
};

// Rows of a slice of the dense part: run 0 then run 1.
struct DenseRows {
    u32 first, run0_row, run0_len, run1_row;
    __device__ __forceinline__ u32 operator()(u32 t) const {
        const u32 j = first + t;
        return j < run0_len ? run0_row + j : run1_row + (j - run0_len);
    }
};

// Rows listed explicitly.
struct ListRows {
    const u32* rows;
    __device__ __forceinline__ u32 operator()(u32 t) const { return rows[t]; }
};

// The list buffer's runs (sinks and window), attended whole: ids inside them are skipped
// elsewhere in the list part.
struct Runs {
    u32 run0_row, run0_len, run1_row, run1_len;
    __device__ __forceinline__ bool hold(u32 id) const {
        return (id - run0_row < run0_len) || (id - run1_row < run1_len);
    }
};

// Most buckets a KV head visits in one launch (`MAX_VISITED_BUCKETS` in attention.rs):
// their starts and running sizes fill shared memory.
#define MAX_VISITS 128

// The visited buckets of one KV head, read as one sequence of ids: visit k's ids are
// numbers before[k] .. before[k + 1] of it and start at bucket_ids[first[k]] (both arrays in
// shared memory). Rows from `start` on; ids inside the list buffer's runs are skipped, so no
// token counts twice.
struct VisitedRows {
    const u32* bucket_ids;
    const u32* first;
    const u32* before;
    u32 visits, start;
    Runs runs;
    __device__ __forceinline__ u32 operator()(u32 t) const {
        const u32 at = start + t;
        // The visit holding `at`: before[lo] <= at < before[hi] throughout, so the search
        // ends on a visit that is not empty.
        u32 lo = 0, hi = visits;
        while (hi - lo > 1) {
            const u32 mid = (lo + hi) / 2;
            if (before[mid] <= at) lo = mid; else hi = mid;
        }
        const u32 id = bucket_ids[first[lo] + (at - before[lo])];
        return runs.hold(id) ? NO_ROW : id;
    }
};

// A visited bucket's rows in a bucket cache: rows first.. of the cache's k/v (all KV heads
// share its rows), token_of[row] the token each holds; `start` is where the segment starts in
// the head's sequence of visited ids (as VisitedRows's). Tokens inside the list buffer's runs
// are skipped, as VisitedRows skips them.
struct CachedRows {
    const u16* k;
    const u16* v;
    const u32* token_of;
    u32 first, start;
    Runs runs;
    __device__ __forceinline__ u32 operator()(u32 t) const {
        const u32 row = first + t;
        return runs.hold(token_of[row]) ? NO_ROW : row;
    }
};

// Ids a KV head follows besides its visited buckets (the successors of the tokens its last
// step attended most): ids[t], skipped where none (NO_ROW), past the rows, inside the list
// buffer's runs or inside a visited bucket (bucket_of: one more than each row's bucket,
// numbered as the visits are; 0 for none), so that no token counts twice.
struct FollowRows {
    const u32* ids;
    const u32* bucket_of;
    const u32* visited;
    u32 visits, rows;
    Runs runs;
    __device__ __forceinline__ u32 operator()(u32 t) const {
        const u32 id = ids[t];
        if (id >= rows || runs.hold(id)) return NO_ROW;
        const u32 bucket = bucket_of[id];
        for (u32 k = 0; k < visits; ++k) {
            if (visited[k] + 1 == bucket) return NO_ROW;
        }
        return id;
    }
};

// The list part of a launch, for one KV head: its runs, then its list or buckets, then (with
// buckets, when `follow` is set) the `follow_count` ids the head follows, one last item.
// `items` is the part's work items per head (runs', list's and the followed ids');
// `head_rows` the rows of a head, `bucket_of` each row's bucket (`[heads][head_rows]`).
struct ListPart {
    u32 run0_row, run0_len, run1_row, run1_len, run_chunk, run_items;
    const u32* list_off;
    const u32* list;
    u32 list_chunk;
    const u32* bucket_off;
    const u32* bucket_ids;
    u32 items;
    const u32* follow;
    u32 follow_count;
    const u32* bucket_of;
    u32 head_rows;
    // The bucket cache, if any (see the top of this file): its keys and values, each
    // bucket's first row in it (NO_ROW: not cached), each row's token.
    const u16* cache_k;
    const u16* cache_v;
    const u32* slot_of;
    const u32* token_of;

    // Calls visit(rows, n) with the rows of the list part's item i of head h (nothing for
    // an item past the head's list: heads' lists differ in length). Every thread of the
    // block calls it.
    template <class Visit>
    __device__ __forceinline__ void item(u32 i, u32 h, Visit visit) const {
        if (i < run_items) {
            const u32 first = i * run_chunk, len = run0_len + run1_len;
            const DenseRows rows = {first, run0_row, run0_len, run1_row};
            visit(rows, min_u32(run_chunk, len - first));
            return;
        }
        if (list_off == nullptr) return;
        i -= run_items;
        if (bucket_off == nullptr) {
            const u32 begin = list_off[h], end = list_off[h + 1];
            if (i < (end - begin + list_chunk - 1) / list_chunk) {
                const u32 first = begin + i * list_chunk;
                const ListRows rows = {list + first};
                visit(rows, min_u32(list_chunk, end - first));
            }
            return;
        }
        const u32 begin = list_off[h], end = list_off[h + 1];
        const u32 visits = min_u32(end - begin, MAX_VISITS);
        const u32 follows = follow != nullptr ? 1u : 0u;
        if (follows && i == items - run_items - 1) {
            const FollowRows rows = {follow + (u64)h * follow_count,
                                     bucket_of + (u64)h * head_rows,
                                     list + begin,
                                     visits,
                                     head_rows,
                                     {run0_row, run0_len, run1_row, run1_len}};
            visit(rows, follow_count);
            return;
        }
        // Buckets: the head's visited buckets' ids, read as one sequence, split evenly over
        // the items, so that the items stay balanced however unequal the buckets are (the
        // visits are chosen on the GPU: the launcher knows neither which nor their sizes).
        __shared__ u32 first[MAX_VISITS];
        __shared__ u32 before[MAX_VISITS + 1];
        __shared__ u32 slot[MAX_VISITS];
        if (threadIdx.x < 32) {
            // Warp 0 sums the visits' sizes, 32 at a time (an inclusive scan by shuffles).
            const u32 lane = threadIdx.x;
            u32 carry = 0;
            for (u32 k0 = 0; k0 < visits; k0 += 32) {
                const u32 k = k0 + lane;
                u32 size = 0;
                if (k < visits) {
                    const u32 bucket = list[begin + k];
                    const u32 a = bucket_off[bucket];
                    size = bucket_off[bucket + 1] - a;
                    first[k] = a;
                    slot[k] = slot_of == nullptr ? NO_ROW : slot_of[bucket];
                }
                u32 sum = size;
#pragma unroll
                for (int off = 1; off < 32; off <<= 1) {
                    const u32 x = __shfl_up_sync(0xffffffffu, sum, off);
                    if (lane >= (u32)off) sum += x;
                }
                if (k < visits) before[k] = carry + sum - size;
                carry += __shfl_sync(0xffffffffu, sum, 31);
            }
            if (lane == 0) before[visits] = carry;
        }
        __syncthreads();
        const u32 total = before[visits], shares = items - run_items - follows;
        const u32 share = (total + shares - 1) / shares, start = i * share;
        if (start >= total) return;
        const Runs runs = {run0_row, run0_len, run1_row, run1_len};
        const u32 stop = min_u32(total, start + share);
        if (slot_of == nullptr) {
            const VisitedRows rows = {bucket_ids, first, before, visits, start, runs};
            visit(rows, stop - start);
            return;
        }
        // Bucket by bucket, each from the cache or in place (the same segments for every
        // thread of the block: the arrays are shared).
        for (u32 k = 0; k < visits; ++k) {
            const u32 a = before[k] > start ? before[k] : start;
            const u32 b = min_u32(before[k + 1], stop);
            if (a >= b) continue;
            if (slot[k] == NO_ROW) {
                const VisitedRows rows = {bucket_ids, first, before, visits, a, runs};
                visit(rows, b - a);
            } else {
                const CachedRows rows = {cache_k, cache_v, token_of, slot[k] + (a - before[k]), a,
                                         runs};
                visit(rows, b - a);
            }
        }
    }
};

// This thread's 8 columns of every group query of KV head h, pre-scaled to base-2 logits.
__device__ __forceinline__ void load_queries(const u16* __restrict__ q, u32 h, float scale_log2,
                                             float (&qf)[GROUP][8]) {
    const u32 lane = threadIdx.x % LANES;
#pragma unroll
    for (int g = 0; g < GROUP; ++g) {
        const u64 at = ((u64)h * GROUP + g) * HEAD_DIM + lane * 8;
        unpack8(__ldg(reinterpret_cast<const uint4*>(q + at)), qf[g]);
#pragma unroll
        for (int i = 0; i < 8; ++i) qf[g][i] *= scale_log2;
    }
}

// s[u][g] = the team's row u's key (8 columns a thread in kr[u]) · group query g (qf),
// summed over the team's lanes: every lane gets the whole logit.
__device__ __forceinline__ void group_scores(const uint4 (&kr)[UNROLL], const float (&qf)[GROUP][8],
                                             float (&s)[UNROLL][GROUP]) {
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
        float kf[8];
        unpack8(kr[u], kf);
#pragma unroll
        for (int g = 0; g < GROUP; ++g) {
            float dot = 0.f;
#pragma unroll
            for (int i = 0; i < 8; ++i) dot = fmaf(qf[g][i], kf[i], dot);
            s[u][g] = dot;
        }
    }
#pragma unroll
    for (int off = LANES / 2; off > 0; off >>= 1) {
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
#pragma unroll
            for (int g = 0; g < GROUP; ++g) s[u][g] += __shfl_xor_sync(0xffffffffu, s[u][g], off);
        }
    }
}

// The row numbers of the team's first UNROLL rows (NO_ROW past n): row u * TEAMS + team.
template <class RowOf>
__device__ __forceinline__ void first_rows(const RowOf& row_of, u32 n, u32 (&rows)[UNROLL]) {
    const u32 team = threadIdx.x / LANES;
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
        const u32 t = u * TEAMS + team;
        rows[u] = t < n ? row_of(t) : NO_ROW;
    }
}

// Attends the thread's team to rows row_of(0..n) of k/v, updating its state. Teams of LANES
// threads share a row, each thread 8 columns; every thread of the block runs the same number
// of iterations, so the shuffles see whole warps.
template <class RowOf>
__device__ __forceinline__ void attend_rows(const RowOf& row_of, u32 n, const u16* __restrict__ k,
                                            const u16* __restrict__ v, const float (&qf)[GROUP][8],
                                            State& st) {
    const u32 team = threadIdx.x / LANES, lane = threadIdx.x % LANES;
    // Row numbers one iteration ahead: where they come from memory (lists, buckets), their
    // loads overlap the previous rows' instead of delaying the keys and values behind them.
    u32 next[UNROLL];
    first_rows(row_of, n, next);
    for (u32 base = 0; base < n; base += STEP) {
        uint4 kr[UNROLL], vr[UNROLL];
        bool live[UNROLL];
        // All loads first, so that UNROLL rows of keys and values are in flight at once.
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const u32 row = next[u], t = base + STEP + u * TEAMS + team;
            next[u] = t < n ? row_of(t) : NO_ROW;
            live[u] = row != NO_ROW;
            if (live[u]) {
                const u64 at = (u64)row * HEAD_DIM + lane * 8;
                kr[u] = __ldg(reinterpret_cast<const uint4*>(k + at));
                vr[u] = __ldg(reinterpret_cast<const uint4*>(v + at));
            } else {
                const uint4 zero = {0u, 0u, 0u, 0u};
                kr[u] = zero;
                vr[u] = zero;
            }
        }
        float s[UNROLL][GROUP];
        group_scores(kr, qf, s);
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            st.rows += live[u];
            if (!live[u]) {
#pragma unroll
                for (int g = 0; g < GROUP; ++g) s[u][g] = NEG_INF;
            }
        }
        // The new maxima rescale the state, and s becomes each row's weight.
#pragma unroll
        for (int g = 0; g < GROUP; ++g) {
            float mx = st.m[g];
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) mx = fmaxf(mx, s[u][g]);
            // Nothing seen yet: the rows weigh nothing (and -inf - -inf is avoided).
            if (mx == NEG_INF) {
#pragma unroll
                for (int u = 0; u < UNROLL; ++u) s[u][g] = 0.f;
                continue;
            }
            const float c = exp2f(st.m[g] - mx);
            st.l[g] *= c;
#pragma unroll
            for (int i = 0; i < 8; ++i) st.o[g][i] *= c;
            st.m[g] = mx;
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) {
                s[u][g] = exp2f(s[u][g] - mx);
                st.l[g] += s[u][g];
            }
        }
        // Then the values, one row at a time: only that row's 8 floats are unpacked at once
        // (all rows unpacked together cost the f16 variant its occupancy).
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            float vf[8];
            unpack8(vr[u], vf);
#pragma unroll
            for (int g = 0; g < GROUP; ++g) {
#pragma unroll
                for (int i = 0; i < 8; ++i) st.o[g][i] = fmaf(s[u][g], vf[i], st.o[g][i]);
            }
        }
    }
}

#if MMA
// The tensor-core path (HEAD_DIM 64 or 128, GROUP <= 8). A warp attends to 16 rows at a
// time, like FlashAttention-2's decode with the group's queries as the rows of the first
// product:
// - logits S [16 x 16] = Q [16 x HEAD_DIM] · K^T: the group's queries are rows 0..GROUP-1
//   of Q (the rest zero), the tile's 16 keys its columns, HEAD_DIM / 16 mma.sync m16n8k16
//   for each half of the keys. A sum over dimensions may take them in any order, so each
//   thread loads 16-byte chunks of its keys (and queries) as they lie in memory: chunk
//   j * 4 + t of a row (t = lane % 4) holds the dimensions of k-steps 2j and 2j + 1.
//   Thread (g = lane / 4, t) then holds query g's logits of keys 2t, 2t + 1, 2t + 8, 2t + 9.
// - the softmax state of query g lives in the 4 threads of quad g (as a row's in FA2);
// - outputs O^T [HEAD_DIM x 8] += V^T [HEAD_DIM x 16] · P^T [16 x 8]: the weights are the
//   second operand as the logits left them; V^T's fragments are two keys' elements of one
//   dimension per register, made by byte permutes of the rows' 16-byte loads. Thread g's
//   dimensions are g * HEAD_DIM / 8 onwards (HEAD_DIM / 8 of them): tile i's rows g and
//   g + 8 are dimensions g * HEAD_DIM / 8 + 2i and + 2i + 1.
// The weights in [0, 1] are split into PSPLIT 16-bit terms (f16: 2, bf16: 3) whose products
// all accumulate in f32, so that the output keeps f32's precision as the scalar path's does.
#if KV_BF16
#define MMA_TYPE "bf16"
#define PSPLIT 3
#else
#define MMA_TYPE "f16"
#define PSPLIT 2
#endif
#define WARPS (THREADS / 32)
// 16-byte chunks of a key row, and of a value row, each thread loads; tiles of the output.
#define KCH (HEAD_DIM / 32)
#define VCH (HEAD_DIM / 64)
#define MTILES (HEAD_DIM / 16)

// c += a · b, a 16x16 (row-major fragments), b 16x8 (column-major).
__device__ __forceinline__ void mma16816(float (&c)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0,
                                         u32 b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32." MMA_TYPE "." MMA_TYPE ".f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ u32 prmt(u32 a, u32 b, u32 selector) {
    u32 d;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(selector));
    return d;
}

// Word i (a constant) of a 16-byte load.
__device__ __forceinline__ u32 word(const uint4& x, int i) {
    return i == 0 ? x.x : i == 1 ? x.y : i == 2 ? x.z : x.w;
}

// Two weights (x0 in the low half) as PSPLIT 16-bit terms whose sum is x0, x1 to about f32
// precision.
__device__ __forceinline__ void split_weights(float x0, float x1, u32 (&w)[PSPLIT]) {
#if KV_BF16
    // bf16 is f32's upper half: truncate, keep the exact remainder, twice, then round.
#pragma unroll
    for (int s = 0; s < PSPLIT - 1; ++s) {
        const u32 b0 = __float_as_uint(x0), b1 = __float_as_uint(x1);
        w[s] = prmt(b0, b1, 0x7632);
        x0 -= __uint_as_float(b0 & 0xffff0000u);
        x1 -= __uint_as_float(b1 & 0xffff0000u);
    }
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(w[PSPLIT - 1]) : "f"(x1), "f"(x0));
#else
#pragma unroll
    for (int s = 0; s < PSPLIT - 1; ++s) {
        asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(w[s]) : "f"(x1), "f"(x0));
        float h0, h1;
        asm("cvt.f32.f16 %0, %1;" : "=f"(h0) : "h"((u16)(w[s] & 0xffffu)));
        asm("cvt.f32.f16 %0, %1;" : "=f"(h1) : "h"((u16)(w[s] >> 16)));
        x0 -= h0;
        x1 -= h1;
    }
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(w[PSPLIT - 1]) : "f"(x1), "f"(x0));
#endif
}

// A warp's running softmax state, in mma fragments: query g's maximum (base-2 logits) in
// every thread of quad g, this thread's part of its sum, and O^T's tiles (rows: dimensions,
// columns: queries 2t and 2t + 1).
struct MState {
    float m;
    float l;
    float o[MTILES][4];
    u32 rows;
};

// Query g's chunks j * 4 + t (zero for g >= GROUP): the first operand of the logits.
__device__ __forceinline__ void load_query_frags(const u16* __restrict__ q, u32 h,
                                                 uint4 (&qa)[KCH]) {
    const u32 lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
#pragma unroll
    for (int j = 0; j < KCH; ++j) {
        const uint4 zero = {0u, 0u, 0u, 0u};
        qa[j] = g < GROUP ? __ldg(reinterpret_cast<const uint4*>(
                                q + ((u64)h * GROUP + g) * HEAD_DIM + (j * 4 + t) * 8))
                          : zero;
    }
}

// Attends the thread's warp to rows row_of(0..n) of k/v in tiles of 16 (warp w takes tiles
// w, w + WARPS, ...), updating its state. Each lane finds the row of one key of the next
// tile (lanes 16..31 repeat lanes 0..15) while the current tile's rows are in flight.
template <class RowOf>
__device__ __forceinline__ void attend_rows_mma(const RowOf& row_of, u32 n,
                                                const u16* __restrict__ k,
                                                const u16* __restrict__ v,
                                                const uint4 (&qa)[KCH], float scale_log2,
                                                MState& st) {
    const u32 warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    const u32 mine = lane % 16;
    u32 next = warp * 16 + mine < n ? row_of(warp * 16 + mine) : NO_ROW;
    for (u32 base = warp * 16; base < n; base += WARPS * 16) {
        const u32 id = next;
        const u32 ahead = base + WARPS * 16 + mine;
        next = ahead < n ? row_of(ahead) : NO_ROW;
        st.rows += lane < 16 && id != NO_ROW;
        // Keys g and g + 8 (logits' second operand), values of keys 2t, 2t + 1, 2t + 8,
        // 2t + 9 (outputs' first operand).
        const u32 rk[2] = {__shfl_sync(0xffffffffu, id, g), __shfl_sync(0xffffffffu, id, g + 8)};
        const u32 rv[4] = {__shfl_sync(0xffffffffu, id, 2 * t),
                           __shfl_sync(0xffffffffu, id, 2 * t + 1),
                           __shfl_sync(0xffffffffu, id, 2 * t + 8),
                           __shfl_sync(0xffffffffu, id, 2 * t + 9)};
        const uint4 zero = {0u, 0u, 0u, 0u};
        uint4 kr[2][KCH], vr[4][VCH];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
#pragma unroll
            for (int j = 0; j < KCH; ++j)
                kr[h][j] = rk[h] == NO_ROW ? zero
                                           : __ldg(reinterpret_cast<const uint4*>(
                                                 k + (u64)rk[h] * HEAD_DIM + (j * 4 + t) * 8));
        }
#pragma unroll
        for (int r = 0; r < 4; ++r) {
#pragma unroll
            for (int c = 0; c < VCH; ++c)
                vr[r][c] = rv[r] == NO_ROW
                               ? zero
                               : __ldg(reinterpret_cast<const uint4*>(
                                     v + (u64)rv[r] * HEAD_DIM + g * (HEAD_DIM / 8) + c * 8));
        }
        // Logits: s[h] holds query g's of keys 8h + 2t, 8h + 2t + 1 (and row g + 8's, zero).
        float s[2][4];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
#pragma unroll
            for (int i = 0; i < 4; ++i) s[h][i] = 0.f;
#pragma unroll
            for (int j = 0; j < KCH; ++j) {
                mma16816(s[h], qa[j].x, 0u, qa[j].y, 0u, kr[h][j].x, kr[h][j].y);
                mma16816(s[h], qa[j].z, 0u, qa[j].w, 0u, kr[h][j].z, kr[h][j].w);
            }
        }
        float p[4] = {s[0][0] * scale_log2, s[0][1] * scale_log2, s[1][0] * scale_log2,
                      s[1][1] * scale_log2};
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            if (rv[i] == NO_ROW) p[i] = NEG_INF;
        }
        float mx = fmaxf(fmaxf(p[0], p[1]), fmaxf(p[2], p[3]));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        mx = fmaxf(mx, st.m);
        // Nothing seen yet: the rows weigh nothing (and -inf - -inf is avoided).
        const float ref = mx == NEG_INF ? 0.f : mx;
        const float c = exp2f(st.m - ref);
        st.m = mx;
        float sum = 0.f;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            p[i] = exp2f(p[i] - ref);
            sum += p[i];
        }
        st.l = fmaf(st.l, c, sum);
        // Rescale the outputs of queries 2t and 2t + 1 (their quads' factors), unless no
        // query's maximum moved.
        const float c0 = __shfl_sync(0xffffffffu, c, 8 * t), c1 = __shfl_sync(0xffffffffu, c, 8 * t + 4);
        if (__any_sync(0xffffffffu, c0 != 1.f || c1 != 1.f)) {
#pragma unroll
            for (int i = 0; i < MTILES; ++i) {
                st.o[i][0] *= c0;
                st.o[i][1] *= c1;
                st.o[i][2] *= c0;
                st.o[i][3] *= c1;
            }
        }
        u32 w0[PSPLIT], w1[PSPLIT];
        split_weights(p[0], p[1], w0);
        split_weights(p[2], p[3], w1);
#pragma unroll
        for (int i = 0; i < MTILES; ++i) {
            const u32 lo0 = word(vr[0][i / 4], i % 4), lo1 = word(vr[1][i / 4], i % 4);
            const u32 hi0 = word(vr[2][i / 4], i % 4), hi1 = word(vr[3][i / 4], i % 4);
            const u32 a0 = prmt(lo0, lo1, 0x5410), a1 = prmt(lo0, lo1, 0x7632);
            const u32 a2 = prmt(hi0, hi1, 0x5410), a3 = prmt(hi0, hi1, 0x7632);
#pragma unroll
            for (int sp = 0; sp < PSPLIT; ++sp) mma16816(st.o[i], a0, a1, a2, a3, w0[sp], w1[sp]);
        }
    }
}

// ListPart::item's visitor for `attend` on the tensor-core path.
struct AttendVisitMma {
    const u16* k;
    const u16* v;
    const uint4 (*qa)[KCH];
    float scale_log2;
    MState* st;
    template <class RowOf>
    __device__ __forceinline__ void operator()(const RowOf& rows, u32 n) const {
        attend_rows_mma(rows, n, k, v, *qa, scale_log2, *st);
    }
    __device__ __forceinline__ void operator()(const CachedRows& rows, u32 n) const {
        attend_rows_mma(rows, n, rows.k, rows.v, *qa, scale_log2, *st);
    }
};
#endif

// Partials one merge reads at most: the launcher keeps groups and group sizes within it.
#define MAX_MERGE 128


// Issues the loads of partials j0 .. j0 + MERGE_BATCH (those below `count`): this thread's
// float4s of their outputs.
__device__ __forceinline__ void load_batch(float4 (&x)[MERGE_BATCH][MERGE_VECS], const float* src,
                                           u32 j0, u32 count) {
#pragma unroll
    for (int b = 0; b < MERGE_BATCH; ++b) {
#pragma unroll
        for (int k = 0; k < MERGE_VECS; ++k) {
            const u32 v = threadIdx.x + k * THREADS;
            if (j0 + b < count && v < GROUP * HEAD_DIM / 4)
                x[b][k] = __ldcg(reinterpret_cast<const float4*>(src + (u64)(j0 + b) * PARTIAL) + v);
        }
    }
}

// Merges `count` (<= MAX_MERGE) consecutive partials at `src` into the partial `dst`, or,
// when `dst` is null, into the normalised output `out` [GROUP, HEAD_DIM] (zeros for a head
// that saw no token, as Partial::finish gives). Every thread of the block calls it. It runs
// on the critical path after the other blocks, so its time is a few L2 round trips: the
// first batch of outputs is in flight while the maxima and weights are computed, each batch
// has all its loads in flight at once, and each weight is computed once by a warp. Reads
// bypass L1: other blocks wrote the partials. Into `out`, it also writes each group head's
// log-sum-exp (base 2) to `lse` unless that is null.
__device__ void merge(const float* src, u32 count, float* dst, float* out, float* lse) {
    __shared__ float sm_w[MAX_MERGE * GROUP];
    __shared__ float sm_l[MAX_MERGE * GROUP];
    __shared__ float sm_stat[2][GROUP];
    float4 x[MERGE_BATCH][MERGE_VECS];
    load_batch(x, src, 0, count);
    for (u32 p = threadIdx.x; p < count * GROUP; p += THREADS) {
        const float* stats = src + (u64)(p / GROUP) * PARTIAL + GROUP * HEAD_DIM + p % GROUP;
        sm_w[p] = __ldcg(stats);
        sm_l[p] = __ldcg(stats + GROUP);
    }
    __syncthreads();
    const u32 warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    for (u32 g = warp; g < GROUP; g += THREADS / 32) {
        float mx = NEG_INF, l = 0.f;
        for (u32 j = lane; j < count; j += 32) mx = fmaxf(mx, sm_w[j * GROUP + g]);
        mx = warp_max(mx);
        for (u32 j = lane; j < count; j += 32) {
            // Empty partials (max -inf) weigh nothing; so does everything when all are empty.
            const float w = mx == NEG_INF ? 0.f : exp2f(sm_w[j * GROUP + g] - mx);
            sm_w[j * GROUP + g] = w;
            l = fmaf(w, sm_l[j * GROUP + g], l);
        }
        l = warp_sum(l);
        if (lane == 0) {
            sm_stat[0][g] = mx;
            sm_stat[1][g] = l;
        }
    }
    __syncthreads();
    float4 acc[MERGE_VECS];
#pragma unroll
    for (int k = 0; k < MERGE_VECS; ++k) acc[k] = make_float4(0.f, 0.f, 0.f, 0.f);
    for (u32 j0 = 0; j0 < count; j0 += MERGE_BATCH) {
        if (j0 > 0) load_batch(x, src, j0, count);
#pragma unroll
        for (int b = 0; b < MERGE_BATCH; ++b) {
#pragma unroll
            for (int k = 0; k < MERGE_VECS; ++k) {
                const u32 v = threadIdx.x + k * THREADS;
                if (j0 + b < count && v < GROUP * HEAD_DIM / 4) {
                    const float w = sm_w[(j0 + b) * GROUP + v * 4 / HEAD_DIM];
                    acc[k].x = fmaf(w, x[b][k].x, acc[k].x);
                    acc[k].y = fmaf(w, x[b][k].y, acc[k].y);
                    acc[k].z = fmaf(w, x[b][k].z, acc[k].z);
                    acc[k].w = fmaf(w, x[b][k].w, acc[k].w);
                }
            }
        }
    }
#pragma unroll
    for (int k = 0; k < MERGE_VECS; ++k) {
        const u32 v = threadIdx.x + k * THREADS;
        if (v >= GROUP * HEAD_DIM / 4) continue;
        float4 o = acc[k];
        if (dst == nullptr) {
            const float l = sm_stat[1][v * 4 / HEAD_DIM], inv = l > 0.f ? 1.f / l : 0.f;
            o = make_float4(o.x * inv, o.y * inv, o.z * inv, o.w * inv);
            reinterpret_cast<float4*>(out)[v] = o;
        } else {
            reinterpret_cast<float4*>(dst)[v] = o;
        }
    }
    if (dst != nullptr && threadIdx.x < GROUP) {
        dst[GROUP * HEAD_DIM + threadIdx.x] = sm_stat[0][threadIdx.x];
        dst[GROUP * HEAD_DIM + GROUP + threadIdx.x] = sm_stat[1][threadIdx.x];
    }
    if (dst == nullptr && lse != nullptr && threadIdx.x < GROUP) {
        lse[threadIdx.x] = sm_stat[0][threadIdx.x] + log2f(sm_stat[1][threadIdx.x]);
    }
}

// ListPart::item's visitor for `attend`.
struct AttendVisit {
    const u16* k;
    const u16* v;
    const float (*qf)[GROUP][8];
    State* st;
    template <class RowOf>
    __device__ __forceinline__ void operator()(const RowOf& rows, u32 n) const {
        attend_rows(rows, n, k, v, *qf, *st);
    }
    __device__ __forceinline__ void operator()(const CachedRows& rows, u32 n) const {
        attend_rows(rows, n, rows.k, rows.v, *qf, *st);
    }
};

extern "C" __global__ void __launch_bounds__(THREADS)
attend(const u16* __restrict__ q, float scale_log2,
       // dense part
       const u16* __restrict__ dk, const u16* __restrict__ dv, u64 d_stride, u32 run0_row,
       u32 run0_len, u32 run1_row, u32 run1_len, u32 dense_chunk, u32 dense_items,
       // list part
       const u16* __restrict__ lk, const u16* __restrict__ lv, u64 l_stride, u32 lrun0_row,
       u32 lrun0_len, u32 lrun1_row, u32 lrun1_len, u32 lrun_items,
       const u32* __restrict__ list_off, const u32* __restrict__ list, u32 list_chunk,
       const u32* __restrict__ bucket_off, const u32* __restrict__ bucket_ids,
       const u32* __restrict__ follow, u32 follow_count, const u32* __restrict__ bucket_of,
       u32 head_rows, const u16* __restrict__ cache_k, const u16* __restrict__ cache_v,
       const u32* __restrict__ slot_of, const u32* __restrict__ token_of,
       // results
       u32 group_size, float* __restrict__ partials, u32* __restrict__ counters,
       float* __restrict__ out, float* __restrict__ lse, u64* __restrict__ bucket_rows,
       u16* __restrict__ q_keep, u32 after_route) {
    const u32 h = blockIdx.x, x = blockIdx.y, items = gridDim.y, heads = gridDim.x;
    const u32 team = threadIdx.x / LANES, lane = threadIdx.x % LANES;
#if __CUDA_ARCH__ >= 900
    if (!after_route) asm volatile("griddepcontrol.wait;" ::: "memory");
    // The launch after this one may start its blocks now: the output projection's `gemv`, a
    // programmatic dependent launch that reads only its weights before it waits for this
    // grid (a plain launch waits for this grid whatever this says).
    asm volatile("griddepcontrol.launch_dependents;");
#endif
    // The first item of each head keeps the head's queries for `attention_mass`, which may
    // run after the caller's query buffer has changed.
    if (x == 0) {
        const u64 head = (u64)h * GROUP * HEAD_DIM;
        const uint4* src = reinterpret_cast<const uint4*>(q + head);
        uint4* dst = reinterpret_cast<uint4*>(q_keep + head);
        for (u32 i = threadIdx.x; i < GROUP * HEAD_DIM / 8; i += THREADS) dst[i] = __ldg(src + i);
    }
    // The bucket rows this block attends, when the launch counts them (the ids of the
    // visited buckets outside the runs: what the index selected).
    __shared__ u32 sm_rows;
    const bool counts = bucket_rows != nullptr && bucket_off != nullptr &&
                        x >= dense_items + lrun_items;
    if (threadIdx.x == 0) sm_rows = 0;
#if __CUDA_ARCH__ >= 900
    // The visits come from the routing launch before this one: wait for it to finish.
    if (after_route && x >= dense_items + lrun_items) asm volatile("griddepcontrol.wait;" ::: "memory");
#endif

    __shared__ __align__(16) float sm_o[PARTS][GROUP][HEAD_DIM];
    __shared__ float sm_m[PARTS][GROUP];
    __shared__ float sm_l[PARTS][GROUP];
#if MMA
    (void)team;
    (void)lane;
    uint4 qa[KCH];
    load_query_frags(q, h, qa);
    MState st;
    st.rows = 0;
    st.m = NEG_INF;
    st.l = 0.f;
#pragma unroll
    for (int i = 0; i < MTILES; ++i) {
#pragma unroll
        for (int j = 0; j < 4; ++j) st.o[i][j] = 0.f;
    }
    if (x < dense_items) {
        const u32 first = x * dense_chunk, dense_len = run0_len + run1_len;
        const u32 n = min_u32(dense_chunk, dense_len - first);
        const DenseRows rows = {first, run0_row, run0_len, run1_row};
        const u64 head = (u64)h * d_stride * HEAD_DIM;
        attend_rows_mma(rows, n, dk + head, dv + head, qa, scale_log2, st);
    } else {
        const ListPart part = {lrun0_row,  lrun0_len,         lrun1_row,    lrun1_len,
                               dense_chunk, lrun_items,       list_off,     list,
                               list_chunk, bucket_off,        bucket_ids,   items - dense_items,
                               follow,     follow_count,      bucket_of,    head_rows,
                               cache_k,    cache_v,           slot_of,      token_of};
        const u64 head = (u64)h * l_stride * HEAD_DIM;
        part.item(x - dense_items, h, AttendVisitMma{lk + head, lv + head, &qa, scale_log2, &st});
    }
    // Each warp's state into shared memory: query g's maximum and sum (the quad's parts
    // added) from quad g, queries 2t and 2t + 1's dimensions g * HEAD_DIM / 8 onwards from
    // thread (g, t), 16 bytes at a time.
    {
        const u32 warp = threadIdx.x / 32, wl = threadIdx.x % 32, g = wl / 4, t = wl % 4;
        float l = st.l;
        l += __shfl_xor_sync(0xffffffffu, l, 1);
        l += __shfl_xor_sync(0xffffffffu, l, 2);
        if (t == 0 && g < GROUP) {
            sm_m[warp][g] = st.m;
            sm_l[warp][g] = l;
        }
#pragma unroll
        for (int c = 0; c < 2; ++c) {
            if (2 * t + c < GROUP) {
                float4* o = reinterpret_cast<float4*>(&sm_o[warp][2 * t + c][g * (HEAD_DIM / 8)]);
#pragma unroll
                for (int i = 0; i < MTILES / 2; ++i)
                    o[i] = make_float4(st.o[2 * i][c], st.o[2 * i][c + 2], st.o[2 * i + 1][c],
                                       st.o[2 * i + 1][c + 2]);
            }
        }
        // Lanes 0..15 counted distinct rows.
        const u32 rows = __reduce_add_sync(0xffffffffu, st.rows);
        if (counts && wl == 0 && rows > 0) atomicAdd(&sm_rows, rows);
    }
#else
    float qf[GROUP][8];
    load_queries(q, h, scale_log2, qf);
    State st;
    st.rows = 0;
#pragma unroll
    for (int g = 0; g < GROUP; ++g) {
        st.m[g] = NEG_INF;
        st.l[g] = 0.f;
#pragma unroll
        for (int i = 0; i < 8; ++i) st.o[g][i] = 0.f;
    }

    if (x < dense_items) {
        const u32 first = x * dense_chunk, dense_len = run0_len + run1_len;
        const u32 n = min_u32(dense_chunk, dense_len - first);
        const DenseRows rows = {first, run0_row, run0_len, run1_row};
        const u64 head = (u64)h * d_stride * HEAD_DIM;
        attend_rows(rows, n, dk + head, dv + head, qf, st);
    } else {
        const ListPart part = {lrun0_row,  lrun0_len,         lrun1_row,    lrun1_len,
                               dense_chunk, lrun_items,       list_off,     list,
                               list_chunk, bucket_off,        bucket_ids,   items - dense_items,
                               follow,     follow_count,      bucket_of,    head_rows,
                               cache_k,    cache_v,           slot_of,      token_of};
        const u64 head = (u64)h * l_stride * HEAD_DIM;
        part.item(x - dense_items, h, AttendVisit{lk + head, lv + head, &qf, &st});
    }

    // Combine the teams of the block into this item's partial. The outputs are stored 16
    // bytes at a time (eight scalar stores a thread would hit the same banks 8 ways).
#pragma unroll
    for (int g = 0; g < GROUP; ++g) {
        float4* o = reinterpret_cast<float4*>(&sm_o[team][g][lane * 8]);
        o[0] = make_float4(st.o[g][0], st.o[g][1], st.o[g][2], st.o[g][3]);
        o[1] = make_float4(st.o[g][4], st.o[g][5], st.o[g][6], st.o[g][7]);
        if (lane == 0) {
            sm_m[team][g] = st.m[g];
            sm_l[team][g] = st.l[g];
        }
    }
    // A team's lanes counted the same rows: its first lane adds them (the bucket items
    // passed a barrier in ListPart::item since sm_rows was zeroed).
    if (counts && lane == 0 && st.rows > 0) atomicAdd(&sm_rows, st.rows);
#endif
    __syncthreads();
    if (counts && threadIdx.x == 0 && sm_rows > 0) atomicAdd(bucket_rows, (u64)sm_rows);
    float* partial = partials + ((u64)h * items + x) * PARTIAL;
    for (u32 e = threadIdx.x; e < GROUP * HEAD_DIM; e += THREADS) {
        const u32 g = e / HEAD_DIM, col = e % HEAD_DIM;
        float mx = NEG_INF;
        for (int t = 0; t < PARTS; ++t) mx = fmaxf(mx, sm_m[t][g]);
        float o = 0.f, l = 0.f;
        if (mx != NEG_INF) {
            for (int t = 0; t < PARTS; ++t) {
                const float w = exp2f(sm_m[t][g] - mx);
                o = fmaf(w, sm_o[t][g][col], o);
                l = fmaf(w, sm_l[t][g], l);
            }
        }
        partial[e] = o;
        if (col == 0) {
            partial[GROUP * HEAD_DIM + g] = mx;
            partial[GROUP * HEAD_DIM + GROUP + g] = l;
        }
    }

    // Merge by log-sum-exp in two levels, so that no block reads more than about sqrt(items)
    // partials: the last block of each group of `group_size` items to finish merges the
    // group's partials, and the last group merged merges the groups' (threadfence reduction).
    const u32 groups = (items + group_size - 1) / group_size;
    const u32 group = x / group_size, first = group * group_size;
    u32* head_counters = counters + (u64)h * (groups + 1);
    float* group_partials = partials + ((u64)heads * items + (u64)h * groups) * PARTIAL;
    float* head_out = out + (u64)h * GROUP * HEAD_DIM;
    if (!last_to_finish(&head_counters[group], min_u32(group_size, items - first))) return;
    const float* item_partials = partials + ((u64)h * items + first) * PARTIAL;
    float* head_lse = lse == nullptr ? nullptr : lse + (u64)h * GROUP;
    if (groups == 1) {
        merge(item_partials, items, nullptr, head_out, head_lse);
    } else {
        merge(item_partials, min_u32(group_size, items - first), group_partials + (u64)group * PARTIAL, nullptr, nullptr);
        if (!last_to_finish(&head_counters[groups], groups)) return;
        merge(group_partials, groups, nullptr, head_out, head_lse);
    }
}

// Calls put(t, row, w) with the attention weight w of each row of the list part (rows
// row_of(0..n) of keys k, t < n), summed over the group's heads: exp2(logit - lse) for each,
// as `attend` weighed it; for a NO_ROW row (skipped: no weight) too, so that a put may mark
// its place. Pipelined as attend_rows: UNROLL rows a team in flight, the next iteration's
// row numbers loaded ahead; one lane of the row's team calls put.
template <class RowOf, class Put>
__device__ __forceinline__ void weigh_rows(const RowOf& row_of, u32 n, const u16* __restrict__ k,
                                           const float (&qf)[GROUP][8], const float (&lse)[GROUP],
                                           const Put& put) {
    const u32 team = threadIdx.x / LANES, lane = threadIdx.x % LANES;
    u32 next[UNROLL];
    first_rows(row_of, n, next);
    // Every thread runs the same iterations, so that the shuffles see whole warps.
    for (u32 base = 0; base < n; base += STEP) {
        uint4 kr[UNROLL];
        u32 rows[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const u32 t = base + STEP + u * TEAMS + team;
            rows[u] = next[u];
            next[u] = t < n ? row_of(t) : NO_ROW;
            const uint4 zero = {0u, 0u, 0u, 0u};
            kr[u] = rows[u] == NO_ROW
                        ? zero
                        : __ldg(reinterpret_cast<const uint4*>(k + (u64)rows[u] * HEAD_DIM + lane * 8));
        }
        float s[UNROLL][GROUP];
        group_scores(kr, qf, s);
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            float w = 0.f;
#pragma unroll
            for (int g = 0; g < GROUP; ++g) w += exp2f(s[u][g] - lse[g]);
            const u32 t = base + u * TEAMS + team;
            if (t < n && lane == 0) put(t, rows[u], w);
        }
    }
}

// The queries of KV head h and their log-sum-exp, as `attend` kept them.
struct HeadWeights {
    float qf[GROUP][8];
    float lse[GROUP];
    __device__ __forceinline__ HeadWeights(const u16* __restrict__ q, u32 h, float scale_log2,
                                           const float* __restrict__ all_lse) {
        load_queries(q, h, scale_log2, qf);
#pragma unroll
        for (int g = 0; g < GROUP; ++g) lse[g] = all_lse[(u64)h * GROUP + g];
    }
};

// Adds a row's weight to the mass of the token it holds (rows are token ids, or a block
// cache's slot rows when slot_token is set), so every KV head adds to the same `mass`.
struct AddMass {
    float* mass;
    const u32* slot_token;
    u32 slot_shift;
    __device__ __forceinline__ void operator()(u32, u32 r, float w) const {
        if (r == NO_ROW) return;
        const u32 token = slot_token == nullptr
                              ? r
                              : slot_token[r >> slot_shift] + (r & ((1u << slot_shift) - 1u));
        atomicAdd(mass + token, w);
    }
    // The same for rows of a bucket cache, whose tokens are `token_of`.
    __device__ __forceinline__ AddMass cached(const u32* token_of) const {
        return {mass, token_of, 0u};
    }
};

// The parameters `attention_mass` and `follow_weights` begin with (the queries and the
// log-sum-exp `attend` kept, the list buffer's keys, the list part), and the list part they
// make of them, its items one per block of the grid's x.
#define WEIGHED_PARAMS                                                                        \
    const u16 *__restrict__ q, float scale_log2, const u16 *__restrict__ lk, u64 l_stride,    \
        u32 lrun0_row, u32 lrun0_len, u32 lrun1_row, u32 lrun1_len, u32 lrun_chunk,           \
        u32 lrun_items, const u32 *__restrict__ list_off, const u32 *__restrict__ list,       \
        u32 list_chunk, const u32 *__restrict__ bucket_off,                                   \
        const u32 *__restrict__ bucket_ids, const u32 *__restrict__ follow, u32 follow_count, \
        const u32 *__restrict__ bucket_of, u32 head_rows, const u16 *__restrict__ cache_k,    \
        const u32 *__restrict__ slot_of, const u32 *__restrict__ token_of
#define WEIGHED_PART                                                                          \
    {lrun0_row,  lrun0_len, lrun1_row, lrun1_len,    lrun_chunk, lrun_items,                  \
     list_off,   list,      list_chunk, bucket_off,  bucket_ids, gridDim.x,                   \
     follow,     follow_count, bucket_of, head_rows, cache_k,    nullptr,                     \
     slot_of,    token_of}

// ListPart::item's visitor for `attention_mass`.
struct MassVisit {
    const u16* k;
    const HeadWeights* head;
    AddMass add;
    template <class RowOf>
    __device__ __forceinline__ void operator()(const RowOf& rows, u32 n) const {
        weigh_rows(rows, n, k, head->qf, head->lse, add);
    }
    __device__ __forceinline__ void operator()(const CachedRows& rows, u32 n) const {
        weigh_rows(rows, n, rows.k, head->qf, head->lse, add.cached(rows.token_of));
    }
};

extern "C" __global__ void __launch_bounds__(THREADS)
attention_mass(WEIGHED_PARAMS, const float* __restrict__ lse, float* __restrict__ mass,
               const u32* __restrict__ slot_token, u32 slot_shift) {
    const u32 h = blockIdx.y;
    const HeadWeights head(q, h, scale_log2, lse);
    const ListPart part = WEIGHED_PART;
    const u64 at = (u64)h * l_stride * HEAD_DIM;
    part.item(blockIdx.x, h, MassVisit{lk + at, &head, {mass, slot_token, slot_shift}});
}

// Writes a list row's weight at its place in the lists.
struct PutWeight {
    float* at;
    __device__ __forceinline__ void operator()(u32 t, u32 r, float w) const {
        if (r != NO_ROW) at[t] = w;
    }
};

// ListPart::item's visitor for `attention_weights`: a slice of a head's list writes its
// rows' weights where the slice starts in the lists; `attention_weights` launches no run or
// bucket items.
struct WeightVisit {
    const u16* k;
    const HeadWeights* head;
    const u32* list;
    float* weights;
    __device__ __forceinline__ void operator()(const ListRows& rows, u32 n) const {
        weigh_rows(rows, n, k, head->qf, head->lse, PutWeight{weights + (rows.rows - list)});
    }
    template <class RowOf>
    __device__ __forceinline__ void operator()(const RowOf&, u32) const {}
};

// `weights[i]` = the attention weight list item i (of every head's list, in CSR order)
// received in the workspace's last launch, summed over its KV head's group: what a query
// following its most attended tokens ranks them by.
extern "C" __global__ void __launch_bounds__(THREADS)
attention_weights(const u16* __restrict__ q, float scale_log2, const u16* __restrict__ lk,
                  u64 l_stride, const u32* __restrict__ list_off, const u32* __restrict__ list,
                  u32 list_chunk, const float* __restrict__ lse, float* __restrict__ weights) {
    const u32 h = blockIdx.y;
    const HeadWeights head(q, h, scale_log2, lse);
    const ListPart part = {0u,      0u,      0u,        0u,      list_chunk, 0u,
                           list_off, list,   list_chunk, nullptr, nullptr,    gridDim.x,
                           nullptr, 0u,      nullptr,   0u,      nullptr,    nullptr,
                           nullptr, nullptr};
    const u64 at = (u64)h * l_stride * HEAD_DIM;
    part.item(blockIdx.x, h, WeightVisit{lk + at, &head, list, weights});
}

// Where `follow_weights` writes a row's weight and id: the visited buckets' rows at their
// place in the head's sequence of visited ids, the followed ids after `cap` (the head's
// rows); a skipped row (NO_ROW) as weight -1, so that no stale value is picked.
struct PutCandidate {
    float* weight;
    u32* id;
    u32 at, end;
    // The tokens of a bucket cache's rows (null: rows are tokens).
    const u32* token_of;
    __device__ __forceinline__ void operator()(u32 t, u32 r, float w) const {
        if (at + t >= end) return;
        weight[at + t] = r == NO_ROW ? -1.f : w;
        id[at + t] = r == NO_ROW || token_of == nullptr ? r : token_of[r];
    }
};

// Adds a row's weight to the mass, where there is one, and writes it as a candidate.
struct MassAndCandidate {
    AddMass add;
    PutCandidate put;
    __device__ __forceinline__ void operator()(u32 t, u32 r, float w) const {
        if (add.mass != nullptr) add(t, r, w);
        put(t, r, w);
    }
};

// ListPart::item's visitor for `follow_weights`: the visited buckets' and followed rows are
// candidates; with a mass every row adds its weight to it besides (as `MassVisit`; the
// launcher gives it run items only then).
struct CandidateVisit {
    const u16* k;
    const HeadWeights* head;
    AddMass add;
    float* weight;
    u32* id;
    u32 cap;
    __device__ __forceinline__ void operator()(const VisitedRows& rows, u32 n) const {
        const MassAndCandidate both = {add, PutCandidate{weight, id, rows.start, cap, nullptr}};
        weigh_rows(rows, n, k, head->qf, head->lse, both);
    }
    __device__ __forceinline__ void operator()(const CachedRows& rows, u32 n) const {
        const MassAndCandidate both = {add.cached(rows.token_of),
                                       PutCandidate{weight, id, rows.start, cap, rows.token_of}};
        weigh_rows(rows, n, rows.k, head->qf, head->lse, both);
    }
    __device__ __forceinline__ void operator()(const FollowRows& rows, u32 n) const {
        const MassAndCandidate both = {add, PutCandidate{weight, id, cap, 0xffffffffu, nullptr}};
        weigh_rows(rows, n, k, head->qf, head->lse, both);
    }
    template <class RowOf>
    __device__ __forceinline__ void operator()(const RowOf& rows, u32 n) const {
        if (add.mass != nullptr) weigh_rows(rows, n, k, head->qf, head->lse, add);
    }
};

// The weight every row of a bucket launch's list part (visited buckets and followed ids)
// received in the workspace's last launch, summed over its KV head's group, with its id:
// head h's candidates at `weight`/`id` + h * (head_rows + follow_count), what `follow_pick`
// (follow.cu) ranks. With a `mass` (not null) it also adds what `attention_mass` adds for the
// whole part, runs included: a step that counts towards provenance and ranks what the next
// step follows weighs each row once.
extern "C" __global__ void __launch_bounds__(THREADS)
follow_weights(WEIGHED_PARAMS, const float* __restrict__ lse, float* __restrict__ mass,
               const u32* __restrict__ slot_token, u32 slot_shift, float* __restrict__ weight,
               u32* __restrict__ id) {
    const u32 h = blockIdx.y;
    const HeadWeights head(q, h, scale_log2, lse);
    const ListPart part = WEIGHED_PART;
    const u64 at = (u64)h * l_stride * HEAD_DIM;
    const u64 stride = (u64)head_rows + follow_count;
    part.item(blockIdx.x, h,
              CandidateVisit{lk + at, &head, {mass, slot_token, slot_shift}, weight + h * stride,
                             id + h * stride, head_rows});
}
