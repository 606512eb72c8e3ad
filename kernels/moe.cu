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

// moe_gate8 in two steps: the raw 16 (f32: 32) bytes, then the conversion.
__device__ __forceinline__ void moe_gate_cvt(int wt, const uint4* raw, float* o) {
    if (wt == WT_F32) {
        o[0] = __uint_as_float(raw[0].x); o[1] = __uint_as_float(raw[0].y);
        o[2] = __uint_as_float(raw[0].z); o[3] = __uint_as_float(raw[0].w);
        o[4] = __uint_as_float(raw[1].x); o[5] = __uint_as_float(raw[1].y);
        o[6] = __uint_as_float(raw[1].z); o[7] = __uint_as_float(raw[1].w);
    } else if (wt == WT_BF16) {
        bf16x8_to_f32(raw[0], o);
    } else {
        const u32 w[4] = {raw[0].x, raw[0].y, raw[0].z, raw[0].w};
#pragma unroll
        for (int i = 0; i < 4; i++) {
            o[2 * i] = f16_to_f32((f16_t)(w[i] & 0xffffu));
            o[2 * i + 1] = f16_to_f32((f16_t)(w[i] >> 16));
        }
    }
}

// The elementwise scores (sigmoid, sqrt-softplus) of a router logit.
__device__ __forceinline__ float moe_score(int score, float l) {
    if (score == SCORE_SQRTSOFTPLUS) return sqrtf(fmaxf(l, 0.0f) + log1pf(expf(-fabsf(l))));
    return 1.0f / (1.0f + expf(-l));
}

// One warp scores a token's router logits sc[0, E) in place and picks its top K as the host's
// `moe::route` (correction bias, group limit, normalization, scaling): experts chosen[j] with
// weights wsel[j], written by lane 0. ch, gs and gtaken are its scratch (shared memory).
__device__ void moe_pick(float* sc, float* ch, float* gs, unsigned char* gtaken, int* chosen,
                         float* wsel, const float* bias, int E, int K, int score, int n_group, int topk_group,
                         int norm, float scaling) {
    const int lane = threadIdx.x & 31;
    if (score == SCORE_SOFTMAX) {
        float mx = NEG_INF;
        for (int e = lane; e < E; e += 32) mx = fmaxf(mx, sc[e]);
        mx = warp_max(mx);
        float sum = 0.0f;
        for (int e = lane; e < E; e += 32) sum += expf(sc[e] - mx);
        sum = warp_sum(sum);
        __syncwarp();
        for (int e = lane; e < E; e += 32) sc[e] = expf(sc[e] - mx) / sum;
    } else {
        for (int e = lane; e < E; e += 32) sc[e] = moe_score(score, sc[e]);
    }
    // (NaN ranks as -inf, so the ranks below are a permutation: every chosen[j] is written once)
    for (int e = lane; e < E; e += 32) {
        const float c = sc[e] + (bias != nullptr ? bias[e] : 0.0f);
        ch[e] = c != c ? NEG_INF : c;
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
    // The top K in one pass: expert e's rank is the number of experts ahead of it (a larger
    // value, or the same value at a lower index), the order a repeated argmax picks them in.
    for (int e = lane; e < E; e += 32) {
        const float v = ch[e];
        int rank = 0;
        for (int o = 0; o < E; o++) {
            const float w = ch[o];
            rank += (w > v) || (w == v && o < e);
        }
        if (rank < K) chosen[rank] = e;
    }
    __syncwarp();
    if (lane == 0) {
        float sum = 0.0f;
        for (int j = 0; j < K; j++) sum += sc[chosen[j]];
        for (int j = 0; j < K; j++) {
            float w = sc[chosen[j]];
            if (norm) w /= sum + 1e-20f;
            wsel[j] = w * scaling;
        }
    }
}

// This lane's share of the router logit of the gate row at `row` for tokens 0..nt of x (rows
// x_stride apart, NT at most): the 8-value chunks lane * 8 + 256 i in order, each product
// fused into its token's sum, the weights loaded once for all the tokens. Every routing kernel
// sums in this order, so they agree bit for bit.
template <typename T, int NT>
__device__ __forceinline__ void moe_logit_share(float (&acc)[NT], const u8* row, int gate_wt, const T* x,
                                                long x_stride, int nt, int d) {
    const int lane = threadIdx.x & 31;
    const int wb = gate_wt == WT_F32 ? 4 : 2;
#pragma unroll 4
    for (int c = lane * 8; c < d; c += 256) {
        float wv[8];
        moe_gate8(gate_wt, row + (long)c * wb, wv);
#pragma unroll
        for (int t = 0; t < NT; t++) {
            if (t < nt) {
                float xv[8];
                act_load8(x + t * x_stride + c, xv);
#pragma unroll
                for (int z = 0; z < 8; z++) acc[t] = fmaf(xv[z], wv[z], acc[t]);
            }
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
    __shared__ float gs[64];
    __shared__ unsigned char gtaken[64];
    __shared__ int chosen[64];
    __shared__ float wsel[64];
    const int t = blockIdx.x;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nw = blockDim.x >> 5;
    const T* xr = x + (long)t * d;
    const bool vec = (d % 8 == 0) && (gate_wt == WT_F32 || gate_wt == WT_BF16 || gate_wt == WT_F16) &&
                     (gate_row_bytes % 16 == 0);
    for (int e = warp; e < E; e += nw) {
        float acc[1] = {0.0f};
        if (vec) {
            moe_logit_share<T, 1>(acc, gate + (long)e * gate_row_bytes, gate_wt, xr, d, 1, d);
        } else {
            for (int c = lane; c < d; c += 32)
                acc[0] = fmaf(act_load(xr, c), weight_at(gate_wt, gate, gate_row_bytes, e, c), acc[0]);
        }
        acc[0] = warp_sum(acc[0]);
        if (lane == 0) sc[e] = acc[0];
    }
    __syncthreads();
    if (warp != 0) return;
    moe_pick(sc, ch, gs, gtaken, chosen, wsel, bias, E, K, score, n_group, topk_group, norm, scaling);
    __syncwarp();
    if (lane == 0) {
        for (int j = 0; j < K; j++) {
            ids[(long)t * K + j] = chosen[j];
            weights[(long)t * K + j] = wsel[j];
        }
    }
}

// Warp-wide scan of the experts' counts cnt[0, E) (lane l owns the run [e0, e1) of
// ceil(E / 32) experts): the assignments and active experts before each lane's run, and after
// it (lane 31's are the totals).
struct MoeScan {
    int e0, e1, off, act, end_off, end_act;
};
__device__ __forceinline__ MoeScan moe_scan_counts(const int* cnt, int E) {
    const int lane = threadIdx.x & 31;
    const int per = (E + 31) / 32, e0 = min(E, lane * per), e1 = min(E, e0 + per);
    int sum = 0, act = 0;
    for (int e = e0; e < e1; e++) {
        sum += cnt[e];
        act += cnt[e] > 0;
    }
    int xs = sum, xa = act;
    for (int o = 1; o < 32; o <<= 1) {
        const int ys = __shfl_up_sync(0xffffffffu, xs, o), ya = __shfl_up_sync(0xffffffffu, xa, o);
        if (lane >= o) {
            xs += ys;
            xa += ya;
        }
    }
    return MoeScan{e0, e1, xs - sum, xa - act, xs, xa};
}

// One block of MOE_PLAN_THREADS; warp w owns experts w, w + 32, ...: it counts an expert's
// assignments 32 at a time by ballot over the ids (staged in shared memory a chunk at a time),
// warp 0 turns the counts into offsets and the list of active experts, then a second pass
// writes each expert's assignments in increasing order (a ballot's lower lanes first).
#define MOE_PLAN_THREADS 1024
#define MOE_PLAN_CHUNK 4096
extern "C" __global__ void __launch_bounds__(MOE_PLAN_THREADS)
    moe_plan(int* offsets, int* rows, int* active, int* n_active, unsigned long long* totals, unsigned* last,
             const int* ids, int nk, int E) {
    PDL_ENTRY();
    __shared__ int cnt[MOE_MAX_EXPERTS];
    __shared__ int off[MOE_MAX_EXPERTS];
    __shared__ int ids_s[MOE_PLAN_CHUNK];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, nw = blockDim.x >> 5;
    const u32 below = (1u << lane) - 1u;
    for (int e = tid; e < E; e += blockDim.x) cnt[e] = 0;
    // pass 0 counts, pass 1 writes the rows
    for (int pass = 0; pass < 2; pass++) {
        for (int c0 = 0; c0 < nk; c0 += MOE_PLAN_CHUNK) {
            const int len = min(MOE_PLAN_CHUNK, nk - c0);
            __syncthreads();
            for (int i = tid; i < len; i += blockDim.x) ids_s[i] = ids[c0 + i];
            __syncthreads();
            for (int e = warp; e < E; e += nw) {
                int pos = pass == 0 ? 0 : off[e];
                for (int i0 = 0; i0 < len; i0 += 32) {
                    const bool hit = i0 + lane < len && ids_s[i0 + lane] == e;
                    const u32 m = __ballot_sync(0xffffffffu, hit);
                    if (pass == 1 && hit) rows[pos + __popc(m & below)] = c0 + i0 + lane;
                    pos += __popc(m);
                }
                if (lane == 0) {
                    if (pass == 0) cnt[e] += pos;
                    else off[e] = pos;
                }
            }
        }
        __syncthreads();
        if (pass == 0 && warp == 0) {
            // offsets by a warp-wide scan of per-lane runs of experts; active experts likewise
            const MoeScan sc = moe_scan_counts(cnt, E);
            int o = sc.off, a = sc.act;
            for (int e = sc.e0; e < sc.e1; e++) {
                off[e] = o;
                offsets[e] = o;
                if (cnt[e] > 0) active[a++] = e;
                o += cnt[e];
            }
            if (lane == 31) {
                offsets[E] = sc.end_off;
                *n_active = sc.end_act;
            }
        }
        __syncthreads();
    }
    for (int e = tid; e < E; e += blockDim.x) {
        last[e] = (unsigned)cnt[e];
        totals[e] += (unsigned long long)cnt[e];
    }
}

// The routing of steps of many tokens (prompts): moe_route_impl for MOE_RT tokens a block, so
// each gate row is read once for all of them (a block a token reads the whole gate again for
// every token: 256 KB for 64 experts of 2,048). Warp w takes experts w, w + 8, ...; then warp t
// scores and picks token t. Same sums in the same order as moe_route: the same ids and weights.
// Rows of whole 8-value chunks and 16-byte gate rows of f32, f16 or bf16; at most MOE_RT_MAXE
// experts.
#define MOE_RT 8
#define MOE_RT_MAXE 256
#define MOE_RT_THREADS 256
template <typename T>
__device__ void moe_route8_impl(int* ids, float* weights, const T* x, const u8* gate, int gate_wt, long gate_row_bytes,
                                const float* bias, int n, int d, int E, int K, int score, int n_group, int topk_group,
                                int norm, float scaling) {
    __shared__ float sc[MOE_RT][MOE_RT_MAXE];
    __shared__ float ch[MOE_RT][MOE_RT_MAXE];
    __shared__ float gs[MOE_RT][64];
    __shared__ unsigned char gtaken[MOE_RT][64];
    __shared__ int chosen[MOE_RT][64];
    __shared__ float wsel[MOE_RT][64];
    const int t0 = blockIdx.x * MOE_RT, nt = min(MOE_RT, n - t0);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nw = blockDim.x >> 5;
    for (int e = warp; e < E; e += nw) {
        float acc[MOE_RT];
#pragma unroll
        for (int t = 0; t < MOE_RT; t++) acc[t] = 0.0f;
        moe_logit_share<T, MOE_RT>(acc, gate + (long)e * gate_row_bytes, gate_wt, x + (long)t0 * d, d, nt, d);
#pragma unroll
        for (int t = 0; t < MOE_RT; t++) {
            const float v = warp_sum(acc[t]);
            if (lane == 0 && t < nt) sc[t][e] = v;
        }
    }
    __syncthreads();
    if (warp >= nt) return;
    moe_pick(sc[warp], ch[warp], gs[warp], gtaken[warp], chosen[warp], wsel[warp], bias, E, K, score, n_group,
             topk_group, norm, scaling);
    __syncwarp();
    if (lane == 0) {
        const long t = t0 + warp;
        for (int j = 0; j < K; j++) {
            ids[t * K + j] = chosen[warp][j];
            weights[t * K + j] = wsel[warp][j];
        }
    }
}

// moe_plan over E blocks (steps of many assignments; one block walks every expert in turn):
// block e counts every expert's assignments in shared memory (atomic adds: the counts do not
// depend on their order), takes its expert's offset and place in the list of active experts by
// the warp scan moe_plan uses, and writes its expert's assignments in increasing order, a chunk
// of the ids at a time (a warp's hits by ballot, the warps' counts added in warp order). Block 0
// writes offsets[E] and the active count. The same outputs as moe_plan.
#define MOE_PLAN2_THREADS 512
extern "C" __global__ void __launch_bounds__(MOE_PLAN2_THREADS)
    moe_plan2(int* offsets, int* rows, int* active, int* n_active, unsigned long long* totals, unsigned* last,
              const int* ids, int nk, int E) {
    PDL_ENTRY();
    __shared__ int cnt[MOE_MAX_EXPERTS];
    __shared__ int wsum[MOE_PLAN2_THREADS / 32];
    __shared__ int off_e, act_e;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, nw = blockDim.x >> 5, e = blockIdx.x;
    const u32 below = (1u << lane) - 1u;
    for (int i = tid; i < E; i += blockDim.x) cnt[i] = 0;
    __syncthreads();
    for (int i = tid; i < nk; i += blockDim.x) atomicAdd(&cnt[ids[i]], 1);
    __syncthreads();
    if (warp == 0) {
        const MoeScan sc = moe_scan_counts(cnt, E);
        int o = sc.off, a = sc.act;
        for (int i = sc.e0; i < sc.e1; i++) {
            if (i == e) {
                off_e = o;
                act_e = a;
            }
            o += cnt[i];
            a += cnt[i] > 0;
        }
        if (e == 0 && lane == 31) {
            offsets[E] = sc.end_off;
            *n_active = sc.end_act;
        }
    }
    __syncthreads();
    const int c = cnt[e];
    if (tid == 0) {
        offsets[e] = off_e;
        if (c > 0) active[act_e] = e;
        last[e] = (unsigned)c;
        totals[e] += (unsigned long long)c;
    }
    if (c == 0) return;
    int pos = off_e;
    for (int c0 = 0; c0 < nk; c0 += blockDim.x) {
        const int i = c0 + tid;
        const bool hit = i < nk && ids[i] == e;
        const u32 m = __ballot_sync(0xffffffffu, hit);
        if (lane == 0) wsum[warp] = __popc(m);
        __syncthreads();
        int before = 0, all = 0;
        for (int w = 0; w < nw; w++) {
            const int s = wsum[w];
            before += w < warp ? s : 0;
            all += s;
        }
        if (hit) rows[pos + before + __popc(m & below)] = i;
        pos += all;
        __syncthreads();
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
                        act_store(reinterpret_cast<T*>(out), a * out_rows + r, swiglu(gs, us));
                    } else {
                        reinterpret_cast<float*>(out)[a * out_rows + r] = gs;
                    }
                }
            }
        }
    }
}

