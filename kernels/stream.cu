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
        u64 t0, t1;
        u32 off = 0, trips = 0;
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
        while (trips < STREAM_MIN_TRIPS || *reinterpret_cast<volatile int*>(&done) < SW) {
#pragma unroll 1
            for (int k = 0; k < 16; k++) {
                u32 v;
                asm volatile("ld.global.cg.u32 %0, [%1];" : "=r"(v) : "l"(cb + off));
                off = (off + 32u + v) & 4095u;  // v is 0: the next line, after this load
            }
            trips += 16;
        }
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t1));
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
