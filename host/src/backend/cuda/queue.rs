//! The deferred work queue. Backend operations append [`Op`]s here instead of launching; the
//! queue runs them at the next synchronization point (`to_host`, a free, a drop). Seeing a
//! whole forward pass before running it lets the queue
//! - fuse neighbours (several GEMVs that read the same input; a residual add into the next
//!   RMSNorm), and
//! - replay it as a CUDA graph: a pass whose operation list (kernels, arguments, addresses)
//!   equals the previous pass's is captured once and from then on launched as one graph.
//!
//! Host data (the step's token ids, positions and block tables) rides along as leading
//! uploads, copied before the graph so that one graph serves every decode step of a batch.

use std::ffi::c_void;
use std::sync::Arc;

use cudarc::driver::{result, sys, CudaStream};

use super::blas::{Blas, Gemm};
use super::device::cuda_err;
use super::module::{KernelId, Module};
use super::weights::WType;
use crate::error::{Error, Result};

/// Weight rows per GEMV segment list (Q/K/V in one launch).
pub const GEMV_SEGMENTS: usize = 3;
/// Threads per GEMV block (one warp per weight row, or one block per few rows).
pub const GEMV_THREADS: u32 = 256;

/// What the GEMV and skinny-GEMM launches share: one input `x` of `n` tokens times up to
/// [`GEMV_SEGMENTS`] weights of `k` columns (`row_bytes` a row), each with its own output.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Product {
    pub x: u64,
    pub n: usize,
    pub k: usize,
    pub row_bytes: usize,
    /// (weight, output, rows).
    pub segs: Vec<(u64, u64, usize)>,
}

impl Product {
    /// A product of one weight of `k` columns (`row_bytes` a row, `rows` rows at `w`) over
    /// `x` into `y`.
    pub fn new(
        x: u64,
        n: usize,
        k: usize,
        row_bytes: usize,
        (w, y, rows): (u64, u64, usize),
    ) -> Product {
        Product {
            x,
            n,
            k,
            row_bytes,
            segs: vec![(w, y, rows)],
        }
    }

    /// Whether another weight of the same shape over the same input, writing `y`, can join as
    /// a segment: room for one more, and `y` is neither an output already nor the input.
    pub fn can_join(&self, x: u64, n: usize, k: usize, row_bytes: usize, y: u64) -> bool {
        self.x == x
            && self.n == n
            && self.k == k
            && self.row_bytes == row_bytes
            && self.segs.len() < GEMV_SEGMENTS
            && !self.segs.iter().any(|s| s.1 == y)
            && y != self.x
    }

    /// Whether this is a gate/up pair a SwiGLU over `gate` and `up` (`n` values each) can fold
    /// into: two segments of equal rows writing exactly those buffers.
    pub fn is_gate_up(&self, gate: u64, up: u64, n: usize) -> bool {
        let s = &self.segs;
        s.len() == 2 && s[0].1 == gate && s[1].1 == up && s[0].2 == s[1].2 && s[0].2 * self.n == n
    }

    /// The kernels' leading parameters: the (weights, output, rows) segments, then the input,
    /// its token count, k and the weights' row bytes.
    fn args(&self, a: &mut [u64]) {
        for (i, &(w, y, rows)) in self.segs.iter().enumerate() {
            a[i] = w;
            a[3 + i] = y;
            a[6 + i] = rows as u64;
        }
        a[9] = self.x;
        a[10] = self.n as u64;
        a[11] = self.k as u64;
        a[12] = self.row_bytes as u64;
    }
}

/// A fusable matrix-vector product (see `kernels/gemv.cu`).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Gemv {
    pub kernel: KernelId,
    pub p: Product,
    /// Weight type (segments of one launch share it).
    pub wtype: WType,
    /// Output rows per block of [`GEMV_THREADS`] threads (8 for the warp-per-row kernels).
    pub rows_per_block: usize,
    /// An RMSNorm folded in (block-cooperative kernels only): (raw input, f32 gain, eps bits);
    /// `x` is then the norm's output, written by the kernel too.
    pub norm: Option<(u64, u64, u32)>,
    /// A residual add folded in: `res += y` (one segment; 0 for none).
    pub res: u64,
    /// SwiGLU folded in (a gate/up pair of equal rows, block-cooperative kernels only): the
    /// first output becomes silu(gate) * up, the second is not written.
    pub swiglu: bool,
}

