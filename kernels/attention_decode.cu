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

// One key of a key group (its LPK lanes hold 8-value slices of it) folded into the online
// softmax of every head of the block (log2 units): the score q.k summed over the lanes, then
// each head's max, sum and unnormalized output. Every lane of the warp must call this.
template <int LPK, int MAXG>
__device__ __forceinline__ void dec_key(const float (&q)[MAXG][8], const float* kf, const float* vf, bool valid,
                                        int hn, float (&m)[MAXG], float (&l)[MAXG], float (&acc)[MAXG][8]) {
#pragma unroll
    for (int h = 0; h < MAXG; h++) {
        if (h < hn) {
            float sc = 0.0f;
#pragma unroll
            for (int i = 0; i < 8; i++) sc = fmaf(q[h][i], kf[i], sc);
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

// Leaves key group `grp`'s state of every head in shared memory, then waits for the block.
template <int D, int MAXG, int NG>
__device__ __forceinline__ void dec_stash(float (&sm_o)[NG][MAXG][D], float (&sm_m)[NG][MAXG],
                                          float (&sm_l)[NG][MAXG], int grp, int sub, int hn,
                                          const float (&m)[MAXG], const float (&l)[MAXG],
                                          const float (&acc)[MAXG][8]) {
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
}

// Head h's state at element d merged over the key groups in order: max, sum and unnormalized
// output.
template <int D, int MAXG, int NG>
__device__ __forceinline__ void dec_merge(const float (&sm_o)[NG][MAXG][D], const float (&sm_m)[NG][MAXG],
                                          const float (&sm_l)[NG][MAXG], int h, int d, float& mx,
                                          float& lsum, float& o) {
    mx = NEG_INF;
    for (int q2 = 0; q2 < NG; q2++) mx = fmaxf(mx, sm_m[q2][h]);
    lsum = 0.0f;
    o = 0.0f;
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
}

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
        dec_key<LPK, MAXG>(qr, kf, vf, valid, hn, m, l, acc);
    }

    dec_stash<D, MAXG, NG>(sm_o, sm_m, sm_l, warp * KPW + kg, sub, hn, m, l, acc);
    for (int e = threadIdx.x; e < hn * D; e += blockDim.x) {
        const int h = e / D, d = e % D;
        float mx, lsum, o;
        dec_merge<D, MAXG, NG>(sm_o, sm_m, sm_l, h, d, mx, lsum, o);
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

// Decode attention of steps where every sequence runs one token, with its neighbours folded
// in: the RoPE of the query and the new key (the whole head rotated; style -1: none), the K/V
// cache write of the new token, and the merge of the key splits. The splits of one (token,
// KV head) form a thread-block cluster (grid (splits, KV heads, tokens), cluster (splits, 1,
// 1), at most 8) and merge through distributed shared memory instead of a combine launch.
// Keys cached by earlier steps (every key but the token's own) are not written by this step's
// kernels, so their loads go out before the programmatic wait, DEC1_PF key steps at a time.
// The split that holds position pos takes the new key and value from registers and writes
// them to the cache; it also writes the rotated query and key back, as `rope_kv` does. Each
// step runs the same arithmetic in the same order as `rope_kv` + `attn_decode` +
// `attn_combine`, so the outputs are bit-identical to theirs.
#define DEC1_PF 4

// Rotates a lane's 8 consecutive elements [e0, e0 + 8) of a head of D (the whole head; angles
// `cs`/`sn` of the token, D/2 of them). Style 1 pairs element e with e + D/2, held by lane
// sub ^ (D/16) of the same key group: every lane of the warp must call this.
template <int D>
__device__ __forceinline__ void dec_rope8(float* x, const float* cs, const float* sn, int e0, int style) {
    if (style == 0) {
#pragma unroll
        for (int i = 0; i < 8; i += 2) {
            const float c = cs[(e0 + i) / 2], s = sn[(e0 + i) / 2];
            const float a = x[i], b = x[i + 1];
            x[i] = rope_ra(a, b, c, s);
            x[i + 1] = rope_rb(a, b, c, s);
        }
    } else if (style == 1) {
        constexpr int HALF = D / 2;
        const bool lo = e0 < HALF;
#pragma unroll
        for (int i = 0; i < 8; i++) {
            const float p = __shfl_xor_sync(0xffffffffu, x[i], HALF / 8);
            const int ai = (lo ? e0 : e0 - HALF) + i;
            const float c = cs[ai], s = sn[ai];
            x[i] = lo ? rope_ra(x[i], p, c, s) : rope_rb(p, x[i], c, s);
        }
    }
}

template <typename T, int D, int MAXG>
__device__ void attn_dec1_impl(T* out, T* q, T* k, const T* v, bf16_t* kc, bf16_t* vc, const long* slots,
                               const float* cs, const float* sn, const int* tok_seq, const int* positions,
                               const int* tables, int table_width, int n_heads, int n_kv_heads, int block_size,
                               float scale_log2, int window, int style) {
    constexpr int LPK = D / 8;
    constexpr int KPW = 32 / LPK;
    constexpr int NG = DEC_WARPS * KPW;
    constexpr int STEP = DEC_WARPS * KPW;  // keys a block takes per key step
    __shared__ float sm_o[NG][MAXG][D];
    __shared__ float sm_m[NG][MAXG];
    __shared__ float sm_l[NG][MAXG];
    // This split's partial (unnormalized output, max, sum), read by the cluster.
    __shared__ float cl_o[MAXG][D];
    __shared__ float cl_ml[MAXG][2];

    pdl_launch_dependents();
    const int s = blockIdx.x, splits = gridDim.x;  // the rank in the cluster
    const int g = blockIdx.y, t = blockIdx.z;
    const int hn = n_heads / n_kv_heads;  // at most MAXG (the host checks)
    const int h0 = g * hn;
    const int pos = positions[t];
    const int lo = window > 0 ? max(0, pos + 1 - window) : 0;
    const int len = pos + 1 - lo;
    const int chunk = (len + splits - 1) / splits;
    const int k0 = lo + s * chunk;
    const int k1 = min(pos + 1, k0 + chunk);
    const bool owner = k0 <= pos && pos < k1;
    const int* table = tables + (long)tok_seq[t] * table_width;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int kg = lane / LPK, sub = lane % LPK;
    const long slot_stride = (long)n_kv_heads * D;
    const long head_off = (long)g * D + sub * 8;

    uint4 kraw[DEC1_PF], vraw[DEC1_PF];
    // Loads of key steps [jb, jb + DEC1_PF * STEP): cached keys only (the new one is pos).
    auto load = [&](int jb) {
#pragma unroll
        for (int p = 0; p < DEC1_PF; p++) {
            const int j = jb + p * STEP + kg;
            if (j < k1 && j != pos) {
                const long slot = (long)table[j / block_size] * block_size + j % block_size;
                kraw[p] = *reinterpret_cast<const uint4*>(kc + slot * slot_stride + head_off);
                vraw[p] = *reinterpret_cast<const uint4*>(vc + slot * slot_stride + head_off);
            } else {
                kraw[p] = make_uint4(0, 0, 0, 0);
                vraw[p] = make_uint4(0, 0, 0, 0);
            }
        }
    };
    const int jfirst = k0 + warp * KPW;
    load(jfirst);
    pdl_wait();

    // The query heads of the group and (the owner) the new key and value, rotated.
    const float* cst = cs + (long)t * (D / 2);
    const float* snt = sn + (long)t * (D / 2);
    float qr[MAXG][8];
#pragma unroll
    for (int h = 0; h < MAXG; h++) {
        if (h < hn) {
            const T* qp = q + ((long)t * n_heads + h0 + h) * D + sub * 8;
#pragma unroll
            for (int i = 0; i < 8; i++) qr[h][i] = act_load(qp, i);
            dec_rope8<D>(qr[h], cst, snt, sub * 8, style);
        }
    }
    float kn[8], vn[8];
    if (owner) {
        const T* kp = k + (long)t * slot_stride + head_off;
        const T* vp = v + (long)t * slot_stride + head_off;
#pragma unroll
        for (int i = 0; i < 8; i++) {
            kn[i] = act_load(kp, i);
            vn[i] = bf16_to_f32(f32_to_bf16(act_load(vp, i)));
        }
        dec_rope8<D>(kn, cst, snt, sub * 8, style);
        if (warp == 0 && kg == 0) {
            const long c = slots[t] * slot_stride + head_off;
#pragma unroll
            for (int i = 0; i < 8; i++) {
                kc[c + i] = f32_to_bf16(kn[i]);
                vc[c + i] = f32_to_bf16(vn[i]);
            }
        }
    }
    // Stored rotated queries are rounded to the activation type before scaling, as the
    // separate kernels' round trip through memory rounds them.
    float qs[MAXG][8];
#pragma unroll
    for (int h = 0; h < MAXG; h++)
#pragma unroll
        for (int i = 0; i < 8; i++) qs[h][i] = h < hn ? act_round(q, qr[h][i]) * scale_log2 : 0.0f;

    float m[MAXG], l[MAXG], acc[MAXG][8];
#pragma unroll
    for (int h = 0; h < MAXG; h++) {
        m[h] = NEG_INF;
        l[h] = 0.0f;
#pragma unroll
        for (int i = 0; i < 8; i++) acc[h][i] = 0.0f;
    }
    for (int jb = jfirst; jb < k1; jb += DEC1_PF * STEP) {
        if (jb != jfirst) load(jb);
#pragma unroll
        for (int p = 0; p < DEC1_PF; p++) {
            const int j = jb + p * STEP + kg;
            if (jb + p * STEP < k1) {  // the step exists for the whole warp
                const bool valid = j < k1;
                float kf[8], vf[8];
                if (j == pos) {
#pragma unroll
                    for (int i = 0; i < 8; i++) {
                        kf[i] = bf16_to_f32(f32_to_bf16(kn[i]));
                        vf[i] = vn[i];
                    }
                } else {
                    bf16x8_to_f32(kraw[p], kf);
                    bf16x8_to_f32(vraw[p], vf);
                }
                dec_key<LPK, MAXG>(qs, kf, vf, valid, hn, m, l, acc);
            }
        }
    }

    dec_stash<D, MAXG, NG>(sm_o, sm_m, sm_l, warp * KPW + kg, sub, hn, m, l, acc);
    for (int e = threadIdx.x; e < hn * D; e += blockDim.x) {
        const int h = e / D, d = e % D;
        float mx, lsum, o;
        dec_merge<D, MAXG, NG>(sm_o, sm_m, sm_l, h, d, mx, lsum, o);
        if (splits == 1) {
            act_store(out, ((long)t * n_heads + h0 + h) * D + d, lsum > 0.0f ? o / lsum : 0.0f);
        } else {
            cl_o[h][d] = o;
            if (d == 0) {
                cl_ml[h][0] = mx;
                cl_ml[h][1] = lsum;
            }
        }
    }
    if (splits > 1) {
        cluster_sync();
        // Block s merges elements s * blockDim.x + tid, + splits * blockDim.x, ... of the
        // group's heads over the splits in rank order, as `attn_combine` does.
        for (int e = s * blockDim.x + threadIdx.x; e < hn * D; e += splits * blockDim.x) {
            const int h = e / D, d = e % D;
            float mx = NEG_INF;
            for (int r = 0; r < splits; r++) mx = fmaxf(mx, cluster_ld(&cl_ml[h][0], r));
            float lsum = 0.0f, o = 0.0f;
            if (mx != NEG_INF) {
                for (int r = 0; r < splits; r++) {
                    const float ms = cluster_ld(&cl_ml[h][0], r);
                    if (ms != NEG_INF) {
                        const float f = exp2f(ms - mx);
                        lsum += cluster_ld(&cl_ml[h][1], r) * f;
                        o += cluster_ld(&cl_o[h][d], r) * f;
                    }
                }
            }
            act_store(out, ((long)t * n_heads + h0 + h) * D + d, lsum > 0.0f ? o / lsum : 0.0f);
        }
    }
    // The rotated query and key back to their buffers, once every block of the cluster has
    // read the raw query (the barriers above; the key is read by the owner only).
    if (owner && warp == 0 && kg == 0 && style >= 0) {
#pragma unroll
        for (int h = 0; h < MAXG; h++) {
            if (h < hn) {
                T* qp = q + ((long)t * n_heads + h0 + h) * D + sub * 8;
#pragma unroll
                for (int i = 0; i < 8; i++) act_store(qp, i, qr[h][i]);
            }
        }
        T* kp = k + (long)t * slot_stride + head_off;
#pragma unroll
        for (int i = 0; i < 8; i++) act_store(kp, i, kn[i]);
    }
    // No block leaves while the cluster may still read its shared memory.
    if (splits > 1) cluster_sync();
}

#define DEC1_WRAPPER(T, S, D, G)                                                                                  \
    extern "C" __global__ void __launch_bounds__(DEC_WARPS * 32) attn_dec1_d##D##_g##G##_##S(                     \
        T* out, T* q, T* k, const T* v, bf16_t* kc, bf16_t* vc, const long* slots, const float* cs,              \
        const float* sn, const int* tok_seq, const int* positions, const int* tables, int table_width,           \
        int n_heads, int n_kv_heads, int block_size, float scale_log2, int window, int style) {                  \
        attn_dec1_impl<T, D, G>(out, q, k, v, kc, vc, slots, cs, sn, tok_seq, positions, tables, table_width,     \
                                n_heads, n_kv_heads, block_size, scale_log2, window, style);                      \
    }
#define DEC1_G(T, S, D) \
    DEC1_WRAPPER(T, S, D, 1) DEC1_WRAPPER(T, S, D, 2) DEC1_WRAPPER(T, S, D, 4) DEC1_WRAPPER(T, S, D, 8)
DEC1_G(float, f32, 64)
DEC1_G(float, f32, 128)
DEC1_G(bf16_t, bf16, 64)
DEC1_G(bf16_t, bf16, 128)
