//! `deepinfer bench stream`: the rate at which one launch reads a buffer several times the
//! L2's size by each path the weight streams take (`kernels/stream.cu`): 16-byte loads into
//! registers, and rings of shared-memory pages of several sizes and depths filled by bulk
//! copies (as `moe_ffn1` streams its units), by the lanes' `cp.async` copies, or both. The
//! ceiling each path reaches on the machine is what the kernels' phases are measured against
//! (doc/benchmarks.md). The latency probe times a chain of L2 round trips in every block
//! while 7 of its 8 warps stream through rings of each depth: what a grid-wide wait's loads
//! cost behind the copies a launch keeps in flight. The chain probe asks what a persistent
//! step launch could stream: a Moonlight layer's weight rows as a chain of dependent GEMVs in
//! one resident launch, one warp a block copying ahead across the phases' boundaries.

use super::queue::Op;
use super::CudaBackend;
use crate::error::{Error, Result};

/// Threads of a probe block (`STREAM_THREADS`).
const THREADS: u32 = 256;
/// Warps of a ring probe block, each owning its pages.
const WARPS: usize = 8;
/// Most ring pages a warp (`STREAM_MAXP` / 8).
const MAX_PPW: usize = 8;
/// Page size of the latency probe's rings (`moe_ffn1`'s on the Moonlight shape).
const LAT_UNIT: usize = 8 * 1024;
/// Fill of the latency probe's rings (`mixed`, `moe_ffn1`'s).
const LAT_MODE: usize = 2;
/// How a ring page is filled, by [`StreamPoint::mode`].
pub const FILLS: [&str; 5] = ["bulk", "bulk2", "mixed", "lanes", "split"];

/// One path's measured rate.
#[derive(Debug, Clone)]
pub struct StreamPoint {
    /// `ldg` (registers) or `ring` (pages of shared memory).
    pub path: &'static str,
    /// Bytes a ring page (0 for `ldg`).
    pub unit: usize,
    /// Ring pages a warp (0 for `ldg`).
    pub pages: usize,
    /// How a ring page is filled (`kernels/stream.cu`): 0, one bulk copy; 1, two bulk
    /// copies of a half; 2, a half by a bulk copy and a half by the warp's lanes' `cp.async`
    /// copies; 3, all by the lanes' `cp.async` copies; 4, two bulk copies of a half from the
    /// buffer's two halves (a gate row and an up row from two matrices).
    pub mode: usize,
    /// Bytes an SM has asked for and not yet read, at most (the ring's size; `ldg`: 8 loads
    /// of 16 bytes a thread of 8 blocks).
    pub in_flight: usize,
    /// Device seconds of each measured launch.
    pub seconds: Vec<f64>,
    /// `lat` (the latency probe): bytes the launch streamed (0: the round trips alone).
    pub bytes: usize,
    /// `lat`: each measured launch's median over blocks of the nanoseconds an L2 round trip
    /// took while the block's other warps streamed.
    pub round_trip_ns: Vec<f64>,
    /// `chain`: the shape (`chain_phases`: `free`, `dense`, or `moe/` and the attention's
    /// round trips, with `+` and `r`, `k` or `g` for the meetings cut ([`ChainCuts`]); `+own`
    /// where each warp copies its own pages, `mode` a warp; `+l2/N`
    /// where the copying lane asks N pages beyond the ring into L2) and its
    /// layers (empty and 0 otherwise).
    pub variant: String,
    pub layers: usize,
    /// `chain`: each measured launch's median over blocks of the share of the launch thread 0
    /// waited for its phases' inputs, warp 0 for its pages, and the copying lane for a free
    /// page (0 where the warps copy their own).
    pub waits: Vec<[f64; 3]>,
}

impl StreamPoint {
    /// A point of `path` before its launches, with no latency or chain fields.
    fn new(
        path: &'static str,
        unit: usize,
        pages: usize,
        mode: usize,
        in_flight: usize,
        bytes: usize,
    ) -> Self {
        StreamPoint {
            path,
            unit,
            pages,
            mode,
            in_flight,
            seconds: Vec::new(),
            bytes,
            round_trip_ns: Vec::new(),
            variant: String::new(),
            layers: 0,
            waits: Vec::new(),
        }
    }
}

