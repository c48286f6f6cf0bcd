//! `InputSparseFfn` against dense references: on GGUF blocks, the FFN over masked inputs is the
//! dense `QLinear` FFN over the same masked inputs bit for bit (every threshold 0: the dense FFN
//! itself), on every tier and thread count, with each matrix by column or as packed rows (whose
//! input is never masked); float storage, by column or row-major, against candle's dense FFN on
//! masked inputs; the rule, calibration, byte accounting and bad input.

mod common;

use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};
use common::*;
use powerinfer::layout::Layout;
use powerinfer::{
    cpu::ColumnStorage, cpu::SimdLevel, layers::QLinear, Activation, FfnSpec, FfnWeights,
    InputScore, InputSparseFfn, InputThresholds,
};
use proptest::prelude::*;
use rand::{rngs::StdRng, SeedableRng};

/// Column norms of a `[rows, cols]` f32 matrix.
fn norms(t: &Tensor) -> Vec<f32> {
    let t2 = t.sqr().unwrap().sum(0).unwrap().sqrt().unwrap();
    flat(&t2)
}

#[allow(clippy::too_many_arguments)]
fn check_quant(
    hidden_blocks: usize,
    inter_blocks: usize,
    kind: usize,
    rows: usize,
    t: [f32; 3],
    wina: bool,
    threads: usize,
    seed: u64,
    layouts: [Layout; 3],
    masked_rows: bool,
) {
    let dt = KINDS[kind];
    let be = dt.block_size();
    let (h, n) = (be * hidden_blocks, be * inter_blocks);
    let spec = FfnSpec::gated(h, n, Activation::Silu).unwrap();
    let mut rng = StdRng::seed_from_u64(seed);
    let w = Weights::random(&spec, seed);
    let q = |t: &Tensor| QTensor::quantize(t, dt).unwrap();
    let (qg, qu, qd) = (q(w.gate.as_ref().unwrap()), q(&w.up), q(&w.down));
    let deq = |q: &QTensor| q.dequantize(&Device::Cpu).unwrap();
    let (ng, nu, nd) = (norms(&deq(&qg)), norms(&deq(&qu)), norms(&deq(&qd)));
    let x = flat(&tensor(&mut rng, &[rows, h], 1.0));
    let score = if wina {
        InputScore::Wina
    } else {
        InputScore::Magnitude
    };
    let th = InputThresholds {
        gate: t[0],
        up: t[1],
        down: t[2],
    };
    // Reference: the dense QLinear FFN on the masked rows.
    let gl = QLinear::new(&qg, None, 1).unwrap();
    let ul = QLinear::new(&qu, None, 1).unwrap();
    let dl = QLinear::new(&qd, None, 1).unwrap();
    let mut want = Vec::new();
    let (mut g, mut u, mut y) = (vec![0f32; n], vec![0f32; n], vec![0f32; h]);
    let pick = |v: &[f32]| wina.then(|| v.to_vec());
    // A matrix stored as rows reads its whole input (threshold 0 keeps every nonzero entry),
    // unless its rows are masked too.
    let t: [f32; 3] = std::array::from_fn(|i| match layouts[i] {
        Layout::Rows if !masked_rows => 0.0,
        _ => t[i],
    });
    for xr in x.chunks(h) {
        let xg = quantized_for(&gl, &mask(xr, pick(&ng).as_deref(), t[0]));
        let xu = quantized_for(&ul, &mask(xr, pick(&nu).as_deref(), t[1]));
        gl.forward_quantized(&[xg], &mut g, &mut Vec::new())
            .unwrap();
        ul.forward_quantized(&[xu], &mut u, &mut Vec::new())
            .unwrap();
        let hv: Vec<f32> = g
            .iter()
            .zip(&u)
            .map(|(&g, &u)| Activation::Silu.gated(g, u))
            .collect();
        let hq = quantized_for(&dl, &mask(&hv, pick(&nd).as_deref(), t[2]));
        dl.forward_quantized(&[hq], &mut y, &mut Vec::new())
            .unwrap();
        want.extend(y.iter().map(|v| v.to_bits()));
    }
    for tier in SimdLevel::supported() {
        let mut f = InputSparseFfn::from_qtensors_as(
            spec,
            Some(&qg),
            &qu,
            &qd,
            threads,
            Some(tier),
            layouts,
        )
        .unwrap();
        assert_eq!(f.layouts(), layouts);
        f.set_rule(score, th).unwrap();
        f.mask_rows(masked_rows);
        let mut out = vec![0f32; rows * h];
        f.forward_f32(&x, rows, &mut out).unwrap();
        let got: Vec<u32> = out.iter().map(|v| v.to_bits()).collect();
        assert_eq!(
            got, want,
            "{dt:?} {h}x{n} {rows} rows, {t:?}, wina {wina}, {threads} threads, {tier}, \
             {layouts:?}, masked rows {masked_rows}"
        );
        // Every matrix unmasked rows: the packed rows run as the dense FFN give the same bits.
        let plain = layouts == [Layout::Rows; 3] && !masked_rows;
        assert_eq!(
            f.dense_rows().is_some(),
            plain,
            "{layouts:?}, masked {masked_rows}"
        );
        if let Some([g, u, d]) = f.dense_rows() {
            let gu = QLinear::from_parts(vec![g.clone(), u.clone()], None, threads).unwrap();
            let dl = QLinear::from_packed(d.clone(), None, threads).unwrap();
            let (mut guv, mut hv, mut y) = (vec![0f32; 2 * n], vec![0f32; n], vec![0f32; h]);
            let mut dense = Vec::new();
            for xr in x.chunks(h) {
                gu.forward_f32(xr, 1, &mut guv).unwrap();
                Activation::Silu.gated_into(&guv[..n], &guv[n..], &mut hv);
                dl.forward_f32(&hv, 1, &mut y).unwrap();
                dense.extend(y.iter().map(|v| v.to_bits()));
            }
            assert_eq!(dense, want, "{dt:?} {h}x{n}, {threads} threads: dense rows");
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 32, ..ProptestConfig::default() })]
    #[test]
    fn quantized_ffn_is_the_dense_ffn_on_masked_inputs(
        hb in 1usize..4, ib in 1usize..5, kind in 0usize..8, rows in 1usize..12,
        tg in 0.0f32..0.8, tu in 0.0f32..0.8, td in 0.0f32..0.05, wina in any::<bool>(),
        threads in 1usize..4, seed in any::<u64>(), rows_mask in 0usize..8,
        masked_rows in any::<bool>(),
    ) {
        let l = layouts(rows_mask);
        check_quant(hb, ib, kind, rows, [tg, tu, td], wina, threads, seed, l, masked_rows);
    }

    #[test]
    fn float_ffn_matches_candle_on_masked_inputs(
        h in 1usize..70, n in 1usize..90, storage in 0usize..3, rows in 1usize..4,
        t in 0.0f32..0.6, td in 0.0f32..0.05, threads in 1usize..3, seed in any::<u64>(),
        rows_mask in 0usize..8, masked_rows in any::<bool>(),
    ) {
        let st = [ColumnStorage::F32, ColumnStorage::F16, ColumnStorage::BF16][storage];
        check_float(h, n, st, rows, [t, t, td], threads, seed, layouts(rows_mask), masked_rows);
    }
}