// Block (token, chunk of blockDim columns).
template <typename T>
__device__ void moe_combine_impl(T* out, const float* y, const float* weights, const T* shared, int k, int d) {
    const int t = blockIdx.x;
    for (int c = blockIdx.y * blockDim.x + threadIdx.x; c < d; c += gridDim.y * blockDim.x) {
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
    extern "C" __global__ void __launch_bounds__(MOE_RT_THREADS) moe_route8_##S(                                   \
        int* ids, float* weights, const T* x, const u8* gate, int gate_wt, long gate_row_bytes, const float* bias,  \
        int n, int d, int E, int K, int score, int n_group, int topk_group, int norm, float scaling) {              \
        PDL_ENTRY();                                                                                                 \
        moe_route8_impl<T>(ids, weights, x, gate, gate_wt, gate_row_bytes, bias, n, d, E, K, score, n_group,         \
                           topk_group, norm, scaling);                                                               \
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

// ---- Decode steps (up to MOED_MAXN tokens): three launches a layer ----
//
//   moe_route_dec  blocks of MOED_EPB experts: each block normalizes the tokens (the RMSNorm
//                  before the layer, when folded in: every block computes the tokens' scales,
//                  each writes a slice of the normalized rows h) and computes its experts'
//                  router logits; the last block to finish (arrival counter, which it leaves
//                  zeroed) routes every token (one warp each), updates the load counters and
//                  writes the slot table: slot s = the s-th selected expert in id order, its
//                  gate/up/down addresses, its tokens (in order) and their routing weights;
//   moe_gu_dec     block (slot, R rows): h[s, i, r] = silu(gate_e[r] . x[tok_i]) * (up_e[r] .
//                  x[tok_i]) for the slot's tokens; the shared experts are further slots of
//                  `inter` rows each, which know their weights before the routing is done and
//                  stream their first rows before waiting for it;
//   moe_down_dec   block (R output rows) over every slot, shared ones first:
//                  out[t, r] = sum_slots w * (down_e[r] . h[s, i]) for the slot's token t,
//                  shared weights 1, and optionally res[t, r] += out[t, r] (the residual add).
// Each thread owns 16-byte chunks of weight rows and issues all of a step's loads before using
// any; partial sums meet in shared memory.

#define MOED_THREADS 256
#define MOED_MAXN 8        // tokens
#define MOED_MAXE 256      // experts
#define MOED_MAXS 64       // routed slots
#define MOED_MAXSH 16      // shared slots
#define MOED_EPB 4         // experts per routing block
#define MOED_R 4           // rows per block of the expert products

__device__ __forceinline__ void moe_prefetch_l2(const void* p) {
    asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
}

// 16 bytes of weights as floats (CE of them) and CE activations.
template <typename WT>
struct MoeChunk;
template <>
struct MoeChunk<bf16_t> {
    static constexpr int CE = 8;
    static __device__ __forceinline__ void cvt(uint4 v, float* o) { bf16x8_to_f32(v, o); }
};
template <>
struct MoeChunk<float> {
    static constexpr int CE = 4;
    static __device__ __forceinline__ void cvt(uint4 v, float* o) {
        o[0] = __uint_as_float(v.x); o[1] = __uint_as_float(v.y);
        o[2] = __uint_as_float(v.z); o[3] = __uint_as_float(v.w);
    }
};
__device__ __forceinline__ void moe_act_load(const float* p, float* o, int ce) {
    if (ce == 8) {
        act_load8(p, o);
    } else {
        const float4 a = *reinterpret_cast<const float4*>(p);
        o[0] = a.x; o[1] = a.y; o[2] = a.z; o[3] = a.w;
    }
}
__device__ __forceinline__ void moe_act_load(const bf16_t* p, float* o, int ce) {
    if (ce == 8) {
        act_load8(p, o);
    } else {
        const uint2 v = *reinterpret_cast<const uint2*>(p);
        o[0] = __uint_as_float(v.x << 16); o[1] = __uint_as_float(v.x & 0xffff0000u);
        o[2] = __uint_as_float(v.y << 16); o[3] = __uint_as_float(v.y & 0xffff0000u);
    }
}

// CE (4 or 8) activations as floats through L2 only (what an earlier kernel wrote, read by a
// kernel that does not wait for its predecessor: see moe_gu_dec).
__device__ __forceinline__ uint4 moe_ld_cg16(const void* p) {
    uint4 r;
    asm volatile("ld.global.cg.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
    return r;
}
__device__ __forceinline__ void moe_load_cg(const float* p, float* o, int ce) {
    for (int h = 0; h < ce / 4; h++) {
        const uint4 a = moe_ld_cg16(p + 4 * h);
        o[4 * h] = __uint_as_float(a.x); o[4 * h + 1] = __uint_as_float(a.y);
        o[4 * h + 2] = __uint_as_float(a.z); o[4 * h + 3] = __uint_as_float(a.w);
    }
}
__device__ __forceinline__ void moe_load_cg(const bf16_t* p, float* o, int ce) {
    if (ce == 8) {
        bf16x8_to_f32(moe_ld_cg16(p), o);
    } else {
        uint2 v;
        asm volatile("ld.global.cg.v2.u32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "l"(p));
        o[0] = __uint_as_float(v.x << 16); o[1] = __uint_as_float(v.x & 0xffff0000u);
        o[2] = __uint_as_float(v.y << 16); o[3] = __uint_as_float(v.y & 0xffff0000u);
    }
}

// Thread tid's first 16 (f32: 32) bytes of the gate rows of experts e0 .. e0 + ne (the
// routing kernels load them before the programmatic wait: no kernel writes them).
template <int EPB>
__device__ __forceinline__ void moe_gate_first(uint4 (&graw)[EPB][2], const u8* gate, int gate_wt,
                                               long gate_row_bytes, int e0, int ne, bool mine) {
    const int wb = gate_wt == WT_F32 ? 4 : 2;
#pragma unroll
    for (int i = 0; i < EPB; i++) {
        graw[i][0] = graw[i][1] = make_uint4(0, 0, 0, 0);
        if (i < ne && mine) {
            const uint4* p = reinterpret_cast<const uint4*>(gate + (long)(e0 + i) * gate_row_bytes +
                                                            (long)threadIdx.x * 8 * wb);
            graw[i][0] = p[0];
            if (gate_wt == WT_F32) graw[i][1] = p[1];
        }
    }
}

// The RMSNorm scales of the n rows of x (d values, 8 a load): rstd[t] = 1 / sqrt(mean(x^2) +
// eps) for every thread, the same sums in the same order in each kernel that calls it (256
// threads). `red` holds [warps][stride] floats; ends with a barrier.
template <typename T>
__device__ void moe_rstd(const T* x, int n, int d, float eps, bool cg, float* red, int stride, float* rstd) {
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, nch = d >> 3;
    float ss[MOED_MAXN];
#pragma unroll
    for (int t = 0; t < MOED_MAXN; t++) ss[t] = 0.0f;
    for (int c = tid; c < nch; c += blockDim.x) {
#pragma unroll
        for (int t = 0; t < MOED_MAXN; t++) {
            if (t < n) {
                float v[8];
                if (cg) moe_load_cg(x + (long)t * d + c * 8, v, 8);
                else act_load8(x + (long)t * d + c * 8, v);
#pragma unroll
                for (int j = 0; j < 8; j++) ss[t] = fmaf(v[j], v[j], ss[t]);
            }
        }
    }
#pragma unroll
    for (int t = 0; t < MOED_MAXN; t++) {
        if (t < n) {
            const float s = warp_sum(ss[t]);
            if (lane == 0) red[warp * stride + t] = s;
        }
    }
    __syncthreads();
    if (tid < n) {
        float s = 0.0f;
        for (int w = 0; w < (int)(blockDim.x >> 5); w++) s += red[w * stride + tid];
        rstd[tid] = 1.0f / sqrtf(s / (float)d + eps);
    }
    __syncthreads();
}

// EPB experts a block, N tokens at most. CL: the blocks form one thread-block cluster and
// block 0 gathers the logits from the others' shared memory, instead of the last block to
// arrive reading them back from global memory after a fence and an arrival counter.
template <typename T, int EPB, int N, bool CL>
__device__ void moe_route_dec_impl(float* logits, unsigned* counter, u64* slot_ptr, int* slot_cnt, int* slot_tok,
                                   float* slot_wt, unsigned long long* totals, unsigned* last, T* h, const T* x,
                                   const float* gain, float eps, const u8* gate, int gate_wt, long gate_row_bytes,
                                   const float* bias, const u64* ptrs, int d, int E, int K, int n, int score,
                                   int n_group, int topk_group, int norm, float scaling, int n_slots, int early) {
    __shared__ float red[MOED_THREADS / 32][EPB * MOED_MAXN];
    __shared__ float lg[CL ? EPB * MOED_MAXN : 1];
    __shared__ float bias_s[MOED_MAXE];
    __shared__ float rstd[MOED_MAXN];
    __shared__ int is_last;
    __shared__ float sc[MOED_MAXN][MOED_MAXE];
    __shared__ float ch[MOED_MAXN][MOED_MAXE];
    __shared__ float gs[MOED_MAXN][64];
    __shared__ unsigned char gtaken[MOED_MAXN][64];
    __shared__ int chosen[MOED_MAXN][64];
    __shared__ float wsel[MOED_MAXN][64];
    __shared__ int wcount[MOED_THREADS / 32];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int e0 = blockIdx.x * EPB;
    const int ne = min(EPB, E - e0);
    const int nch = d >> 3;
    const int wb = gate_wt == WT_F32 ? 4 : 2;
    // The dependents are let in only after the wait below: moe_gu_dec's shared slots then
    // read the layer's input without waiting for this kernel.
    // The first chunk of each gate row is no earlier kernel's output: loaded before the wait
    // (raw), the rest on its way to L2.
    uint4 graw[EPB][2];
    moe_gate_first<EPB>(graw, gate, gate_wt, gate_row_bytes, e0, ne, tid < nch);
    for (int c = tid + blockDim.x; c < nch; c += blockDim.x)
        for (int i = 0; i < ne; i++) moe_prefetch_l2(gate + (long)(e0 + i) * gate_row_bytes + (long)c * 8 * wb);
    // the norm's gains of this thread's first chunk (no kernel writes them)
    float g8[8];
#pragma unroll
    for (int j = 0; j < 8; j++) g8[j] = gain != nullptr && tid < nch ? gain[tid * 8 + j] : 0.0f;
    // early: the correction bias (no kernel writes it) and the experts' weight addresses are
    // loaded before the wait, and the last block scores from a shared copy of the bias
    u64 my_ptr[3] = {0, 0, 0};
    float my_bias = 0.0f;
    if (early && tid < E) {
        my_ptr[0] = ptrs[tid];
        my_ptr[1] = ptrs[E + tid];
        my_ptr[2] = ptrs[2 * E + tid];
        if (bias != nullptr) my_bias = bias[tid];
    }
    pdl_wait();
    pdl_launch_dependents();
    // What the last block needs of expert tid, loaded early by every block (any may be last).
    unsigned long long my_total = 0;
    if (tid < E) {
        if (!early) {
            my_ptr[0] = ptrs[tid];
            my_ptr[1] = ptrs[E + tid];
            my_ptr[2] = ptrs[2 * E + tid];
        }
        my_total = totals[tid];
    }
    if (gain != nullptr) {
        moe_rstd(x, n, d, eps, false, &red[0][0], EPB * MOED_MAXN, rstd);
        // this block's slice of the normalized rows, as the RMSNorm kernel writes them
        for (long i = (long)blockIdx.x * blockDim.x + tid; i < (long)n * nch; i += (long)gridDim.x * blockDim.x) {
            const int t = (int)(i / nch), c = (int)(i % nch);
            float v[8];
            act_load8(x + (long)t * d + c * 8, v);
#pragma unroll
            for (int j = 0; j < 8; j++) act_store(h, (long)t * d + c * 8 + j, v[j] * rstd[t] * gain[c * 8 + j]);
        }
    }
    di_trace_phase(0);
    float acc[EPB][N];
#pragma unroll
    for (int i = 0; i < EPB; i++)
#pragma unroll
        for (int t = 0; t < N; t++) acc[i][t] = 0.0f;
    for (int c = tid; c < nch; c += blockDim.x) {
        float wv[EPB][8];
#pragma unroll
        for (int i = 0; i < EPB; i++) {
            if (i < ne) {
                if (c == tid) {
                    moe_gate_cvt(gate_wt, graw[i], wv[i]);
                } else {
                    moe_gate8(gate_wt, gate + (long)(e0 + i) * gate_row_bytes + (long)c * 8 * wb, wv[i]);
                }
            }
        }
#pragma unroll
        for (int t = 0; t < N; t++) {
            if (t < n) {
                float xv[8];
                act_load8(x + (long)t * d + c * 8, xv);
                if (gain != nullptr) {
#pragma unroll
                    for (int j = 0; j < 8; j++)
                        xv[j] = act_round(x, xv[j] * rstd[t] * (c == tid ? g8[j] : gain[c * 8 + j]));
                }
#pragma unroll
                for (int i = 0; i < EPB; i++)
                    if (i < ne)
#pragma unroll
                        for (int j = 0; j < 8; j++) acc[i][t] = fmaf(xv[j], wv[i][j], acc[i][t]);
            }
        }
    }
    __syncthreads();  // red is reused
#pragma unroll
    for (int i = 0; i < EPB; i++)
#pragma unroll
        for (int t = 0; t < N; t++) {
            if (i < ne && t < n) {
                const float s = warp_sum(acc[i][t]);
                if (lane == 0) red[warp][i * MOED_MAXN + t] = s;
            }
        }
    __syncthreads();
    if (tid < EPB * MOED_MAXN) {
        const int i = tid / MOED_MAXN, t = tid % MOED_MAXN;
        if (i < ne && t < n) {
            float s = 0.0f;
            for (int w = 0; w < (int)(blockDim.x >> 5); w++) s += red[w][tid];
            if (CL) lg[tid] = s;
            else logits[(long)t * E + e0 + i] = s;
        }
    }
    di_trace_phase(1);
    if (CL) {
        // Block 0 routes every token; the others leave once it has read their logits.
        cluster_sync();
        if (blockIdx.x != 0) {
            cluster_sync();
            return;
        }
        if (warp < n)
            for (int e = lane; e < E; e += 32) sc[warp][e] = cluster_ld(&lg[(e % EPB) * MOED_MAXN + warp], e / EPB);
        cluster_sync();
    } else {
        // The last block to arrive routes every token.
        __threadfence();
        __syncthreads();
        if (tid == 0) is_last = atomicAdd(counter, 1u) == gridDim.x - 1;
        __syncthreads();
        if (!is_last) return;
        __threadfence();
        if (warp < n)
            for (int e = lane; e < E; e += 32) sc[warp][e] = ld_cg(logits + (long)warp * E + e);
    }
    di_trace_phase(2);
    const float* bias_p = bias;
    if (early && bias != nullptr) {
        if (tid < E) bias_s[tid] = my_bias;
        __syncthreads();
        bias_p = bias_s;
    }
    if (warp < n) {
        __syncwarp();
        moe_pick(sc[warp], ch[warp], gs[warp], gtaken[warp], chosen[warp], wsel[warp], bias_p, E, K, score, n_group,
                 topk_group, norm, scaling);
    }
    __syncthreads();
    di_trace_phase(3);
    // Tokens per expert, each selected expert's slot (its rank among the selected ones).
    const int e = tid;
    int c = 0;
    if (e < E)
        for (int t = 0; t < n; t++)
            for (int j = 0; j < K; j++) c += chosen[t][j] == e;
    const unsigned bal = __ballot_sync(0xffffffffu, c > 0);
    if (lane == 0) wcount[warp] = __popc(bal);
    __syncthreads();
    int s = __popc(bal & ((1u << lane) - 1u));
    int n_active = 0;
    for (int w = 0; w < (int)(blockDim.x >> 5); w++) {
        if (w < warp) s += wcount[w];
        n_active += wcount[w];
    }
    if (e < E) {
        last[e] = (unsigned)c;
        totals[e] = my_total + (unsigned long long)c;
        if (c > 0) {
            slot_ptr[3 * s] = my_ptr[0];
            slot_ptr[3 * s + 1] = my_ptr[1];
            slot_ptr[3 * s + 2] = my_ptr[2];
            slot_cnt[s] = c;
            int i = 0;
            for (int t = 0; t < n; t++)
                for (int j = 0; j < K; j++)
                    if (chosen[t][j] == e) {
                        slot_tok[s * MOED_MAXN + i] = t;
                        slot_wt[s * MOED_MAXN + i] = wsel[t][j];
                        i++;
                    }
        }
    }
    for (int q = n_active + tid; q < n_slots; q += blockDim.x) slot_cnt[q] = 0;
    if (tid == 0) *counter = 0u;
    di_trace_phase(4);
}

template <typename T, typename WT, int N>
__device__ void moe_gu_dec_impl(T* hout, const T* x, const T* src, const float* gain, float eps,
                                const u64* slot_ptr, const int* slot_cnt, const int* slot_tok, const WT* sh_gate,
                                const WT* sh_up, int n_routed, int n_shared, int n, int d, int inter, int early) {
    constexpr int R = MOED_R;
    constexpr int CE = MoeChunk<WT>::CE;
    __shared__ float red[MOED_THREADS / 32][2 * R * N];
    __shared__ float rstd[MOED_MAXN];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    // the shared slots first in the grid, so they are the first to be resident; `early`
    // (`DEEPINFER_CUDA_DS2` shared): they do not wait for the routing
    const bool shared_slot = (int)blockIdx.x < n_shared;
    const bool pre = shared_slot && early;
    const int s = shared_slot ? n_routed + blockIdx.x : blockIdx.x - n_shared;
    pdl_launch_dependents();
    // the slot's rows from 0; a block takes the row chunks blockIdx.y, + gridDim.y, ... (one
    // chunk a block when the grid has them all, else fewer blocks that read the table once)
    const WT* wg;
    const WT* wu;
    int cnt;
    int tok[N];
    if (shared_slot) {
        // The shared experts do not wait for the routing: it lets this kernel in only once
        // the layer's input is written (see moe_route_dec), and they read that input through
        // L2, normalizing it themselves (the same sums and rounding as the routing kernel)
        // when the RMSNorm is folded into the routing (`gain`; `src` its input).
        const long q = s - n_routed;
        wg = sh_gate + q * inter * (long)d;
        wu = sh_up + q * inter * (long)d;
        cnt = n;
#pragma unroll
        for (int i = 0; i < N; i++) tok[i] = i;
        if (!early) pdl_wait();
        if (pre && gain != nullptr) moe_rstd(src, n, d, eps, true, &red[0][0], 2 * R * N, rstd);
    } else {
        pdl_wait();
        // the slot's count, addresses and tokens asked for together (one round trip to L2,
        // not two): the table is whole for every slot, an empty one holds stale addresses
        cnt = slot_cnt[s];
        const u64 pg = slot_ptr[3 * s], pu = slot_ptr[3 * s + 1];
#pragma unroll
        for (int i = 0; i < N; i++) tok[i] = slot_tok[s * MOED_MAXN + i];
        if (cnt == 0) return;
        wg = reinterpret_cast<const WT*>(pg);
        wu = reinterpret_cast<const WT*>(pu);
#pragma unroll
        for (int i = 0; i < N; i++) tok[i] = i < cnt ? tok[i] : 0;
    }
    const bool norm = pre && gain != nullptr;
    if (norm) __syncthreads();  // red held the norm's sums
    for (int r0 = blockIdx.y * R; r0 < inter; r0 += gridDim.y * R) {
        const int nr = min(R, inter - r0);
        float g[R][N], u[R][N];
#pragma unroll
        for (int i = 0; i < R; i++)
#pragma unroll
            for (int t = 0; t < N; t++) g[i][t] = u[i][t] = 0.0f;
        const int nch = d / CE;
        for (int c = tid; c < nch; c += blockDim.x) {
            uint4 rg[R], ru[R];
#pragma unroll
            for (int i = 0; i < R; i++) {
                if (i < nr) {
                    rg[i] = ld_stream16(wg + (long)(r0 + i) * d + (long)c * CE);
                    ru[i] = ld_stream16(wu + (long)(r0 + i) * d + (long)c * CE);
                } else {
                    rg[i] = ru[i] = make_uint4(0, 0, 0, 0);
                }
            }
#pragma unroll
            for (int t = 0; t < N; t++) {
                if (t < cnt) {
                    float xv[CE];
                    if (pre) {
                        const long o = (long)tok[t] * d + (long)c * CE;
                        moe_load_cg((norm ? src : x) + o, xv, CE);
                        if (norm)
#pragma unroll
                            for (int j = 0; j < CE; j++) xv[j] = act_round(x, xv[j] * rstd[t] * gain[c * CE + j]);
                    } else {
                        moe_act_load(x + (long)tok[t] * d + (long)c * CE, xv, CE);
                    }
#pragma unroll
                    for (int i = 0; i < R; i++) {
                        float wf[CE];
                        MoeChunk<WT>::cvt(rg[i], wf);
#pragma unroll
                        for (int j = 0; j < CE; j++) g[i][t] = fmaf(wf[j], xv[j], g[i][t]);
                        MoeChunk<WT>::cvt(ru[i], wf);
#pragma unroll
                        for (int j = 0; j < CE; j++) u[i][t] = fmaf(wf[j], xv[j], u[i][t]);
                    }
                }
            }
        }
#pragma unroll
        for (int i = 0; i < R; i++)
#pragma unroll
            for (int t = 0; t < N; t++) {
                if (t < cnt) {
                    const float a = warp_sum(g[i][t]), b = warp_sum(u[i][t]);
                    if (lane == 0) {
                        red[warp][(i * N + t) * 2] = a;
                        red[warp][(i * N + t) * 2 + 1] = b;
                    }
                }
            }
        __syncthreads();
        if (tid < R * N) {
            const int i = tid / N, t = tid % N;
            if (i < nr && t < cnt) {
                float a = 0.0f, b = 0.0f;
                for (int w = 0; w < (int)(blockDim.x >> 5); w++) {
                    a += red[w][tid * 2];
                    b += red[w][tid * 2 + 1];
                }
                act_store(hout, ((long)s * N + t) * inter + r0 + i, swiglu(a, b));
            }
        }
        __syncthreads();  // red is reused by the next chunk
    }
    di_trace_phase(shared_slot ? 0 : 1);
}

template <typename T, typename WT, int N>
__device__ void moe_down_dec_impl(T* out, T* res, const T* h, const u64* slot_ptr, const int* slot_cnt,
                                  const int* slot_tok, const float* slot_wt, const WT* sh_down, int n_routed,
                                  int n_shared, int n, int d, int inter, int early, const u8* pf0, long pf0_bytes,
                                  const u8* pf1, long pf1_bytes) {
    constexpr int R = MOED_R;
    constexpr int CE = MoeChunk<WT>::CE;
    __shared__ const WT* sp[MOED_MAXS + MOED_MAXSH];
    __shared__ long sld[MOED_MAXS + MOED_MAXSH];
    __shared__ int scnt[MOED_MAXS + MOED_MAXSH];
    __shared__ int shrow[MOED_MAXS + MOED_MAXSH];
    __shared__ int stok[MOED_MAXS + MOED_MAXSH][N];
    __shared__ float swt[MOED_MAXS + MOED_MAXSH][N];
    __shared__ float red[MOED_THREADS / 32][R * N];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int r0 = blockIdx.x * R;
    const int nr = min(R, d - r0);
    const int nch = inter / CE;
    const int iters = (nch + blockDim.x - 1) / blockDim.x;
    const long sh_ld = (long)n_shared * inter;
    pdl_launch_dependents();
    // The first shared slot's rows before the wait.
    uint4 cur[R], nxt[R];
#pragma unroll
    for (int i = 0; i < R; i++) cur[i] = nxt[i] = make_uint4(0, 0, 0, 0);
    if (n_shared > 0 && tid < nch) {
#pragma unroll
        for (int i = 0; i < R; i++)
            if (i < nr) cur[i] = ld_stream16(sh_down + (long)(r0 + i) * sh_ld + (long)tid * CE);
    }
    // early: every later step's rows are asked into L2 as soon as their addresses are known
    // (the shared slots' now, the routed ones' once the slot table is read), so the steps'
    // loads below find them there instead of each waiting for memory in turn
    if (early) {
        for (int k = 1; k < n_shared * iters; k++) {
            const int c = tid + (k % iters) * blockDim.x;
            if (c < nch)
                for (int i = 0; i < nr; i++)
                    moe_prefetch_l2(sh_down + (long)(r0 + i) * sh_ld + (long)(k / iters) * inter + (long)c * CE);
        }
    }
    pdl_wait();
    // Slot table: shared slots first, then the routed slots with tokens (slots [0, n_active)).
    for (int q = tid; q < n_shared; q += blockDim.x) {
        sp[q] = sh_down + (long)r0 * sh_ld + (long)q * inter;
        sld[q] = sh_ld;
        scnt[q] = n;
        shrow[q] = (n_routed + q) * N;
#pragma unroll
        for (int i = 0; i < N; i++) {
            stok[q][i] = i;
            swt[q][i] = 1.0f;
        }
    }
    // Routed slot tid (blockDim >= n_routed); those with tokens are [0, n_active).
    int c = 0;
    if (tid < n_routed) {
        const int s = tid, q = n_shared + s;
        c = slot_cnt[s];
        sp[q] = reinterpret_cast<const WT*>(slot_ptr[3 * s + 2]) + (long)r0 * inter;
        sld[q] = inter;
        scnt[q] = c;
        shrow[q] = s * N;
#pragma unroll
        for (int i = 0; i < N; i++) {
            stok[q][i] = slot_tok[s * MOED_MAXN + i];
            swt[q][i] = slot_wt[s * MOED_MAXN + i];
        }
    }
    const int n_active = __syncthreads_count(c > 0);
    di_trace_phase(0);
    const int S = n_shared + n_active;
    const int steps = S * iters;
    if (early) {
        for (int k = max(1, n_shared * iters); k < steps; k++) {
            const int q = k / iters;
            const int c = tid + (k % iters) * blockDim.x;
            if (c < nch)
                for (int i = 0; i < nr; i++) moe_prefetch_l2(sp[q] + (long)i * sld[q] + (long)c * CE);
        }
    }
    if (n_shared == 0 && steps > 0 && tid < nch) {
#pragma unroll
        for (int i = 0; i < R; i++)
            if (i < nr) cur[i] = ld_stream16(sp[0] + (long)i * sld[0] + (long)tid * CE);
    }
    float acc[R][N];
#pragma unroll
    for (int i = 0; i < R; i++)
#pragma unroll
        for (int t = 0; t < N; t++) acc[i][t] = 0.0f;
    for (int k = 0; k < steps; k++) {
        // next step's rows in flight while this one is used
        if (k + 1 < steps) {
            const int q = (k + 1) / iters;
            const int c = tid + ((k + 1) % iters) * blockDim.x;
            if (c < nch) {
#pragma unroll
                for (int i = 0; i < R; i++)
                    if (i < nr) nxt[i] = ld_stream16(sp[q] + (long)i * sld[q] + (long)c * CE);
            }
        }
        const int q = k / iters;
        const int c = tid + (k % iters) * blockDim.x;
        if (c < nch) {
            float wf[R][CE];
#pragma unroll
            for (int i = 0; i < R; i++) MoeChunk<WT>::cvt(cur[i], wf[i]);
            const int cnt = scnt[q];
#pragma unroll
            for (int a = 0; a < N; a++) {
                if (a < cnt) {
                    float hv[CE];
                    moe_act_load(h + (long)(shrow[q] + a) * inter + (long)c * CE, hv, CE);
                    const float w = swt[q][a];
                    const int tk = stok[q][a];
#pragma unroll
                    for (int i = 0; i < R; i++) {
                        float p = 0.0f;
#pragma unroll
                        for (int j = 0; j < CE; j++) p = fmaf(wf[i][j], hv[j], p);
#pragma unroll
                        for (int t = 0; t < N; t++)
                            if (t == tk) acc[i][t] = fmaf(w, p, acc[i][t]);
                    }
                }
            }
        }
#pragma unroll
        for (int i = 0; i < R; i++) cur[i] = nxt[i];
    }
    // The next kernel's weights (pf0, pf1: its two first segments) asked into L2, a slice a
    // block, once this block's own rows are in: the q/kv_a GEMV after a layer cannot be
    // resident (and start its copies) until this kernel's blocks leave.
    if (pf0 != nullptr) {
        const long l0 = (pf0_bytes + 127) >> 7, lines = l0 + ((pf1_bytes + 127) >> 7);
        const long a = lines * blockIdx.x / gridDim.x, b = lines * (blockIdx.x + 1) / gridDim.x;
        for (long l = a + tid; l < b; l += blockDim.x)
            moe_prefetch_l2(l < l0 ? pf0 + (l << 7) : pf1 + ((l - l0) << 7));
    }
#pragma unroll
    for (int i = 0; i < R; i++)
#pragma unroll
        for (int t = 0; t < N; t++) {
            if (t < n) {
                const float v = warp_sum(acc[i][t]);
                if (lane == 0) red[warp][i * N + t] = v;
            }
        }
    __syncthreads();
    if (tid < R * N) {
        const int i = tid / N, t = tid % N;
        if (i < nr && t < n) {
            float v = 0.0f;
            for (int w = 0; w < (int)(blockDim.x >> 5); w++) v += red[w][tid];
            const long o = (long)t * d + r0 + i;
            act_store(out, o, v);
            if (res != nullptr) act_store(res, o, act_load(res, o) + act_round(out, v));
        }
    }
    di_trace_phase(1);
}

#define MOE_DEC_WRAPPERS(T, S, WT, WS, N)                                                                            \
    extern "C" __global__ void __launch_bounds__(MOED_THREADS, N == 1 ? 4 : 1)                                       \
        moe_gu_dec_##WS##_n##N##_##S(T* hout, const T* x, const T* src, const float* gain, float eps,              \
                                     const u64* slot_ptr, const int* slot_cnt, const int* slot_tok,                 \
                                     const WT* sh_gate, const WT* sh_up, int n_routed, int n_shared, int n, int d,  \
                                     int inter, int early) {                                                         \
        moe_gu_dec_impl<T, WT, N>(hout, x, src, gain, eps, slot_ptr, slot_cnt, slot_tok, sh_gate, sh_up, n_routed,  \
                                  n_shared, n, d, inter, early);                                                     \
    }                                                                                                                \
    extern "C" __global__ void __launch_bounds__(MOED_THREADS)                                                       \
        moe_down_dec_##WS##_n##N##_##S(T* out, T* res, const T* h, const u64* slot_ptr, const int* slot_cnt,        \
                                       const int* slot_tok, const float* slot_wt, const WT* sh_down, int n_routed,  \
                                       int n_shared, int n, int d, int inter, int early, const u8* pf0,             \
                                       long pf0_bytes, const u8* pf1, long pf1_bytes) {                             \
        moe_down_dec_impl<T, WT, N>(out, res, h, slot_ptr, slot_cnt, slot_tok, slot_wt, sh_down, n_routed, n_shared, \
                                    n, d, inter, early, pf0, pf0_bytes, pf1, pf1_bytes);                             \
    }

// The routing kernels' parameters (one list: the host passes the same arguments to each).
#define MOE_ROUTE_PARAMS(T)                                                                                          \
    float *logits, unsigned *counter, u64 *slot_ptr, int *slot_cnt, int *slot_tok, float *slot_wt,                   \
        unsigned long long *totals, unsigned *last, T *h, const T *x, const float *gain, float eps, const u8 *gate,   \
        int gate_wt, long gate_row_bytes, const float *bias, const u64 *ptrs, int d, int E, int K, int n, int score, \
        int n_group, int topk_group, int norm, float scaling, int n_slots, int early

// The cluster routing (moe_route_decc_n<N>): blocks of MOED_EPBC experts, one cluster.
#define MOED_EPBC 8
#define MOE_ROUTE_CL(T, S, N)                                                                                        \
    extern "C" __global__ void __launch_bounds__(MOED_THREADS) moe_route_decc_n##N##_##S(                            \
        MOE_ROUTE_PARAMS(T)) {                                                                                       \
        moe_route_dec_impl<T, MOED_EPBC, N, true>(logits, counter, slot_ptr, slot_cnt, slot_tok, slot_wt, totals,    \
                                                  last, h, x, gain, eps, gate, gate_wt, gate_row_bytes, bias, ptrs, \
                                                  d, E, K, n, score, n_group, topk_group, norm, scaling, n_slots,   \
                                                  early);                                                            \
    }

// The routing of one token (`moe_route1c`): one cluster of blocks of MOED_EPBC experts, up
// to 64 experts, rows of at most 8 x 256 values, no group limit, top k <= 32. The same sums
// in the same order as moe_route_dec_impl, in fewer steps: every block normalizes its copy of
// the token (one chunk a thread) and writes its share of the normalized row, stores its
// experts' logits straight into block 0's shared memory, and after one cluster barrier
// block 0's first warp scores two experts a lane and takes the top k by k rounds of a warp
// max (redux.sync); then each of the first E threads writes its expert's counters and, when
// picked, its slot. What the table needs and no kernel writes (weights, gains, bias, the
// experts' addresses) is loaded before the programmatic wait.
__device__ __forceinline__ u32 moe_redux_max(u32 v) {
    u32 r;
    asm volatile("redux.sync.max.u32 %0, %1, 0xffffffff;" : "=r"(r) : "r"(v));
    return r;
}
__device__ __forceinline__ u32 moe_redux_min(u32 v) {
    u32 r;
    asm volatile("redux.sync.min.u32 %0, %1, 0xffffffff;" : "=r"(r) : "r"(v));
    return r;
}
// A float's order as an unsigned key (NaN as -inf); 0 is below every float's key.
__device__ __forceinline__ u32 moe_key(float v) {
    if (v != v) v = NEG_INF;
    const u32 b = __float_as_uint(v);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

// Warp 0's pick of one token's K experts from its E <= 64 logits (v0: expert lane's, v1:
// expert lane + 32's; b0, b1 their correction biases, which count for the choice only): scores,
// top k by k rounds of a warp max (redux.sync), weights normalized when `norm`, then scaled;
// the experts' ids into cid[0, K), their weights into cw.
__device__ __forceinline__ void moe_pick1(float v0, float v1, float b0, float b1, int E, int K, int score, int norm,
                                          float scaling, int* cid, float* cw) {
    const int lane = threadIdx.x & 31;
    const bool ok0 = lane < E, ok1 = lane + 32 < E;
    if (score == SCORE_SOFTMAX) {
        float mx = NEG_INF;
        if (ok0) mx = fmaxf(mx, v0);
        if (ok1) mx = fmaxf(mx, v1);
        mx = warp_max(mx);
        float sum = 0.0f;
        if (ok0) sum += expf(v0 - mx);
        if (ok1) sum += expf(v1 - mx);
        sum = warp_sum(sum);
        v0 = expf(v0 - mx) / sum;
        v1 = expf(v1 - mx) / sum;
    } else {
        v0 = moe_score(score, v0);
        v1 = moe_score(score, v1);
    }
    u32 k0 = ok0 ? moe_key(v0 + b0) : 0u, k1 = ok1 ? moe_key(v1 + b1) : 0u;
    int my_id = 0;
    float my_w = 0.0f;
    for (int j = 0; j < K; j++) {
        const u32 m = moe_redux_max(max(k0, k1));
        const u32 win = moe_redux_min(k0 == m ? (u32)lane : k1 == m ? (u32)lane + 32u : 0xffffffffu);
        const float w = __shfl_sync(0xffffffffu, win < 32u ? v0 : v1, (int)(win & 31u));
        if (win == (u32)lane) k0 = 0u;
        if (win == (u32)lane + 32u) k1 = 0u;
        if (lane == j) {
            my_id = (int)win;
            my_w = w;
        }
    }
    float sum = 0.0f;
    for (int j = 0; j < K; j++) sum += __shfl_sync(0xffffffffu, my_w, j);
    if (norm) my_w /= sum + 1e-20f;
    if (lane < K) {
        cid[lane] = my_id;
        cw[lane] = my_w * scaling;
    }
}

// Whether expert e is among the K picked (cid, cw from moe_pick1): 1 with its slot s (the
// picked experts in id order) and weight w, else 0.
__device__ __forceinline__ int moe_picked(const int* cid, const float* cw, int K, int e, int& s, float& w) {
    int c = 0;
    s = 0;
    w = 0.0f;
    for (int j = 0; j < K; j++) {
        const int id = cid[j];
        s += id < e;
        if (id == e) {
            c = 1;
            w = cw[j];
        }
    }
    return c;
}

// One token's routing prologue as moe_route1c and moe_ffn1 take it (256 threads, chunk tid of
// the row a thread). Before the programmatic wait, what no kernel writes: thread tid's 8 norm
// gains, expert tid's weight addresses, in warp 0 the correction biases of experts lane and
// lane + 32. After it, chunk tid of x normalized when `gain` is given (the RMSNorm folded in:
// the 8 warps' sums through red[w * rs], `bar` the barrier of the 256 threads), rounded as the
// activations store it, block b of the grid writing the chunks tid = b (mod grid) of `h`.
struct MoeTok1 {
    float g8[8];
    u64 ptr[3];
    float b0, b1;
};
__device__ __forceinline__ void moe_tok1_pre(MoeTok1& t, const float* gain, const u64* ptrs, const float* bias, int E,
                                             bool mine) {
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
#pragma unroll
    for (int j = 0; j < 8; j++) t.g8[j] = gain != nullptr && mine ? gain[tid * 8 + j] : 0.0f;
    t.ptr[0] = t.ptr[1] = t.ptr[2] = 0;
    if (tid < E) {
        t.ptr[0] = ptrs[tid];
        t.ptr[1] = ptrs[E + tid];
        t.ptr[2] = ptrs[2 * E + tid];
    }
    t.b0 = t.b1 = 0.0f;
    if (warp == 0 && bias != nullptr) {
        if (lane < E) t.b0 = bias[lane];
        if (lane + 32 < E) t.b1 = bias[lane + 32];
    }
}
template <typename T, typename Bar>
__device__ __forceinline__ void moe_tok1_norm(float (&xv)[8], const MoeTok1& t, const T* x, T* h, const float* gain,
                                              float eps, int d, bool mine, float* red, int rs, Bar bar,
                                              bool cg = false) {
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
#pragma unroll
    for (int j = 0; j < 8; j++) xv[j] = 0.0f;
    if (mine) {
        if (cg)
            act_load8_cg(x + (long)tid * 8, xv);
        else
            act_load8(x + (long)tid * 8, xv);
    }
    if (gain == nullptr) return;
    float ss = 0.0f;
#pragma unroll
    for (int j = 0; j < 8; j++) ss = fmaf(xv[j], xv[j], ss);
    ss = warp_sum(ss);
    if (lane == 0) red[warp * rs] = ss;
    bar();
    float sum = 0.0f;
    for (int w = 0; w < 8; w++) sum += red[w * rs];
    const float rstd = 1.0f / sqrtf(sum / (float)d + eps);
#pragma unroll
    for (int j = 0; j < 8; j++) xv[j] = act_round(x, xv[j] * rstd * t.g8[j]);
    // this block's share of the normalized row, as the RMSNorm kernel writes it
    if (mine && tid % gridDim.x == blockIdx.x)
#pragma unroll
        for (int j = 0; j < 8; j++) act_store(h, (long)tid * 8 + j, xv[j]);
    bar();  // red is reused
}

template <typename T>
__device__ void moe_route1_impl(u64* slot_ptr, int* slot_cnt, int* slot_tok, float* slot_wt,
                                unsigned long long* totals, unsigned* last, T* h, const T* x, const float* gain,
                                float eps, const u8* gate, int gate_wt, long gate_row_bytes, const float* bias,
                                const u64* ptrs, int d, int E, int K, int score, int norm, float scaling,
                                int n_slots) {
    __shared__ float lg[64];
    __shared__ float red[MOED_THREADS / 32][MOED_EPBC];
    __shared__ int cid[32];
    __shared__ float cw[32];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int e0 = blockIdx.x * MOED_EPBC, ne = min(MOED_EPBC, E - e0), nch = d >> 3;
    const bool mine = tid < nch;
    uint4 graw[MOED_EPBC][2];
    moe_gate_first<MOED_EPBC>(graw, gate, gate_wt, gate_row_bytes, e0, ne, mine);
    MoeTok1 t;
    moe_tok1_pre(t, gain, ptrs, bias, E, mine);
    pdl_wait();
    pdl_launch_dependents();
    const unsigned long long my_total = tid < E ? totals[tid] : 0ull;
    float xv[8];
    moe_tok1_norm(xv, t, x, h, gain, eps, d, mine, &red[0][0], MOED_EPBC, [] { __syncthreads(); });
    di_trace_phase(0);
    float acc[MOED_EPBC];
#pragma unroll
    for (int i = 0; i < MOED_EPBC; i++) {
        acc[i] = 0.0f;
        if (i < ne && mine) {
            float wv[8];
            moe_gate_cvt(gate_wt, graw[i], wv);
#pragma unroll
            for (int j = 0; j < 8; j++) acc[i] = fmaf(xv[j], wv[j], acc[i]);
        }
    }
#pragma unroll
    for (int i = 0; i < MOED_EPBC; i++) {
        const float v = warp_sum(acc[i]);
        if (lane == 0) red[warp][i] = v;
    }
    __syncthreads();
    if (tid < ne) {
        float v = 0.0f;
        for (int w = 0; w < MOED_THREADS / 32; w++) v += red[w][tid];
        // into block 0's logits
        const u32 a = cluster_addr((u32)__cvta_generic_to_shared(&lg[e0 + tid]), 0);
        asm volatile("st.shared::cluster.f32 [%0], %1;" ::"r"(a), "f"(v) : "memory");
    }
    di_trace_phase(1);
    cluster_sync();
    if (blockIdx.x != 0) return;
    di_trace_phase(2);
    if (warp == 0)
        moe_pick1(lane < E ? lg[lane] : 0.0f, lane + 32 < E ? lg[lane + 32] : 0.0f, t.b0, t.b1, E, K, score, norm,
                  scaling, cid, cw);
    __syncthreads();
    di_trace_phase(3);
    if (tid < E) {
        int s;
        float w;
        const int c = moe_picked(cid, cw, K, tid, s, w);
        last[tid] = (unsigned)c;
        totals[tid] = my_total + (unsigned long long)c;
        if (c) {
            slot_ptr[3 * s] = t.ptr[0];
            slot_ptr[3 * s + 1] = t.ptr[1];
            slot_ptr[3 * s + 2] = t.ptr[2];
            slot_cnt[s] = 1;
            slot_tok[s * MOED_MAXN] = 0;
            slot_wt[s * MOED_MAXN] = w;
        }
    }
    for (int q = K + tid; q < n_slots; q += blockDim.x) slot_cnt[q] = 0;
    di_trace_phase(4);
}

#define MOE_ROUTE1(T, S)                                                                                             \
    extern "C" __global__ void __launch_bounds__(MOED_THREADS) moe_route1c_##S(                                      \
        MOE_ROUTE_PARAMS(T)) {                                                                                       \
        moe_route1_impl<T>(slot_ptr, slot_cnt, slot_tok, slot_wt, totals, last, h, x, gain, eps, gate, gate_wt,      \
                           gate_row_bytes, bias, ptrs, d, E, K, score, norm, scaling, n_slots);                      \
    }

// ---- One token's MoE layer in one persistent launch (moe_ffn1) ----
//
// The routing, the experts' gate/up products and their down products of a one-token step
// (bf16 weights and activations) in one launch of a block an SM, every block resident at once
// (the host checks), so the phases meet at grid-wide counters instead of kernel boundaries
// and the weights never stop streaming: each of a block's eight warps owns a ring of
// shared-memory pages and copies its own units of weights into them (a bulk copy and the
// lanes' copies, completing on the page's mbarrier: "How a warp fills its pages" below),
// asking for its next unit into the page it has just used, so a warp's copies never wait
// behind another warp's work:
//   1. (before the programmatic wait) each warp asks for its first units that are shared
//      experts' gate/up rows, which need no routing, and loads its block's router row;
//   2. every block normalizes the token (the RMSNorm before the layer, when folded in) and
//      block e < E computes expert e's logit; once all E are counted (cnt[0]) each block picks
//      the top k itself (moe_pick1, the sums and order of moe_route1c, so the same experts),
//      then each warp fills the rest of its ring;
//   3. gate/up: a unit is one row pair (gate row r and up row r of one slot); the warp's dot
//      products go into act[slot, r] = silu(g) * u, with the sums in moe_gu_dec's order;
//   4. once every block's gate/up units are counted (cnt[1]), each block copies act into
//      shared memory and takes output rows [2 p, 2 p + 2) for its row pairs p, a unit being
//      one slot's two down rows, shared slots first: out[r] = sum_slots w * (down[r] . act),
//      in moe_down_dec's order, and res[r] += out[r] when asked (the warps' first down units
//      are already copied while the grid meets);
//   5. when the host folded in the product after the layer (`moe::fold_next_norm_gemv`: the
//      next layer's RMSNorm of `res` and its q / kv_a rows), each warp's last units are that
//      product's rows, two a unit, copied into its pages as its down units leave them; once
//      every block's residual rows are counted (cnt[3]) each block normalizes `res` and takes
//      its rows [q0, q0 + nq) of the product;
//   0. when the host folded in the product before the layer (`moe::fold_prev_acc_gemv`: the
//      attention's o rows and their residual add, as gemvp's ACC blocks compute them), each
//      warp's first units are that product's rows, two a unit, copied before the wait; after
//      it each block stages the product's input, takes its rows [o0, o0 + no), adds them into
//      the residual stream and counts them (cnt[4]): the routing's norm reads the stream once
//      all are counted;
//   6. the last block out leaves the counters zeroed (cnt[2] counts the blocks past their
//      last wait).
// Slots: the picked experts in id order [0, K), then the shared experts' `inter`-row slots.
#define MOEF_WARPS 8                          // warps, each with its ring of pages
#define MOEF_THREADS (32 * MOEF_WARPS)
#define MOEF_MAXP 32                          // most ring pages (a multiple of MOEF_WARPS)
#define MOEF_MAXJ 8                           // 16-byte chunks a lane of a hidden row (<= 2048)
#define MOEF_MAXIJ 8                          // ... of an expert row (inter <= 2048)
#define MOEF_MAXS 48                          // most slots (top k <= 32, 16 shared)

// A lane's chunks lane + 32 j of a row of `nch` 8-value chunks staged in `hs` (zero past it).
__device__ __forceinline__ void moef_lane_row(float (&hr)[MOEF_MAXJ][8], const float* hs, int nch) {
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int j = 0; j < MOEF_MAXJ; j++) {
        const int c = lane + 32 * j;
#pragma unroll
        for (int k = 0; k < 8; k++) hr[j][k] = c < nch ? hs[c * 8 + k] : 0.0f;
    }
}