/// Bytes a page of the chain probe (two rows of [`CHAIN_K`] bf16).
const CHAIN_PAGE: usize = 8192;
/// Elements a row of the chain probe (`CHAIN_K`).
pub const CHAIN_K: usize = 2048;
/// Threads of a chain block: 8 computing warps and the copying warp (`CHAIN_THREADS`).
const CHAIN_THREADS: u32 = 288;
/// Most ring pages a chain block (`CHAIN_MAXP`).
const CHAIN_MAXP: usize = 32;
/// Fields of a phase in `stream_chain`'s table (`CHAIN_FIELDS`).
const CHAIN_FIELDS: usize = 8;
/// Most groups a phase (`CHAIN_MAXG`).
const CHAIN_MAXG: usize = 8;
/// MoE layers of the chain probe (Moonlight's 27 less the dense first).
pub const CHAIN_LAYERS: usize = 26;

/// One phase of the chain probe (`stream_chain`'s fields).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChainPhase {
    /// Rows of [`CHAIN_K`] bf16 (even), 0 for a latency stage.
    pub rows: usize,
    /// The phase whose outputs are this one's input (`None`: the first).
    pub dep: Option<usize>,
    /// A phase the copies of this one's rows wait for (a routing), if any.
    pub gate: Option<usize>,
    /// Dependent L2 round trips each block makes before counting the phase done.
    pub trips: usize,
    /// Words each block adds into one shared output (`red.global.add.u64`, integer sums
    /// whose order does not change them) before counting the phase done: a product split by
    /// its input's rows, its partial sums met by the adds instead of a meeting and a pass.
    pub red: usize,
    /// Equal groups of the phase's units (experts) counted apart, so a phase of as many groups
    /// that depends on this one waits only for the groups its own share touches (0: none).
    pub groups: usize,
}

/// Meetings of the `moe` shapes a persistent step could do without (each a grid-wide wait
/// less a layer, or a smaller one), named in the probe's rows by `+` and `r`, `k` or `g`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ChainCuts {
    /// The router's rows in o's phase: its logits taken as o's partial sums (the router
    /// folded through o's weights and the residual's own part), so the routed rows wait for
    /// o's count, and the router's phase and meeting are gone.
    pub router: bool,
    /// The experts' down product split by expert row (`moe_fk1`'s units: a gate row, an up
    /// row and a down row after one another), so gate/up and down are one phase with no
    /// meeting between them, each block adding its partial sums of the layer's output into
    /// one buffer by integer adds ([`ChainPhase::red`]: [`CHAIN_K`] words).
    pub split: bool,
    /// The experts' down rows waiting only for their own expert's gate/up rows (a meeting of
    /// the blocks that computed them, [`ChainPhase::groups`]), not for the grid's.
    pub group: bool,
}

impl ChainCuts {
    /// The cuts a row's tag names (`r`, `k`, `g`; any order).
    fn from_tag(tag: &str) -> Self {
        ChainCuts {
            router: tag.contains('r'),
            split: tag.contains('k'),
            group: tag.contains('g'),
        }
    }

    /// The row's tag: `+` and the cuts' letters, or empty for none.
    fn tag(self) -> String {
        let cut: String = [(self.router, 'r'), (self.split, 'k'), (self.group, 'g')]
            .iter()
            .filter(|c| c.0)
            .map(|c| c.1)
            .collect();
        if cut.is_empty() {
            cut
        } else {
            format!("+{cut}")
        }
    }
}

