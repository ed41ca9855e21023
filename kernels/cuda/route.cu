// Bucket routing of one decode step on the GPU, for a bucket index whose buckets are probed
// by a linear score of the query (IVF: the centroids' inner products): each KV head's group
// of queries picks the `probes` buckets of best score, where a bucket's score is the best
// over the group's heads (as `IvfIndex` does on the CPU), ties to the lower bucket.
//
// Compiled by NVRTC with GROUP, the query heads per KV head (1..16), and HEAD_DIM defined;
// HEAD_DIM / 8 is a power of two up to 32. blocks.cuh comes before this file.
//
// Layouts: queries [kv_heads, GROUP, head_dim] f32; centroids [kv_heads, buckets, head_dim]
// f32; `visited` [kv_heads, stride] gets, in each head's first `probes` items, list
// numbers of the partition's CSR of ids, in which bucket b of KV head h is list
// h * per_head + b and list kv_heads * per_head is empty (probes <= buckets <= per_head).
// A head's lists past its buckets and its visits past `probes` are the launcher's: a bucket
// every search visits (ivf's hot keys) is one more list a head, preset in the visits.
// Routing never reads the ids: the bucket attention that reads the visits counts the ids it
// attends.
//
// Grid: (KV heads, slices), blocks of ROUTE_THREADS. Every block of a head scores all of its
// buckets (dynamic shared memory holds the scores, padded to whole SCAN chunks), then ranks
// only its slice of them against all: the ranking, most of the work, is spread over
// several multiprocessors with no block waiting for another (one block a head ran the whole
// head on one multiprocessor, instruction-bound). Each step is split over several threads
// per bucket, so that its loads are in flight together and no thread runs a long loop
// alone.

typedef unsigned int u32;
typedef unsigned long long u64;

#define NEG_INF __int_as_float(0xff800000)

// Threads of a block (`ROUTE_THREADS` in route.rs).
#define ROUTE_THREADS 512
// Buckets each thread scores between uses of their loads (loads in flight): 8 take a
// head's 256 buckets in one pass when the group's queries leave the registers for them.
#define BUCKETS_IN_FLIGHT (GROUP <= 4 ? 8 : 4)
// Scores each ranking thread compares between checks of its count (loads in flight).
#define SCAN 8

// Eight floats (two 16-byte loads) of `p`, through the read-only cache.
__device__ __forceinline__ void load8(const float* p, float (&x)[8]) {
    const float4 a = __ldg(reinterpret_cast<const float4*>(p));
    const float4 b = __ldg(reinterpret_cast<const float4*>(p) + 1);
    x[0] = a.x; x[1] = a.y; x[2] = a.z; x[3] = a.w;
    x[4] = b.x; x[5] = b.y; x[6] = b.z; x[7] = b.w;
}