impl Gemv {
    /// Blocks of the launch: `rows_per_block` rows each, or half as many gate rows (and the
    /// same up rows) with SwiGLU.
    pub fn blocks(&self) -> usize {
        let per = self.rows_per_block.max(1);
        if self.swiglu {
            self.p.segs[0].2.div_ceil((per / 2).max(1))
        } else {
            self.p.segs.iter().map(|s| s.2).sum::<usize>().div_ceil(per)
        }
    }
}

/// A skinny tensor-core GEMM (see `kernels/gemt.cu`): `n` tokens (9..=64) times up to three
/// bf16 weights sharing the input, or a gate/up pair with SwiGLU folded in.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Gemt {
    pub kernel: KernelId,
    pub p: Product,
    /// Gate and up (two segments of equal rows): the first output becomes silu(gate) * up.
    pub swiglu: bool,
    /// Dynamic shared memory of the kernel, bytes.
    pub smem: u32,
    /// Blocks splitting k for one row tile (a thread-block cluster): 1, 2, 4 or 8.
    pub splits: u32,
}

/// Output rows per block of [`Gemt`] (`GEMT_ROWS`).
pub const GEMT_ROWS: usize = 128;

impl Gemt {
    /// Row tiles (the grid's y).
    pub fn tiles(&self) -> usize {
        if self.swiglu {
            self.p.segs[0].2.div_ceil(GEMT_ROWS / 2)
        } else {
            self.p.segs.iter().map(|s| s.2.div_ceil(GEMT_ROWS)).sum()
        }
    }
}

/// One unit of device work.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Op {
    Launch {
        kernel: KernelId,
        grid: [u32; 3],
        block: u32,
        smem: u32,
        args: Vec<u64>,
    },
    /// A kernel launched in thread-block clusters of `cluster` blocks along x (sm_90+).
    Cluster {
        kernel: KernelId,
        grid: [u32; 3],
        block: u32,
        cluster: u32,
        smem: u32,
        args: Vec<u64>,
    },
    Gemv(Gemv),
    Gemt(Gemt),
    /// `x += y` over `n` activations (kept apart so a following RMSNorm can absorb it).
    Add {
        kernel: KernelId,
        x: u64,
        y: u64,
        n: usize,
    },
    Gemm(Gemm),
    Memset {
        ptr: u64,
        bytes: usize,
    },
    Upload {
        ptr: u64,
        data: Vec<u8>,
    },
}

/// A captured graph, owned by the queue.
struct Graph(cudarc::driver::CudaGraph);
// SAFETY: a graph is only touched under the queue's mutex, one thread at a time.
unsafe impl Send for Graph {}

/// Counters for benchmarks and tests.
#[derive(Debug, Clone, Copy, Default)]
pub struct QueueStats {
    pub flushes: u64,
    pub ops: u64,
    pub graph_captures: u64,
    pub graph_launches: u64,
    /// Device time of the flushed work (only while timing is on), seconds.
    pub device_s: f64,
    /// Products taken into the `moe_ffn1` launch before them (`moe::fold_next_norm_gemv`).
    pub ffn1_next_folds: u64,
    /// Products taken into the `moe_ffn1` launch after them (`moe::fold_prev_acc_gemv`).
    pub ffn1_prev_folds: u64,
    /// One-token MoE layers queued as `moe_fk1` (`CudaOptions::moe_splitk`).
    pub fk1_launches: u64,
    /// One-token MoE layers queued as `moe_ffn1`, and the last one's blocks
    /// (`CudaOptions::ffn1_blocks`).
    pub ffn1_launches: u64,
    pub ffn1_blocks: u64,
    /// Launches given the next launch's weights to ask into L2 (`moe::link_next_weights`).
    pub l2_links: u64,
}

/// Most graphs kept (least recently used dropped first).
const MAX_GRAPHS: usize = 16;
/// Shorter passes are not worth a graph.
const MIN_GRAPH_OPS: usize = 8;

pub struct Queue {
    ops: Vec<Op>,
    previous: Vec<Op>,
    graphs: Vec<(Vec<Op>, Graph)>,
    pub graphs_enabled: bool,
    pub timing: bool,
    pub stats: QueueStats,
    /// The kernel timeline asked for (`DEEPINFER_CUDA_TRACE`).
    pub tracer: Option<super::trace::Tracer>,
    /// `Ds2::next_l2`: passes go through `moe::link_next_weights` before they run.
    pub next_l2: bool,
    /// `CudaOptions::ffn1_next`: passes go through `moe::fold_next_norm_gemv` before they run.
    pub ffn1_next: bool,
    /// `CudaOptions::ffn1_prev`: passes go through `moe::fold_prev_acc_gemv` before they run.
    pub ffn1_prev: bool,
    /// `CudaOptions::fk1_l2`: passes go through `moe::link_next_weights` before they run.
    pub fk1_l2: bool,
    /// `CudaOptions::ffn1_next_l2`: the same for `moe_ffn1` launches.
    pub ffn1_next_l2: bool,
}

