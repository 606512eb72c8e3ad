// Row-wise and element-wise kernels: embedding lookup, RMSNorm (optionally fused with the
// residual add), residual add, SwiGLU, rotary embeddings, row gathers, dtype conversions.

// out[t, :] = table[tokens[t], :] for a weight of any supported type. One block per token.
template <typename T>
__device__ void embed_impl(T* out, const u8* table, const u32* tokens, int wt, long rows, long cols, long row_bytes) {
    const long t = blockIdx.x;
    const u32 tok = tokens[t];
    for (long c = threadIdx.x; c < cols; c += blockDim.x) {
        const float v = tok < rows ? weight_at(wt, table, row_bytes, tok, c) : 0.0f;
        act_store(out, t * cols + c, v);
    }
}

// RMSNorm of each row of x (width d) with gain g (f32). With `y` non-null, first x += y
// (written back to x) and the sum is normalized: the residual add fused into the norm.
template <typename T>
__device__ void rms_norm_impl(T* out, T* x, const T* y, const float* g, int d, float eps) {
    __shared__ float red[32];
    const long base = (long)blockIdx.x * d;
    float ss = 0.0f;
    for (int c = threadIdx.x; c < d; c += blockDim.x) {
        float v = act_load(x, base + c);
        if (y != nullptr) {
            v += act_load(y, base + c);
            act_store(x, base + c, v);
            v = act_load(x, base + c);  // normalize the stored (rounded) sum
        }
        ss += v * v;
    }
    ss = block_sum(ss, red);
    const float r = 1.0f / sqrtf(ss / (float)d + eps);
    for (int c = threadIdx.x; c < d; c += blockDim.x) {
        act_store(out, base + c, act_load(x, base + c) * r * g[c]);
    }
}

template <typename T>
__device__ void add_impl(T* x, const T* y, long n) {
    for (long i = (long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x) {
        act_store(x, i, act_load(x, i) + act_load(y, i));
    }
}

// SwiGLU of one gate and up value; the GEMVs that fold it in (`gemvb*s*`) call this too, so
// both paths round alike.
__device__ __forceinline__ float swiglu(float g, float u) { return g / (1.0f + expf(-g)) * u; }

template <typename T>
__device__ void silu_mul_impl(T* gate, const T* up, long n) {
    for (long i = (long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x) {
        act_store(gate, i, swiglu(act_load(gate, i), act_load(up, i)));
    }
}

// One rotated pair: (a c - b s, a s + b c), rounded product by product (no FMA contraction), so
// every kernel that rotates (these, `rope_kv`, the folded decode attention) rounds alike.
__device__ __forceinline__ float rope_ra(float a, float b, float c, float s) {
    return __fsub_rn(__fmul_rn(a, c), __fmul_rn(b, s));
}
__device__ __forceinline__ float rope_rb(float a, float b, float c, float s) {
    return __fadd_rn(__fmul_rn(a, s), __fmul_rn(b, c));
}

// Rotates pairs of each head by the token's angle table row (`cos`/`sin`: [tokens, half]).
// style 0: interleaved pairs (2i, 2i+1); style 1: halves (i, i + half).
template <typename T>
__device__ void rope_impl(T* x, const float* cs, const float* sn, long n_tokens, int n_heads, int head_dim, int half, int style) {
    const long total = n_tokens * n_heads * half;
    for (long e = (long)blockIdx.x * blockDim.x + threadIdx.x; e < total; e += (long)gridDim.x * blockDim.x) {
        const int i = (int)(e % half);
        const long th = e / half;  // token * n_heads + head
        const long t = th / n_heads;
        const long base = th * head_dim;
        const long ia = style == 0 ? base + 2 * i : base + i;
        const long ib = style == 0 ? ia + 1 : ia + half;
        const float c = cs[t * half + i], s = sn[t * half + i];
        const float a = act_load(x, ia), b = act_load(x, ib);
        act_store(x, ia, rope_ra(a, b, c, s));
        act_store(x, ib, rope_rb(a, b, c, s));
    }
}

// `rope_impl` over two tensors of one step in one launch (queries and keys): heads [0, h1)
// of each token are x1's, [h1, h1 + h2) x2's.
template <typename T>
__device__ void rope2_impl(T* x1, T* x2, const float* cs, const float* sn, long n_tokens, int h1, int h2, int head_dim,
                           int half, int style) {
    const int hs = h1 + h2;
    const long total = n_tokens * hs * half;
    for (long e = (long)blockIdx.x * blockDim.x + threadIdx.x; e < total; e += (long)gridDim.x * blockDim.x) {
        const int i = (int)(e % half);
        const long th = e / half;
        const long t = th / hs;
        const int hh = (int)(th % hs);
        T* x = hh < h1 ? x1 : x2;
        const long base = hh < h1 ? (t * h1 + hh) * head_dim : (t * h2 + hh - h1) * head_dim;
        const long ia = style == 0 ? base + 2 * i : base + i;
        const long ib = style == 0 ? ia + 1 : ia + half;
        const float c = cs[t * half + i], s = sn[t * half + i];
        const float a = act_load(x, ia), b = act_load(x, ib);
        act_store(x, ia, rope_ra(a, b, c, s));
        act_store(x, ib, rope_rb(a, b, c, s));
    }
}

template <typename T>
__device__ void gather_rows_impl(T* out, const T* x, const int* rows, long width) {
    const long j = blockIdx.x;
    const long r = rows[j];
    for (long c = threadIdx.x; c < width; c += blockDim.x) out[j * width + c] = x[r * width + c];
}

#define EW_WRAPPERS(T, S)                                                                                          \
    extern "C" __global__ void embed_##S(T* out, const u8* table, const u32* tokens, int wt, long rows, long cols,  \
                                         long row_bytes) { PDL_ENTRY();                                                         \
        embed_impl<T>(out, table, tokens, wt, rows, cols, row_bytes);                                              \
    }                                                                                                              \
    extern "C" __global__ void rms_norm_##S(T* out, T* x, const T* y, const float* g, int d, float eps) { PDL_ENTRY();         \
        rms_norm_impl<T>(out, x, y, g, d, eps);                                                                    \
    }                                                                                                              \
    extern "C" __global__ void add_##S(T* x, const T* y, long n) { PDL_ENTRY(); add_impl<T>(x, y, n); }                        \
    extern "C" __global__ void silu_mul_##S(T* g, const T* u, long n) { PDL_ENTRY(); silu_mul_impl<T>(g, u, n); }              \
    extern "C" __global__ void rope_##S(T* x, const float* cs, const float* sn, long n_tokens, int n_heads,        \
                                        int head_dim, int half, int style) { PDL_ENTRY();                                       \
        rope_impl<T>(x, cs, sn, n_tokens, n_heads, head_dim, half, style);                                         \
    }                                                                                                              \
    extern "C" __global__ void rope2_##S(T* x1, T* x2, const float* cs, const float* sn, long n_tokens, int h1,      \
                                         int h2, int head_dim, int half, int style) {                              \
        PDL_ENTRY();                                                                                               \
        rope2_impl<T>(x1, x2, cs, sn, n_tokens, h1, h2, head_dim, half, style);                                    \
    }                                                                                                              \
    extern "C" __global__ void gather_rows_##S(T* out, const T* x, const int* rows, long width) { PDL_ENTRY();                 \
        gather_rows_impl<T>(out, x, rows, width);                                                                  \
    }

