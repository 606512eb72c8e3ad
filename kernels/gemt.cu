// Skinny GEMM on tensor cores for decode batches of 9..64 tokens: y[t, r] = sum_c W[r, c] x[t, c]
// with bf16 weights and activations, f32 accumulation (mma.sync m16n8k16; the weight rows are
// the M dimension, the tokens N). Meant to be bound by streaming the weights once:
// - A block of 8 warps owns GEMT_ROWS = 128 output rows (16 a warp) and one `splits`-th of k;
//   the `splits` blocks of a row tile (1, 2, 4 or 8, chosen at launch) form a thread-block
//   cluster and add their partial sums through distributed shared memory, in rank order
//   (deterministic: a token's outputs do not depend on how many tokens ride along or on which
//   block finishes first).
// - Each lane loads its weights with 16-byte loads straight into mma operands: the dot product
//   does not care in which order k is visited, so lane (g, t) of a warp reads 8 consecutive
//   weights of rows g and g + 8 at k0 + 8 t, and the activations of token g at the same k
//   (one 16-byte shared-memory load serves two mmas). 8 to 16 such loads per lane are in
//   flight (half a chunk ahead).
// - The activations of the block's k range come through shared memory in chunks of GEMT_KC,
//   double-buffered with cp.async (rows past n and k past the range are zero-filled).
// Status (H200, Llama-3-8B batch 32, ncu with 8 splits): 1.7-1.9 TB/s, about half of what
// cuBLAS reaches on the same products, with only ~30% of warp time stalled on global loads;
// hence opt-in (DEEPINFER_CUDA_GEMT=1). See doc/benchmarks.md.
// MODE GEMT_SWIGLU pairs gate and up (w0, w1 of equal rows): a block owns 64 gate rows (warps
// 0-3) and the same 64 up rows (warps 4-7) and writes y1 = up, y0 = silu(gate) * up, each
// rounded as the separate products and `silu_mul` round them.
#define GEMT_THREADS 256
#define GEMT_ROWS 128
// Most blocks of a cluster (the launch picks 1..GEMT_SPLITS; 8, the portable cluster size, is
// the default).
#define GEMT_SPLITS 8
#define GEMT_KC 256
// Row strides (elements): the 64-byte pad puts the two tokens a quarter-warp reads in
// different banks.
#define GEMT_XS (GEMT_KC + 32)
#define GEMT_RS (GEMT_ROWS + 4)
#define GEMT_PLAIN 0
#define GEMT_SWIGLU 1

