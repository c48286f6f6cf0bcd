//! Every block type of the packed product (Q4_0, Q4_1, Q8_0, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K)
//! against the per-row reference written from the GGUF block layout (`cpu::dot_row`), bit for
//! bit, on every SIMD level and thread count; the reference against the dequantized product;
//! the layer against candle's quantized matmul; layers stacked from several block types.
//!
//! Weights are random bytes with finite random scales: every bit pattern of the quants, the
//! high bits and the packed 6-bit scales occurs, not only what a quantizer writes.

mod common;

use candle_core::quantized::{GgmlDType, QMatMul, QTensor};
use candle_core::{Device, Module, Tensor};
use common::*;
use powerinfer::cpu::{dequantize_blocks, dot_row, BlockKind, PackedRows, QuantizedRow};
use powerinfer::{cpu::SimdLevel, layers::QLinear};
use proptest::prelude::*;
use rand::{rngs::StdRng, SeedableRng};

fn quantize(kind: BlockKind, x: &[f32], cols: usize) -> Vec<QuantizedRow> {
    let mut rows = Vec::new();
    QuantizedRow::quantize_rows_for(&mut rows, x, cols, kind.inputs()).to_vec()
}

/// One layer on every tier and `threads` against the per-row reference, bit for bit.
fn check_bits(kind: BlockKind, out: usize, cols: usize, rows: usize, threads: usize, seed: u64) {
    let mut rng = StdRng::seed_from_u64(seed);
    let w = random_rows(kind, out, cols, &mut rng);
    let xq = quantize(kind, &values(&mut rng, rows * cols, 2.0), cols);
    let rb = kind.row_bytes(cols);
    let want: Vec<u32> = xq
        .iter()
        .flat_map(|x| (0..out).map(move |o| (o, x)))
        .map(|(o, x)| dot_row(kind, &w[o * rb..(o + 1) * rb], x).to_bits())
        .collect();
    for tier in SimdLevel::supported() {
        let p = PackedRows::pack(kind, out, cols, &w).unwrap();
        let lin = QLinear::from_packed(p, None, threads)
            .unwrap()
            .with_simd_level(tier)
            .unwrap();
        let mut y = vec![0f32; rows * out];
        lin.forward_quantized(&xq, &mut y, &mut Vec::new()).unwrap();
        let got: Vec<u32> = y.iter().map(|v| v.to_bits()).collect();
        assert_eq!(
            got, want,
            "{kind} {out}x{cols}, {rows} rows, {threads} threads, {tier}"
        );
    }
}