// A lane's partial dot products of a gate row `wg` and an up row `wu` (staged bf16) with the
// row it holds in `hr`: chunk lane + 32 j of each into a[j], e[j].
__device__ __forceinline__ void moef_gu_partials(float (&a)[MOEF_MAXJ], float (&e)[MOEF_MAXJ], const bf16_t* wg,
                                                 const bf16_t* wu, const float (&hr)[MOEF_MAXJ][8], int nch) {
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int j = 0; j < MOEF_MAXJ; j++) {
        const int c = lane + 32 * j;
        a[j] = e[j] = 0.0f;
        if (c < nch) {
            float wf[8];
            bf16x8_to_f32(*reinterpret_cast<const uint4*>(wg + c * 8), wf);
#pragma unroll
            for (int k = 0; k < 8; k++) a[j] = fmaf(wf[k], hr[j][k], a[j]);
            bf16x8_to_f32(*reinterpret_cast<const uint4*>(wu + c * 8), wf);
#pragma unroll
            for (int k = 0; k < 8; k++) e[j] = fmaf(wf[k], hr[j][k], e[j]);
        }
    }
}

// The routing of a one-token launch of a block an SM (moe_ffn1, moe_fk1), after the
// programmatic wait: every block normalizes the token into `hs` (block b writing its share of
// `hn`; `cg`: the stream read past L1, another block of the grid wrote it), a block whose
// `eb` < E (block b: expert b) stores expert eb's logit in `logits` and counts it in cnt[0],
// `between()` runs while the other blocks' logits come in, then every block picks the top k
// itself (moe_pick1: moe_route1c's sums and order, so the same experts) into `sel` (the picked experts' gate, up and down addresses from `ptrs`'
// three tables) and `selw` (their weights); block 0 keeps the load counters.
template <typename F>
__device__ __forceinline__ void moef_route(const MoeTok1& t, const uint4 (&graw)[1][2], const bf16_t* src,
                                           bf16_t* hn, const float* gain, float eps, int gate_wt, float* logits,
                                           u32* cnt, unsigned long long* totals, unsigned* last, int d, int E, int K,
                                           int score, int norm, float scaling, bool cg, float* hs, float* red,
                                           int* cid, float* cw, u64 (*sel)[3], float* selw, int eb, F between) {
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, b = blockIdx.x;
    const bool mine = tid < (d >> 3);
    const unsigned long long my_total = b == 0 && tid < E ? totals[tid] : 0ull;
    float xv[8];
    moe_tok1_norm(xv, t, src, hn, gain, eps, d, mine, red, 1, [] { __syncthreads(); }, cg);
    if (mine) {
        *reinterpret_cast<float4*>(&hs[tid * 8]) = make_float4(xv[0], xv[1], xv[2], xv[3]);
        *reinterpret_cast<float4*>(&hs[tid * 8 + 4]) = make_float4(xv[4], xv[5], xv[6], xv[7]);
    }
    if (eb < E) {
        float acc = 0.0f;
        if (mine) {
            float wv[8];
            moe_gate_cvt(gate_wt, graw[0], wv);
#pragma unroll
            for (int j = 0; j < 8; j++) acc = fmaf(xv[j], wv[j], acc);
        }
        acc = warp_sum(acc);
        if (lane == 0) red[warp] = acc;
    }
    __syncthreads();
    if (eb < E && tid == 0) {
        float v = 0.0f;
        for (int w = 0; w < MOEF_WARPS; w++) v += red[w];
        logits[eb] = v;
        __threadfence();
        atomicAdd(&cnt[0], 1u);
    }
    di_trace_phase(0);
    between();
    if (tid == 0) wait_count(&cnt[0], (u32)E);
    __syncthreads();
    if (warp == 0) {
        const float v0 = lane < E ? __ldcg(logits + lane) : 0.0f, v1 = lane + 32 < E ? __ldcg(logits + lane + 32) : 0.0f;
        moe_pick1(v0, v1, t.b0, t.b1, E, K, score, norm, scaling, cid, cw);
    }
    __syncthreads();
    if (tid < E) {
        int s;
        float w;
        const int c = moe_picked(cid, cw, K, tid, s, w);
        if (c) {
            sel[s][0] = t.ptr[0];
            sel[s][1] = t.ptr[1];
            sel[s][2] = t.ptr[2];
            selw[s] = w;
        }
        if (b == 0) {
            last[tid] = (unsigned)c;
            totals[tid] = my_total + (unsigned long long)c;
        }
    }
}

