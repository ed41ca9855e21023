// Copies blocks of keys and values from pinned host memory (mapped into the device's
// address space) into slots of the GPU block cache: one CUDA block per copied block, all
// misses of a decode step in one launch instead of one small copy call each.
//
// Blocks are `vecs` 16-byte vectors long in both buffers. jobs [n][2]: the block's index in
// the host buffer (KV head * blocks per head + block), then its slot in the pool. Each copy
// also records its slot's first token id, (block % blocks per head) << shift, in
// `slot_token`, so that `attention_mass` can add the weight of a slot's rows to their tokens.

typedef unsigned int u32;
typedef unsigned long long u64;

#define UNROLL 4

extern "C" __global__ void fill_slots(const uint4* host_k, const uint4* host_v, uint4* pool_k,
                                      uint4* pool_v, const u32* __restrict__ jobs, u32 vecs,
                                      u32* __restrict__ slot_token, u32 blocks, u32 shift) {
    const u32 block = jobs[2 * blockIdx.x], slot = jobs[2 * blockIdx.x + 1];
    if (threadIdx.x == 0) slot_token[slot] = (block % blocks) << shift;
    const u64 src = (u64)block * vecs, dst = (u64)slot * vecs;
    // Several loads per thread before the first store: reads over PCIe have a long latency.
    for (u32 base = threadIdx.x; base < vecs; base += blockDim.x * UNROLL) {
        uint4 k[UNROLL], v[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const u32 i = base + u * blockDim.x;
            if (i < vecs) {
                k[u] = host_k[src + i];
                v[u] = host_v[src + i];
            }
        }
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const u32 i = base + u * blockDim.x;
            if (i < vecs) {
                pool_k[dst + i] = k[u];
                pool_v[dst + i] = v[u];
            }
        }
    }
}

// Copies whole buckets of a partition's rows from pinned host memory into a GPU bucket cache
// (`BucketCache` in cache.rs): jobs [n][2] are a list number l (KV head l / buckets, the
// partition's lists per head) and the first cache row it gets; the list's ids (`ids[offsets[l]..offsets[l + 1]]`, rows of
// that head, `head_stride` rows apart per head) are copied in order to consecutive cache
// rows, and each row's token id to `token_of`. Rows are `row_vecs` 16-byte vectors; block
// (j, y) copies vectors y, y + gridDim.y, ... (in blocks of blockDim.x) of job j.
extern "C" __global__ void fill_buckets(const uint4* host_k, const uint4* host_v, u64 head_stride,
                                        const u32* __restrict__ offsets,
                                        const u32* __restrict__ ids, const u32* __restrict__ jobs,
                                        u32 buckets, u32 row_vecs, uint4* cache_k, uint4* cache_v,
                                        u32* __restrict__ token_of) {
    const u32 list = jobs[2 * blockIdx.x], first = jobs[2 * blockIdx.x + 1];
    const u32 begin = offsets[list], rows = offsets[list + 1] - begin;
    const u64 head = (u64)(list / buckets) * head_stride;
    const u64 vecs = (u64)rows * row_vecs, stride = (u64)gridDim.y * blockDim.x;
    for (u64 base = (u64)blockIdx.y * blockDim.x + threadIdx.x; base < vecs; base += stride * UNROLL) {
        uint4 k[UNROLL], v[UNROLL];
        u64 dst[UNROLL];
        // Several loads per thread before the first store: reads over PCIe have a long latency.
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const u64 e = base + u * stride;
            dst[u] = ~0ull;
            if (e < vecs) {
                const u32 r = (u32)(e / row_vecs), c = (u32)(e % row_vecs);
                const u32 id = ids[begin + r];
                const u64 src = (head + id) * row_vecs + c;
                k[u] = host_k[src];
                v[u] = host_v[src];
                dst[u] = ((u64)first + r) * row_vecs + c;
                if (c == 0) token_of[first + r] = id;
            }
        }
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            if (dst[u] != ~0ull) {
                cache_k[dst[u]] = k[u];
                cache_v[dst[u]] = v[u];
            }
        }
    }
}