/// The chain probe's phases for `layers` Moonlight MoE layers, as rows of 2,048 bf16 (a
/// layer's 162 MB of weights). `trips: None` (`dense`): four products each taking the one
/// before as its input (q/kv_a 3,648 rows, o 2,048, the 8 experts' gate/up 22,528, their down
/// 11,264). `Some(t)` (`moe/t`): the layer's dependencies — the attention a stage of `t`
/// round trips after q/kv_a, o after it; the router (64 rows) and the shared experts' gate/up
/// (5,632) from o's output; the routed experts' gate/up (16,896), whose rows are copied only
/// once the router is done; their down after every gate/up; the next layer's q/kv_a after the
/// down.
#[cfg(test)]
fn chain_phases(layers: usize, trips: Option<usize>) -> Vec<ChainPhase> {
    chain_shape(layers, trips, true, ChainCuts::default())
}

/// `chain_phases`, or with `linked` false the dense chain's rows with no phase waiting for
/// another (`free`: what the launch's copies and products stream without the meetings); the
/// `moe` shapes with `cuts`' meetings left out.
fn chain_shape(
    layers: usize,
    trips: Option<usize>,
    linked: bool,
    cuts: ChainCuts,
) -> Vec<ChainPhase> {
    if !linked {
        let unlink = |p: ChainPhase| ChainPhase { dep: None, ..p };
        return chain_shape(layers, None, true, cuts)
            .into_iter()
            .map(unlink)
            .collect();
    }
    let mut v: Vec<ChainPhase> = Vec::new();
    // (rows, dep, gate, trips, red, groups)
    type P = (usize, Option<usize>, Option<usize>, usize, usize, usize);
    let mut push = |(rows, dep, gate, trips, red, groups): P| {
        v.push(ChainPhase {
            rows,
            dep,
            gate,
            trips,
            red,
            groups,
        });
        v.len() - 1
    };
    let mut last: Option<usize> = None;
    for _ in 0..layers {
        let qkv = push((3648, last, None, 0, 0, 0));
        last = Some(match trips {
            None => {
                let o = push((2048, Some(qkv), None, 0, 0, 0));
                let gu = push((22528, Some(o), None, 0, 0, 0));
                push((11264, Some(gu), None, 0, 0, 0))
            }
            Some(t) => {
                let attn = push((0, Some(qkv), None, t, 0, 0));
                let (o, router) = if cuts.router {
                    let o = push((2048 + 64, Some(attn), None, 0, 0, 0));
                    (o, o)
                } else {
                    let o = push((2048, Some(attn), None, 0, 0, 0));
                    (o, push((64, Some(o), None, 0, 0, 0)))
                };
                if cuts.split {
                    // the shared experts' units, then the routed experts' (2 of 8 down rows
                    // shared), the partial sums added once at the end
                    push((5632 + 2816, Some(o), None, 0, 0, 0));
                    push((16896 + 8448, Some(o), Some(router), 0, CHAIN_K, 0))
                } else if cuts.group {
                    // each expert's down rows after its own gate/up rows: the shared experts'
                    // (2 groups), then the routed experts' (6)
                    let sgu = push((5632, Some(o), None, 0, 0, 2));
                    let rgu = push((16896, Some(o), Some(router), 0, 0, 6));
                    push((2816, Some(sgu), None, 0, 0, 2));
                    push((8448, Some(rgu), None, 0, 0, 6))
                } else {
                    push((5632, Some(o), None, 0, 0, 0));
                    let routed = push((16896, Some(o), Some(router), 0, 0, 0));
                    push((11264, Some(routed), None, 0, 0, 0))
                }
            }
        });
    }
    v
}

