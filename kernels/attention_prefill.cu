// Paged causal attention for prefill and long chunks, flash-attention style on the bf16
// tensor cores (mma.sync m16n8k16, fp32 accumulation). A block of 4 warps takes 64 query
// tokens of one sequence for one query head (16 rows per warp) and walks the sequence's keys
// in tiles of 64, gathered from the paged cache through its block table into shared memory
// (rows swizzled by 16-byte chunk so ldmatrix is conflict-free). Scores stay in registers:
// the S accumulator is re-packed as the A operand of P.V (FA2's register reuse), with an
// online softmax in base 2. Grouped-query heads share their KV head; sliding windows mask.
//
// Work items (`tiles`: [n_tiles][2] = sequence, first query index) are walked from the last,
// so the longest causal rows start first.

#define FA_BM 64
#define FA_BN 64
#define FA_THREADS 128

__device__ __forceinline__ void ldsm_x4(u32& r0, u32& r1, u32& r2, u32& r3, const bf16_t* p) {
    const u32 a = (u32)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(a));
}

__device__ __forceinline__ void ldsm_x4_t(u32& r0, u32& r1, u32& r2, u32& r3, const bf16_t* p) {
    const u32 a = (u32)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(a));
}

__device__ __forceinline__ void mma_bf16_16816(float* c, const u32* a, u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Offset of element (row, col) in a [rows][D] bf16 tile whose 16-byte chunks are XOR-swizzled.
template <int D>
__device__ __forceinline__ int swz(int row, int col) {
    return row * D + ((((col >> 3) ^ (row & 7)) << 3) | (col & 7));
}

__device__ __forceinline__ uint4 load8_as_bf16(const float* p) {
    float f[8];
    act_load8(p, f);
    return make_uint4(pack_bf16x2(f[0], f[1]), pack_bf16x2(f[2], f[3]), pack_bf16x2(f[4], f[5]),
                      pack_bf16x2(f[6], f[7]));
}
__device__ __forceinline__ uint4 load8_as_bf16(const bf16_t* p) { return *reinterpret_cast<const uint4*>(p); }

// The pieces both 64-query kernels share: the query tile, one K/V tile's update, the output.

// Stages the block's query rows [row0, row0 + qn) of head h in `sq` (zeros past qn) and loads
// this warp's 16 rows as mma A fragments.
template <typename T, int D>
__device__ __forceinline__ void fa_load_q(u32 (&qf)[D / 16][4], bf16_t* sq, const T* q, long row0, int qn,
                                          int n_heads, int h) {
    constexpr int CH = D / 8;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    for (int e = tid; e < FA_BM * CH; e += FA_THREADS) {
        const int r = e / CH, c = e % CH;
        uint4 val = make_uint4(0, 0, 0, 0);
        if (r < qn) val = load8_as_bf16(q + ((long)(row0 + r) * n_heads + h) * D + c * 8);
        *reinterpret_cast<uint4*>(&sq[swz<D>(r, c * 8)]) = val;
    }
    __syncthreads();
#pragma unroll
    for (int kk = 0; kk < D / 16; kk++) {
        ldsm_x4(qf[kk][0], qf[kk][1], qf[kk][2], qf[kk][3], &sq[swz<D>(warp * 16 + (lane & 15), kk * 16 + (lane >> 4) * 8)]);
    }
}

// One 64-key tile staged in sk/sv (keys kt..kt+63): S = Q K^T on the tensor cores, the causal
// and window mask (this thread's rows are at positions qrow0 and qrow0 + 8), the online softmax
// in base 2, O += P V with P re-packed from the S registers.
template <int D>
__device__ __forceinline__ void fa_tile(float (&o)[D / 8][4], float (&mrow)[2], float (&lrow)[2],
                                        const u32 (&qf)[D / 16][4], const bf16_t* sk, const bf16_t* sv, int kt,
                                        int qrow0, int window, float scale_log2) {
    const int lane = threadIdx.x & 31;
    float s[FA_BN / 8][4];
#pragma unroll
    for (int i = 0; i < FA_BN / 8; i++) s[i][0] = s[i][1] = s[i][2] = s[i][3] = 0.0f;
#pragma unroll
    for (int kk = 0; kk < D / 16; kk++) {
#pragma unroll
        for (int np = 0; np < FA_BN / 16; np++) {
            u32 b0, b1, b2, b3;
            ldsm_x4(b0, b1, b2, b3, &sk[swz<D>(np * 16 + (lane & 7) + ((lane >> 4) << 3), kk * 16 + (((lane >> 3) & 1) << 3))]);
            mma_bf16_16816(s[2 * np], qf[kk], b0, b1);
            mma_bf16_16816(s[2 * np + 1], qf[kk], b2, b3);
        }
    }
#pragma unroll
    for (int nt = 0; nt < FA_BN / 8; nt++) {
#pragma unroll
        for (int e = 0; e < 4; e++) {
            const int key = kt + nt * 8 + 2 * (lane & 3) + (e & 1);
            const int qp = qrow0 + (e >> 1) * 8;
            const bool ok = key <= qp && (window <= 0 || key > qp - window);
            s[nt][e] = ok ? s[nt][e] * scale_log2 : NEG_INF;
        }
    }
#pragma unroll
    for (int rh = 0; rh < 2; rh++) {
        float mx = NEG_INF;
#pragma unroll
        for (int nt = 0; nt < FA_BN / 8; nt++) mx = fmaxf(mx, fmaxf(s[nt][2 * rh], s[nt][2 * rh + 1]));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        const float mnew = fmaxf(mrow[rh], mx);
        const float muse = mnew == NEG_INF ? 0.0f : mnew;
        const float corr = exp2f(mrow[rh] - muse);
        mrow[rh] = mnew;
        float rs = 0.0f;
#pragma unroll
        for (int nt = 0; nt < FA_BN / 8; nt++) {
            const float p0 = exp2f(s[nt][2 * rh] - muse), p1 = exp2f(s[nt][2 * rh + 1] - muse);
            s[nt][2 * rh] = p0;
            s[nt][2 * rh + 1] = p1;
            rs += p0 + p1;
        }
        lrow[rh] = lrow[rh] * corr + rs;
#pragma unroll
        for (int dt = 0; dt < D / 8; dt++) {
            o[dt][2 * rh] *= corr;
            o[dt][2 * rh + 1] *= corr;
        }
    }
#pragma unroll
    for (int kk = 0; kk < FA_BN / 16; kk++) {
        u32 a[4];
        a[0] = pack_bf16x2(s[2 * kk][0], s[2 * kk][1]);
        a[1] = pack_bf16x2(s[2 * kk][2], s[2 * kk][3]);
        a[2] = pack_bf16x2(s[2 * kk + 1][0], s[2 * kk + 1][1]);
        a[3] = pack_bf16x2(s[2 * kk + 1][2], s[2 * kk + 1][3]);
#pragma unroll
        for (int dp = 0; dp < D / 16; dp++) {
            u32 b0, b1, b2, b3;
            ldsm_x4_t(b0, b1, b2, b3, &sv[swz<D>(kk * 16 + (lane & 7) + (((lane >> 3) & 1) << 3), dp * 16 + ((lane >> 4) << 3))]);
            mma_bf16_16816(o[2 * dp], a, b0, b1);
            mma_bf16_16816(o[2 * dp + 1], a, b2, b3);
        }
    }
}

// Normalizes this warp's rows and writes those below qn to out (rows row0.., head h).
template <typename T, int D>
__device__ __forceinline__ void fa_store(T* out, const float (&o)[D / 8][4], const float (&lrow)[2], long row0,
                                         int qn, int n_heads, int h) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
#pragma unroll
    for (int rh = 0; rh < 2; rh++) {
        float l = lrow[rh];
        l += __shfl_xor_sync(0xffffffffu, l, 1);
        l += __shfl_xor_sync(0xffffffffu, l, 2);
        const float inv = l > 0.0f ? 1.0f / l : 0.0f;
        const int row = warp * 16 + (lane >> 2) + rh * 8;
        if (row < qn) {
            const long base = ((long)(row0 + row) * n_heads + h) * D;
#pragma unroll
            for (int dt = 0; dt < D / 8; dt++) {
                const int d = dt * 8 + 2 * (lane & 3);
                act_store(out, base + d, o[dt][2 * rh] * inv);
                act_store(out, base + d + 1, o[dt][2 * rh + 1] * inv);
            }
        }
    }
}

