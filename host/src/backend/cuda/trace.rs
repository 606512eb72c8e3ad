//! A timeline of one pass's kernels as they ran, CUDA graph and programmatic launches
//! included (`DEEPINFER_CUDA_TRACE=FILE`; a development tool, not for serving).
//!
//! The kernels are compiled with `DEEPINFER_TRACE` defined, which makes `pdl_wait` and
//! `pdl_launch_dependents` (`kernels/common.cuh`) stamp each launch's record in the module's
//! `di_trace` table from one block in 16. The queue clears the table before the
//! `DEEPINFER_CUDA_TRACE_AT`-th pass of at least [`MIN_OPS`] operations (default 40: a decode
//! step well after the graph is captured), waits for the pass, and writes one row a kernel to
//! FILE: its name, when its first and its last sampled block triggered (most kernels trigger
//! first thing, so: started), when its wait first and last returned (the first: when the
//! kernels before it had finished) and its share of the pass (the gap to the next kernel's first
//! return) and when its sampled blocks first and last reached each phase (`di_trace_phase`),
//! then the shares summed by kernel name. ncu times kernels one at a time; this shows what each
//! costs inside the pass, where launches overlap.

use std::fmt::Write as _;
use std::sync::Arc;

use cudarc::driver::{result, CudaStream};

use super::device::cuda_err;
use super::module::Module;
use super::queue::Op;
use crate::error::{Error, Result};

/// Records in the device table (`DI_TRACE_SLOTS`) and 64-bit words a record (`DI_TRACE_WORDS`).
pub const SLOTS: usize = 4096;
pub const WORDS: usize = 6 + 2 * PHASES;
/// Phase stamps a record (`DI_TRACE_PHASES`: `di_trace_phase` in long kernels).
pub const PHASES: usize = 8;
/// Passes shorter than this are not counted (uploads, sampling).
pub const MIN_OPS: usize = 40;
/// The per-block table of kernels compiled with `DI_TRACE_BLOCKS`: the first
/// `DI_TRACE_BLOCK_MAX` blocks of each record, `DI_TRACE_BLOCK_WORDS` 32-bit words a block
/// (the low bits of its trigger, wait and phase times, then its SM + 1).
pub const BLOCK_MAX: usize = 256;
pub const BLOCK_WORDS: usize = 3 + PHASES;
/// 32-bit words of that table.
const BLOCK_TABLE_WORDS: usize = SLOTS * BLOCK_MAX * BLOCK_WORDS;

/// The file to write, when tracing was asked for.
pub fn requested() -> Option<String> {
    std::env::var("DEEPINFER_CUDA_TRACE")
        .ok()
        .filter(|v| !v.is_empty())
}

/// Which pass the queue traces, and where the report goes.
pub struct Tracer {
    path: String,
    at: u64,
    seen: u64,
    /// `di_trace` on the device.
    table: u64,
    /// `di_trace_blocks` on the device, when the kernels keep it.
    blocks: Option<u64>,
}

impl Tracer {
    /// The tracer for a module compiled with tracing: `table` is its `di_trace`, of `bytes`
    /// bytes (which must be the SLOTS x WORDS words this side reads).
    pub fn new(path: String, (table, bytes): (u64, usize)) -> Result<Tracer> {
        if bytes != SLOTS * WORDS * 8 {
            return Err(Error::Cuda(format!(
                "the kernels' trace table is {bytes} bytes, expected {} ({SLOTS} records of \
                 {WORDS} words): DI_TRACE_SLOTS / DI_TRACE_WORDS in kernels/common.cuh and \
                 backend/cuda/trace.rs disagree",
                SLOTS * WORDS * 8
            )));
        }
        let at = match std::env::var("DEEPINFER_CUDA_TRACE_AT") {
            Ok(v) => v.parse::<u64>().ok().filter(|&n| n > 0).ok_or_else(|| {
                Error::BadConfig(format!(
                    "DEEPINFER_CUDA_TRACE_AT={v}: expected a pass number of 1 or more"
                ))
            })?,
            Err(_) => 40,
        };
        Ok(Tracer {
            path,
            at,
            seen: 0,
            table,
            blocks: None,
        })
    }

