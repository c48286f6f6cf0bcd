//! `InputSparseLinear` (input sparsity for the attention projections) against `QLinear`: with a
//! threshold it is `QLinear` over the masked input bit for bit (threshold 0: `QLinear` itself),
//! stacked tensors and a bias included, on every tier and thread count; the byte accounting,
//! calibration and bad input.

mod common;

use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};
use common::*;
use powerinfer::cpu::QuantizedRow;
use powerinfer::{cpu::SimdLevel, layers::InputSparseLinear, layers::QLinear};
use proptest::prelude::*;
use rand::{rngs::StdRng, SeedableRng};

/// `outs` stacked output widths, `in_blocks * 32` inputs, `rows` rows at threshold `t`.
#[allow(clippy::too_many_arguments)]
fn check(
    outs: &[usize],
    in_blocks: usize,
    kind: usize,
    rows: usize,
    t: f32,
    bias: bool,
    threads: usize,
    seed: u64,
) {
    let dt = KINDS[kind];
    let cols = dt.block_size() * in_blocks;
    let mut rng = StdRng::seed_from_u64(seed);
    let ws: Vec<QTensor> = outs
        .iter()
        .map(|&o| QTensor::quantize(&tensor(&mut rng, &[o, cols], 0.2), dt).unwrap())
        .collect();
    let refs: Vec<&QTensor> = ws.iter().collect();
    let out: usize = outs.iter().sum();
    let b = bias.then(|| Tensor::from_vec(values(&mut rng, out, 1.0), out, &Device::Cpu).unwrap());
    let x = values(&mut rng, rows * cols, 1.0);

    let dense = QLinear::stacked(&refs, b.as_ref(), 1).unwrap();
    let mut want = vec![0f32; rows * out];
    let xq: Vec<QuantizedRow> = x
        .chunks(cols)
        .map(|r| {
            let mut q = QuantizedRow::default();
            q.quantize_for(&mask(r, None, t), dense.inputs());
            q
        })
        .collect();
    dense
        .forward_quantized(&xq, &mut want, &mut Vec::new())
        .unwrap();
    for tier in SimdLevel::supported() {
        let mut l =
            InputSparseLinear::from_qtensors(&refs, b.as_ref(), threads, Some(tier)).unwrap();
        l.set_threshold(t).unwrap();
        let mut got = vec![0f32; rows * out];
        l.forward_f32(&x, rows, &mut got).unwrap();
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(
            bits(&got),
            bits(&want),
            "{dt:?} {outs:?}x{cols}, {rows} rows, t {t}, bias {bias}, {threads} threads, {tier}"
        );
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 32, ..ProptestConfig::default() })]
    #[test]
    fn input_sparse_linear_is_qlinear_on_masked_inputs(
        outs in prop::collection::vec(1usize..150, 1..4), ib in 1usize..5, kind in 0usize..8,
        rows in 1usize..12, t in 0.0f32..0.9, bias in any::<bool>(), threads in 1usize..4,
        seed in any::<u64>(),
    ) {
        check(&outs, ib, kind, rows, t, bias, threads, seed);
    }
}

#[test]
fn edge_shapes() {
    // Outputs around the 64-row chunk and the 16-row SIMD step; one input block and several.
    for outs in [
        &[1][..],
        &[15],
        &[16],
        &[17],
        &[63],
        &[64],
        &[65],
        &[9, 3, 3],
    ] {
        for ib in [1, 3] {
            for kind in 0..KINDS.len() {
                for t in [0.0, 0.5, 10.0] {
                    check(outs, ib, kind, 2, t, true, 2, (ib * 31 + outs[0]) as u64);
                }
            }
        }
    }
}