impl Queue {
    pub fn new(graphs_enabled: bool) -> Queue {
        Queue {
            ops: Vec::new(),
            previous: Vec::new(),
            graphs: Vec::new(),
            graphs_enabled,
            timing: false,
            tracer: None,
            next_l2: false,
            ffn1_next: false,
            ffn1_prev: false,
            fk1_l2: false,
            ffn1_next_l2: false,
            stats: QueueStats::default(),
        }
    }

    pub fn push(&mut self, op: Op) {
        self.ops.push(op);
    }

    /// The last queued op, for peephole fusion.
    pub fn last_mut(&mut self) -> Option<&mut Op> {
        self.ops.last_mut()
    }

    pub fn pop(&mut self) -> Option<Op> {
        self.ops.pop()
    }

    /// Takes back the last queued op when it is a plain RMSNorm (`rms`, no residual) of `n` rows
    /// of `d` writing `out` from another buffer, for a kernel that folds the norm in: its input,
    /// gain and eps bits.
    pub fn take_norm(
        &mut self,
        rms: KernelId,
        out: u64,
        d: usize,
        n: usize,
    ) -> Option<(u64, u64, u64)> {
        let Some(Op::Launch {
            kernel, grid, args, ..
        }) = self.ops.last()
        else {
            return None;
        };
        // rms_norm's arguments: out, x, y (residual, 0 for none), gain, d, eps.
        let norm = (*kernel == rms
            && args.len() == 6
            && args[0] == out
            && args[1] != out
            && args[2] == 0
            && args[4] == d as u64
            && grid[0] as usize == n)
            .then(|| (args[1], args[3], args[5]));
        if norm.is_some() {
            self.ops.pop();
        }
        norm
    }

    /// Removes the memset of exactly `[ptr, ptr + bytes)` from the memsets queued last (nothing
    /// queued since can have read the range); true when there was one.
    pub fn drop_memset(&mut self, ptr: u64, bytes: usize) -> bool {
        let tail = self
            .ops
            .iter()
            .rev()
            .take_while(|o| matches!(o, Op::Memset { .. }))
            .count();
        let start = self.ops.len() - tail;
        let hit = self.ops[start..]
            .iter()
            .position(|o| matches!(o, Op::Memset { ptr: p, bytes: b } if *p == ptr && *b == bytes));
        match hit {
            Some(i) => {
                self.ops.remove(start + i);
                true
            }
            None => false,
        }
    }

    /// Runs everything queued (leading uploads first, then the rest eagerly or as a graph).
    pub fn flush(&mut self, m: &Module, blas: &Blas, stream: &Arc<CudaStream>) -> Result<()> {
        if self.ops.is_empty() {
            return Ok(());
        }
        let mut ops = std::mem::take(&mut self.ops);
        if self.ffn1_prev {
            self.stats.ffn1_prev_folds += super::moe::fold_prev_acc_gemv(&mut ops, m);
        }
        if self.ffn1_next {
            self.stats.ffn1_next_folds += super::moe::fold_next_norm_gemv(&mut ops, m);
        }
        if self.next_l2 || self.fk1_l2 || self.ffn1_next_l2 {
            self.stats.l2_links += super::moe::link_next_weights(
                &mut ops,
                m,
                self.next_l2,
                self.fk1_l2,
                self.ffn1_next_l2,
            );
        }
        self.stats.flushes += 1;
        self.stats.ops += ops.len() as u64;
        let lead = ops
            .iter()
            .take_while(|o| matches!(o, Op::Upload { .. }))
            .count();
        let (uploads, body) = ops.split_at(lead);
        let timer = if self.timing {
            Some(Timer::start(stream)?)
        } else {
            None
        };
        exec_all(uploads, m, blas, stream)?;
        let traced = match self.tracer.as_mut() {
            Some(t) => t.begin(body.len(), stream)?,
            None => false,
        };
        let graphable = self.graphs_enabled
            && body.len() >= MIN_GRAPH_OPS
            && !body.iter().any(|o| matches!(o, Op::Upload { .. }));
        if graphable {
            if let Some(i) = self.graphs.iter().position(|(k, _)| k.as_slice() == body) {
                let entry = self.graphs.remove(i);
                entry
                    .1
                     .0
                    .launch()
                    .map_err(|e| cuda_err("launching a CUDA graph", e))?;
                self.graphs.push(entry);
                self.stats.graph_launches += 1;
            } else if self.previous.as_slice() == body {
                let graph = capture(body, m, blas, stream)?;
                graph
                    .0
                    .launch()
                    .map_err(|e| cuda_err("launching a CUDA graph", e))?;
                self.stats.graph_captures += 1;
                self.stats.graph_launches += 1;
                if self.graphs.len() >= MAX_GRAPHS {
                    self.graphs.remove(0);
                }
                self.graphs.push((body.to_vec(), graph));
            } else {
                exec_all(body, m, blas, stream)?;
                self.previous = body.to_vec();
            }
        } else {
            exec_all(body, m, blas, stream)?;
        }
        if traced {
            if let Some(t) = self.tracer.as_ref() {
                t.finish(body, m, stream)?;
            }
        }
        if let Some(t) = timer {
            self.stats.device_s += t.stop(stream)?;
        }
        Ok(())
    }

