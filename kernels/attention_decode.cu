// Paged attention, one query token per block row (decode and short chunks): split-KV
// ("flash-decoding"). Block (t, kv head [x head group], split s) attends query token t's
// heads of one KV head over keys [k0, k1) of its window; with more than one split, each
// writes an unnormalized partial (output, max, sum) that `attn_combine` merges.
//
// Keys and values are bf16 in caches laid out [blocks, block_size, kv_heads, D]; a token's
// key j lives in block tables[seq][j / block_size], slot j % block_size. Lanes split each key
// into D/8-element slices (D/8 lanes per key, 32/(D/8) keys per warp step); every key group
// keeps its own online-softmax state, merged through shared memory at the end.

#define DEC_WARPS 4
#define DEC_MAXG 8  // most query heads per block; kernels exist for 1, 2, 4 and 8 (`_g<N>`)

template <typename T, int D, int MAXG>
__device__ void attn_decode_impl(float* part_o, float* part_ml, T* out, const T* q, const bf16_t* kc,
                                 const bf16_t* vc, const int* tok_seq, const int* positions, const int* tables,
                                 int table_width, int n_heads, int n_kv_heads, int block_size, float scale_log2,
                                 int window, int splits, unsigned* counters) {
    constexpr int LPK = D / 8;
    constexpr int KPW = 32 / LPK;
    constexpr int NG = DEC_WARPS * KPW;  // key groups per block
    __shared__ float sm_o[NG][MAXG][D];
    __shared__ float sm_m[NG][MAXG];
    __shared__ float sm_l[NG][MAXG];

    const int t = blockIdx.x;
    const int G = n_heads / n_kv_heads;
    const int hgroups = (G + MAXG - 1) / MAXG;
    const int g = blockIdx.y / hgroups;
    const int h0 = g * G + (blockIdx.y % hgroups) * MAXG;
    const int hn = min(MAXG, g * G + G - h0);
    const int s = blockIdx.z;
    const int pos = positions[t];
    const int lo = window > 0 ? max(0, pos + 1 - window) : 0;
    const int len = pos + 1 - lo;
    const int chunk = (len + splits - 1) / splits;
    const int k0 = lo + s * chunk;
    const int k1 = min(pos + 1, k0 + chunk);
    const int* table = tables + (long)tok_seq[t] * table_width;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int kg = lane / LPK, sub = lane % LPK;
    const long slot_stride = (long)n_kv_heads * D;

    float qr[MAXG][8];
#pragma unroll
    for (int h = 0; h < MAXG; h++) {
        if (h < hn) {
            const T* qp = q + ((long)t * n_heads + h0 + h) * D + sub * 8;
#pragma unroll
            for (int i = 0; i < 8; i++) qr[h][i] = act_load(qp, i) * scale_log2;
        } else {
#pragma unroll
            for (int i = 0; i < 8; i++) qr[h][i] = 0.0f;
        }
    }
    float m[MAXG], l[MAXG], acc[MAXG][8];
#pragma unroll
    for (int h = 0; h < MAXG; h++) {
        m[h] = NEG_INF;
        l[h] = 0.0f;
#pragma unroll
        for (int i = 0; i < 8; i++) acc[h][i] = 0.0f;
    }

    for (int jb = k0 + warp * KPW; jb < k1; jb += DEC_WARPS * KPW) {
        const int j = jb + kg;
        const bool valid = j < k1;
        uint4 kraw = make_uint4(0, 0, 0, 0), vraw = make_uint4(0, 0, 0, 0);
        if (valid) {
            const long slot = (long)table[j / block_size] * block_size + j % block_size;
            const long off = slot * slot_stride + (long)g * D + sub * 8;
            kraw = *reinterpret_cast<const uint4*>(kc + off);
            vraw = *reinterpret_cast<const uint4*>(vc + off);
        }
        float kf[8], vf[8];
        bf16x8_to_f32(kraw, kf);
        bf16x8_to_f32(vraw, vf);
#pragma unroll
        for (int h = 0; h < MAXG; h++) {
            if (h < hn) {
                float sc = 0.0f;
#pragma unroll
                for (int i = 0; i < 8; i++) sc = fmaf(qr[h][i], kf[i], sc);
#pragma unroll
                for (int o = LPK / 2; o > 0; o >>= 1) sc += __shfl_xor_sync(0xffffffffu, sc, o);
                if (valid) {
                    const float mn = fmaxf(m[h], sc);
                    const float corr = exp2f(m[h] - mn);
                    const float p = exp2f(sc - mn);
                    l[h] = l[h] * corr + p;
#pragma unroll
                    for (int i = 0; i < 8; i++) acc[h][i] = fmaf(p, vf[i], acc[h][i] * corr);
                    m[h] = mn;
                }
            }
        }
    }

    const int grp = warp * KPW + kg;
#pragma unroll
    for (int h = 0; h < MAXG; h++) {
        if (h < hn) {
#pragma unroll
            for (int i = 0; i < 8; i++) sm_o[grp][h][sub * 8 + i] = acc[h][i];
            if (sub == 0) {
                sm_m[grp][h] = m[h];
                sm_l[grp][h] = l[h];
            }
        }
    }
    __syncthreads();
    for (int e = threadIdx.x; e < hn * D; e += blockDim.x) {
        const int h = e / D, d = e % D;
        float mx = NEG_INF;
        for (int q2 = 0; q2 < NG; q2++) mx = fmaxf(mx, sm_m[q2][h]);
        float lsum = 0.0f, o = 0.0f;
        if (mx != NEG_INF) {
            for (int q2 = 0; q2 < NG; q2++) {
                const float mq = sm_m[q2][h];
                if (mq != NEG_INF) {
                    const float f = exp2f(mq - mx);
                    lsum += sm_l[q2][h] * f;
                    o += sm_o[q2][h][d] * f;
                }
            }
        }
        const long row = (long)t * n_heads + h0 + h;
        if (splits == 1) {
            act_store(out, row * D + d, lsum > 0.0f ? o / lsum : 0.0f);
        } else {
            part_o[(row * splits + s) * D + d] = o;
            if (d == 0) {
                part_ml[(row * splits + s) * 2] = mx;
                part_ml[(row * splits + s) * 2 + 1] = lsum;
            }
        }
    }
    // With `counters` (zeroed, one per (token, head block)), the last split block of a row
    // to finish merges the splits itself, which saves the combine launch; it leaves its
    // counter at zero again for the next launch.
    if (splits > 1 && counters != nullptr) {
        __shared__ int last;
        __threadfence();
        __syncthreads();
        if (threadIdx.x == 0) {
            const long ci = (long)t * gridDim.y + blockIdx.y;
            last = atomicAdd(&counters[ci], 1u) == (unsigned)(splits - 1);
            if (last) counters[ci] = 0u;
        }
        __syncthreads();
        if (last) {
            __threadfence();
            for (int e = threadIdx.x; e < hn * D; e += blockDim.x) {
                const int h = e / D, d = e % D;
                const long row = (long)t * n_heads + h0 + h;
                float mx = NEG_INF;
                for (int s2 = 0; s2 < splits; s2++) mx = fmaxf(mx, ld_cg(part_ml + (row * splits + s2) * 2));
                float lsum = 0.0f, o = 0.0f;
                if (mx != NEG_INF) {
                    for (int s2 = 0; s2 < splits; s2++) {
                        const float ms = ld_cg(part_ml + (row * splits + s2) * 2);
                        if (ms != NEG_INF) {
                            const float f = exp2f(ms - mx);
                            lsum += ld_cg(part_ml + (row * splits + s2) * 2 + 1) * f;
                            o += ld_cg(part_o + (row * splits + s2) * D + d) * f;
                        }
                    }
                }
                act_store(out, row * D + d, lsum > 0.0f ? o / lsum : 0.0f);
            }
        }
    }
}