/// Float storage in `lay` (each matrix by column or row-major) against candle's dense FFN in
/// f32 on the stored (rounded) weights, each product's input masked unless its matrix is
/// unmasked rows.
#[allow(clippy::too_many_arguments)]
fn check_float(
    h: usize,
    n: usize,
    st: ColumnStorage,
    rows: usize,
    t: [f32; 3],
    threads: usize,
    seed: u64,
    lay: [Layout; 3],
    masked_rows: bool,
) {
    use candle_core::DType;
    let spec = FfnSpec::gated(h, n, Activation::Silu).unwrap();
    let w = Weights::random(&spec, seed);
    let mut f = InputSparseFfn::from_weights_as(spec, w.view(), st, threads, None, lay).unwrap();
    assert_eq!(f.layouts(), lay);
    let th = InputThresholds {
        gate: t[0],
        up: t[1],
        down: t[2],
    };
    f.set_rule(InputScore::Magnitude, th).unwrap();
    f.mask_rows(masked_rows);
    let mut rng = StdRng::seed_from_u64(seed ^ 1);
    let x = flat(&tensor(&mut rng, &[rows, h], 1.0));
    let mut out = vec![0f32; rows * h];
    f.forward_f32(&x, rows, &mut out).unwrap();
    let round = |t: &Tensor| {
        t.to_dtype(st_dtype(st))
            .unwrap()
            .to_dtype(DType::F32)
            .unwrap()
    };
    let (g, u, d) = (
        round(w.gate.as_ref().unwrap()),
        round(&w.up),
        round(&w.down),
    );
    let masks = |i: usize| lay[i] == Layout::Columns || masked_rows;
    let input = |v: &[f32], i: usize, cols: usize| {
        let v = if masks(i) {
            mask(v, None, t[i])
        } else {
            v.to_vec()
        };
        Tensor::from_vec(v, (rows, cols), &Device::Cpu).unwrap()
    };
    let mm = |a: &Tensor, w: &Tensor| a.matmul(&w.t().unwrap()).unwrap();
    let hv = (candle_nn::ops::silu(&mm(&input(&x, 0, h), &g)).unwrap() * mm(&input(&x, 1, h), &u))
        .unwrap();
    let want = mm(&input(&flat(&hv), 2, n), &d);
    let got = Tensor::from_vec(out, (rows, h), &Device::Cpu).unwrap();
    let e = rel_err(&got, &want);
    assert!(
        e <= 1e-4,
        "{st:?} {h}x{n}, {rows} rows, {threads} threads, {lay:?}, masked {masked_rows}: rel err {e}"
    );
}

