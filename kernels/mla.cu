// Multi-head latent attention (DeepSeek-V2/V3) over a paged latent cache, absorbed form.
//
// The cache of a layer is [blocks * block_size, W] values of the activation type T, W = latent
// (`r`) + rope (`dr`): per token the RMS-normalized KV latent and the rotated shared rope key.
// A step runs three kernels:
//   mla_q_absorb  projects each head's nope query into latent space with the K half of
//                 kv_b_proj (q_lat = W_UK^T q_nope) and appends the rope query rotated by
//                 position: qf [n, H, W] f32; its rope blocks of head 0 also write the new
//                 tokens' cache rows (normalized latent, rotated rope key);
//   mla_decode    attends qf over the cached rows, split-KV over the context; one block serves
//                 up to 16 heads of one token, so each latent row is loaded once for all of them
//                 (FlashMLA's idea: the step is memory-bound on the latent, not on the heads);
//   mla_v_up      merges the splits and projects the latent output back with the V half
//                 (out = W_UV o_lat), writing [n, H * v] activations.

#define MLA_WARPS 8
#define MLA_HPW 2                          // heads per warp
#define MLA_HEADS (MLA_WARPS * MLA_HPW)    // heads per block
#define MLA_MAXW 576                       // most latent + rope values (DeepSeek-V3: 512 + 64)
#define MLA_NPL (MLA_MAXW / 32)            // values per lane
#define MLA_TK 16                          // keys per shared-memory tile
#define MLA_MAXNOPE 256                    // most nope query values per head
#define MLA_VROWS 32                       // V up-projection rows per block

// The rotation of a rope pair at frequency `f` and position `pos`, as the host's `mla::rotate`:
// the angle in f32, its cosine (x) and sine (y) in f64, each scaled by `rs`.
__device__ __forceinline__ float2 mla_angle(float f, int pos, float rs) {
    const float ang = f * (float)pos;
    return make_float2((float)cos((double)ang) * rs, (float)sin((double)ang) * rs);
}

// The pair (x, y) rotated by cosine c and sine s.
__device__ __forceinline__ float2 mla_rotate(float x, float y, float c, float s) {
    return make_float2(x * c - y * s, y * c + x * s);
}

// Rotates the pair (v[a], v[b]) of a rope part by `pos` (mla_angle, mla_rotate).
__device__ __forceinline__ void mla_rot_pair(float& x, float& y, float f, int pos, float rs) {
    const float2 cs = mla_angle(f, pos, rs);
    const float2 o = mla_rotate(x, y, cs.x, cs.y);
    x = o.x;
    y = o.y;
}

// Token t's cache row: the RMS-normalized latent and the rotated rope key (whole block; `red`
// holds 32 floats).
template <typename T>
__device__ void mla_cache_row(T* cache, const T* kva, const float* gain, const float* inv_freq, long slot, int pos,
                              int t, int r, int dr, float eps, float rs, int interleaved, float* red) {
    const int W = r + dr;
    const T* row = kva + (long)t * W;
    float ss = 0.0f;
    for (int c = threadIdx.x; c < r; c += blockDim.x) {
        const float v = act_load(row, c);
        ss += v * v;
    }
    ss = block_sum(ss, red);
    const float inv = 1.0f / sqrtf(ss / (float)r + eps);
    T* dst = cache + slot * (long)W;
    for (int c = threadIdx.x; c < r; c += blockDim.x) act_store(dst, c, gain[c] * (act_load(row, c) * inv));
    const int half = dr / 2;
    for (int i = threadIdx.x; i < half; i += blockDim.x) {
        const int a = interleaved ? 2 * i : i, b = interleaved ? 2 * i + 1 : i + half;
        float x = act_load(row, r + a), y = act_load(row, r + b);
        mla_rot_pair(x, y, inv_freq[i], pos, rs);
        act_store(dst, r + a, x);
        act_store(dst, r + b, y);
    }
}

__device__ __forceinline__ float mla_w(const float* w, long i) { return w[i]; }
__device__ __forceinline__ float mla_w(const bf16_t* w, long i) { return bf16_to_f32(w[i]); }

// The rotation's cosines and sines of tokens [t0, t0 + nt) (nt <= 8), pair p of `half`, into
// cs[i][p] and sn[i][p] (shared memory; the caller synchronizes before reading them).
__device__ __forceinline__ void mla_angles(float (*cs)[MLA_MAXW / 2], float (*sn)[MLA_MAXW / 2],
                                           const float* inv_freq, const int* positions, int t0, int nt, int half,
                                           float rs) {
    for (int e = threadIdx.x; e < nt * half; e += blockDim.x) {
        const int i = e / half, p = e % half;
        const float2 a = mla_angle(inv_freq[p], positions[t0 + i], rs);
        cs[i][p] = a.x;
        sn[i][p] = a.y;
    }
}

// The rope queries of tokens [t0, t0 + nt) (nt <= 8) of head h, rotated by position, into qf;
// with `rows` instead their cache rows (RMS-normalized latent and rotated rope key; head 0 only,
// other heads' blocks return). The rotation's sines and cosines (positions and frequencies are
// the step's inputs, uploaded before its kernels) are computed before the programmatic wait,
// once per pair. A whole block of at least 8 warps.
template <typename T>
__device__ void mla_q_rope(float* qf, const T* q, int heads, int nope, int dr, int r, T* cache, const T* kva,
                           const float* gain, const float* inv_freq, const long* slots, const int* positions,
                           float eps, float rs, int interleaved, int h, int t0, int nt, bool rows) {
    const int W = r + dr, qk = nope + dr;
    __shared__ float cs[8][MLA_MAXW / 2], sn[8][MLA_MAXW / 2];
    const int half = dr / 2;
    mla_angles(cs, sn, inv_freq, positions, t0, nt, half, rs);
    if (rows && h != 0) return;
    // each token's slot before the wait too
    long sl = 0;
    if (rows && (int)threadIdx.x < 8 && (int)threadIdx.x < nt) sl = slots[t0 + threadIdx.x];
    __syncthreads();
    pdl_wait();
    if (!rows) {
        for (int e = threadIdx.x; e < nt * half; e += blockDim.x) {
            const int i = e / half, p = e % half;
            const int t = t0 + i;
            const int a = interleaved ? 2 * p : p, b = interleaved ? 2 * p + 1 : p + half;
            const T* qh = q + ((long)t * heads + h) * qk + nope;
            const float x = act_load(qh, a), y = act_load(qh, b);
            float* o = qf + ((long)t * heads + h) * W + r;
            const float2 v = mla_rotate(x, y, cs[i][p], sn[i][p]);
            o[a] = v.x;
            o[b] = v.y;
        }
        return;
    }
    // the cache rows: RMS-normalized latent and rotated rope key, one warp-group of the
    // block a token (all tokens' sums of squares at once)
    __shared__ long slot_s[8];
    __shared__ float inv_s[8];
    if ((int)threadIdx.x < nt) slot_s[threadIdx.x] = sl;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    // warp i sums token i's squares (8 warps, up to 8 tokens)
    if (warp < nt) {
        const T* row = kva + (long)(t0 + warp) * W;
        float ss = 0.0f;
        for (int cc = lane; cc < r; cc += 32) {
            const float x = act_load(row, cc);
            ss = fmaf(x, x, ss);
        }
        ss = warp_sum(ss);
        if (lane == 0) inv_s[warp] = 1.0f / sqrtf(ss / (float)r + eps);
    }
    __syncthreads();
    for (int e = threadIdx.x; e < nt * r; e += blockDim.x) {
        const int i = e / r, cc = e % r;
        const T* row = kva + (long)(t0 + i) * W;
        act_store(cache + slot_s[i] * (long)W, cc, gain[cc] * (act_load(row, cc) * inv_s[i]));
    }
    for (int e = threadIdx.x; e < nt * half; e += blockDim.x) {
        const int i = e / half, p = e % half;
        const int a = interleaved ? 2 * p : p, b = interleaved ? 2 * p + 1 : p + half;
        const T* row = kva + (long)(t0 + i) * W + r;
        const float x = act_load(row, a), y = act_load(row, b);
        T* dst = cache + slot_s[i] * (long)W + r;
        const float2 v = mla_rotate(x, y, cs[i][p], sn[i][p]);
        act_store(dst, a, v.x);
        act_store(dst, b, v.y);
    }
}

// qf[t, h, c] = sum_j q[t, h, j] W[h (nope + v) + j, c] for c < r, then the rope query for
// c in [r, r + dr). Block (head, 8-token chunk, 64-column chunk; the last chunk copies the rope
// queries): the tokens' nope queries are staged in shared memory, four groups of 64 threads
// split the nope rows and their partial sums meet in shared memory.
template <typename T, typename WT, bool V2>
__device__ void mla_q_absorb_impl(float* qf, const T* q, const WT* w, int n, int heads, int nope, int dr, int v,
                                  int r, T* cache, const T* kva, const float* gain, const float* inv_freq,
                                  const long* slots, const int* positions, float eps, float rs, int interleaved) {
    __shared__ float qs[8][MLA_MAXNOPE];
    __shared__ float part[4][8][64];
    __shared__ float red[32];
    const int h = blockIdx.x;
    const int t0 = blockIdx.y * 8;
    const int nt = min(8, n - t0);
    const int W = r + dr, qk = nope + dr;
    const int cl = threadIdx.x & 63, jg = threadIdx.x >> 6;
    const int c = blockIdx.z * 64 + cl;
    const int zr = (r + 63) / 64;  // the rope block; V2: zr + 1 writes the cache rows
    if (V2 && (int)blockIdx.z >= zr) {
        mla_q_rope<T>(qf, q, heads, nope, dr, r, cache, kva, gain, inv_freq, slots, positions, eps, rs, interleaved,
                      h, t0, nt, (int)blockIdx.z > zr);
        return;
    }
    // This thread's weights (rows jg, jg + 4, ... of column c) are no earlier kernel's
    // output: loaded before the wait.
    float wv[MLA_MAXNOPE / 4];
    const bool wcol = (int)blockIdx.z < zr && c < r;
    const WT* wh = w + (long)h * (nope + v) * r + c;
#pragma unroll
    for (int i = 0; i < MLA_MAXNOPE / 4; i++) {
        const int j = jg + 4 * i;
        wv[i] = (wcol && j < nope) ? mla_w(wh, (long)j * r) : 0.0f;
    }
    pdl_wait();
    if ((int)blockIdx.z == zr) {
        // the rope queries, rotated by position; head 0's blocks also write the cache rows
        const int half = dr / 2;
        for (int e = threadIdx.x; e < nt * half; e += blockDim.x) {
            const int i = e / half, p = e % half;
            const int t = t0 + i;
            const int a = interleaved ? 2 * p : p, b = interleaved ? 2 * p + 1 : p + half;
            const T* qh = q + ((long)t * heads + h) * qk + nope;
            float x = act_load(qh, a), y = act_load(qh, b);
            mla_rot_pair(x, y, inv_freq[p], positions[t], rs);
            float* o = qf + ((long)t * heads + h) * W + r;
            o[a] = x;
            o[b] = y;
        }
        if (h == 0)
            for (int i = 0; i < nt; i++)
                mla_cache_row<T>(cache, kva, gain, inv_freq, slots[t0 + i], positions[t0 + i], t0 + i, r, dr, eps, rs,
                                 interleaved, red);
        return;
    }
    for (int e = threadIdx.x; e < 8 * nope; e += blockDim.x) {
        const int i = e / nope, j = e % nope;
        qs[i][j] = i < nt ? act_load(q, ((long)(t0 + i) * heads + h) * qk + j) : 0.0f;
    }
    __syncthreads();
    float acc[8];
#pragma unroll
    for (int i = 0; i < 8; i++) acc[i] = 0.0f;
    if (c < r) {
#pragma unroll
        for (int q = 0; q < MLA_MAXNOPE / 4; q++) {
            const int j = jg + 4 * q;
            if (j < nope) {
#pragma unroll
                for (int i = 0; i < 8; i++) acc[i] = fmaf(qs[i][j], wv[q], acc[i]);
            }
        }
    }
#pragma unroll
    for (int i = 0; i < 8; i++) part[jg][i][cl] = acc[i];
    __syncthreads();
    for (int e = threadIdx.x; e < nt * 64; e += blockDim.x) {
        const int i = e / 64, cc = e % 64;
        const int col = blockIdx.z * 64 + cc;
        if (col < r)
            qf[((long)(t0 + i) * heads + h) * W + col] = part[0][i][cc] + part[1][i][cc] + part[2][i][cc] + part[3][i][cc];
    }
}

