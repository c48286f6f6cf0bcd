//! Column-major matrices (`ColumnMatrix`) for input-sparse products: the quantized product over
//! the nonzero inputs is the dense block formula over the same (masked, quantized) input, bit for
//! bit, on every SIMD level and every split of the rows among threads; float storage matches an
//! f64 product; bad weights are typed errors.

mod common;

use candle_core::quantized::{GgmlDType, QTensor};
use common::*;
use powerinfer::cpu::{ActiveColumns, ColumnMatrix, Kernels, QuantKind, QuantizedRow, CHUNK};
use powerinfer::{cpu::ColumnStorage, cpu::SimdLevel};
use proptest::prelude::*;
use rand::{rngs::StdRng, Rng, SeedableRng};

const KINDS: [(GgmlDType, QuantKind); 3] = [
    (GgmlDType::Q4_0, QuantKind::Q4_0),
    (GgmlDType::Q4_1, QuantKind::Q4_1),
    (GgmlDType::Q8_0, QuantKind::Q8_0),
];

/// `x` with each entry zeroed with probability `drop`.
fn masked(rng: &mut StdRng, n: usize, drop: f64) -> Vec<f32> {
    values(rng, n, 2.0)
        .into_iter()
        .map(|v| if rng.random_bool(drop) { 0.0 } else { v })
        .collect()
}

/// The product of every tier, rows split at chunk `split` (two "threads"), as bits.
fn tier_bits(
    k: &Kernels,
    m: &ColumnMatrix,
    x: &[f32],
    xq: &QuantizedRow,
    a: &ActiveColumns,
    split: usize,
) -> Vec<u32> {
    let c = m.chunks();
    let split = split.min(c);
    let mut out = vec![0f32; c * CHUNK];
    let (lo, hi) = out.split_at_mut(split * CHUNK);
    k.column_matrix_q8(m, 0..split, x, xq, a, lo);
    k.column_matrix_q8(m, split..c, x, xq, a, hi);
    out[..m.rows()].iter().map(|v| v.to_bits()).collect()
}

fn check_quantized(rows: usize, blocks: usize, kind: usize, drop: f64, split: usize, seed: u64) {
    let cols = 32 * blocks;
    let mut rng = StdRng::seed_from_u64(seed);
    let (dtype, qk) = KINDS[kind];
    let q = QTensor::quantize(&tensor(&mut rng, &[rows, cols], 0.5), dtype).unwrap();
    let data = q.data().unwrap().into_owned();
    let m = ColumnMatrix::from_blocks(qk, rows, cols, &data).unwrap();
    let x = masked(&mut rng, cols, drop);
    let mut xq = QuantizedRow::default();
    xq.quantize(&x);
    let mut a = ActiveColumns::default();
    a.of_quantized(&xq);
    let rb = data.len() / rows;
    let want: Vec<u32> = (0..rows)
        .map(|r| naive_row(dtype, &data[r * rb..(r + 1) * rb], &xq).to_bits())
        .collect();
    for tier in SimdLevel::supported() {
        let k = Kernels::new(tier).unwrap();
        let got = tier_bits(&k, &m, &x, &xq, &a, split);
        assert_eq!(
            got, want,
            "{dtype:?} {rows}x{cols}, drop {drop}, split {split}, {tier}"
        );
    }
}

