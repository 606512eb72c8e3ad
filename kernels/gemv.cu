// Matrix-vector products for a few tokens at a time (decode): y[t, r] = sum_c W[r, c] x[t, c]
// for t < n <= GEMV_MAX_N. One warp per weight row, so each weight byte is read once for all
// tokens. Up to three weights that share the input (Q/K/V, gate/up) run in one launch as
// "segments": rows [0, m0) come from w0 into y0, the next m1 rows from w1 into y1, and so on.
//
// Float weights stream in 16-byte loads (four in flight per lane) when k is a multiple of 8;
// block-quantized weights (Q4_0, Q4_1, Q8_0) are read one 32-element block per lane.

#define GEMV_MAX_N 8
#define GEMV_UNROLL 4

__device__ __forceinline__ void f16x8_to_f32(uint4 v, float* out) {
    out[0] = f16_to_f32((f16_t)(v.x & 0xffff)); out[1] = f16_to_f32((f16_t)(v.x >> 16));
    out[2] = f16_to_f32((f16_t)(v.y & 0xffff)); out[3] = f16_to_f32((f16_t)(v.y >> 16));
    out[4] = f16_to_f32((f16_t)(v.z & 0xffff)); out[5] = f16_to_f32((f16_t)(v.z >> 16));
    out[6] = f16_to_f32((f16_t)(v.w & 0xffff)); out[7] = f16_to_f32((f16_t)(v.w >> 16));
}

// Row `g` of a launch's up to three segments (m0, m1, m2 rows): its segment's weights `w` and
// output `y`, its index `r` there and the segment's rows `m`; false past the last (then
// segment 0 and index 0).
template <typename T>
__device__ __forceinline__ bool gemv_seg(long g, const u8* w0, const u8* w1, const u8* w2, T* y0, T* y1, T* y2,
                                         int m0, int m1, int m2, const u8*& w, T*& y, long& r, long& m) {
    if (g < m0) {
        w = w0; y = y0; r = g; m = m0;
    } else if (g < (long)m0 + m1) {
        w = w1; y = y1; r = g - m0; m = m1;
    } else if (g < (long)m0 + m1 + m2) {
        w = w2; y = y2; r = g - m0 - m1; m = m2;
    } else {
        w = w0; y = y0; r = 0; m = m0;
        return false;
    }
    return true;
}