// Block (token, head group, split): heads [g*16, g*16+16) of token t over keys [k0, k1) of
// its causal range [0, pos]. Writes the split's unnormalized latent output and (max, sum) in
// log2 units; mla_v_up merges the splits.
template <typename T>
__device__ void mla_decode_impl(float* part_o, float* part_ml, const float* qf, const T* cache, const int* tok_seq,
                                const int* positions, const int* tables, int table_width, int block_size, int heads,
                                int r, int dr, float scale_log2, int splits) {
    __shared__ float kt[MLA_TK][MLA_MAXW];
    __shared__ long slot_of[MLA_TK];
    const int t = blockIdx.x;
    const int hb = blockIdx.y * MLA_HEADS;
    const int s = blockIdx.z;
    const int W = r + dr;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int pos = positions[t];
    const int len = pos + 1;
    const int chunk = (len + splits - 1) / splits;
    const int k0 = s * chunk;
    const int k1 = min(len, k0 + chunk);
    const int* table = tables + (long)tok_seq[t] * table_width;
    // The step's positions and block tables are uploaded before its kernels run: the first
    // tile's cache slots are looked up before the wait (the cache rows are read after it).
    if ((int)threadIdx.x < min(MLA_TK, k1 - k0)) {  // an empty split (k1 <= k0) looks up nothing
        const int j = k0 + threadIdx.x;
        slot_of[threadIdx.x] = ((long)table[j / block_size] * block_size + j % block_size) * W;
    }
    pdl_wait();

    float qv[MLA_HPW][MLA_NPL], acc[MLA_HPW][MLA_NPL], m[MLA_HPW], l[MLA_HPW];
    bool has[MLA_HPW];
#pragma unroll
    for (int hh = 0; hh < MLA_HPW; hh++) {
        const int h = hb + warp * MLA_HPW + hh;
        has[hh] = h < heads;
        m[hh] = NEG_INF;
        l[hh] = 0.0f;
#pragma unroll
        for (int i = 0; i < MLA_NPL; i++) {
            const int c = lane + 32 * i;
            qv[hh][i] = (has[hh] && c < W) ? qf[((long)t * heads + h) * W + c] * scale_log2 : 0.0f;
            acc[hh][i] = 0.0f;
        }
    }
    for (int j0 = k0; j0 < k1; j0 += MLA_TK) {
        const int nk = min(MLA_TK, k1 - j0);
        if (j0 != k0) {
            __syncthreads();
            if (threadIdx.x < nk) {
                const int j = j0 + threadIdx.x;
                slot_of[threadIdx.x] = ((long)table[j / block_size] * block_size + j % block_size) * W;
            }
        }
        __syncthreads();
        if (W % 8 == 0) {
            // 8 values per load, every row's loads issued together
            const int per = W / 8;
            for (int e = threadIdx.x; e < nk * per; e += blockDim.x) {
                const int kk = e / per, c = (e % per) * 8;
                float v[8];
                act_load8(cache + slot_of[kk] + c, v);
#pragma unroll
                for (int z = 0; z < 8; z++) kt[kk][c + z] = v[z];
            }
        } else {
            for (int e = threadIdx.x; e < nk * W; e += blockDim.x) {
                const int kk = e / W, c = e % W;
                kt[kk][c] = act_load(cache, slot_of[kk] + c);
            }
        }
        __syncthreads();
        for (int kk = 0; kk < nk; kk++) {
#pragma unroll
            for (int hh = 0; hh < MLA_HPW; hh++) {
                if (!has[hh]) continue;
                float sc = 0.0f;
#pragma unroll
                for (int i = 0; i < MLA_NPL; i++) {
                    const int c = lane + 32 * i;
                    if (c < W) sc = fmaf(qv[hh][i], kt[kk][c], sc);
                }
                sc = warp_sum(sc);
                const float mn = fmaxf(m[hh], sc);
                const float corr = exp2f(m[hh] - mn);
                const float p = exp2f(sc - mn);
                l[hh] = l[hh] * corr + p;
#pragma unroll
                for (int i = 0; i < MLA_NPL; i++) {
                    const int c = lane + 32 * i;
                    if (c < r) acc[hh][i] = fmaf(p, kt[kk][c], acc[hh][i] * corr);
                }
                m[hh] = mn;
            }
        }
    }
#pragma unroll
    for (int hh = 0; hh < MLA_HPW; hh++) {
        if (!has[hh]) continue;
        const long row = ((long)t * heads + hb + warp * MLA_HPW + hh) * splits + s;
#pragma unroll
        for (int i = 0; i < MLA_NPL; i++) {
            const int c = lane + 32 * i;
            if (c < r) part_o[row * r + c] = acc[hh][i];
        }
        if (lane == 0) {
            part_ml[row * 2] = m[hh];
            part_ml[row * 2 + 1] = l[hh];
        }
    }
}

// mla_decode with the keys of a tile scored together (`DEEPINFER_CUDA_DS2`, on by default): each
// warp's lanes form partial dot products of its 2 heads with all 16 keys of the tile, one
// transposing butterfly (31 shuffles) leaves lane l with the score of head l / 16, key l % 16,
// and the online softmax updates once per tile instead of once per key, so a tile is not a
// chain of 32 dependent warp reductions. bf16 caches: the first tile's rows that earlier steps
// wrote (positions before the step's first possible token of this sequence) are loaded before
// the programmatic wait.
#define MLA_PRE 5  // 16-byte chunks per thread of the first tile loaded early (16 * 576 * 2 / 16 / 256)
// One step of a transposing butterfly over 2 * C values per lane: lanes with bit C set keep
// the upper C values, the others the lower C, each adding its partner's copy of what it
// keeps. After the steps C = 16, 8, 4, 2, 1 lane l holds the warp's sum of value l.
template <int C>
__device__ __forceinline__ void mla_fold(float* v, int lane) {
    const bool up = (lane & C) != 0;
#pragma unroll
    for (int z = 0; z < C; z++) {
        const float send = up ? v[z] : v[z + C];
        const float keep = up ? v[z + C] : v[z];
        v[z] = keep + __shfl_xor_sync(0xffffffffu, send, C);
    }
}

