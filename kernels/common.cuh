// Shared definitions for every kernel file. The Rust side concatenates this file with the
// kernel files and compiles the result once with NVRTC, so nothing here may #include a
// header: NVRTC ships no standard library. bf16 and f16 values travel as raw 16-bit words
// and are converted with PTX instructions.
//
// Activation buffers hold either f32 or bf16 (the backend's choice); kernels are templates
// over the activation type `T` and `extern "C"` wrappers name each instantiation
// `<kernel>_f32` / `<kernel>_bf16`.

typedef unsigned short bf16_t;
typedef unsigned short f16_t;
typedef unsigned int u32;
typedef unsigned long long u64;
typedef unsigned char u8;
typedef signed char i8;

#define NEG_INF (__int_as_float(0xff800000))
#define LOG2E 1.4426950408889634f

__device__ __forceinline__ float bf16_to_f32(bf16_t b) { return __uint_as_float(((u32)b) << 16); }

__device__ __forceinline__ bf16_t f32_to_bf16(float x) {
    bf16_t r;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(x));
    return r;
}

__device__ __forceinline__ float f16_to_f32(f16_t h) {
    float r;
    asm("cvt.f32.f16 %0, %1;" : "=f"(r) : "h"(h));
    return r;
}

// Two floats packed as bf16x2 (lo in the low half), the operand format of the mma instructions.
__device__ __forceinline__ u32 pack_bf16x2(float lo, float hi) {
    u32 r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

// Activation loads and stores, overloaded on the storage type.
__device__ __forceinline__ float act_load(const float* p, long i) { return p[i]; }
__device__ __forceinline__ float act_load(const bf16_t* p, long i) { return bf16_to_f32(p[i]); }
__device__ __forceinline__ void act_store(float* p, long i, float v) { p[i] = v; }
__device__ __forceinline__ void act_store(bf16_t* p, long i, float v) { p[i] = f32_to_bf16(v); }

// Eight consecutive activations (16- or 32-byte aligned) as floats.
__device__ __forceinline__ void act_load8(const float* p, float* out) {
    const float4 a = *reinterpret_cast<const float4*>(p);
    const float4 b = *reinterpret_cast<const float4*>(p + 4);
    out[0] = a.x; out[1] = a.y; out[2] = a.z; out[3] = a.w;
    out[4] = b.x; out[5] = b.y; out[6] = b.z; out[7] = b.w;
}
__device__ __forceinline__ void bf16x8_to_f32(uint4 v, float* out) {
    out[0] = __uint_as_float(v.x << 16); out[1] = __uint_as_float(v.x & 0xffff0000u);
    out[2] = __uint_as_float(v.y << 16); out[3] = __uint_as_float(v.y & 0xffff0000u);
    out[4] = __uint_as_float(v.z << 16); out[5] = __uint_as_float(v.z & 0xffff0000u);
    out[6] = __uint_as_float(v.w << 16); out[7] = __uint_as_float(v.w & 0xffff0000u);
}
__device__ __forceinline__ void act_load8(const bf16_t* p, float* out) {
    bf16x8_to_f32(*reinterpret_cast<const uint4*>(p), out);
}
// The same through L2 only (values other blocks of the running grid wrote).
__device__ __forceinline__ void act_load8_cg(const float* p, float* out) {
    const float4 a = __ldcg(reinterpret_cast<const float4*>(p));
    const float4 b = __ldcg(reinterpret_cast<const float4*>(p + 4));
    out[0] = a.x; out[1] = a.y; out[2] = a.z; out[3] = a.w;
    out[4] = b.x; out[5] = b.y; out[6] = b.z; out[7] = b.w;
}
__device__ __forceinline__ void act_load8_cg(const bf16_t* p, float* out) {
    bf16x8_to_f32(__ldcg(reinterpret_cast<const uint4*>(p)), out);
}

// Weight streams are marked first to go from L2 (a cache policy), so the weights of a step
// passing through (≈ 166 MB a Moonlight layer, more than three times the L2) do not push out the
// kernels' code, the activations, the caches' rows and the small tables that the next
// launches read (measured: doc/benchmarks.md, session 25). DI_NO_EVICT (a
// DEEPINFER_CUDA_DEFINE entry) streams them as any other load, for comparison.
#if !defined(DI_NO_EVICT) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
#define DI_EVICT_FIRST 1
__device__ __forceinline__ u64 l2_evict_first() {
    u64 p;
    asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(p));
    return p;
}
#endif