template <typename T, int WT>
__device__ void gemv_impl(const u8* w0, const u8* w1, const u8* w2, T* y0, T* y1, T* y2, int m0, int m1, int m2,
                          const T* x, int n, int k, long row_bytes) {
    pdl_launch_dependents();
    const int lane = threadIdx.x & 31;
    const long grow = (long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const u8* w;
    T* y;
    long r, m;
    if (!gemv_seg(grow, w0, w1, w2, y0, y1, y2, m0, m1, m2, w, y, r, m)) return;  // whole warp leaves together
    const u8* wrow = w + r * row_bytes;
    float acc[GEMV_MAX_N];
#pragma unroll
    for (int t = 0; t < GEMV_MAX_N; t++) acc[t] = 0.0f;

    // Weights are never written by earlier kernels: the first loads go out before the wait.
    bool waited = false;
    if (WT == WT_Q4_0 || WT == WT_Q4_1 || WT == WT_Q8_0) {
        pdl_wait();
        waited = true;
        const int nb = k >> 5;
        for (int b = lane; b < nb; b += 32) {
            float wf[32];
            dequant_block32(WT, wrow + (long)b * block_bytes32(WT), wf);
#pragma unroll
            for (int t = 0; t < GEMV_MAX_N; t++) {
                if (t < n) {
                    const T* xp = x + (long)t * k + b * 32;
                    float s = 0.0f;
#pragma unroll
                    for (int j = 0; j < 32; j += 8) {
                        float xf[8];
                        act_load8(xp + j, xf);
#pragma unroll
                        for (int i = 0; i < 8; i++) s = fmaf(wf[j + i], xf[i], s);
                    }
                    acc[t] += s;
                }
            }
        }
    } else if ((k & 7) == 0) {
        const int nch = k >> 3;  // chunks of 8 elements
        const int cbytes = WT == WT_F32 ? 32 : 16;
        for (int c0 = lane; c0 < nch; c0 += 32 * GEMV_UNROLL) {
            uint4 raw[GEMV_UNROLL], raw2[GEMV_UNROLL];
#pragma unroll
            for (int u = 0; u < GEMV_UNROLL; u++) {
                const int c = c0 + 32 * u;
                if (c < nch) {
                    raw[u] = ld_stream16(wrow + (long)c * cbytes);
                    if (WT == WT_F32) raw2[u] = ld_stream16(wrow + (long)c * cbytes + 16);
                }
            }
            if (!waited) {
                pdl_wait();
                waited = true;
            }
#pragma unroll
            for (int u = 0; u < GEMV_UNROLL; u++) {
                const int c = c0 + 32 * u;
                if (c < nch) {
                    float wf[8];
                    if (WT == WT_BF16) {
                        bf16x8_to_f32(raw[u], wf);
                    } else if (WT == WT_F16) {
                        f16x8_to_f32(raw[u], wf);
                    } else {
                        wf[0] = __uint_as_float(raw[u].x); wf[1] = __uint_as_float(raw[u].y);
                        wf[2] = __uint_as_float(raw[u].z); wf[3] = __uint_as_float(raw[u].w);
                        wf[4] = __uint_as_float(raw2[u].x); wf[5] = __uint_as_float(raw2[u].y);
                        wf[6] = __uint_as_float(raw2[u].z); wf[7] = __uint_as_float(raw2[u].w);
                    }
#pragma unroll
                    for (int t = 0; t < GEMV_MAX_N; t++) {
                        if (t < n) {
                            float xf[8];
                            act_load8(x + (long)t * k + (long)c * 8, xf);
                            float s = acc[t];
#pragma unroll
                            for (int i = 0; i < 8; i++) s = fmaf(wf[i], xf[i], s);
                            acc[t] = s;
                        }
                    }
                }
            }
        }
    } else {
        pdl_wait();
        waited = true;
        for (int c = lane; c < k; c += 32) {
            const float wv = weight_at(WT, wrow, 0, 0, c);
#pragma unroll
            for (int t = 0; t < GEMV_MAX_N; t++) {
                if (t < n) acc[t] = fmaf(wv, act_load(x, (long)t * k + c), acc[t]);
            }
        }
    }
    if (!waited) pdl_wait();
#pragma unroll
    for (int t = 0; t < GEMV_MAX_N; t++) {
        if (t < n) {
            const float s = warp_sum(acc[t]);
            if (lane == 0) act_store(y, (long)t * m + r, s);
        }
    }
}

#define GEMV_WRAPPER(T, S, WT, WS)                                                                                  \
    extern "C" __global__ void gemv_##WS##_##S(const u8* w0, const u8* w1, const u8* w2, T* y0, T* y1, T* y2,      \
                                               int m0, int m1, int m2, const T* x, int n, int k, long row_bytes) { \
        gemv_impl<T, WT>(w0, w1, w2, y0, y1, y2, m0, m1, m2, x, n, k, row_bytes);                                  \
    }

#define GEMV_ALL(T, S)                   \
    GEMV_WRAPPER(T, S, WT_F32, f32w)     \
    GEMV_WRAPPER(T, S, WT_F16, f16w)     \
    GEMV_WRAPPER(T, S, WT_BF16, bf16w)   \
    GEMV_WRAPPER(T, S, WT_Q4_0, q4_0w)   \
    GEMV_WRAPPER(T, S, WT_Q4_1, q4_1w)   \
    GEMV_WRAPPER(T, S, WT_Q8_0, q8_0w)

GEMV_ALL(float, f32)
GEMV_ALL(bf16_t, bf16)

// Block-cooperative GEMV for long rows of bf16/f16 weights (k >= 2048, k % 8 == 0): a block of
// GEMVB_THREADS threads computes R consecutive output rows for up to N tokens. Every thread
// owns 16-byte chunks c = tid + GEMVB_THREADS * u of each of the R rows, so a warp reads 512
// contiguous bytes per load, and all R * U loads of an iteration are issued before the first is
// used (R * U = 8 loads, 128 bytes, in flight per thread). Partial sums meet in shared memory.
// Small blocks of rows keep the grid many blocks deep, so the tail of the launch is short.
#define GEMVB_THREADS 256