template <typename T>
__device__ void mla_decode2_impl(float* part_o, float* part_ml, const float* qf, const T* cache, const int* tok_seq,
                                 const int* positions, const int* tables, int table_width, int block_size, int heads,
                                 int r, int dr, float scale_log2, int splits) {
    static_assert(MLA_HPW == 2 && MLA_TK == 16, "a warp scores 2 heads x 16 keys: 32 values, one per lane");
    __shared__ float kt[MLA_TK][MLA_MAXW];
    __shared__ long slot_of[MLA_TK];
    const int t = blockIdx.x;
    const int hb = blockIdx.y * MLA_HEADS;
    const int s = blockIdx.z;
    const int W = r + dr;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int pos = positions[t];
    const int len = pos + 1;
    const int chunk = (len + splits - 1) / splits;
    const int k0 = s * chunk;
    const int k1 = min(len, k0 + chunk);
    const int* table = tables + (long)tok_seq[t] * table_width;
    // rows [k0, safe) of this tile were written by earlier steps: this step has at most
    // gridDim.x tokens, so this sequence's rows of this step start at pos - gridDim.x + 1 or later
    const int safe = pos - (int)gridDim.x + 1;
    constexpr bool VEC = sizeof(T) == 2;
    const bool vec = VEC && W % 8 == 0;
    const int per = W / 8;
    uint4 pre[MLA_PRE];
    int nk0 = min(MLA_TK, k1 - k0);
    if (vec) {
#pragma unroll
        for (int q = 0; q < MLA_PRE; q++) {
            const int e = threadIdx.x + q * blockDim.x;
            const int kk = e / per;
            const int j = k0 + kk;
            pre[q] = make_uint4(0, 0, 0, 0);
            if (kk < nk0 && j < safe) {
                const long sl = ((long)table[j / block_size] * block_size + j % block_size) * W;
                pre[q] = *reinterpret_cast<const uint4*>(cache + sl + (e % per) * 8);
            }
        }
    }
    if ((int)threadIdx.x < nk0) {
        const int j = k0 + threadIdx.x;
        slot_of[threadIdx.x] = ((long)table[j / block_size] * block_size + j % block_size) * W;
    }
    pdl_wait();

    float qv[MLA_HPW][MLA_NPL], acc[MLA_HPW][MLA_NPL];
#pragma unroll
    for (int hh = 0; hh < MLA_HPW; hh++) {
        const int h = hb + warp * MLA_HPW + hh;
#pragma unroll
        for (int i = 0; i < MLA_NPL; i++) {
            const int c = lane + 32 * i;
            qv[hh][i] = (h < heads && c < W) ? qf[((long)t * heads + h) * W + c] * scale_log2 : 0.0f;
            acc[hh][i] = 0.0f;
        }
    }
    // lane l keeps the running max and sum of head l / 16 of its pair
    float m = NEG_INF, l = 0.0f;
    for (int j0 = k0; j0 < k1; j0 += MLA_TK) {
        const int nk = min(MLA_TK, k1 - j0);
        if (j0 != k0) {
            __syncthreads();
            if ((int)threadIdx.x < nk) {
                const int j = j0 + threadIdx.x;
                slot_of[threadIdx.x] = ((long)table[j / block_size] * block_size + j % block_size) * W;
            }
        }
        __syncthreads();
        if (vec) {
            if (j0 == k0) {
#pragma unroll
                for (int q = 0; q < MLA_PRE; q++) {
                    const int e = threadIdx.x + q * blockDim.x;
                    const int kk = e / per, c = (e % per) * 8;
                    if (kk < nk) {
                        float v[8];
                        if (j0 + kk < safe) {
                            bf16x8_to_f32(pre[q], v);
                        } else {
                            act_load8(cache + slot_of[kk] + c, v);
                        }
#pragma unroll
                        for (int z = 0; z < 8; z++) kt[kk][c + z] = v[z];
                    }
                }
                for (int e = threadIdx.x + MLA_PRE * blockDim.x; e < nk * per; e += blockDim.x) {
                    const int kk = e / per, c = (e % per) * 8;
                    float v[8];
                    act_load8(cache + slot_of[kk] + c, v);
#pragma unroll
                    for (int z = 0; z < 8; z++) kt[kk][c + z] = v[z];
                }
            } else {
                for (int e = threadIdx.x; e < nk * per; e += blockDim.x) {
                    const int kk = e / per, c = (e % per) * 8;
                    float v[8];
                    act_load8(cache + slot_of[kk] + c, v);
#pragma unroll
                    for (int z = 0; z < 8; z++) kt[kk][c + z] = v[z];
                }
            }
        } else if (W % 8 == 0) {
            for (int e = threadIdx.x; e < nk * per; e += blockDim.x) {
                const int kk = e / per, c = (e % per) * 8;
                float v[8];
                act_load8(cache + slot_of[kk] + c, v);
#pragma unroll
                for (int z = 0; z < 8; z++) kt[kk][c + z] = v[z];
            }
        } else {
            for (int e = threadIdx.x; e < nk * W; e += blockDim.x) {
                const int kk = e / W, c = e % W;
                kt[kk][c] = act_load(cache, slot_of[kk] + c);
            }
        }
        __syncthreads();
        // partial scores of both heads with every key of the tile
        float sc[MLA_HPW * MLA_TK];
#pragma unroll
        for (int z = 0; z < MLA_HPW * MLA_TK; z++) sc[z] = 0.0f;
#pragma unroll
        for (int i = 0; i < MLA_NPL; i++) {
            const int c = lane + 32 * i;
            if (c < W) {
#pragma unroll
                for (int kk = 0; kk < MLA_TK; kk++) {
                    const float kv = kt[kk][c];
#pragma unroll
                    for (int hh = 0; hh < MLA_HPW; hh++) sc[hh * MLA_TK + kk] = fmaf(qv[hh][i], kv, sc[hh * MLA_TK + kk]);
                }
            }
        }
        mla_fold<16>(sc, lane);
        mla_fold<8>(sc, lane);
        mla_fold<4>(sc, lane);
        mla_fold<2>(sc, lane);
        mla_fold<1>(sc, lane);
        // lane l: head l / 16 of the pair, key l % 16
        const int kk = lane & 15;
        const float score = kk < nk ? sc[0] : NEG_INF;
        float mx = score;
#pragma unroll
        for (int o = 8; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
        const float mn = fmaxf(m, mx);
        const float corr = exp2f(m - mn);
        const float p = exp2f(score - mn);
        float ps = p;
#pragma unroll
        for (int o = 8; o > 0; o >>= 1) ps += __shfl_xor_sync(0xffffffffu, ps, o);
        l = l * corr + ps;
        m = mn;
        const float corr0 = __shfl_sync(0xffffffffu, corr, 0), corr1 = __shfl_sync(0xffffffffu, corr, 16);
#pragma unroll
        for (int i = 0; i < MLA_NPL; i++) {
            acc[0][i] *= corr0;
            acc[1][i] *= corr1;
        }
#pragma unroll
        for (int k2 = 0; k2 < MLA_TK; k2++) {
            const float p0 = __shfl_sync(0xffffffffu, p, k2), p1 = __shfl_sync(0xffffffffu, p, 16 + k2);
            if (k2 < nk) {
#pragma unroll
                for (int i = 0; i < MLA_NPL; i++) {
                    const int c = lane + 32 * i;
                    if (c < r) {
                        const float kv = kt[k2][c];
                        acc[0][i] = fmaf(p0, kv, acc[0][i]);
                        acc[1][i] = fmaf(p1, kv, acc[1][i]);
                    }
                }
            }
        }
    }
#pragma unroll
    for (int hh = 0; hh < MLA_HPW; hh++) {
        const int h = hb + warp * MLA_HPW + hh;
        if (h >= heads) continue;
        const long row = ((long)t * heads + h) * splits + s;
#pragma unroll
        for (int i = 0; i < MLA_NPL; i++) {
            const int c = lane + 32 * i;
            if (c < r) part_o[row * r + c] = acc[hh][i];
        }
        if (lane == 16 * hh) {
            part_ml[row * 2] = m;
            part_ml[row * 2 + 1] = l;
        }
    }
}

// The merge weights of row `row`'s key splits (their (max, sum) pairs in log2 units):
// fs[s] = 2^(m_s - max m) (0 for an empty split) and *inv_l = 1 / sum_s l_s fs[s], in shared
// memory (ms, ls: scratch of `splits` values); the whole block calls it.
__device__ __forceinline__ void mla_split_weights(const float* part_ml, long row, int splits, float* ms, float* ls,
                                                  float* fs, float* inv_l) {
    if ((int)threadIdx.x < splits) {
        ms[threadIdx.x] = part_ml[(row * splits + threadIdx.x) * 2];
        ls[threadIdx.x] = part_ml[(row * splits + threadIdx.x) * 2 + 1];
    }
    __syncthreads();
    if ((int)threadIdx.x < splits) {
        float mx = NEG_INF;
        for (int s = 0; s < splits; s++) mx = fmaxf(mx, ms[s]);
        const float m = ms[threadIdx.x];
        fs[threadIdx.x] = (mx == NEG_INF || m == NEG_INF) ? 0.0f : exp2f(m - mx);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        float lsum = 0.0f;
        for (int s = 0; s < splits; s++) lsum += ls[s] * fs[s];
        *inv_l = lsum > 0.0f ? 1.0f / lsum : 0.0f;
    }
    __syncthreads();
}

// Latent column c of row `row`'s splits merged with their weights fs, before the 1 / l scale.
__device__ __forceinline__ float mla_merge_col(const float* part_o, long row, int splits, int r, int c,
                                               const float* fs) {
    float o = 0.0f;
#pragma unroll 16
    for (int s = 0; s < splits; s++) o = fmaf(part_o[(row * splits + s) * r + c], fs[s], o);
    return o;
}

// Block (head, token, 32-row chunk): merges the splits of o_lat into shared memory, then each
// warp takes 4 output rows j: out[t, h v + j] = W[h (nope + v) + nope + j, :] . o_lat.
template <typename T, typename WT, bool V2>
__device__ void mla_v_up_impl(T* out, const float* part_o, const float* part_ml, const WT* w, int heads, int nope,
                              int v, int r, int splits) {
    __shared__ float ol[MLA_MAXW];
    __shared__ float ms[64], ls[64], fs[64];
    __shared__ float inv_l;
    const int h = blockIdx.x, t = blockIdx.y;
    const long row = (long)t * heads + h;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nw = blockDim.x >> 5;
    // bf16 weights: this warp's rows loaded before the wait (no earlier kernel writes them)
    constexpr bool PRE = sizeof(WT) == 2;
    const bool pre = PRE && r % 8 == 0;
    uint4 wraw[MLA_VROWS / 8][3];
#pragma unroll
    for (int k = 0; k < MLA_VROWS / 8; k++) {
        const int j = blockIdx.z * MLA_VROWS + k * nw + warp;
#pragma unroll
        for (int i = 0; i < 3; i++) {
            const int c = lane * 8 + 256 * i;
            wraw[k][i] = make_uint4(0, 0, 0, 0);
            if (pre && j < v && c < r)
                wraw[k][i] = *reinterpret_cast<const uint4*>(w + ((long)h * (nope + v) + nope + j) * r + c);
        }
    }
    pdl_wait();
    // V2 (up to MLA_V2S splits, 3 columns a thread): the split outputs are loaded together
    // with the (max, sum) pairs instead of after their merge weights are known
    constexpr int MLA_V2S = 16;
    const bool early = V2 && splits <= MLA_V2S && r <= 3 * (int)blockDim.x;
    float po[3][MLA_V2S];
    if (early) {
#pragma unroll
        for (int i = 0; i < 3; i++) {
            const int c = threadIdx.x + i * blockDim.x;
#pragma unroll
            for (int s = 0; s < MLA_V2S; s++)
                po[i][s] = (c < r && s < splits) ? part_o[(row * splits + s) * r + c] : 0.0f;
        }
    }
    mla_split_weights(part_ml, row, splits, ms, ls, fs, &inv_l);
    if (early) {
        // the same sums in the same order as below
#pragma unroll
        for (int i = 0; i < 3; i++) {
            const int c = threadIdx.x + i * blockDim.x;
            if (c < r) {
                float o = 0.0f;
#pragma unroll
                for (int s = 0; s < MLA_V2S; s++)
                    if (s < splits) o = fmaf(po[i][s], fs[s], o);
                ol[c] = o * inv_l;
            }
        }
    } else {
        for (int c = threadIdx.x; c < r; c += blockDim.x) ol[c] = mla_merge_col(part_o, row, splits, r, c, fs) * inv_l;
    }
    __syncthreads();
#pragma unroll
    for (int k = 0; k < MLA_VROWS / 8; k++) {
        const int j = blockIdx.z * MLA_VROWS + k * nw + warp;
        if (j >= v) continue;
        const WT* wr = w + ((long)h * (nope + v) + nope + j) * r;
        float acc = 0.0f;
        if (pre) {
#pragma unroll
            for (int i = 0; i < 3; i++) {
                const int c = lane * 8 + 256 * i;
                if (c < r) {
                    float wv[8];
                    bf16x8_to_f32(wraw[k][i], wv);
#pragma unroll
                    for (int z = 0; z < 8; z++) acc = fmaf(wv[z], ol[c + z], acc);
                }
            }
        } else if (r % 8 == 0) {
#pragma unroll 4
            for (int c = lane * 8; c < r; c += 256) {
                float wv[8];
                act_load8(wr + c, wv);
#pragma unroll
                for (int z = 0; z < 8; z++) acc = fmaf(wv[z], ol[c + z], acc);
            }
        } else {
            for (int c = lane; c < r; c += 32) acc = fmaf(mla_w(wr, c), ol[c], acc);
        }
        acc = warp_sum(acc);
        if (lane == 0) act_store(out, row * v + j, acc);
    }
}

// ---- V up-projection of larger steps on tensor cores (bf16 activations and weights) ----
//
//   mla_merge  block (head, token): the splits of o_lat merged as mla_v_up merges them (same
//              sums in the same order), rounded to bf16: ol[t, h, :];
//   mla_v_mma  block (head, ROWMMA_ROWS V rows, MLA_VT tokens): out[t, h v + j] =
//              W[h (nope + v) + nope + j] . ol[t, h] for the block's tokens, the tokens the
//              columns of the row-streaming products (gemt.cu): each head's V rows are read once
//              a block of tokens instead of once a token.
#define MLA_VT 16
#define MLA_MERGE_THREADS 128
extern "C" __global__ void __launch_bounds__(MLA_MERGE_THREADS) mla_merge(bf16_t* ol, const float* part_o, const float* part_ml,
                                                            int heads, int r, int splits) {
    __shared__ float ms[64], ls[64], fs[64];
    __shared__ float inv_l;
    PDL_ENTRY();
    const int h = blockIdx.x, t = blockIdx.y;
    const long row = (long)t * heads + h;
    mla_split_weights(part_ml, row, splits, ms, ls, fs, &inv_l);
    for (int c = threadIdx.x; c < r; c += blockDim.x)
        ol[row * r + c] = f32_to_bf16(mla_merge_col(part_o, row, splits, r, c, fs) * inv_l);
}

extern "C" __global__ void __launch_bounds__(ROWMMA_THREADS) mla_v_mma(bf16_t* out, const bf16_t* ol, const bf16_t* w,
                                                                      int n, int heads, int nope, int v, int r) {
    PDL_ENTRY();
    const int h = blockIdx.x, t0 = blockIdx.z * MLA_VT;
    const u8* wh = reinterpret_cast<const u8*>(w + ((long)h * (nope + v) + nope) * r);
    rowmma_rows<1, bf16_t>(out, ol, wh, wh, RowmmaMap{nullptr, heads, h}, t0, min(n, t0 + MLA_VT), 1, r, v,
                           rowmma_row0());
}

// mla_q_absorb_mma: mla_q_absorb2 for steps past 8 tokens with bf16 activations and kv_b, the
// absorption on tensor cores. Block (head h, 64 latent columns, 64 tokens; grid (heads, r / 64
// + 2, tokens / 64)): the columns' K rows of the head ([nope, 64] of W_UK) are staged in shared
// memory before the programmatic wait (rows padded to 144 bytes, so ldmatrix reads them without
// bank conflicts); warp w takes columns 16 (w % 4) .. + 16 and every other 8-token tile from
// 8 (w / 4). ldmatrix.trans turns the staged rows into the A operand of mma.sync m16n8k16
// (latent columns as M, nope values as K), the tokens' nope queries are B, read straight from
// q. The further block rows of the grid are mla_q_absorb2's: the rope queries, and (head 0)
// the cache rows, a block each 8 tokens (grid rows r / 64 + 2 * 64 / 8).
#define MLA_QT 64                // tokens a block
#define MLA_QC 64                // latent columns a block
#define MLA_QMAXNOPE 128         // most nope values a head
extern "C" __global__ void __launch_bounds__(256) mla_q_absorb_mma(
    float* qf, const bf16_t* q, const bf16_t* w, int n, int heads, int nope, int dr, int v, int r, bf16_t* cache,
    const bf16_t* kva, const float* gain, const float* inv_freq, const long* slots, const int* positions, float eps,
    float rs, int interleaved) {
    pdl_launch_dependents();
    const int h = blockIdx.x, zr = r / MLA_QC, tb = blockIdx.z * MLA_QT;
    const int nt = min(MLA_QT, n - tb);
    if ((int)blockIdx.y >= zr) {
        // a block each 8 tokens, so every block's rotation table is computed before the wait
        const int y = (int)blockIdx.y - zr, t0 = (y % (MLA_QT / 8)) * 8;
        const bool rows = y >= MLA_QT / 8;
        if ((rows && h != 0) || t0 >= nt) return;
        mla_q_rope<bf16_t>(qf, q, heads, nope, dr, r, cache, kva, gain, inv_freq, slots, positions, eps, rs,
                           interleaved, h, tb + t0, min(8, nt - t0), rows);
        return;
    }
    __shared__ __align__(16) bf16_t ws[MLA_QMAXNOPE][MLA_QC + 8];
    const int c0 = blockIdx.y * MLA_QC;
    const bf16_t* wh = w + (long)h * (nope + v) * r + c0;
    for (int e = threadIdx.x; e < nope * (MLA_QC / 8); e += blockDim.x) {
        const int j = e / (MLA_QC / 8), cc = (e % (MLA_QC / 8)) * 8;
        *reinterpret_cast<uint4*>(&ws[j][cc]) = ld_stream16(wh + (long)j * r + cc);
    }
    __syncthreads();
    pdl_wait();
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int qk = nope + dr, W = r + dr, cw = (warp & 3) * 16;
    // lane l addresses row l % 8 of 8x8 matrix l / 8 (matrix j: K rows + 8 (j / 2), M columns + 8 (j % 2))
    const int lr = (lane & 7) + (lane >> 4) * 8, lc = cw + ((lane >> 3) & 1) * 8;
    constexpr int NTILE = MLA_QT / 16;  // tiles a warp
    float acc[NTILE][4];
#pragma unroll
    for (int i = 0; i < NTILE; i++) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.0f;
    // tile i's B column g: token tg + 16 i, its nope query from q0 (2 t values in)
    const int tg = tb + (warp >> 2) * 8 + g;
    const bf16_t* q0 = q + (long)h * qk + 2 * t;
    const long qstep = 16L * heads * qk;
    for (int k0 = 0; k0 < nope; k0 += 16) {
        u32 a[4];
        ldsm_x4_t(a[0], a[1], a[2], a[3], &ws[k0 + lr][lc]);
#pragma unroll
        for (int i = 0; i < NTILE; i++) {
            if ((warp >> 2) * 8 + 16 * i >= nt) break;  // warp-uniform
            const bool ok = tg + 16 * i < n;
            const bf16_t* qi = q0 + (long)tg * heads * qk + i * qstep + k0;
            const u32 b0 = ok ? __ldg(reinterpret_cast<const u32*>(qi)) : 0u;
            const u32 b1 = ok ? __ldg(reinterpret_cast<const u32*>(qi + 8)) : 0u;
            mma_bf16_16816(acc[i], a, b0, b1);
        }
    }
#pragma unroll
    for (int i = 0; i < NTILE; i++)
#pragma unroll
        for (int e = 0; e < 4; e++) {
            const int tok = tb + (warp >> 2) * 8 + 16 * i + 2 * t + (e & 1), c = c0 + cw + g + (e >> 1) * 8;
            if (tok < n) qf[((long)tok * heads + h) * W + c] = acc[i][e];
        }
}

// mla_decode_mma: mla_decode2 for steps past 8 tokens with a bf16 cache, on tensor cores (the
// heads of a group as the M dimension of mma.sync m16n8k16, as FlashMLA does). Block (token t,
// head group, split s; MLA_DTHREADS threads) with the same outputs as mla_decode2 (the split's
// unnormalized latent output and its (max, sum) in log2 units). Keys stream through shared
// memory in tiles of MLA_DT by cp.async, two buffers so the next tile's rows are in flight while
// one is used (the first tile's rows written by earlier steps before the programmatic wait);
// the scaled query is staged once as bf16. Per tile: warp w scores keys 8 (w % 4) .. + 8 with
// every head over every other 32 of the W values from 32 (w / 4) (S = Q K^T, ldmatrix of the
// staged rows; the two halves' sums meet in shared memory), the block takes the tile's
// online-softmax step there (P in bf16), then warp w adds P V for latent columns [w r / 8,
// (w + 1) r / 8) (V = the rows' first r values, through ldmatrix.trans). Needs W % 32 == 0,
// r % 128 == 0, W <= MLA_MAXW.
#define MLA_DT 32                                           // keys a tile
#define MLA_DWP (MLA_MAXW + 8)                              // a staged row, values (ldmatrix without bank conflicts)
#define MLA_DTHREADS 256
#define MLA_DSMEM ((2 * MLA_DT + MLA_HEADS) * MLA_DWP * 2)  // dynamic shared memory: two key tiles, the query
#define MLA_DNT (MLA_MAXW / 64)                             // most 8-column output tiles a warp (r / 64)

// Tile rows of keys j0 .. j0 + nk (their cache offsets in `slot`) into `sk` by cp.async; rows
// past nk are zero-filled. which: 1 the rows before `safe` only, 2 all others, 0 all.
__device__ __forceinline__ void mla_dm_tile(bf16_t (*sk)[MLA_DWP], const long* slot, const bf16_t* cache, int W,
                                            int nk, int j0, int safe, int which) {
    const int per = W / 8;
    for (int e = threadIdx.x; e < MLA_DT * per; e += blockDim.x) {
        const int kk = e / per, c = (e % per) * 8;
        const bool ok = kk < nk, early = ok && j0 + kk < safe;
        if (which == 1 ? !early : which == 2 ? early : false) continue;
        cp_async16(&sk[kk][c], ok ? cache + slot[kk] + c : cache, ok);
    }
}

// Cache offsets of keys j0 .. min(j0 + MLA_DT, k1) into slot (threads below MLA_DT).
__device__ __forceinline__ void mla_dm_slots(long* slot, const int* table, int block_size, int W, int j0, int k1) {
    if ((int)threadIdx.x < MLA_DT) {
        const int j = j0 + threadIdx.x;
        slot[threadIdx.x] = j < k1 ? ((long)table[j / block_size] * block_size + j % block_size) * W : 0;
    }
}

// A step of the double-buffered walk over the key tiles: the next tile's rows (keys jn ..,
// when any are left) asked into the other buffer, then this tile's awaited; on return the
// block sees this tile in sk[buf].
__device__ __forceinline__ void mla_dm_step(long (*slot)[MLA_DT], bf16_t (*sk)[MLA_DT][MLA_DWP], int buf,
                                            const int* table, int block_size, int W, const bf16_t* cache, int jn,
                                            int k1) {
    if (jn < k1) {
        // the other buffer's last readers finished the previous tile before this barrier
        mla_dm_slots(slot[buf ^ 1], table, block_size, W, jn, k1);
        __syncthreads();
        mla_dm_tile(sk[buf ^ 1], slot[buf ^ 1], cache, W, min(MLA_DT, k1 - jn), jn, 0, 0);
    }
    cp_async_commit();
    cp_async_wait_group<1>();  // this tile's rows
    __syncthreads();
}

// O += P V for a warp's 16 rows of the attention's tile: its accumulators (NT 8-column tiles of
// the latent columns from col0, the first `cols` columns in use) rescaled by the rows' softmax
// corrections (c0 for rows g, c1 for rows g + 8), then the rows' weights P (bf16, from row `p`)
// times the tile's key rows `k` (ldmatrix.trans), 16 keys a step.
template <int NT>
__device__ __forceinline__ void mla_dm_pv(float (&acc)[NT][4], float c0, float c1, const bf16_t (*p)[MLA_DT + 8],
                                          const bf16_t (*k)[MLA_DWP], int col0, int cols) {
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int n = 0; n < NT; n++) {
        acc[n][0] *= c0;
        acc[n][1] *= c0;
        acc[n][2] *= c1;
        acc[n][3] *= c1;
    }
#pragma unroll
    for (int kk = 0; kk < MLA_DT; kk += 16) {
        u32 a[4];
        ldsm_x4(a[0], a[1], a[2], a[3], &p[lane & 15][kk + (lane >> 4) * 8]);
#pragma unroll
        for (int n = 0; n < NT; n += 2) {
            if (n * 8 >= cols) break;  // warp-uniform
            u32 b[4];
            ldsm_x4_t(b[0], b[1], b[2], b[3], &k[kk + (lane & 7) + ((lane >> 3) & 1) * 8][col0 + n * 8 + (lane >> 4) * 8]);
            mma_bf16_16816(acc[n], a, b[0], b[1]);
            mma_bf16_16816(acc[n + 1], a, b[2], b[3]);
        }
    }
}