/// `stream_chain`'s phase table: per phase rows, dep, gate, trips (-1 for none), the first
/// output's index, the first page's index (in the order the phases come), the words added
/// at its end and its groups; then per phase [`CHAIN_MAXG`] counts, how many of `blocks`
/// blocks' shares touch each of its groups (what a phase waiting on its groups waits for,
/// counted here so the kernel walks no other block's share).
fn chain_table(phases: &[ChainPhase], blocks: usize) -> Vec<i32> {
    let (mut y0, mut u0) = (0usize, 0usize);
    let opt = |o: Option<usize>| o.map_or(-1, |v| v as i32);
    let mut t = Vec::with_capacity(phases.len() * (CHAIN_FIELDS + CHAIN_MAXG));
    for p in phases {
        t.extend([p.rows as i32, opt(p.dep), opt(p.gate), p.trips as i32]);
        t.extend([y0 as i32, u0 as i32, p.red as i32, p.groups as i32]);
        y0 += p.rows;
        u0 += p.rows * CHAIN_K * 2 / CHAIN_PAGE;
    }
    for p in phases {
        let mut need = [0i32; CHAIN_MAXG];
        // (the kernel's `chain_share` and `chain_groups`, in the same integer steps)
        let (n, ng) = (p.rows / 2, p.groups.min(CHAIN_MAXG));
        if ng > 0 && n > 0 {
            for b in 0..blocks {
                let (a, e) = (n * b / blocks, n * (b + 1) / blocks);
                if a < e {
                    for g in need.iter_mut().take((e - 1) * ng / n + 1).skip(a * ng / n) {
                        *g += 1;
                    }
                }
            }
        }
        t.extend(need);
    }
    t
}