__device__ __forceinline__ void gemt_mma(float* c, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// Four k-steps of 32 (one half chunk) of a lane's two rows, zero past `hi` or off the matrix.
__device__ __forceinline__ void gemt_load(uint4 (&a)[4], uint4 (&b)[4], const u8* pa, const u8* pb, bool oka,
                                          bool okb, int k0, int hi) {
#pragma unroll
    for (int s = 0; s < 4; s++) {
        const int kk = k0 + s * 32;
        const bool in = kk < hi;
        a[s] = in && oka ? ld_stream16(pa + (long)kk * 2) : make_uint4(0, 0, 0, 0);
        b[s] = in && okb ? ld_stream16(pb + (long)kk * 2) : make_uint4(0, 0, 0, 0);
    }
}

template <int NT>
__device__ __forceinline__ void gemt_half(float (&acc)[NT][4], const uint4 (&a)[4], const uint4 (&b)[4],
                                          const bf16_t* xb) {
#pragma unroll
    for (int s = 0; s < 4; s++) {
#pragma unroll
        for (int j = 0; j < NT; j++) {
            const uint4 xv = *reinterpret_cast<const uint4*>(xb + j * 8 * GEMT_XS + s * 32);
            gemt_mma(acc[j], a[s].x, b[s].x, a[s].y, b[s].y, xv.x, xv.y);
            gemt_mma(acc[j], a[s].z, b[s].z, a[s].w, b[s].w, xv.z, xv.w);
        }
    }
}

// Dynamic shared memory: two chunks of NT * 8 token rows (the partial sums reuse it).
template <int NT, int MODE>
__device__ __forceinline__ void gemt_impl(const u8* w0, const u8* w1, const u8* w2, bf16_t* y0, bf16_t* y1,
                                          bf16_t* y2, int m0, int m1, int m2, const bf16_t* x, int n, int k,
                                          long row_bytes, int splits) {
    constexpr int TP = NT * 8;
    extern __shared__ __align__(16) unsigned char gemt_smem[];
    bf16_t* xs = reinterpret_cast<bf16_t*>(gemt_smem);
    float* red = reinterpret_cast<float*>(gemt_smem);
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
    pdl_launch_dependents();
    const int split = blockIdx.x;  // the rank in the cluster: cluster dims are (splits, 1, 1)
    int tile = blockIdx.y, row0, wrow;
    const u8* w;
    bf16_t* y;
    int m;
    if (MODE == GEMT_SWIGLU) {
        row0 = tile * (GEMT_ROWS / 2);
        w = warp < 4 ? w0 : w1;
        y = y0;
        m = m0;
        wrow = row0 + (warp & 3) * 16 + g;
    } else {
        const int t0 = (m0 + GEMT_ROWS - 1) / GEMT_ROWS, t1 = (m1 + GEMT_ROWS - 1) / GEMT_ROWS;
        if (tile < t0) {
            w = w0; y = y0; m = m0;
        } else if (tile < t0 + t1) {
            tile -= t0; w = w1; y = y1; m = m1;
        } else {
            tile -= t0 + t1; w = w2; y = y2; m = m2;
        }
        row0 = tile * GEMT_ROWS;
        wrow = row0 + warp * 16 + g;
    }
    const bool oka = wrow < m, okb = wrow + 8 < m;
    const u8* pa = w + (long)(oka ? wrow : 0) * row_bytes + t * 16;
    const u8* pb = w + (long)(okb ? wrow + 8 : 0) * row_bytes + t * 16;
    const int span = ((k + splits - 1) / splits + 31) & ~31;
    const int lo = min(k, split * span), hi = min(k, lo + span);
    const int chunks = (hi - lo + GEMT_KC - 1) / GEMT_KC;
    // Chunk c of the activations into buffer `buf`.
    auto stage = [&](int c, int buf) {
        const int k0 = lo + c * GEMT_KC;
        bf16_t* dst = xs + buf * TP * GEMT_XS;
        for (int i = tid; i < TP * (GEMT_KC / 8); i += GEMT_THREADS) {
            const int r = i / (GEMT_KC / 8), kk = k0 + (i % (GEMT_KC / 8)) * 8;
            const bool ok = r < n && kk < hi;
            cp_async16(dst + r * GEMT_XS + (kk - k0), ok ? x + (long)r * k + kk : x, ok);
        }
        asm volatile("cp.async.commit_group;");
    };
    float acc[NT][4];
#pragma unroll
    for (int j = 0; j < NT; j++) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.0f;
    uint4 a0[4], b0[4], a1[4], b1[4];
    if (chunks > 0) gemt_load(a0, b0, pa, pb, oka, okb, lo, hi - t * 8);
    pdl_wait();
    if (chunks > 0) stage(0, 0);
    for (int c = 0; c < chunks; c++) {
        if (c + 1 < chunks) {
            stage(c + 1, (c + 1) & 1);
            asm volatile("cp.async.wait_group 1;" ::: "memory");
        } else {
            asm volatile("cp.async.wait_group 0;" ::: "memory");
        }
        __syncthreads();
        const int k0 = lo + c * GEMT_KC;
        const bf16_t* xb = xs + (c & 1) * TP * GEMT_XS + g * GEMT_XS + t * 8;
        gemt_load(a1, b1, pa, pb, oka, okb, k0 + GEMT_KC / 2, hi - t * 8);
        gemt_half<NT>(acc, a0, b0, xb);
        if (c + 1 < chunks) gemt_load(a0, b0, pa, pb, oka, okb, k0 + GEMT_KC, hi - t * 8);
        gemt_half<NT>(acc, a1, b1, xb + GEMT_KC / 2);
        __syncthreads();
    }
    // This block's partial sums, [token][row of the tile], for the cluster to add up.
#pragma unroll
    for (int j = 0; j < NT; j++) {
        const int tok = j * 8 + 2 * t, r = warp * 16 + g;
        red[tok * GEMT_RS + r] = acc[j][0];
        red[(tok + 1) * GEMT_RS + r] = acc[j][1];
        red[tok * GEMT_RS + r + 8] = acc[j][2];
        red[(tok + 1) * GEMT_RS + r + 8] = acc[j][3];
    }
    cluster_sync();
    // Block `split` finishes 1/splits of the tile's rows, 4 rows of a token at a time (with
    // SwiGLU 4 gate rows and the matching up rows).
    constexpr int OUT_ROWS = MODE == GEMT_SWIGLU ? GEMT_ROWS / 2 : GEMT_ROWS;
    const int per = OUT_ROWS / splits;  // a multiple of 4: splits is 1, 2, 4 or 8
    for (int i = tid; i < n * (per / 4); i += GEMT_THREADS) {
        const int tok = i / (per / 4), r = split * per + (i % (per / 4)) * 4;
        const u32 base = (u32)__cvta_generic_to_shared(red + tok * GEMT_RS + r);
        float4 s = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        float4 u = s;
        for (int p = 0; p < splits; p++) {
            const float4 v = cluster_ld4(base, p);
            s.x += v.x; s.y += v.y; s.z += v.z; s.w += v.w;
            if (MODE == GEMT_SWIGLU) {
                const float4 vu = cluster_ld4(base + (GEMT_ROWS / 2) * 4, p);
                u.x += vu.x; u.y += vu.y; u.z += vu.z; u.w += vu.w;
            }
        }
        if (MODE == GEMT_SWIGLU) {
            const float gv[4] = {s.x, s.y, s.z, s.w}, uv[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
            for (int j = 0; j < 4; j++) {
                const int row = row0 + r + j;
                if (row < m) {
                    const float gr = act_round(y0, gv[j]), ur = act_round(y1, uv[j]);
                    const long e = (long)tok * m + row;
                    act_store(y1, e, ur);
                    act_store(y0, e, swiglu(gr, ur));
                }
            }
        } else {
            const float sv[4] = {s.x, s.y, s.z, s.w};
#pragma unroll
            for (int j = 0; j < 4; j++) {
                const int row = row0 + r + j;
                if (row < m) act_store(y, (long)tok * m + row, sv[j]);
            }
        }
    }
    // No block may leave while a peer still reads its shared memory.
    cluster_sync();
}

// gemt<mode>_t<tokens>: mode "" (plain, up to three segments) or "s" (gate/up with SwiGLU).
#define GEMT_WRAPPER(NT, MODE, MS)                                                                                 \
    extern "C" __global__ void __launch_bounds__(GEMT_THREADS, 2) gemt##MS##_t##NT(                             \
        const u8* w0, const u8* w1, const u8* w2, bf16_t* y0, bf16_t* y1, bf16_t* y2, int m0, int m1, int m2,       \
        const bf16_t* x, int n, int k, long row_bytes, int splits) {                                              \
        gemt_impl<NT / 8, MODE>(w0, w1, w2, y0, y1, y2, m0, m1, m2, x, n, k, row_bytes, splits);                  \
    }
#define GEMT_TOKENS(MODE, MS)      \
    GEMT_WRAPPER(16, MODE, MS)     \
    GEMT_WRAPPER(24, MODE, MS)     \
    GEMT_WRAPPER(32, MODE, MS)     \
    GEMT_WRAPPER(48, MODE, MS)     \
    GEMT_WRAPPER(64, MODE, MS)
GEMT_TOKENS(GEMT_PLAIN, )
GEMT_TOKENS(GEMT_SWIGLU, s)

// ---- Row-streaming products on tensor cores (bf16 weights and inputs, f32 sums) ----
//
// out[a, r] = W[r, :] . x[a / xdiv, :] for the columns a of a group (the grouped expert
// products in moe.cu, MLA's V up-projection in mla.cu); with two matrices (gate and up)
// out[a, r] = silu(W1[r] . x) * (W2[r] . x). A block of ROWMMA_WARPS warps owns ROWMMA_ROWS rows
// (`rowmma_row0`), a warp 16 of them over their whole length and every column of the group, 8 * NT
// at a time (up to ROWMMA_NT tiles; a further set of columns streams the rows again). The
// columns are the N dimension of mma.sync m16n8k16: as in gemt above, lane (g, t) loads 16 bytes
// of rows g and g + 8 at k0 + 8 t straight into mma operands and the input of the tile's column
// g at the same k (through L1, since every warp of the block reads it). A lane keeps one stage
// of loads (128 bytes: 64 k of two matrices or 128 k of one) in flight while it multiplies the
// stage before it. Each column's sums are taken in the same order whichever columns share its
// group, so a column's result does not depend on the others.
#define ROWMMA_WARPS 4
#define ROWMMA_THREADS (32 * ROWMMA_WARPS)
#define ROWMMA_ROWS (16 * ROWMMA_WARPS)
#define ROWMMA_NT 4
// Blocks an SM the expert products are compiled for (at most 128 registers a thread; the
// gate/up kernel spills a little in its 4-tile groups). On the H200 a Moonlight batch-64 decode
// step took 15.05 ms with 4 against 16.28 ms with no bound (164 registers, 3 blocks an SM).
// `DEEPINFER_CUDA_DEFINE=ROWMMA_MINB=N` compiles another bound.
#ifndef ROWMMA_MINB
#define ROWMMA_MINB 4
#endif

// A lane's loads of one stage: [matrix][row g, row g + 8][32-wide k step].
template <int NM>
struct RowmmaStage {
    static constexpr int S = 4 / NM;  // k steps of 32
    uint4 w[NM][2][S];
};

// Column p's index a: rows[p], or p * stride + add without a table.
struct RowmmaMap {
    const int* rows;
    int stride, add;
    __device__ __forceinline__ int at(int p) const { return rows != nullptr ? rows[p] : p * stride + add; }
};

template <int NM>
__device__ __forceinline__ void rowmma_load(RowmmaStage<NM>& st, const u8* const (&wr)[NM][2], const bool (&ok)[2],
                                            int k0, int lim) {
#pragma unroll
    for (int s = 0; s < RowmmaStage<NM>::S; s++) {
        const int kk = k0 + s * 32;  // this lane's 8 values start at kk + 8 t: in the row while kk < lim
        const bool in = kk < lim;
#pragma unroll
        for (int m = 0; m < NM; m++)
#pragma unroll
            for (int h = 0; h < 2; h++)
                st.w[m][h][s] = in && ok[h] ? ld_stream16(wr[m][h] + (long)kk * 2) : make_uint4(0, 0, 0, 0);
    }
}

// Steps wholly past the row (the same for the whole warp, as mma.sync needs) are skipped; a
// lane's values past it are zero.
template <int NM, int NT>
__device__ __forceinline__ void rowmma_mul(float (&acc)[NM][NT][4], const RowmmaStage<NM>& st,
                                           const bf16_t* const (&xr)[NT], int k0, int cols, int lim) {
#pragma unroll
    for (int s = 0; s < RowmmaStage<NM>::S; s++) {
        const int kk = k0 + s * 32;
        if (kk >= cols) break;
        const bool in = kk < lim;
#pragma unroll
        for (int j = 0; j < NT; j++) {
            const uint4 xv = in ? __ldg(reinterpret_cast<const uint4*>(xr[j] + kk)) : make_uint4(0, 0, 0, 0);
#pragma unroll
            for (int m = 0; m < NM; m++) {
                gemt_mma(acc[m][j], st.w[m][0][s].x, st.w[m][1][s].x, st.w[m][0][s].y, st.w[m][1][s].y, xv.x, xv.y);
                gemt_mma(acc[m][j], st.w[m][0][s].z, st.w[m][1][s].z, st.w[m][0][s].w, st.w[m][1][s].w, xv.z, xv.w);
            }
        }
    }
}

// Columns p0 .. p0 + n (n <= 8 * NT) of a warp's 16 rows from r0.
template <int NM, int NT, typename OT>
__device__ __forceinline__ void rowmma_group(OT* out, const bf16_t* x, const u8* const (&wr)[NM][2],
                                             const bool (&ok)[2], RowmmaMap map, int p0, int n, int xdiv, int cols,
                                             int out_rows, int r0) {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const bf16_t* xr[NT];
#pragma unroll
    for (int j = 0; j < NT; j++) {
        const int i = j * 8 + g;
        xr[j] = x + (long)(map.at(p0 + (i < n ? i : 0)) / xdiv) * cols + t * 8;
    }
    float acc[NM][NT][4];
#pragma unroll
    for (int m = 0; m < NM; m++)
#pragma unroll
        for (int j = 0; j < NT; j++) acc[m][j][0] = acc[m][j][1] = acc[m][j][2] = acc[m][j][3] = 0.0f;
    constexpr int KS = 32 * RowmmaStage<NM>::S;
    const int lim = cols - t * 8;
    // two stages taken in turn, so one is in flight while the other is multiplied
    RowmmaStage<NM> s0, s1;
    rowmma_load<NM>(s0, wr, ok, 0, lim);
    for (int k0 = 0; k0 < cols; k0 += 2 * KS) {
        rowmma_load<NM>(s1, wr, ok, k0 + KS, lim);
        rowmma_mul<NM, NT>(acc, s0, xr, k0, cols, lim);
        rowmma_load<NM>(s0, wr, ok, k0 + 2 * KS, lim);
        rowmma_mul<NM, NT>(acc, s1, xr, k0 + KS, cols, lim);
    }
#pragma unroll
    for (int j = 0; j < NT; j++)
#pragma unroll
        for (int q = 0; q < 4; q++) {
            const int i = j * 8 + 2 * t + (q & 1), r = r0 + g + (q >> 1) * 8;
            if (i < n && r < out_rows) {
                const long o = (long)map.at(p0 + i) * out_rows + r;
                if (NM == 2) {
                    const float gs = acc[0][j][q], us = acc[1][j][q];
                    act_store(out, o, swiglu(gs, us));
                } else {
                    act_store(out, o, acc[0][j][q]);
                }
            }
        }
}

// The first of this warp's 16 rows when blockIdx.y numbers the blocks' ROWMMA_ROWS-row chunks.
__device__ __forceinline__ int rowmma_row0() { return blockIdx.y * ROWMMA_ROWS + (threadIdx.x >> 5) * 16; }

// Columns a0 .. a1 of this warp's 16 rows from r0 of the matrices at w1 (and w2), rows of
// cols values.
template <int NM, typename OT>
__device__ __forceinline__ void rowmma_rows(OT* out, const bf16_t* x, const u8* w1, const u8* w2, RowmmaMap map,
                                            int a0, int a1, int xdiv, int cols, int out_rows, int r0) {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    if (r0 >= out_rows) return;
    const bool ok[2] = {r0 + g < out_rows, r0 + g + 8 < out_rows};
    const long row_bytes = (long)cols * 2;
    const u8* wr[NM][2];
#pragma unroll
    for (int m = 0; m < NM; m++)
#pragma unroll
        for (int h = 0; h < 2; h++)
            wr[m][h] = (m == 0 ? w1 : w2) + t * 16 + (ok[h] ? (long)(r0 + g + h * 8) : 0) * row_bytes;
    for (int p0 = a0; p0 < a1; p0 += 8 * ROWMMA_NT) {
        const int n = min(8 * ROWMMA_NT, a1 - p0);
        if (n <= 8) {
            rowmma_group<NM, 1, OT>(out, x, wr, ok, map, p0, n, xdiv, cols, out_rows, r0);
        } else if (n <= 16) {
            rowmma_group<NM, 2, OT>(out, x, wr, ok, map, p0, n, xdiv, cols, out_rows, r0);
        } else if (n <= 24) {
            rowmma_group<NM, 3, OT>(out, x, wr, ok, map, p0, n, xdiv, cols, out_rows, r0);
        } else {
            rowmma_group<NM, 4, OT>(out, x, wr, ok, map, p0, n, xdiv, cols, out_rows, r0);
        }
    }
}
