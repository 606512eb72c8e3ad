// Mixture-of-experts layers on the device: routing, a deterministic per-expert plan, and
// expert-grouped products (each selected expert's weights streamed once for all of its tokens).
//
//   moe_route    router logits in f32 (from the activations and the gate weight), scores
//                (sigmoid / softmax / sqrt-softplus), correction bias, group-limited top-k,
//                normalization and scaling, as the host's `moe::route`: ids and weights [n, k];
//   moe_plan     one block: tokens per expert, their offsets, the assignments (t * k + j) of
//                each expert in order, the list of experts with work; adds to the load counters;
//   moe_gateup   block (active expert, 8 rows): h[a, r] = silu(gate_e[r] . x[t]) * (up_e[r] . x[t])
//                for every assignment a = (t, j) of the expert;
//   moe_down     block (active expert, 8 rows): y[a, r] = down_e[r] . h[a] (f32);
//   moe_combine  out[t] = shared[t] + sum_j w[t, j] y[t * k + j].

#define MOE_UNROLL 4     // 8-value chunks of a row loaded before use
#define MOE_MAX_EXPERTS 1024

#define SCORE_SIGMOID 0
#define SCORE_SOFTMAX 1
#define SCORE_SQRTSOFTPLUS 2

// Index of the largest of v[0..n) not yet taken (ties: the lowest index), computed by one
// whole warp; every lane gets it (-1 when nothing is left).
__device__ __forceinline__ int moe_warp_argmax(const float* v, const unsigned char* taken, int n) {
    const int lane = threadIdx.x & 31;
    float bv = NEG_INF;
    int bi = -1;
    for (int i = lane; i < n; i += 32)
        if (!taken[i] && (bi < 0 || v[i] > bv)) {
            bv = v[i];
            bi = i;
        }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
        const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
        if (oi >= 0 && (bi < 0 || ov > bv || (ov == bv && oi < bi))) {
            bv = ov;
            bi = oi;
        }
    }
    return bi;
}

// Eight consecutive weights of a row as floats (f32, f16, bf16 rows; 16-byte aligned).
__device__ __forceinline__ void moe_gate8(int wt, const u8* p, float* o) {
    if (wt == WT_F32) {
        act_load8(reinterpret_cast<const float*>(p), o);
    } else if (wt == WT_BF16) {
        act_load8(reinterpret_cast<const bf16_t*>(p), o);
    } else {
        const uint4 v = *reinterpret_cast<const uint4*>(p);
        const u32 w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int i = 0; i < 4; i++) {
            o[2 * i] = f16_to_f32((f16_t)(w[i] & 0xffffu));
            o[2 * i + 1] = f16_to_f32((f16_t)(w[i] >> 16));
        }
    }
}

