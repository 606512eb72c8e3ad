//! Dequantization of every supported type against values recorded from gguf-py
//! (`testdata/make_fixtures.py` writes the fixture; python is not needed to run the tests).

use super::dequantize_row;
use crate::tensor::DType;

const FIXTURE: &[u8] = include_bytes!("testdata/dequant_fixtures.bin");

struct Entry {
    dtype: DType,
    bytes: &'static [u8],
    values: Vec<f32>,
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes"))
}

fn entries() -> Vec<Entry> {
    assert_eq!(&FIXTURE[0..4], b"DQFX");
    assert_eq!(u32_at(FIXTURE, 4), 1, "fixture version");
    let count = u32_at(FIXTURE, 8) as usize;
    let mut at = 12;
    let mut out = Vec::new();
    for _ in 0..count {
        let id = u32_at(FIXTURE, at);
        let n = u32_at(FIXTURE, at + 4) as usize;
        let nb = u32_at(FIXTURE, at + 8) as usize;
        at += 12;
        let dtype = DType::from_ggml(id).expect("fixture type is supported");
        let bytes = &FIXTURE[at..at + nb];
        at += nb;
        let values = FIXTURE[at..at + 4 * n]
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        at += 4 * n;
        out.push(Entry {
            dtype,
            bytes,
            values,
        });
    }
    assert_eq!(at, FIXTURE.len(), "trailing bytes in fixture");
    out
}

#[test]
fn fixture_covers_every_block_type() {
    let types: Vec<DType> = entries().iter().map(|e| e.dtype).collect();
    for t in [
        DType::F16,
        DType::BF16,
        DType::Q4_0,
        DType::Q4_1,
        DType::Q5_0,
        DType::Q5_1,
        DType::Q8_0,
        DType::Q2_K,
        DType::Q3_K,
        DType::Q4_K,
        DType::Q5_K,
        DType::Q6_K,
    ] {
        assert!(types.contains(&t), "fixture lacks {t}");
    }
}

#[test]
fn dequantize_row_matches_gguf_py() {
    for e in entries() {
        assert_eq!(e.dtype.bytes_for(e.values.len()), Some(e.bytes.len()));
        let mut got = vec![f32::NAN; e.values.len()];
        dequantize_row(e.dtype, e.bytes, &mut got);
        let mut nonzero = 0;
        for (i, (&g, &want)) in got.iter().zip(&e.values).enumerate() {
            let tol = 1e-6 * want.abs().max(1e-3);
            assert!(
                (g - want).abs() <= tol,
                "{}: element {i}: got {g}, gguf-py says {want}",
                e.dtype
            );
            nonzero += usize::from(want != 0.0);
        }
        assert!(
            nonzero > e.values.len() / 2,
            "{}: fixture mostly zero",
            e.dtype
        );
    }
}

#[test]
fn dequantize_row_handles_block_prefixes() {
    // Dequantizing only the first block of a longer buffer gives the fixture's first block.
    for e in entries() {
        let be = e.dtype.block_elems().max(16);
        let mut got = vec![0f32; be];
        dequantize_row(e.dtype, e.bytes, &mut got);
        assert_eq!(got[..], e.values[..be], "{}", e.dtype);
    }
}

#[test]
fn f32_rows_copy_through() {
    let v = [1.5f32, -2.25, 0.0, 3.0e-5];
    let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
    let mut got = [0f32; 4];
    dequantize_row(DType::F32, &bytes, &mut got);
    assert_eq!(got, v);
}

#[test]
#[should_panic(expected = "whole number")]
fn partial_block_panics() {
    let mut out = [0f32; 31];
    dequantize_row(DType::Q4_0, &[0u8; 18], &mut out);
}