    /// The per-block table too (`di_trace_blocks`: address, bytes), whose stamps go to
    /// FILE.blocks ([`block_report`]).
    pub fn with_blocks(mut self, blocks: Option<(u64, usize)>) -> Result<Tracer> {
        if let Some((ptr, bytes)) = blocks {
            let want = BLOCK_TABLE_WORDS * 4;
            if bytes != want {
                return Err(Error::Cuda(format!(
                    "the kernels' per-block trace table is {bytes} bytes, expected {want}: \
                     DI_TRACE_BLOCK_MAX / DI_TRACE_BLOCK_WORDS in kernels/common.cuh and \
                     backend/cuda/trace.rs disagree"
                )));
            }
            self.blocks = Some(ptr);
        }
        Ok(self)
    }

    /// Whether the pass about to run (of `ops` operations) is the one to trace; clears the
    /// table on the stream if so. Passes after it are not counted.
    pub fn begin(&mut self, ops: usize, stream: &Arc<CudaStream>) -> Result<bool> {
        if ops < MIN_OPS || self.seen >= self.at {
            return Ok(false);
        }
        self.seen += 1;
        if self.seen < self.at {
            return Ok(false);
        }
        // SAFETY: `table` is the module's `di_trace`, SLOTS * WORDS words long.
        unsafe { result::memset_d8_async(self.table, 0, SLOTS * WORDS * 8, stream.cu_stream()) }
            .map_err(|e| cuda_err("clearing the trace table", e))?;
        if let Some(b) = self.blocks {
            // SAFETY: `b` is the module's `di_trace_blocks`, of the size `with_blocks` checked.
            unsafe { result::memset_d8_async(b, 0, BLOCK_TABLE_WORDS * 4, stream.cu_stream()) }
                .map_err(|e| cuda_err("clearing the per-block trace table", e))?;
        }
        Ok(true)
    }

    /// Waits for the traced pass `body` and writes the report.
    pub fn finish(&self, body: &[Op], m: &Module, stream: &Arc<CudaStream>) -> Result<()> {
        stream
            .synchronize()
            .map_err(|e| cuda_err("waiting for the traced pass", e))?;
        let mut words = vec![0u64; SLOTS * WORDS];
        // SAFETY: the table holds SLOTS * WORDS words; the stream is idle.
        unsafe { result::memcpy_dtoh_sync(&mut words, self.table) }
            .map_err(|e| cuda_err("reading the trace table", e))?;
        let names: Vec<&str> = body.iter().filter_map(|o| op_name(o, m)).collect();
        let text = report(&words, &names);
        std::fs::write(&self.path, text).map_err(|e| Error::io(&self.path, e))?;
        tracing::info!("kernel trace written to {}", self.path);
        if let Some(b) = self.blocks {
            let mut stamps = vec![0u32; BLOCK_TABLE_WORDS];
            // SAFETY: the table holds that many words; the stream is idle.
            unsafe { result::memcpy_dtoh_sync(&mut stamps, b) }
                .map_err(|e| cuda_err("reading the per-block trace table", e))?;
            let path = format!("{}.blocks", self.path);
            std::fs::write(&path, block_report(&words, &stamps, &names))
                .map_err(|e| Error::io(&path, e))?;
            tracing::info!("per-block trace written to {path}");
        }
        Ok(())
    }
}

/// The kernel an operation launches (none for copies and memsets; cuBLAS names none).
fn op_name<'a>(op: &Op, m: &'a Module) -> Option<&'a str> {
    match op {
        Op::Launch { kernel, .. } | Op::Cluster { kernel, .. } | Op::Add { kernel, .. } => {
            Some(m.name(*kernel))
        }
        Op::Gemv(g) => Some(m.name(g.kernel)),
        Op::Gemt(g) => Some(m.name(g.kernel)),
        Op::Gemm(_) => Some("(cublas)"),
        Op::Memset { .. } | Op::Upload { .. } => None,
    }
}