// What the last block out of a moe_ffn1 / moe_fk1 launch leaves for the next one: its `n`
// counters zeroed.
__device__ __forceinline__ void moef_reset(u32* cnt, int n) {
    for (int i = 0; i < n; i++) cnt[i] = 0;
}

// Before the programmatic wait a block of moe_ffn1 / moe_fk1 asks for its warps' first ring
// pages (up to 192 KB), then loads what the routing reads (router row eb when eb < E, the
// norm's gains, the expert addresses, the bias). (Those loads first measured no faster,
// session 26.)
__device__ __forceinline__ void moef_route_loads(uint4 (&graw)[1][2], MoeTok1& t, const u8* gate, int gate_wt,
                                                 long gate_row_bytes, const float* gain, const u64* ptrs,
                                                 const float* bias, int E, bool mine, int eb) {
    moe_gate_first<1>(graw, gate, gate_wt, gate_row_bytes, eb, eb < E ? 1 : 0, mine);
    moe_tok1_pre(t, gain, ptrs, bias, E, mine);
}

// How a warp fills its pages (session 29): a gate/up unit's gate row and a down unit's first
// row by a bulk copy (lane 0, the copy engine), the unit's second row by the warp's lanes,
// 16-byte `cp.async` copies (the load path), both completing on the page's barrier: every lane
// takes part in asking for each unit and arrives on its page's barrier
// (`cp.async.mbarrier.arrive.noinc`: once its earlier copies have landed), lane 0 last, with
// the bulk bytes to wait for (33 arrivals a phase). 1.013x on the Moonlight step against every
// row by bulk copies (H100, doc/benchmarks.md, session 29), though a bare ring of bulk copies
// streams as fast as one of the lanes' copies (`deepinfer bench stream`). The values are the
// same either way (both rows by the lanes measured between the two and was dropped). For
// measuring, MOEF_X_BULK builds every row by bulk copies (lane 0 alone asking, one arrival a
// phase; the kernel before session 29).
#ifdef MOEF_X_BULK
#define MOEF_LANES false
#define MOEF_ISSUER (lane == 0)
#define MOEF_ARRIVALS 1
#else
#define MOEF_LANES true
#define MOEF_ISSUER true
#define MOEF_ARRIVALS 33
#endif
// The routing's logits by the first blocks to arrive (session 32): block b computes the logit
// of the expert numbered by its arrival (an atomic ticket, cnt[5], before the programmatic
// wait) instead of expert b, so the routing waits on the first E blocks to become resident
// (some start only as the launches before leave their SMs, ~2.4 us of spread at the wait on
// an H100) whatever their numbers; the values and the pick are the same. One H200, alternated:
// 2.1205 against 2.149 ms a step (medians of 5 processes each, every one faster),
// doc/benchmarks.md. MOEF_X_NUMBERED builds the logits by block number, as before.
#ifdef MOEF_X_NUMBERED
#define MOEF_TICKET false
#else
#define MOEF_TICKET true
#endif
#define MOEF_COUNTERS 6