/// Float storage at the kernels' edges: sizes 1, odd, the four-row step and the SIMD widths
/// (8 and 16 lanes) plus and minus one, each matrix by column and row-major.
#[test]
fn float_edge_shapes() {
    let sizes = [
        (1, 1),
        (1, 17),
        (15, 16),
        (16, 17),
        (17, 15),
        (7, 9),
        (33, 65),
    ];
    for (i, (h, n)) in sizes.into_iter().enumerate() {
        for st in [ColumnStorage::F32, ColumnStorage::F16, ColumnStorage::BF16] {
            for (m, masked) in [(0, false), (0b111, false), (0b101, true), (0b010, false)] {
                let t = [0.3, 0.2, 0.01];
                check_float(h, n, st, 3, t, 1 + i % 3, i as u64, layouts(m), masked);
            }
        }
    }
}

/// Several rows at once (a prompt: each product reads the union of the rows' kept channels)
/// against each row alone (a decoded token), bit for bit: block types, float storage with
/// biases, ungated, every tier, 1-3 threads, row counts around the kernel's tiles (8, 4, 2, 1).
#[test]
fn prompt_rows_are_each_row_alone() {
    let check = |f: &InputSparseFfn, x: &[f32], rows: usize, what: &str| {
        let h = f.spec().hidden();
        let mut all = vec![0f32; rows * h];
        f.forward_f32(x, rows, &mut all).unwrap();
        let mut one = vec![0f32; h];
        for (r, xr) in x.chunks(h).enumerate() {
            f.forward_f32(xr, 1, &mut one).unwrap();
            let bits = |v: &[f32]| v.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
            assert_eq!(
                bits(&all[r * h..(r + 1) * h]),
                bits(&one),
                "{what}: row {r} of {rows}"
            );
        }
    };
    let th = InputThresholds {
        gate: 0.4,
        up: 0.3,
        down: 0.02,
    };
    let mut rng = StdRng::seed_from_u64(17);
    for (i, dt) in KINDS.iter().enumerate() {
        let be = dt.block_size();
        let spec = FfnSpec::gated(2 * be, 3 * be, Activation::Silu).unwrap();
        let w = Weights::random(&spec, i as u64);
        let q = |t: &Tensor| QTensor::quantize(t, *dt).unwrap();
        let (qg, qu, qd) = (q(w.gate.as_ref().unwrap()), q(&w.up), q(&w.down));
        for tier in SimdLevel::supported() {
            for threads in 1..4 {
                let mut f =
                    InputSparseFfn::from_qtensors(spec, Some(&qg), &qu, &qd, threads, Some(tier))
                        .unwrap();
                for (score, rows) in [(InputScore::Magnitude, 13), (InputScore::Wina, 7)] {
                    f.set_rule(score, th).unwrap();
                    let x = flat(&tensor(&mut rng, &[rows, spec.hidden()], 1.0));
                    check(
                        &f,
                        &x,
                        rows,
                        &format!("{dt:?} {score:?} {threads} threads {tier}"),
                    );
                }
            }
        }
    }
    for (st, gated) in [
        (ColumnStorage::F32, true),
        (ColumnStorage::F16, false),
        (ColumnStorage::BF16, true),
    ] {
        let spec = match gated {
            true => FfnSpec::gated(70, 130, Activation::Silu),
            false => FfnSpec::ungated(70, 130, Activation::Gelu),
        }
        .unwrap();
        let w = Weights::random(&spec, 3);
        let mut b = |n: usize| tensor(&mut rng, &[n], 0.5);
        let (bg, bu, bd) = (b(130), b(130), b(70));
        let mut view = w.view();
        view.gate_bias = gated.then_some(&bg);
        view.up_bias = Some(&bu);
        view.down_bias = Some(&bd);
        for lay in [[Layout::Columns; 3], [Layout::Rows; 3]] {
            let mut f = InputSparseFfn::from_weights_as(spec, view, st, 2, None, lay).unwrap();
            f.set_rule(
                InputScore::Magnitude,
                InputThresholds {
                    gate: 0.3,
                    up: 0.3,
                    down: 0.02,
                },
            )
            .unwrap();
            let x = flat(&tensor(&mut rng, &[9, 70], 1.0));
            check(&f, &x, 9, &format!("{st:?} gated {gated} {lay:?}"));
        }
    }
}