extern "C" __global__ void __launch_bounds__(MLA_DTHREADS) mla_decode_mma(
    float* part_o, float* part_ml, const float* qf, const bf16_t* cache, const int* tok_seq, const int* positions,
    const int* tables, int table_width, int block_size, int heads, int r, int dr, float scale_log2, int splits) {
    pdl_launch_dependents();
    extern __shared__ __align__(16) u8 mla_dsm[];
    bf16_t(*sk)[MLA_DT][MLA_DWP] = reinterpret_cast<bf16_t(*)[MLA_DT][MLA_DWP]>(mla_dsm);
    bf16_t(*sq)[MLA_DWP] = reinterpret_cast<bf16_t(*)[MLA_DWP]>(mla_dsm + 2 * MLA_DT * MLA_DWP * 2);
    __shared__ float ss[2][MLA_HEADS][MLA_DT];
    __shared__ __align__(16) bf16_t sp[MLA_HEADS][MLA_DT + 8];
    __shared__ float scorr[MLA_HEADS], smax[MLA_HEADS], ssum[MLA_HEADS];
    __shared__ long slot[2][MLA_DT];
    const int t = blockIdx.x, hb = blockIdx.y * MLA_HEADS, s = blockIdx.z;
    const int W = r + dr, rw = r / 8;  // latent columns a warp
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, tq = lane & 3;
    const int len = positions[t] + 1;
    const int chunk = (len + splits - 1) / splits;
    const int k0 = s * chunk, k1 = min(len, k0 + chunk);
    const int* table = tables + (long)tok_seq[t] * table_width;
    // rows before `safe` were written by earlier steps (see mla_decode2)
    const int safe = len - (int)gridDim.x;
    mla_dm_slots(slot[0], table, block_size, W, k0, k1);
    __syncthreads();
    if (k0 < k1) mla_dm_tile(sk[0], slot[0], cache, W, min(MLA_DT, k1 - k0), k0, safe, 1);
    pdl_wait();
    if (k0 < k1) mla_dm_tile(sk[0], slot[0], cache, W, min(MLA_DT, k1 - k0), k0, safe, 2);
    cp_async_commit();
    // the scaled query as bf16, MLA_DQL loads a thread in flight at a time
    constexpr int MLA_DQL = 6;
    for (int e0 = 0; e0 < MLA_HEADS * (W / 4); e0 += MLA_DQL * MLA_DTHREADS) {
        float4 v[MLA_DQL];
#pragma unroll
        for (int i = 0; i < MLA_DQL; i++) {
            const int e = e0 + i * MLA_DTHREADS + threadIdx.x, hh = e / (W / 4), c = (e % (W / 4)) * 4;
            v[i] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            if (hh < MLA_HEADS && hb + hh < heads)
                v[i] = *reinterpret_cast<const float4*>(qf + ((long)t * heads + hb + hh) * W + c);
        }
#pragma unroll
        for (int i = 0; i < MLA_DQL; i++) {
            const int e = e0 + i * MLA_DTHREADS + threadIdx.x, hh = e / (W / 4), c = (e % (W / 4)) * 4;
            if (hh < MLA_HEADS) {
                sq[hh][c] = f32_to_bf16(v[i].x * scale_log2);
                sq[hh][c + 1] = f32_to_bf16(v[i].y * scale_log2);
                sq[hh][c + 2] = f32_to_bf16(v[i].z * scale_log2);
                sq[hh][c + 3] = f32_to_bf16(v[i].w * scale_log2);
            }
        }
    }
    if ((int)threadIdx.x < MLA_HEADS) {
        smax[threadIdx.x] = NEG_INF;
        ssum[threadIdx.x] = 0.0f;
    }
    float acc[MLA_DNT][4];
#pragma unroll
    for (int n = 0; n < MLA_DNT; n++) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.0f;
    int buf = 0;
    for (int j0 = k0; j0 < k1; j0 += MLA_DT, buf ^= 1) {
        const int nk = min(MLA_DT, k1 - j0), jn = j0 + MLA_DT;
        mla_dm_step(slot, sk, buf, table, block_size, W, cache, jn, k1);
        // scores of keys 8 kw .. + 8 with all heads over half the values (the two halves of
        // each 32-value step into their own sums: two chains of dependent products, not one)
        const int kw = warp & 3, dh = warp >> 2;
        float sc[4] = {0.0f, 0.0f, 0.0f, 0.0f}, sc2[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        for (int k = dh * 32; k < W; k += 64) {
            u32 b[4], a[4], a2[4];
            ldsm_x4(b[0], b[1], b[2], b[3], &sk[buf][kw * 8 + (lane & 7)][k + (lane >> 3) * 8]);
            ldsm_x4(a[0], a[1], a[2], a[3], &sq[lane & 15][k + (lane >> 4) * 8]);
            ldsm_x4(a2[0], a2[1], a2[2], a2[3], &sq[lane & 15][k + 16 + (lane >> 4) * 8]);
            mma_bf16_16816(sc, a, b[0], b[1]);
            mma_bf16_16816(sc2, a2, b[2], b[3]);
        }
#pragma unroll
        for (int i = 0; i < 4; i++) sc[i] += sc2[i];
        ss[dh][g][kw * 8 + 2 * tq] = sc[0];
        ss[dh][g][kw * 8 + 2 * tq + 1] = sc[1];
        ss[dh][g + 8][kw * 8 + 2 * tq] = sc[2];
        ss[dh][g + 8][kw * 8 + 2 * tq + 1] = sc[3];
        __syncthreads();
        {
            // the online-softmax step: 16 threads a head, 2 keys each
            const int hh = threadIdx.x >> 4, kq = (threadIdx.x & 15) * 2;
            float v[2], mx = NEG_INF;
#pragma unroll
            for (int i = 0; i < 2; i++) {
                v[i] = kq + i < nk ? ss[0][hh][kq + i] + ss[1][hh][kq + i] : NEG_INF;
                mx = fmaxf(mx, v[i]);
            }
#pragma unroll
            for (int o = 8; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
            const float mo = smax[hh], mn = fmaxf(mo, mx);
            float ps = 0.0f;
#pragma unroll
            for (int i = 0; i < 2; i++) {
                const float p = exp2f(v[i] - mn);
                sp[hh][kq + i] = f32_to_bf16(p);
                ps += p;
            }
#pragma unroll
            for (int o = 8; o > 0; o >>= 1) ps += __shfl_xor_sync(0xffffffffu, ps, o);
            __syncwarp();
            if ((threadIdx.x & 15) == 0) {
                const float c = exp2f(mo - mn);
                scorr[hh] = c;
                ssum[hh] = ssum[hh] * c + ps;
                smax[hh] = mn;
            }
        }
        __syncthreads();
        mla_dm_pv<MLA_DNT>(acc, scorr[g], scorr[g + 8], sp, sk[buf], warp * rw, rw);
    }
    cp_async_wait_all();
#pragma unroll
    for (int n = 0; n < MLA_DNT; n++) {
        if (n * 8 >= rw) break;
        const int c = warp * rw + n * 8 + 2 * tq;
#pragma unroll
        for (int hi = 0; hi < 2; hi++) {
            const int h = hb + g + hi * 8;
            if (h < heads) {
                const long row = ((long)t * heads + h) * splits + s;
                *reinterpret_cast<float2*>(part_o + row * r + c) = make_float2(acc[n][2 * hi], acc[n][2 * hi + 1]);
            }
        }
    }
    if ((int)threadIdx.x < MLA_HEADS && hb + (int)threadIdx.x < heads) {
        const long row = ((long)t * heads + hb + threadIdx.x) * splits + s;
        part_ml[row * 2] = smax[threadIdx.x];
        part_ml[row * 2 + 1] = ssum[threadIdx.x];
    }
}

// mla_decode_mma4: mla_decode_mma for steps whose sequences run several tokens each (prompts):
// a block takes MLA_D4T consecutive tokens of the step with their 16 heads as 64 rows, so each
// key tile streamed into shared memory serves all of them. The block's tokens are taken a run of
// one sequence at a time (a block spanning two sequences walks each one's keys); a run's split s
// covers keys [s c, (s + 1) c) of its longest context (c = ceil(longest / splits)) and masks
// each token's keys from its own length on, so every key of a token is in exactly one split, as
// the merge needs. 8 warps: warp w scores the 16 rows of token w % 4 against keys
// 16 (w / 4) .. + 16 of the tile, the block takes the online-softmax step in shared memory, then
// warp w adds P V for token w % 4's rows and latent columns [(w / 4) r / 2, (w / 4 + 1) r / 2).
// No loads before the programmatic wait (prompts are not latency-bound). Needs W % 32 == 0,
// r % 32 == 0, r <= 512, W <= MLA_MAXW.
#define MLA_D4T 4
#define MLA_D4ROWS (MLA_D4T * MLA_HEADS)
#define MLA_D4NT (512 / 2 / 8)                                  // most 8-column output tiles a warp
#define MLA_D4SMEM ((2 * MLA_DT + MLA_D4ROWS) * MLA_DWP * 2)    // two key tiles, 64 query rows

extern "C" __global__ void __launch_bounds__(MLA_DTHREADS, 1) mla_decode_mma4(
    float* part_o, float* part_ml, const float* qf, const bf16_t* cache, const int* tok_seq, const int* positions,
    const int* tables, int table_width, int block_size, int heads, int r, int dr, float scale_log2, int splits,
    int n) {
    pdl_launch_dependents();
    extern __shared__ __align__(16) u8 mla_dsm4[];
    bf16_t(*sk)[MLA_DT][MLA_DWP] = reinterpret_cast<bf16_t(*)[MLA_DT][MLA_DWP]>(mla_dsm4);
    bf16_t(*sq)[MLA_DWP] = reinterpret_cast<bf16_t(*)[MLA_DWP]>(mla_dsm4 + 2 * MLA_DT * MLA_DWP * 2);
    __shared__ float ss[MLA_D4ROWS][MLA_DT];
    __shared__ __align__(16) bf16_t sp[MLA_D4ROWS][MLA_DT + 8];
    __shared__ float scorr[MLA_D4ROWS], smax[MLA_D4ROWS], ssum[MLA_D4ROWS];
    __shared__ long slot[2][MLA_DT];
    __shared__ int slen[MLA_D4T], sseq[MLA_D4T];
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, tq = lane & 3;
    const int tb = blockIdx.x * MLA_D4T, hb = blockIdx.y * MLA_HEADS, s = blockIdx.z;
    const int nt = min(MLA_D4T, n - tb);
    const int W = r + dr, rh = r / 2;
    const int tw = warp & 3, kh = warp >> 2;  // this warp's token of the block, key / column half
    pdl_wait();
    if (tid < MLA_D4T) {
        slen[tid] = tid < nt ? positions[tb + tid] + 1 : 0;
        sseq[tid] = tid < nt ? tok_seq[tb + tid] : -1;
    }
    // the block's scaled queries as bf16 (rows of missing tokens or heads zero)
    constexpr int MLA_DQL = 6;
    for (int e0 = 0; e0 < MLA_D4ROWS * (W / 4); e0 += MLA_DQL * MLA_DTHREADS) {
        float4 v[MLA_DQL];
#pragma unroll
        for (int i = 0; i < MLA_DQL; i++) {
            const int e = e0 + i * MLA_DTHREADS + tid, row = e / (W / 4), c = (e % (W / 4)) * 4;
            const int ts = row >> 4, hh = row & 15;
            v[i] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            if (row < MLA_D4ROWS && ts < nt && hb + hh < heads)
                v[i] = *reinterpret_cast<const float4*>(qf + ((long)(tb + ts) * heads + hb + hh) * W + c);
        }
#pragma unroll
        for (int i = 0; i < MLA_DQL; i++) {
            const int e = e0 + i * MLA_DTHREADS + tid, row = e / (W / 4), c = (e % (W / 4)) * 4;
            if (row < MLA_D4ROWS) {
                sq[row][c] = f32_to_bf16(v[i].x * scale_log2);
                sq[row][c + 1] = f32_to_bf16(v[i].y * scale_log2);
                sq[row][c + 2] = f32_to_bf16(v[i].z * scale_log2);
                sq[row][c + 3] = f32_to_bf16(v[i].w * scale_log2);
            }
        }
    }
    __syncthreads();
    for (int a = 0; a < nt;) {
        // the run of tokens [a, b) of one sequence, and its longest context
        int b = a + 1, longest = slen[a];
        while (b < nt && sseq[b] == sseq[a]) longest = max(longest, slen[b++]);
        const int chunk = (longest + splits - 1) / splits;
        const int k0 = s * chunk, k1 = min(longest, k0 + chunk);
        const int* table = tables + (long)sseq[a] * table_width;
        if (tid < MLA_D4ROWS) {
            smax[tid] = NEG_INF;
            ssum[tid] = 0.0f;
        }
        float acc[MLA_D4NT][4];
#pragma unroll
        for (int q = 0; q < MLA_D4NT; q++) acc[q][0] = acc[q][1] = acc[q][2] = acc[q][3] = 0.0f;
        mla_dm_slots(slot[0], table, block_size, W, k0, k1);
        __syncthreads();
        if (k0 < k1) mla_dm_tile(sk[0], slot[0], cache, W, min(MLA_DT, k1 - k0), k0, 0, 0);
        cp_async_commit();
        int buf = 0;
        for (int j0 = k0; j0 < k1; j0 += MLA_DT, buf ^= 1) {
            const int nk = min(MLA_DT, k1 - j0), jn = j0 + MLA_DT;
            mla_dm_step(slot, sk, buf, table, block_size, W, cache, jn, k1);
            // scores of token tw's rows against keys 16 kh .. + 16 (the two halves of each
            // 32-value step into their own sums)
            float sa[2][4], sb[2][4];
#pragma unroll
            for (int nb = 0; nb < 2; nb++)
#pragma unroll
                for (int i = 0; i < 4; i++) sa[nb][i] = sb[nb][i] = 0.0f;
            for (int k = 0; k < W; k += 32) {
                u32 a0[4], a1[4];
                ldsm_x4(a0[0], a0[1], a0[2], a0[3], &sq[tw * 16 + (lane & 15)][k + (lane >> 4) * 8]);
                ldsm_x4(a1[0], a1[1], a1[2], a1[3], &sq[tw * 16 + (lane & 15)][k + 16 + (lane >> 4) * 8]);
#pragma unroll
                for (int nb = 0; nb < 2; nb++) {
                    u32 bq[4];
                    ldsm_x4(bq[0], bq[1], bq[2], bq[3], &sk[buf][kh * 16 + nb * 8 + (lane & 7)][k + (lane >> 3) * 8]);
                    mma_bf16_16816(sa[nb], a0, bq[0], bq[1]);
                    mma_bf16_16816(sb[nb], a1, bq[2], bq[3]);
                }
            }
#pragma unroll
            for (int nb = 0; nb < 2; nb++)
#pragma unroll
                for (int i = 0; i < 4; i++)
                    ss[tw * 16 + g + (i >> 1) * 8][kh * 16 + nb * 8 + 2 * tq + (i & 1)] = sa[nb][i] + sb[nb][i];
            __syncthreads();
            {
                // the online-softmax step: 4 threads a row, 8 keys each; a row's keys count
                // while its token's context lasts
                const int row = tid >> 2, kq = (tid & 3) * 8, ts = row >> 4;
                const int lim = ts >= a && ts < b ? min(nk, slen[ts] - j0) : 0;
                float v[8], mx = NEG_INF;
#pragma unroll
                for (int i = 0; i < 8; i++) {
                    v[i] = kq + i < lim ? ss[row][kq + i] : NEG_INF;
                    mx = fmaxf(mx, v[i]);
                }
#pragma unroll
                for (int o = 2; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
                const float mo = smax[row], mn = fmaxf(mo, mx);
                const bool none = mn == NEG_INF;  // no key of this row yet
                float ps = 0.0f;
#pragma unroll
                for (int i = 0; i < 8; i++) {
                    const float p = none ? 0.0f : exp2f(v[i] - mn);
                    sp[row][kq + i] = f32_to_bf16(p);
                    ps += p;
                }
#pragma unroll
                for (int o = 2; o > 0; o >>= 1) ps += __shfl_xor_sync(0xffffffffu, ps, o);
                __syncwarp();
                if ((tid & 3) == 0) {
                    const float c = none ? 1.0f : exp2f(mo - mn);
                    scorr[row] = c;
                    ssum[row] = ssum[row] * c + ps;
                    smax[row] = mn;
                }
            }
            __syncthreads();
            mla_dm_pv<MLA_D4NT>(acc, scorr[tw * 16 + g], scorr[tw * 16 + g + 8], sp + tw * 16, sk[buf], kh * rh, rh);
        }
        cp_async_wait_all();
        if (tw >= a && tw < b) {
#pragma unroll
            for (int q = 0; q < MLA_D4NT; q++) {
                if (q * 8 >= rh) break;
                const int c = kh * rh + q * 8 + 2 * tq;
#pragma unroll
                for (int hi = 0; hi < 2; hi++) {
                    const int h = hb + g + hi * 8;
                    if (h < heads) {
                        const long row = ((long)(tb + tw) * heads + h) * splits + s;
                        *reinterpret_cast<float2*>(part_o + row * r + c) =
                            make_float2(acc[q][2 * hi], acc[q][2 * hi + 1]);
                    }
                }
            }
        }
        __syncthreads();
        if (tid < MLA_D4ROWS) {
            const int ts = tid >> 4, h = hb + (tid & 15);
            if (ts >= a && ts < b && h < heads) {
                const long row = ((long)(tb + ts) * heads + h) * splits + s;
                part_ml[row * 2] = smax[tid];
                part_ml[row * 2 + 1] = ssum[tid];
            }
        }
        __syncthreads();  // the next run resets the row state
        a = b;
    }
}

// ---- Decode steps of one token a sequence: one launch (mla_dec1) ----
//
// Block (cluster rank b, head h, token t): the C blocks of a cluster (grid (C, H, n), cluster
// (C, 1, 1)) serve one head of one token. Block b absorbs latent columns [b rc, (b + 1) rc)
// of the query (rc = r / C), the cluster gathers the whole absorbed query through distributed
// shared memory, block b attends over keys [b chunk, (b + 1) chunk) of the context, the
// splits merge through distributed shared memory in rank order, and block b projects V rows
// [b vc, (b + 1) vc) (vc = v / C). The block holding the token's own position computes its
// cache row (RMS-normalized latent, rotated rope key, rounded to T) and uses it from shared
// memory; head 0's cluster writes it to the cache. Every other cached key was written by an
// earlier step, so the first tile's rows stream into shared memory (cp.async) before the
// programmatic wait, together with both projections' weights (into registers). Nothing a
// token computes depends on the other tokens of the step.
#define MLA1_THREADS 256
#define MLA1_MAXRC 64                    // most absorbed latent columns a block (r / C)
#define MLA1_PRE 4                       // 8-value weight chunks a thread holds for the absorption
#define MLA1_VR 2                        // V rows a warp
#define MLA1_VC 2                        // 8-value chunks of a V row a lane (r <= 512)
#define MLA1_MAXDR 128                   // most rope values
#define MLA1_MAXC 8                      // most blocks a cluster
#define MLA1_MAXQR 192                   // most query rows a block of the fused layer launch
#define MLA1_MAXVR 16                    // most V rows a block (v / C)
#define MLA1_MAXV 256                    // most V values a head
#define MLA1_MAXLR 64                    // most q + kv_a rows a block of the fused layer launch

// Eight consecutive weights, loaded raw (so the load can go out early) and converted later.
template <typename WT>
struct Mla8;
template <>
struct Mla8<bf16_t> {
    uint4 v;
    __device__ __forceinline__ void zero() { v = make_uint4(0, 0, 0, 0); }
    __device__ __forceinline__ void load(const bf16_t* p) { v = ld_stream16(p); }
    __device__ __forceinline__ void get(float* o) const { bf16x8_to_f32(v, o); }
};
template <>
struct Mla8<float> {
    uint4 a, b;
    __device__ __forceinline__ void zero() { a = b = make_uint4(0, 0, 0, 0); }
    __device__ __forceinline__ void load(const float* p) {
        a = ld_stream16(p);
        b = ld_stream16(p + 4);
    }
    __device__ __forceinline__ void get(float* o) const {
        o[0] = __uint_as_float(a.x); o[1] = __uint_as_float(a.y); o[2] = __uint_as_float(a.z); o[3] = __uint_as_float(a.w);
        o[4] = __uint_as_float(b.x); o[5] = __uint_as_float(b.y); o[6] = __uint_as_float(b.z); o[7] = __uint_as_float(b.w);
    }
};

// Where key j's cache row starts (values) in a paged cache of rows W values long.
__device__ __forceinline__ long mla1_key_offset(const int* table, int block_size, int W, int j) {
    return ((long)table[j / block_size] * block_size + j % block_size) * W;
}

// Looks up the cache offsets of keys [j0, j0 + nk) into slot_of, then streams their rows
// (all but position `skip`) into kt with cp.async; the caller waits and synchronizes.
template <typename T, int KT>
__device__ __forceinline__ void mla1_tile(T (*kt)[MLA_MAXW], long* slot_of, const T* cache, const int* table,
                                          int block_size, int W, int j0, int nk, int skip) {
    if ((int)threadIdx.x < nk) slot_of[threadIdx.x] = mla1_key_offset(table, block_size, W, j0 + threadIdx.x);
    __syncthreads();
    constexpr int E = 16 / sizeof(T);  // values a 16-byte copy
    const int per = W / E;
    for (int e = threadIdx.x; e < nk * per; e += blockDim.x) {
        const int kk = e / per, c = (e % per) * E;
        if (j0 + kk != skip) cp_async16(&kt[kk][c], cache + slot_of[kk] + c, true);
    }
    cp_async_commit();
}

// The attention half of a decoder layer in the fused decode launch (`mla_layer1`, one token,
// bf16): the RMSNorm of the residual stream and the q / kv_a products before the attention,
// the o product and the residual add after it. Block b of head h's cluster (global block
// g = h C + b of heads * C) computes rows [b rq, (b + 1) rq) of its head's query (the cluster
// reads them from its shared memory) and kv_a rows [g rk, (g + 1) rk) (written to `kva`, then
// counted in cnt[0]: the block holding the token's own position waits for all of them), both
// from rows the L2 cache is asked for before the programmatic wait (shared memory for them
// would leave one block a multiprocessor, too few for every cluster at once). After the V rows each
// block takes o rows [b ro, (b + 1) ro) times its head's V output (o columns [h v, (h + 1) v)),
// a partial sum per head into `part`; the last of the heads' blocks of a row chunk (cnt[2 + b])
// adds the heads' partials in head order, so the sum does not depend on which came last,
// and stores the product and the residual. The counters return to zero (cnt[1] counts the
// blocks that are done). Every block of the grid must be resident together (the host checks
// the device holds that many clusters).
template <typename T>
struct Mla1Layer {
    const T* x;          // the residual stream (the norm's input)
    const float* g;      // the norm's gain
    float eps;
    T* h;                // the normalized row (or null)
    const u8* wq;        // q_proj, [heads * (nope + dr), k]
    const u8* wk;        // kv_a_proj, [r + dr, k]
    long row_bytes;      // of both
    int k;               // the hidden width
    int rq, rk;          // q rows a block, kv_a rows a block
    const u8* wo;        // o_proj, [k, heads * v] (null: no o product)
    long wo_row_bytes;
    T* oy;               // the o product
    T* res;              // the residual stream, += o (or null)
    float* part;         // [heads, k] partial o sums
    u32* cnt;            // 2 + C zeroed counters
};

// Asks the L2 cache for rows [0, n) of `w` (`bytes` each, rows `row_bytes` apart).
__device__ __forceinline__ void mla1_prefetch_rows(const u8* w, long row_bytes, unsigned bytes, int n) {
    for (int j = threadIdx.x; j < n; j += blockDim.x) prefetch_l2_bulk(w + (long)j * row_bytes, bytes);
}

// A value of the token's kv_a row: in the fused layer launch other blocks wrote it (read past L1).
template <bool LAYER, typename T>
__device__ __forceinline__ float mla1_row_ld(const T* p, long i) {
    if constexpr (LAYER) return act_load_cg(p, i);
    else return act_load(p, i);
}

// The layer's q and kv_a rows of this block (see Mla1Layer): the normalized input staged in
// `xs` times each row (`wq`: the block's first query row, `wk`: its first kv_a row), warp w
// taking rows [w rp, (w + 1) rp). Query rows go to `qloc` (rounded as the activations store
// them) and to `q`; kv_a rows to `kva`, fenced, then counted.
template <typename T>
__device__ void mla1_qkv(const Mla1Layer<T>& L, const u8* wq, const u8* wk, float* xs, float* red, float* qloc,
                         T* q, T* kva, int nq, int nk, int q0, int k0, long g, long nblocks) {
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int nch = L.k >> 3;
    const float ss = stage_row<true>([&](int c, float* v) { act_load8(L.x + (long)c * 8, v); }, L.g, xs, nch);
    const float rstd = block_rstd<MLA_WARPS>(ss, red, L.k, L.eps);
    if (L.h != nullptr && tid < 8)
        for (long c = g; c < nch; c += nblocks) {
            const long e = c * 8 + tid;
            act_store(L.h, e, act_load(L.x, e) * rstd * L.g[e]);
        }
    const int nr = nq + nk, rp = (nr + MLA_WARPS - 1) / MLA_WARPS;
    constexpr int MAXRP = MLA1_MAXLR / MLA_WARPS;  // rows a warp
    float acc[MAXRP];
    const uint4* wrow[MAXRP];
#pragma unroll
    for (int i = 0; i < MAXRP; i++) {
        const int j = warp * rp + i;
        acc[i] = 0.0f;
        wrow[i] = reinterpret_cast<const uint4*>(j < nq ? wq + (long)j * L.row_bytes : wk + (long)(j - nq) * L.row_bytes);
    }
#pragma unroll 2
    for (int c = lane; c < nch; c += 32) {
        const float4 xa = *reinterpret_cast<const float4*>(&xs[c * 8]);
        const float4 xb = *reinterpret_cast<const float4*>(&xs[c * 8 + 4]);
#pragma unroll
        for (int i = 0; i < MAXRP; i++) {
            const int j = warp * rp + i;
            if (i < rp && j < nr) acc[i] = dot8_add(acc[i], __ldg(&wrow[i][c]), xa, xb);
        }
    }
#pragma unroll
    for (int i = 0; i < MAXRP; i++) {
        const int j = warp * rp + i;
        if (i < rp && j < nr) {  // warp-uniform
            const float s = warp_sum(acc[i]) * rstd;
            if (lane == 0) {
                if (j < nq) {
                    qloc[j] = act_round(q, s);
                    act_store(q, q0 + j, s);
                } else {
                    act_store(kva, k0 + j - nq, s);
                }
            }
        }
    }
    __threadfence();  // the kv_a stores, before the count
    __syncthreads();
    if (tid == 0 && nk > 0) atomicAdd(&L.cnt[0], 1u);
}

// The o product's partial sums of this block (rows [row0, row0 + nro), columns of head h,
// times the head's V output `vf`), then the row chunk's sum by its last block.
template <typename T>
__device__ void mla1_o(const Mla1Layer<T>& L, const float* vf, int* flag, int h, int heads, int b, int v, int row0,
                       int nro) {
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int nvc = v >> 3;
    int lp = 1;  // lanes a row: the chunks of a row, rounded up to a power of two
    while (lp < nvc) lp <<= 1;
    const int per = 32 / lp;  // rows a warp at a time
    const u8* w0 = L.wo + (long)row0 * L.wo_row_bytes + (long)h * v * 2;
    // the lane's V values in registers; 4 rows' loads in flight at a time
    const int c = lane % lp;
    float vr[8];
#pragma unroll
    for (int e = 0; e < 8; e++) vr[e] = c < nvc ? vf[c * 8 + e] : 0.0f;
#pragma unroll 4
    for (int base = warp * per; base < nro; base += MLA_WARPS * per) {
        const int j = base + lane / lp;
        float a = 0.0f;
        if (j < nro && c < nvc) {
            float wf[8];
            bf16x8_to_f32(__ldg(reinterpret_cast<const uint4*>(w0 + (long)j * L.wo_row_bytes) + c), wf);
#pragma unroll
            for (int e = 0; e < 8; e++) a = fmaf(wf[e], vr[e], a);
        }
        for (int o = lp >> 1; o > 0; o >>= 1) a += __shfl_xor_sync(0xffffffffu, a, o);
        if (c == 0 && j < nro) L.part[(long)h * L.k + row0 + j] = a;
    }
    __threadfence();  // the partial sums, before the count
    __syncthreads();
    if (tid == 0) {
        const bool last = atomicAdd(&L.cnt[2 + b], 1u) == (u32)(heads - 1);
        if (last) L.cnt[2 + b] = 0u;
        *flag = last;
    }
    __syncthreads();
    if (*flag) {
        __threadfence();
        for (int j = tid; j < nro; j += blockDim.x) {
            const long e = row0 + j;
            float s = 0.0f;
            // the heads' loads in flight together, added in head order
#pragma unroll 8
            for (int hh = 0; hh < heads; hh++) s += __ldcg(&L.part[(long)hh * L.k + e]);
            act_store(L.oy, e, s);
            if (L.res != nullptr) act_store(L.res, e, act_load(L.res, e) + act_round(L.oy, s));
        }
    }
}

// Where mla_dec1 lets the next launch, the o product, in: 0 first thing (before session 37;
// MLA1_X_EARLY_TRIGGER), 1 after the query's staging, 2 after the attention's splits (the
// default), 3 after the merge; MLA1_X_TRIGGER_AT picks 1 or 3 for measuring. After the
// attention its blocks copy their rows while the merge and the V projection run rather than
// while this launch's own copies and the q / kv_a product before it still stream: 1.004-1.019x
// on the Moonlight step (three H100s; 1 the same, 3 6% slower: doc/benchmarks.md).
#if defined(MLA1_X_EARLY_TRIGGER)
#define MLA1_TRIGGER_AT 0
#elif defined(MLA1_X_TRIGGER_AT)
#define MLA1_TRIGGER_AT MLA1_X_TRIGGER_AT
#else
#define MLA1_TRIGGER_AT 2
#endif
// The trigger, where `at` is the place chosen (the fused layer, LAYER, triggers its own way).
template <bool LAYER>
__device__ __forceinline__ void mla1_trigger(int at) {
    if (!LAYER && at == MLA1_TRIGGER_AT) pdl_launch_dependents();
}

template <typename T, typename WT, bool LAYER>
__device__ void mla_dec1_impl(T* out, const T* q, const T* kva, const WT* w, T* cache, const float* gain,
                              const float* inv_freq, const long* slots, const int* positions, const int* tok_seq,
                              const int* tables, int table_width, int block_size, int heads, int nope, int dr, int v,
                              int r, float eps, float rs, int interleaved, float scale_log2,
                              const Mla1Layer<T>& L) {
    constexpr int KT = sizeof(T) == 2 ? 32 : 16;  // keys a tile: 36 KB either way
    __shared__ __align__(16) T kt[KT][MLA_MAXW];
    __shared__ long slot_of[KT];
    __shared__ float qf[MLA_MAXW];                 // scaled query (latent + rope); later the merged output
    __shared__ float ql[MLA1_MAXRC];               // this block's absorbed columns, read by the cluster
    __shared__ float buf[MLA_WARPS * MLA1_MAXRC];  // absorption partials; later this split's output
    __shared__ float qn[MLA_MAXNOPE];
    __shared__ float nrow[MLA_MAXW];               // the token's own cache row
    __shared__ float cs[MLA1_MAXDR / 2], sn[MLA1_MAXDR / 2];
    __shared__ float sc[KT], ps[KT];
    __shared__ float ml[2];
    __shared__ float red[32];
    // LAYER: this block's query rows, the head's V output, the last-block flag; the input in
    // f32 in dynamic shared memory
    __shared__ float qloc[LAYER ? MLA1_MAXQR : 1];
    __shared__ float vloc[LAYER ? MLA1_MAXVR : 1];
    __shared__ float vfull[LAYER ? MLA1_MAXV : 1];
    __shared__ int oflag;
    extern __shared__ __align__(16) float mla1_xs[];
    const int b = blockIdx.x, C = gridDim.x, h = blockIdx.y, t = blockIdx.z;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int W = r + dr, qk = nope + dr, half = dr / 2;
    const int rc = r / C, ncc = rc / 8, vc = v / C;
    const int pos = positions[t];
    const int len = pos + 1;
    const int chunk = (len + C - 1) / C;
    const int k0 = min(len, b * chunk), k1 = min(len, k0 + chunk);
    const bool owner = k0 <= pos && pos < k1;
    const int* table = tables + (long)tok_seq[t] * table_width;
    const WT* wh = w + (long)h * (nope + v) * r;
    // Before the wait: the weights (no kernel writes them), the rope's angles (the step's
    // positions are uploaded before its kernels) and the first tile of earlier steps' keys.
    Mla8<WT> wa[MLA1_PRE], wv[MLA1_VR][MLA1_VC];
#pragma unroll
    for (int i = 0; i < MLA1_PRE; i++) {
        const int e = tid + i * MLA1_THREADS, j = e / ncc;
        wa[i].zero();
        if (j < nope) wa[i].load(wh + (long)j * r + b * rc + (e % ncc) * 8);
    }
#pragma unroll
    for (int a = 0; a < MLA1_VR; a++)
#pragma unroll
        for (int z = 0; z < MLA1_VC; z++) {
            const int jj = warp + MLA_WARPS * a, cq = lane + 32 * z;
            wv[a][z].zero();
            if (jj < vc && cq * 8 < r) wv[a][z].load(wh + (long)(nope + b * vc + jj) * r + cq * 8);
        }
    if (tid < half) {
        const float2 a = mla_angle(inv_freq[tid], pos, rs);
        cs[tid] = a.x;
        sn[tid] = a.y;
    }
    // the owner's norm gains (2 columns a thread: r <= 512)
    float g2[2] = {0.0f, 0.0f};
    if (owner)
#pragma unroll
        for (int i = 0; i < 2; i++)
            if (tid + i * MLA1_THREADS < r) g2[i] = gain[tid + i * MLA1_THREADS];
    // LAYER: this block's q and kv_a rows (see Mla1Layer), asked of the L2 cache first
    const long g = (long)h * C + b, nblocks = (long)heads * C;
    const int q0 = min(qk, b * L.rq), nq = min(qk, q0 + L.rq) - q0;
    const int kr0 = (int)min((long)W, g * L.rk), nkv = (int)min((long)W, kr0 + (long)L.rk) - kr0;
    const u8* wq = L.wq + ((long)h * qk + q0) * L.row_bytes;
    const u8* wk = L.wk + (long)kr0 * L.row_bytes;
    if constexpr (LAYER) {
        mla1_prefetch_rows(wq, L.row_bytes, (unsigned)L.k * 2, nq);
        mla1_prefetch_rows(wk, L.row_bytes, (unsigned)L.k * 2, nkv);
    }
    if (k0 < k1) mla1_tile<T, KT>(kt, slot_of, cache, table, block_size, W, k0, min(KT, k1 - k0), pos);
    // (traced builds: the block at its wait, its loads before it asked for; the first tile's
    // copies need the block table read first)
    if constexpr (!LAYER) di_trace_phase(7);
    pdl_wait();

    const T* qh = q + ((long)t * heads + h) * qk;
    const T* row = kva + (long)t * W;
    const int ro = (L.k + C - 1) / C, or0 = min(L.k, b * ro), nro = min(L.k, or0 + ro) - or0;
    if constexpr (LAYER) {
        mla1_qkv<T>(L, wq, wk, mla1_xs, red, qloc, const_cast<T*>(qh), const_cast<T*>(row), nq, nkv, q0, kr0, g,
                    nblocks);
        di_trace_phase(5);
        // the o rows (this head's columns), for after the attention
        if (L.wo != nullptr)
            mla1_prefetch_rows(L.wo + (long)or0 * L.wo_row_bytes + (long)h * v * 2, L.wo_row_bytes, (unsigned)v * 2,
                               nro);
        cluster_sync();  // the cluster's query rows
    }

    // The step's inputs, loaded together: the nope query, the rope query and, in the owner,
    // the token's kv_a row.
    float xn = 0.0f, qx = 0.0f, qy = 0.0f, kx[2] = {0.0f, 0.0f}, ky = 0.0f, kz = 0.0f;
    const int ia = interleaved ? 2 * tid : tid, ib = interleaved ? 2 * tid + 1 : tid + half;
    if constexpr (LAYER) {
        const int rq = L.rq;
        if (tid < nope) xn = cluster_ld(&qloc[tid % rq], tid / rq);
        if (tid < half) {
            qx = cluster_ld(&qloc[(nope + ia) % rq], (nope + ia) / rq);
            qy = cluster_ld(&qloc[(nope + ib) % rq], (nope + ib) / rq);
        }
        // every block's kv_a rows, before the owner reads the token's row
        if (owner) {
            if (tid == 0)
                wait_count(&L.cnt[0], (u32)min(nblocks, (long)(W + L.rk - 1) / L.rk));
            __syncthreads();
        }
    } else {
        if (tid < nope) xn = act_load(qh, tid);
        if (tid < half) {
            qx = act_load(qh, nope + ia);
            qy = act_load(qh, nope + ib);
        }
    }
    if (owner) {
#pragma unroll
        for (int i = 0; i < 2; i++)
            if (tid + i * MLA1_THREADS < r) kx[i] = mla1_row_ld<LAYER>(row, tid + i * MLA1_THREADS);
        if (tid < half) {
            ky = mla1_row_ld<LAYER>(row, r + ia);
            kz = mla1_row_ld<LAYER>(row, r + ib);
        }
    }
    if (LAYER) di_trace_phase(6);
    if (tid < nope) qn[tid] = xn;  // nope <= MLA_MAXNOPE = MLA1_THREADS
    __syncthreads();  // qn, cs, sn
    if (tid < half) {
        const float2 o = mla_rotate(qx, qy, cs[tid], sn[tid]);
        qf[r + ia] = o.x * scale_log2;
        qf[r + ib] = o.y * scale_log2;
    }
    // The token's own cache row, rounded as the cache stores it.
    if (owner) {
        const float ss = block_sum(fmaf(kx[0], kx[0], kx[1] * kx[1]), red);
        const float inv = 1.0f / sqrtf(ss / (float)r + eps);
        T* dst = cache + slots[t] * (long)W;
#pragma unroll
        for (int i = 0; i < 2; i++) {
            const int c = tid + i * MLA1_THREADS;
            if (c < r) {
                const float x = act_round(cache, g2[i] * (kx[i] * inv));
                nrow[c] = x;
                if (h == 0) act_store(dst, c, x);
            }
        }
        if (tid < half) {
            const float2 o = mla_rotate(ky, kz, cs[tid], sn[tid]);
            const float xa = act_round(cache, o.x), xb = act_round(cache, o.y);
            nrow[r + ia] = xa;
            nrow[r + ib] = xb;
            if (h == 0) {
                act_store(dst, r + ia, xa);
                act_store(dst, r + ib, xb);
            }
        }
    }
    // This block's absorbed columns: lanes of a warp with the same column chunk (lane % ncc)
    // add their rows, then the warps' sums meet in shared memory.
    {
        float acc[8];
#pragma unroll
        for (int z = 0; z < 8; z++) acc[z] = 0.0f;
#pragma unroll
        for (int i = 0; i < MLA1_PRE; i++) {
            const int j = (tid + i * MLA1_THREADS) / ncc;
            if (j < nope) {
                float wf[8];
                wa[i].get(wf);
                const float x = qn[j];
#pragma unroll
                for (int z = 0; z < 8; z++) acc[z] = fmaf(x, wf[z], acc[z]);
            }
        }
        for (int o = 16; o >= ncc; o >>= 1)
#pragma unroll
            for (int z = 0; z < 8; z++) acc[z] += __shfl_xor_sync(0xffffffffu, acc[z], o);
        if (lane < ncc)
#pragma unroll
            for (int z = 0; z < 8; z++) buf[warp * MLA1_MAXRC + lane * 8 + z] = acc[z];
        __syncthreads();
        if (tid < rc) {
            float s = 0.0f;
#pragma unroll
            for (int w8 = 0; w8 < MLA_WARPS; w8++) s += buf[w8 * MLA1_MAXRC + tid];
            ql[tid] = s;
        }
    }
    di_trace_phase(0);
    cluster_sync();
    {
        float v2[2];
#pragma unroll
        for (int i = 0; i < 2; i++) {
            const int c = tid + i * MLA1_THREADS;
            v2[i] = c < r ? cluster_ld(&ql[c % rc], c / rc) : 0.0f;
        }
#pragma unroll
        for (int i = 0; i < 2; i++)
            if (tid + i * MLA1_THREADS < r) qf[tid + i * MLA1_THREADS] = v2[i] * scale_log2;
    }

    di_trace_phase(1);
    mla1_trigger<LAYER>(1);
    // This split's keys, a tile at a time (online softmax). Scores: warp w takes keys w + 8 i
    // (KT / 8 of them together); outputs: thread tid owns latent columns 2 tid, 2 tid + 1.
    constexpr int KW = KT / MLA_WARPS;
    const int c0 = 2 * tid;
    float m = NEG_INF, l = 0.0f, o0 = 0.0f, o1 = 0.0f;
    for (int j0 = k0; j0 < k1; j0 += KT) {
        const int nk = min(KT, k1 - j0);
        if (j0 != k0) {
            __syncthreads();  // the last tile is used up
            mla1_tile<T, KT>(kt, slot_of, cache, table, block_size, W, j0, nk, pos);
        }
        cp_async_wait_all();
        if (pos >= j0 && pos < j0 + nk)
            for (int c = tid; c < W; c += blockDim.x) act_store(&kt[pos - j0][0], c, nrow[c]);
        __syncthreads();
        {
            float sk[KW];
#pragma unroll
            for (int i = 0; i < KW; i++) sk[i] = 0.0f;
#pragma unroll 6
            for (int c = lane; c < W; c += 32) {
                const float x = qf[c];
#pragma unroll
                for (int i = 0; i < KW; i++) sk[i] = fmaf(x, act_load(&kt[warp + MLA_WARPS * i][0], c), sk[i]);
            }
#pragma unroll
            for (int o = 16; o > 0; o >>= 1)
#pragma unroll
                for (int i = 0; i < KW; i++) sk[i] += __shfl_xor_sync(0xffffffffu, sk[i], o);
            if (lane == 0)
#pragma unroll
                for (int i = 0; i < KW; i++) sc[warp + MLA_WARPS * i] = sk[i];  // rows past nk: unused
        }
        __syncthreads();
        // every thread takes the same maximum and sum in the same order; the weights once
        float mx = NEG_INF;
        for (int kk = 0; kk < nk; kk++) mx = fmaxf(mx, sc[kk]);
        const float mn = fmaxf(m, mx);
        const float corr = exp2f(m - mn);
        if (tid < nk) ps[tid] = exp2f(sc[tid] - mn);
        __syncthreads();
        float psum = 0.0f;
        o0 *= corr;
        o1 *= corr;
#pragma unroll 8
        for (int kk = 0; kk < nk; kk++) {
            const float p = ps[kk];
            psum += p;
            if (c0 < r) {
                o0 = fmaf(p, act_load(&kt[kk][0], c0), o0);
                o1 = fmaf(p, act_load(&kt[kk][0], c0 + 1), o1);
            }
        }
        l = l * corr + psum;
        m = mn;
    }
    if (c0 < r) {
        buf[c0] = o0;
        buf[c0 + 1] = o1;
    }
    if (tid == 0) {
        ml[0] = m;
        ml[1] = l;
    }
    di_trace_phase(2);
    mla1_trigger<LAYER>(2);
    cluster_sync();
    // The splits merged in rank order; every block gets the whole latent output. All the
    // cluster's values are asked for before any is used.
    {
        float ms[MLA1_MAXC], ls[MLA1_MAXC], b0[MLA1_MAXC], b1[MLA1_MAXC];
#pragma unroll
        for (int s = 0; s < MLA1_MAXC; s++) {
            ms[s] = NEG_INF;
            ls[s] = b0[s] = b1[s] = 0.0f;
            if (s < C) {
                ms[s] = cluster_ld(&ml[0], s);
                ls[s] = cluster_ld(&ml[1], s);
                if (c0 < r) {
                    b0[s] = cluster_ld(&buf[c0], s);
                    b1[s] = cluster_ld(&buf[c0 + 1], s);
                }
            }
        }
        float mx = NEG_INF;
#pragma unroll
        for (int s = 0; s < MLA1_MAXC; s++) mx = fmaxf(mx, ms[s]);
        float lsum = 0.0f, a0 = 0.0f, a1 = 0.0f;
#pragma unroll
        for (int s = 0; s < MLA1_MAXC; s++) {
            const float f = ms[s] == NEG_INF ? 0.0f : exp2f(ms[s] - mx);
            lsum += ls[s] * f;
            a0 = fmaf(b0[s], f, a0);
            a1 = fmaf(b1[s], f, a1);
        }
        const float inv_l = lsum > 0.0f ? 1.0f / lsum : 0.0f;
        if (c0 < r) {
            qf[c0] = a0 * inv_l;
            qf[c0 + 1] = a1 * inv_l;
        }
    }
    __syncthreads();
    di_trace_phase(3);
    mla1_trigger<LAYER>(3);
    // This block's V rows: warp rows warp + 8 a, lanes over 8-value chunks of the row.
#pragma unroll
    for (int a = 0; a < MLA1_VR; a++) {
        const int jj = warp + MLA_WARPS * a;
        if (jj >= vc) continue;
        float s = 0.0f;
#pragma unroll
        for (int z = 0; z < MLA1_VC; z++) {
            const int cq = lane + 32 * z;
            if (cq * 8 < r) {
                float wf[8];
                wv[a][z].get(wf);
#pragma unroll
                for (int e = 0; e < 8; e++) s = fmaf(wf[e], qf[cq * 8 + e], s);
            }
        }
        s = warp_sum(s);
        if (lane == 0) {
            act_store(out, ((long)t * heads + h) * v + b * vc + jj, s);
            if (LAYER) vloc[jj] = act_round(out, s);
        }
    }
    di_trace_phase(4);
    if constexpr (LAYER) {
        cluster_sync();  // the head's V output, gathered for the o product
        for (int e = tid; e < v; e += blockDim.x) vfull[e] = cluster_ld(&vloc[e % vc], e / vc);
    }
    // No block leaves while the cluster may still read its shared memory.
    cluster_sync();
    if constexpr (LAYER) {
        if (L.wo != nullptr) mla1_o<T>(L, vfull, &oflag, h, heads, b, v, or0, nro);
        di_trace_phase(7);
        if (tid == 0 && atomicAdd(&L.cnt[1], 1u) == (u32)(nblocks - 1)) {
            L.cnt[0] = 0u;
            L.cnt[1] = 0u;
        }
    }
}

#define MLA_DEC1_WRAPPER(T, S, WT, WS)                                                                               \
    extern "C" __global__ void __launch_bounds__(MLA1_THREADS) mla_dec1_##WS##_##S(                                 \
        T* out, const T* q, const T* kva, const WT* w, T* cache, const float* gain, const float* inv_freq,           \
        const long* slots, const int* positions, const int* tok_seq, const int* tables, int table_width,            \
        int block_size, int heads, int nope, int dr, int v, int r, float eps, float rs, int interleaved,            \
        float scale_log2) {                                                                                          \
        mla1_trigger<false>(0);                                                                                      \
        mla_dec1_impl<T, WT, false>(out, q, kva, w, cache, gain, inv_freq, slots, positions, tok_seq, tables,        \
                                    table_width, block_size, heads, nope, dr, v, r, eps, rs, interleaved, scale_log2, \
                                    Mla1Layer<T>{});                                                                 \
    }

#define MLA_WRAPPERS(T, S)                                                                                           \
    extern "C" __global__ void mla_q_absorb_wf32_##S(                                                                \
        float* qf, const T* q, const float* w, int n, int heads, int nope, int dr, int v, int r, T* cache,           \
        const T* kva, const float* gain, const float* inv_freq, const long* slots, const int* positions, float eps,  \
        float rs, int interleaved) {                                                                                 \
        pdl_launch_dependents();                                                                                     \
        mla_q_absorb_impl<T, float, false>(qf, q, w, n, heads, nope, dr, v, r, cache, kva, gain, inv_freq, slots, positions, \
                                 eps, rs, interleaved);                                                              \
    }                                                                                                                \
    extern "C" __global__ void mla_q_absorb_wbf16_##S(                                                               \
        float* qf, const T* q, const bf16_t* w, int n, int heads, int nope, int dr, int v, int r, T* cache,          \
        const T* kva, const float* gain, const float* inv_freq, const long* slots, const int* positions, float eps,  \
        float rs, int interleaved) {                                                                                 \
        pdl_launch_dependents();                                                                                     \
        mla_q_absorb_impl<T, bf16_t, false>(qf, q, w, n, heads, nope, dr, v, r, cache, kva, gain, inv_freq, slots, positions, \
                                 eps, rs, interleaved);                                                              \
    }                                                                                                                \
    extern "C" __global__ void mla_q_absorb2_wf32_##S(                                                               \
        float* qf, const T* q, const float* w, int n, int heads, int nope, int dr, int v, int r, T* cache,           \
        const T* kva, const float* gain, const float* inv_freq, const long* slots, const int* positions, float eps,  \
        float rs, int interleaved) {                                                                                 \
        pdl_launch_dependents();                                                                                     \
        mla_q_absorb_impl<T, float, true>(qf, q, w, n, heads, nope, dr, v, r, cache, kva, gain, inv_freq, slots,     \
                                          positions, eps, rs, interleaved);                                          \
    }                                                                                                                \
    extern "C" __global__ void mla_q_absorb2_wbf16_##S(                                                              \
        float* qf, const T* q, const bf16_t* w, int n, int heads, int nope, int dr, int v, int r, T* cache,          \
        const T* kva, const float* gain, const float* inv_freq, const long* slots, const int* positions, float eps,  \
        float rs, int interleaved) {                                                                                 \
        pdl_launch_dependents();                                                                                     \
        mla_q_absorb_impl<T, bf16_t, true>(qf, q, w, n, heads, nope, dr, v, r, cache, kva, gain, inv_freq, slots,    \
                                           positions, eps, rs, interleaved);                                         \
    }                                                                                                                \
    extern "C" __global__ void __launch_bounds__(MLA_WARPS * 32)                                                     \
        mla_decode_##S(float* part_o, float* part_ml, const float* qf, const T* cache, const int* tok_seq,           \
                       const int* positions, const int* tables, int table_width, int block_size, int heads, int r,   \
                       int dr, float scale_log2, int splits) {                                                       \
        pdl_launch_dependents();                                                                                     \
        mla_decode_impl<T>(part_o, part_ml, qf, cache, tok_seq, positions, tables, table_width, block_size, heads,   \
                           r, dr, scale_log2, splits);                                                               \
    }                                                                                                                \
    extern "C" __global__ void __launch_bounds__(MLA_WARPS * 32)                                                     \
        mla_decode2_##S(float* part_o, float* part_ml, const float* qf, const T* cache, const int* tok_seq,          \
                        const int* positions, const int* tables, int table_width, int block_size, int heads, int r,  \
                        int dr, float scale_log2, int splits) {                                                      \
        pdl_launch_dependents();                                                                                     \
        mla_decode2_impl<T>(part_o, part_ml, qf, cache, tok_seq, positions, tables, table_width, block_size, heads,  \
                            r, dr, scale_log2, splits);                                                              \
    }                                                                                                                \
    extern "C" __global__ void mla_v_up_wf32_##S(T* out, const float* part_o, const float* part_ml, const float* w,  \
                                                 int heads, int nope, int v, int r, int splits) {                    \
        pdl_launch_dependents();                                                                                     \
        mla_v_up_impl<T, float, false>(out, part_o, part_ml, w, heads, nope, v, r, splits);                          \
    }                                                                                                                \
    extern "C" __global__ void mla_v_up_wbf16_##S(T* out, const float* part_o, const float* part_ml,                 \
                                                  const bf16_t* w, int heads, int nope, int v, int r, int splits) {  \
        pdl_launch_dependents();                                                                                     \
        mla_v_up_impl<T, bf16_t, false>(out, part_o, part_ml, w, heads, nope, v, r, splits);                         \
    }                                                                                                                \
    extern "C" __global__ void mla_v_up2_wf32_##S(T* out, const float* part_o, const float* part_ml, const float* w, \
                                                  int heads, int nope, int v, int r, int splits) {                   \
        pdl_launch_dependents();                                                                                     \
        mla_v_up_impl<T, float, true>(out, part_o, part_ml, w, heads, nope, v, r, splits);                           \
    }                                                                                                                \
    MLA_DEC1_WRAPPER(T, S, float, wf32)                                                                          \
    MLA_DEC1_WRAPPER(T, S, bf16_t, wbf16)                                                                        \
    extern "C" __global__ void mla_v_up2_wbf16_##S(T* out, const float* part_o, const float* part_ml,                \
                                                   const bf16_t* w, int heads, int nope, int v, int r, int splits) { \
        pdl_launch_dependents();                                                                                     \
        mla_v_up_impl<T, bf16_t, true>(out, part_o, part_ml, w, heads, nope, v, r, splits);                          \
    }

