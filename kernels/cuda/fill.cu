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
