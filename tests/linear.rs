//! `QLinear` (row-interleaved GGUF blocks) against a naive per-row reference written from the
//! GGUF block layout, on every SIMD level, bit for bit; against candle's own quantized matmul
//! (Q4_1: bit for bit); and against the dense matmul on the same quantized values.

mod common;

use candle_core::quantized::{GgmlDType, QMatMul, QTensor};
use candle_core::{DType, Device, Module, Tensor};
use common::*;
use powerinfer::cpu::{QuantizedRow, PACK};
use powerinfer::{cpu::SimdLevel, layers::QLinear, ErrorKind};
use proptest::prelude::*;
use rand::{rngs::StdRng, SeedableRng};

const KINDS: [GgmlDType; 3] = [GgmlDType::Q4_0, GgmlDType::Q4_1, GgmlDType::Q8_0];

/// Checks one layer on every tier against the naive reference, bit for bit.
fn check_bits(out: usize, inp: usize, rows: usize, threads: usize, kind: usize, seed: u64) {
    let mut rng = StdRng::seed_from_u64(seed);
    let w = tensor(&mut rng, &[out, inp], 0.5);
    let dtype = KINDS[kind];
    let q = QTensor::quantize(&w, dtype).unwrap();
    let data = q.data().unwrap().into_owned();
    let x = tensor(&mut rng, &[rows.max(1), inp], 2.0);
    let xs = flat(&x);
    let xq: Vec<QuantizedRow> = xs
        .chunks(inp)
        .take(rows)
        .map(|r| {
            let mut q = QuantizedRow::default();
            q.quantize(r);
            q
        })
        .collect();
    let rb = data.len() / out;
    let want: Vec<u32> = xq
        .iter()
        .flat_map(|x| (0..out).map(move |o| (o, x)))
        .map(|(o, x)| naive_row(dtype, &data[o * rb..(o + 1) * rb], x).to_bits())
        .collect();
    for tier in SimdLevel::supported() {
        let lin = QLinear::new(&q, None, threads)
            .unwrap()
            .with_simd_level(tier)
            .unwrap();
        let mut y = vec![0f32; rows * out];
        lin.forward_quantized(&xq, &mut y, &mut Vec::new()).unwrap();
        let got: Vec<u32> = y.iter().map(|v| v.to_bits()).collect();
        assert_eq!(
            got, want,
            "{dtype:?} {out}x{inp}, {rows} rows, {threads} threads, {tier}"
        );
        // The layer's own quantization (rows shared among its threads) reads the same input.
        let mut buf = Vec::new();
        let own = lin.quantize_input(&mut buf, &xs[..rows * inp]);
        lin.forward_quantized(own, &mut y, &mut Vec::new()).unwrap();
        let got: Vec<u32> = y.iter().map(|v| v.to_bits()).collect();
        assert_eq!(
            got, want,
            "quantize_input: {dtype:?} {rows} rows, {threads} threads"
        );
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]
    #[test]
    fn qlinear_is_the_block_formula_on_every_tier(
        blocks in 1usize..5, out in 1usize..70, rows in 1usize..7, threads in 1usize..4,
        kind in 0usize..3, seed in any::<u64>(),
    ) {
        check_bits(out, 32 * blocks, rows, threads, kind, seed);
    }

    #[test]
    fn qlinear_matches_dequantized_matmul(
        blocks in 1usize..5, out in 1usize..70, rows in 1usize..6, threads in 1usize..4,
        kind in 0usize..3, bias in any::<bool>(), seed in any::<u64>(),
    ) {
        let inp = 32 * blocks;
        let mut rng = StdRng::seed_from_u64(seed);
        let w = tensor(&mut rng, &[out, inp], 0.5);
        let dtype = KINDS[kind];
        let q = QTensor::quantize(&w, dtype).unwrap();
        let b = bias.then(|| tensor(&mut rng, &[out], 1.0));
        let lin = QLinear::new(&q, b.as_ref(), threads).unwrap();
        let x = tensor(&mut rng, &[rows, inp], 2.0);
        let y = lin.forward(&x).unwrap();
        // Reference: dequantized weights times the 8-bit quantized input, in f32.
        let xs = flat(&x);
        let mut xd = vec![0f32; xs.len()];
        let mut qr = QuantizedRow::default();
        for (s, d) in xs.chunks(inp).zip(xd.chunks_mut(inp)) {
            qr.quantize(s);
            qr.dequantize(d);
        }
        let xd = Tensor::from_vec(xd, (rows, inp), &Device::Cpu).unwrap();
        let mut r = xd.matmul(&q.dequantize(&Device::Cpu).unwrap().t().unwrap()).unwrap();
        if let Some(b) = &b {
            r = r.broadcast_add(b).unwrap();
        }
        let e = rel_err(&y, &r);
        // Q4_1's min term uses Q8_1's f16-rounded `d * sum(q)`, which a dequantized input cannot
        // express (up to 2^-10 of that term per block, and the term can exceed the output it is
        // part of); the block formula itself is checked bit for bit above.
        let tol = if dtype == GgmlDType::Q4_1 { 1e-2 } else { 1e-4 };
        prop_assert!(e <= tol, "{dtype:?}: rel err {e}");
    }
}

/// Edge shapes: 1, odd, one group of 16 rows +-1, one and several blocks, tiles of 1-5 input rows.
#[test]
fn qlinear_edge_shapes() {
    for &out in &[1usize, 2, 15, 16, 17, 31, 32, 33, 48] {
        for &blocks in &[1usize, 2, 3] {
            for &rows in &[1usize, 3, 4, 5, 9] {
                for kind in 0..3 {
                    check_bits(out, 32 * blocks, rows, 2, kind, (out * 100 + blocks) as u64);
                }
            }
        }
    }
    assert_eq!(PACK, 16);
}