extern "C" __global__ void __launch_bounds__(ROUTE_THREADS)
route_buckets(const float* __restrict__ q, const float* __restrict__ centroids, u32 head_dim,
              u32 buckets, u32 probes, u32 per, u32 stride, u32 per_head,
              u32* __restrict__ visited) {
#if __CUDA_ARCH__ >= 900
    // Launched as a programmatic dependent launch: first the launch before this one
    // (attention's inputs, which write the queries) finishes. Then a bucket attention
    // launched after this one (programmatic dependent launch) may start its blocks: those
    // that need the visits wait for this grid to finish, and the others read only what was
    // written before this grid, which every block of it has now waited for.
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;");
#endif
    // The buckets' scores, padded with -inf to whole SCAN chunks.
    extern __shared__ float scores[];
    const u32 padded = (buckets + SCAN - 1) / SCAN * SCAN;
    __shared__ u32 scored;
    const u32 h = blockIdx.x;
    if (threadIdx.x == 0) scored = 0;
    for (u32 b = buckets + threadIdx.x; b < padded; b += blockDim.x) scores[b] = NEG_INF;
    // Each bucket's score, the group's best inner product with its centroid, from `lanes`
    // adjacent threads that each hold 8 dimensions of every group query in registers (read
    // once) and load the same 8 of the bucket's centroid: a warp reads whole centroids,
    // and the queries never pass through shared memory.
    // The threads of a bucket: a constant, so that their shuffles unroll.
    constexpr u32 lanes = HEAD_DIM / 8;
    const u32 sub = threadIdx.x % lanes, per_pass = ROUTE_THREADS / lanes;
    float qr[GROUP][8];
#pragma unroll
    for (int g = 0; g < GROUP; ++g) load8(q + ((u64)h * GROUP + g) * head_dim + sub * 8, qr[g]);
    const float* hc = centroids + (u64)h * buckets * head_dim + sub * 8;
    // Every thread runs the same passes (the shuffles need whole warps); those past the
    // last bucket load its centroid again and drop the score.
    for (u32 pass = 0; pass < buckets; pass += per_pass * BUCKETS_IN_FLIGHT) {
        const u32 base = pass + threadIdx.x / lanes;
        float c[BUCKETS_IN_FLIGHT][8];
#pragma unroll
        for (int u = 0; u < BUCKETS_IN_FLIGHT; ++u)
            load8(hc + (u64)umin(base + u * per_pass, buckets - 1) * head_dim, c[u]);
#pragma unroll
        for (int u = 0; u < BUCKETS_IN_FLIGHT; ++u) {
            float best = NEG_INF;
#pragma unroll
            for (int g = 0; g < GROUP; ++g) {
                float x = 0.f;
#pragma unroll
                for (int i = 0; i < 8; ++i) x = fmaf(qr[g][i], c[u][i], x);
#pragma unroll
                for (u32 off = lanes / 2; off > 0; off >>= 1) x += __shfl_xor_sync(0xffffffffu, x, off);
                best = fmaxf(best, x);
            }
            const u32 b = base + u * per_pass;
            if (b < buckets && sub == 0) scores[b] = best;
        }
    }
    __syncthreads();
    // Each bucket of the slice gets its rank in (score descending, bucket ascending): the
    // buckets ranked below `probes` are the visits, in that order. `split` adjacent threads
    // count a bucket's betters together, each over every split-th chunk of SCAN scores
    // (consecutive threads read consecutive words: no bank conflicts); a thread stops once
    // it alone has counted `probes` (the bucket is then not visited), and the shuffles add
    // the parts up. Comparisons are branch-free, so a warp's lanes never diverge inside a
    // chunk. NaN scores compare false both ways: never better than another, never visited.
    // Each slice's `per` buckets (the launcher divides them).
    const u32 first = min(blockIdx.y * per, buckets), end = min(first + per, buckets);
    u32 split = 1;
    while (split < 32 && split * 2 * (end - first) <= blockDim.x) split *= 2;
    const u32 part = threadIdx.x % split;
    for (u32 base = first; base < end; base += blockDim.x / split) {
        const u32 b = base + threadIdx.x / split;
        const float s = b < end ? scores[b] : NEG_INF;
        u32 rank = 0;
        for (u32 o0 = part * SCAN; o0 < padded && rank < probes; o0 += split * SCAN) {
#pragma unroll
            for (int u = 0; u < SCAN; ++u) {
                const u32 o = o0 + u;
                const float x = scores[o];
                rank += (u32)(x > s) | ((u32)(x == s) & (u32)(o < b));
            }
        }
        for (u32 off = 1; off < split; off <<= 1) rank += __shfl_xor_sync(0xffffffffu, rank, off);
        if (part == 0 && b < end && s == s && rank < probes) visited[(u64)h * stride + rank] = h * per_head + b;
    }
    // Fewer buckets than probes could win (NaN scores): the first slice's block has the rest
    // visit the empty list after every head's buckets. Every block holds all the scores, so
    // it counts the winners without asking the others.
    if (blockIdx.y == 0) {
        u32 valid = 0;
        for (u32 b = threadIdx.x; b < buckets; b += blockDim.x) valid += scores[b] == scores[b];
        atomicAdd(&scored, valid);
        __syncthreads();
        for (u32 r = min(scored, probes) + threadIdx.x; r < probes; r += blockDim.x)
            visited[(u64)h * stride + r] = gridDim.x * per_head;
    }
}

