//! `QLinear` against the dense matmul on the same quantized values.

mod common;

use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{DType, Device, Module, Tensor};
use common::*;
use powerinfer::{ErrorKind, QLinear, QuantizedRow};
use proptest::prelude::*;
use rand::{rngs::StdRng, SeedableRng};

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]
    #[test]
    fn qlinear_matches_dequantized_matmul(
        blocks in 1usize..5, out in 1usize..70, rows in 1usize..6, threads in 1usize..4,
        kind in 0usize..3, bias in any::<bool>(), seed in any::<u64>(),
    ) {
        let inp = 32 * blocks;
        let mut rng = StdRng::seed_from_u64(seed);
        let w = tensor(&mut rng, &[out, inp], 0.5);
        let dtype = [GgmlDType::Q4_0, GgmlDType::Q4_1, GgmlDType::Q8_0][kind];
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
        prop_assert!(e <= 1e-4, "rel err {e}");
    }
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