EW_WRAPPERS(float, f32)
EW_WRAPPERS(bf16_t, bf16)

// The rotary angle table of a step: cos/sin of pos / scale * theta^(-2i / dims), computed in
// double precision as the CPU backend does, for every token and pair index i < half.
extern "C" __global__ void rope_table(float* cs, float* sn, const int* positions, long n_tokens, int half, int dims,
                                      float theta, float scale) { PDL_ENTRY();
    const long total = n_tokens * half;
    for (long e = (long)blockIdx.x * blockDim.x + threadIdx.x; e < total; e += (long)gridDim.x * blockDim.x) {
        const int i = (int)(e % half);
        const long t = e / half;
        const double inv = 1.0 / pow((double)theta, 2.0 * (double)i / (double)dims);
        const double a = (double)positions[t] / (double)scale * inv;
        double s, c;
        sincos(a, &s, &c);
        cs[e] = (float)c;
        sn[e] = (float)s;
    }
}

// Any weight type -> bf16, one thread per 32 elements (cols is a multiple of 32 for the
// block types; the float types take any width).
extern "C" __global__ void weight_to_bf16(bf16_t* out, const u8* w, int wt, long rows, long cols, long row_bytes) { PDL_ENTRY();
    const long chunks = (cols + 31) / 32;
    const long total = rows * chunks;
    for (long e = (long)blockIdx.x * blockDim.x + threadIdx.x; e < total; e += (long)gridDim.x * blockDim.x) {
        const long r = e / chunks, c0 = (e % chunks) * 32;
        bf16_t* o = out + r * cols + c0;
        if (wt >= WT_Q4_0) {
            float y[32];
            dequant_block32(wt, w + r * row_bytes + (c0 / 32) * block_bytes32(wt), y);
#pragma unroll
            for (int j = 0; j < 32; j++) o[j] = f32_to_bf16(y[j]);
        } else {
            const long n = cols - c0 < 32 ? cols - c0 : 32;
            for (long j = 0; j < n; j++) o[j] = f32_to_bf16(weight_at(wt, w, row_bytes, r, c0 + j));
        }
    }
}