// ------------------------------------------------------------------------ classifier routing
// A partition routed by a trained classifier (SAAP, index/src/saap.rs), as its CPU search
// routes: each query head of a KV head's group gets a distribution over the buckets that hold
// keys, the softmax of the classifier's logits (a 2-layer MLP of the de-roped query plus
// `prior` times the query's centroid scores) mixed with the geometric expert's (the softmax of
// `prior` times the query, rotated at its position, against each bucket's mean rotated key),
// `share` of the latter; the group sums its heads' distributions, and the `probes` buckets of
// best sum among those holding a candidate id are visited (ties to the lower bucket, NaN
// last), the rest of the visits going to the empty list.
//
// Two launches: `saap_hidden`, the first layer (grid (KV heads, slices of SAAP_ROWS hidden
// units)) and each bucket's flags, and `saap_scores`, the second layer, the prior and the
// expert, a warp a bucket
// (grid (KV heads, slices of SAAP_BUCKETS buckets)), whose last block of each KV head turns
// the scores into distributions and ranks them. Each launch spreads its head's weights over
// many blocks: one block a head would read a head's 1.5 MB alone. Layouts, per KV head h: w1
// [h][hidden][HEAD_DIM], b1 [h][hidden], w2 [h][buckets][hidden], b2 [h][buckets], centroids
// and mean_keys [h][buckets][HEAD_DIM], prior and share [h]; scratch: hidden [h][GROUP][hidden],
// logits [h][2][GROUP][buckets] (the classifier's, then the expert's) and a flag word per
// bucket [h][buckets] (bit 0: it holds keys; bit 1: one of them is a candidate).

#define SAAP_THREADS 256
#define SAAP_WARPS (SAAP_THREADS / 32)
// Hidden units a block of `saap_hidden` computes (two a warp, their loads in flight
// together), buckets a block of `saap_scores` scores (one a warp).
#define SAAP_ROWS (2 * SAAP_WARPS)
#define SAAP_BUCKETS SAAP_WARPS
// Elements of a head's vector each lane holds.
#define PER_LANE ((HEAD_DIM + 31) / 32)
// Columns of the second layer each lane loads at a time (with the group's hidden units:
// about 40 registers).
#define W2_BATCH (GROUP <= 4 ? 8 : GROUP <= 8 ? 4 : 2)

// Lane's elements lane, lane + 32, ... of a head vector (zeros past HEAD_DIM).
__device__ __forceinline__ void lane_part(const float* v, float (&x)[PER_LANE]) {
    const u32 lane = threadIdx.x % 32;
#pragma unroll
    for (int k = 0; k < PER_LANE; ++k) {
        const u32 i = lane + 32 * k;
        x[k] = i < HEAD_DIM ? v[i] : 0.f;
    }
}

// The flag word of a bucket whose ids (ascending) are ids[0..len): bit 0 when it holds any,
// bit 1 when one is in [start, end). The warp reads the ids 32 at a time until one reaches
// `start` (the first batch, unless the bucket holds many of the sinks before it); every lane
// gets the word.
__device__ __forceinline__ u32 bucket_flags(const u32* ids, u32 len, u32 start, u32 end) {
    const u32 lane = threadIdx.x % 32;
    for (u32 base = 0; base < len; base += 32) {
        const u32 id = base + lane < len ? ids[base + lane] : 0xffffffffu;
        const u32 reached = __ballot_sync(0xffffffffu, id >= start);
        if (reached != 0) {
            const u32 first = __shfl_sync(0xffffffffu, id, __ffs(reached) - 1);
            return 1u | ((u32)(first < end) << 1);
        }
    }
    return len > 0 ? 1u : 0u;
}