fn st_dtype(s: ColumnStorage) -> candle_core::DType {
    match s {
        ColumnStorage::F16 => candle_core::DType::F16,
        ColumnStorage::BF16 => candle_core::DType::BF16,
        _ => candle_core::DType::F32,
    }
}

/// Gate, up and down as rows where bit 0, 1, 2 of `mask` is set, by column elsewhere.
fn layouts(mask: usize) -> [Layout; 3] {
    std::array::from_fn(|i| {
        if mask >> i & 1 == 1 {
            Layout::Rows
        } else {
            Layout::Columns
        }
    })
}

#[test]
fn edge_shapes() {
    for (hb, ib) in [(1, 1), (1, 2), (2, 1), (3, 3)] {
        for kind in 0..KINDS.len() {
            for t in [[0.0; 3], [0.5, 0.2, 0.01], [10.0, 10.0, 10.0]] {
                for (m, masked) in [(0, false), (0b011, false), (0b100, true), (0b111, false)] {
                    let seed = (hb * 7 + ib) as u64;
                    check_quant(hb, ib, kind, 2, t, false, 2, seed, layouts(m), masked);
                }
            }
        }
    }
    // Packed rows take prompts in tiles of 32 input rows: one row past a tile, and one short.
    for rows in [31, 33] {
        check_quant(
            1,
            2,
            5,
            rows,
            [0.4, 0.3, 0.01],
            false,
            3,
            5,
            layouts(0b101),
            false,
        );
        check_quant(
            1,
            2,
            5,
            rows,
            [0.4, 0.3, 0.01],
            false,
            3,
            5,
            layouts(0b111),
            true,
        );
    }
}

#[test]
fn calibration_thresholds_drop_the_asked_fraction_and_bytes_follow() {
    let spec = FfnSpec::gated(128, 256, Activation::Silu).unwrap();
    let w = Weights::random(&spec, 5);
    let q = |t: &Tensor| QTensor::quantize(t, GgmlDType::Q4_1).unwrap();
    let mut f = InputSparseFfn::from_qtensors(
        spec,
        Some(&q(w.gate.as_ref().unwrap())),
        &q(&w.up),
        &q(&w.down),
        2,
        None,
    )
    .unwrap();
    let mut rng = StdRng::seed_from_u64(6);
    let x = flat(&tensor(&mut rng, &[64, 128], 1.0));
    let mut out = vec![0f32; x.len()];
    f.record_scores();
    f.forward_f32(&x, 64, &mut out).unwrap();
    let scores = f.take_scores().unwrap();
    assert_eq!(scores.gate.count(), 64 * 128);
    assert_eq!(scores.down.count(), 64 * 256);

    let dense = f.take_traffic();
    assert_eq!(dense.rows, 64);
    // Dense: only inputs that quantize to 0 are skipped (exactly: they add nothing).
    assert!(
        (0.0..0.05).contains(&dense.skipped()),
        "dense skipped {}",
        dense.skipped()
    );
    let t = scores.thresholds([0.5, 0.5, 0.5]).unwrap();
    f.set_rule(InputScore::Magnitude, t).unwrap();
    f.forward_f32(&x, 64, &mut out).unwrap();
    let sparse = f.take_traffic();
    // Half the values dropped (to the histogram's 1/16-octave resolution); the scale planes of
    // Q4_1 (4 of every 20 bytes) are still read.
    let s = sparse.skipped();
    assert!((0.3..0.5).contains(&s), "skipped {s}");
}