    /// Forgets every captured graph (their addresses may be about to be freed).
    pub fn drop_graphs(&mut self) {
        self.graphs.clear();
        self.previous.clear();
    }
}

fn capture(body: &[Op], m: &Module, blas: &Blas, stream: &Arc<CudaStream>) -> Result<Graph> {
    stream
        .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
        .map_err(|e| cuda_err("beginning graph capture", e))?;
    let ran = exec_all(body, m, blas, stream);
    let ended = stream.end_capture(sys::CUgraphInstantiate_flags(0));
    ran?;
    match ended {
        Ok(Some(g)) => Ok(Graph(g)),
        Ok(None) => Err(Error::Cuda("graph capture produced no graph".into())),
        Err(e) => Err(cuda_err("instantiating a CUDA graph", e)),
    }
}

fn exec_all(ops: &[Op], m: &Module, blas: &Blas, stream: &Arc<CudaStream>) -> Result<()> {
    // Programmatic launches only in passes without cuBLAS: on the H200 they saved 0.1 ms of a
    // batch-1 Llama-3-8B decode step (GEMVs only) but cost 1 ms at batch 32 (cuBLAS GEMMs).
    let pdl = m.pdl && !ops.iter().any(|o| matches!(o, Op::Gemm(_)));
    for op in ops {
        exec(op, m, blas, stream, pdl)?;
    }
    Ok(())
}