extern "C" __global__ void __launch_bounds__(SAAP_THREADS)
saap_hidden(const float* __restrict__ q, const float* __restrict__ w1, const float* __restrict__ b1,
            u32 hidden, float* __restrict__ out, u32 buckets, const u32* __restrict__ bucket_off,
            const u32* __restrict__ bucket_ids, u32 cand_start, u32 cand_end,
            u32* __restrict__ flags) {
#if __CUDA_ARCH__ >= 900
    // `saap_scores`, launched after this one programmatically, may start its blocks now:
    // it waits for this grid before it reads the hidden units and the flags.
    asm volatile("griddepcontrol.launch_dependents;");
#endif
    const u32 h = blockIdx.x, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    float qr[GROUP][PER_LANE];
#pragma unroll
    for (int g = 0; g < GROUP; ++g) lane_part(q + ((u64)h * GROUP + g) * HEAD_DIM, qr[g]);
    const u32 first = blockIdx.y * SAAP_ROWS + warp;
    // The warp's two rows (the second past the block's first SAAP_WARPS), loaded together.
    float w[2][PER_LANE];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const u32 row = min(first + r * SAAP_WARPS, hidden - 1);
        lane_part(w1 + ((u64)h * hidden + row) * HEAD_DIM, w[r]);
    }
    // While the rows load, the warp also flags buckets for `saap_scores`' ranking (its
    // loads depend on each other: here they cost that launch nothing).
    for (u32 b = blockIdx.y * SAAP_WARPS + warp; b < buckets; b += gridDim.y * SAAP_WARPS) {
        const u64 at = (u64)h * buckets + b;
        const u32 lo = bucket_off[at], hi = bucket_off[at + 1];
        const u32 f = bucket_flags(bucket_ids + lo, hi - lo, cand_start, cand_end);
        if (lane == 0) flags[at] = f;
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const u32 row = first + r * SAAP_WARPS;
        if (row >= hidden) break;
        const float bias = b1[(u64)h * hidden + row];
#pragma unroll
        for (int g = 0; g < GROUP; ++g) {
            float dot = 0.f;
#pragma unroll
            for (int k = 0; k < PER_LANE; ++k) dot = fmaf(w[r][k], qr[g][k], dot);
            dot = warp_sum(dot);
            if (lane == 0) out[((u64)h * GROUP + g) * hidden + row] = fmaxf(dot + bias, 0.f);
        }
    }
}


// dst[0..n) (shared) = src[0..n) (global, through L2 when `fresh`: another block wrote it),
// BATCH loads a thread in flight at a time: a plain copy loop waits for each load before the
// next. Every thread calls it; they all see the copy on return.
template <int BATCH>
__device__ __forceinline__ void to_shared(float* dst, const float* src, u32 n, bool fresh) {
    for (u32 base = threadIdx.x; base < n; base += BATCH * SAAP_THREADS) {
        float v[BATCH];
#pragma unroll
        for (int u = 0; u < BATCH; ++u) {
            const u32 i = base + u * SAAP_THREADS;
            v[u] = i < n ? (fresh ? __ldcg(src + i) : __ldg(src + i)) : 0.f;
        }
#pragma unroll
        for (int u = 0; u < BATCH; ++u) {
            const u32 i = base + u * SAAP_THREADS;
            if (i < n) dst[i] = v[u];
        }
    }
    __syncthreads();
}