/// One launch as the table recorded it (times in ns).
struct Rec {
    key: u64,
    blocks: u64,
    threads: u64,
    start: u64,
    /// The latest block's trigger (its start where the kernel triggers first thing).
    start_last: u64,
    wait: Option<u64>,
    wait_last: u64,
    /// The latest time each phase was reached (0: never).
    phases: [u64; PHASES],
    /// The earliest time each phase was reached.
    phases_first: [Option<u64>; PHASES],
}

/// The table's records (`words`) in launch order, each with its slot.
fn launches(words: &[u64]) -> Vec<(usize, Rec)> {
    let mut recs: Vec<(usize, Rec)> = words
        .chunks_exact(WORDS)
        .enumerate()
        .filter(|(_, r)| r[0] != 0)
        .map(|(slot, r)| {
            (
                slot,
                Rec {
                    key: r[0],
                    blocks: r[1] >> 32,
                    threads: r[1] & 0xffff_ffff,
                    start: !r[2],
                    start_last: r[3],
                    wait: (r[4] != 0).then_some(!r[4]),
                    wait_last: r[5],
                    phases: std::array::from_fn(|k| r[6 + k]),
                    phases_first: std::array::from_fn(|k| {
                        let w = r[6 + PHASES + k];
                        (w != 0).then_some(!w)
                    }),
                },
            )
        })
        .collect();
    recs.sort_by_key(|(_, r)| r.key);
    recs
}

/// The per-block stamps (`stamps`, the `di_trace_blocks` table) of the pass's launches:
/// one line a block that stamped, in launch order, its trigger, wait and phases in µs after
/// the launch's first wait (its first trigger where none waited), from the times' low 32
/// bits (a pass is far shorter than their 4.29 s wrap).
fn block_report(words: &[u64], stamps: &[u32], names: &[&str]) -> String {
    let mut out = String::from(
        "# launch kernel block sm trigger_us wait_us p0..p7_us (- where not stamped)\n",
    );
    for (i, (slot, r)) in launches(words).iter().enumerate() {
        let name = names.get(i).copied().unwrap_or("?");
        let mark = r.wait.unwrap_or(r.start) as u32;
        for b in 0..(r.blocks as usize).min(BLOCK_MAX) {
            let at = (slot * BLOCK_MAX + b) * BLOCK_WORDS;
            let Some(e) = stamps.get(at..at + BLOCK_WORDS) else {
                break;
            };
            if e[BLOCK_WORDS - 1] == 0 {
                continue;
            }
            let _ = write!(out, "{i} {name} {b} {}", e[BLOCK_WORDS - 1] - 1);
            for &t in &e[..BLOCK_WORDS - 1] {
                if t == 0 {
                    out.push_str(" -");
                } else {
                    let _ = write!(out, " {:.2}", t.wrapping_sub(mark) as i32 as f64 / 1e3);
                }
            }
            out.push('\n');
        }
    }
    out
}