MLA_WRAPPERS(float, f32)
MLA_WRAPPERS(bf16_t, bf16)

// `mla_dec1` with the layer's attention half around it (Mla1Layer): bf16 activations and
// weights, one token. Dynamic shared memory: the input in f32 (4 k bytes).
extern "C" __global__ void __launch_bounds__(MLA1_THREADS) mla_layer1_bf16(
    bf16_t* out, bf16_t* q, bf16_t* kva, const bf16_t* w, bf16_t* cache, const float* gain, const float* inv_freq,
    const long* slots, const int* positions, const int* tok_seq, const int* tables, int table_width, int block_size,
    int heads, int nope, int dr, int v, int r, float eps, float rs, int interleaved, float scale_log2,
    const bf16_t* x, const float* ngain, float neps, bf16_t* hn, const u8* wq, const u8* wk, long row_bytes, int k,
    int rq, int rk, const u8* wo, long wo_row_bytes, bf16_t* oy, bf16_t* res, float* part, u32* cnt) {
    pdl_launch_dependents();
    const Mla1Layer<bf16_t> L{x, ngain, neps, hn, wq, wk, row_bytes, k, rq, rk, wo, wo_row_bytes, oy, res, part,
                              cnt};
    mla_dec1_impl<bf16_t, bf16_t, true>(out, q, kva, w, cache, gain, inv_freq, slots, positions, tok_seq, tables,
                                        table_width, block_size, heads, nope, dr, v, r, eps, rs, interleaved,
                                        scale_log2, L);
}

