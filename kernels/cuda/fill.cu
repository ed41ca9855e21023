// Copies blocks of keys and values from pinned host memory (mapped into the device's
// address space) into slots of the GPU block cache: one CUDA block per copied block, all
// misses of a decode step in one launch instead of one small copy call each.
//
// Blocks are `vecs` 16-byte vectors long in both buffers. jobs [n][2]: the block's index in
// the host buffer (KV head * blocks per head + block), then its slot in the pool.

typedef unsigned int u32;
typedef unsigned long long u64;

#define UNROLL 4

extern "C" __global__ void fill_slots(const uint4* host_k, const uint4* host_v, uint4* pool_k,
                                      uint4* pool_v, const u32* __restrict__ jobs, u32 vecs) {
    const u64 src = (u64)jobs[2 * blockIdx.x] * vecs, dst = (u64)jobs[2 * blockIdx.x + 1] * vecs;
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