//
// MODE folds a neighbouring row-wise operation into the product (one launch instead of two):
// - GEMVB_PLAIN: y = W x.
// - GEMVB_NORM, an RMSNorm before it: x is the raw row and y = rstd * W (x * g) with
//   rstd = 1 / sqrt(mean(x^2) + eps); each token's sum of squares is accumulated beside the
//   products from the same loads and reduced with them. The normalized rows are written to h
//   as the separate norm would (each block writes a slice), for any later reader.
// - GEMVB_ACC, a residual add after it (one segment): y = W x, then res += y, rounded as the
//   separate add kernel rounds.
// - GEMVB_SWIGLU, SwiGLU after a gate/up pair (two segments of equal rows, alone or with the
//   norm): a block owns R/2 gate rows and the same R/2 up rows, and writes silu(gate) * up
//   into the gate output, both rounded to the activation type first as the separate
//   `silu_mul` kernel reads them (the up output is not written).
// Modes are bits; NORM and SWIGLU combine.
#define GEMVB_PLAIN 0
#define GEMVB_NORM 1
#define GEMVB_ACC 2
#define GEMVB_SWIGLU 4

template <typename T, int WT, int N, int R, int U, int MODE>
__device__ __forceinline__ void gemvb_impl(const u8* w0, const u8* w1, const u8* w2, T* y0, T* y1, T* y2, int m0,
                                           int m1, int m2, const T* x, int n, int k, long row_bytes,
                                           const float* g, float eps, T* h, T* res) {
    constexpr bool NORM = (MODE & GEMVB_NORM) != 0, ACC = (MODE & GEMVB_ACC) != 0, SWIGLU = (MODE & GEMVB_SWIGLU) != 0;
    static_assert(!SWIGLU || R % 2 == 0, "SwiGLU pairs rows");
    constexpr int RED = R * N + (NORM ? N : 0);
    __shared__ float red[GEMVB_THREADS / 32][RED];
    __shared__ float rstd[N];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    pdl_launch_dependents();
    bool waited = false;
    const long row0 = (long)blockIdx.x * R;
    const u8* wr[R];
    T* yr[R];
    long rr[R], mr[R];
    bool ok[R];
#pragma unroll
    for (int i = 0; i < R; i++) {
        // SwiGLU: rows i < R/2 are gate rows blockIdx.x * R/2 + i, the others the up rows of
        // the same indices.
        const long g = SWIGLU ? (long)blockIdx.x * (R / 2) + (i % (R / 2)) + (i < R / 2 || m1 != m0 ? 0 : m0)
                              : row0 + i;
        ok[i] = !SWIGLU || (m1 == m0 && (long)blockIdx.x * (R / 2) + (i % (R / 2)) < m0);
        if (!gemv_seg(g, w0, w1, w2, y0, y1, y2, m0, m1, m2, wr[i], yr[i], rr[i], mr[i])) ok[i] = false;
        wr[i] += rr[i] * row_bytes;
    }
    float acc[R][N];
    float ss[N];
    float resv = 0.0f;
#pragma unroll
    for (int t = 0; t < N; t++) ss[t] = 0.0f;
#pragma unroll
    for (int i = 0; i < R; i++)
#pragma unroll
        for (int t = 0; t < N; t++) acc[i][t] = 0.0f;
    const int nch = k >> 3;
    for (int c0 = tid; c0 < nch; c0 += GEMVB_THREADS * U) {
        uint4 raw[R][U];
#pragma unroll
        for (int u = 0; u < U; u++) {
            const int c = c0 + GEMVB_THREADS * u;
#pragma unroll
            for (int i = 0; i < R; i++) {
                if (c < nch && ok[i]) raw[i][u] = ld_stream16(wr[i] + (long)c * 16);
                else raw[i][u] = make_uint4(0, 0, 0, 0);
            }
        }
        if (!waited) {
            pdl_wait();
            waited = true;
            // The residual this thread's output adds to (written by earlier kernels), read
            // now so that its latency hides behind the products.
            if (ACC) {
#pragma unroll
                for (int i = 0; i < R; i++)
#pragma unroll
                    for (int t = 0; t < N; t++)
                        if (tid == i * N + t && ok[i] && t < n) resv = act_load(res, (long)t * mr[i] + rr[i]);
            }
        }
#pragma unroll
        for (int u = 0; u < U; u++) {
            const int c = c0 + GEMVB_THREADS * u;
            if (c < nch) {
                float gf[8];
                if (NORM) {
                    const float4 ga = *reinterpret_cast<const float4*>(g + (long)c * 8);
                    const float4 gb = *reinterpret_cast<const float4*>(g + (long)c * 8 + 4);
                    gf[0] = ga.x; gf[1] = ga.y; gf[2] = ga.z; gf[3] = ga.w;
                    gf[4] = gb.x; gf[5] = gb.y; gf[6] = gb.z; gf[7] = gb.w;
                }
#pragma unroll
                for (int t = 0; t < N; t++) {
                    if (N == 1 || t < n) {
                        float xf[8];
                        act_load8(x + (long)t * k + (long)c * 8, xf);
                        if (NORM) {
#pragma unroll
                            for (int j = 0; j < 8; j++) {
                                ss[t] = fmaf(xf[j], xf[j], ss[t]);
                                xf[j] *= gf[j];
                            }
                        }
#pragma unroll
                        for (int i = 0; i < R; i++) {
                            float wf[8];
                            if (WT == WT_BF16) bf16x8_to_f32(raw[i][u], wf);
                            else f16x8_to_f32(raw[i][u], wf);
                            float s = acc[i][t];
#pragma unroll
                            for (int j = 0; j < 8; j++) s = fmaf(wf[j], xf[j], s);
                            acc[i][t] = s;
                        }
                    }
                }
            }
        }
    }
    if (!waited) pdl_wait();
#pragma unroll
    for (int i = 0; i < R; i++)
#pragma unroll
        for (int t = 0; t < N; t++) {
            const float s = warp_sum(acc[i][t]);
            if (lane == 0) red[warp][i * N + t] = s;
        }
    if (NORM) {
#pragma unroll
        for (int t = 0; t < N; t++) {
            const float s = warp_sum(ss[t]);
            if (lane == 0) red[warp][RED - N + t] = s;
        }
    }
    __syncthreads();
    if (NORM) {
        if (tid < N) {
            float s = 0.0f;
#pragma unroll
            for (int wi = 0; wi < GEMVB_THREADS / 32; wi++) s += red[wi][RED - N + tid];
            rstd[tid] = 1.0f / sqrtf(s / (float)k + eps);
        }
        __syncthreads();
        // This block's slice of the normalized rows: 16-byte chunks blockIdx.x, + gridDim.x, ...
        if (h != nullptr && tid < 8 * n) {
            const int t = tid >> 3, j = tid & 7;
            for (long c = blockIdx.x; c < (k >> 3); c += gridDim.x) {
                const long e = c * 8 + j;
                act_store(h, (long)t * k + e, act_load(x, (long)t * k + e) * rstd[t] * g[e]);
            }
        }
    }
    // Compile-time row and token indices, so the per-row arrays stay in registers.
#pragma unroll
    for (int i = 0; i < (SWIGLU ? R / 2 : R); i++)
#pragma unroll
        for (int t = 0; t < N; t++) {
            if (tid == i * N + t && ok[i] && t < n) {
                float s = 0.0f;
#pragma unroll
                for (int wi = 0; wi < GEMVB_THREADS / 32; wi++) s += red[wi][i * N + t];
                if (NORM) s *= rstd[t];
                const long e = (long)t * mr[i] + rr[i];
                if (SWIGLU) {
                    const int iu = i + R / 2;
                    float su = 0.0f;
#pragma unroll
                    for (int wi = 0; wi < GEMVB_THREADS / 32; wi++) su += red[wi][iu * N + t];
                    if (NORM) su *= rstd[t];
                    act_store(yr[i], e, swiglu(act_round(yr[i], s), act_round(yr[i], su)));
                } else {
                    act_store(yr[i], e, s);
                }
                if (ACC) act_store(res, e, resv + act_round(yr[i], s));
            }
        }
}