template <typename T, int D>
__device__ void attn_prefill_impl(T* out, const T* q, const bf16_t* kc, const bf16_t* vc, const int* tiles,
                                  int n_tiles, const int* seq_start, const int* seq_len, const int* seq_pos,
                                  const int* tables, int table_width, int n_heads, int n_kv_heads, int block_size,
                                  float scale_log2, int window) {
    constexpr int CH = D / 8;
    __shared__ __align__(16) bf16_t sq[FA_BM * D];
    __shared__ __align__(16) bf16_t sk[FA_BN * D];
    __shared__ __align__(16) bf16_t sv[FA_BN * D];

    const int tile = n_tiles - 1 - blockIdx.x;
    const int si = tiles[2 * tile], q0 = tiles[2 * tile + 1];
    const int h = blockIdx.y;
    const int g = h / (n_heads / n_kv_heads);
    const int start = seq_start[si], len = seq_len[si], pos = seq_pos[si];
    const int qn = min(FA_BM, len - q0);
    const int* table = tables + (long)si * table_width;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;

    u32 qf[D / 16][4];
    fa_load_q<T, D>(qf, sq, q, start + q0, qn, n_heads, h);

    float o[D / 8][4];
#pragma unroll
    for (int i = 0; i < D / 8; i++) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.0f;
    float mrow[2] = {NEG_INF, NEG_INF}, lrow[2] = {0.0f, 0.0f};
    const int qrow0 = pos + q0 + warp * 16 + (lane >> 2);  // position of this thread's first row
    const int qfirst = pos + q0, qlast = pos + q0 + qn - 1;
    int kstart = window > 0 ? max(0, qfirst + 1 - window) : 0;
    kstart = kstart / FA_BN * FA_BN;

    for (int kt = kstart; kt <= qlast; kt += FA_BN) {
        __syncthreads();
        for (int e = tid; e < FA_BN * CH; e += FA_THREADS) {
            const int r = e / CH, c = e % CH;
            const int j = kt + r;
            uint4 kv = make_uint4(0, 0, 0, 0), vv = make_uint4(0, 0, 0, 0);
            if (j <= qlast) {
                const long slot = (long)table[j / block_size] * block_size + j % block_size;
                const long off = (slot * n_kv_heads + g) * D + c * 8;
                kv = *reinterpret_cast<const uint4*>(kc + off);
                vv = *reinterpret_cast<const uint4*>(vc + off);
            }
            *reinterpret_cast<uint4*>(&sk[swz<D>(r, c * 8)]) = kv;
            *reinterpret_cast<uint4*>(&sv[swz<D>(r, c * 8)]) = vv;
        }
        __syncthreads();

        fa_tile<D>(o, mrow, lrow, qf, sk, sv, kt, qrow0, window, scale_log2);
    }

    fa_store<T, D>(out, o, lrow, start + q0, qn, n_heads, h);
}

