// Bucket routing of one decode step on the GPU, for a bucket index whose buckets are probed
// by a linear score of the query (IVF: the centroids' inner products): each KV head's group
// of queries picks the `probes` buckets of best score, where a bucket's score is the best
// over the group's heads (as `IvfIndex` does on the CPU), ties to the lower bucket.
//
// Layouts: queries [kv_heads, group, head_dim] f32 (group <= MAX_GROUP); centroids
// [kv_heads, head_dim, buckets] f32 (transposed); bucket b of KV head h is list
// h * buckets + b of the CSR (`bucket_off`, `bucket_ids`, ids ascending within a bucket),
// and list kv_heads * buckets is empty; `visited`
// [kv_heads, probes] gets those list numbers (probes <= buckets).
// `selected` counts the ids of the visited buckets inside [lo, hi): the keys the step
// attends to besides the dense part.
//
// Grid: one block per KV head; dynamic shared memory holds the buckets' scores.

typedef unsigned int u32;
typedef unsigned long long u64;

#define NEG_INF __int_as_float(0xff800000)

// Most query heads per KV head (`MAX_ROUTED_GROUP` in route.rs).
#define MAX_GROUP 16

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
    __shared__ u32 ranked;
    const u32 h = blockIdx.x;
    const float* hq = q + (u64)h * group * head_dim;
    const float* hc = centroids + (u64)h * buckets * head_dim;
    if (threadIdx.x == 0) ranked = 0;
    // One thread per bucket: the group's best inner product with its centroid. The
    // centroids are transposed ([head_dim, buckets] per head), so a warp reads one dimension
    // of 32 consecutive buckets at once, and every thread reads the same query element (a
    // broadcast); each dimension feeds the group's running sums.
    for (u32 b = threadIdx.x; b < buckets; b += blockDim.x) {
        float sum[MAX_GROUP];
#pragma unroll
        for (u32 g = 0; g < MAX_GROUP; ++g) sum[g] = 0.f;
        for (u32 i = 0; i < head_dim; ++i) {
            const float c = hc[(u64)i * buckets + b];
#pragma unroll
            for (u32 g = 0; g < MAX_GROUP; ++g)
                if (g < group) sum[g] = fmaf(hq[(u64)g * head_dim + i], c, sum[g]);
        }
        float best = NEG_INF;
#pragma unroll
        for (u32 g = 0; g < MAX_GROUP; ++g)
            if (g < group) best = fmaxf(best, sum[g]);
        scores[b] = best;
    }
    __syncthreads();
    // Each bucket's rank in (score descending, bucket ascending): the buckets ranked below
    // `probes` are the visits, in that order. A bucket stops counting once `probes` others
    // beat it, which most do within a few comparisons. NaN scores are never visited.
    for (u32 b = threadIdx.x; b < buckets; b += blockDim.x) {
        const float s = scores[b];
        if (s != s) continue;
        u32 rank = 0;
        for (u32 o = 0; o < buckets && rank < probes; ++o) {
            const float x = scores[o];
            rank += (x > s || (x == s && o < b)) ? 1u : 0u;
        }
        if (rank < probes) {
            visited[(u64)h * probes + rank] = h * buckets + b;
            atomicAdd(&ranked, 1u);
        }
    }
    __syncthreads();
    // Fewer buckets than probes could win (NaN scores): the rest visit the empty list after
    // every head's buckets.
    for (u32 r = ranked + threadIdx.x; r < probes; r += blockDim.x)
        visited[(u64)h * probes + r] = gridDim.x * buckets;
    __syncthreads();
    // The visited buckets' eligible ids, one bucket per thread: each count is two binary
    // searches of dependent loads from global memory. The block's writes to `visited` are
    // visible after the barrier above.
    for (u32 r = threadIdx.x; r < probes; r += blockDim.x) {
        const u32 list = visited[(u64)h * probes + r];
        const u32 a = bucket_off[list], z = bucket_off[list + 1];
        const u32 from = lower_bound(bucket_ids + a, z - a, lo);
        const u32 to = lower_bound(bucket_ids + a, z - a, hi);
        atomicAdd(selected, (u64)(to - from));
    }
}