// One token, rows of at most GEMVP_MAXK bf16 weights (`gemvp<mode>_bf16w_n1_r8_bf16`; modes as
// gemvb's, SwiGLU excepted): a block's GEMVP_ROWS rows stream into shared memory by cp.async
// before the programmatic wait, so no register holds a load in flight (5 blocks an SM keep
// 160 KB asked for) and a block resident while the kernel before it runs starts its copies
// then. After the wait the block stages the input (times the gain for GEMVB_NORM, whose scale
// each thread computes from the block's sums) and each warp takes one row: lanes over 16-byte
// chunks, one warp reduction.
#define GEMVP_ROWS 8
#define GEMVP_MAXK 2048
// Wide blocks (`gemvp<mode>_bf16w_n1_r32_bf16`): 4 rows a warp, 32 a block, in 136 KB of
// dynamic shared memory, so a matrix of up to 32 rows an SM (the q/kv_a and o projections of
// a 2048-wide model) is one block an SM and every block can be resident, its rows copying,
// while the kernel before it runs.
#define GEMVP_WIDE_RPW 4

template <int MODE, int RPW>
__device__ __forceinline__ void gemvp_impl(const u8* w0, const u8* w1, const u8* w2, bf16_t* y0, bf16_t* y1,
                                           bf16_t* y2, int m0, int m1, int m2, const bf16_t* x, int k,
                                           long row_bytes, const float* g, float eps, bf16_t* h, bf16_t* res) {
    constexpr bool NORM = (MODE & GEMVB_NORM) != 0, ACC = (MODE & GEMVB_ACC) != 0, SWIGLU = (MODE & GEMVB_SWIGLU) != 0;
    constexpr int R = GEMVP_ROWS * RPW;
    static_assert(!SWIGLU || RPW == 1, "SwiGLU pairs the block's warps");
    // (traced builds: the block's first instruction, stamped as p7 once the copies are asked)
    const u64 t_entry = di_trace_now();
    uint4* wbuf;
    float* xs;
    if constexpr (RPW == 1) {
        __shared__ __align__(16) uint4 wst[R * GEMVP_MAXK / 8];
        __shared__ __align__(16) float xst[GEMVP_MAXK];
        wbuf = wst;
        xs = xst;
    } else {
        extern __shared__ __align__(16) uint4 gemvp_dyn[];
        wbuf = gemvp_dyn;
        xs = reinterpret_cast<float*>(gemvp_dyn + R * GEMVP_MAXK / 8);
    }
    __shared__ float red[GEMVB_THREADS / 32];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int nch = k >> 3;
    // Rows warp * RPW .. + RPW of this block; each warp copies its own rows: lane l takes
    // chunks l, l + 32, ... SwiGLU (a gate/up pair of segments of m0 rows each): warp w < 4
    // takes gate row 4 b + w, warp w + 4 the up row of the same index.
    const u8* wr[RPW];
    bf16_t* yr[RPW];
    long rr[RPW];
    bool ok[RPW];
#pragma unroll
    for (int j = 0; j < RPW; j++) {
        long mj;
        constexpr int P = GEMVP_ROWS / 2;
        const long pr = (long)blockIdx.x * P + warp % P;
        const long row = SWIGLU ? pr + (warp < P ? 0 : m0) : (long)blockIdx.x * R + warp * RPW + j;
        ok[j] = gemv_seg(row, w0, w1, w2, y0, y1, y2, m0, m1, m2, wr[j], yr[j], rr[j], mj) &&
                (!SWIGLU || (m1 == m0 && pr < m0));
        wr[j] += rr[j] * row_bytes;
        for (int c = lane; c < nch; c += 32)
            cp_async16_w(&wbuf[(warp * RPW + j) * nch + c], wr[j] + (long)c * 16, ok[j]);
    }
    cp_async_commit();
    // The next launch comes in first thing: its copies before its wait pay even while these
    // rows stream (holding the trigger until they have landed was 2-8% slower, session 38).
    pdl_launch_dependents();
    di_trace_phase_at(7, t_entry);
    pdl_wait();
    float resv[RPW];
#pragma unroll
    for (int j = 0; j < RPW; j++) resv[j] = ACC && ok[j] && lane == 0 ? act_load(res, rr[j]) : 0.0f;
    // The input (times the gain), and its sum of squares.
    float ss = stage_row<NORM>([&](int c, float* v) { act_load8(x + (long)c * 8, v); }, g, xs, nch);
    if (NORM) {
        ss = warp_sum(ss);
        if (lane == 0) red[warp] = ss;
    }
    cp_async_wait_all();
    __syncthreads();
    di_trace_phase(0);
    float rstd = 1.0f;
    if (NORM) {
        // every thread adds the warps' sums in the same order
        float s = 0.0f;
#pragma unroll
        for (int wi = 0; wi < GEMVB_THREADS / 32; wi++) s += red[wi];
        rstd = 1.0f / sqrtf(s / (float)k + eps);
        // This block's slice of the normalized row, as the RMSNorm kernel writes it.
        if (h != nullptr && tid < 8)
            for (long c = blockIdx.x; c < nch; c += gridDim.x) {
                const long e = c * 8 + tid;
                act_store(h, e, act_load(x, e) * rstd * g[e]);
            }
    }
    float part[RPW];
#ifdef DI_X_PER_ROW
    // comparison only: each row's products with the input read again (the earlier loop)
#pragma unroll
    for (int j = 0; j < RPW; j++) part[j] = staged_dot(&wbuf[(warp * RPW + j) * nch], xs, nch, lane);
#else
    staged_dots<RPW>(&wbuf[warp * RPW * nch], nch, xs, nch, lane, part);
#endif
    if constexpr (SWIGLU) {
        // the up warps' sums to the gate warps (rounded as the unfolded products store them)
        __shared__ float up[GEMVP_ROWS / 2];
        const float s = warp_sum(part[0]) * rstd;
        if (warp >= GEMVP_ROWS / 2 && lane == 0) up[warp - GEMVP_ROWS / 2] = act_round(yr[0], s);
        __syncthreads();
        if (warp < GEMVP_ROWS / 2 && ok[0] && lane == 0)
            act_store(yr[0], rr[0], swiglu(act_round(yr[0], s), up[warp]));
    } else {
#pragma unroll
        for (int j = 0; j < RPW; j++) {
            const float acc = warp_sum(part[j]);
            if (ok[j] && lane == 0) {
                const float s = acc * rstd;
                act_store(yr[j], rr[j], s);
                if (ACC) act_store(res, rr[j], resv[j] + act_round(yr[j], s));
            }
        }
    }
    di_trace_phase(1);
}