// A 16-byte load that skips L1: weights are read once, the activations stay cached.
__device__ __forceinline__ uint4 ld_stream16(const void* p) {
    uint4 r;
#ifdef DI_EVICT_FIRST
    asm volatile("ld.global.nc.L1::no_allocate.L2::cache_hint.v4.u32 {%0, %1, %2, %3}, [%4], %5;"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
                 : "l"(p), "l"(l2_evict_first()));
#else
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
                 : "l"(p));
#endif
    return r;
}

// A load that skips L1 (reads what other blocks wrote before a fence).
__device__ __forceinline__ float ld_cg(const float* p) {
    float v;
    asm volatile("ld.global.cg.f32 %0, [%1];" : "=f"(v) : "l"(p));
    return v;
}

// An activation that other blocks wrote before a fence, read past L1.
__device__ __forceinline__ float act_load_cg(const float* p, long i) { return ld_cg(p + i); }
__device__ __forceinline__ float act_load_cg(const bf16_t* p, long i) {
    bf16_t v;
    asm volatile("ld.global.cg.u16 %0, [%1];" : "=h"(v) : "l"(p + i));
    return bf16_to_f32(v);
}

// A counter read with acquire semantics at GPU scope: writes other blocks made before their
// fenced increments of it are visible after the read.
__device__ __forceinline__ u32 ld_acquire_u32(const u32* p) {
    u32 v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

// The GPU's nanosecond clock (`%globaltimer`).
__device__ __forceinline__ u64 gtime() {
    u64 t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

// Waits (one thread) until the counter at `p` reaches `n`, with ld_acquire_u32's visibility.
// Grids that wait on each other's blocks assume every block resident at once; where that
// does not hold (another grid of the kind holding SMs, fewer SMs lent than the device has)
// the wait would never end, so past 5 s it traps: the launch fails and the host reports the
// error instead of hanging.
__device__ __forceinline__ void wait_count(const u32* p, u32 n) {
    u64 t0 = 0;
    for (u32 k = 1; ld_acquire_u32(p) < n; k++) {
        __nanosleep(32);
        if ((k & 4095) == 0) {
            const u64 t = gtime();
            if (t0 == 0)
                t0 = t;
            else if (t - t0 > 5000000000ull)
                __trap();
        }
    }
}

// One thread of each block of a grid (all resident) at a grid-wide meeting: the block's writes
// made visible, its arrival counted at `c`, then the wait for all `n` blocks' arrivals.
__device__ __forceinline__ void grid_arrive_wait(u32* c, u32 n) {
    __threadfence();
    atomicAdd(c, 1u);
    wait_count(c, n);
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// A row of `nch` chunks of 8 values staged as floats in shared memory `xs`, a chunk a thread in
// turn (`load(c, v)` reads chunk c); with GAIN times the gain `g`, and then the thread's sum of
// the squares of the values read is returned (else 0).
template <bool GAIN, typename Load>
__device__ __forceinline__ float stage_row(Load load, const float* g, float* xs, int nch) {
    float ss = 0.0f;
    for (int c = threadIdx.x; c < nch; c += blockDim.x) {
        float xf[8];
        load(c, xf);
        if (GAIN) {
            const float4 ga = *reinterpret_cast<const float4*>(g + (long)c * 8);
            const float4 gb = *reinterpret_cast<const float4*>(g + (long)c * 8 + 4);
            const float gf[8] = {ga.x, ga.y, ga.z, ga.w, gb.x, gb.y, gb.z, gb.w};
#pragma unroll
            for (int j = 0; j < 8; j++) {
                ss = fmaf(xf[j], xf[j], ss);
                xf[j] *= gf[j];
            }
        }
        *reinterpret_cast<float4*>(&xs[c * 8]) = make_float4(xf[0], xf[1], xf[2], xf[3]);
        *reinterpret_cast<float4*>(&xs[c * 8 + 4]) = make_float4(xf[4], xf[5], xf[6], xf[7]);
    }
    return ss;
}

// 1 / RMS of a row of `k` values from `stage_row`'s sums of squares: a block of W warps adds
// the warps' sums in warp order (`red` holds W floats), every thread gets the result.
template <int W>
__device__ __forceinline__ float block_rstd(float ss, float* red, int k, float eps) {
    ss = warp_sum(ss);
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = ss;
    __syncthreads();
    float s = 0.0f;
#pragma unroll
    for (int w = 0; w < W; w++) s += red[w];
    return 1.0f / sqrtf(s / (float)k + eps);
}

// a + the 8 products of a chunk of bf16 weights `w` with the floats (xa, xb), added in order
// (the staged GEMVs' order of sums).
__device__ __forceinline__ float dot8_add(float a, uint4 w, const float4& xa, const float4& xb) {
    float wf[8];
    bf16x8_to_f32(w, wf);
    a = fmaf(wf[0], xa.x, a); a = fmaf(wf[1], xa.y, a);
    a = fmaf(wf[2], xa.z, a); a = fmaf(wf[3], xa.w, a);
    a = fmaf(wf[4], xb.x, a); a = fmaf(wf[5], xb.y, a);
    a = fmaf(wf[6], xb.z, a); a = fmaf(wf[7], xb.w, a);
    return a;
}
// A lane's shares of the dot products of R bf16 rows staged in shared memory (`nch` chunks of
// 8; row j at w + j * stride) with the floats `stage_row` staged: chunks lane, lane + 32, ...,
// each chunk's 8 products in order (the staged GEMVs' order; warp_sum adds the lanes'). The
// input's chunk is read from shared memory once for all R rows: read once a row, its two
// 16-byte loads (a two-way bank conflict: chunks are 32 bytes apart) made the products of a
// 4-row warp ≈ 3.3 µs (H100, session 25), more than the rows' copy.
template <int R>
__device__ __forceinline__ void staged_dots(const uint4* w, int stride, const float* xs, int nch, int lane,
                                            float (&acc)[R]) {
#pragma unroll
    for (int j = 0; j < R; j++) acc[j] = 0.0f;
#pragma unroll 4
    for (int c = lane; c < nch; c += 32) {
        const float4 xa = *reinterpret_cast<const float4*>(&xs[c * 8]);
        const float4 xb = *reinterpret_cast<const float4*>(&xs[c * 8 + 4]);
#pragma unroll
        for (int j = 0; j < R; j++) acc[j] = dot8_add(acc[j], w[(long)j * stride + c], xa, xb);
    }
}
__device__ __forceinline__ float staged_dot(const uint4* wrow, const float* xs, int nch, int lane) {
    float acc[1];
    staged_dots<1>(wrow, 0, xs, nch, lane, acc);
    return acc[0];
}

// Sum over a block of up to 1024 threads; every thread gets the result. `red` holds 32 floats.
__device__ __forceinline__ float block_sum(float v, float* red) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) red[warp] = v;
    __syncthreads();
    const int nw = (blockDim.x + 31) >> 5;
    float t = lane < nw ? red[lane] : 0.0f;
    return warp_sum(t);
}

// Unaligned little-endian reads from quantized blocks (GGUF blocks are only 2-byte aligned).
__device__ __forceinline__ float ld_f16(const u8* p) {
    return f16_to_f32((f16_t)(p[0] | (p[1] << 8)));
}

// Weight element types, numbered as the Rust side's `WType`.
#define WT_F32 0
#define WT_F16 1
#define WT_BF16 2
#define WT_Q4_0 3
#define WT_Q4_1 4
#define WT_Q8_0 5

// Dequantizes the 32-element block `b` of a block-quantized type into `y`.
__device__ __forceinline__ void dequant_block32(int wt, const u8* b, float* y) {
    if (wt == WT_Q8_0) {
        const float d = ld_f16(b);
#pragma unroll
        for (int j = 0; j < 32; j++) y[j] = d * (float)(i8)b[2 + j];
    } else if (wt == WT_Q4_1) {
        const float d = ld_f16(b), m = ld_f16(b + 2);
#pragma unroll
        for (int j = 0; j < 16; j++) {
            const u32 q = b[4 + j];
            y[j] = d * (float)(q & 15u) + m;
            y[j + 16] = d * (float)(q >> 4) + m;
        }
    } else {  // WT_Q4_0
        const float d = ld_f16(b);
#pragma unroll
        for (int j = 0; j < 16; j++) {
            const int q = b[2 + j];
            y[j] = d * (float)((q & 15) - 8);
            y[j + 16] = d * (float)((q >> 4) - 8);
        }
    }
}

__device__ __forceinline__ int block_bytes32(int wt) {
    return wt == WT_Q8_0 ? 34 : (wt == WT_Q4_1 ? 20 : 18);
}

// Element `c` of row `r` of a weight as float (any type; slow path for odd shapes).
__device__ __forceinline__ float weight_at(int wt, const u8* w, long row_bytes, long r, long c) {
    const u8* row = w + r * row_bytes;
    if (wt == WT_F32) return reinterpret_cast<const float*>(row)[c];
    if (wt == WT_BF16) return bf16_to_f32(reinterpret_cast<const bf16_t*>(row)[c]);
    if (wt == WT_F16) return f16_to_f32(reinterpret_cast<const f16_t*>(row)[c]);
    const u8* b = row + (c >> 5) * block_bytes32(wt);
    const int j = c & 31;
    if (wt == WT_Q8_0) return ld_f16(b) * (float)(i8)b[2 + j];
    const int off = wt == WT_Q4_1 ? 4 : 2;
    const u32 q = j < 16 ? (b[off + j] & 15u) : (b[off + j - 16] >> 4);
    if (wt == WT_Q4_1) return ld_f16(b) * (float)q + ld_f16(b + 2);
    return ld_f16(b) * ((float)q - 8.0f);
}

// An activation value rounded to the storage type (what a store and a load back give).
__device__ __forceinline__ float act_round(const float*, float v) { return v; }
__device__ __forceinline__ float act_round(const bf16_t*, float v) { return bf16_to_f32(f32_to_bf16(v)); }

// 16 bytes copied from global to shared memory without passing through registers (zero-filled
// when `valid` is false); `cp_async_wait_all` waits for this thread's copies.
__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool valid) {
    const u32 a = (u32)__cvta_generic_to_shared(dst);
    const int n = valid ? 16 : 0;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(a), "l"(src), "r"(n));
}
// cp_async16 for weights, streamed as ld_stream16 streams them.
__device__ __forceinline__ void cp_async16_w(void* dst, const void* src, bool valid) {
#ifdef DI_EVICT_FIRST
    const u32 a = (u32)__cvta_generic_to_shared(dst);
    const int n = valid ? 16 : 0;
    asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2, %3;" ::"r"(a), "l"(src), "r"(n),
                 "l"(l2_evict_first()));