impl CudaBackend {
    /// Reads `bytes` of device memory `repeats` times (after one unmeasured launch) by each
    /// path: 16-byte loads into registers, and on sm_90+ bulk copies into rings of `units`-byte
    /// pages, 1 to 8 a warp where they fit in shared memory, each page filled each of the
    /// [`FILLS`] ways; then the latency probe (`lat`): L2 round trips timed with nothing
    /// streaming, then behind rings of 8 KiB pages filled the `mixed` way, 1 to 8 a warp where
    /// they fit.
    pub fn stream_probe(
        &self,
        bytes: usize,
        units: &[usize],
        repeats: usize,
    ) -> Result<Vec<StreamPoint>> {
        let inner = &self.inner;
        let m = &inner.module;
        if bytes < 1 << 20 || !bytes.is_multiple_of(1 << 16) {
            return Err(Error::BadConfig(format!(
                "stream probe: {bytes} bytes; expected a multiple of 64 KiB, at least 1 MiB"
            )));
        }
        if let Some(&u) = units
            .iter()
            .find(|&&u| u < 1024 || !u.is_multiple_of(1024) || u > 64 * 1024)
        {
            return Err(Error::BadConfig(format!(
                "stream probe: a page of {u} bytes; expected a multiple of 1 KiB from 1 to 64 KiB"
            )));
        }
        let buf = inner.scratch(bytes, 1)?;
        let sink = inner.scratch(1, 4)?;
        let sms = m.sms as u32;
        // the latency probe's 16 KB a block and its (ns, trips) a block
        let chase = inner.scratch(m.sms * 16 * 1024, 16)?;
        let lat = inner.scratch(m.sms * 16, 16)?;
        // the chain probe's four times a block
        let stat = inner.scratch(m.sms * 4, 8)?;
        let mut points = Vec::new();
        inner.flush()?;
        inner.sync()?;
        let mut measure =
            |mut p: StreamPoint, ops: &dyn Fn() -> Vec<Op>| -> Result<()> {
                for r in 0..=repeats {
                    let before = inner.queue().stats.device_s;
                    for op in ops() {
                        inner.push(op);
                    }
                    inner.flush()?;
                    inner.sync()?;
                    let after = inner.queue().stats.device_s;
                    if r > 0 {
                        p.seconds.push(after - before);
                        if p.path == "lat" {
                            p.round_trip_ns.push(median_round_trip(
                                &super::sample::download::<u64>(inner, lat.ptr(), 2 * m.sms)?,
                            ));
                        }
                        if p.path == "chain" {
                            p.waits.push(wait_shares(&super::sample::download::<u64>(
                                inner,
                                stat.ptr(),
                                4 * m.sms,
                            )?));
                        }
                    }
                }
                points.push(p);
                Ok(())
            };
        inner.queue().timing = true;
        // 8 loads of 16 bytes a thread, 8 blocks an SM (the grid is one wave of them)
        let ldg = StreamPoint::new("ldg", 0, 0, 0, 8 * 8 * 16 * THREADS as usize, bytes);
        let (src, out) = (buf.ptr(), sink.ptr());
        let result = (|| {
            measure(ldg, &|| {
                vec![Op::Launch {
                    kernel: m.stream_ldg,
                    grid: [sms * 8, 1, 1],
                    block: THREADS,
                    smem: 0,
                    args: vec![src, (bytes / 16) as u64, out],
                }]
            })?;
            let Some((ring, max_smem)) = m.stream_ring else {
                return Ok(());
            };
            // a ring launch streaming `streamed` bytes; `probe`: the latency probe's chase
            // and result buffers, or zeros
            let ring_op =
                |streamed: usize, unit: usize, ppw: usize, mode: usize, probe: [u64; 2]| {
                    let args = [streamed, unit, ppw, mode].map(|v| v as u64);
                    Op::Launch {
                        kernel: ring,
                        grid: [sms, 1, 1],
                        block: THREADS,
                        smem: (WARPS * ppw * unit) as u32,
                        args: [&[src][..], &args, &[out], &probe].concat(),
                    }
                };
            for &unit in units {
                for ppw in 1..=MAX_PPW {
                    let smem = WARPS * ppw * unit;
                    if smem > max_smem as usize {
                        break;
                    }
                    for mode in 0..FILLS.len() {
                        let p = StreamPoint::new("ring", unit, ppw, mode, smem, bytes);
                        measure(p, &|| vec![ring_op(bytes, unit, ppw, mode, [0, 0])])?;
                    }
                }
            }
            // the latency probe: nothing streaming (ppw 0), then 1 to 8 pages a warp where they fit
            for ppw in 0..=MAX_PPW {
                let smem = WARPS * ppw.max(1) * LAT_UNIT;
                if smem > max_smem as usize {
                    break;
                }
                let streamed = if ppw == 0 { 0 } else { bytes };
                let in_flight = (WARPS - 1) * ppw * LAT_UNIT;
                let p = StreamPoint::new("lat", LAT_UNIT, ppw, LAT_MODE, in_flight, streamed);
                let probe = [chase.ptr(), lat.ptr()];
                measure(p, &|| {
                    vec![ring_op(streamed, LAT_UNIT, ppw.max(1), LAT_MODE, probe)]
                })?;
            }
            // and behind shallower rings (one page of 2 or 4 KiB a warp: 14 or 28 KiB in flight
            // an SM), whether a round trip shortens with less queued while the rate holds
            for unit in [2048, 4096] {
                let p = StreamPoint::new("lat", unit, 1, LAT_MODE, (WARPS - 1) * unit, bytes);
                let probe = [chase.ptr(), lat.ptr()];
                measure(p, &|| vec![ring_op(bytes, unit, 1, LAT_MODE, probe)])?;
            }
            // the chain probe: the free and dense chains, then the layer's dependencies with
            // the attention 0, 8 and 24 round trips long, each by the copying lane and some
            // by the warps' own copies or with pages asked ahead into L2
            let Some((chain, chain_smem)) = m.stream_chain else {
                return Ok(());
            };
            let most = (chain_smem as usize / CHAIN_PAGE)
                .saturating_sub(1)
                .min(CHAIN_MAXP);
            if most < 2 {
                return Ok(());
            }
            // the integer sums of the `+k` rows' split products (one output all layers share)
            let red = inner.scratch(CHAIN_K, 8)?;
            // (shape, ring pages of the block, pages a warp where the warps copy their own,
            // pages further on the copying lane asks into L2, meetings cut)
            let none = ChainCuts::default();
            let cuts = ChainCuts::from_tag;
            let (r, k, g, rk, rg) = (cuts("r"), cuts("k"), cuts("g"), cuts("rk"), cuts("rg"));
            let variants = [
                (None, false, most, 0, 0, none),
                (None, false, 24, 3, 0, none),
                (None, true, 8.min(most), 0, 0, none),
                (None, true, most, 0, 0, none),
                (None, true, 24, 3, 0, none),
                (None, true, most, 0, 16, none),
                (None, true, most, 0, 48, none),
                (Some(0), true, most, 0, 0, none),
                (Some(8), true, most, 0, 0, none),
                (Some(24), true, most, 0, 0, none),
                (Some(8), true, 24, 3, 0, none),
                (Some(8), true, most, 0, 16, none),
                (Some(8), true, most, 0, 48, none),
                (Some(8), true, most, 0, 0, r),
                (Some(8), true, most, 0, 0, k),
                (Some(8), true, most, 0, 0, rk),
                (Some(8), true, most, 0, 0, g),
                (Some(8), true, most, 0, 0, rg),
                (Some(0), true, most, 0, 0, rg),
                (Some(24), true, most, 0, 0, rg),
            ];
            // counters and outputs for the shapes with the most phases and rows
            let shapes: Vec<_> = variants
                .iter()
                .map(|&(trips, linked, _, _, _, cuts)| {
                    chain_shape(CHAIN_LAYERS, trips, linked, cuts)
                })
                .collect();
            let most_phases = shapes.iter().map(Vec::len).max().unwrap_or(0);
            let most_rows = shapes
                .iter()
                .map(|v| v.iter().map(|p| p.rows).sum::<usize>())
                .max()
                .unwrap_or(0);
            let cnt = inner.scratch(most_phases * (1 + CHAIN_MAXG), 4)?;
            let y = inner.scratch(most_rows, 4)?;
            for ((trips, linked, pages, own, l2, cuts), phases) in variants.into_iter().zip(shapes)
            {
                if pages > most {
                    continue;
                }
                let table = chain_table(&phases, sms as usize);
                let tb = inner.scratch(table.len(), 4)?;
                inner.push(Op::Upload {
                    ptr: tb.ptr(),
                    data: table.iter().flat_map(|v| v.to_le_bytes()).collect(),
                });
                let streamed = phases.iter().map(|p| p.rows).sum::<usize>() * CHAIN_K * 2;
                let mut p = StreamPoint::new(
                    "chain",
                    CHAIN_PAGE,
                    pages,
                    own,
                    pages * CHAIN_PAGE,
                    streamed,
                );
                p.variant = match (trips, linked) {
                    (_, false) => "free".to_string(),
                    (None, true) => "dense".to_string(),
                    (Some(t), true) => format!("moe/{t}{}", cuts.tag()),
                } + &if own > 0 {
                    "+own".to_string()
                } else if l2 > 0 {
                    format!("+l2/{l2}")
                } else {
                    String::new()
                };
                p.layers = CHAIN_LAYERS;
                let args = vec![
                    src,
                    bytes as u64,
                    tb.ptr(),
                    phases.len() as u64,
                    pages as u64,
                    own as u64,
                    l2 as u64,
                    y.ptr(),
                    cnt.ptr(),
                    chase.ptr(),
                    stat.ptr(),
                    red.ptr(),
                ];
                // counters, the round trips' lines and the times zeroed, then the launch (timed
                // together: the small memsets are a few µs of a launch of milliseconds)
                let (cnt_ptr, chase_ptr, cnt_bytes) =
                    (cnt.ptr(), chase.ptr(), phases.len() * (1 + CHAIN_MAXG) * 4);
                let stat_ptr = stat.ptr();
                let ops = move || {
                    vec![
                        Op::Memset {
                            ptr: cnt_ptr,
                            bytes: cnt_bytes,
                        },
                        Op::Memset {
                            ptr: chase_ptr,
                            bytes: sms as usize * 16 * 1024,
                        },
                        Op::Memset {
                            ptr: stat_ptr,
                            bytes: sms as usize * 4 * 8,
                        },
                        Op::Launch {
                            kernel: chain,
                            grid: [sms, 1, 1],
                            block: CHAIN_THREADS,
                            smem: ((pages + 1) * CHAIN_PAGE) as u32,
                            args: args.clone(),
                        },
                    ]
                };
                measure(p, &ops)?;
            }
            Ok(())
        })();
        inner.queue().timing = false;
        result.map(|()| points)
    }
}