#[test]
fn bad_input_is_a_typed_error() {
    let spec = FfnSpec::gated(32, 64, Activation::Silu).unwrap();
    let w = Weights::random(&spec, 1);
    let q = |t: &Tensor| QTensor::quantize(t, GgmlDType::Q8_0).unwrap();
    let (g, u, d) = (q(w.gate.as_ref().unwrap()), q(&w.up), q(&w.down));
    let mut f = InputSparseFfn::from_qtensors(spec, Some(&g), &u, &d, 1, None).unwrap();
    let msg = |e: powerinfer::Error| e.to_string();
    let mut out = vec![0f32; 32];
    let mut x = vec![0.1f32; 32];
    assert!(msg(f.forward_f32(&x[..31], 1, &mut out).unwrap_err()).contains("input"));
    assert!(msg(f.forward_f32(&x, 1, &mut out[..3]).unwrap_err()).contains("output"));
    x[3] = f32::NAN;
    assert!(msg(f.forward_f32(&x, 1, &mut out).unwrap_err()).contains("NaN"));
    for bad in [-1.0, f32::NAN, f32::INFINITY] {
        let t = InputThresholds {
            gate: 0.0,
            up: bad,
            down: 0.0,
        };
        assert!(msg(f.set_rule(InputScore::Wina, t).unwrap_err()).contains("up threshold"));
    }
    assert!(
        msg(InputSparseFfn::from_qtensors(spec, Some(&g), &d, &d, 1, None).unwrap_err())
            .contains("up_proj")
    );
    assert!(
        msg(InputSparseFfn::from_qtensors(spec, None, &u, &d, 1, None).unwrap_err())
            .contains("gate")
    );
    assert!(
        msg(InputSparseFfn::from_qtensors(spec, Some(&g), &u, &d, 0, None).unwrap_err())
            .contains("threads")
    );
    let f16 = QTensor::quantize(w.gate.as_ref().unwrap(), GgmlDType::F16).unwrap();
    assert!(
        msg(InputSparseFfn::from_qtensors(spec, Some(&f16), &u, &d, 1, None).unwrap_err())
            .contains("Q8_0, Q4_K, Q5_K and Q6_K")
    );
    assert!(InputScore::from_name("relu").is_err());
}

