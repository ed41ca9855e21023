// Following the most attended tokens inside a bucket launch (`attend.cu`'s followed ids):
// what the next step of a KV head follows is the successors of the tokens its last step
// weighed most, ranked here on the GPU so that no layer waits for the host.
//
// Compiled by NVRTC without defines, after blocks.cuh.

typedef unsigned long long u64;

#define NO_ROW 0xffffffffu
#define PICK_THREADS 256
// Candidates each thread of `follow_pick` holds in registers, and a block's slice of them.
#define PICK_PER_THREAD 8
#define PICK_SLICE (PICK_THREADS * PICK_PER_THREAD)

// bucket_of[h * rows + id] = l + 1 for every id of list l (l = h * buckets + b) of a
// partition's CSR (`offsets`, `ids`; `lists` = kv_heads * buckets lists, any after them
// left out), on zeros: what tells a followed id inside a visited bucket. Ids >= rows are
// left out (the launcher checked there are none). One block per list at a time.
extern "C" __global__ void bucket_of(const u32* __restrict__ offsets, const u32* __restrict__ ids,
                                     u32 lists, u32 buckets, u32 rows, u32* __restrict__ out) {
    for (u32 l = blockIdx.x; l < lists; l += gridDim.x) {
        const u64 head = (u64)(l / buckets) * rows;
        for (u32 j = offsets[l] + threadIdx.x; j < offsets[l + 1]; j += blockDim.x) {
            const u32 id = ids[j];
            if (id < rows) out[head + id] = l + 1;
        }
    }
}

// Whether candidate (w, id) ranks before (bw, bid): more weight first, ties to the lower id,
// as the CPU's `successors_of_most_attended` ranks; no candidate (NO_ROW) ranks last.
__device__ __forceinline__ bool before(float w, u32 id, float bw, u32 bid) {
    return id != NO_ROW && (bid == NO_ROW || w > bw || (w == bw && id < bid));
}

// The block's best of its threads' (w, id), every thread getting it. Every thread calls it.
__device__ __forceinline__ void block_best(float& w, u32& id) {
    __shared__ float sm_w[PICK_THREADS / 32];
    __shared__ u32 sm_id[PICK_THREADS / 32];
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
        const float ow = __shfl_xor_sync(0xffffffffu, w, off);
        const u32 oi = __shfl_xor_sync(0xffffffffu, id, off);
        if (before(ow, oi, w, id)) {
            w = ow;
            id = oi;
        }
    }
    if (threadIdx.x % 32 == 0) {
        sm_w[threadIdx.x / 32] = w;
        sm_id[threadIdx.x / 32] = id;
    }
    __syncthreads();
    w = sm_w[0];
    id = sm_id[0];
    for (u32 k = 1; k < PICK_THREADS / 32; ++k) {
        if (before(sm_w[k], sm_id[k], w, id)) {
            w = sm_w[k];
            id = sm_id[k];
        }
    }
    // The slots are rewritten by the next call only after every thread read them.
    __syncthreads();
}

// `count` rounds over candidates this thread reads with at(k, w, id) for k < n (one thread's
// share; n the same in every thread): round r finds the best candidate ranked after round
// r - 1's and calls emit(r, w, id) in thread 0 (id NO_ROW once they run out).
template <class At, class Emit>
__device__ __forceinline__ void rounds(u32 n, const At& at, u32 count, const Emit& emit) {
    float prev_w = 0.f;
    u32 prev_id = NO_ROW;
    for (u32 r = 0; r < count; ++r) {
        float best_w = 0.f;
        u32 best_id = NO_ROW;
        if (r == 0 || prev_id != NO_ROW) {
#pragma unroll 8
            for (u32 k = 0; k < n; ++k) {
                float w;
                u32 i;
                at(k, w, i);
                // Ranked after the previous round's pick (every candidate is, before the first).
                const bool after = r == 0 || before(prev_w, prev_id, w, i);
                if (after && before(w, i, best_w, best_id)) {
                    best_w = w;
                    best_id = i;
                }
            }
            block_best(best_w, best_id);
        }
        if (threadIdx.x == 0) emit(r, best_w, best_id);
        prev_w = best_w;
        prev_id = best_id;
    }
}

