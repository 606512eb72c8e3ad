//! CPU matmul kernels on the default model's shapes (SmolLM2-135M: Q4_1 linear layers, Q8_0
//! tied embedding / output head), 2 threads.
//!
//! - `matvec/*` (one token, the decode case): throughput is weight bytes streamed (GB/s).
//! - `tokens64/*` (64 tokens, the prefill case): throughput "elements" are FLOPs
//!   (2 * rows * cols * 64), so Gelem/s reads as GFLOP/s.
//! - `tokens64_a16/*`: the same with 16-bit activations (`matmul16`, the default precision),
//!   and `tokens64_two_pass/*` the 128-token 8-bit product the two-pass precision it replaced
//!   cost (FLOPs counted once, for the 64 tokens).
//! - `decode_step/*`: all matvecs of one decode step over distinct weights (~96 MB): the
//!   time per token the matmuls cost when weights stream from L3/DRAM.
//! - `attention/*`: one decode token's attention in every layer over a 256-token context.
//! - `overhead/*`: fixed costs of a pool job and of a tiny matvec.
//! - `isa/*`: one matvec shape on every instruction-set level this CPU has.
//!
//! Run: `cargo bench -p deepinfer --bench cpu_kernels -- --warm-up-time 1 --measurement-time 3`

use std::sync::Arc;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use deepinfer::backend::cpu::attention::{paged_attention, AttnParams};
use deepinfer::backend::cpu::kv::PagedKv;
use deepinfer::backend::cpu::matmul::{matmul, matmul_with_isa};
use deepinfer::backend::cpu::matmul16::{matmul16, supports};
use deepinfer::backend::cpu::pool::ThreadPool;
use deepinfer::backend::cpu::quant::Isa;
use deepinfer::model::batch::Batch;
use deepinfer::tensor::{Bytes, DType, Weight};

/// (name, dtype, rows, cols) of the default model's matrices.
const SHAPES: [(&str, DType, usize, usize); 5] = [
    ("q4_1_576x576_attn_q_o", DType::Q4_1, 576, 576),
    ("q4_1_192x576_attn_k_v", DType::Q4_1, 192, 576),
    ("q4_1_1536x576_ffn_gate_up", DType::Q4_1, 1536, 576),
    ("q4_1_576x1536_ffn_down", DType::Q4_1, 576, 1536),
    ("q8_0_49152x576_output", DType::Q8_0, 49152, 576),
];

/// Random blocks with sane f16 scales (the values do not matter for speed, NaNs would).
fn weight(dtype: DType, rows: usize, cols: usize) -> Weight {
    let n = dtype.bytes_for(rows * cols).expect("whole blocks");
    let mut state = 0x1234_5678_9abc_def0u64;
    let mut bytes: Vec<u8> = (0..n)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state as u8
        })
        .collect();
    let scales: &[usize] = if dtype == DType::Q4_1 { &[0, 2] } else { &[0] };
    for block in bytes.chunks_exact_mut(dtype.block_bytes()) {
        for &off in scales {
            let v = half::f16::from_f32(0.01 + (block[off + 4] as f32) / 4096.0);
            block[off..off + 2].copy_from_slice(&v.to_le_bytes());
        }
    }
    Weight {
        dtype,
        rows,
        cols,
        data: Bytes::Owned(Arc::new(bytes)),
    }
}

fn activations(n: usize) -> Vec<f32> {
    (0..n)
        .map(|i| ((i * 7919 % 1000) as f32 - 500.0) / 250.0)
        .collect()
}

