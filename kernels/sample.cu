// Candidate selection on logits rows, one block per row: argmax (ties -> lowest index) and
// top-K by radix select (K-th largest key found digit by digit over order-preserving u32 keys,
// then every larger element and the lowest-index ties gathered and ranked by value, index).

#define SEL_THREADS 1024
#define TOPK_MAX 1024

__device__ __forceinline__ u32 order_key(float v) {
    const u32 b = __float_as_uint(v == 0.0f ? 0.0f : v);  // -0 and +0 are one value
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

template <typename T>
__device__ void argmax_impl(u32* out, const T* x, long width) {
    __shared__ float sv[32];
    __shared__ long si[32];
    const T* row = x + (long)blockIdx.x * width;
    float best = NEG_INF;
    long bi = width;  // "none yet": larger than any index
    // Each thread sees its values in increasing index order (the head before the 16-byte
    // aligned body, the body's groups of 8 in order, then the tail), keeping the first of
    // equal maxima; the reduction below then keeps the lowest index of equal values.
    auto see = [&](float v, long i) {
        if (v > best || (bi == width && v == best)) {
            best = v;
            bi = i;
        }
    };
    const long head = min(width, (long)(((16 - ((unsigned long long)row & 15)) & 15) / sizeof(T)));
    const long groups = (width - head) / 8;
    const T* body = row + head;
    if (threadIdx.x < head) see(act_load(row, threadIdx.x), threadIdx.x);
    // Body: 8 values a load group, 4 groups a thread loaded before any is compared, so one
    // block keeps enough bytes in flight to stream a vocabulary row at the SM's rate.
    long c = threadIdx.x;
    for (; c + 3 * (long)blockDim.x < groups; c += 4 * (long)blockDim.x) {
        float f[4][8];
#pragma unroll
        for (int u = 0; u < 4; u++) act_load8(body + (c + u * (long)blockDim.x) * 8, f[u]);
#pragma unroll
        for (int u = 0; u < 4; u++)
#pragma unroll
            for (int e = 0; e < 8; e++) see(f[u][e], head + (c + u * (long)blockDim.x) * 8 + e);
    }
    for (; c < groups; c += blockDim.x) {
        float f[8];
        act_load8(body + c * 8, f);
#pragma unroll
        for (int e = 0; e < 8; e++) see(f[e], head + c * 8 + e);
    }
    for (long i = head + groups * 8 + threadIdx.x; i < width; i += blockDim.x) see(act_load(row, i), i);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, best, o);
        const long oi = __shfl_xor_sync(0xffffffffu, bi, o);
        if (ov > best || (ov == best && oi < bi)) {
            best = ov;
            bi = oi;
        }
    }
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) {
        sv[warp] = best;
        si[warp] = bi;
    }
    __syncthreads();
    if (warp == 0) {
        const int nw = blockDim.x >> 5;
        best = lane < nw ? sv[lane] : NEG_INF;
        bi = lane < nw ? si[lane] : width;
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            const float ov = __shfl_xor_sync(0xffffffffu, best, o);
            const long oi = __shfl_xor_sync(0xffffffffu, bi, o);
            if (ov > best || (ov == best && oi < bi)) {
                best = ov;
                bi = oi;
            }
        }
        if (lane == 0) out[blockIdx.x] = (u32)(bi < width ? bi : 0);
    }
}

// ids/vals: [rows, k], largest first; ties broken by the lower index. k <= TOPK_MAX, k <= width.
template <typename T>
__device__ void topk_impl(u32* ids, float* vals, const T* x, long width, int k) {
    __shared__ u32 hist[256];
    __shared__ u32 s_prefix, s_mask, s_need, s_count, s_ties;
    __shared__ u32 c_id[TOPK_MAX];
    __shared__ float c_val[TOPK_MAX];
    const T* row = x + (long)blockIdx.x * width;
    if (threadIdx.x == 0) {
        s_prefix = 0;
        s_mask = 0;
        s_need = k;
    }
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (int i = threadIdx.x; i < 256; i += blockDim.x) hist[i] = 0;
        __syncthreads();
        const u32 prefix = s_prefix, mask = s_mask;
        for (long i = threadIdx.x; i < width; i += blockDim.x) {
            const u32 key = order_key(act_load(row, i));
            if ((key & mask) == prefix) atomicAdd(&hist[(key >> shift) & 255u], 1u);
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            u32 need = s_need, b = 255;
            while (true) {
                const u32 c = hist[b];
                if (c >= need || b == 0) break;
                need -= c;
                b--;
            }
            s_need = need;
            s_prefix = prefix | (b << shift);
            s_mask = mask | (255u << shift);
        }
        __syncthreads();
    }
    // s_prefix is the K-th largest key; take every larger element, then s_need ties by index.
    const u32 kth = s_prefix;
    if (threadIdx.x == 0) {
        s_count = 0;
        s_ties = 0;
    }
    __syncthreads();
    for (long i = threadIdx.x; i < width; i += blockDim.x) {
        const float v = act_load(row, i);
        if (order_key(v) > kth) {
            const u32 at = atomicAdd(&s_count, 1u);
            if (at < TOPK_MAX) {
                c_id[at] = (u32)i;
                c_val[at] = v;
            }
        }
    }
    __syncthreads();
    // Ties at the threshold in index order: one warp scans the row with ballots.
    if (threadIdx.x < 32) {
        const u32 need = s_need;
        u32 taken = 0;
        for (long base = 0; base < width && taken < need; base += 32) {
            const long i = base + threadIdx.x;
            const bool eq = i < width && order_key(act_load(row, i)) == kth;
            const u32 ballot = __ballot_sync(0xffffffffu, eq);
            const u32 before = __popc(ballot & ((1u << threadIdx.x) - 1u));
            if (eq && taken + before < need) {
                const u32 at = s_count + taken + before;
                if (at < TOPK_MAX) {
                    c_id[at] = (u32)i;
                    c_val[at] = act_load(row, i);
                }
            }
            taken += __popc(ballot);
        }
    }
    __syncthreads();
    for (int a = threadIdx.x; a < k; a += blockDim.x) {
        const float va = c_val[a];
        const u32 ia = c_id[a];
        int rank = 0;
        for (int b = 0; b < k; b++) {
            const float vb = c_val[b];
            rank += (vb > va || (vb == va && c_id[b] < ia)) ? 1 : 0;
        }
        ids[(long)blockIdx.x * k + rank] = ia;
        vals[(long)blockIdx.x * k + rank] = va;
    }
}

extern "C" __global__ void argmax_f32(u32* out, const float* x, long width) { PDL_ENTRY(); argmax_impl<float>(out, x, width); }
extern "C" __global__ void argmax_bf16(u32* out, const bf16_t* x, long width) { PDL_ENTRY(); argmax_impl<bf16_t>(out, x, width); }
extern "C" __global__ void topk_f32(u32* ids, float* vals, const float* x, long width, int k) { PDL_ENTRY();
    topk_impl<float>(ids, vals, x, width, k);
}
extern "C" __global__ void topk_bf16(u32* ids, float* vals, const bf16_t* x, long width, int k) { PDL_ENTRY();
    topk_impl<bf16_t>(ids, vals, x, width, k);
}
