// Read-rate probes for `deepinfer bench stream` (host/src/backend/cuda/stream.rs): one launch
// reads a buffer several times the L2's size by one of the paths the weight streams take, so
// the rate each path reaches (and, for the rings, what page size and depth it needs) is
// measured apart from any product. Each block reads a contiguous share; what is read is folded
// into a value that is stored only if it equals a constant no real buffer gives, so the reads
// cannot be dropped.

#define STREAM_THREADS 256
#define STREAM_MAXP 64  // most ring pages a block (8 warps x at most 8)

// 16-byte loads into registers (`ld_stream16`, as the block GEMVs read weights), 8 in flight a
// thread before any is used.
extern "C" __global__ void __launch_bounds__(STREAM_THREADS) stream_ldg(const uint4* src, long n16, unsigned* sink) {
    const long c0 = n16 * blockIdx.x / gridDim.x, c1 = n16 * (blockIdx.x + 1) / gridDim.x;
    unsigned acc = 0;
    for (long c = c0 + threadIdx.x; c < c1; c += 8L * STREAM_THREADS) {
        uint4 v[8];
#pragma unroll
        for (int k = 0; k < 8; k++) {
            const long e = c + (long)k * STREAM_THREADS;
            v[k] = e < c1 ? ld_stream16(src + e) : make_uint4(0, 0, 0, 0);
        }
#pragma unroll
        for (int k = 0; k < 8; k++) acc ^= v[k].x ^ v[k].y ^ v[k].z ^ v[k].w;
    }
    if (acc == 0x9e3779b9u) sink[0] = acc;
}