// The same computation with the K/V tiles double-buffered: while a tile is multiplied, the
// next one streams into the other buffer with cp.async (16-byte copies, zero-filled past the
// context). Shared memory: Q tile + 2 x (K, V) tiles, dynamic (80 KB at D = 128).

template <typename T, int D>
__device__ void attn_prefill2_impl(T* out, const T* q, const bf16_t* kc, const bf16_t* vc, const int* tiles,
                                   int n_tiles, const int* seq_start, const int* seq_len, const int* seq_pos,
                                   const int* tables, int table_width, int n_heads, int n_kv_heads, int block_size,
                                   float scale_log2, int window) {
    constexpr int CH = D / 8;
    extern __shared__ __align__(16) bf16_t smem[];
    bf16_t* sq = smem;
    bf16_t* skv = smem + FA_BM * D;  // stage s: K at skv + s * 2 * FA_BN * D, V right after

    const int tile = n_tiles - 1 - blockIdx.x;
    const int si = tiles[2 * tile], q0 = tiles[2 * tile + 1];
    const int h = blockIdx.y;
    const int g = h / (n_heads / n_kv_heads);
    const int start = seq_start[si], len = seq_len[si], pos = seq_pos[si];
    const int qn = min(FA_BM, len - q0);
    const int* table = tables + (long)si * table_width;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int qfirst = pos + q0, qlast = pos + q0 + qn - 1;
    int kstart = window > 0 ? max(0, qfirst + 1 - window) : 0;
    kstart = kstart / FA_BN * FA_BN;
    const int n_kt = (qlast - kstart) / FA_BN + 1;

    auto issue = [&](int it) {
        const int kt = kstart + it * FA_BN;
        bf16_t* sk = skv + (it & 1) * 2 * FA_BN * D;
        bf16_t* sv = sk + FA_BN * D;
        for (int e = tid; e < FA_BN * CH; e += FA_THREADS) {
            const int r = e / CH, c = e % CH;
            const int j = kt + r;
            const bool ok = j <= qlast;
            long off = 0;
            if (ok) {
                const long slot = (long)table[j / block_size] * block_size + j % block_size;
                off = (slot * n_kv_heads + g) * D + c * 8;
            }
            cp_async16(&sk[swz<D>(r, c * 8)], kc + off, ok);
            cp_async16(&sv[swz<D>(r, c * 8)], vc + off, ok);
        }
        asm volatile("cp.async.commit_group;");
    };

    issue(0);
    u32 qf[D / 16][4];
    fa_load_q<T, D>(qf, sq, q, start + q0, qn, n_heads, h);

    float o[D / 8][4];
#pragma unroll
    for (int i = 0; i < D / 8; i++) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.0f;
    float mrow[2] = {NEG_INF, NEG_INF}, lrow[2] = {0.0f, 0.0f};
    const int qrow0 = pos + q0 + warp * 16 + (lane >> 2);

    for (int it = 0; it < n_kt; it++) {
        if (it + 1 < n_kt) {
            issue(it + 1);
            asm volatile("cp.async.wait_group 1;");
        } else {
            asm volatile("cp.async.wait_group 0;");
        }
        __syncthreads();
        const int kt = kstart + it * FA_BN;
        const bf16_t* sk = skv + (it & 1) * 2 * FA_BN * D;
        const bf16_t* sv = sk + FA_BN * D;

        fa_tile<D>(o, mrow, lrow, qf, sk, sv, kt, qrow0, window, scale_log2);
        __syncthreads();  // this stage is refilled two iterations on
    }

    fa_store<T, D>(out, o, lrow, start + q0, qn, n_heads, h);
}