#define GEMVP_WRAPPER(MODE, MS, RPW, RS)                                                                          \
    extern "C" __global__ void __launch_bounds__(GEMVB_THREADS) gemvp##MS##_bf16w_n1_r##RS##_bf16(               \
        const u8* w0, const u8* w1, const u8* w2, bf16_t* y0, bf16_t* y1, bf16_t* y2, int m0, int m1, int m2,     \
        const bf16_t* x, int n, int k, long row_bytes, const float* g, float eps, bf16_t* h, bf16_t* res) {       \
        gemvp_impl<MODE, RPW>(w0, w1, w2, y0, y1, y2, m0, m1, m2, x, k, row_bytes, g, eps, h, res);              \
    }
GEMVP_WRAPPER(GEMVB_PLAIN, , 1, 8)
GEMVP_WRAPPER(GEMVB_NORM, n, 1, 8)
GEMVP_WRAPPER(GEMVB_ACC, a, 1, 8)
GEMVP_WRAPPER(GEMVB_SWIGLU, s, 1, 8)
GEMVP_WRAPPER(GEMVB_NORM | GEMVB_SWIGLU, ns, 1, 8)
GEMVP_WRAPPER(GEMVB_PLAIN, , GEMVP_WIDE_RPW, 32)
GEMVP_WRAPPER(GEMVB_NORM, n, GEMVP_WIDE_RPW, 32)
GEMVP_WRAPPER(GEMVB_ACC, a, GEMVP_WIDE_RPW, 32)