#[allow(clippy::too_many_arguments)]
fn launch(
    m: &Module,
    stream: &CudaStream,
    pdl: bool,
    cluster: u32,
    kernel: KernelId,
    grid: [u32; 3],
    block: u32,
    smem: u32,
    args: &[u64],
) -> Result<()> {
    let mut vals: Vec<u64> = args.to_vec();
    let mut ptrs: Vec<*mut c_void> = vals
        .iter_mut()
        .map(|v| v as *mut u64 as *mut c_void)
        .collect();
    if pdl || cluster > 1 {
        // SAFETY: all-zero is a valid launch attribute; the ids and values set below select
        // programmatic stream serialization, which every kernel of the module supports
        // (`pdl_wait` in `kernels/common.cuh` before it reads earlier kernels' results), and
        // the cluster shape the kernel was written for, and a cluster scheduling preference
        // (a hint: the blocks and their shapes are the same whichever policy places them).
        let mut attrs: [sys::CUlaunchAttribute; 3] = unsafe { std::mem::zeroed() };
        let mut count = 0;
        if pdl {
            attrs[count].id =
                sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
            attrs[count].value.programmaticStreamSerializationAllowed = 1;
            count += 1;
        }
        if cluster > 1 {
            attrs[count].id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION;
            attrs[count].value.clusterDim = sys::CUlaunchAttributeValue_union__bindgen_ty_1 {
                x: cluster,
                y: 1,
                z: 1,
            };
            count += 1;
            if let Some(policy) = m.cluster_policy {
                attrs[count].id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_CLUSTER_SCHEDULING_POLICY_PREFERENCE;
                attrs[count].value.clusterSchedulingPolicyPreference = policy;
                count += 1;
            }
        }
        let cfg = sys::CUlaunchConfig {
            gridDimX: grid[0],
            gridDimY: grid[1],
            gridDimZ: grid[2],
            blockDimX: block,
            blockDimY: 1,
            blockDimZ: 1,
            sharedMemBytes: smem,
            hStream: stream.cu_stream(),
            attrs: attrs.as_mut_ptr(),
            numAttrs: count as u32,
        };
        // SAFETY: as for `launch_kernel` below; `cfg` and `attrs` outlive the call.
        return unsafe {
            sys::cuLaunchKernelEx(
                &cfg,
                m.function(kernel),
                ptrs.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        }
        .result()
        .map_err(|e| cuda_err(&format!("launching kernel #{}", kernel.0), e));
    }
    // SAFETY: every kernel parameter is 8 bytes (pointer, long) or 4 bytes (int, float) and
    // each argument word holds the value in its low bytes (little-endian), so a pointer to the
    // word is a pointer to the parameter. The typed launchers built `args` to match the
    // kernel's signature and checked the buffer sizes.
    unsafe {
        result::launch_kernel(
            m.function(kernel),
            (grid[0], grid[1], grid[2]),
            (block, 1, 1),
            smem,
            stream.cu_stream(),
            &mut ptrs,
        )
    }
    .map_err(|e| cuda_err(&format!("launching kernel #{}", kernel.0), e))
}

fn exec(op: &Op, m: &Module, blas: &Blas, stream: &Arc<CudaStream>, pdl: bool) -> Result<()> {
    match op {
        Op::Launch {
            kernel,
            grid,
            block,
            smem,
            args,
        } => launch(m, stream, pdl, 1, *kernel, *grid, *block, *smem, args),
        Op::Cluster {
            kernel,
            grid,
            block,
            cluster,
            smem,
            args,
        } => launch(
            m, stream, pdl, *cluster, *kernel, *grid, *block, *smem, args,
        ),
        Op::Add { kernel, x, y, n } => {
            let grid = elementwise_grid(*n);
            launch(
                m,
                stream,
                pdl,
                1,
                *kernel,
                [grid, 1, 1],
                256,
                0,
                &[*x, *y, *n as u64],
            )
        }
        Op::Gemv(g) => {
            // The warp-per-row kernels take the first 13 parameters, the block-cooperative
            // ones all 17 (gain, eps, norm output, residual).
            let mut a = [0u64; 17];
            g.p.args(&mut a);
            if let Some((raw, gain, eps)) = g.norm {
                a[9] = raw;
                a[13] = gain;
                a[14] = eps as u64;
                a[15] = g.p.x;
            }
            a[16] = g.res;
            launch(
                m,
                stream,
                pdl,
                1,
                g.kernel,
                [g.blocks() as u32, 1, 1],
                GEMV_THREADS,
                m.gemv_smem(g.kernel),
                &a,
            )
        }
        Op::Gemt(g) => {
            let mut a = [0u64; 14];
            g.p.args(&mut a);
            a[13] = g.splits as u64;
            launch(
                m,
                stream,
                pdl,
                g.splits,
                g.kernel,
                [g.splits, g.tiles() as u32, 1],
                GEMV_THREADS,
                g.smem,
                &a,
            )
        }
        Op::Gemm(g) => blas.run(g),
        Op::Memset { ptr, bytes } => {
            // SAFETY: the range lies in a live allocation (recorded by `zeros`).
            unsafe { result::memset_d8_async(*ptr, 0, *bytes, stream.cu_stream()) }
                .map_err(|e| cuda_err("memset", e))
        }
        Op::Upload { ptr, data } => {
            // SAFETY: the destination holds `data.len()` bytes (the step arena was sized for
            // it); pageable host memory is staged before the call returns.
            unsafe { result::memcpy_htod_async(*ptr, data.as_slice(), stream.cu_stream()) }
                .map_err(|e| cuda_err("upload", e))
        }
    }
}

/// Blocks for a grid-stride element-wise kernel over `n` elements (fixed for a given `n`).
pub fn elementwise_grid(n: usize) -> u32 {
    n.div_ceil(256).clamp(1, 132 * 16) as u32
}

/// A pair of timing events around flushed work.
struct Timer {
    start: cudarc::driver::CudaEvent,
}

impl Timer {
    fn start(stream: &Arc<CudaStream>) -> Result<Timer> {
        let start = stream
            .context()
            .new_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))
            .map_err(|e| cuda_err("event", e))?;
        start
            .record(stream)
            .map_err(|e| cuda_err("event record", e))?;
        Ok(Timer { start })
    }

    fn stop(self, stream: &Arc<CudaStream>) -> Result<f64> {
        let end = stream
            .context()
            .new_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))
            .map_err(|e| cuda_err("event", e))?;
        end.record(stream)
            .map_err(|e| cuda_err("event record", e))?;
        let ms = self
            .start
            .elapsed_ms(&end)
            .map_err(|e| cuda_err("event timing", e))?;
        Ok(ms as f64 / 1e3)
    }
}