/// The report of a table (`words`) for the pass's kernels in launch order (`names`).
fn report(words: &[u64], names: &[&str]) -> String {
    let recs: Vec<Rec> = launches(words).into_iter().map(|(_, r)| r).collect();
    let mut out = String::new();
    let _ = writeln!(
        out,
        "# {} launches recorded, {} kernels in the pass{}",
        recs.len(),
        names.len(),
        if recs.len() == names.len() {
            ""
        } else {
            " (counts differ: names may be misaligned)"
        }
    );
    let Some(t0) = recs.iter().map(|r| r.start).min() else {
        return out;
    };
    let us = |t: u64| t.saturating_sub(t0) as f64 / 1e3;
    // A kernel's share: from its first wait return (else its start) to the next one's.
    let mark = |r: &Rec| r.wait.unwrap_or(r.start);
    let end = recs
        .iter()
        .map(|r| {
            r.phases
                .iter()
                .fold(r.wait_last.max(r.start), |a, &p| a.max(p))
        })
        .max()
        .unwrap_or(t0);
    let _ = writeln!(
        out,
        "{:>4} {:<40} {:>7} {:>5} {:>9} {:>9} {:>9} {:>9} {:>8}  phases (us after the first wait: first/last block)",
        "#", "kernel", "blocks", "thr", "start_us", "slast_us", "wait_us", "wlast_us", "share_us"
    );
    let mut by_name: Vec<(String, f64, usize)> = Vec::new();
    for (i, r) in recs.iter().enumerate() {
        let next = recs.get(i + 1).map_or(end, mark);
        let share = next.saturating_sub(mark(r)) as f64 / 1e3;
        let name = names.get(i).copied().unwrap_or("?");
        let phases: String = r
            .phases
            .iter()
            .enumerate()
            .filter(|(_, &p)| p != 0)
            .map(|(k, &p)| {
                // µs after the launch's mark
                let after = |t: u64| (t as i64 - mark(r) as i64) as f64 / 1e3;
                match r.phases_first[k] {
                    Some(f) if f < p => format!(" p{k} {:+.2}/{:+.2}", after(f), after(p)),
                    _ => format!(" p{k} {:+.2}", after(p)),
                }
            })
            .collect();
        let _ = writeln!(
            out,
            "{i:>4} {name:<40} {:>7} {:>5} {:>9.2} {:>9.2} {:>9} {:>9.2} {share:>8.2}{phases}",
            r.blocks,
            r.threads,
            us(r.start),
            us(r.start_last),
            r.wait.map_or("-".into(), |w| format!("{:.2}", us(w))),
            us(r.wait_last),
        );
        match by_name.iter_mut().find(|(n, _, _)| n == name) {
            Some(e) => {
                e.1 += share;
                e.2 += 1;
            }
            None => by_name.push((name.to_string(), share, 1)),
        }
    }
    by_name.sort_by(|a, b| b.1.total_cmp(&a.1));
    let _ = writeln!(
        out,
        "\n# shares by kernel (pass {:.1} us from the first start to the last stamp)",
        us(end)
    );
    for (n, s, c) in by_name {
        let _ = writeln!(
            out,
            "{n:<40} {c:>4} x {:>8.2} us = {s:>9.1} us",
            s / c as f64
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(words: &mut [u64], slot: usize, key: u64, start: u64, wait: Option<u64>) {
        let r = &mut words[slot * WORDS..(slot + 1) * WORDS];
        r[0] = key;
        r[1] = (8 << 32) | 256;
        r[2] = !start;
        r[3] = start;
        r[4] = wait.map_or(0, |w| !w);
        r[5] = wait.unwrap_or(0);
        // phase 1 half a microsecond after the first wait (one block)
        r[7] = wait.map_or(0, |w| w + 500);
        r[7 + PHASES] = wait.map_or(0, |w| !(w + 500));
    }

    #[test]
    fn block_stamps_are_listed_by_launch_block_and_sm_after_the_first_wait() {
        let mut words = vec![0u64; SLOTS * WORDS];
        // launched second (larger key) but in the lower slot, and launched first
        rec(&mut words, 3, 20, 5_000, Some(6_000));
        rec(&mut words, 9, 10, 1_000, None);
        let mut stamps = vec![0u32; BLOCK_TABLE_WORDS];
        let set = |stamps: &mut [u32], slot: usize, b: usize, field: usize, v: u32| {
            stamps[(slot * BLOCK_MAX + b) * BLOCK_WORDS + field] = v;
        };
        // slot 3 (launch 1), block 2 on SM 7: waited at the mark, phase 1 2.5 µs later
        set(&mut stamps, 3, 2, 1, 6_000);
        set(&mut stamps, 3, 2, 3, 8_500);
        set(&mut stamps, 3, 2, BLOCK_WORDS - 1, 8);
        // slot 9 (launch 0, no wait: times after its start), block 0 on SM 0, triggered 0.25
        // µs after; block 1 never stamped
        set(&mut stamps, 9, 0, 0, 1_250);
        set(&mut stamps, 9, 0, BLOCK_WORDS - 1, 1);
        let text = block_report(&words, &stamps, &["first", "second"]);
        let lines: Vec<&str> = text.lines().skip(1).collect();
        assert_eq!(
            lines,
            [
                "0 first 0 0 0.25 - - - - - - - - -",
                "1 second 2 7 - 0.00 - 2.50 - - - - - -"
            ]
        );
    }

    #[test]
    fn shares_are_gaps_between_first_waits_in_launch_order() {
        let mut w = vec![0u64; 8 * WORDS];
        // launched in key order 5, 6, 7 (slots out of order)
        rec(&mut w, 3, 6, 1_500, Some(4_000));
        rec(&mut w, 1, 5, 1_000, Some(1_000));
        rec(&mut w, 6, 7, 2_000, Some(9_000));
        let r = report(&w, &["a", "b", "a"]);
        let lines: Vec<&str> = r.lines().collect();
        assert!(
            lines[0].starts_with("# 3 launches recorded, 3 kernels"),
            "{r}"
        );
        // a: 1.0 -> 4.0 us, b: 4.0 -> 9.0 us, a again: 9.0 -> 9.5 (its last phase stamp)
        assert!(
            lines[2].contains(" a ") && lines[2].trim_end().ends_with("3.00 p1 +0.50"),
            "{r}"
        );
        assert!(
            lines[3].contains(" b ") && lines[3].trim_end().ends_with("5.00 p1 +0.50"),
            "{r}"
        );
        let sum = |n: &str| {
            r.lines()
                .skip_while(|l| !l.starts_with("# shares"))
                .find(|l| l.split_whitespace().next() == Some(n))
                .map(|l| l.split_whitespace().collect::<Vec<_>>().join(" "))
        };
        assert_eq!(sum("b").as_deref(), Some("b 1 x 5.00 us = 5.0 us"), "{r}");
        assert_eq!(sum("a").as_deref(), Some("a 2 x 1.75 us = 3.5 us"), "{r}");
    }

    #[test]
    fn a_phase_reached_at_two_times_shows_the_first_and_the_last_block() {
        let mut w = vec![0u64; 2 * WORDS];
        rec(&mut w, 0, 5, 1_000, Some(2_000));
        // phase 3: the first block at +0.25 us, the last at +1.75 us
        w[6 + 3] = 3_750;
        w[6 + PHASES + 3] = !2_250;
        let r = report(&w, &["a"]);
        let line = r.lines().nth(2).unwrap();
        assert!(line.contains(" p1 +0.50 p3 +0.25/+1.75"), "{r}");
    }

    #[test]
    fn the_last_blocks_trigger_and_wait_are_shown_after_the_first() {
        let mut w = vec![0u64; 2 * WORDS];
        rec(&mut w, 0, 5, 1_000, Some(2_000));
        // the last sampled block triggered at 1.4 us and returned from its wait at 3.1 us
        w[3] = 1_400;
        w[5] = 3_100;
        let r = report(&w, &["a"]);
        let cols: Vec<&str> = r.lines().nth(2).unwrap().split_whitespace().collect();
        // #, kernel, blocks, threads, start, last start, wait, last wait (us after the start)
        assert_eq!(&cols[4..8], ["0.00", "0.40", "1.00", "2.10"], "{r}");
    }

    #[test]
    fn a_table_of_another_size_is_an_error() {
        let e = Tracer::new("t.txt".into(), (0, SLOTS * 6 * 8))
            .err()
            .unwrap();
        assert!(e.to_string().contains("DI_TRACE_WORDS"), "{e}");
        assert!(Tracer::new("t.txt".into(), (0, SLOTS * WORDS * 8)).is_ok());
        let t = Tracer::new("t.txt".into(), (0, SLOTS * WORDS * 8)).unwrap();
        let e = t
            .with_blocks(Some((0, 12)))
            .err()
            .expect("a per-block table of 12 bytes");
        assert!(e.to_string().contains("DI_TRACE_BLOCK_MAX"), "{e}");
    }

    #[test]
    fn mismatched_counts_are_said() {
        let mut w = vec![0u64; 4 * WORDS];
        rec(&mut w, 0, 1, 0, None);
        let r = report(&w, &[]);
        assert!(r.contains("counts differ"), "{r}");
        assert!(r.contains(" ? "), "{r}");
    }
}