#else
    cp_async16(dst, src, valid);
#endif
}

// Asks the L2 cache to fetch `bytes` (a multiple of 16) from `src` (16-byte aligned); no
// completion to wait for (sm_90+). `keep`: the lines marked evict_last, kept before others
// when L2 must evict, for bytes asked for well before a stream of evict-first weights passes.
__device__ __forceinline__ void prefetch_l2_bulk(const void* src, unsigned bytes, bool keep = false) {
#if __CUDA_ARCH__ >= 900
    if (keep) {
        u64 p;
        asm("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(p));
        asm volatile("cp.async.bulk.prefetch.L2.global.L2::cache_hint [%0], %1, %2;" ::"l"(src), "r"(bytes), "l"(p)
                     : "memory");
    } else {
        asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(src), "r"(bytes) : "memory");
    }
#endif
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;"); }
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;" ::: "memory"); }
// Waits until at most N of this thread's committed copy groups are still in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait_group() {
    asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

// mbarriers in shared memory and bulk copies that complete on them (sm_90+): `a` is the
// barrier's shared-memory address. A wait takes the phase parity it waits for to complete.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
__device__ __forceinline__ void mbar_init(u32 a, u32 count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(a), "r"(count) : "memory");
}
// Makes barriers just initialized visible to the bulk copies (the async proxy).
__device__ __forceinline__ void mbar_init_fence() {
    asm volatile("fence.mbarrier_init.release.cluster;\n\tfence.proxy.async.shared::cta;" ::: "memory");
}
__device__ __forceinline__ void mbar_wait(u32 a, u32 parity) {
    u32 done;
    do {
        asm volatile(
            "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
            : "=r"(done)
            : "r"(a), "r"(parity)
            : "memory");
    } while (!done);
}
__device__ __forceinline__ void mbar_arrive(u32 a) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(a) : "memory");
}
// Arrives once this thread's earlier `cp.async` copies have landed (counted in the barrier's
// expected arrivals: `noinc`).
__device__ __forceinline__ void mbar_arrive_cp_async(u32 a) {
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(a) : "memory");
}
// Arrives and adds `bytes` to the transfers the barrier's phase waits for.
__device__ __forceinline__ void mbar_arrive_tx(u32 a, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(a), "r"(bytes) : "memory");
}
// `bytes` (a multiple of 16) of weights from global `src` (16-byte aligned) to shared `dst`,
// completing on the barrier at `bar` (marked first to leave L2, as ld_stream16 marks them).
__device__ __forceinline__ void bulk_g2s(u32 dst, const void* src, u32 bytes, u32 bar) {
#ifdef DI_EVICT_FIRST
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1], %2, [%3], %4;" ::"r"(
            dst),
        "l"(src), "r"(bytes), "r"(bar), "l"(l2_evict_first())
        : "memory");