fn bench(c: &mut Criterion) {
    let pool = ThreadPool::new(2);
    let weights: Vec<_> = SHAPES
        .iter()
        .map(|&(name, dt, r, k)| (name, weight(dt, r, k)))
        .collect();

    let mut g = c.benchmark_group("matvec");
    for (name, w) in &weights {
        let x = activations(w.cols);
        let mut y = vec![0f32; w.rows];
        g.throughput(Throughput::BytesDecimal(w.bytes().len() as u64));
        g.bench_function(*name, |b| b.iter(|| matmul(&pool, w, &x, 1, &mut y)));
    }
    g.finish();

    let mut g = c.benchmark_group("tokens64");
    for (name, w) in &weights {
        let n = 64;
        let x = activations(n * w.cols);
        let mut y = vec![0f32; n * w.rows];
        g.throughput(Throughput::Elements((2 * w.rows * w.cols * n) as u64));
        g.bench_function(*name, |b| b.iter(|| matmul(&pool, w, &x, n, &mut y)));
    }
    g.finish();

    let mut g = c.benchmark_group("tokens64_a16");
    for (name, w) in weights.iter().filter(|(_, w)| supports(w.dtype)) {
        let n = 64;
        let x = activations(n * w.cols);
        let mut y = vec![0f32; n * w.rows];
        g.throughput(Throughput::Elements((2 * w.rows * w.cols * n) as u64));
        g.bench_function(*name, |b| b.iter(|| matmul16(&pool, w, &x, n, &mut y)));
    }
    g.finish();

    let mut g = c.benchmark_group("tokens64_two_pass");
    for (name, w) in &weights {
        let n = 64;
        let x = activations(2 * n * w.cols);
        let mut y = vec![0f32; 2 * n * w.rows];
        g.throughput(Throughput::Elements((2 * w.rows * w.cols * n) as u64));
        g.bench_function(*name, |b| b.iter(|| matmul(&pool, w, &x, 2 * n, &mut y)));
    }
    g.finish();

    // One decode step's matvecs over distinct weights (30 layers of q, k, v, o, gate, up,
    // down, then the output head): ~96 MB, so weights stream from L3/DRAM as in a real step.
    let mut g = c.benchmark_group("decode_step");
    g.sample_size(20);
    let layer = [
        (576, 576),
        (192, 576),
        (192, 576),
        (576, 576),
        (1536, 576),
        (1536, 576),
        (576, 1536),
    ];
    let mut step: Vec<Weight> = (0..30)
        .flat_map(|_| layer.iter().map(|&(r, k)| weight(DType::Q4_1, r, k)))
        .collect();
    step.push(weight(DType::Q8_0, 49152, 576));
    let total: usize = step.iter().map(|w| w.bytes().len()).sum();
    let x = activations(1536);
    let mut y = vec![0f32; 49152];
    g.throughput(Throughput::BytesDecimal(total as u64));
    g.bench_function("smollm2_135m_matvecs", |b| {
        b.iter(|| {
            for w in &step {
                matmul(&pool, w, &x[..w.cols], 1, &mut y[..w.rows]);
            }
        })
    });
    // Two tokens per matvec (two-pass activations, or a token plus one draft).
    let x2 = activations(2 * 1536);
    let mut y2 = vec![0f32; 2 * 49152];
    g.bench_function("smollm2_135m_matvecs_2_tokens", |b| {
        b.iter(|| {
            for w in &step {
                matmul(&pool, w, &x2[..2 * w.cols], 2, &mut y2[..2 * w.rows]);
            }
        })
    });
    g.finish();
    drop(step);

    // One decode token's attention over a 256-token context in each of the 30 layers (9 query
    // heads over 3 KV heads of 64, f32 cache in 16-token blocks: 11.8 MB, so from L3/DRAM as
    // in a step).
    let mut g = c.benchmark_group("attention");
    g.sample_size(20);
    let (layers, ctx, kv_heads, hd) = (30usize, 256usize, 3usize, 64usize);
    let mut kv = PagedKv::new(layers, ctx / 16, 16, kv_heads, hd);
    for l in 0..layers {
        let (k, v) = kv.layer_mut(l);
        k.copy_from_slice(&activations(k.len()));
        v.copy_from_slice(&activations(v.len()));
    }
    let p = AttnParams {
        n_heads: 9,
        n_kv_heads: kv_heads,
        head_dim: hd,
        scale: 0.125,
        window: None,
    };
    let mut batch = Batch::default();
    batch.push(&[1], ctx - 1, (0..(ctx / 16) as u32).collect(), true);
    let q = activations(9 * hd);
    let mut out = vec![0f32; 9 * hd];
    g.throughput(Throughput::BytesDecimal(
        (layers * ctx * kv_heads * hd * 2 * 4) as u64,
    ));
    g.bench_function("decode_30_layers_ctx256", |b| {
        b.iter(|| {
            for l in 0..layers {
                paged_attention(&pool, &p, &batch, &q, &kv, l, &mut out);
            }
        })
    });
    g.finish();
    drop(kv);

    // Fixed costs: an empty two-task job, and a matvec small enough to be all overhead.
    let mut g = c.benchmark_group("overhead");
    g.bench_function("parallel_for_2_empty", |b| {
        b.iter(|| {
            pool.parallel_for(2, &|i| {
                std::hint::black_box(i);
            })
        })
    });
    let tiny = weight(DType::Q4_1, 8, 576);
    let x = activations(576);
    let mut y = vec![0f32; 8];
    g.bench_function("matvec_q4_1_8x576", |b| {
        b.iter(|| matmul(&pool, &tiny, &x, 1, &mut y))
    });
    let one = ThreadPool::new(1);
    let (_, small) = &weights[1];
    let mut y = vec![0f32; small.rows];
    g.bench_function("matvec_q4_1_192x576_1_thread", |b| {
        b.iter(|| matmul(&one, small, &x, 1, &mut y))
    });
    g.finish();

    let mut g = c.benchmark_group("isa");
    let (_, w) = &weights[2];
    let x = activations(w.cols);
    let mut y = vec![0f32; w.rows];
    g.throughput(Throughput::BytesDecimal(w.bytes().len() as u64));
    for isa in Isa::available() {
        g.bench_with_input(
            BenchmarkId::new("q4_1_1536x576", isa.name()),
            &isa,
            |b, &isa| b.iter(|| matmul_with_isa(&pool, isa, w, &x, 1, &mut y)),
        );
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