// Rings of shared-memory pages, as `moe_ffn1` streams its units: each of the 8 warps owns
// `ppw` pages of `unit` bytes, takes the block's units w, w + 8, ... and asks for unit i + ppw
// into the page unit i leaves once every lane has read a word of it (sm_90+). How a page is
// filled (`mode`): 0, one bulk copy by lane 0 (`cp.async.bulk`, the copy engine); 1, two bulk
// copies of a half each (as a gate/up unit is a gate row and an up row); 2, the first half by
// a bulk copy and the second by the warp's lanes, 16-byte `cp.async` copies (the load path)
// completing on the same barrier; 3, all of it by the lanes' `cp.async` copies; 4, two bulk
// copies of a half, from the two halves of the buffer (as a gate/up unit's gate row and up row
// come from two matrices).
// With `lat` (the latency probe), warp 7 streams nothing: its lane 0 times L2 round trips
// while the other 7 warps stream, a chain of dependent loads past L1 (`ld.global.cg`, as the
// grid-wide waits read counters) over the block's own 16 KB of `chase`, a line at a time,
// until the streaming warps are done and at least STREAM_MIN_TRIPS were made, and stores the
// nanoseconds and the round trips in lat[2 b], lat[2 b + 1] (low 32 bits): what a round trip
// costs behind a given depth of copies in flight (a routing's loads behind the weight rings).
#define STREAM_MIN_TRIPS 512
// One L2 round trip of a chase over a block's 16 KB `cb` (zeroed): the load past L1 at word
// `off`, then the next line's word, found only once the load is back (its value is 0).
__device__ __forceinline__ u32 chase_step(const u32* cb, u32 off) {
    u32 v;
    asm volatile("ld.global.cg.u32 %0, [%1];" : "=r"(v) : "l"(cb + off));
    return (off + 32u + v) & 4095u;
}
extern "C" __global__ void __launch_bounds__(STREAM_THREADS, 1)
    stream_ring(const u8* src, long bytes, int unit, int ppw, int mode, unsigned* sink, u32* chase,
                unsigned long long* lat) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    extern __shared__ __align__(128) u8 stream_smem[];
    __shared__ __align__(8) u64 bars[STREAM_MAXP];
    __shared__ int done;  // streaming warps finished (the latency probe)
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, G = gridDim.x, b = blockIdx.x;
    const int SW = lat != nullptr ? 7 : 8;  // warps streaming
    const long n = bytes / unit, u0 = n * b / G, nu = n * (b + 1) / G - u0;
    const u32 ring = (u32)__cvta_generic_to_shared(stream_smem), bar0 = (u32)__cvta_generic_to_shared(bars);
    // bytes by bulk copies, the rest by the lanes
    const u32 bulk = mode == 3 ? 0u : mode == 2 ? (u32)unit / 2 : (u32)unit;
    // a page's phase waits for lane 0's arrival and, where the lanes copy, each lane's
    if (threadIdx.x == 0) {
        for (int p = 0; p < 8 * ppw; p++) mbar_init(bar0 + 8 * p, bulk < (u32)unit ? 33 : 1);
        mbar_init_fence();
        done = 0;
    }
    __syncthreads();
    if (warp == SW) {
        if (lane != 0) return;
        u32* cb = chase + (long)b * 4096;
        for (int i = 0; i < 4096; i += 32) cb[i] = 0u;
        u32 off = 0, trips = 0;
        const u64 t0 = gtime();
        while (trips < STREAM_MIN_TRIPS || *reinterpret_cast<volatile int*>(&done) < SW) {
#pragma unroll 1
            for (int k = 0; k < 16; k++) off = chase_step(cb, off);
            trips += 16;
        }
        const u64 t1 = gtime();
        lat[2 * b] = t1 - t0;
        lat[2 * b + 1] = trips | (u64)off << 32;  // (the chain's end kept: unused, its loads would go)
        return;
    }
    const long mine = nu > warp ? (nu - warp + SW - 1) / SW : 0;
    // the whole warp: each lane's copies arrive on the barrier once they land, then lane 0
    // arrives, telling the barrier the bulk bytes to wait for
    auto issue = [&](long i) {
        const int pg = warp * ppw + (int)(i % ppw);
        const long u = u0 + warp + (long)SW * i;
        const u8* s = src + u * unit;
        const u32 dst = ring + (u32)pg * (u32)unit, bar = bar0 + 8 * pg;
        if (bulk < (u32)unit) {
            for (u32 o = bulk + 16u * lane; o < (u32)unit; o += 16u * 32u)
                cp_async16(stream_smem + (long)pg * unit + o, s + o, true);
            mbar_arrive_cp_async(bar);
        }
        __syncwarp();
        if (lane != 0) return;
        if (bulk == 0) {
            mbar_arrive(bar);
        } else if (mode == 1) {
            page_fill(dst, bar, bulk / 2, 2, s, s + bulk / 2);
        } else if (mode == 4) {
            // unit u's halves: half-unit u of the buffer's first half and of its second
            const long h = (long)unit / 2, half = n * h;
            page_fill(dst, bar, (u32)h, 2, src + u * h, src + half + u * h);
        } else {
            page_fill(dst, bar, bulk, 1, s);
        }
    };
    for (long i = 0; i < ppw && i < mine; i++) issue(i);
    unsigned acc = 0;
    for (long i = 0; i < mine; i++) {
        const int pg = warp * ppw + (int)(i % ppw);
        mbar_wait(bar0 + 8 * pg, (u32)((i / ppw) & 1));
        acc ^= *reinterpret_cast<const unsigned*>(stream_smem + (long)pg * unit + lane * 4);
        __syncwarp();
        if (i + ppw < mine) issue(i + ppw);
    }
    if (acc == 0x9e3779b9u) sink[0] = acc;
    if (lane == 0) atomicAdd(&done, 1);
#endif
}