// gemvb<mode>_<weight>_n<N>_r<R>u<U>_<act>, mode "" (plain), "n" (norm folded in), "a" (add),
// "s" (SwiGLU), "ns" (norm and SwiGLU)
#define GEMVB_WRAPPER(T, S, WT, WS, N, R, U, MODE, MS)                                                            \
    extern "C" __global__ void __launch_bounds__(GEMVB_THREADS) gemvb##MS##_##WS##_n##N##_r##R##u##U##_##S(        \
        const u8* w0, const u8* w1, const u8* w2, T* y0, T* y1, T* y2, int m0, int m1, int m2, const T* x, int n, \
        int k, long row_bytes, const float* g, float eps, T* h, T* res) {                                        \
        gemvb_impl<T, WT, N, R, U, MODE>(w0, w1, w2, y0, y1, y2, m0, m1, m2, x, n, k, row_bytes, g, eps, h, res); \
    }

// Shapes: (R, U) = (4, 2) for k <= 4096, (2, 4) for k <= 8192, (1, 8) beyond; N = 1, 2, 4, 8.
#define GEMVB_SHAPES(T, S, WT, WS, N, MODE, MS)    \
    GEMVB_WRAPPER(T, S, WT, WS, N, 4, 2, MODE, MS) \
    GEMVB_WRAPPER(T, S, WT, WS, N, 2, 4, MODE, MS) \
    GEMVB_WRAPPER(T, S, WT, WS, N, 1, 8, MODE, MS)