// The end of a block (session 29): its arrival counted (cnt[2]) right after its last wait and
// its down rows' residual values loaded before their units, so its last warps wait for no
// round trip; MOEF_X_LATE_END builds the end as before.
#ifdef MOEF_X_LATE_END
#define MOEF_EARLY_END false
#else
#define MOEF_EARLY_END true
#endif

// Asks L2 for share s of N of two (address, bytes) ranges of the next launch's weights: of
// each range's n whole 4 KB pieces, pieces [n s / N, n (s + 1) / N), the caller's thread taking
// pieces first, first + step, ... moe_ffn1 and moe_fk1.
__device__ __forceinline__ void moe_ask_share_l2(const u8* const (&p)[2], const long (&bytes)[2], long s, long N,
                                                 int first, int step) {
#pragma unroll
    for (int k = 0; k < 2; k++) {
        const long n = bytes[k] >> 12, p1 = n * (s + 1) / N;
        for (long q = n * s / N + first; q < p1; q += step) prefetch_l2_bulk(p[k] + (q << 12), 4096);
    }
}

extern "C" __global__ void __launch_bounds__(MOEF_THREADS, 1) moe_ffn1_bf16(
    bf16_t* out, bf16_t* res, bf16_t* hn, const bf16_t* src, const float* gain, float eps, bf16_t* act,
    float* logits, u32* cnt, unsigned long long* totals, unsigned* last, const u8* gate, int gate_wt,
    long gate_row_bytes, const float* bias, const u64* ptrs, const bf16_t* sh_gate, const bf16_t* sh_up,
    const bf16_t* sh_down, int d, int E, int K, int n_shared, int inter, int score, int norm, float scaling, int np,
    int page, const u8* qw0, const u8* qw1, const u8* qw2, bf16_t* qy0, bf16_t* qy1, bf16_t* qy2, int qm0, int qm1,
    int qm2, const float* qg, float qeps, bf16_t* qh, const u8* ow, const bf16_t* oa, bf16_t* oy, bf16_t* ores,
    int om, int ok, int l2f, const u8* nl2_0, long nl2_bytes0, const u8* nl2_1, long nl2_bytes1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    extern __shared__ __align__(128) u8 moef_smem[];
    __shared__ __align__(8) u64 bars[MOEF_MAXP];
    __shared__ __align__(16) float hs[MOEF_MAXJ * 256];
    __shared__ float red[MOEF_WARPS];
    __shared__ int cid[32];
    __shared__ float cw[32];
    __shared__ u64 sel[32][3];
    __shared__ float selw[32];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int G = gridDim.x, b = blockIdx.x, S = K + n_shared;
    const u32 ring = (u32)__cvta_generic_to_shared(moef_smem);
    const u32 full0 = (u32)__cvta_generic_to_shared(bars);
    // Warp w owns pages [w ppw, (w + 1) ppw) and takes its units in order, its i-th in page
    // w ppw + i % ppw: a page's barrier is then never more than one phase apart from what its
    // one reader waits for (a ring shared by warps that take units out of order would let a
    // warp far ahead see an old phase of the same parity as done).
    const int ppw = np / MOEF_WARPS;
    bf16_t* acts = reinterpret_cast<bf16_t*>(moef_smem + (long)np * page);
    // this block's units: shared and routed gate/up row pairs, then its down row pairs by slot
    const long ush = (long)n_shared * inter, urt = (long)K * inter;
    const long sh0 = ush * b / G, nsh = ush * (b + 1) / G - sh0;
    const long rt0 = urt * b / G, nrt = urt * (b + 1) / G - rt0;
    const int rp0 = (d / 2) * b / G, nrp = (d / 2) * (b + 1) / G - rp0;
    const int ngu = (int)(nsh + nrt);
    // of n units dealt to the warps in turn (unit u to warp u % 8), how many warp w takes
    auto share = [&](int n, int w) { return n > w ? (n - w + MOEF_WARPS - 1) / MOEF_WARPS : 0; };
    // the product before the layer (step 0): this block's rows, two a unit; a warp's first units
    const int o0 = (int)((long)om * b / G), no = (int)((long)om * (b + 1) / G) - o0;
    const int nou = (no + 1) / 2;
    const int my_no = share(nou, warp);
    // the next product's rows of this block (step 5), two a unit
    const int qrows = qm0 + qm1 + qm2;
    const int q0 = (int)((long)qrows * b / G), nq = (int)((long)qrows * (b + 1) / G) - q0;
    const int nqu = (nq + 1) / 2;
    // row g of the next product: its weight row and where its value goes
    auto qrow = [&](int g, const u8*& w, bf16_t*& y, int& r) {
        if (g < qm0) {
            w = qw0; y = qy0; r = g;
        } else if (g < qm0 + qm1) {
            w = qw1; y = qy1; r = g - qm0;
        } else {
            w = qw2; y = qy2; r = g - qm0 - qm1;
        }
        w += (long)r * d * 2;
    };
    // gate/up unit u goes to warp u % 8 (its (u / 8)-th); down row pair p to warp p % 8, whose
    // units carry on from its gate/up ones
    if (tid == 0) {
        for (int p = 0; p < np; p++) mbar_init(full0 + 8 * p, MOEF_ARRIVALS);
        mbar_init_fence();
    }
    __syncthreads();
    // Each warp copies its own units: its lane 0 asks for unit i + ppw into the page unit i
    // leaves, so no warp's copies wait behind another's and nothing polls. (A producer warp
    // serving the eight rings in one order was slower: 2.33-2.38 ms a step against 2.15.)
    const int my_ng = share(ngu, warp);
    const int my_gd = my_ng + S * share(nrp, warp);
    const int my_units = my_no + my_gd + share(nqu, warp);
    int issued = 0;
    // page pg filled with `bytes` from p0 and, when `two`, as many from p1 after them (the
    // warp's reads of the page's last unit before the copy's writes); `lanes`: p1's bytes by
    // the lanes' copies
    auto fill = [&](int pg, const void* p0, const void* p1, bool two, u32 bytes, bool lanes) {
        const u32 dst = ring + (u32)(pg * page), bar = full0 + 8 * pg;
        if (!MOEF_LANES) {
            page_fill(dst, bar, bytes, two ? 2 : 1, p0, p1);
            return;
        }
        u8* pb = moef_smem + (long)pg * page;
        if (lanes)
            for (u32 o = 16u * lane; o < bytes; o += 16u * 32u)
                cp_async16_w(pb + bytes + o, reinterpret_cast<const u8*>(p1) + o, true);
        mbar_arrive_cp_async(bar);
        __syncwarp();
        if (lane == 0) page_fill(dst, bar, bytes, lanes || !two ? 1 : 2, p0, p1);
    };
    // this warp's ia-th unit into its page (every lane; lane 0 alone with MOEF_X_BULK; units reading
    // the picked experts only once the routing is done): ia counts from the product before the
    // layer's units, i after them
    auto issue = [&](int ia) {
        const int pg = warp * ppw + ia % ppw;
        if (ia < my_no) {
            // rows 2 t and 2 t + 1 of this block's share of the product before the layer
            const int t = warp + MOEF_WARPS * ia, g = o0 + 2 * t;
            const long ob = (long)ok * 2;
            fill(pg, ow + g * ob, ow + (g + 1) * ob, 2 * t + 1 < no, (u32)ob, false);
            return;
        }
        const int i = ia - my_no;
        const int u = warp + MOEF_WARPS * i, q = (i - my_ng) % S;
        const bf16_t *p0, *p1;
        u32 bytes = (u32)d * 2;
        if (i >= my_gd) {
            // the next product's rows 2 t and 2 t + 1 of this block (the second may not be)
            const int t = warp + MOEF_WARPS * (i - my_gd), g = q0 + 2 * t;
            const u8 *w0, *w1 = nullptr;
            bf16_t* y;
            int r;
            qrow(g, w0, y, r);
            const bool two = 2 * t + 1 < nq;
            if (two) qrow(g + 1, w1, y, r);
            fill(pg, w0, w1, two, bytes, false);
            return;
        }
        if (i < my_ng && u < nsh) {
            p0 = sh_gate + (sh0 + u) * d;
            p1 = sh_up + (sh0 + u) * d;
        } else if (i < my_ng) {
            // (32-bit: a lane alone runs this once a unit, where a 64-bit division is ~100
            // instructions)
            const int j = (int)(rt0 + (u - nsh)), s = j / inter, r = j % inter;
            p0 = reinterpret_cast<const bf16_t*>(sel[s][0]) + (long)r * d;
            p1 = reinterpret_cast<const bf16_t*>(sel[s][1]) + (long)r * d;
        } else {
            const long r = 2L * (rp0 + (i - my_ng) / S * MOEF_WARPS + warp);
            p0 = q < n_shared ? sh_down + r * ush + (long)q * inter
                              : reinterpret_cast<const bf16_t*>(sel[q - n_shared][2]) + r * inter;
            p1 = p0 + (q < n_shared ? ush : inter);
            bytes = (u32)inter * 2;
        }
        fill(pg, p0, p1, true, bytes, true);
    };
    // whether the warp's ia-th unit reads no picked expert (the product before the layer, a
    // shared expert's gate/up rows), so it may be asked for before the routing is done
    auto early = [&](int ia) {
        return ia < my_no || (ia < my_no + my_ng && warp + MOEF_WARPS * (ia - my_no) < nsh);
    };
    // before the wait: the warp's units of the product before the layer, then its first that
    // are shared experts' gate/up rows, and the routing's loads (the routing: a chunk of the
    // row a thread, as moe_route1c)
    const int nch = d >> 3, ich = inter >> 3;
    const bool mine = tid < nch;
    uint4 graw[1][2];
    MoeTok1 t;
    if (MOEF_ISSUER)
        while (issued < ppw && early(issued)) issue(issued++);
    // the expert whose logit this block computes: with MOEF_TICKET the block's place among the
    // grid's blocks in the order they got here (cnt[5]), so the E logits come from the first E
    // blocks resident
    __shared__ int ticket;
    if (MOEF_TICKET) {
        if (tid == 0) ticket = (int)atomicAdd(&cnt[5], 1u);
        __syncthreads();
    }
    const int eb = MOEF_TICKET ? ticket : b;
    moef_route_loads(graw, t, gate, gate_wt, gate_row_bytes, gain, ptrs, bias, E, mine, eb);
    pdl_wait();
    if (om > 0) {
        // 0. the product before the layer (gemvp's ACC sums in their order): its input staged
        // as floats, a warp's row pair from its page, the rows added into the stream
        stage_row<false>([&](int c, float* v) { act_load8(oa + (long)c * 8, v); }, nullptr, hs, ok >> 3);
        __syncthreads();
        for (int tt = warp; tt < nou; tt += MOEF_WARPS) {
            const int ia = (tt - warp) / MOEF_WARPS, pg = warp * ppw + ia % ppw;
            mbar_wait(full0 + 8 * pg, (u32)((ia / ppw) & 1));
            float acc[2] = {0.0f, 0.0f};
#pragma unroll
            for (int rr = 0; rr < 2; rr++) {
                if (2 * tt + rr >= no) break;
                const uint4* wrow = reinterpret_cast<const uint4*>(moef_smem + (long)pg * page + (long)rr * ok * 2);
                acc[rr] = warp_sum(staged_dot(wrow, hs, ok >> 3, lane));
            }
            __syncwarp();
            // the page it leaves takes the next unit unless that one waits for the routing
            if (MOEF_ISSUER && issued < my_units && early(issued)) issue(issued++);
            if (lane == 0)
                for (int rr = 0; rr < 2 && 2 * tt + rr < no; rr++) {
                    const long r = o0 + 2 * tt + rr;
                    const float rv = act_load_cg(ores, r);
                    act_store(oy, r, acc[rr]);
                    act_store(ores, r, rv + act_round(oy, acc[rr]));
                }
        }
        // every block's rows in the stream before the norm reads it
        __syncthreads();
        if (tid == 0) grid_arrive_wait(&cnt[4], (u32)G);
        __syncthreads();
        di_trace_phase(7);
    }
    // this lane's chunks of the normalized row (chunk lane + 32 j)
    float hr[MOEF_MAXJ][8];
    // While the grid waits for the logits the memory idles (the ring is full): the last warp
    // asks L2 for this block's down rows of the shared experts, 4 KB a lane (`l2f`: 0 not at
    // all, 1 as any line, 2 evict_last, kept before the evict-first weight streams)
    auto ask_l2 = [&] {
        if (l2f == 0 || warp != MOEF_WARPS - 1) return;
        const u8* p = reinterpret_cast<const u8*>(sh_down + 2L * rp0 * ush);
        const long n = 2L * nrp * ush * 2;
        for (long o = (long)lane << 12; o < n; o += 32L << 12) {
            prefetch_l2_bulk(p + o, (unsigned)min(4096L, n - o), l2f == 2);
        }
    };
    moef_route(t, graw, src, hn, gain, eps, gate_wt, logits, cnt, totals, last, d, E, K, score, norm, scaling, om > 0,
               hs, red, cid, cw, sel, selw, eb, [&] {
                   moef_lane_row(hr, hs, nch);
                   ask_l2();
               });
    __syncthreads();
    di_trace_phase(1);
    // the pages left free: the warp has read its units of the product before the layer
    if (MOEF_ISSUER)
        while (issued < my_no + ppw && issued < my_units) issue(issued++);
    // gate/up: unit u by warp u % 8
    for (int u = warp; u < ngu; u += MOEF_WARPS) {
        const int i = my_no + u / MOEF_WARPS, pg = warp * ppw + i % ppw;
        mbar_wait(full0 + 8 * pg, (u32)((i / ppw) & 1));
        const bf16_t* wg = reinterpret_cast<const bf16_t*>(moef_smem + (long)pg * page);
        const bf16_t* wu = wg + d;
        // the 16 partial sums first, then their butterflies side by side (warp_sum's order):
        // independent chains, where one sum after another would leave the warp waiting
        float a[MOEF_MAXJ], e[MOEF_MAXJ];
#ifdef DI_X_NOCOMPUTE
        // Timing experiment only (wrong values): the rings stream without the sums, so a
        // trace's phases show what the copies alone take
        for (int j = 0; j < MOEF_MAXJ; j++) a[j] = e[j] = 0.0f;
#else
        moef_gu_partials(a, e, wg, wu, hr, nch);
#endif
        __syncwarp();
        if (MOEF_ISSUER && issued < my_units) issue(issued++);
#pragma unroll
        for (int o = 16; o > 0; o >>= 1)
#pragma unroll
            for (int j = 0; j < MOEF_MAXJ; j++) {
                a[j] += __shfl_xor_sync(0xffffffffu, a[j], o);
                e[j] += __shfl_xor_sync(0xffffffffu, e[j], o);
            }
        float gs = 0.0f, us = 0.0f;
#pragma unroll
        for (int j = 0; j < MOEF_MAXJ; j++) {
            gs += a[j];
            us += e[j];
        }
        if (lane == 0) {
            const int j = (int)(u < nsh ? sh0 + u : rt0 + (u - nsh));
            const int s = u < nsh ? K + j / inter : j / inter;
            act_store(act, (long)s * inter + j % inter, swiglu(gs, us));
        }
    }
    // every block's gate/up done
    __syncthreads();
    di_trace_phase(2);
    // the block's arrival at the end (cnt[2]) counted right after its last wait, so no round
    // trip is left for its end: the last block out zeroes the counters, none of which any
    // block waits on by then (MOEF_X_LATE_END: counted at the end, as before session 29)
    u32 out_before = 0;
    if (tid == 0) {
        grid_arrive_wait(&cnt[1], (u32)G);
        if (MOEF_EARLY_END && qrows == 0) out_before = atomicAdd(&cnt[2], 1u);
    }
    __syncthreads();
    di_trace_phase(3);
    pdl_launch_dependents();
    // every load of a round in flight before its stores (one L2 round trip for 8 x 256 chunks)
    for (int e0 = tid; e0 < S * ich; e0 += 8 * 32 * MOEF_WARPS) {
        uint4 v[8];
#pragma unroll
        for (int k = 0; k < 8; k++) {
            const int e = e0 + k * 32 * MOEF_WARPS;
            if (e < S * ich) v[k] = __ldcg(reinterpret_cast<const uint4*>(act) + e);
        }
#pragma unroll
        for (int k = 0; k < 8; k++) {
            const int e = e0 + k * 32 * MOEF_WARPS;
            if (e < S * ich) reinterpret_cast<uint4*>(acts)[e] = v[k];
        }
    }
    __syncthreads();
    // down: row pair p of this block by warp p % 8, its slots' units in turn
    for (int p = warp; p < nrp; p += MOEF_WARPS) {
        // the pair's residual values, asked for now so the pair's end waits for no load
        // (through L2: another block may have added the product before the layer; no block
        // writes these rows after the grid's meeting but this warp)
        float rv[2] = {0.0f, 0.0f};
        if (MOEF_EARLY_END && lane == 0 && res != nullptr)
            for (int i = 0; i < 2; i++) rv[i] = act_load_cg(res, 2L * (rp0 + p) + i);
        float acc[MOEF_MAXIJ][2];
#pragma unroll
        for (int j = 0; j < MOEF_MAXIJ; j++) acc[j][0] = acc[j][1] = 0.0f;
        for (int q = 0; q < S; q++) {
            const int i = my_no + my_ng + p / MOEF_WARPS * S + q, pg = warp * ppw + i % ppw;
            const int sl = q < n_shared ? K + q : q - n_shared;
            const float wt = q < n_shared ? 1.0f : selw[q - n_shared];
            mbar_wait(full0 + 8 * pg, (u32)((i / ppw) & 1));
            const bf16_t* w0 = reinterpret_cast<const bf16_t*>(moef_smem + (long)pg * page);
#ifdef DI_X_NOCOMPUTE
            if (w0 != nullptr) {
                __syncwarp();
                if (MOEF_ISSUER && issued < my_units) issue(issued++);
                continue;
            }
#endif
#pragma unroll
            for (int j = 0; j < MOEF_MAXIJ; j++) {
                const int c = lane + 32 * j;
                if (c < ich) {
                    float hv[8], wf[8];
                    bf16x8_to_f32(*reinterpret_cast<const uint4*>(acts + (long)sl * inter + c * 8), hv);
#pragma unroll
                    for (int rr = 0; rr < 2; rr++) {
                        bf16x8_to_f32(*reinterpret_cast<const uint4*>(w0 + (long)rr * inter + c * 8), wf);
                        float pp = 0.0f;
#pragma unroll
                        for (int k = 0; k < 8; k++) pp = fmaf(wf[k], hv[k], pp);
                        acc[j][rr] = fmaf(wt, pp, acc[j][rr]);
                    }
                }
            }
            __syncwarp();
            if (MOEF_ISSUER && issued < my_units) issue(issued++);
        }
#pragma unroll
        for (int i = 0; i < 2; i++) {
            float v = 0.0f;
#pragma unroll
            for (int j = 0; j < MOEF_MAXIJ; j++)
                if (32 * j < ich) v += warp_sum(acc[j][i]);
            if (lane == 0) {
                const long o = 2L * (rp0 + p) + i;
                act_store(out, o, v);
                // (through L2: another block may have added the product before the layer)
                if (res != nullptr)
                    act_store(res, o, (MOEF_EARLY_END ? rv[i] : act_load_cg(res, o)) + act_round(out, v));
            }
        }
    }
    // The next launch's 136 KB blocks can start their copies only once this launch's leave
    // their SMs, so this warp's lane 0 asks L2 for its share of that launch's rows now (grid
    // warp 8 b + warp of 8 G): they keep the memory busy through the layer's tail and the
    // launch between (sessions 39-40, H100: 0.991x / 0.984x / 1.004x a step; asked for as the
    // warp asked for its last unit instead, 1.017x slower: they then compete with the down
    // rows). `nl2`: a staged GEMV's first two segments, the next layer's q/kv_a rows (0 bytes:
    // none).
    const u8* nl2[2] = {nl2_0, nl2_1};
    const long nl2_bytes[2] = {nl2_bytes0, nl2_bytes1};
    if (lane == 0) moe_ask_share_l2(nl2, nl2_bytes, (long)b * MOEF_WARPS + warp, (long)G * MOEF_WARPS, 0, 1);
    di_trace_phase(4);
#ifdef DEEPINFER_TRACE
    if (qrows == 0) {
        __syncthreads();  // (traced builds: every warp's down rows done, not only warp 0's)
        di_trace_phase(5);
    }
#endif
    if (qrows > 0) {
        // 5. the next product (the next layer's RMSNorm of `res` and its q / kv_a rows, as
        // gemvp's NORM blocks compute them, sums in their order): once every block's residual
        // rows are counted (cnt[3]), each block normalizes the whole row and takes its rows
        // from the pages they were copied into while the down units ran
        __syncthreads();
        if (tid == 0) {
            grid_arrive_wait(&cnt[3], (u32)G);
            if (MOEF_EARLY_END) out_before = atomicAdd(&cnt[2], 1u);
        }
        __syncthreads();
        di_trace_phase(5);
        // (through L2: other blocks of this grid wrote the stream)
        const float ss = stage_row<true>([&](int c, float* v) { act_load8_cg(res + (long)c * 8, v); }, qg, hs, nch);
        const float rstd = block_rstd<MOEF_WARPS>(ss, red, d, qeps);
        if (qh != nullptr && tid < 8)
            for (long c = b; c < nch; c += G) {
                const long e = c * 8 + tid;
                act_store(qh, e, act_load_cg(res, e) * rstd * qg[e]);
            }
        for (int t = warp; t < nqu; t += MOEF_WARPS) {
            const int i = my_no + my_gd + (t - warp) / MOEF_WARPS, pg = warp * ppw + i % ppw;
            mbar_wait(full0 + 8 * pg, (u32)((i / ppw) & 1));
            float acc[2] = {0.0f, 0.0f};
#pragma unroll
            for (int rr = 0; rr < 2; rr++) {
                if (2 * t + rr >= nq) break;
                const uint4* wrow = reinterpret_cast<const uint4*>(moef_smem + (long)pg * page + (long)rr * d * 2);
                acc[rr] = warp_sum(staged_dot(wrow, hs, nch, lane));
            }
            __syncwarp();
            if (MOEF_ISSUER && issued < my_units) issue(issued++);
            if (lane == 0)
                for (int rr = 0; rr < 2 && 2 * t + rr < nq; rr++) {
                    const u8* w;
                    bf16_t* y;
                    int r;
                    qrow(q0 + 2 * t + rr, w, y, r);
                    act_store(y, r, acc[rr] * rstd);
                }
        }
        di_trace_phase(6);
    }
    // the last block out leaves the counters zeroed for the next launch
    if (tid == 0 && !MOEF_EARLY_END) out_before = atomicAdd(&cnt[2], 1u);
    if (tid == 0 && out_before == (u32)G - 1) moef_reset(cnt, MOEF_COUNTERS);
    // (traced builds: the block's last instruction, where no product follows)
    if (qrows == 0) di_trace_phase(6);
#endif
}