#else
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(dst),
                 "l"(src), "r"(bytes), "r"(bar)
                 : "memory");
#endif
}
// A ring page at `dst` refilled with `n` (1 to 3) pieces of `bytes` from s0, s1, s2, one after
// another, completing on the page's barrier at `bar`: the reader's loads of the page's last
// contents ordered before the copies' writes, the barrier told the bytes to expect.
__device__ __forceinline__ void page_fill(u32 dst, u32 bar, u32 bytes, int n, const void* s0,
                                          const void* s1 = nullptr, const void* s2 = nullptr) {
#ifndef DI_X_NOFENCE
    // (DI_X_NOFENCE, a timing experiment outside the memory model, never for use: the fence
    // left out, to measure what it costs the issuing lane)
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
#endif
    mbar_arrive_tx(bar, n * bytes);
    bulk_g2s(dst, s0, bytes, bar);
    if (n > 1) bulk_g2s(dst + bytes, s1, bytes, bar);
    if (n > 2) bulk_g2s(dst + 2 * bytes, s2, bytes, bar);
}
#endif

// Thread-block clusters (sm_90+): a barrier of every thread of the cluster (release / acquire,
// so shared-memory writes before it are seen by the cluster's reads after it), and loads from
// the shared memory of cluster block `rank` at this block's address of the same variable.
__device__ __forceinline__ void cluster_sync() {
    asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}