#[test]
fn calibration_and_bytes() {
    let mut rng = StdRng::seed_from_u64(3);
    let w = QTensor::quantize(&tensor(&mut rng, &[96, 256], 0.2), GgmlDType::Q4_1).unwrap();
    let mut l = InputSparseLinear::from_qtensors(&[&w], None, 2, None).unwrap();
    assert_eq!(l.dims(), (96, 256));
    let x = values(&mut rng, 32 * 256, 1.0);
    let mut y = vec![0f32; 32 * 96];
    l.record_scores();
    l.forward_f32(&x, 32, &mut y).unwrap();
    let hist = l.take_scores().unwrap();
    assert_eq!(hist.count(), 32 * 256);
    let dense = l.take_traffic();
    // Threshold 0: only inputs that quantize to 0 are skipped (exactly: they add nothing).
    assert_eq!(dense.rows, 32);
    assert!(
        (0.0..0.05).contains(&dense.skipped()),
        "skipped {}",
        dense.skipped()
    );
    l.set_threshold(hist.threshold_for_fraction(0.5).unwrap())
        .unwrap();
    l.forward_f32(&x, 32, &mut y).unwrap();
    // Half the columns skipped; Q4_1's scale planes (4 of every 20 bytes) are still read.
    let s = l.take_traffic().skipped();
    assert!((0.3..0.5).contains(&s), "skipped {s}");
    // As a candle Module: the same values as forward_f32, in the input's shape and dtype.
    let xt = Tensor::from_vec(x[..2 * 256].to_vec(), (1, 2, 256), &Device::Cpu).unwrap();
    let yt = candle_core::Module::forward(&l, &xt).unwrap();
    assert_eq!(yt.dims(), [1, 2, 96]);
    assert_eq!(flat(&yt), y[..2 * 96].to_vec());
}

#[test]
fn bad_input_is_a_typed_error() {
    let mut rng = StdRng::seed_from_u64(4);
    let w = QTensor::quantize(&tensor(&mut rng, &[8, 64], 0.2), GgmlDType::Q8_0).unwrap();
    let w4 = QTensor::quantize(&tensor(&mut rng, &[8, 64], 0.2), GgmlDType::Q4_0).unwrap();
    let narrow = QTensor::quantize(&tensor(&mut rng, &[8, 32], 0.2), GgmlDType::Q8_0).unwrap();
    let f16 = QTensor::quantize(&tensor(&mut rng, &[8, 64], 0.2), GgmlDType::F16).unwrap();
    let msg = |e: powerinfer::Error| e.to_string();
    let mut l = InputSparseLinear::from_qtensors(&[&w], None, 1, None).unwrap();
    let (mut x, mut y) = (vec![0.1f32; 64], vec![0f32; 8]);
    assert!(msg(l.forward_f32(&x[..63], 1, &mut y).unwrap_err()).contains("input"));
    assert!(msg(l.forward_f32(&x, 1, &mut y[..7]).unwrap_err()).contains("output"));
    x[5] = f32::INFINITY;
    assert!(msg(l.forward_f32(&x, 1, &mut y).unwrap_err()).contains("input"));
    for bad in [-0.5, f32::NAN] {
        assert!(msg(l.set_threshold(bad).unwrap_err()).contains("threshold"));
    }
    assert!(
        msg(InputSparseLinear::from_qtensors(&[], None, 1, None).unwrap_err())
            .contains("no tensor")
    );
    assert!(
        msg(InputSparseLinear::from_qtensors(&[&w, &w4], None, 1, None).unwrap_err())
            .contains("stacked tensors differ")
    );
    assert!(
        msg(InputSparseLinear::from_qtensors(&[&w, &narrow], None, 1, None).unwrap_err())
            .contains("stacked tensors differ")
    );
    assert!(
        msg(InputSparseLinear::from_qtensors(&[&f16], None, 1, None).unwrap_err()).contains("F16")
    );
    assert!(
        msg(InputSparseLinear::from_qtensors(&[&w], None, 0, None).unwrap_err())
            .contains("threads")
    );
    let b = Tensor::zeros(7, candle_core::DType::F32, &Device::Cpu).unwrap();
    assert!(
        msg(InputSparseLinear::from_qtensors(&[&w], Some(&b), 1, None).unwrap_err())
            .contains("bias")
    );
    let nan = Tensor::from_vec(vec![f32::NAN; 8], 8, &Device::Cpu).unwrap();
    assert!(
        msg(InputSparseLinear::from_qtensors(&[&w], Some(&nan), 1, None).unwrap_err())
            .contains("bias")
    );
}