#define PREFILL_WRAPPER(T, S, D)                                                                                   \
    extern "C" __global__ void __launch_bounds__(FA_THREADS) attn_prefill_d##D##_##S(                            \
        T* out, const T* q, const bf16_t* kc, const bf16_t* vc, const int* tiles, int n_tiles, const int* seq_start, \
        const int* seq_len, const int* seq_pos, const int* tables, int table_width, int n_heads, int n_kv_heads,    \
        int block_size, float scale_log2, int window) { PDL_ENTRY();                                                            \
        attn_prefill_impl<T, D>(out, q, kc, vc, tiles, n_tiles, seq_start, seq_len, seq_pos, tables, table_width,  \
                                n_heads, n_kv_heads, block_size, scale_log2, window);                              \
    }

#define PREFILL2_WRAPPER(T, S, D)                                                                                  \
    extern "C" __global__ void __launch_bounds__(FA_THREADS) attn_prefill2_d##D##_##S(                           \
        T* out, const T* q, const bf16_t* kc, const bf16_t* vc, const int* tiles, int n_tiles, const int* seq_start, \
        const int* seq_len, const int* seq_pos, const int* tables, int table_width, int n_heads, int n_kv_heads,    \
        int block_size, float scale_log2, int window) { PDL_ENTRY();                                                            \
        attn_prefill2_impl<T, D>(out, q, kc, vc, tiles, n_tiles, seq_start, seq_len, seq_pos, tables, table_width, \
                                 n_heads, n_kv_heads, block_size, scale_log2, window);                             \
    }