// The persistent step's question, asked without a model: can one resident launch stream a
// chain of dependent GEMVs (each phase's input the output of an earlier phase, met across the
// grid through counters) at the rate of a bare ring, when one warp a block copies weights
// ahead across the phases' boundaries and only the other warps wait on the dependencies?
// `ph` holds `nph` phases of CHAIN_FIELDS ints: rows (of CHAIN_K bf16, two a page), dep (the
// phase whose outputs are the input, -1 for ones), gate (a phase the copies must wait for, as
// routed experts' rows wait for the routing; -1 for none), trips (dependent L2 round trips
// thread 0 makes before the block counts the phase: a latency-bound stage such as the
// attention's), y0 (the phase's first output in `y`) and u0 (its first page in the weights,
// wrapped at `wbytes`), red (words each block adds into `red` before counting the phase: the
// integer sums that would meet a product split by its input's rows; 0 for none) and groups
// (the phase's units cut into that many equal groups, experts: a block counts each group its
// share touches in cnt[nph + CHAIN_MAXG p + g] as well as the phase in cnt[p], and a phase of
// as many groups that depends on it waits only for the groups its own share touches; 0 for
// none); after the phases, CHAIN_MAXG ints a phase: how many blocks' shares touch each group
// (the counts those waits wait for). Warps 0..7 compute; warp 8's lane 0 fills the
// `pages`-page ring. A block's share of a phase is a contiguous range of its pages; the ring
// is taken in the block's order of pages across phases; a page's `full` barrier completes
// when its bytes land, its `empty` barrier when the warp that read it is done (with `own`,
// see below). cnt[p] counts the blocks that
// finished phase p (zeroed before the launch, with the groups' counters after them), chase
// holds each block's 16 KB (zeroed).
#define CHAIN_FIELDS 8
#define CHAIN_MAXG 8
#define CHAIN_K 2048
#define CHAIN_PAGE 8192
#define CHAIN_WARPS 8
#define CHAIN_THREADS (32 * CHAIN_WARPS + 32)
#define CHAIN_MAXP 32
__device__ __forceinline__ void chain_bar() { asm volatile("bar.sync 1, %0;" ::"n"(32 * CHAIN_WARPS) : "memory"); }

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
// Whether the barrier's phase of `parity` is complete, without waiting (so the probe times only
// the waits that happen).
__device__ __forceinline__ bool chain_ready(u32 a, u32 parity) {
    u32 done;
    asm volatile(
        "{\n.reg .pred p;\nmbarrier.test_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(a), "r"(parity)
        : "memory");
    return done != 0;
}
// Waits for the barrier's phase of `parity`, adding to `t` the nanoseconds it waited when the
// phase was not complete at the first look.
__device__ __forceinline__ void chain_wait(u32 a, u32 parity, u64& t) {
    if (chain_ready(a, parity)) return;
    const u64 t0 = gtime();
    mbar_wait(a, parity);
    t += gtime() - t0;
}
#endif

// A place in a block's walk over the phases' pages (all 32-bit: the walk runs once a page, so
// it holds no 64-bit division): phase p, unit i of the block's share [.., e), the phase's
// first weight page `base` (wrapped at the buffer's `wp` pages). A walk takes every
// `stride`-th unit from its share's unit `off` (the copying lane: 1 and 0; a warp copying its
// own: CHAIN_WARPS and its number).
struct ChainWalk {
    int p, i, e;
    u32 base;
};
__device__ __forceinline__ void chain_share(const int* ph, int p, int b, int G, int& a, int& e) {
    const int n = ph[CHAIN_FIELDS * p] / 2;
    a = n * b / G;
    e = n * (b + 1) / G;
}
// The walk moved to the first phase from `p` on where it has a unit (c.p == nph past the last).
__device__ __forceinline__ void chain_seek(ChainWalk& c, const int* ph, int nph, int p, int off, int b, int G, u32 wp) {
    for (; p < nph; p++) {
        int a, e;
        chain_share(ph, p, b, G, a, e);
        if (a + off < e) {
            c.p = p;
            c.i = a + off;
            c.e = e;
            c.base = (u32)ph[CHAIN_FIELDS * p + 5] % wp;
            return;
        }
    }
    c.p = nph;
}
__device__ __forceinline__ void chain_step(ChainWalk& c, const int* ph, int nph, int stride, int off, int b, int G,
                                           u32 wp) {
    c.i += stride;
    if (c.i >= c.e) chain_seek(c, ph, nph, c.p + 1, off, b, G, wp);
}
// The groups (of `ng` over the phase's units) that block b's share of phase p touches, [g0, g1)
// (32-bit: a share's units times 8 groups fit; the host counts the same way, `chain_table`).
__device__ __forceinline__ void chain_groups(const int* ph, int p, int b, int G, int ng, int& g0, int& g1) {
    int a, e;
    chain_share(ph, p, b, G, a, e);
    const int n = ph[CHAIN_FIELDS * p] / 2;
    g0 = a < e ? a * ng / n : 0;
    g1 = a < e ? (e - 1) * ng / n + 1 : 0;
}
// Waits until every block whose share of phase `dep` touches group g has counted it (how many:
// the table's counts after its phases, ph[CHAIN_FIELDS nph + CHAIN_MAXG dep + g], the host's,
// so the wait walks no other block's share).
__device__ __forceinline__ void chain_wait_group(const int* ph, int nph, const u32* cnt, int dep, int g) {
    wait_count(cnt + nph + CHAIN_MAXG * dep + g, (u32)ph[CHAIN_FIELDS * nph + CHAIN_MAXG * dep + g]);
}
__device__ __forceinline__ const u8* chain_src(const u8* w, const ChainWalk& c, u32 wp) {
    u32 k = c.base + (u32)c.i;
    if (k >= wp) k -= wp;
    return w + (u64)k * CHAIN_PAGE;
}