// ---- Prompts in the expanded form (mla_x_*) ----
//
// A (query, key) pair costs (nope + rope) + v values a head in the expanded form against
// (latent + rope) + latent in the absorbed one (320 against 1,088 for DeepSeek-V3's heads), at
// the price of expanding every context row through kv_b once, which costs what the absorption
// and the V up-projection of a token cost. So a prompt (or a long chunk of one) runs:
//   mla_x_rope    the queries' rope parts rotated in place and the cache rows, as the
//                 absorption kernels write them;
//   mla_x_gather  the context rows of every sequence of the step copied out of the paged cache,
//                 latents and rope keys apart (the rows of sequence s from ctx_start[s]);
//   (cuBLAS)      the latents through kv_b: per context row and head, nope K values then v V
//                 values (bf16);
//   mla_x_attn    the wide flash-attention kernel of attention_prefill.cu (fw_tile) over K rows
//                 of nope values from the expansion and the rope key every head shares, and V
//                 rows from the expansion; the output is the layer's [tokens, heads, v].
// DeepSeek-V3's head shape only (nope 128, rope 64, v 128; MLX_*).
#define MLX_NOPE 128
#define MLX_DR 64
#define MLX_DK (MLX_NOPE + MLX_DR)
#define MLX_DV 128
#define MLX_STAGES 2
#define MLX_THREADS 128