PREFILL2_WRAPPER(float, f32, 64)
PREFILL2_WRAPPER(float, f32, 128)
PREFILL2_WRAPPER(bf16_t, bf16, 64)
PREFILL2_WRAPPER(bf16_t, bf16, 128)

PREFILL_WRAPPER(float, f32, 64)
PREFILL_WRAPPER(float, f32, 128)
PREFILL_WRAPPER(bf16_t, bf16, 64)
PREFILL_WRAPPER(bf16_t, bf16, 128)

// ---------------------------------------------------------------------------------------------
// Wide variant (`attn_prefill3`, the default): a block of NW warps takes 128 query tokens of
// one sequence for one query head, each warp MT x 16 consecutive rows, so every K and V
// fragment read from shared memory feeds MT MMAs (instantiated as 4 warps of 32 rows: two
// blocks of 128 threads per SM, about 255 registers each). Keys are walked in tiles of 64
// through a ring of `STAGES` cp.async buffers with one barrier per tile: at the top of tile
// `it` every warp has finished tile `it-1`, so its buffer is refilled with tile
// `it + STAGES - 1` while `it` is multiplied. Q stays in shared memory (fragments reloaded
// per tile). Only tiles that cross a warp's diagonal (or its window's edge) are masked; a warp
// skips tiles wholly past its rows. Scores stay raw until the exponent (p = 2^(s * scale *
// log2e - m): one FFMA and one MUFU.EX2 each), and O is rescaled only when some row's maximum
// moved (the scale must be positive; the host falls back otherwise).
//
// Work items: the engine's 64-query list (`tiles`, PREFILL_TILE in step.rs); a block takes
// the item of its y index counted from the last (longest causal rows first) and its successor,
// and blocks whose item starts at an odd multiple of 64 leave at once. x is the query head, so
// the heads sharing a KV head run side by side and read its tiles from L2.
#define FW_BM 128
#define FW_BN 64

__device__ __forceinline__ float fast_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

__device__ __forceinline__ void store2(float* p, long i, float a, float b) {
    *reinterpret_cast<float2*>(p + i) = make_float2(a, b);
}
__device__ __forceinline__ void store2(bf16_t* p, long i, float a, float b) {
    *reinterpret_cast<u32*>(p + i) = pack_bf16x2(a, b);
}

// The wide kernel's running state for a warp's MT x 16 rows: O zero, row maxima -inf, sums 0.
template <int DV, int MT>
__device__ __forceinline__ void fw_init(float (&o)[MT][DV / 8][4], float (&mrow)[MT][2], float (&lrow)[MT][2]) {
#pragma unroll
    for (int mt = 0; mt < MT; mt++) {
#pragma unroll
        for (int i = 0; i < DV / 8; i++) o[mt][i][0] = o[mt][i][1] = o[mt][i][2] = o[mt][i][3] = 0.0f;
        mrow[mt][0] = mrow[mt][1] = NEG_INF;
        lrow[mt][0] = lrow[mt][1] = 0.0f;
    }
}