// Block per token: router logits in f32 (one warp per expert at a time, 8-value loads when
// the row allows), then warp 0 scores, masks groups and picks the top k.
template <typename T>
__device__ void moe_route_impl(int* ids, float* weights, const T* x, const u8* gate, int gate_wt, long gate_row_bytes,
                               const float* bias, int d, int E, int K, int score, int n_group, int topk_group,
                               int norm, float scaling) {
    __shared__ float sc[MOE_MAX_EXPERTS];
    __shared__ float ch[MOE_MAX_EXPERTS];
    __shared__ unsigned char taken[MOE_MAX_EXPERTS];
    __shared__ float gs[64];
    __shared__ unsigned char gtaken[64];
    __shared__ int chosen[64];
    const int t = blockIdx.x;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nw = blockDim.x >> 5;
    const T* xr = x + (long)t * d;
    const bool vec = (d % 8 == 0) && (gate_wt == WT_F32 || gate_wt == WT_BF16 || gate_wt == WT_F16) &&
                     (gate_row_bytes % 16 == 0);
    for (int e = warp; e < E; e += nw) {
        float acc = 0.0f;
        if (vec) {
            const int wb = gate_wt == WT_F32 ? 4 : 2;
            const u8* row = gate + (long)e * gate_row_bytes;
#pragma unroll 4
            for (int c = lane * 8; c < d; c += 256) {
                float wv[8], xv[8];
                moe_gate8(gate_wt, row + (long)c * wb, wv);
                act_load8(xr + c, xv);
#pragma unroll
                for (int z = 0; z < 8; z++) acc = fmaf(xv[z], wv[z], acc);
            }
        } else {
            for (int c = lane; c < d; c += 32) acc = fmaf(act_load(xr, c), weight_at(gate_wt, gate, gate_row_bytes, e, c), acc);
        }
        acc = warp_sum(acc);
        if (lane == 0) sc[e] = acc;
    }
    __syncthreads();
    if (warp != 0) return;
    if (score == SCORE_SOFTMAX) {
        float mx = NEG_INF;
        for (int e = lane; e < E; e += 32) mx = fmaxf(mx, sc[e]);
        mx = warp_max(mx);
        float sum = 0.0f;
        for (int e = lane; e < E; e += 32) sum += expf(sc[e] - mx);
        sum = warp_sum(sum);
        __syncwarp();
        for (int e = lane; e < E; e += 32) sc[e] = expf(sc[e] - mx) / sum;
    } else if (score == SCORE_SQRTSOFTPLUS) {
        for (int e = lane; e < E; e += 32) {
            const float l = sc[e];
            sc[e] = sqrtf(fmaxf(l, 0.0f) + log1pf(expf(-fabsf(l))));
        }
    } else {
        for (int e = lane; e < E; e += 32) sc[e] = 1.0f / (1.0f + expf(-sc[e]));
    }
    for (int e = lane; e < E; e += 32) {
        ch[e] = sc[e] + (bias != nullptr ? bias[e] : 0.0f);
        taken[e] = 0;
    }
    __syncwarp();
    if (n_group > 1 && topk_group < n_group) {
        const int per = E / n_group;
        for (int g = lane; g < n_group; g += 32) {
            const float* gv = ch + g * per;
            if (score == SCORE_SOFTMAX) {
                float mx = NEG_INF;
                for (int i = 0; i < per; i++) mx = fmaxf(mx, gv[i]);
                gs[g] = mx;
            } else {
                // sum of the group's two best (ties: lower index first, as the host)
                int b0 = 0;
                for (int i = 1; i < per; i++)
                    if (gv[i] > gv[b0]) b0 = i;
                int b1 = -1;
                for (int i = 0; i < per; i++)
                    if (i != b0 && (b1 < 0 || gv[i] > gv[b1])) b1 = i;
                gs[g] = gv[b0] + gv[b1];
            }
            gtaken[g] = 0;
        }
        __syncwarp();
        for (int q = 0; q < topk_group; q++) {
            const int g = moe_warp_argmax(gs, gtaken, n_group);
            if (lane == 0) gtaken[g] = 1;
            __syncwarp();
        }
        for (int e = lane; e < E; e += 32)
            if (!gtaken[e / per]) ch[e] = NEG_INF;
        __syncwarp();
    }
    for (int j = 0; j < K; j++) {
        const int e = moe_warp_argmax(ch, taken, E);
        if (lane == 0) {
            taken[e] = 1;
            chosen[j] = e;
        }
        __syncwarp();
    }
    if (lane == 0) {
        float sum = 0.0f;
        for (int j = 0; j < K; j++) sum += sc[chosen[j]];
        for (int j = 0; j < K; j++) {
            float w = sc[chosen[j]];
            if (norm) w /= sum + 1e-20f;
            ids[(long)t * K + j] = chosen[j];
            weights[(long)t * K + j] = w * scaling;
        }
    }
}

extern "C" __global__ void moe_plan(int* offsets, int* rows, int* active, int* n_active, unsigned long long* totals,
                                    unsigned* last, const int* ids, int nk, int E) {
    PDL_ENTRY();
    __shared__ int cnt[MOE_MAX_EXPERTS];
    __shared__ int off[MOE_MAX_EXPERTS + 1];
    const int e = threadIdx.x;
    int c = 0;
    if (e < E)
        for (int a = 0; a < nk; a++) c += ids[a] == e;
    if (e < E) cnt[e] = c;
    __syncthreads();
    if (threadIdx.x == 0) {
        int o = 0, na = 0;
        for (int i = 0; i < E; i++) {
            off[i] = o;
            offsets[i] = o;
            o += cnt[i];
            if (cnt[i] > 0) active[na++] = i;
        }
        off[E] = o;
        offsets[E] = o;
        *n_active = na;
    }
    __syncthreads();
    if (e < E) {
        if (c > 0) {
            int p = off[e];
            for (int a = 0; a < nk; a++)
                if (ids[a] == e) rows[p++] = a;
        }
        last[e] = (unsigned)c;
        totals[e] += (unsigned long long)c;
    }
}

__device__ __forceinline__ void moe_w8(const float* p, float* o) { act_load8(p, o); }
__device__ __forceinline__ void moe_w8(const bf16_t* p, float* o) { act_load8(p, o); }