// Grid (2, token chunks of 8): x 0 rotates the chunk's queries of every head in place, the
// sines and cosines computed once for all heads (as mla_q_rope computes them); x 1 writes the
// chunk's cache rows through mla_q_rope.
extern "C" __global__ void __launch_bounds__(256) mla_x_rope(bf16_t* q, bf16_t* cache, const bf16_t* kva,
                                                             const float* gain, const float* inv_freq,
                                                             const long* slots, const int* positions, int n, int heads,
                                                             int nope, int dr, int r, float eps, float rs,
                                                             int interleaved) {
    pdl_launch_dependents();
    const int t0 = blockIdx.y * 8, nt = min(8, n - t0);
    if (blockIdx.x == 1) {
        mla_q_rope<bf16_t>(nullptr, q, heads, nope, dr, r, cache, kva, gain, inv_freq, slots, positions, eps, rs,
                           interleaved, 0, t0, nt, true);
        return;
    }
    __shared__ float cs[8][MLA_MAXW / 2], sn[8][MLA_MAXW / 2];
    const int half = dr / 2, qk = nope + dr;
    mla_angles(cs, sn, inv_freq, positions, t0, nt, half, rs);
    __syncthreads();
    pdl_wait();
    for (int e = threadIdx.x; e < nt * heads * half; e += blockDim.x) {
        const int i = e / (heads * half), h = e / half % heads, p = e % half;
        const int a = interleaved ? 2 * p : p, b = interleaved ? 2 * p + 1 : p + half;
        bf16_t* qh = q + ((long)(t0 + i) * heads + h) * qk + nope;
        const float2 v = mla_rotate(act_load(qh, a), act_load(qh, b), cs[i][p], sn[i][p]);
        act_store(qh, a, v.x);
        act_store(qh, b, v.y);
    }
}