// One 64-key tile of the wide kernel for this warp's MT x 16 query rows (Q staged in shared
// memory as rows of DK values, the warp's from row `wrow`; the tile's K rows of DK values and
// V rows of DV values): S = Q K^T on the tensor cores, the causal and window mask where
// `masked` (this thread's first row is at position qrow0), the online softmax in base 2 with O
// rescaled only when some row's maximum moved, then O += P V with P re-packed from S.
template <int DK, int DV, int MT>
__device__ __forceinline__ void fw_tile(float (&o)[MT][DV / 8][4], float (&mrow)[MT][2], float (&lrow)[MT][2],
                                        const bf16_t* sq, const bf16_t* sk, const bf16_t* sv, int wrow, int kt,
                                        int qrow0, int window, float scale_log2, bool masked) {
    const int lane = threadIdx.x & 31;
    float s[MT][FW_BN / 8][4];
#pragma unroll
    for (int mt = 0; mt < MT; mt++) {
#pragma unroll
        for (int i = 0; i < FW_BN / 8; i++) s[mt][i][0] = s[mt][i][1] = s[mt][i][2] = s[mt][i][3] = 0.0f;
    }
#pragma unroll
    for (int kk = 0; kk < DK / 16; kk++) {
        u32 a[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; mt++) {
            ldsm_x4(a[mt][0], a[mt][1], a[mt][2], a[mt][3],
                    &sq[swz<DK>(wrow + mt * 16 + (lane & 15), kk * 16 + (lane >> 4) * 8)]);
        }
#pragma unroll
        for (int np = 0; np < FW_BN / 16; np++) {
            u32 b0, b1, b2, b3;
            ldsm_x4(b0, b1, b2, b3,
                    &sk[swz<DK>(np * 16 + (lane & 7) + ((lane >> 4) << 3), kk * 16 + (((lane >> 3) & 1) << 3))]);
#pragma unroll
            for (int mt = 0; mt < MT; mt++) {
                mma_bf16_16816(s[mt][2 * np], a[mt], b0, b1);
                mma_bf16_16816(s[mt][2 * np + 1], a[mt], b2, b3);
            }
        }
    }
    if (masked) {
#pragma unroll
        for (int mt = 0; mt < MT; mt++) {
#pragma unroll
            for (int nt = 0; nt < FW_BN / 8; nt++) {
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    const int key = kt + nt * 8 + 2 * (lane & 3) + (e & 1);
                    const int qp = qrow0 + mt * 16 + (e >> 1) * 8;
                    const bool ok = key <= qp && (window <= 0 || key > qp - window);
                    if (!ok) s[mt][nt][e] = NEG_INF;
                }
            }
        }
    }
    float corr[MT][2];
    bool moved = false;
#pragma unroll
    for (int mt = 0; mt < MT; mt++) {
#pragma unroll
        for (int rh = 0; rh < 2; rh++) {
            float mx = NEG_INF;
#pragma unroll
            for (int nt = 0; nt < FW_BN / 8; nt++) mx = fmaxf(mx, fmaxf(s[mt][nt][2 * rh], s[mt][nt][2 * rh + 1]));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
            const float mnew = fmaxf(mrow[mt][rh], mx * scale_log2);
            const float muse = mnew == NEG_INF ? 0.0f : mnew;
            corr[mt][rh] = fast_exp2(mrow[mt][rh] - muse);
            moved |= corr[mt][rh] != 1.0f;
            mrow[mt][rh] = mnew;
            float rs = 0.0f;
#pragma unroll
            for (int nt = 0; nt < FW_BN / 8; nt++) {
                const float p0 = fast_exp2(fmaf(s[mt][nt][2 * rh], scale_log2, -muse));
                const float p1 = fast_exp2(fmaf(s[mt][nt][2 * rh + 1], scale_log2, -muse));
                s[mt][nt][2 * rh] = p0;
                s[mt][nt][2 * rh + 1] = p1;
                rs += p0 + p1;
            }
            lrow[mt][rh] = lrow[mt][rh] * corr[mt][rh] + rs;
        }
    }
    if (__any_sync(0xffffffffu, moved)) {
#pragma unroll
        for (int mt = 0; mt < MT; mt++) {
#pragma unroll
            for (int dt = 0; dt < DV / 8; dt++) {
                o[mt][dt][0] *= corr[mt][0];
                o[mt][dt][1] *= corr[mt][0];
                o[mt][dt][2] *= corr[mt][1];
                o[mt][dt][3] *= corr[mt][1];
            }
        }
    }