// One warp per output row r of expert e = active[blockIdx.x]; assignments in passes of
// MOE_TOK (1: one token per expert, what batch-1 decode has, with the fewest registers; 8).
// GATED: x rows are tokens (a / k), weights gate and up, output silu(g) u in T with
// `out_w` values per row; else x rows are assignments, one weight, output f32.
template <typename T, typename WT, bool GATED, int MOE_TOK>
__device__ void moe_gemv_impl(void* out, const T* x, const u64* w1s, const u64* w2s, const int* active,
                              const int* n_active, const int* offsets, const int* rows, int k, int cols, int out_rows) {
    if ((int)blockIdx.x >= *n_active) return;
    const int e = active[blockIdx.x];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int r = blockIdx.y * (blockDim.x >> 5) + warp;
    if (r >= out_rows) return;
    const WT* w1 = reinterpret_cast<const WT*>(w1s[e]) + (long)r * cols;
    const WT* w2 = GATED ? reinterpret_cast<const WT*>(w2s[e]) + (long)r * cols : w1;
    const int a0 = offsets[e], a1 = offsets[e + 1];
    for (int p0 = a0; p0 < a1; p0 += MOE_TOK) {
        const int nt = min(MOE_TOK, a1 - p0);
        long xo[MOE_TOK];
#pragma unroll
        for (int i = 0; i < MOE_TOK; i++) {
            const int a = i < nt ? rows[p0 + i] : 0;
            xo[i] = (long)(GATED ? a / k : a) * cols;
        }
        float g[MOE_TOK], u[MOE_TOK];
#pragma unroll
        for (int i = 0; i < MOE_TOK; i++) g[i] = u[i] = 0.0f;
        for (int cb = lane * 8; cb < cols; cb += 256 * MOE_UNROLL) {
            float wa[MOE_UNROLL][8], wb[MOE_UNROLL][8];
#pragma unroll
            for (int q = 0; q < MOE_UNROLL; q++) {
                const int c = cb + q * 256;
                if (c < cols) {
                    moe_w8(w1 + c, wa[q]);
                    if (GATED) moe_w8(w2 + c, wb[q]);
                }
            }
#pragma unroll
            for (int q = 0; q < MOE_UNROLL; q++) {
                const int c = cb + q * 256;
#pragma unroll
                for (int i = 0; i < MOE_TOK; i++) {
                    if (i < nt && c < cols) {
                        float xv[8];
                        act_load8(x + xo[i] + c, xv);
#pragma unroll
                        for (int z = 0; z < 8; z++) {
                            g[i] = fmaf(wa[q][z], xv[z], g[i]);
                            if (GATED) u[i] = fmaf(wb[q][z], xv[z], u[i]);
                        }
                    }
                }
            }
        }
#pragma unroll
        for (int i = 0; i < MOE_TOK; i++) {
            if (i < nt) {
                const float gs = warp_sum(g[i]);
                const float us = GATED ? warp_sum(u[i]) : 0.0f;
                if (lane == 0) {
                    const long a = rows[p0 + i];
                    if (GATED) {
                        act_store(reinterpret_cast<T*>(out), a * out_rows + r, gs / (1.0f + expf(-gs)) * us);
                    } else {
                        reinterpret_cast<float*>(out)[a * out_rows + r] = gs;
                    }
                }
            }
        }
    }
}

template <typename T>
__device__ void moe_combine_impl(T* out, const float* y, const float* weights, const T* shared, int k, int d) {
    const int t = blockIdx.x;
    for (int c = threadIdx.x; c < d; c += blockDim.x) {
        float acc = 0.0f;
        for (int j = 0; j < k; j++) acc = fmaf(weights[(long)t * k + j], y[((long)t * k + j) * d + c], acc);
        if (shared != nullptr) acc += act_load(shared, (long)t * d + c);
        act_store(out, (long)t * d + c, acc);
    }
}

#define MOE_GEMV_WRAPPERS(T, S, WT, WS, TOK)                                                                         \
    extern "C" __global__ void moe_gateup_##WS##_t##TOK##_##S(T* h, const T* x, const u64* gates, const u64* ups,   \
                                                              const int* active, const int* n_active,               \
                                                              const int* offsets, const int* rows, int k, int d,    \
                                                              int inter) {                                          \
        PDL_ENTRY();                                                                                                 \
        moe_gemv_impl<T, WT, true, TOK>(h, x, gates, ups, active, n_active, offsets, rows, k, d, inter);             \
    }                                                                                                                \
    extern "C" __global__ void moe_down_##WS##_t##TOK##_##S(float* y, const T* h, const u64* downs,                 \
                                                            const int* active, const int* n_active,                 \
                                                            const int* offsets, const int* rows, int k, int inter,  \
                                                            int d) {                                                 \
        PDL_ENTRY();                                                                                                 \
        moe_gemv_impl<T, WT, false, TOK>(y, h, downs, downs, active, n_active, offsets, rows, k, inter, d);          \
    }

#define MOE_WRAPPERS(T, S)                                                                                           \
    extern "C" __global__ void moe_route_##S(int* ids, float* weights, const T* x, const u8* gate, int gate_wt,     \
                                             long gate_row_bytes, const float* bias, int d, int E, int K, int score, \
                                             int n_group, int topk_group, int norm, float scaling) {                \
        PDL_ENTRY();                                                                                                 \
        moe_route_impl<T>(ids, weights, x, gate, gate_wt, gate_row_bytes, bias, d, E, K, score, n_group, topk_group, \
                          norm, scaling);                                                                            \
    }                                                                                                                \
    extern "C" __global__ void moe_combine_##S(T* out, const float* y, const float* weights, const T* shared, int k, \
                                               int d) {                                                              \
        PDL_ENTRY();                                                                                                 \
        moe_combine_impl<T>(out, y, weights, shared, k, d);                                                          \
    }                                                                                                                \
    MOE_GEMV_WRAPPERS(T, S, float, wf32, 1)                                                                          \
    MOE_GEMV_WRAPPERS(T, S, float, wf32, 8)                                                                          \
    MOE_GEMV_WRAPPERS(T, S, bf16_t, wbf16, 1)                                                                        \
    MOE_GEMV_WRAPPERS(T, S, bf16_t, wbf16, 8)

MOE_WRAPPERS(float, f32)
MOE_WRAPPERS(bf16_t, bf16)