extern "C" __global__ void __launch_bounds__(CHAIN_THREADS, 1)
    stream_chain(const u8* w, long wbytes, const int* ph, int nph, int pages, int own, int l2, float* y,
                 u32* cnt, u32* chase, u64* stat, unsigned long long* red) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    extern __shared__ __align__(128) u8 chain_smem[];
    // where a block's time goes (stat[4 b ..]): the launch, thread 0's waits for the phases'
    // inputs (the counter and the input's load), warp 0's waits for its pages, the copying
    // lane's waits for a free page (nanoseconds; a page or a free page timed only when it is
    // not there at the first look)
    u64 t_start = gtime(), t_dep = 0, t_page = 0, t_free = 0;
    __shared__ __align__(8) u64 full[CHAIN_MAXP], empty[CHAIN_MAXP];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, G = gridDim.x, b = blockIdx.x;
    const u32 wp = (u32)(wbytes / CHAIN_PAGE);
    float* xs = reinterpret_cast<float*>(chain_smem + (long)pages * CHAIN_PAGE);
    const u32 ring = (u32)__cvta_generic_to_shared(chain_smem);
    const u32 f0 = (u32)__cvta_generic_to_shared(full), e0 = (u32)__cvta_generic_to_shared(empty);
    if (threadIdx.x == 0) {
        for (int p = 0; p < pages; p++) {
            mbar_init(f0 + 8 * p, 1);
            mbar_init(e0 + 8 * p, 1);
        }
        mbar_init_fence();
    }
    __syncthreads();
    // `own` > 0: no copying warp; each computing warp owns `own` pages and copies its own
    // units, unit k + own into the page unit k leaves (as `moe_ffn1`'s warps do), walking the
    // phases ahead of its reads (lane 0 keeps the walk). A routed phase's units wait for their
    // gate, without blocking unless the warp needs the unit now (it has then finished every
    // earlier phase, so the wait cannot be on it).
    ChainWalk oc;
    int issued = 0, islot = 0, gated = -1;
    auto pump = [&](int done, bool need) {
        while (oc.p < nph && issued < done + own) {
            const int gate = ph[CHAIN_FIELDS * oc.p + 2];
            if (gate >= 0 && gated != oc.p) {
                if (need && issued == done)
                    wait_count(cnt + gate, (u32)G);
                else if (ld_acquire_u32(cnt + gate) < (u32)G)
                    return;
                gated = oc.p;
            }
            const int pg = warp * own + islot;
            page_fill(ring + (u32)pg * CHAIN_PAGE, f0 + 8 * pg, CHAIN_PAGE, 1, chain_src(w, oc, wp));
            issued++;
            if (++islot == own) islot = 0;
            chain_step(oc, ph, nph, CHAIN_WARPS, warp, b, G, wp);
        }
    };
    if (own > 0 && warp < CHAIN_WARPS && lane == 0) {
        chain_seek(oc, ph, nph, 0, warp, b, G, wp);
        pump(0, false);
    }
    if (warp == CHAIN_WARPS) {
        if (lane != 0 || own > 0) return;
        // the copying lane: the block's pages in order into the ring (page `slot` of round
        // `round`), and with `l2` the pages from `pages` to `pages + l2` beyond the one it
        // copies asked into L2 (walk `lc`, `lseq` pages along), as far as no routed phase's
        // gate is still closed
        ChainWalk c, lc;
        chain_seek(c, ph, nph, 0, 0, b, G, wp);
        lc = c;
        int seq = 0, lseq = 0, slot = 0, open = -1;
        u32 round = 0;
        for (; c.p < nph; seq++) {
            const int gate = ph[CHAIN_FIELDS * c.p + 2];
            if (gate >= 0 && open < c.p) {
                wait_count(cnt + gate, (u32)G);
                open = c.p;
            }
            for (; l2 > 0 && lc.p < nph && lseq < seq + pages + l2; lseq++) {
                const int lg = ph[CHAIN_FIELDS * lc.p + 2];
                if (lg >= 0 && open < lc.p) {
                    if (ld_acquire_u32(cnt + lg) < (u32)G) break;
                    open = lc.p;
                }
                if (lseq >= pages) prefetch_l2_bulk(chain_src(w, lc, wp), CHAIN_PAGE);
                chain_step(lc, ph, nph, 1, 0, b, G, wp);
            }
            if (seq >= pages) chain_wait(e0 + 8 * slot, (round - 1) & 1, t_free);
            page_fill(ring + (u32)slot * CHAIN_PAGE, f0 + 8 * slot, CHAIN_PAGE, 1, chain_src(w, c, wp));
            if (++slot == pages) {
                slot = 0;
                round++;
            }
            chain_step(c, ph, nph, 1, 0, b, G, wp);
        }
        stat[4 * b + 3] = t_free;
        return;
    }
    int seq = 0;                       // the block's pages taken so far (the copying lane's)
    int kw = 0, kslot = 0, kpar = 0;  // (`own`) the warp's pages, its next page and parity
    for (int p = 0; p < nph; p++) {
        const int* q = ph + CHAIN_FIELDS * p;
        const int rows = q[0], dep = q[1], trips = q[3], y0 = q[4];
        const u64 t0 = gtime();
        const int ng = q[7];
        // the groups this block's share of the phase touches (waited for in the dep, counted
        // at the end), thread 0's
        int g0 = 0, g1 = 0;
        if (ng > 0 && threadIdx.x == 0) chain_groups(ph, p, b, G, ng, g0, g1);
        if (dep >= 0 && threadIdx.x == 0) {
            if (ng > 0 && ph[CHAIN_FIELDS * dep + 7] == ng) {
                // only the groups of the dep that this block's share needs
                for (int g = g0; g < g1; g++) chain_wait_group(ph, nph, cnt, dep, g);
            } else {
                wait_count(cnt + dep, (u32)G);
            }
        }
        chain_bar();
        if (rows > 0) {
            // the dep's outputs (wrapped to CHAIN_K values), or where it has none (the attention
            // stage) the first values of `y`, loaded all the same
            const int* d = ph + CHAIN_FIELDS * (dep >= 0 ? dep : 0);
            const int from = d[0] > 0 ? d[4] : 0, span = d[0] > 0 ? d[0] : CHAIN_K;
            for (int k = threadIdx.x; k < CHAIN_K; k += 32 * CHAIN_WARPS)
                xs[k] = dep >= 0 ? ld_cg(y + from + k % span) : 1.0f;
            chain_bar();
        }
        t_dep += gtime() - t0;
        // the lane's 64 input values for the phase, in registers
        float xr[64];
#pragma unroll
        for (int j = 0; j < 8; j++)
#pragma unroll
            for (int h = 0; h < 8; h++) xr[8 * j + h] = rows > 0 ? xs[j * 256 + lane * 8 + h] : 0.f;
        if (trips > 0 && threadIdx.x == 0) {
            u32* cb = chase + (long)b * 4096;
            u32 off = 0;
            for (int t = 0; t < trips; t++) off = chase_step(cb, off);
            if (off == 1u) cb[0] = off;  // (never: 32-word steps; keeps the chain's loads)
        }
        int a, e;
        chain_share(ph, p, b, G, a, e);
        // (the copying lane's ring) the warp's first unit's page and round parity
        int pos = seq + warp, slot = pos % pages, par = (pos / pages) & 1;
        for (int i = a + warp; i < e; i += CHAIN_WARPS, pos += CHAIN_WARPS) {
            if (own > 0) {
                // the other lanes wait for lane 0 at a warp barrier rather than polling the
                // page's barrier while lane 0 may still be asking for the page
                if (lane == 0) pump(kw, true);
                __syncwarp();
            }
            const int pg = own > 0 ? warp * own + kslot : slot;
            const u32 parity = (u32)(own > 0 ? kpar : par);
            // (the copying lane's ring) a page's previous round may be another warp's and its
            // copy may still be in flight (bulk copies land in any order): the parity test
            // alone would then pass a round early, so first the page's previous round read
            if (own == 0 && pos >= pages) chain_wait(e0 + 8 * pg, parity ^ 1u, t_page);
            chain_wait(f0 + 8 * pg, parity, t_page);
            const u8* page = chain_smem + (long)pg * CHAIN_PAGE;
            float acc[2] = {0.f, 0.f};
#ifdef CHAIN_X_NODOT
            // (a timing experiment: the page's words read but not multiplied)
            const uint4 v = *reinterpret_cast<const uint4*>(page + lane * 16);
            acc[0] = __uint_as_float(v.x ^ v.w);
#else
#pragma unroll
            for (int j = 0; j < 16; j++) {
                const uint4 v = *reinterpret_cast<const uint4*>(page + j * 512 + lane * 16);
                const float* x = xr + 8 * (j & 7);
                const u32 wd[4] = {v.x, v.y, v.z, v.w};
                float s2 = 0.f;
#pragma unroll
                for (int h = 0; h < 4; h++)
                    s2 += __uint_as_float(wd[h] << 16) * x[2 * h] + __uint_as_float(wd[h] & 0xffff0000u) * x[2 * h + 1];
                acc[j >> 3] += s2;
            }
#endif
            __syncwarp();
            if (own > 0) {
                kw++;
                if (++kslot == own) {
                    kslot = 0;
                    kpar ^= 1;
                }
                if (lane == 0) pump(kw, false);
            } else {
                if (lane == 0) mbar_arrive(e0 + 8 * pg);
                for (slot += CHAIN_WARPS; slot >= pages; slot -= pages) par ^= 1;
            }
            acc[0] = warp_sum(acc[0]);
            acc[1] = warp_sum(acc[1]);
            if (lane == 0) {
                y[y0 + 2 * i] = acc[0];
                y[y0 + 2 * i + 1] = acc[1];
            }
        }
        seq += e - a;
        // a split product's partial sums, one word a column, added where every block adds
        // its own (fire-and-forget reductions; the fence before the count orders them)
        for (int k = threadIdx.x; k < min(q[6], CHAIN_K); k += 32 * CHAIN_WARPS)
            atomicAdd(red + k, (unsigned long long)__float_as_uint(xs[k]));
        chain_bar();
        if (threadIdx.x == 0) {
            __threadfence();
            for (int g = g0; g < g1; g++) atomicAdd(cnt + nph + CHAIN_MAXG * p + g, 1u);
            atomicAdd(cnt + p, 1u);
        }
    }
    if (threadIdx.x == 0) {
        stat[4 * b] = gtime() - t_start;
        stat[4 * b + 1] = t_dep;
        stat[4 * b + 2] = t_page;
    }
#endif
}