#pragma unroll
    for (int kk = 0; kk < FW_BN / 16; kk++) {
        u32 a[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; mt++) {
            a[mt][0] = pack_bf16x2(s[mt][2 * kk][0], s[mt][2 * kk][1]);
            a[mt][1] = pack_bf16x2(s[mt][2 * kk][2], s[mt][2 * kk][3]);
            a[mt][2] = pack_bf16x2(s[mt][2 * kk + 1][0], s[mt][2 * kk + 1][1]);
            a[mt][3] = pack_bf16x2(s[mt][2 * kk + 1][2], s[mt][2 * kk + 1][3]);
        }
#pragma unroll
        for (int dp = 0; dp < DV / 16; dp++) {
            u32 b0, b1, b2, b3;
            ldsm_x4_t(b0, b1, b2, b3,
                      &sv[swz<DV>(kk * 16 + (lane & 7) + (((lane >> 3) & 1) << 3), dp * 16 + ((lane >> 4) << 3))]);
#pragma unroll
            for (int mt = 0; mt < MT; mt++) {
                mma_bf16_16816(o[mt][2 * dp], a[mt], b0, b1);
                mma_bf16_16816(o[mt][2 * dp + 1], a[mt], b2, b3);
            }
        }
    }
}

// Normalizes the warp's MT x 16 rows (from row `wrow` of the block's queries, which start at
// step row row0) and writes those below qn to out, rows of n_heads heads of DV values.
template <typename T, int DV, int MT>
__device__ __forceinline__ void fw_store(T* out, const float (&o)[MT][DV / 8][4], const float (&lrow)[MT][2],
                                         int row0, int wrow, int qn, int n_heads, int h) {
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int mt = 0; mt < MT; mt++) {
#pragma unroll
        for (int rh = 0; rh < 2; rh++) {
            float l = lrow[mt][rh];
            l += __shfl_xor_sync(0xffffffffu, l, 1);
            l += __shfl_xor_sync(0xffffffffu, l, 2);
            const float inv = l > 0.0f ? 1.0f / l : 0.0f;
            const int row = wrow + mt * 16 + (lane >> 2) + rh * 8;
            if (row < qn) {
                const long base = ((long)(row0 + row) * n_heads + h) * DV;
#pragma unroll
                for (int dt = 0; dt < DV / 8; dt++) {
                    store2(out, base + dt * 8 + 2 * (lane & 3), o[mt][dt][2 * rh] * inv, o[mt][dt][2 * rh + 1] * inv);
                }
            }
        }
    }
}