// For each KV head, of its candidates (`follow_weights`' output at h * (cap + followed): the
// visited buckets' ids 0 .. total, total the visits' sizes summed, then `followed` followed
// ids from `cap` on; weight < 0 or id NO_ROW where a row was skipped), the `count` ranked
// first. Grid (slices, kv heads): block (s, h) ranks the `count` best of slice s of head h's
// candidates (PICK_SLICE of them, held in registers) into `slice_w`/`slice_id` [h][s][count];
// the last block of the head to finish ranks the slices' picks and writes next[h * count +
// r] = the successor of the r-th if it is inside the `tokens` of the corpus, else NO_ROW
// (also when the candidates ran out). `counters` [kv heads] start at zero and are left so.
extern "C" __global__ void __launch_bounds__(PICK_THREADS)
follow_pick(const float* __restrict__ weight, const u32* __restrict__ id, u32 cap, u32 followed,
            const u32* __restrict__ list_off, const u32* __restrict__ list,
            const u32* __restrict__ bucket_off, u32 count, u32 tokens, float* __restrict__ slice_w,
            u32* __restrict__ slice_id, u32* __restrict__ counters, u32* __restrict__ next) {
    __shared__ u32 sm_total;
    const u32 s = blockIdx.x, h = blockIdx.y, slices = gridDim.x;
    // The visits' sizes summed by warp 0, 32 visits at a time.
    if (threadIdx.x < 32) {
        u32 total = 0;
        for (u32 k = list_off[h] + threadIdx.x; k < list_off[h + 1]; k += 32) {
            const u32 bucket = list[k];
            total += bucket_off[bucket + 1] - bucket_off[bucket];
        }
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) total += __shfl_xor_sync(0xffffffffu, total, off);
        if (threadIdx.x == 0) sm_total = total < cap ? total : cap;
    }
    __syncthreads();
    const u32 total = sm_total, candidates = total + followed;
    const u64 stride = (u64)cap + followed;
    // This thread's candidates of the slice, loaded at once.
    float w[PICK_PER_THREAD];
    u32 ids[PICK_PER_THREAD];
#pragma unroll
    for (int k = 0; k < PICK_PER_THREAD; ++k) {
        const u32 e = s * PICK_SLICE + k * PICK_THREADS + threadIdx.x;
        w[k] = -1.f;
        ids[k] = NO_ROW;
        if (e < candidates) {
            const u64 at = h * stride + (e < total ? e : cap + (e - total));
            w[k] = weight[at];
            ids[k] = w[k] >= 0.f ? id[at] : NO_ROW;
        }
    }
    const u64 picks = ((u64)h * slices + s) * count;
    rounds(
        PICK_PER_THREAD,
        [&](u32 k, float& cw, u32& ci) {
            cw = w[k];
            ci = ids[k];
        },
        count,
        [&](u32 r, float bw, u32 bid) {
            slice_w[picks + r] = bw;
            slice_id[picks + r] = bid;
        });
    if (!last_to_finish(&counters[h], slices)) return;
    // The slices' picks, read past L1: other blocks wrote them.
    const u64 head = (u64)h * slices * count;
    const u32 all = slices * count, per = (all + PICK_THREADS - 1) / PICK_THREADS;
    rounds(
        per,
        [&](u32 k, float& cw, u32& ci) {
            const u32 e = k * PICK_THREADS + threadIdx.x;
            cw = e < all ? __ldcg(slice_w + head + e) : 0.f;
            ci = e < all ? __ldcg(slice_id + head + e) : NO_ROW;
        },
        count,
        [&](u32 r, float, u32 bid) {
            next[(u64)h * count + r] = bid != NO_ROW && bid + 1 < tokens ? bid + 1 : NO_ROW;
        });
}