// Merges the splits of every (token, head) row: one block per row.
template <typename T>
__device__ void attn_combine_impl(T* out, const float* part_o, const float* part_ml, int splits, int D) {
    const long row = blockIdx.x;
    float mx = NEG_INF;
    for (int s = 0; s < splits; s++) mx = fmaxf(mx, part_ml[(row * splits + s) * 2]);
    for (int d = threadIdx.x; d < D; d += blockDim.x) {
        float lsum = 0.0f, o = 0.0f;
        if (mx != NEG_INF) {
            for (int s = 0; s < splits; s++) {
                const float ms = part_ml[(row * splits + s) * 2];
                if (ms != NEG_INF) {
                    const float f = exp2f(ms - mx);
                    lsum += part_ml[(row * splits + s) * 2 + 1] * f;
                    o += part_o[(row * splits + s) * D + d] * f;
                }
            }
        }
        act_store(out, row * D + d, lsum > 0.0f ? o / lsum : 0.0f);
    }
}

#define DECODE_WRAPPER(T, S, D, G)                                                                                     \
    extern "C" __global__ void __launch_bounds__(DEC_WARPS * 32) attn_decode_d##D##_g##G##_##S(                          \
        float* part_o, float* part_ml, T* out, const T* q, const bf16_t* kc, const bf16_t* vc, const int* tok_seq,  \
        const int* positions, const int* tables, int table_width, int n_heads, int n_kv_heads, int block_size,      \
        float scale_log2, int window, int splits, unsigned* counters) { PDL_ENTRY();                                                                 \
        attn_decode_impl<T, D, G>(part_o, part_ml, out, q, kc, vc, tok_seq, positions, tables, table_width, n_heads,   \
                               n_kv_heads, block_size, scale_log2, window, splits, counters);                                 \
    }

#define DECODE_G(T, S, D) \
    DECODE_WRAPPER(T, S, D, 1) DECODE_WRAPPER(T, S, D, 2) DECODE_WRAPPER(T, S, D, 4) DECODE_WRAPPER(T, S, D, 8)

#define DECODE_ALL(T, S)                                                                                    \
    DECODE_G(T, S, 16)                                                                                      \
    DECODE_G(T, S, 32)                                                                                      \
    DECODE_G(T, S, 64)                                                                                      \
    DECODE_G(T, S, 128)                                                                                     \
    DECODE_G(T, S, 256)                                                                                     \
    extern "C" __global__ void attn_combine_##S(T* out, const float* part_o, const float* part_ml, int splits, \
                                                int D) { PDL_ENTRY();                                                    \
        attn_combine_impl<T>(out, part_o, part_ml, splits, D);                                              \
    }

DECODE_ALL(float, f32)
DECODE_ALL(bf16_t, bf16)