template <typename T, int D, int STAGES, int NW, int MT>
__device__ void attn_prefill_wide_impl(T* out, const T* q, const bf16_t* kc, const bf16_t* vc, const int* tiles,
                                       int n_tiles, const int* seq_start, const int* seq_len, const int* seq_pos,
                                       const int* tables, int table_width, int n_heads, int n_kv_heads,
                                       int block_size, float scale_log2, int window) {
    constexpr int CH = D / 8;
    constexpr int THREADS = NW * 32;
    constexpr int WR = 16 * MT;           // query rows per warp
    constexpr int STAGE = 2 * FW_BN * D;  // K then V
    static_assert(NW * WR == FW_BM, "warps x rows must cover the query tile");
    extern __shared__ __align__(16) bf16_t smem[];
    bf16_t* sq = smem;
    bf16_t* skv = smem + FW_BM * D;

    const int tile = n_tiles - 1 - blockIdx.y;
    const int si = tiles[2 * tile], q0 = tiles[2 * tile + 1];
    if (q0 % FW_BM != 0) return;
    const int h = blockIdx.x;
    const int g = h / (n_heads / n_kv_heads);
    const int start = seq_start[si], len = seq_len[si], pos = seq_pos[si];
    const int qn = min(FW_BM, len - q0);
    const int* table = tables + (long)si * table_width;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int qfirst = pos + q0, qlast = pos + q0 + qn - 1;
    int kstart = window > 0 ? max(0, qfirst + 1 - window) : 0;
    kstart = kstart / FW_BN * FW_BN;
    const int n_kt = (qlast - kstart) / FW_BN + 1;
    // Cache blocks of a power-of-two size are found by shifts, not divisions.
    const int bs_shift = (block_size & (block_size - 1)) == 0 ? __ffs(block_size) - 1 : -1;

    auto issue = [&](int it) {
        if (it < n_kt) {
            const int kt = kstart + it * FW_BN;
            bf16_t* sk = skv + (it % STAGES) * STAGE;
            bf16_t* sv = sk + FW_BN * D;
#pragma unroll
            for (int e = tid; e < FW_BN * CH; e += THREADS) {
                const int r = e / CH, c = e % CH;
                const int j = kt + r;
                const bool ok = j <= qlast;
                long off = 0;
                if (ok) {
                    const int b = bs_shift >= 0 ? j >> bs_shift : j / block_size;
                    const int in = bs_shift >= 0 ? j & (block_size - 1) : j % block_size;
                    const long slot = (long)table[b] * block_size + in;
                    off = (slot * n_kv_heads + g) * D + c * 8;
                }
                cp_async16(&sk[swz<D>(r, c * 8)], kc + off, ok);
                cp_async16(&sv[swz<D>(r, c * 8)], vc + off, ok);
            }
        }
        asm volatile("cp.async.commit_group;");
    };

#pragma unroll
    for (int s = 0; s < STAGES - 1; s++) issue(s);
    for (int e = tid; e < FW_BM * CH; e += THREADS) {
        const int r = e / CH, c = e % CH;
        uint4 val = make_uint4(0, 0, 0, 0);
        if (r < qn) val = load8_as_bf16(q + ((long)(start + q0 + r) * n_heads + h) * D + c * 8);
        *reinterpret_cast<uint4*>(&sq[swz<D>(r, c * 8)]) = val;
    }
    float o[MT][D / 8][4];
    float mrow[MT][2], lrow[MT][2];
    fw_init<D, MT>(o, mrow, lrow);
    const int qrow0 = qfirst + warp * WR + (lane >> 2);  // position of this thread's first row
    // This warp's rows (positions); a warp wholly past the sequence's queries only keeps step.
    const int wfirst = qfirst + warp * WR, wlast = min(wfirst + WR - 1, qlast);
    const bool active = warp * WR < qn;

    for (int it = 0; it < n_kt; it++) {
        asm volatile("cp.async.wait_group %0;" ::"n"(STAGES - 2));
        __syncthreads();
        issue(it + STAGES - 1);
        const int kt = kstart + it * FW_BN;
        const bf16_t* sk = skv + (it % STAGES) * STAGE;
        const bf16_t* sv = sk + FW_BN * D;
        const bool skip = kt > wlast || (window > 0 && kt + FW_BN - 1 <= wfirst - window);
        if (!active || skip) continue;
        const bool masked = kt + FW_BN - 1 > wfirst || (window > 0 && kt <= wlast - window);

        fw_tile<D, D, MT>(o, mrow, lrow, sq, sk, sv, warp * WR, kt, qrow0, window, scale_log2, masked);
    }
    asm volatile("cp.async.wait_group 0;");

    fw_store<T, D, MT>(out, o, lrow, start + q0, warp * WR, qn, n_heads, h);
}

#define PREFILL_WIDE_WRAPPER(NAME, STAGES, NW, MT, MINB, T, S, D)                                                  \
    extern "C" __global__ void __launch_bounds__(NW * 32, MINB) NAME##_d##D##_##S(                               \
        T* out, const T* q, const bf16_t* kc, const bf16_t* vc, const int* tiles, int n_tiles, const int* seq_start, \
        const int* seq_len, const int* seq_pos, const int* tables, int table_width, int n_heads, int n_kv_heads,    \
        int block_size, float scale_log2, int window) {                                                            \
        PDL_ENTRY();                                                                                               \
        attn_prefill_wide_impl<T, D, STAGES, NW, MT>(out, q, kc, vc, tiles, n_tiles, seq_start, seq_len, seq_pos,   \
                                                     tables, table_width, n_heads, n_kv_heads, block_size,          \
                                                     scale_log2, window);                                           \
    }

// 4 warps of 32 rows, 2 stages, two blocks per SM (`PREFILL3_THREADS` and `prefill3_smem` in
// module.rs).
PREFILL_WIDE_WRAPPER(attn_prefill3, 2, 4, 2, 2, float, f32, 64)
PREFILL_WIDE_WRAPPER(attn_prefill3, 2, 4, 2, 2, float, f32, 128)
PREFILL_WIDE_WRAPPER(attn_prefill3, 2, 4, 2, 2, bf16_t, bf16, 64)
PREFILL_WIDE_WRAPPER(attn_prefill3, 2, 4, 2, 2, bf16_t, bf16, 128)
