//! Rotary embeddings and paged attention through the same trait calls on the CPU and CUDA
//! backends: scattered block tables, grouped-query heads (groups of 1 to 16), sliding windows,
//! several sequences per step, prefill (the tensor-core kernel), chunked prefill mixed with
//! decode, and split-KV decode over long contexts.

use deepinfer::backend::cpu::CpuBackend;
use deepinfer::backend::cuda::Act;
use deepinfer::backend::{AttnParams, Backend, KvShape};
use deepinfer::model::batch::Batch;
use deepinfer::model::hparams::{RopeSpec, RopeStyle};

use super::util::{assert_close, backend, tol, upload, Rng};

/// (pos, len) of each sequence, per step.
type Plan = Vec<Vec<(usize, usize)>>;

/// Runs `plan` through one backend: per step, random Q/K/V (drawn in `data` order) go in,
/// the attention output comes out.
fn run<B: Backend>(
    be: &B,
    p: &AttnParams,
    bs: usize,
    tables: &[Vec<u32>],
    plan: &Plan,
    data: &[Vec<f32>],
) -> Vec<Vec<f32>> {
    let blocks = tables.iter().flatten().max().map_or(1, |&b| b as usize + 1);
    let mut kv = be
        .new_kv(KvShape {
            layers: 2,
            num_blocks: blocks,
            block_size: bs,
            kv_heads: p.n_kv_heads,
            head_dim: p.head_dim,
        })
        .unwrap();
    let (qw, kw) = (p.n_heads * p.head_dim, p.n_kv_heads * p.head_dim);
    let mut outs = Vec::new();
    for (si, step) in plan.iter().enumerate() {
        let mut b = Batch::default();
        for (s, &(pos, len)) in step.iter().enumerate() {
            b.push(&vec![0; len], pos, tables[s].clone(), true);
        }
        let n = b.n_tokens();
        let st = be.prepare_step(&b, bs).unwrap();
        let d = &data[si];
        let q = upload(be, n, qw, &d[..n * qw]);
        let k = upload(be, n, kw, &d[n * qw..n * (qw + kw)]);
        let v = upload(be, n, kw, &d[n * (qw + kw)..n * (qw + 2 * kw)]);
        let mut out = be.zeros(n * qw).unwrap();
        be.attention(&st, &mut kv, 1, p, &q, &k, &v, &mut out)
            .unwrap();
        outs.push(be.to_host(&out).unwrap());
    }
    outs
}

#[test]
fn paged_attention_matches_the_cpu_backend() {
    let mut rng = Rng::fresh("attention");
    let cpu = CpuBackend::new(2);
    // (heads, kv heads, head dim, window, block size)
    let shapes = [
        (8usize, 2usize, 64usize, None, 16usize),
        (12, 4, 128, Some(24), 16),
        (4, 1, 16, None, 4),
        (6, 6, 32, Some(7), 8),
        (32, 2, 64, None, 32),
        (4, 2, 256, None, 16),
        (9, 3, 64, None, 16),
    ];
    // Prefill, then chunked prefill mixed with decode, then decode, then a long decode.
    let plan: Plan = vec![
        vec![(0, 70), (0, 37), (0, 5)],
        vec![(70, 1), (37, 20), (5, 1)],
        vec![(71, 1), (57, 1), (6, 1)],
        vec![(72, 3), (58, 500), (7, 1)],
        vec![(75, 1), (558, 1), (8, 1)],
    ];
    for act in [Act::F32, Act::Bf16] {
        let Some(be) = backend(act) else { return };
        for &(h, kvh, hd, window, bs) in &shapes {
            let p = AttnParams {
                n_heads: h,
                n_kv_heads: kvh,
                head_dim: hd,
                scale: 1.0 / (hd as f32).sqrt(),
                window,
            };
            let per_seq = 600usize.div_ceil(bs);
            // Scattered tables: a random permutation of all blocks, dealt out per sequence.
            let mut ids: Vec<u32> = (0..(3 * per_seq) as u32).collect();
            for i in (1..ids.len()).rev() {
                ids.swap(i, rng.below(i + 1));
            }
            let tables: Vec<Vec<u32>> = ids.chunks(per_seq).map(|c| c.to_vec()).collect();
            let data: Vec<Vec<f32>> = plan
                .iter()
                .map(|s| {
                    let n: usize = s.iter().map(|x| x.1).sum();
                    rng.vec(n * (h + 2 * kvh) * hd, 2.0)
                })
                .collect();
            let want = run(&cpu, &p, bs, &tables, &plan, &data);
            let got = run(&be, &p, bs, &tables, &plan, &data);
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                let row = h * hd;
                let mut worst: Vec<(f64, usize)> = g
                    .chunks(row)
                    .zip(w.chunks(row))
                    .map(|(a, b)| super::util::rel_err(a, b))
                    .zip(0..)
                    .collect();
                worst.sort_by(|a, b| b.0.total_cmp(&a.0));
                eprintln!(
                    "  worst tokens (error, index): {:?}",
                    &worst[..worst.len().min(4)]
                );
                // The CUDA cache holds K/V in bf16.
                assert_close(
                    &format!("{act:?} h={h} kv={kvh} d={hd} window={window:?} bs={bs} step {i}"),
                    g,
                    w,
                    tol(act, 1e-2),
                );
            }
        }
    }
}

#[test]
fn rope_matches_the_cpu_backend_for_both_styles() {
    let mut rng = Rng::fresh("rope");
    let cpu = CpuBackend::new(2);
    let specs = [
        RopeSpec {
            theta: 10000.0,
            dims: 64,
            style: RopeStyle::Interleaved,
            scale: 1.0,
        },
        RopeSpec {
            theta: 500000.0,
            dims: 64,
            style: RopeStyle::Half,
            scale: 1.0,
        },
        RopeSpec {
            theta: 100000.0,
            dims: 32,
            style: RopeStyle::Half,
            scale: 2.0,
        },
        RopeSpec {
            theta: 10000.0,
            dims: 18,
            style: RopeStyle::Interleaved,
            scale: 1.0,
        },
    ];
    fn go<B: Backend>(
        be: &B,
        b: &Batch,
        specs: &[RopeSpec],
        x: &[f32],
        heads: usize,
        hd: usize,
    ) -> Vec<Vec<f32>> {
        let mut st = be.prepare_step(b, 16).unwrap();
        specs
            .iter()
            .map(|&s| {
                let mut xb = upload(be, b.n_tokens(), heads * hd, x);
                be.rope(&mut st, s, &mut xb, heads, hd).unwrap();
                be.to_host(&xb).unwrap()
            })
            .collect()
    }
    for act in [Act::F32, Act::Bf16] {
        let Some(be) = backend(act) else { return };
        let mut b = Batch::default();
        b.push(&[0; 5], 0, vec![0], true);
        b.push(&[0; 3], 4000, (0..251).collect(), true);
        b.push(&[0; 1], 131_000, (0..8200).collect(), true);
        let (heads, hd) = (3, 64);
        let x = rng.vec(b.n_tokens() * heads * hd, 1.0);
        let want = go(&cpu, &b, &specs, &x, heads, hd);
        let got = go(&be, &b, &specs, &x, heads, hd);
        for (s, (g, w)) in specs.iter().zip(got.iter().zip(&want)) {
            assert_close(&format!("{act:?} rope {s:?}"), g, w, tol(act, 1e-5));
        }
    }
}