__device__ __forceinline__ u32 cluster_addr(u32 a, u32 rank) {
    u32 r;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(rank));
    return r;
}
__device__ __forceinline__ float cluster_ld(const float* p, u32 rank) {
    const u32 r = cluster_addr((u32)__cvta_generic_to_shared(p), rank);
    float v;
    asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(r) : "memory");
    return v;
}
__device__ __forceinline__ float4 cluster_ld4(u32 a, u32 rank) {
    const u32 r = cluster_addr(a, rank);
    float4 v;
    asm volatile("ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [%4];"
                 : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
                 : "r"(r)
                 : "memory");
    return v;
}

// Programmatic dependent launch (Hopper+; the host launches kernels with the programmatic
// stream serialization attribute when the device supports it). Every kernel calls
// `pdl_launch_dependents()` at entry, so the next kernel's blocks may be scheduled while this
// one runs, and `pdl_wait()` before it touches memory that earlier kernels write (or that
// they read and it writes): the wait returns once every earlier kernel has finished and its
// writes are visible. Work that needs neither (streaming weights) may run before the wait.
// Without the attribute, or below sm_90, both are no-ops.
//
// With DEEPINFER_TRACE defined (`DEEPINFER_CUDA_TRACE`, host side in `backend/cuda/trace.rs`),
// both also stamp the launch's record in `di_trace` from thread 0 of one block in 16: the
// first and last trigger and the first and last return from the wait, in global-timer
// nanoseconds (and, for `di_trace_phase`, the first and last block to reach each phase). A
// kernel's wait returns once the kernels before it are done, so the gaps between successive
// launches' first returns are each kernel's share of the step. Only a block's first stamp
// waits on memory (it claims the record), so a traced step runs close to an untraced one.
#ifdef DEEPINFER_TRACE
#define DI_TRACE_SLOTS 4096
// key (grid id + 1), blocks << 32 | threads, ~first trigger, last trigger, ~first wait, last
// wait, then DI_TRACE_PHASES phase stamps (the latest block's), then as many again (~ the
// earliest block's)
#define DI_TRACE_PHASES 8
#define DI_TRACE_WORDS (6 + 2 * DI_TRACE_PHASES)
__device__ u64 di_trace[DI_TRACE_SLOTS * DI_TRACE_WORDS];
// DI_TRACE_BLOCKS (implies DI_TRACE_ALL): each of a launch's first DI_TRACE_BLOCK_MAX blocks
// also keeps its own stamps, by the launch's record: the low 32 bits of its trigger, wait and
// phase times and its SM + 1 (plain stores, nothing waited for), so a late phase can be put on
// the blocks and SMs that reached it late (the host writes them to FILE.blocks)
#ifdef DI_TRACE_BLOCKS
#ifndef DI_TRACE_ALL
#define DI_TRACE_ALL
#endif
#define DI_TRACE_BLOCK_MAX 256
#define DI_TRACE_BLOCK_WORDS (3 + DI_TRACE_PHASES)
__device__ u32 di_trace_blocks[DI_TRACE_SLOTS * DI_TRACE_BLOCK_MAX * DI_TRACE_BLOCK_WORDS];
#endif
// field 0: trigger, 1: wait, 2 + k: phase k
__device__ __forceinline__ void di_trace_stamp_at(int field, u64 t) {
    if (threadIdx.x | threadIdx.y | threadIdx.z) return;
    // y fastest, so a grid of a few x (the MoE slots) by many y is sampled in every x; the
    // block number's low 4 bits equal to its next 4, so a cluster grid (ranks by heads) is
    // sampled across heads and ranks, not one head's whole cluster
    // (DI_TRACE_ALL: every block stamps, so a phase's first and last are the grid's, at the
    // cost of every block's claim of the record)
#ifndef DI_TRACE_ALL
    const u64 b = blockIdx.y + (u64)gridDim.y * (blockIdx.x + (u64)gridDim.x * blockIdx.z);
    if ((b ^ (b >> 4)) & 15) return;
#endif
    u64 g;
    asm volatile("mov.u64 %0, %%gridid;" : "=l"(g));
    const u64 key = g + 1;
    // The block's record, found once: the claim (a compare-and-swap whose result the thread
    // waits for, a round trip to L2 that a loaded memory makes long) is paid by the block's
    // first stamp only, usually the trigger before the wait; later stamps are reductions the
    // thread does not wait for, so a stamp barely moves the block it times. Shared memory
    // left by another launch holds another key.
    __shared__ u64 di_trace_key;
    __shared__ u32 di_trace_slot;
    u64* r = nullptr;
    if (di_trace_key == key) {
        r = di_trace + (u64)di_trace_slot * DI_TRACE_WORDS;
    } else {
        for (u32 i = 0; i < 64 && r == nullptr; i++) {
            const u32 slot = (u32)((key + i) % DI_TRACE_SLOTS);
            u64* c = di_trace + (u64)slot * DI_TRACE_WORDS;
            const u64 old = atomicCAS(c, 0ull, key);
            if (old != 0ull && old != key) continue;
            if (old == 0ull) atomicExch(c + 1, ((u64)(gridDim.x * gridDim.y * gridDim.z) << 32) | blockDim.x);
            di_trace_key = key;
            di_trace_slot = slot;
            r = c;
        }
        if (r == nullptr) return;
    }
#ifdef DI_TRACE_BLOCKS
    const u64 blk = blockIdx.x + (u64)gridDim.x * (blockIdx.y + (u64)gridDim.y * blockIdx.z);
    if (blk < DI_TRACE_BLOCK_MAX) {
        u32* e = di_trace_blocks + ((u64)di_trace_slot * DI_TRACE_BLOCK_MAX + blk) * DI_TRACE_BLOCK_WORDS;
        u32 sm;
        asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
        e[field] = (u32)t;
        e[DI_TRACE_BLOCK_WORDS - 1] = sm + 1;
    }
#endif
    if (field < 2) {
        atomicMax(r + 2 + 2 * field, ~t);
        atomicMax(r + 3 + 2 * field, t);
    } else {
        atomicMax(r + 4 + field, t);
        atomicMax(r + 4 + DI_TRACE_PHASES + field, ~t);
    }
}
__device__ __forceinline__ void di_trace_stamp(int field) { di_trace_stamp_at(field, gtime()); }
// The time now, for a stamp made later (di_trace_phase_at): a block's first instruction, say,
// whose stamp (the record's claim, a round trip) would delay what follows.
__device__ __forceinline__ u64 di_trace_now() { return gtime(); }
#else
__device__ __forceinline__ void di_trace_stamp_at(int, u64) {}
__device__ __forceinline__ void di_trace_stamp(int) {}
__device__ __forceinline__ u64 di_trace_now() { return 0; }
#endif
// Phase k (< DI_TRACE_PHASES) of a kernel reached, by thread 0 of the sampled blocks (traced
// builds only): where a long kernel's time goes inside the pass.
__device__ __forceinline__ void di_trace_phase(int k) { di_trace_stamp(2 + k); }
// Phase k stamped with an earlier time `t` (from di_trace_now).
__device__ __forceinline__ void di_trace_phase_at(int k, u64 t) { di_trace_stamp_at(2 + k, t); }
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
    di_trace_stamp(1);
}
__device__ __forceinline__ void pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" :::);
#endif
    di_trace_stamp(0);
}
#define PDL_ENTRY() \
    do {                        \
        pdl_launch_dependents(); \
        pdl_wait();             \
    } while (0)