/// `InputSparseFfn::load` reads a candle MLP from its `VarBuilder` as `HybridFfn::load` does
/// (gated `gate_proj`/`up_proj`/`down_proj` or ungated `fc1`/`fc2` with biases, in the
/// `VarBuilder`'s dtype) and gives `from_weights`' bits under the options' rule; a missing
/// tensor is named in full and an integer dtype is refused.
#[test]
fn var_builder_load_is_from_weights() {
    use candle_core::DType;
    use candle_nn::VarBuilder;
    use powerinfer::{ErrorKind, InputSparseOptions};
    use std::collections::HashMap;

    let mut rng = StdRng::seed_from_u64(5);
    let th = InputThresholds {
        gate: 0.3,
        up: 0.2,
        down: 0.02,
    };
    for (gated, dtype, storage) in [
        (true, DType::F32, ColumnStorage::F32),
        (false, DType::BF16, ColumnStorage::BF16),
        (true, DType::F16, ColumnStorage::F16),
    ] {
        let spec = match gated {
            true => FfnSpec::gated(48, 80, Activation::Silu),
            false => FfnSpec::ungated(48, 80, Activation::Gelu),
        }
        .unwrap();
        let w = Weights::random(&spec, 9);
        let bu = tensor(&mut rng, &[80], 0.5);
        let names = match gated {
            true => ["mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"],
            false => ["", "mlp.fc1", "mlp.fc2"],
        };
        let mut m = HashMap::new();
        if let Some(g) = &w.gate {
            m.insert(format!("{}.weight", names[0]), g.clone());
        }
        m.insert(format!("{}.weight", names[1]), w.up.clone());
        m.insert(format!("{}.weight", names[2]), w.down.clone());
        m.insert(format!("{}.bias", names[1]), bu.clone());
        let vb = VarBuilder::from_tensors(m.clone(), dtype, &Device::Cpu);
        let opts = InputSparseOptions {
            threads: 2,
            score: InputScore::Wina,
            thresholds: th,
            ..Default::default()
        };
        let f = InputSparseFfn::load(spec.activation(), vb.pp("mlp"), opts).unwrap();
        assert_eq!(*f.spec(), spec, "sizes and gating from the weights");
        assert_eq!((f.score(), f.thresholds()), (InputScore::Wina, th));

        // The same tensors as the VarBuilder hands them out (converted to its dtype).
        let conv = |t: &Tensor| t.to_dtype(dtype).unwrap();
        let (g, u, d, b) = (
            w.gate.as_ref().map(conv),
            conv(&w.up),
            conv(&w.down),
            conv(&bu),
        );
        let view = FfnWeights {
            gate: g.as_ref(),
            up: &u,
            down: &d,
            gate_bias: None,
            up_bias: Some(&b),
            down_bias: None,
        };
        let mut r = InputSparseFfn::from_weights(spec, view, storage, 2, None).unwrap();
        r.set_rule(InputScore::Wina, th).unwrap();
        let x = flat(&tensor(&mut rng, &[3, 48], 1.0));
        let (mut a, mut e) = (vec![0f32; 3 * 48], vec![0f32; 3 * 48]);
        f.forward_f32(&x, 3, &mut a).unwrap();
        r.forward_f32(&x, 3, &mut e).unwrap();
        let bits = |v: &[f32]| v.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&a), bits(&e), "gated {gated} {dtype:?}");
        assert_eq!(f.weight_bytes(), r.weight_bytes(), "stored as {storage:?}");

        m.remove(&format!("{}.weight", names[2]));
        let vb = VarBuilder::from_tensors(m, dtype, &Device::Cpu);
        let err = InputSparseFfn::load(spec.activation(), vb.pp("mlp"), opts).unwrap_err();
        let missing = format!("{}.weight", names[2]);
        assert!(
            matches!(err.kind(), ErrorKind::MissingTensor { name } if *name == missing),
            "{err}"
        );
    }
    // The default options (every threshold 0) store each matrix row-major, read by the dense
    // row kernels; asked for, by column; with a threshold, that matrix by column.
    let spec = FfnSpec::gated(40, 72, Activation::Silu).unwrap();
    let w = Weights::random(&spec, 4);
    let m = HashMap::from([
        ("gate_proj.weight".to_string(), w.gate.clone().unwrap()),
        ("up_proj.weight".to_string(), w.up.clone()),
        ("down_proj.weight".to_string(), w.down.clone()),
    ]);
    let vb = VarBuilder::from_tensors(m, DType::F32, &Device::Cpu);
    let load = |opts| InputSparseFfn::load(Activation::Silu, vb.clone(), opts).unwrap();
    let rows = load(InputSparseOptions::default());
    assert_eq!(rows.layouts(), [Layout::Rows; 3]);
    let columns = load(InputSparseOptions {
        layouts: Some([Layout::Columns; 3]),
        ..Default::default()
    });
    assert_eq!(columns.layouts(), [Layout::Columns; 3]);
    let down = load(InputSparseOptions {
        thresholds: InputThresholds {
            down: 0.1,
            ..Default::default()
        },
        ..Default::default()
    });
    assert_eq!(
        down.layouts(),
        [Layout::Rows, Layout::Rows, Layout::Columns]
    );
    let x = flat(&tensor(&mut rng, &[2, 40], 1.0));
    let (mut a, mut b) = (vec![0f32; 80], vec![0f32; 80]);
    rows.forward_f32(&x, 2, &mut a).unwrap();
    columns.forward_f32(&x, 2, &mut b).unwrap();
    let (a, b) = (
        Tensor::from_vec(a, (2, 40), &Device::Cpu).unwrap(),
        Tensor::from_vec(b, (2, 40), &Device::Cpu).unwrap(),
    );
    assert!(
        rel_err(&a, &b) <= 1e-5,
        "rows against columns: {}",
        rel_err(&a, &b)
    );

    let vb = VarBuilder::from_tensors(HashMap::new(), DType::U32, &Device::Cpu);
    let err = InputSparseFfn::load(Activation::Silu, vb, InputSparseOptions::default());
    assert!(err.unwrap_err().to_string().contains("VarBuilder dtype"));
}

