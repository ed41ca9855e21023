// Block-level helpers of the kernels that combine blocks' results (attend.cu, route.cu): the
// crate prepends this file to their sources (NVRTC takes one source).

typedef unsigned int u32;

// Whether this block is the last of `expected` to arrive at `counter` (which it then resets
// for the next launch). Every thread of the block calls it. The barrier orders the block's
// writes before thread 0's release; its acquire and the second barrier order the winner's
// reads after every other block's release (CUTLASS's semaphore does the same): one fence for
// the block instead of one per thread.
__device__ __forceinline__ bool last_to_finish(u32* counter, u32 expected) {
    __shared__ bool last;
    __syncthreads();
    if (threadIdx.x == 0) {
        u32 before;
        asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], 1;"
                     : "=r"(before)
                     : "l"(counter)
                     : "memory");
        last = before == expected - 1;
        if (last) *counter = 0;
    }
    __syncthreads();
    return last;
}

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) x += __shfl_xor_sync(0xffffffffu, x, off);
    return x;
}

__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, off));
    return x;
}