extern "C" __global__ void __launch_bounds__(256) mla_x_gather(bf16_t* lat, bf16_t* kr, const bf16_t* cache,
                                                               const int* ctx_start, int n_seqs, int n_ctx,
                                                               const int* tables, int table_width, int block_size,
                                                               int r, int dr) {
    PDL_ENTRY();
    const int W = r + dr, cw = W / 8;
    for (long e = (long)blockIdx.x * blockDim.x + threadIdx.x; e < (long)n_ctx * cw; e += (long)gridDim.x * blockDim.x) {
        const int row = (int)(e / cw), c = (int)(e % cw) * 8;
        // the row's sequence: the last whose context starts at or before it
        int lo = 0, hi = n_seqs - 1;
        while (lo < hi) {
            const int mid = (lo + hi + 1) >> 1;
            if (ctx_start[mid] <= row) lo = mid;
            else hi = mid - 1;
        }
        const int j = row - ctx_start[lo];
        const long slot = (long)tables[(long)lo * table_width + j / block_size] * block_size + j % block_size;
        const uint4 v = *reinterpret_cast<const uint4*>(cache + slot * W + c);
        if (c < r) *reinterpret_cast<uint4*>(lat + (long)row * r + c) = v;
        else *reinterpret_cast<uint4*>(kr + (long)row * dr + (c - r)) = v;
    }
}

// Block (head, work item): 128 queries of one sequence as attn_prefill3 takes them (4 warps of
// 32 rows; items starting at an odd multiple of 64 leave at once), keys in 64-row tiles through
// MLX_STAGES cp.async buffers. kvx rows: heads x (nope K values, v V values) a context row.
extern "C" __global__ void __launch_bounds__(MLX_THREADS, 1) mla_x_attn(
    bf16_t* out, const bf16_t* q, const bf16_t* kvx, const bf16_t* kr, const int* tiles, int n_tiles,
    const int* seq_start, const int* seq_len, const int* seq_pos, const int* ctx_start, int heads, float scale_log2) {
    PDL_ENTRY();
    constexpr int DK = MLX_DK, DV = MLX_DV, MT = 2, WR = 16 * MT, CK = DK / 8, CV = DV / 8;
    constexpr int STAGE = FW_BN * (DK + DV);
    static_assert(MLX_THREADS / 32 * WR == FW_BM, "warps x rows must cover the query tile");
    extern __shared__ __align__(16) bf16_t mlx_smem[];
    bf16_t* sq = mlx_smem;
    bf16_t* skv = mlx_smem + FW_BM * DK;
    const int tile = n_tiles - 1 - blockIdx.y;
    const int si = tiles[2 * tile], q0 = tiles[2 * tile + 1];
    if (q0 % FW_BM != 0) return;
    const int h = blockIdx.x;
    const int start = seq_start[si], len = seq_len[si], pos = seq_pos[si];
    const long c0 = ctx_start[si];
    const int qn = min(FW_BM, len - q0);
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int qfirst = pos + q0, qlast = pos + q0 + qn - 1;
    const int n_kt = qlast / FW_BN + 1;
    const long kvw = (long)heads * (MLX_NOPE + DV);  // a context row of kvx
    const bf16_t* kvh = kvx + (long)h * (MLX_NOPE + DV);

    auto issue = [&](int it) {
        if (it < n_kt) {
            const int kt = it * FW_BN;
            bf16_t* sk = skv + (it % MLX_STAGES) * STAGE;
            bf16_t* sv = sk + FW_BN * DK;
#pragma unroll
            for (int e = tid; e < FW_BN * CK; e += MLX_THREADS) {
                const int rr = e / CK, c = (e % CK) * 8, j = kt + rr;
                const bool ok = j <= qlast;
                const long row = c0 + (ok ? j : 0);
                const bf16_t* src = c < MLX_NOPE ? kvh + row * kvw + c : kr + row * MLX_DR + (c - MLX_NOPE);
                cp_async16(&sk[swz<DK>(rr, c)], src, ok);
            }
#pragma unroll
            for (int e = tid; e < FW_BN * CV; e += MLX_THREADS) {
                const int rr = e / CV, c = (e % CV) * 8, j = kt + rr;
                const bool ok = j <= qlast;
                const long row = c0 + (ok ? j : 0);
                cp_async16(&sv[swz<DV>(rr, c)], kvh + row * kvw + MLX_NOPE + c, ok);
            }
        }
        asm volatile("cp.async.commit_group;");
    };

#pragma unroll
    for (int s = 0; s < MLX_STAGES - 1; s++) issue(s);
    for (int e = tid; e < FW_BM * CK; e += MLX_THREADS) {
        const int rr = e / CK, c = (e % CK) * 8;
        uint4 val = make_uint4(0, 0, 0, 0);
        if (rr < qn) val = *reinterpret_cast<const uint4*>(q + ((long)(start + q0 + rr) * heads + h) * DK + c);
        *reinterpret_cast<uint4*>(&sq[swz<DK>(rr, c)]) = val;
    }
    float o[MT][DV / 8][4];
    float mrow[MT][2], lrow[MT][2];
    fw_init<DV, MT>(o, mrow, lrow);
    const int qrow0 = qfirst + warp * WR + (lane >> 2);
    const int wfirst = qfirst + warp * WR, wlast = min(wfirst + WR - 1, qlast);
    const bool active = warp * WR < qn;
    for (int it = 0; it < n_kt; it++) {
        asm volatile("cp.async.wait_group %0;" ::"n"(MLX_STAGES - 2));
        __syncthreads();
        issue(it + MLX_STAGES - 1);
        const int kt = it * FW_BN;
        const bf16_t* sk = skv + (it % MLX_STAGES) * STAGE;
        if (!active || kt > wlast) continue;
        fw_tile<DK, DV, MT>(o, mrow, lrow, sq, sk, sk + FW_BN * DK, warp * WR, kt, qrow0, 0, scale_log2,
                            kt + FW_BN - 1 > wfirst);
    }
    asm volatile("cp.async.wait_group 0;");
    fw_store<bf16_t, DV, MT>(out, o, lrow, start + q0, warp * WR, qn, heads, h);
}