// Any weight type -> f32 (the cuBLAS input when activations are kept in f32).
extern "C" __global__ void weight_to_f32(float* out, const u8* w, int wt, long rows, long cols, long row_bytes) { PDL_ENTRY();
    const long chunks = (cols + 31) / 32;
    const long total = rows * chunks;
    for (long e = (long)blockIdx.x * blockDim.x + threadIdx.x; e < total; e += (long)gridDim.x * blockDim.x) {
        const long r = e / chunks, c0 = (e % chunks) * 32;
        float* o = out + r * cols + c0;
        if (wt >= WT_Q4_0) {
            dequant_block32(wt, w + r * row_bytes + (c0 / 32) * block_bytes32(wt), o);
        } else {
            const long n = cols - c0 < 32 ? cols - c0 : 32;
            for (long j = 0; j < n; j++) o[j] = weight_at(wt, w, row_bytes, r, c0 + j);
        }
    }
}

// Writes each token's K and V rows ([tokens, kv_width] activations) into its paged slot
// (bf16 caches [blocks, block_size, kv_width]). `slots[t]` is the token's flat slot index.
template <typename T>
__device__ void write_kv_impl(bf16_t* kc, bf16_t* vc, const T* k, const T* v, const long* slots, long kv_width) {
    const long t = blockIdx.x;
    const long s = slots[t];
    for (long c = threadIdx.x; c < kv_width; c += blockDim.x) {
        kc[s * kv_width + c] = f32_to_bf16(act_load(k, t * kv_width + c));
        vc[s * kv_width + c] = f32_to_bf16(act_load(v, t * kv_width + c));
    }
}

// One layer's RoPE of queries and keys and its K/V cache write in one launch: elements
// [0, n*hq*half) rotate pairs of q, the next n*hk*half rotate pairs of k and also store them in
// the token's cache slot, the last n*kv_width copy v into its slot. Same arithmetic as `rope`
// followed by `write_kv`.
template <typename T>
__device__ void rope_kv_impl(T* q, T* k, const T* v, bf16_t* kc, bf16_t* vc, const long* slots, const float* cs,
                             const float* sn, long n_tokens, int hq, int hk, int head_dim, int half, int style) {
    const long nq = n_tokens * hq * half, nk = n_tokens * hk * half;
    const long kvw = (long)hk * head_dim;
    const long total = nq + nk + n_tokens * kvw;
    for (long e = (long)blockIdx.x * blockDim.x + threadIdx.x; e < total; e += (long)gridDim.x * blockDim.x) {
        if (e < nq + nk) {
            const bool isq = e < nq;
            const long f = isq ? e : e - nq;
            const int heads = isq ? hq : hk;
            T* x = isq ? q : k;
            const int i = (int)(f % half);
            const long th = f / half;  // token * heads + head
            const long t = th / heads;
            const long base = th * head_dim;
            const long ia = style == 0 ? base + 2 * i : base + i;
            const long ib = style == 0 ? ia + 1 : ia + half;
            const float c = cs[t * half + i], s = sn[t * half + i];
            const float a = act_load(x, ia), b = act_load(x, ib);
            const float ra = rope_ra(a, b, c, s), rb = rope_rb(a, b, c, s);
            act_store(x, ia, ra);
            act_store(x, ib, rb);
            if (!isq) {
                const long o = slots[t] * kvw - t * kvw;  // cache index minus row index
                kc[o + ia] = f32_to_bf16(ra);
                kc[o + ib] = f32_to_bf16(rb);
            }
        } else {
            const long f = e - nq - nk;
            const long t = f / kvw;
            vc[slots[t] * kvw + f % kvw] = f32_to_bf16(act_load(v, f));
        }
    }
}

#define ROPE_KV_WRAPPER(T, S)                                                                                      \
    extern "C" __global__ void rope_kv_##S(T* q, T* k, const T* v, bf16_t* kc, bf16_t* vc, const long* slots,      \
                                           const float* cs, const float* sn, long n_tokens, int hq, int hk,        \
                                           int head_dim, int half, int style) {                                    \
        PDL_ENTRY();                                                                                               \
        rope_kv_impl<T>(q, k, v, kc, vc, slots, cs, sn, n_tokens, hq, hk, head_dim, half, style);                  \
    }
ROPE_KV_WRAPPER(float, f32)
ROPE_KV_WRAPPER(bf16_t, bf16)

extern "C" __global__ void write_kv_f32(bf16_t* kc, bf16_t* vc, const float* k, const float* v, const long* slots,
                                        long kv_width) { PDL_ENTRY();
    write_kv_impl<float>(kc, vc, k, v, slots, kv_width);
}
extern "C" __global__ void write_kv_bf16(bf16_t* kc, bf16_t* vc, const bf16_t* k, const bf16_t* v, const long* slots,
                                         long kv_width) { PDL_ENTRY();
    write_kv_impl<bf16_t>(kc, vc, k, v, slots, kv_width);
}