// ---- One token's MoE layer with the down product split by expert row (moe_fk1) ----
//
// moe_ffn1's layer without its grid-wide meeting between gate/up and down: a unit is one
// expert row i of one slot (gate row i, up row i and row i of the slot's down matrix stored
// transposed, [inter, d], so the three are 3 d contiguous values), and the warp that computes
// act_i = silu(gate_i . x) (up_i . x) (rounded as the activations store it) adds
// w act_i downT_i into its own d partial sums (lane: the chunks lane + 32 j of the output, as
// of the hidden row). So the down rows stream right behind the gate/up rows, no warp waits
// for the others before its down rows, and only the d sums per block meet at the end: the
// block adds its warps' sums in warp order into part[b], and once all blocks' are counted
// (cnt[1]) block b adds rows [d b / G, d (b + 1) / G) over the blocks in a fixed order (16
// threads a row, each a strided share, then a fixed butterfly), so the result depends on the
// grid size only, not on timing. Warp g of the grid (g = 8 b + warp) takes shared units
// [ush g / W, ush (g + 1) / W) (W warps; ush = shared slots x inter), asked for before the
// programmatic wait, and routed units [urt g / W, ...) once the routing is done. The routing is
// moe_ffn1's (moef_route); the last block out leaves the counters zeroed (cnt[2]).
// Not bit-identical to moe_ffn1: the down sums run in another order.
#define MOEK_MAXP 16                          // most ring pages (a multiple of MOEF_WARPS)
#define MOEK_TPR 16                           // threads a row of the final sum
#define MOEK_MAXG 256                         // most blocks (a multiple of MOEK_TPR)