/// The median block's value (the upper of the middle two), NaN for none.
fn median_block(mut v: Vec<f64>) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// The median over blocks of nanoseconds a round trip from the latency probe's (ns, trips)
/// pairs (blocks that made none left out).
fn median_round_trip(pairs: &[u64]) -> f64 {
    median_block(
        pairs
            .chunks_exact(2)
            // (the high half of a block's second word is where its chain ended)
            .map(|p| (p[0], p[1] & 0xffff_ffff))
            .filter(|&(_, trips)| trips > 0)
            .map(|(ns, trips)| ns as f64 / trips as f64)
            .collect(),
    )
}

/// The median over blocks of each share of the chain probe's launch (`stat`: a block's
/// launch, input, page and free-page nanoseconds; blocks with no time left out).
fn wait_shares(stat: &[u64]) -> [f64; 3] {
    std::array::from_fn(|k| {
        median_block(
            stat.chunks_exact(4)
                .filter(|b| b[0] > 0)
                .map(|b| b[k + 1] as f64 / b[0] as f64)
                .collect(),
        )
    })
}

#[cfg(test)]
mod tests {
    use super::{
        chain_phases, chain_shape, chain_table, median_round_trip, wait_shares, ChainCuts,
        CHAIN_FIELDS, CHAIN_K, CHAIN_MAXG,
    };

