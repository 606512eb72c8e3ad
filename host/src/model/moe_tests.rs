//! MoE routing and the grouped expert computation against plain scalar references.

use super::*;
use crate::backend::cpu::CpuBackend;
use crate::tensor::Weight;

struct Lcg(u64);
impl Lcg {
    fn next(&mut self) -> f32 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((self.0 >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
    fn vec(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| self.next() * scale).collect()
    }
}

fn cfg(score: ScoreFunc, n_group: usize, topk_group: usize) -> RouterConfig {
    RouterConfig {
        n_experts: 16,
        top_k: 4,
        score,
        n_group,
        topk_group,
        norm_topk_prob: true,
        scaling: 2.5,
    }
}

fn score_ref(f: ScoreFunc, l: &[f32]) -> Vec<f64> {
    let l: Vec<f64> = l.iter().map(|&v| v as f64).collect();
    match f {
        ScoreFunc::Sigmoid => l.iter().map(|v| 1.0 / (1.0 + (-v).exp())).collect(),
        ScoreFunc::Softmax => {
            let s: f64 = l.iter().map(|v| v.exp()).sum();
            l.iter().map(|v| v.exp() / s).collect()
        }
        ScoreFunc::SqrtSoftplus => l.iter().map(|v| (1.0 + v.exp()).ln().sqrt()).collect(),
    }
}

/// Number of entries strictly greater than `v[i]` (ties broken by index): `i`'s rank.
fn rank(v: &[f64], i: usize) -> usize {
    (0..v.len())
        .filter(|&j| v[j] > v[i] || (v[j] == v[i] && j < i))
        .count()
}

/// Scalar reference: each token's experts as a sorted set with their weights.
fn route_ref(c: &RouterConfig, logits: &[f32], bias: &[f32]) -> Vec<Vec<(u32, f64)>> {
    let e = c.n_experts;
    let pg = e / c.n_group;
    logits
        .chunks_exact(e)
        .map(|l| {
            let s = score_ref(c.score, l);
            let choice: Vec<f64> = (0..e).map(|i| s[i] + bias[i] as f64).collect();
            let gscore: Vec<f64> = (0..c.n_group)
                .map(|g| {
                    let grp = &choice[g * pg..(g + 1) * pg];
                    if c.score == ScoreFunc::Softmax {
                        grp.iter().cloned().fold(f64::MIN, f64::max)
                    } else {
                        (0..pg).filter(|&i| rank(grp, i) < 2).map(|i| grp[i]).sum()
                    }
                })
                .collect();
            let allowed: Vec<f64> = (0..e)
                .map(|i| {
                    if rank(&gscore, i / pg) < c.topk_group {
                        choice[i]
                    } else {
                        f64::MIN
                    }
                })
                .collect();
            let chosen: Vec<usize> = (0..e).filter(|&i| rank(&allowed, i) < c.top_k).collect();
            let sum: f64 = chosen.iter().map(|&i| s[i]).sum();
            chosen
                .iter()
                .map(|&i| {
                    let w = if c.norm_topk_prob { s[i] / sum } else { s[i] };
                    (i as u32, w * c.scaling as f64)
                })
                .collect()
        })
        .collect()
}

fn as_sets(r: &Routing) -> Vec<Vec<(u32, f64)>> {
    r.experts
        .chunks_exact(r.top_k)
        .zip(r.weights.chunks_exact(r.top_k))
        .map(|(e, w)| {
            let mut v: Vec<(u32, f64)> = e.iter().zip(w).map(|(e, &w)| (e.0, w as f64)).collect();
            v.sort_by_key(|x| x.0);
            v
        })
        .collect()
}

fn check_routing(c: &RouterConfig, seed: u64) {
    let mut r = Lcg(seed);
    let logits = r.vec(32 * c.n_experts, 3.0);
    let bias: Vec<f32> = r.vec(c.n_experts, 0.2);
    let got = as_sets(&route(c, &logits, Some(&bias)));
    let want = route_ref(c, &logits, &bias);
    for (t, (g, w)) in got.iter().zip(&want).enumerate() {
        let ids = |v: &Vec<(u32, f64)>| v.iter().map(|x| x.0).collect::<Vec<_>>();
        assert_eq!(ids(g), ids(w), "token {t}: {c:?}");
        for (a, b) in g.iter().zip(w) {
            assert!((a.1 - b.1).abs() < 1e-5 * b.1.abs().max(1.0), "{a:?} {b:?}");
        }
    }
}

#[test]
fn routing_matches_the_scalar_reference() {
    for score in [
        ScoreFunc::Sigmoid,
        ScoreFunc::Softmax,
        ScoreFunc::SqrtSoftplus,
    ] {
        for (ng, tg) in [(1, 1), (4, 2), (8, 3), (4, 4)] {
            let mut c = cfg(score, ng, tg);
            check_routing(&c, 7 + ng as u64);
            c.norm_topk_prob = false;
            check_routing(&c, 11 + tg as u64);
        }
    }
}

#[test]
fn group_limit_keeps_experts_inside_the_chosen_groups() {
    let c = cfg(ScoreFunc::Sigmoid, 4, 1);
    let mut r = Lcg(3);
    let logits = r.vec(64 * 16, 3.0);
    let routing = route(&c, &logits, None);
    for e in routing.experts.chunks_exact(4) {
        let g = e[0].0 / 4;
        assert!(e.iter().all(|x| x.0 / 4 == g), "{e:?} spans groups");
    }
    // without the limit, the same logits spread over several groups for some token
    let free = route(&cfg(ScoreFunc::Sigmoid, 1, 1), &logits, None);
    assert!(free
        .experts
        .chunks_exact(4)
        .any(|e| e.iter().any(|x| x.0 / 4 != e[0].0 / 4)));
}

#[test]
fn bias_changes_the_choice_but_not_the_weights() {
    let c = cfg(ScoreFunc::Sigmoid, 1, 1);
    let logits = vec![0.0f32; 16];
    let mut bias = vec![0.0f32; 16];
    for b in &mut bias[12..] {
        *b = 1.0;
    }
    let r = route(&c, &logits, Some(&bias));
    let mut ids: Vec<u32> = r.experts.iter().map(|e| e.0).collect();
    ids.sort();
    assert_eq!(ids, vec![12, 13, 14, 15]);
    // equal sigmoid scores 0.5, normalized to 1/4, scaled by 2.5
    assert!(r.weights.iter().all(|&w| (w - 0.625).abs() < 1e-6), "{r:?}");
}

#[test]
fn hash_routing_uses_the_table() {
    let c = cfg(ScoreFunc::SqrtSoftplus, 1, 1);
    let table = HashTable {
        table: (0..10 * 4).map(|i| ExpertId((i * 5 % 16) as u32)).collect(),
        top_k: 4,
    };
    table.validate(&c).unwrap();
    let mut r = Lcg(5);
    let logits = r.vec(3 * 16, 2.0);
    let got = route_hash(&c, &table, &logits, &[2, 9, 2]).unwrap();
    assert_eq!(&got.experts[..4], &table.table[8..12]);
    assert_eq!(&got.experts[4..8], &table.table[36..40]);
    assert_eq!(&got.experts[..4], &got.experts[8..12]);
    let s: f32 = got.weights[..4].iter().sum();
    assert!(
        (s - 2.5).abs() < 1e-5,
        "normalized weights sum to the scale: {s}"
    );
    assert!(route_hash(&c, &table, &logits[..16], &[10]).is_err());
    let bad = HashTable {
        table: vec![ExpertId(16); 4],
        top_k: 4,
    };
    assert!(bad.validate(&c).is_err());
}

#[test]
fn bad_router_settings_are_rejected_with_the_key() {
    let msg = |c: RouterConfig| c.validate().unwrap_err().to_string();
    assert!(msg(cfg(ScoreFunc::Sigmoid, 4, 5)).contains("topk_group"));
    assert!(msg(cfg(ScoreFunc::Sigmoid, 3, 1)).contains("n_group"));
    assert!(msg(cfg(ScoreFunc::Sigmoid, 8, 1)).contains("cannot hold"));
    let mut c = cfg(ScoreFunc::Sigmoid, 1, 1);
    c.top_k = 17;
    assert!(msg(c).contains("num_experts_per_tok"));
    assert!(ScoreFunc::parse("tanh").is_err());
}

fn weight(r: &mut Lcg, rows: usize, cols: usize) -> (Weight, Vec<f32>) {
    let v = r.vec(rows * cols, 1.0 / (cols as f32).sqrt());
    (Weight::from_f32(rows, cols, &v), v)
}

type RefMlp = (Vec<f32>, Vec<f32>, Vec<f32>);

fn mlp(
    be: &CpuBackend,
    r: &mut Lcg,
    d: usize,
    f: usize,
) -> (Mlp<crate::backend::cpu::CpuWeight>, RefMlp) {
    let (g, gv) = weight(r, f, d);
    let (u, uv) = weight(r, f, d);
    let (dn, dv) = weight(r, d, f);
    let m = Mlp {
        gate: be.prepare_weight(&g).unwrap(),
        up: be.prepare_weight(&u).unwrap(),
        down: be.prepare_weight(&dn).unwrap(),
        inter: f,
    };
    (m, (gv, uv, dv))
}

fn mlp_ref(w: &RefMlp, x: &[f32], d: usize, f: usize) -> Vec<f64> {
    let h: Vec<f64> = (0..f)
        .map(|i| {
            let g: f64 = (0..d).map(|c| w.0[i * d + c] as f64 * x[c] as f64).sum();
            let u: f64 = (0..d).map(|c| w.1[i * d + c] as f64 * x[c] as f64).sum();
            g / (1.0 + (-g).exp()) * u
        })
        .collect();
    (0..d)
        .map(|o| (0..f).map(|i| w.2[o * f + i] as f64 * h[i]).sum())
        .collect()
}

#[test]
fn grouped_layer_matches_a_per_token_scalar_loop() {
    let be = CpuBackend::new(2);
    let (d, f, n) = (24, 16, 9);
    let mut r = Lcg(42);
    let c = cfg(ScoreFunc::Sigmoid, 4, 2);
    let (gate, gate_v) = weight(&mut r, 16, d);
    let bias = r.vec(16, 0.1);
    let mut experts = Vec::new();
    let mut refs = Vec::new();
    for _ in 0..16 {
        let (m, w) = mlp(&be, &mut r, d, f);
        experts.push(m);
        refs.push(w);
    }
    let (shared, shared_ref) = mlp(&be, &mut r, d, 2 * f);
    let layer = MoeLayer::new(
        c.clone(),
        Router::Learned {
            gate: be.prepare_weight(&gate).unwrap(),
            bias: Some(bias.clone()),
        },
        experts,
        Some(shared),
    )
    .unwrap();
    let x = r.vec(n * d, 1.0);
    let mut out = vec![0.0; n * d];
    let tokens: Vec<u32> = (0..n as u32).collect();
    layer.forward(&be, &x, &tokens, n, d, &mut out).unwrap();
    let logits: Vec<f32> = (0..n)
        .flat_map(|t| {
            let x = &x[t * d..(t + 1) * d];
            let gv = &gate_v;
            (0..16).map(move |e| (0..d).map(|c| gv[e * d + c] * x[c]).sum::<f32>())
        })
        .collect();
    let routes = route_ref(&c, &logits, &bias);
    let mut max_err = 0.0f64;
    for t in 0..n {
        let xt = &x[t * d..(t + 1) * d];
        let mut want = mlp_ref(&shared_ref, xt, d, 2 * f);
        for &(e, w) in &routes[t] {
            for (o, y) in want.iter_mut().zip(mlp_ref(&refs[e as usize], xt, d, f)) {
                *o += w * y;
            }
        }
        for (a, b) in out[t * d..(t + 1) * d].iter().zip(&want) {
            max_err = max_err.max((*a as f64 - b).abs() / b.abs().max(1e-2));
        }
    }
    assert!(max_err < 1e-4, "max relative error {max_err}");
    let load = layer.load();
    assert_eq!(load.last_step.iter().sum::<u64>(), (n * 4) as u64);
    assert_eq!(load.steps, 1);
    let want_counts: Vec<u64> = (0..16u32)
        .map(|e| routes.iter().filter(|r| r.iter().any(|x| x.0 == e)).count() as u64)
        .collect();
    assert_eq!(load.last_step, want_counts);
    layer
        .forward(&be, &x[..d].to_vec(), &tokens[..1], 1, d, &mut out)
        .unwrap();
    let load = layer.load();
    assert_eq!(load.last_step.iter().sum::<u64>(), 4);
    assert_eq!(load.total.iter().sum::<u64>(), (n * 4 + 4) as u64);
}