fn check_float(rows: usize, cols: usize, storage: usize, drop: f64, split: usize, seed: u64) {
    let storage = [ColumnStorage::F32, ColumnStorage::F16, ColumnStorage::BF16][storage];
    let mut rng = StdRng::seed_from_u64(seed);
    let w = values(&mut rng, rows * cols, 0.5);
    let m = ColumnMatrix::from_f32(storage, rows, cols, &w).unwrap();
    let x = masked(&mut rng, cols, drop);
    let mut a = ActiveColumns::default();
    a.of_f32(&x);
    // f64 reference on the stored (rounded) weights.
    let mut col = vec![0f32; rows];
    let mut want = vec![0f64; rows];
    let mut scale = vec![0f64; rows];
    for (c, &xv) in x.iter().enumerate() {
        m.column(c, &mut col);
        for r in 0..rows {
            want[r] += f64::from(col[r]) * f64::from(xv);
            scale[r] += (f64::from(col[r]) * f64::from(xv)).abs();
        }
    }
    for tier in SimdLevel::supported() {
        let k = Kernels::new(tier).unwrap();
        let got = tier_bits(&k, &m, &x, &QuantizedRow::default(), &a, split);
        for r in 0..rows {
            let g = f64::from(f32::from_bits(got[r]));
            assert!(
                (g - want[r]).abs() <= 1e-5 * scale[r] + 1e-30,
                "{storage:?} {rows}x{cols} row {r}: {g} vs {} ({tier})",
                want[r]
            );
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]
    #[test]
    fn quantized_columns_are_the_block_formula_on_every_tier(
        rows in 1usize..200, blocks in 1usize..5, kind in 0usize..3, drop in 0.0f64..1.0,
        split in 0usize..4, seed in any::<u64>(),
    ) {
        check_quantized(rows, blocks, kind, drop, split, seed);
    }

    #[test]
    fn float_columns_match_f64(
        rows in 1usize..150, cols in 1usize..80, storage in 0usize..3, drop in 0.0f64..1.0,
        split in 0usize..3, seed in any::<u64>(),
    ) {
        check_float(rows, cols, storage, drop, split, seed);
    }
}

#[test]
fn edge_shapes() {
    // 0 and 1 rows past a chunk, SIMD widths +-1, every input kept, none kept.
    for rows in [
        1, 2, 7, 8, 9, 15, 16, 17, 31, 32, 33, 63, 64, 65, 127, 128, 129,
    ] {
        for kind in 0..3 {
            for drop in [0.0, 0.5, 1.0] {
                check_quantized(rows, 1, kind, drop, 1, rows as u64);
                check_quantized(rows, 3, kind, drop, 0, 7 + rows as u64);
            }
        }
        for storage in 0..3 {
            for cols in [1, 3, 4, 5, 33] {
                check_float(rows, cols, storage, 0.3, 1, rows as u64);
            }
        }
    }
}

#[test]
fn tall_matrices_cross_tiles() {
    // Many tiles of chunks (the AVX-512 kernel reads 8 chunks per tile), split anywhere.
    for kind in 0..3 {
        for (rows, split) in [(64 * 64, 64), (64 * 65 + 3, 33), (64 * 130 - 1, 65)] {
            check_quantized(rows, 2, kind, 0.5, split, (rows + kind) as u64);
        }
    }
}

#[test]
fn column_norms_and_bytes() {
    let mut rng = StdRng::seed_from_u64(3);
    let (rows, cols) = (70, 64);
    let q = QTensor::quantize(&tensor(&mut rng, &[rows, cols], 0.5), GgmlDType::Q4_1).unwrap();
    let data = q.data().unwrap();
    let m = ColumnMatrix::from_blocks(QuantKind::Q4_1, rows, cols, &data).unwrap();
    let deq = flat(&q.dequantize(&candle_core::Device::Cpu).unwrap());
    let mut col = vec![0f32; rows];
    for c in 0..cols {
        m.column(c, &mut col);
        let want: Vec<f32> = (0..rows).map(|r| deq[r * cols + c]).collect();
        assert_eq!(col, want, "column {c}");
        let norm = want.iter().map(|v| v * v).sum::<f32>().sqrt();
        assert!((m.column_norms()[c] - norm).abs() <= 1e-5 * norm.max(1.0));
    }
    // Values 4 bits per padded row, scale planes 4 bytes per padded row and block.
    assert_eq!(m.bytes(), 128 / 2 * cols + 2 * 128 * 4);
    assert_eq!(m.bytes_read(cols, 2), m.bytes());
    assert_eq!(m.bytes_read(1, 1), 64 + 512);
}

#[test]
fn bad_weights_are_typed_errors() {
    let mut rng = StdRng::seed_from_u64(4);
    let q = QTensor::quantize(&tensor(&mut rng, &[4, 64], 0.5), GgmlDType::Q8_0).unwrap();
    let mut data = q.data().unwrap().into_owned();
    let err = |r: powerinfer::Result<ColumnMatrix>| r.unwrap_err().to_string();
    assert!(err(ColumnMatrix::from_blocks(
        QuantKind::Q8_0,
        4,
        64,
        &data[1..]
    ))
    .contains("bytes"));
    assert!(
        err(ColumnMatrix::from_blocks(QuantKind::Q8_0, 4, 48, &data)).contains("multiple of 32")
    );
    assert!(err(ColumnMatrix::from_blocks(QuantKind::Q8_0, 0, 64, &[])).contains("at least 1"));
    // A NaN scale (f16 0x7e00) in the second row's first block.
    data[68..70].copy_from_slice(&[0x00, 0x7e]);
    assert!(
        err(ColumnMatrix::from_blocks(QuantKind::Q8_0, 4, 64, &data)).contains("NaN or infinity")
    );
    let mut w = vec![0.5f32; 12];
    w[5] = f32::INFINITY;
    assert!(err(ColumnMatrix::from_f32(ColumnStorage::F16, 3, 4, &w)).contains("NaN or infinity"));
    assert!(err(ColumnMatrix::from_f32(ColumnStorage::F16, 3, 5, &w)).contains("12"));
}