    #[test]
    fn wait_shares_are_each_share_of_the_median_block() {
        let s = wait_shares(&[100, 10, 20, 30, 200, 100, 0, 0, 0, 5, 5, 5, 400, 40, 40, 40]);
        assert_eq!(s, [0.1, 0.1, 0.1]);
        assert!(wait_shares(&[0, 1, 1, 1])[0].is_nan());
    }

    #[test]
    fn chain_phases_carry_a_moonlight_layer_and_its_dependencies() {
        let row = CHAIN_K * 2;
        let dense = chain_phases(2, None);
        assert_eq!(dense.len(), 8);
        let moe = chain_phases(2, Some(8));
        assert_eq!(moe.len(), 14);
        // a layer's rows: q/kv_a, o, the router, 8 experts' gate/up and down (162 MB)
        let bytes = |v: &[super::ChainPhase]| v.iter().map(|p| p.rows).sum::<usize>() * row / 2;
        assert_eq!(bytes(&moe), (3648 + 2048 + 64 + 22528 + 11264) * row);
        assert_eq!(bytes(&dense) + 64 * row, bytes(&moe));
        // `free`: the dense rows with no phase waiting for another
        let free = chain_shape(2, None, false, ChainCuts::default());
        assert_eq!(
            free.iter().map(|p| p.rows).collect::<Vec<_>>(),
            [3648, 2048, 22528, 11264].repeat(2)
        );
        assert!(free
            .iter()
            .all(|p| p.dep.is_none() && p.gate.is_none() && p.trips == 0 && p.red == 0));
        // every phase depends on an earlier one; only the routed gate/up waits to copy
        for v in [&dense, &moe] {
            assert_eq!(v[0].dep, None);
            assert!(v
                .iter()
                .enumerate()
                .skip(1)
                .all(|(i, p)| p.dep.is_some_and(|d| d < i)));
        }
        let gated: Vec<_> = moe
            .iter()
            .enumerate()
            .filter(|(_, p)| p.gate.is_some())
            .collect();
        assert_eq!(gated.len(), 2);
        let (i, p) = gated[0];
        assert_eq!((p.rows, p.gate, p.dep), (16896, Some(i - 2), Some(i - 3)));
        assert_eq!(moe[1].rows, 0);
        assert_eq!(moe[1].trips, 8);
        // the second layer's q/kv_a takes the first layer's down output
        assert_eq!(moe[7].dep, Some(6));
        // the table: outputs and pages laid one phase after another
        let t = chain_table(&moe, 132);
        let f = CHAIN_FIELDS;
        assert_eq!(t.len(), 14 * (f + CHAIN_MAXG));
        // no groups, no counts
        assert!(t[14 * f..].iter().all(|&c| c == 0));
        assert_eq!(&t[..f], &[3648, -1, -1, 0, 0, 0, 0, 0]);
        assert_eq!(&t[f..2 * f], &[0, 0, -1, 8, 3648, 1824, 0, 0]);
        assert_eq!(&t[2 * f..3 * f], &[2048, 1, -1, 0, 3648, 1824, 0, 0]);
        assert_eq!(t[5 * f + 2], 3);
        // a row's tag names its cuts and back
        for tag in ["", "+r", "+k", "+rk", "+g", "+rg"] {
            assert_eq!(ChainCuts::from_tag(tag).tag(), tag);
        }
        // the cuts: the same bytes a layer in fewer phases, each cut one meeting fewer
        let cut = |router, split, group| {
            chain_shape(
                2,
                Some(8),
                true,
                ChainCuts {
                    router,
                    split,
                    group,
                },
            )
        };
        for (router, split, group, phases) in [
            (true, false, false, 6),
            (false, true, false, 6),
            (true, true, false, 5),
            (false, false, true, 8),
            (true, false, true, 7),
        ] {
            let v = cut(router, split, group);
            assert_eq!(
                v.len(),
                2 * phases,
                "router {router} split {split} group {group}"
            );
            assert_eq!(bytes(&v), bytes(&moe));
            // the routed rows wait for o's count where the router is folded into it
            let g = v.iter().position(|p| p.gate.is_some()).unwrap();
            assert_eq!(
                v[v[g].gate.unwrap()].rows,
                if router { 2048 + 64 } else { 64 }
            );
            // a split layer's last phase adds a row of partial sums; nothing else does
            let reds: Vec<_> = v.iter().map(|p| p.red).collect();
            let last = if split { CHAIN_K } else { 0 };
            assert_eq!(reds[phases - 1], last);
            assert_eq!(reds.iter().sum::<usize>(), 2 * last);
            assert_eq!(v[phases].dep, Some(phases - 1));
            // grouped: each down phase depends on the gate/up phase of as many groups (experts),
            // whose units divide into them; nothing else is grouped
            for (i, p) in v.iter().enumerate() {
                if p.groups > 0 {
                    assert!(group);
                    assert_eq!((p.rows / 2) % p.groups, 0, "phase {i}");
                    if let Some(d) = p.dep.filter(|&d| v[d].groups > 0) {
                        assert_eq!(v[d].groups, p.groups);
                        assert_eq!(v[d].rows / p.rows, 2, "gate/up rows twice the down rows");
                    }
                }
            }
            assert_eq!(
                v.iter().filter(|p| p.groups > 0).count(),
                if group { 8 } else { 0 }
            );
            // the table's counts: for each group, the blocks whose share of the phase has a
            // unit in it (counted here unit by unit), for a grid of 132 and of 7
            for blocks in [132usize, 7] {
                let t = chain_table(&v, blocks);
                let counts = &t[v.len() * CHAIN_FIELDS..];
                for (i, p) in v.iter().enumerate() {
                    let n = p.rows / 2;
                    let want: Vec<i32> = (0..CHAIN_MAXG)
                        .map(|g| {
                            let hit = |b: usize| {
                                (n * b / blocks..n * (b + 1) / blocks)
                                    .any(|u| p.groups > 0 && u * p.groups / n == g)
                            };
                            (0..blocks).filter(|&b| hit(b)).count() as i32
                        })
                        .collect();
                    assert_eq!(&counts[CHAIN_MAXG * i..CHAIN_MAXG * (i + 1)], &want[..]);
                    if p.groups > 0 {
                        // every group's blocks, at least one each, and no more than the grid
                        assert!(want[..p.groups]
                            .iter()
                            .all(|&c| c > 0 && c as usize <= blocks));
                    }
                }
            }
        }
    }

    #[test]
    fn round_trips_are_the_median_block_and_blocks_without_trips_are_left_out() {
        // blocks: 600 ns / 2 trips, 4000 / 8, 1200 / 2, and one that made none
        let m = median_round_trip(&[600, 2, 4000, 8 | 96 << 32, 1200, 2, 0, 0]);
        assert_eq!(m, 500.0);
        assert!(median_round_trip(&[0, 0]).is_nan());
    }
}