/// The layout planner: a decision per (matrix, block type, shape), reused for the next layer
/// with the same key; the layout follows the measured times (columns only below `MARGIN` of the
/// rows' time); nothing dropped, or too little for the bytes skipped to pay, means rows without
/// timing columns; a fraction outside [0, 1) is a typed error.
#[test]
fn layout_planner_decides_once_per_key_from_its_measurements() {
    use powerinfer::layout::{FfnMatrix, LayoutPlanner, MARGIN};
    let spec = FfnSpec::gated(256, 512, Activation::Silu).unwrap();
    let w = Weights::random(&spec, 3);
    let q = |t: &Tensor| QTensor::quantize(t, GgmlDType::Q4K).unwrap();
    let (g, u, d) = (q(w.gate.as_ref().unwrap()), q(&w.up), q(&w.down));
    let p = LayoutPlanner::new([0.5, 0.5, 0.0], 2, None).unwrap();
    let lg = p.layout(FfnMatrix::Gate, &g, 512, 256).unwrap();
    assert_eq!(p.layout(FfnMatrix::Gate, &g, 512, 256).unwrap(), lg);
    p.layout(FfnMatrix::Up, &u, 512, 256).unwrap();
    assert_eq!(
        p.layout(FfnMatrix::Down, &d, 256, 512).unwrap(),
        Layout::Rows
    );
    let ds = p.decisions();
    assert_eq!(ds.len(), 3, "{ds:?}");
    for d in &ds[..2] {
        assert!(d.rows_ms > 0.0 && d.columns_ms > 0.0, "{d}");
        assert!(d.columns_bytes < d.rows_bytes, "{d}");
        let columns = d.columns_ms < MARGIN * d.rows_ms;
        assert_eq!(d.layout == Layout::Columns, columns, "{d}");
        assert!((d.kept - 0.5).abs() < 1e-12);
    }
    assert_eq!(ds[0].layout, lg);
    assert!(
        ds[2].columns_ms == 0.0 && ds[2].layout == Layout::Rows,
        "{}",
        ds[2]
    );
    assert!(ds[2].to_string().ends_with("-> rows"), "{}", ds[2]);
    // A wrong shape names the matrix; a bad fraction is refused.
    let e = p
        .layout(FfnMatrix::Up, &u, 256, 512)
        .unwrap_err()
        .to_string();
    assert!(e.contains("up"), "{e}");
    for bad in [[1.0, 0.0, 0.0], [0.0, -0.1, 0.0], [0.0, 0.0, f64::NAN]] {
        let e = LayoutPlanner::new(bad, 1, None).unwrap_err().to_string();
        assert!(e.contains("expected input sparsity"), "{e}");
    }
    assert!(LayoutPlanner::new([0.0; 3], 0, None).is_err());

    // 5% dropped: the columns would read over `MARGIN` of the rows' bytes, so no timing can
    // make them pay; they are not timed, and the decision says why.
    let p = LayoutPlanner::new([0.05; 3], 2, None).unwrap();
    assert_eq!(
        p.layout(FfnMatrix::Gate, &g, 512, 256).unwrap(),
        Layout::Rows
    );
    let d = &p.decisions()[0];
    assert!(d.rows_ms > 0.0 && d.columns_ms == 0.0, "{d}");
    assert!(
        d.columns_bytes as f64 >= MARGIN * d.rows_bytes as f64,
        "{d}"
    );
    assert!(d.to_string().contains("not timed"), "{d}");
}