/// Q4_1 weights: the same bits as candle's own quantized matmul (it quantizes the input to Q8_1
/// and sums each block in the same order), so a model on `QLinear` computes what candle does.
#[test]
fn qlinear_q4_1_equals_candle_bit_for_bit() {
    let mut rng = StdRng::seed_from_u64(11);
    let (out, inp) = (40, 96);
    let q = QTensor::quantize(&tensor(&mut rng, &[out, inp], 0.5), GgmlDType::Q4_1).unwrap();
    let x = tensor(&mut rng, &[3, inp], 2.0);
    let ours = QLinear::new(&q, None, 2).unwrap().forward(&x).unwrap();
    let theirs = QMatMul::from_qtensor(q).unwrap().forward(&x).unwrap();
    assert_eq!(bits(&ours), bits(&theirs));
}

/// Stacked tensors are one layer over the concatenated rows; a tied embedding reads its rows.
#[test]
fn qlinear_stacked_and_rows() {
    let mut rng = StdRng::seed_from_u64(5);
    let a = QTensor::quantize(&tensor(&mut rng, &[20, 64], 0.5), GgmlDType::Q8_0).unwrap();
    let b = QTensor::quantize(&tensor(&mut rng, &[12, 64], 0.5), GgmlDType::Q8_0).unwrap();
    let s = QLinear::stacked(&[&a, &b], None, 2).unwrap();
    assert_eq!(s.dims(), (32, 64));
    let x = tensor(&mut rng, &[2, 64], 1.0);
    let ya = flat(&QLinear::new(&a, None, 1).unwrap().forward(&x).unwrap());
    let yb = flat(&QLinear::new(&b, None, 1).unwrap().forward(&x).unwrap());
    let ys = flat(&s.forward(&x).unwrap());
    for r in 0..2 {
        assert_eq!(&ys[r * 32..r * 32 + 20], &ya[r * 20..(r + 1) * 20]);
        assert_eq!(&ys[r * 32 + 20..(r + 1) * 32], &yb[r * 12..(r + 1) * 12]);
    }
    let deq = flat(&b.dequantize(&Device::Cpu).unwrap());
    let mut row = vec![0f32; 64];
    s.dequantize_row(20 + 7, &mut row).unwrap();
    assert_eq!(&row[..], &deq[7 * 64..8 * 64]);
    assert!(s.dequantize_row(32, &mut row).is_err());
    assert!(s.dequantize_row(0, &mut row[..63]).is_err());
    // Different widths cannot be stacked (different block types can: tests/blocks.rs).
    let c = QTensor::quantize(&tensor(&mut rng, &[4, 96], 0.5), GgmlDType::Q4_0).unwrap();
    assert!(QLinear::stacked(&[&a, &c], None, 1).is_err());
    assert!(QLinear::stacked(&[], None, 1).is_err());
}

#[test]
fn qlinear_rejects_bad_input() {
    let w = Tensor::zeros((8, 40), DType::F32, &Device::Cpu).unwrap();
    let q = QTensor::quantize(&w, GgmlDType::F32).unwrap();
    assert!(matches!(
        QLinear::new(&q, None, 1).unwrap_err().kind(),
        ErrorKind::Config { .. }
    ));
    let w = Tensor::zeros((8, 64), DType::F32, &Device::Cpu).unwrap();
    let q = QTensor::quantize(&w, GgmlDType::Q8_0).unwrap();
    let bad_bias = Tensor::zeros(7, DType::F32, &Device::Cpu).unwrap();
    assert!(matches!(
        QLinear::new(&q, Some(&bad_bias), 1).unwrap_err().kind(),
        ErrorKind::Shape { .. }
    ));
    let lin = QLinear::new(&q, None, 2).unwrap();
    let x = Tensor::zeros((2, 63), DType::F32, &Device::Cpu).unwrap();
    assert!(lin.forward(&x).is_err());
    // A quantized input of the wrong width, an output of the wrong length: typed errors.
    let mut xq = QuantizedRow::default();
    xq.quantize(&[0.5; 32]);
    let mut y = vec![0f32; 8];
    assert!(matches!(
        lin.forward_quantized(std::slice::from_ref(&xq), &mut y, &mut Vec::new())
            .unwrap_err()
            .kind(),
        ErrorKind::Shape { .. }
    ));
    xq.quantize(&[0.5; 64]);
    assert!(lin
        .forward_quantized(std::slice::from_ref(&xq), &mut y[..7], &mut Vec::new())
        .is_err());
    // No rows: nothing to do.
    lin.forward_quantized(&[], &mut [], &mut Vec::new())
        .unwrap();
}

/// Non-contiguous and f16 inputs take the copying path and agree with the in-place one.
#[test]
fn qlinear_input_layouts_agree() {
    let mut rng = StdRng::seed_from_u64(4);
    let q = QTensor::quantize(&tensor(&mut rng, &[24, 64], 0.5), GgmlDType::Q4_1).unwrap();
    let lin = QLinear::new(&q, None, 2).unwrap();
    let xt = tensor(&mut rng, &[64, 3], 1.0);
    let x = xt.t().unwrap(); // [3, 64], not contiguous
    assert!(!x.is_contiguous());
    let a = lin.forward(&x).unwrap();
    let b = lin.forward(&x.contiguous().unwrap()).unwrap();
    assert_eq!(bits(&a), bits(&b));
    let h = lin.forward(&x.to_dtype(DType::F16).unwrap()).unwrap();
    assert_eq!(h.dtype(), DType::F16);
    assert!(rel_err(&h, &b) < 2e-2);
}
