// Bucket routing of one decode step on the GPU, for a bucket index whose buckets are probed
// by a linear score of the query (IVF: the centroids' inner products): each KV head's group
// of queries picks the `probes` buckets of best score, where a bucket's score is the best
// over the group's heads (as `IvfIndex` does on the CPU), ties to the lower bucket.
//
// Layouts: queries [kv_heads, group, head_dim] f32; centroids [kv_heads, buckets, head_dim]
// f32; bucket b of KV head h is list h * buckets + b of the CSR (`bucket_off`, `bucket_ids`,
// ids ascending within a bucket), and list kv_heads * buckets is empty; `visited`
// [kv_heads, probes] gets those list numbers (probes <= buckets).
// `selected` counts the ids of the visited buckets inside [lo, hi): the keys the step
// attends to besides the dense part.
//
// Grid: one block per KV head; dynamic shared memory holds the buckets' scores.

typedef unsigned int u32;
typedef unsigned long long u64;

#define NEG_INF __int_as_float(0xff800000)

// The first index of ids[0..n) (ascending) at or past `value`.
__device__ __forceinline__ u32 lower_bound(const u32* ids, u32 n, u32 value) {
    u32 lo = 0, hi = n;
    while (lo < hi) {
        const u32 mid = (lo + hi) / 2;
        if (ids[mid] < value) lo = mid + 1; else hi = mid;
    }
    return lo;
}

extern "C" __global__ void route_buckets(const float* __restrict__ q,
                                         const float* __restrict__ centroids, u32 group,
                                         u32 head_dim, u32 buckets, u32 probes,
                                         const u32* __restrict__ bucket_off,
                                         const u32* __restrict__ bucket_ids, u32 lo, u32 hi,
                                         u32* __restrict__ visited, u64* __restrict__ selected) {
    extern __shared__ float scores[];
    __shared__ float best_score[32];
    __shared__ u32 best_bucket[32];
    const u32 h = blockIdx.x, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const u32 warps = blockDim.x / 32;
    const float* hq = q + (u64)h * group * head_dim;
    const float* hc = centroids + (u64)h * buckets * head_dim;
    // One warp per bucket: the group's best inner product with its centroid.
    for (u32 b = warp; b < buckets; b += warps) {
        const float* c = hc + (u64)b * head_dim;
        float best = NEG_INF;
        for (u32 g = 0; g < group; ++g) {
            float s = 0.f;
            for (u32 i = lane; i < head_dim; i += 32) s = fmaf(hq[g * head_dim + i], c[i], s);
#pragma unroll
            for (int off = 16; off > 0; off >>= 1) s += __shfl_xor_sync(0xffffffffu, s, off);
            best = fmaxf(best, s);
        }
        if (lane == 0) scores[b] = best;
    }
    __syncthreads();
    // `probes` rounds of a block-wide arg max, each taking its winner out.
    for (u32 r = 0; r < probes; ++r) {
        float s = NEG_INF;
        u32 at = 0xffffffffu;
        for (u32 b = threadIdx.x; b < buckets; b += blockDim.x) {
            const float x = scores[b];
            if (x > s || (x == s && b < at)) { s = x; at = b; }
        }
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) {
            const float os = __shfl_xor_sync(0xffffffffu, s, off);
            const u32 oat = __shfl_xor_sync(0xffffffffu, at, off);
            if (os > s || (os == s && oat < at)) { s = os; at = oat; }
        }
        if (lane == 0) { best_score[warp] = s; best_bucket[warp] = at; }
        __syncthreads();
        if (threadIdx.x == 0) {
            float bs = best_score[0];
            u32 bb = best_bucket[0];
            for (u32 w = 1; w < warps; ++w) {
                if (best_score[w] > bs || (best_score[w] == bs && best_bucket[w] < bb)) {
                    bs = best_score[w];
                    bb = best_bucket[w];
                }
            }
            // No bucket left that can win (NaN scores: a NaN query): the empty list after
            // every head's buckets. Else the winner is marked taken with a NaN, which no
            // comparison picks again.
            const u32 list = bb == 0xffffffffu ? gridDim.x * buckets : h * buckets + bb;
            visited[(u64)h * probes + r] = list;
            if (bb != 0xffffffffu) scores[bb] = __int_as_float(0x7fc00000);
            const u32 a = bucket_off[list], z = bucket_off[list + 1];
            const u32 from = lower_bound(bucket_ids + a, z - a, lo);
            const u32 to = lower_bound(bucket_ids + a, z - a, hi);
            atomicAdd(selected, (u64)(to - from));
        }
        __syncthreads();
    }
}