extern "C" __global__ void __launch_bounds__(SAAP_THREADS)
saap_scores(const float* __restrict__ q, const float* __restrict__ hidden_in,
            const float* __restrict__ w2, const float* __restrict__ b2,
            const float* __restrict__ centroids, const float* __restrict__ mean_keys,
            const float* __restrict__ prior, const float* __restrict__ share,
            const double* __restrict__ inv_freq, u32 interleaved, u64 position, u32 hidden,
            u32 buckets, u32 probes, float* __restrict__ logits, const u32* __restrict__ flags,
            u32* __restrict__ counters,
            u32* __restrict__ visited) {
#if __CUDA_ARCH__ >= 900
    // A bucket attention launched after this one (programmatic dependent launch) may start
    // its blocks now: those that need the visits wait for this grid to finish.
    asm volatile("griddepcontrol.launch_dependents;");
#endif
    // Shared: the group's de-roped and rotated queries [GROUP][HEAD_DIM] each; the last
    // block reuses it for the ranking (see below).
    extern __shared__ float sm[];
    float* sq = sm;
    float* sr = sq + GROUP * HEAD_DIM;
    __shared__ float cos_t[HEAD_DIM / 2], sin_t[HEAD_DIM / 2];
    const u32 h = blockIdx.x, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const u32 b = blockIdx.y * SAAP_BUCKETS + warp;
    const u64 row = (u64)h * buckets + b;
    to_shared<GROUP * HEAD_DIM / SAAP_THREADS + 1>(sq, q + (u64)h * GROUP * HEAD_DIM,
                                                  GROUP * HEAD_DIM, false);
    // The rotation as the CPU's Rope: angles in double, cos/sin rounded to float, products
    // rounded separately, then the sum.
    for (u32 i = threadIdx.x; i < HEAD_DIM / 2; i += SAAP_THREADS) {
        double sn, cs;
        sincos((double)position * inv_freq[i], &sn, &cs);
        cos_t[i] = (float)cs;
        sin_t[i] = (float)sn;
    }
    __syncthreads();
    for (u32 p = threadIdx.x; p < GROUP * (HEAD_DIM / 2); p += SAAP_THREADS) {
        const u32 g = p / (HEAD_DIM / 2), i = p % (HEAD_DIM / 2);
        const u32 a = interleaved ? 2 * i : i, z = interleaved ? 2 * i + 1 : i + HEAD_DIM / 2;
        const float x0 = sq[g * HEAD_DIM + a], x1 = sq[g * HEAD_DIM + z];
        sr[g * HEAD_DIM + a] = __fsub_rn(__fmul_rn(x0, cos_t[i]), __fmul_rn(x1, sin_t[i]));
        sr[g * HEAD_DIM + z] = __fadd_rn(__fmul_rn(x0, sin_t[i]), __fmul_rn(x1, cos_t[i]));
    }
    __syncthreads();
#if __CUDA_ARCH__ >= 900
    // Everything above is this launch's own; the hidden units and the flags are
    // `saap_hidden`'s (a no-op when launched plainly).
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
    float* head_logits = logits + (u64)h * 2 * GROUP * buckets;
    if (b < buckets) {
        const float weight = prior[h];
        float mlp[GROUP], dot[GROUP], expert[GROUP];
#pragma unroll
        for (int g = 0; g < GROUP; ++g) mlp[g] = dot[g] = expert[g] = 0.f;
        // The row's weights and the hidden units (L1 keeps those for the block's other warps)
        // W2_BATCH columns a lane at a time, every load of a batch issued before any is used
        // (a loop that may end after any column issues one column's loads at a time).
        const float* w = w2 + row * hidden;
        const float* units = hidden_in + (u64)h * GROUP * hidden;
        for (u32 j0 = lane; j0 < hidden; j0 += 32 * W2_BATCH) {
            float x[W2_BATCH], y[W2_BATCH][GROUP];
#pragma unroll
            for (int u = 0; u < W2_BATCH; ++u) {
                const u32 j = j0 + 32 * u;
                x[u] = j < hidden ? __ldg(w + j) : 0.f;
#pragma unroll
                for (int g = 0; g < GROUP; ++g) y[u][g] = j < hidden ? __ldg(units + g * hidden + j) : 0.f;
            }
#pragma unroll
            for (int u = 0; u < W2_BATCH; ++u) {
#pragma unroll
                for (int g = 0; g < GROUP; ++g) mlp[g] = fmaf(x[u], y[u][g], mlp[g]);
            }
        }
        float c[PER_LANE], m[PER_LANE];
        lane_part(centroids + row * HEAD_DIM, c);
        lane_part(mean_keys + row * HEAD_DIM, m);
#pragma unroll
        for (int k = 0; k < PER_LANE; ++k) {
            const u32 i = lane + 32 * k;
            if (i < HEAD_DIM) {
#pragma unroll
                for (int g = 0; g < GROUP; ++g) {
                    dot[g] = fmaf(sq[g * HEAD_DIM + i], c[k], dot[g]);
                    expert[g] = fmaf(sr[g * HEAD_DIM + i], m[k], expert[g]);
                }
            }
        }
        const float bias = b2[row];
#pragma unroll
        for (int g = 0; g < GROUP; ++g) {
            const float l = warp_sum(mlp[g]) + bias + weight * warp_sum(dot[g]);
            const float e = weight * warp_sum(expert[g]);
            if (lane == 0) {
                head_logits[(u64)g * buckets + b] = l;
                head_logits[(u64)(GROUP + g) * buckets + b] = e;
            }
        }
    }
    if (!last_to_finish(&counters[h], gridDim.y)) return;

    // The last block of the head: every logit and flag into shared memory (one round trip),
    // a warp per distribution (the softmax over the held buckets, as the CPU's of its
    // masked logits), their sum over the group in the CPU's order, then the ranking.
    float* sl = sm;                                  // [2][GROUP][buckets], then distributions
    float* summed = sl + 2 * GROUP * buckets;        // [buckets]
    u32* sf = reinterpret_cast<u32*>(summed + buckets);  // [buckets]
    to_shared<8>(sl, head_logits, 2 * GROUP * buckets, true);
    to_shared<8>(reinterpret_cast<float*>(sf), reinterpret_cast<const float*>(flags + (u64)h * buckets),
                 buckets, true);
    __syncthreads();
    const float mix = share[h];
    const u32 parts = mix != 0.f ? 2 : 1;
    for (u32 d = warp; d < parts * GROUP; d += SAAP_WARPS) {
        float* l = sl + (u64)d * buckets;
        float mx = NEG_INF;
        for (u32 i = lane; i < buckets; i += 32)
            if (sf[i] & 1u) mx = fmaxf(mx, l[i]);
        mx = warp_max(mx);
        float sum = 0.f;
        for (u32 i = lane; i < buckets; i += 32) {
            const float e = (sf[i] & 1u) && mx != NEG_INF ? expf(l[i] - mx) : 0.f;
            l[i] = e;
            sum += e;
        }
        sum = warp_sum(sum);
        // None held, or every held logit -inf: the distribution is zeros.
        for (u32 i = lane; i < buckets; i += 32) l[i] = mx != NEG_INF ? l[i] / sum : 0.f;
    }
    __syncthreads();
    // Each bucket's sort key: its sum (NaN as -inf) where it holds a candidate, else NaN,
    // which compares false with everything: such a bucket never ranks above another.
    float* key = summed;
    __shared__ u32 eligible;
    if (threadIdx.x == 0) eligible = 0;
    __syncthreads();
    u32 mine = 0;
    for (u32 i = threadIdx.x; i < buckets; i += SAAP_THREADS) {
        float s = 0.f;
        for (int g = 0; g < GROUP; ++g) {
            const float c = sl[(u64)g * buckets + i];
            s += mix != 0.f ? (1.f - mix) * c + mix * sl[(u64)(GROUP + g) * buckets + i] : c;
        }
        s = s == s ? s : NEG_INF;
        key[i] = sf[i] & 2u ? s : __int_as_float(0x7fc00000);
        mine += (sf[i] >> 1) & 1u;
    }
    mine = __reduce_add_sync(0xffffffffu, mine);
    if (lane == 0 && mine > 0) atomicAdd(&eligible, mine);
    __syncthreads();
    // A candidate's bucket's rank in (sum descending, bucket ascending), counted over SCAN
    // keys at a time (loads in flight together) until it reaches `probes`.
    for (u32 i = threadIdx.x; i < buckets; i += SAAP_THREADS) {
        const float s = key[i];
        if (s != s) continue;
        u32 rank = 0;
        for (u32 o0 = 0; o0 < buckets && rank < probes; o0 += SCAN) {
#pragma unroll
            for (int u = 0; u < SCAN; ++u) {
                const u32 o = o0 + u;
                const float x = o < buckets ? key[o] : __int_as_float(0x7fc00000);
                rank += (u32)(x > s) | ((u32)(x == s) & (u32)(o < i));
            }
        }
        if (rank < probes) visited[(u64)h * probes + rank] = h * buckets + i;
    }
    for (u32 r = min(eligible, probes) + threadIdx.x; r < probes; r += SAAP_THREADS)
        visited[(u64)h * probes + r] = gridDim.x * buckets;
}