extern "C" __global__ void __launch_bounds__(MOEF_THREADS, 1) moe_fk1_bf16(
    bf16_t* out, bf16_t* res, bf16_t* hn, const bf16_t* src, const float* gain, float eps, float* part,
    float* logits, u32* cnt, unsigned long long* totals, unsigned* last, const u8* gate, int gate_wt,
    long gate_row_bytes, const float* bias, const u64* ptrs, const bf16_t* sh_gate, const bf16_t* sh_up,
    const bf16_t* sh_downt, int d, int E, int K, int n_shared, int inter, int score, int norm, float scaling, int np,
    int page, const u8* l2_0, long l2_bytes0, const u8* l2_1, long l2_bytes1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    extern __shared__ __align__(128) u8 moef_smem[];
    __shared__ __align__(8) u64 bars[MOEK_MAXP];
    __shared__ __align__(16) float hs[MOEF_MAXJ * 256];
    __shared__ float red[MOEF_WARPS];
    __shared__ int cid[32];
    __shared__ float cw[32];
    __shared__ u64 sel[32][3];
    __shared__ float selw[32];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int G = gridDim.x, b = blockIdx.x, nch = d >> 3;
    const u32 ring = (u32)__cvta_generic_to_shared(moef_smem);
    const u32 full0 = (u32)__cvta_generic_to_shared(bars);
    const int ppw = np / MOEF_WARPS;  // pages a warp: its i-th unit in page warp ppw + i % ppw
    const long W = (long)G * MOEF_WARPS, gw = (long)b * MOEF_WARPS + warp;
    const long ush = (long)n_shared * inter, urt = (long)K * inter;
    const long sh0 = ush * gw / W, nsh = ush * (gw + 1) / W - sh0;
    const long rt0 = urt * gw / W, nrt = urt * (gw + 1) / W - rt0;
    const int my_units = (int)(nsh + nrt);
    const u32 row = (u32)d * 2;
    const u8* l2[2] = {l2_0, l2_1};
    const long l2_bytes[2] = {l2_bytes0, l2_bytes1};
    if (tid == 0) {
        for (int p = 0; p < np; p++) mbar_init(full0 + 8 * p, 1);
        mbar_init_fence();
    }
    __syncthreads();
    int issued = 0;
    // the warp's i-th unit into its page (lane 0; routed units once the routing is done)
    auto issue = [&](int i) {
        const int pg = warp * ppw + i % ppw;
        const bf16_t *g, *u, *dn;
        if (i < nsh) {
            const long r = sh0 + i;
            g = sh_gate + r * d;
            u = sh_up + r * d;
            dn = sh_downt + r * d;
        } else {
            const long j = rt0 + (i - nsh), s = j / inter, r = j % inter;
            g = reinterpret_cast<const bf16_t*>(sel[s][0]) + r * d;
            u = reinterpret_cast<const bf16_t*>(sel[s][1]) + r * d;
            dn = reinterpret_cast<const bf16_t*>(sel[s][2]) + r * d;
        }
        page_fill(ring + (u32)(pg * page), full0 + 8 * pg, row, 3, g, u, dn);
    };
    // before the wait: the warp's first shared units, and the routing's loads
    const bool mine = tid < nch;
    uint4 graw[1][2];
    MoeTok1 t;
    if (lane == 0)
        while (issued < ppw && issued < nsh) issue(issued++);
    moef_route_loads(graw, t, gate, gate_wt, gate_row_bytes, gain, ptrs, bias, E, mine, b);
    pdl_wait();
    float hr[MOEF_MAXJ][8];
    // the warp's partial sums of the output, chunk lane + 32 j
    float acc[MOEF_MAXJ][8];
#pragma unroll
    for (int j = 0; j < MOEF_MAXJ; j++)
#pragma unroll
        for (int k = 0; k < 8; k++) acc[j][k] = 0.0f;
    // the warp's unit i (after the routing): act_i from its gate and up rows, then w act_i
    // times its down row
    auto consume = [&](int i) {
        const int pg = warp * ppw + i % ppw;
        mbar_wait(full0 + 8 * pg, (u32)((i / ppw) & 1));
        const bf16_t* wg = reinterpret_cast<const bf16_t*>(moef_smem + (long)pg * page);
        const bf16_t* wu = wg + d;
        const bf16_t* wd = wg + 2 * d;
        float a[MOEF_MAXJ], e[MOEF_MAXJ];
        moef_gu_partials(a, e, wg, wu, hr, nch);
        // the down row's chunks of this lane, out of the page before it is asked for again
        uint4 dv[MOEF_MAXJ];
#pragma unroll
        for (int j = 0; j < MOEF_MAXJ; j++) {
            const int c = lane + 32 * j;
            dv[j] = c < nch ? *reinterpret_cast<const uint4*>(wd + c * 8) : make_uint4(0, 0, 0, 0);
        }
        __syncwarp();
        if (lane == 0 && issued < my_units) issue(issued++);
        // the lane's sums first, then two butterflies
        float gs = 0.0f, us = 0.0f;
#pragma unroll
        for (int j = 0; j < MOEF_MAXJ; j++) {
            gs += a[j];
            us += e[j];
        }
        gs = warp_sum(gs);
        us = warp_sum(us);
        const float wt = i < nsh ? 1.0f : selw[(rt0 + (i - nsh)) / inter];
        const float hv = wt * act_round(out, swiglu(gs, us));
#pragma unroll
        for (int j = 0; j < MOEF_MAXJ; j++) {
            float wf[8];
            bf16x8_to_f32(dv[j], wf);
#pragma unroll
            for (int k = 0; k < 8; k++) acc[j][k] = fmaf(wf[k], hv, acc[j][k]);
        }
    };
    moef_route(t, graw, src, hn, gain, eps, gate_wt, logits, cnt, totals, last, d, E, K, score, norm, scaling, false,
               hs, red, cid, cw, sel, selw, b, [&] { moef_lane_row(hr, hs, nch); });
    __syncthreads();
    di_trace_phase(1);
    // the pages the shared units left free (or never took)
    if (lane == 0)
        while (issued < ppw && issued < my_units) issue(issued++);
    for (int i = 0; i < my_units; i++) consume(i);
    di_trace_phase(2);
    // The memory idles from here to the launch's end: the block asks its share of the next
    // launch's weights (`l2`: two address, bytes ranges; 0 bytes: none) into L2, 4 KB a lane
    // of warp 0.
    if (warp == 0) moe_ask_share_l2(l2, l2_bytes, b, G, lane, 32);
    // the warps' sums in warp order into part[b] (the ring is free: every copy was waited for)
    __syncthreads();
    float* ws = reinterpret_cast<float*>(moef_smem);
#pragma unroll
    for (int j = 0; j < MOEF_MAXJ; j++) {
        const int c = lane + 32 * j;
        if (c < nch) {
            float* p = ws + (long)warp * d + c * 8;
            *reinterpret_cast<float4*>(p) = make_float4(acc[j][0], acc[j][1], acc[j][2], acc[j][3]);
            *reinterpret_cast<float4*>(p + 4) = make_float4(acc[j][4], acc[j][5], acc[j][6], acc[j][7]);
        }
    }
    __syncthreads();
    for (int c = tid; c < nch; c += MOEF_THREADS) {
        float v[8];
#pragma unroll
        for (int k = 0; k < 8; k++) v[k] = 0.0f;
        for (int w = 0; w < MOEF_WARPS; w++) {
            const float4 x0 = *reinterpret_cast<const float4*>(ws + (long)w * d + c * 8);
            const float4 x1 = *reinterpret_cast<const float4*>(ws + (long)w * d + c * 8 + 4);
            v[0] += x0.x; v[1] += x0.y; v[2] += x0.z; v[3] += x0.w;
            v[4] += x1.x; v[5] += x1.y; v[6] += x1.z; v[7] += x1.w;
        }
        float* p = part + (long)b * d + c * 8;
        *reinterpret_cast<float4*>(p) = make_float4(v[0], v[1], v[2], v[3]);
        *reinterpret_cast<float4*>(p + 4) = make_float4(v[4], v[5], v[6], v[7]);
    }
    // rows [r0, r0 + nr) of the output: MOEK_TPR threads a row, thread q adding blocks q, q + 16, ...
    const int r0 = (int)((long)d * b / G), nr = (int)((long)d * (b + 1) / G) - r0;
    const int q = tid % MOEK_TPR;
    // the residual values of the first rows, loaded while the grid meets (no other block writes them)
    const int rr0 = tid / MOEK_TPR;
    const float rv0 = res != nullptr && q == 0 && rr0 < nr ? act_load(res, r0 + rr0) : 0.0f;
    __syncthreads();
    if (tid == 0) grid_arrive_wait(&cnt[1], (u32)G);
    __syncthreads();
    di_trace_phase(3);
    pdl_launch_dependents();
    for (int base = 0; base < nr; base += MOEF_THREADS / MOEK_TPR) {
        const int rr = base + rr0;
        const bool ok = rr < nr;
        // every load in flight before the sum
        float pv[MOEK_MAXG / MOEK_TPR];
#pragma unroll
        for (int m = 0; m < MOEK_MAXG / MOEK_TPR; m++) {
            const int p = q + MOEK_TPR * m;
            pv[m] = ok && p < G ? __ldcg(part + (long)p * d + r0 + rr) : 0.0f;
        }
        float v = 0.0f;
#pragma unroll
        for (int m = 0; m < MOEK_MAXG / MOEK_TPR; m++) v += pv[m];
#pragma unroll
        for (int o = MOEK_TPR / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
        if (ok && q == 0) {
            const long r = r0 + rr;
            act_store(out, r, v);
            if (res != nullptr) {
                const float rv = base == 0 ? rv0 : act_load(res, r);
                act_store(res, r, rv + act_round(out, v));
            }
        }
    }
    di_trace_phase(4);
    if (tid == 0 && atomicAdd(&cnt[2], 1u) == (u32)G - 1) moef_reset(cnt, 3);
#endif
}

// out[c, r] = in[r, c] for a [rows, cols] bf16 matrix (a 32 x 32 tile a block of 256 threads).
extern "C" __global__ void __launch_bounds__(256) transpose_bf16(bf16_t* out, const bf16_t* in, int rows, int cols) {
    __shared__ bf16_t tile[32][33];
    const int tx = threadIdx.x & 31, ty = threadIdx.x >> 5;
    const int c0 = blockIdx.x * 32, r0 = blockIdx.y * 32;
    for (int y = ty; y < 32; y += 8) {
        const int r = r0 + y, c = c0 + tx;
        if (r < rows && c < cols) tile[y][tx] = in[(long)r * cols + c];
    }
    __syncthreads();
    for (int y = ty; y < 32; y += 8) {
        const int c = c0 + y, r = r0 + tx;
        if (c < cols && r < rows) out[(long)c * rows + r] = tile[tx][y];
    }
}

#define MOE_DEC_ALL(T, S)                                                                                            \
    extern "C" __global__ void __launch_bounds__(MOED_THREADS) moe_route_dec_##S(                                    \
        MOE_ROUTE_PARAMS(T)) {                                                                                       \
        moe_route_dec_impl<T, MOED_EPB, MOED_MAXN, false>(logits, counter, slot_ptr, slot_cnt, slot_tok, slot_wt,      \
                                                          totals, last, h, x, gain, eps, gate, gate_wt,             \
                                                          gate_row_bytes, bias, ptrs, d, E, K, n, score, n_group,   \
                                                          topk_group, norm, scaling, n_slots, early);               \
    }                                                                                                                \
    MOE_ROUTE_CL(T, S, 1)                                                                                            \
    MOE_ROUTE1(T, S)                                                                                                 \
    MOE_ROUTE_CL(T, S, 8)                                                                                            \
    MOE_DEC_WRAPPERS(T, S, float, wf32, 1)                                                                           \
    MOE_DEC_WRAPPERS(T, S, float, wf32, 8)                                                                           \
    MOE_DEC_WRAPPERS(T, S, bf16_t, wbf16, 1)                                                                         \
    MOE_DEC_WRAPPERS(T, S, bf16_t, wbf16, 8)

MOE_DEC_ALL(float, f32)
MOE_DEC_ALL(bf16_t, bf16)

// ---- Grouped expert products on tensor cores (bf16 weights and activations) ----
//
//   moe_gu_mma   block (active expert, ROWMMA_ROWS rows): moe_gateup's h[a, r] for every
//                assignment a of the expert;
//   moe_dn_mma   block (active expert, ROWMMA_ROWS rows): moe_down's y[a, r] (f32).
// The expert's assignments are the N dimension of the row-streaming products (gemt.cu,
// `rowmma_rows`): each weight is read once a group of 32 assignments, so with the few tokens
// an expert has in a decode batch the kernels are bound by streaming the weights.

template <int NM, typename OT>
__device__ __forceinline__ void moem_impl(OT* out, const bf16_t* x, const u64* w1s, const u64* w2s, const int* active,
                                          const int* n_active, const int* offsets, const int* rows, int k, int cols,
                                          int out_rows) {
    PDL_ENTRY();
    if ((int)blockIdx.x >= *n_active) return;
    const int e = active[blockIdx.x];
    const RowmmaMap map{rows, 0, 0};
    rowmma_rows<NM, OT>(out, x, reinterpret_cast<const u8*>(w1s[e]), reinterpret_cast<const u8*>(w2s[e]), map,
                        offsets[e], offsets[e + 1], NM == 2 ? k : 1, cols, out_rows, rowmma_row0());
}

extern "C" __global__ void __launch_bounds__(ROWMMA_THREADS, ROWMMA_MINB)
    moe_gu_mma(bf16_t* h, const bf16_t* x, const u64* gates, const u64* ups, const int* active, const int* n_active,
               const int* offsets, const int* rows, int k, int d, int inter) {
    moem_impl<2, bf16_t>(h, x, gates, ups, active, n_active, offsets, rows, k, d, inter);
}

extern "C" __global__ void __launch_bounds__(ROWMMA_THREADS, ROWMMA_MINB)
    moe_dn_mma(float* y, const bf16_t* h, const u64* downs, const int* active, const int* n_active,
               const int* offsets, const int* rows, int k, int inter, int d) {
    moem_impl<1, float>(y, h, downs, downs, active, n_active, offsets, rows, k, inter, d);
}

// ---- Grouped expert GEMMs for long steps (prefill): tiled on tensor cores ----
//
// moe_gu_gemm / moe_dn_gemm compute what moe_gu_mma / moe_dn_mma compute (same arguments),
// for steps whose experts have many tokens each. The row-streaming kernels read an expert's
// rows again for every 32 of its assignments; here a block takes a tile of MOEG_TM weight rows
// by MOEG_TN of one expert's assignments and walks k in stages of MOEG_TK, staging both the
// rows and the assignments' inputs (gathered through `rows`) in shared memory by cp.async, two
// buffers so the next stage is in flight while one is multiplied. 8 warps, warp (wm, wn) takes
// 32 rows by 32 assignments (mma.sync m16n8k16, both operands through ldmatrix; rows padded to
// 144 bytes so ldmatrix reads them without bank conflicts). Block x numbers the tiles of all
// active experts in their list's order (an expert of c assignments has ceil(c / MOEG_TN)), block
// y the row tiles. Each output is one sum over k in stage order whatever tile it falls in. Row
// lengths must be multiples of MOEG_TK.
#define MOEG_TM 128
#define MOEG_TN 64
#define MOEG_TK 64
#define MOEG_PAD (MOEG_TK + 8)
#define MOEG_THREADS 256

// The tile of `TN` assignments grid block x takes, found by warp 0: a warp-wide scan of the
// active experts' tile counts (an expert of c assignments has ceil(c / TN) tiles, numbered in
// the active list's order). Sets the expert, its first assignment and the tile's count (0: no
// tile, the block leaves).
template <int TN>
__device__ __forceinline__ void moeg_find_tile(const int* active, const int* n_active, const int* offsets, int lane,
                                               int* s_e, int* s_t0, int* s_n) {
    const int na = *n_active, tile = blockIdx.x;
    int base = 0, found = 0;
    for (int i0 = 0; i0 < na && !found; i0 += 32) {
        const int i = i0 + lane;
        const int e = i < na ? active[i] : 0;
        const int a0 = i < na ? offsets[e] : 0, c = i < na ? offsets[e + 1] - a0 : 0;
        const int nt = (c + TN - 1) / TN;
        int incl = nt;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const int v = __shfl_up_sync(0xffffffffu, incl, o);
            if (lane >= o) incl += v;
        }
        const int excl = base + incl - nt;
        const bool mine = nt > 0 && tile >= excl && tile < excl + nt;
        if (mine) {
            const int t0 = a0 + (tile - excl) * TN;
            *s_e = e;
            *s_t0 = t0;
            *s_n = min(TN, a0 + c - t0);
        }
        found = __any_sync(0xffffffffu, mine);
        base += __shfl_sync(0xffffffffu, incl, 31);
    }
    if (lane == 0 && !found) *s_n = 0;
}