#define GEMVB_TOKENS(T, S, WT, WS, MODE, MS)  \
    GEMVB_SHAPES(T, S, WT, WS, 1, MODE, MS)   \
    GEMVB_SHAPES(T, S, WT, WS, 2, MODE, MS)   \
    GEMVB_SHAPES(T, S, WT, WS, 4, MODE, MS)   \
    GEMVB_SHAPES(T, S, WT, WS, 8, MODE, MS)
// The folded modes only for bf16 weights and activations (the Llama-3 shapes).
#define GEMVB_PLAIN_ALL(T, S)                           \
    GEMVB_TOKENS(T, S, WT_BF16, bf16w, GEMVB_PLAIN, )   \
    GEMVB_TOKENS(T, S, WT_F16, f16w, GEMVB_PLAIN, )

GEMVB_PLAIN_ALL(float, f32)
GEMVB_PLAIN_ALL(bf16_t, bf16)
GEMVB_TOKENS(bf16_t, bf16, WT_BF16, bf16w, GEMVB_NORM, n)
GEMVB_TOKENS(bf16_t, bf16, WT_BF16, bf16w, GEMVB_ACC, a)
// SwiGLU pairs rows: shapes (4, 2) and (2, 4) only.
#define GEMVB_SWIGLU_TOKENS(MODE, MS)                                  \
    GEMVB_WRAPPER(bf16_t, bf16, WT_BF16, bf16w, 1, 4, 2, MODE, MS)    \
    GEMVB_WRAPPER(bf16_t, bf16, WT_BF16, bf16w, 1, 2, 4, MODE, MS)    \
    GEMVB_WRAPPER(bf16_t, bf16, WT_BF16, bf16w, 2, 4, 2, MODE, MS)    \
    GEMVB_WRAPPER(bf16_t, bf16, WT_BF16, bf16w, 2, 2, 4, MODE, MS)    \
    GEMVB_WRAPPER(bf16_t, bf16, WT_BF16, bf16w, 4, 4, 2, MODE, MS)    \
    GEMVB_WRAPPER(bf16_t, bf16, WT_BF16, bf16w, 4, 2, 4, MODE, MS)    \
    GEMVB_WRAPPER(bf16_t, bf16, WT_BF16, bf16w, 8, 4, 2, MODE, MS)    \
    GEMVB_WRAPPER(bf16_t, bf16, WT_BF16, bf16w, 8, 2, 4, MODE, MS)
GEMVB_SWIGLU_TOKENS(GEMVB_SWIGLU, s)
GEMVB_SWIGLU_TOKENS(GEMVB_NORM | GEMVB_SWIGLU, ns)
