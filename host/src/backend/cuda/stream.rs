//! `deepinfer bench stream`: the rate at which one launch reads a buffer several times the
//! L2's size by each path the weight streams take (`kernels/stream.cu`): 16-byte loads into
//! registers, and rings of shared-memory pages of several sizes and depths filled by bulk
//! copies (as `moe_ffn1` streams its units), by the lanes' `cp.async` copies, or both. The
//! ceiling each path reaches on the machine is what the kernels' phases are measured against
//! (doc/benchmarks.md). The latency probe times a chain of L2 round trips in every block
//! while 7 of its 8 warps stream through rings of each depth: what a grid-wide wait's loads
//! cost behind the copies a launch keeps in flight.

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
        let mut points = Vec::new();
        inner.flush()?;
        inner.sync()?;
        let mut measure =
            |mut p: StreamPoint, op: &dyn Fn() -> Op| -> Result<()> {
                for r in 0..=repeats {
                    let before = inner.queue().stats.device_s;
                    inner.push(op());
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
                    }
                }
                points.push(p);
                Ok(())
            };
        inner.queue().timing = true;
        let ldg = StreamPoint {
            path: "ldg",
            unit: 0,
            pages: 0,
            mode: 0,
            // 8 loads of 16 bytes a thread, 8 blocks an SM (the grid is one wave of them)
            in_flight: 8 * 8 * 16 * THREADS as usize,
            seconds: Vec::new(),
            bytes,
            round_trip_ns: Vec::new(),
        };
        let (src, out) = (buf.ptr(), sink.ptr());
        let result = (|| {
            measure(ldg, &|| Op::Launch {
                kernel: m.stream_ldg,
                grid: [sms * 8, 1, 1],
                block: THREADS,
                smem: 0,
                args: vec![src, (bytes / 16) as u64, out],
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
                        let p = StreamPoint {
                            path: "ring",
                            unit,
                            pages: ppw,
                            mode,
                            in_flight: smem,
                            seconds: Vec::new(),
                            bytes,
                            round_trip_ns: Vec::new(),
                        };
                        measure(p, &|| ring_op(bytes, unit, ppw, mode, [0, 0]))?;
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
                let p = StreamPoint {
                    path: "lat",
                    unit: LAT_UNIT,
                    pages: ppw,
                    mode: LAT_MODE,
                    in_flight: (WARPS - 1) * ppw * LAT_UNIT,
                    seconds: Vec::new(),
                    bytes: streamed,
                    round_trip_ns: Vec::new(),
                };
                let probe = [chase.ptr(), lat.ptr()];
                measure(p, &|| {
                    ring_op(streamed, LAT_UNIT, ppw.max(1), LAT_MODE, probe)
                })?;
            }
            Ok(())
        })();
        inner.queue().timing = false;
        result.map(|()| points)
    }
}

/// The median over blocks of nanoseconds a round trip from the latency probe's (ns, trips)
/// pairs (blocks that made none left out).
fn median_round_trip(pairs: &[u64]) -> f64 {
    let mut v: Vec<f64> = pairs
        .chunks_exact(2)
        // (the high half of a block's second word is where its chain ended)
        .map(|p| (p[0], p[1] & 0xffff_ffff))
        .filter(|&(_, trips)| trips > 0)
        .map(|(ns, trips)| ns as f64 / trips as f64)
        .collect();
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

#[cfg(test)]
mod tests {
    use super::median_round_trip;

    #[test]
    fn round_trips_are_the_median_block_and_blocks_without_trips_are_left_out() {
        // blocks: 600 ns / 2 trips, 4000 / 8, 1200 / 2, and one that made none
        let m = median_round_trip(&[600, 2, 4000, 8 | 96 << 32, 1200, 2, 0, 0]);
        assert_eq!(m, 500.0);
        assert!(median_round_trip(&[0, 0]).is_nan());
    }
}