// Every thread of the block: the block's tile (moeg_find_tile) and, where it has one, its
// assignments' rows in `s_a` (zero past the count). Returns the tile's count, the same in
// every thread; 0: no tile, and `s_a` is not written.
template <int TN>
__device__ __forceinline__ int moeg_tile(const int* active, const int* n_active, const int* offsets, const int* rows,
                                         int* s_e, int* s_t0, int* s_n, int* s_a) {
    const int tid = threadIdx.x;
    if ((tid >> 5) == 0) moeg_find_tile<TN>(active, n_active, offsets, tid & 31, s_e, s_t0, s_n);
    __syncthreads();
    const int nn = *s_n;
    if (nn == 0) return 0;
    if (tid < TN) s_a[tid] = tid < nn ? rows[*s_t0 + tid] : 0;
    __syncthreads();
    return nn;
}

template <int NM>
struct MoegStage {
    bf16_t w[NM][MOEG_TM][MOEG_PAD];
    bf16_t x[MOEG_TN][MOEG_PAD];
};

template <int NM, typename OT>
__device__ __forceinline__ void moeg_impl(OT* out, const bf16_t* x, const u64* w1s, const u64* w2s,
                                          const int* active, const int* n_active, const int* offsets,
                                          const int* rows, int xdiv, int cols, int out_rows) {
    extern __shared__ __align__(16) u8 moeg_dsm[];
    MoegStage<NM>* st = reinterpret_cast<MoegStage<NM>*>(moeg_dsm);  // [2]
    __shared__ int s_e, s_n, s_t0, s_a[MOEG_TN];
    PDL_ENTRY();
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int nn = moeg_tile<MOEG_TN>(active, n_active, offsets, rows, &s_e, &s_t0, &s_n, s_a);
    if (nn == 0) return;
    const int r0 = blockIdx.y * MOEG_TM;
    const u8* wbase[NM];
    wbase[0] = reinterpret_cast<const u8*>(w1s[s_e]);
    if (NM == 2) wbase[NM - 1] = reinterpret_cast<const u8*>(w2s[s_e]);
    const long row_bytes = (long)cols * 2;
    // this thread's copies a stage: weight rows tid / 8 + 32 i (16-byte chunk tid % 8) of each
    // matrix, input row tid / 4 (chunks 2 (tid % 4), + 1)
    const int wc = tid & 7, xj = tid >> 2, xc = (tid & 3) * 2;
    const bool xok = xj < nn;
    const bf16_t* xrow = x + (long)(s_a[xok ? xj : 0] / xdiv) * cols;
    auto load = [&](int buf, int k0) {
#pragma unroll
        for (int m = 0; m < NM; m++)
#pragma unroll
            for (int i = 0; i < MOEG_TM / 32; i++) {
                const int rr = (tid >> 3) + 32 * i, row = r0 + rr;
                const bool ok = row < out_rows;
                cp_async16(&st[buf].w[m][rr][wc * 8], ok ? wbase[m] + row * row_bytes + (long)(k0 + wc * 8) * 2 : wbase[m],
                           ok);
            }
#pragma unroll
        for (int c = 0; c < 2; c++)
            cp_async16(&st[buf].x[xj][(xc + c) * 8], xok ? xrow + k0 + (xc + c) * 8 : x, xok);
    };
    const int wm = warp & 3, wn = warp >> 2, g = lane >> 2, tq = lane & 3;
    float acc[NM][2][4][4];
#pragma unroll
    for (int m = 0; m < NM; m++)
#pragma unroll
        for (int mi = 0; mi < 2; mi++)
#pragma unroll
            for (int ni = 0; ni < 4; ni++) acc[m][mi][ni][0] = acc[m][mi][ni][1] = acc[m][mi][ni][2] = acc[m][mi][ni][3] = 0.0f;
    const int nk = cols / MOEG_TK;
    load(0, 0);
    cp_async_commit();
    for (int kt = 0; kt < nk; kt++) {
        const int buf = kt & 1;
        if (kt + 1 < nk) load(buf ^ 1, (kt + 1) * MOEG_TK);
        cp_async_commit();
        cp_async_wait_group<1>();
        __syncthreads();
#pragma unroll
        for (int kk = 0; kk < MOEG_TK; kk += 16) {
            u32 b[4][2];
#pragma unroll
            for (int p = 0; p < 2; p++)
                ldsm_x4(b[2 * p][0], b[2 * p][1], b[2 * p + 1][0], b[2 * p + 1][1],
                        &st[buf].x[32 * wn + 16 * p + (lane & 7) + ((lane >> 4) << 3)][kk + ((lane >> 3) & 1) * 8]);
#pragma unroll
            for (int m = 0; m < NM; m++)
#pragma unroll
                for (int mi = 0; mi < 2; mi++) {
                    u32 a[4];
                    ldsm_x4(a[0], a[1], a[2], a[3], &st[buf].w[m][32 * wm + 16 * mi + (lane & 15)][kk + (lane >> 4) * 8]);
#pragma unroll
                    for (int ni = 0; ni < 4; ni++) mma_bf16_16816(acc[m][mi][ni], a, b[ni][0], b[ni][1]);
                }
        }
        __syncthreads();  // the buffer is refilled next stage
    }
#pragma unroll
    for (int mi = 0; mi < 2; mi++)
#pragma unroll
        for (int ni = 0; ni < 4; ni++)
#pragma unroll
            for (int q = 0; q < 4; q++) {
                const int row = r0 + 32 * wm + 16 * mi + g + (q >> 1) * 8, j = 32 * wn + 8 * ni + 2 * tq + (q & 1);
                if (j < nn && row < out_rows) {
                    const long o = (long)s_a[j] * out_rows + row;
                    if (NM == 2) {
                        const float gs = acc[0][mi][ni][q], us = acc[NM - 1][mi][ni][q];
                        act_store(out, o, swiglu(gs, us));
                    } else {
                        act_store(out, o, acc[0][mi][ni][q]);
                    }
                }
            }
}

extern "C" __global__ void __launch_bounds__(MOEG_THREADS, 2)
    moe_gu_gemm(bf16_t* h, const bf16_t* x, const u64* gates, const u64* ups, const int* active, const int* n_active,
                const int* offsets, const int* rows, int k, int d, int inter) {
    moeg_impl<2, bf16_t>(h, x, gates, ups, active, n_active, offsets, rows, k, d, inter);
}

extern "C" __global__ void __launch_bounds__(MOEG_THREADS)
    moe_dn_gemm(float* y, const bf16_t* h, const u64* downs, const int* active, const int* n_active,
                const int* offsets, const int* rows, int k, int inter, int d) {
    moeg_impl<1, float>(y, h, downs, downs, active, n_active, offsets, rows, 1, inter, d);
}

// ---- Grouped expert GEMMs on Hopper's warpgroup MMA (sm_90a images only) ----
//
// moe_gu_wg / moe_dn_wg compute what moe_gu_gemm / moe_dn_gemm compute (same arguments) with
// `wgmma` instead of `mma.sync`. A block takes MOEW_TT = 128 of one expert's assignments by 256
// weight rows and walks k in stages of 64 values: each stage is 128 input rows and 256 weight
// rows of 128 bytes, copied by cp.async into shared memory in the 128-byte swizzled layout the
// tensor cores read (16-byte chunk c of row r at chunk c ^ (r % 8); 8-row groups 1,024 bytes
// apart), MOEW_ST stages in flight. Warpgroup w multiplies the stage's weight rows
// [128 w, 128 w + 128) (gate/up: 64 gate rows then the same 64 up rows, so a SwiGLU pair stays
// in one thread; down: 128 rows) with the first 64 assignments and, where the tile has more,
// the second 64 (m64n128k16, both operands from shared memory): a tile of few assignments
// keeps both warpgroups busy. Each output is one sum over k in stage order (16-wide steps, as
// mma.sync adds them: the same results as moe_gu_gemm / moe_dn_gemm in the GPU test). Row
// lengths must be multiples of 64; 4 * 48 KB + 1 KB of dynamic shared memory (`MOE_WG_SMEM`
// on the host).
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define MOEW_TT 128
#define MOEW_TR 256
#define MOEW_ST 4
#define MOEW_THREADS 256
#define MOEW_STAGE ((MOEW_TT + MOEW_TR) * 128)

// A shared-memory matrix descriptor: K-major rows of 128 bytes, 128-byte swizzle, 8-row groups
// 1,024 bytes apart (the leading offset is unused in this layout).
__device__ __forceinline__ u64 wg_desc(u32 saddr) {
    return (u64)((saddr & 0x3FFFF) >> 4) | ((u64)1 << 16) | ((u64)(1024 >> 4) << 32) | ((u64)1 << 62);
}
__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wg_wait0() { asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory"); }
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }

// d (64 x 128, f32) += A (64 x 16) * B (128 x 16)^T, both K-major in shared memory
__device__ __forceinline__ void wg_mma_n128(float (&d)[64], u64 da, u64 db) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p, 1, 1, 0, 0;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
                 "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
                 "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
                 "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
                 "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
                 "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
                 "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
                 "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
                 : "l"(da), "l"(db), "r"(1));
}

// One stage of a moew block's copies: this thread's 16-byte chunk of rows rb + 32 i (`st`: the
// stage plus the thread's swizzled chunk offset), from k0 on.
__device__ __forceinline__ void moew_load(u8* st, int rb, const u8* const (&src)[12], const bool (&ok)[12], int k0) {
#pragma unroll
    for (int i = 0; i < 12; i++) cp_async16(st + (rb + 32 * i) * 128, src[i] + (long)k0 * 2, ok[i]);
}

// A moew block's k loop, with the second 64 assignments' products (TWO) or without: one loop
// each, since a branch between the products would make the compiler wait for each.
template <bool TWO>
__device__ __forceinline__ void moew_loop(float (&acc0)[64], float (&acc1)[64], u8* st0, u32 sbase, int rb,
                                          const u8* const (&src)[12], const bool (&ok)[12], int nk, int wgi) {
#pragma unroll
    for (int s = 0; s < MOEW_ST - 1; s++) {
        if (s < nk) moew_load(st0 + s * MOEW_STAGE, rb, src, ok, s * 64);
        cp_async_commit();
    }
    for (int kt = 0; kt < nk; kt++) {
        cp_async_wait_group<MOEW_ST - 2>();
        fence_proxy_async();  // this thread's copies, seen by the tensor cores
        wg_wait0();           // this warpgroup's products of the buffer refilled below are done
        __syncthreads();
        const int nx = kt + MOEW_ST - 1;
        if (nx < nk) moew_load(st0 + (nx % MOEW_ST) * MOEW_STAGE, rb, src, ok, nx * 64);
        cp_async_commit();
        const u32 sb = sbase + (u32)((kt % MOEW_ST) * MOEW_STAGE);
        const u64 da = wg_desc(sb), db = wg_desc(sb + (MOEW_TT + 128 * wgi) * 128);
        wg_fence();
#pragma unroll
        for (int kk = 0; kk < 4; kk++) {
            // a 16-value step is 32 bytes along the swizzled rows; the second 64 assignments
            // start 8 KB on
            wg_mma_n128(acc0, da + 2 * kk, db + 2 * kk);
            if (TWO) wg_mma_n128(acc1, da + 512 + 2 * kk, db + 2 * kk);
        }
        wg_commit();
    }
    wg_wait0();
}

template <int NM, typename OT>
__device__ __forceinline__ void moew_impl(OT* out, const bf16_t* x, const u64* w1s, const u64* w2s,
                                          const int* active, const int* n_active, const int* offsets,
                                          const int* rows, int xdiv, int cols, int out_rows) {
    extern __shared__ __align__(16) u8 moew_dsm[];
    __shared__ int s_e, s_n, s_t0, s_a[MOEW_TT];
    PDL_ENTRY();
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int nn = moeg_tile<MOEW_TT>(active, n_active, offsets, rows, &s_e, &s_t0, &s_n, s_a);
    if (nn == 0) return;
    // the stages from the first 1,024-byte boundary (the swizzle is of address bits)
    const u32 sm0 = (u32)__cvta_generic_to_shared(moew_dsm);
    const u32 sbase = (sm0 + 1023u) & ~1023u;
    u8* stage0 = moew_dsm + (sbase - sm0);
    // weight rows a block: gate/up 128 of each matrix, down 256; warpgroup w takes the stage's
    // weight rows [128 w, 128 w + 128): gate/up rows r0 + 64 w.. of the gate, then of the up
    // matrix (so SwiGLU pairs stay in one thread), down rows r0 + 128 w..
    const int r0 = blockIdx.y * (NM == 2 ? MOEW_TR / 2 : MOEW_TR);
    const long row_bytes = (long)cols * 2;
    // this thread's copies a stage: chunk c of rows rb + 32 i (i < 4: inputs, then weights)
    const int c = tid & 7, rb = tid >> 3;
    const u32 dchunk = (u32)((c ^ (rb & 7)) << 4);
    const u8* src[12];
    bool ok[12];
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const int j = rb + 32 * i;
        ok[i] = j < nn;
        src[i] = reinterpret_cast<const u8*>(x + (long)(s_a[ok[i] ? j : 0] / xdiv) * cols) + c * 16;
    }
    const u8* w1 = reinterpret_cast<const u8*>(w1s[s_e]);
    const u8* w2 = reinterpret_cast<const u8*>(w2s[s_e]);
#pragma unroll
    for (int i = 4; i < 12; i++) {
        const int br = rb + 32 * (i - 4), within = br & 127;
        const bool second = NM == 2 && within >= 64;
        const int row = r0 + (NM == 2 ? 64 * (br >> 7) + (within & 63) : br);
        ok[i] = row < out_rows;
        src[i] = (second ? w2 : w1) + (ok[i] ? row : 0) * row_bytes + c * 16;
    }
    const int wgi = warp >> 2;
    // the tile's second 64 assignments (block-uniform)
    const bool two = nn > 64;
    float acc0[64], acc1[64];
#pragma unroll
    for (int i = 0; i < 64; i++) acc0[i] = acc1[i] = 0.0f;
    const int nk = cols / 64;
    if (two)
        moew_loop<true>(acc0, acc1, stage0 + dchunk, sbase, rb, src, ok, nk, wgi);
    else
        moew_loop<false>(acc0, acc1, stage0 + dchunk, sbase, rb, src, ok, nk, wgi);
    // accumulator 4 i + q: assignment 16 (warp % 4) + lane / 4 + 8 (q / 2) of the 64 (acc1: of
    // the second 64), weight column 8 i + 2 (lane % 4) + q % 2 of the warpgroup's 128
    const int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int half = 0; half < 2; half++) {
        if (half == 1 && !two) break;
        const float* acc = half ? acc1 : acc0;
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const int j = 64 * half + 16 * (warp & 3) + g + 8 * h;
            if (j >= nn) continue;
            OT* o = out + (long)s_a[j] * out_rows;
#pragma unroll
            for (int i = 0; i < (NM == 2 ? 8 : 16); i++)
#pragma unroll
                for (int q = 0; q < 2; q++) {
                    const int a = 4 * i + 2 * h + q;
                    if (NM == 2) {
                        const int row = r0 + 64 * wgi + 8 * i + 2 * t + q;
                        if (row < out_rows) act_store(o, row, swiglu(acc[a], acc[a + 32]));
                    } else {
                        const int row = r0 + 128 * wgi + 8 * i + 2 * t + q;
                        if (row < out_rows) act_store(o, row, acc[a]);
                    }
                }
        }
    }
}

extern "C" __global__ void __launch_bounds__(MOEW_THREADS, 1)
    moe_gu_wg(bf16_t* h, const bf16_t* x, const u64* gates, const u64* ups, const int* active, const int* n_active,
              const int* offsets, const int* rows, int k, int d, int inter) {
    moew_impl<2, bf16_t>(h, x, gates, ups, active, n_active, offsets, rows, k, d, inter);
}

extern "C" __global__ void __launch_bounds__(MOEW_THREADS, 1)
    moe_dn_wg(float* y, const bf16_t* h, const u64* downs, const int* active, const int* n_active,
              const int* offsets, const int* rows, int k, int inter, int d) {
    moew_impl<1, float>(y, h, downs, downs, active, n_active, offsets, rows, 1, inter, d);
}
#endif
