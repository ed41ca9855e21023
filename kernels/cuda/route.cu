// Bucket routing of one decode step on the GPU, for a bucket index whose buckets are probed
// by a linear score of the query (IVF: the centroids' inner products): each KV head's group
// of queries picks the `probes` buckets of best score, where a bucket's score is the best
// over the group's heads (as `IvfIndex` does on the CPU), ties to the lower bucket.
//
// Compiled by NVRTC with GROUP, the query heads per KV head (1..16), and HEAD_DIM defined;
// HEAD_DIM / 8 is a power of two up to 32.
//
// Layouts: queries [kv_heads, GROUP, head_dim] f32; centroids [kv_heads, buckets, head_dim]
// f32; `visited` [kv_heads, probes] gets list numbers of the partition's CSR of ids, in
// which bucket b of KV head h is list h * buckets + b and list kv_heads * buckets is empty
// (probes <= buckets). Routing never reads the ids: the bucket attention that reads the
// visits counts the ids it attends.
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
              u32 buckets, u32 probes, u32 per,
              u32* __restrict__ visited) {
#if __CUDA_ARCH__ >= 900
    // A bucket attention launched after this one (programmatic dependent launch) may start
    // its blocks now: those that need the visits wait for this grid to finish.
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
        if (part == 0 && b < end && s == s && rank < probes) visited[(u64)h * probes + rank] = h * buckets + b;
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
            visited[(u64)h * probes + r] = gridDim.x * buckets;
    }
}