fn kind_and_cols() -> impl Strategy<Value = (BlockKind, usize)> {
    (0usize..8, 1usize..4).prop_map(|(k, n)| {
        let kind = BlockKind::ALL[k];
        // 32-weight kinds: widths that are not a multiple of 256 too (Qwen2.5-0.5B: 896).
        let blocks = if kind.block_elems() == 32 { 7 * n } else { n };
        (kind, blocks * kind.block_elems())
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]
    #[test]
    fn packed_product_is_the_row_reference_on_every_tier(
        (kind, cols) in kind_and_cols(), out in 1usize..40, rows in 1usize..7,
        threads in 1usize..4, seed in any::<u64>(),
    ) {
        check_bits(kind, out, cols, rows, threads, seed);
    }

    /// The reference is the dot product of the dequantized weights with the values the input
    /// quantization gives, up to float order.
    #[test]
    fn row_reference_is_the_dequantized_product(
        (kind, cols) in kind_and_cols(), seed in any::<u64>(),
    ) {
        let mut rng = StdRng::seed_from_u64(seed);
        let w = random_rows(kind, 1, cols, &mut rng);
        let x = &quantize(kind, &values(&mut rng, cols, 2.0), cols)[0];
        let (mut wd, mut xd) = (vec![0f32; cols], vec![0f32; cols]);
        dequantize_blocks(kind, &w, &mut wd);
        if kind.inputs().k { x.dequantize_k(&mut xd) } else { x.dequantize(&mut xd) }
        let want: f64 = wd.iter().zip(&xd).map(|(a, b)| *a as f64 * *b as f64).sum();
        let mag: f64 = wd.iter().zip(&xd).map(|(a, b)| (*a as f64 * *b as f64).abs()).sum();
        let got = dot_row(kind, &w, x) as f64;
        // Q4_1/Q5_1's min term uses Q8_1's f16-rounded `d * sum(q)` (2^-11 relative of the
        // term, which can exceed the products it belongs to); the others differ by float
        // order and the f32 products only.
        let tol = match kind {
            BlockKind::Q4_1 | BlockKind::Q5_1 => 2e-3,
            _ => 1e-5,
        };
        prop_assert!((got - want).abs() <= tol * mag + 1e-6, "{kind}: {got} vs {want} (mag {mag})");
    }
}

/// Edge shapes: 1, odd, one group of 16 rows +-1, one and several blocks, tiles of 1-5 and 9
/// input rows (the kernels take up to 4 at once).
#[test]
fn packed_product_edge_shapes() {
    for kind in BlockKind::ALL {
        for &out in &[1usize, 15, 16, 17, 33] {
            for &blocks in &[1usize, 2, 3] {
                for &rows in &[1usize, 4, 5, 9] {
                    let seed = (out * 100 + blocks * 10 + rows) as u64;
                    check_bits(kind, out, blocks * kind.block_elems(), rows, 2, seed);
                }
            }
        }
    }
}

fn ggml(kind: BlockKind) -> GgmlDType {
    match kind {
        BlockKind::Q4_0 => GgmlDType::Q4_0,
        BlockKind::Q4_1 => GgmlDType::Q4_1,
        BlockKind::Q8_0 => GgmlDType::Q8_0,
        BlockKind::Q5_0 => GgmlDType::Q5_0,
        BlockKind::Q5_1 => GgmlDType::Q5_1,
        BlockKind::Q4K => GgmlDType::Q4K,
        BlockKind::Q5K => GgmlDType::Q5K,
        BlockKind::Q6K => GgmlDType::Q6K,
    }
}

/// candle's quantized matmul on the same blocks. Its 32-weight inputs are ggml's (Q8_0/Q8_1),
/// but its Q8_K input scales by `-128 / max` (ggml's older rule; ggml and we use `-127 / max`),
/// so the two differ by at most the two input roundings: per output, `sum |w| * max|x| / 127`.
#[test]
fn packed_product_matches_candle() {
    let mut rng = StdRng::seed_from_u64(21);
    for kind in BlockKind::ALL {
        let (out, cols, rows) = (40, 2 * 256, 3);
        let w = tensor(&mut rng, &[out, cols], 0.5);
        let q = QTensor::quantize(&w, ggml(kind)).unwrap();
        let x = tensor(&mut rng, &[rows, cols], 2.0);
        let ours = flat(&QLinear::new(&q, None, 2).unwrap().forward(&x).unwrap());
        let wd = flat(&q.dequantize(&Device::Cpu).unwrap());
        let theirs = flat(&QMatMul::from_qtensor(q).unwrap().forward(&x).unwrap());
        let xs = flat(&x);
        for (i, (a, b)) in ours.iter().zip(&theirs).enumerate() {
            let (r, o) = (i / out, i % out);
            let xr = &xs[r * cols..(r + 1) * cols];
            let amax = xr.iter().fold(0f32, |m, v| m.max(v.abs()));
            let wsum: f32 = wd[o * cols..(o + 1) * cols].iter().map(|v| v.abs()).sum();
            let bound = wsum * amax / 127.0;
            assert!(
                (a - b).abs() <= bound,
                "{kind} [{i}]: {a} vs {b} (bound {bound})"
            );
        }
        if kind == BlockKind::Q4_1 {
            // The same input and the same order: candle's bits.
            assert_eq!(ours, theirs);
        }
    }
}

/// A Q4_K_M layer's q, k (Q4_K) and v (Q6_K), or a Q5_0 layer with a Q8_0 v: one layer of parts
/// whose outputs are each part's, bit for bit, and whose rows read back from the right part.
#[test]
fn stacked_layers_of_several_block_types() {
    let mut rng = StdRng::seed_from_u64(5);
    for (types, cols) in [
        ([GgmlDType::Q4K, GgmlDType::Q4K, GgmlDType::Q6K], 512),
        ([GgmlDType::Q5_0, GgmlDType::Q5_0, GgmlDType::Q8_0], 96),
    ] {
        let sizes = [20, 7, 13];
        let qs: Vec<QTensor> = types
            .iter()
            .zip(sizes)
            .map(|(&t, n)| QTensor::quantize(&tensor(&mut rng, &[n, cols], 0.5), t).unwrap())
            .collect();
        let refs: Vec<&QTensor> = qs.iter().collect();
        let bias = tensor(&mut rng, &[40], 1.0);
        let s = QLinear::stacked(&refs, Some(&bias), 2).unwrap();
        assert_eq!(s.dims(), (40, cols));
        assert_eq!(s.parts().len(), 2);
        let x = tensor(&mut rng, &[3, cols], 1.0);
        let ys = flat(&s.forward(&x).unwrap());
        let b = flat(&bias);
        let mut first = 0;
        for (q, n) in qs.iter().zip(sizes) {
            let y = flat(&QLinear::new(q, None, 1).unwrap().forward(&x).unwrap());
            for r in 0..3 {
                for j in 0..n {
                    assert_eq!(ys[r * 40 + first + j], y[r * n + j] + b[first + j]);
                }
            }
            let deq = flat(&q.dequantize(&Device::Cpu).unwrap());
            let mut row = vec![0f32; cols];
            s.dequantize_row(first + n - 1, &mut row).unwrap();
            assert_eq!(&row[..], &deq[(n - 1) * cols..n * cols]);
            first += n;
        }
        let mut row = vec![0f32; cols];
        assert!(s.dequantize_row(40, &mut row).is_err());
    }
}

/// A K-quant layer refuses an input quantized without its super-blocks, and a width that is not
/// whole super-blocks: typed errors.
#[test]
fn kquant_layers_refuse_bad_shapes() {
    let mut rng = StdRng::seed_from_u64(3);
    let w = random_rows(BlockKind::Q6K, 16, 256, &mut rng);
    let lin = QLinear::from_packed(
        PackedRows::pack(BlockKind::Q6K, 16, 256, &w).unwrap(),
        None,
        1,
    )
    .unwrap();
    let mut xq = QuantizedRow::default();
    xq.quantize(&[0.5; 256]);
    let mut y = vec![0f32; 16];
    assert!(lin
        .forward_quantized(std::slice::from_ref(&xq), &mut y, &mut Vec::new())
        .is_err());
    // A row quantized for K-quants, then again for 32-value blocks only: its old super-blocks
    // are gone, not read as if they were this input's.
    xq.quantize_for(&[0.25; 256], lin.inputs());
    xq.quantize(&[0.5; 256]);
    assert!(lin
        .forward_quantized(std::slice::from_ref(&xq), &mut y, &mut Vec::new())
        .is_err());
    assert!(PackedRows::pack(BlockKind::Q4K, 1, 96, &[0u8; 54]).is_err());
    let x = Tensor::zeros((1, 256), candle_core::DType::F32, &Device::Cpu).unwrap();
    assert_eq!(flat(&lin.forward(&x).unwrap()), vec![0f32; 16]);
}
