//! Bad input gives a typed error naming what was wrong; never a panic.

mod common;

use candle_core::{DType, Device, Module, Tensor};
use candle_nn::VarBuilder;
use common::*;
use powerinfer::{
    predict::Oracle, tier::plan_placement, tier::LayerPlacement, Activation, ErrorKind, FfnSpec,
    FfnWeights, GateFirst, HybridFfn, HybridOptions, LowRank, NeuronBundles, WeightDType,
};
use std::collections::HashMap;

fn spec() -> FfnSpec {
    FfnSpec::gated(16, 24, Activation::Silu).unwrap()
}

fn ffn() -> HybridFfn {
    let s = spec();
    let w = Weights::random(&s, 1);
    HybridFfn::from_weights(s, w.view(), WeightDType::F32, HybridOptions::default()).unwrap()
}

#[test]
fn mismatched_weight_shapes_name_the_tensor() {
    let s = spec();
    let w = Weights::random(&s, 1);
    let bad_up = Tensor::zeros((24, 15), DType::F32, &Device::Cpu).unwrap();
    let e = NeuronBundles::from_weights(
        s,
        FfnWeights::gated(w.gate.as_ref().unwrap(), &bad_up, &w.down),
        WeightDType::F32,
    )
    .unwrap_err();
    match e.kind() {
        ErrorKind::Shape { tensor, got, .. } => {
            assert_eq!(tensor, "up_proj.weight");
            assert_eq!(got, &[24, 15]);
        }
        k => panic!("{k:?}"),
    }
    assert!(e.to_string().contains("up_proj.weight"));
    let bad_down = Tensor::zeros((24, 16), DType::F32, &Device::Cpu).unwrap();
    let e = NeuronBundles::from_weights(
        s,
        FfnWeights::gated(w.gate.as_ref().unwrap(), &w.up, &bad_down),
        WeightDType::F32,
    )
    .unwrap_err();
    assert!(matches!(e.kind(), ErrorKind::Shape { tensor, .. } if tensor == "down_proj.weight"));
}

#[test]
fn wrong_dtypes_are_rejected() {
    let s = spec();
    let w = Weights::random(&s, 1);
    let up_u8 = w.up.to_dtype(DType::U8).unwrap();
    let e = NeuronBundles::from_weights(
        s,
        FfnWeights::gated(w.gate.as_ref().unwrap(), &up_u8, &w.down),
        WeightDType::F32,
    )
    .unwrap_err();
    assert!(
        matches!(e.kind(), ErrorKind::DType { tensor, got: DType::U8 } if tensor == "up_proj.weight")
    );
    let x = Tensor::zeros((1, 16), DType::F64, &Device::Cpu).unwrap();
    let e = ffn().forward_tensor(&x).unwrap_err();
    assert!(matches!(e.kind(), ErrorKind::DType { tensor, got: DType::F64 } if tensor == "input"));
}

#[test]
fn wrong_input_shape_is_rejected() {
    let x = Tensor::zeros((2, 3, 15), DType::F32, &Device::Cpu).unwrap();
    let e = ffn().forward_tensor(&x).unwrap_err();
    assert!(
        matches!(e.kind(), ErrorKind::Shape { tensor, got, .. } if tensor == "input" && got == &[2, 3, 15])
    );
    // Through candle's Module the same error arrives wrapped in candle's error.
    let e = ffn().forward(&x).unwrap_err();
    assert!(e.to_string().contains("input"), "{e}");
    let mut out = vec![0.0; 16];
    let e = ffn().forward_f32(&[0.0; 31], 2, &mut out).unwrap_err();
    assert!(matches!(e.kind(), ErrorKind::Shape { .. }));
}

#[test]
fn out_of_range_and_duplicate_neurons() {
    let e = LayerPlacement::new(24, vec![3, 24], Some(5)).unwrap_err();
    assert!(matches!(
        e.kind(),
        ErrorKind::NeuronOutOfRange {
            layer: Some(5),
            neuron: 24,
            intermediate: 24
        }
    ));
    assert!(e.to_string().contains("layer 5") && e.to_string().contains("24"));
    let e = LayerPlacement::new(24, vec![3, 3], None).unwrap_err();
    assert!(matches!(
        e.kind(),
        ErrorKind::DuplicateNeuron { neuron: 3, .. }
    ));
    let e = ffn()
        .with_placement(LayerPlacement::all_hot(23))
        .unwrap_err();
    assert!(matches!(
        e.kind(),
        ErrorKind::Count {
            expected: 24,
            got: 23,
            ..
        }
    ));
    // An oracle naming a neuron that does not exist.
    let f = HybridFfn::from_weights(
        spec(),
        Weights::random(&spec(), 1).view(),
        WeightDType::F32,
        HybridOptions {
            layer: Some(2),
            ..Default::default()
        },
    )
    .unwrap()
    .with_predictor(Oracle::new(vec![vec![0, 99]]));
    let x = Tensor::ones((1, 16), DType::F32, &Device::Cpu).unwrap();
    let e = f.forward_tensor(&x).unwrap_err();
    assert!(
        matches!(
            e.kind(),
            ErrorKind::NeuronOutOfRange {
                layer: Some(2),
                neuron: 99,
                intermediate: 24
            }
        ),
        "{e}"
    );
}

#[test]
fn empty_tensors_and_specs() {
    assert!(
        matches!(FfnSpec::gated(0, 4, Activation::Relu).unwrap_err().kind(), ErrorKind::Config { setting, .. } if setting == "hidden")
    );
    assert!(
        matches!(FfnSpec::gated(4, 0, Activation::Relu).unwrap_err().kind(), ErrorKind::Config { setting, .. } if setting == "intermediate")
    );
    assert!(FfnSpec::ungated(4, 4, Activation::DRelu).is_err());
    let s = spec();
    let empty = Tensor::zeros((0, 16), DType::F32, &Device::Cpu).unwrap();
    let w = Weights::random(&s, 1);
    let e = NeuronBundles::from_weights(
        s,
        FfnWeights::gated(&empty, &w.up, &w.down),
        WeightDType::F32,
    )
    .unwrap_err();
    assert!(matches!(e.kind(), ErrorKind::Shape { tensor, .. } if tensor == "gate_proj.weight"));
}

#[test]
fn nan_inputs_and_weights() {
    let mut x = vec![0.5f32; 32];
    x[21] = f32::NAN;
    let xt = Tensor::from_vec(x.clone(), (2, 16), &Device::Cpu).unwrap();
    let e = ffn().forward_tensor(&xt).unwrap_err();
    assert!(matches!(e.kind(), ErrorKind::NonFinite { tensor, index: 21 } if tensor == "input"));
    let mut out = vec![0.0; 32];
    assert!(matches!(
        ffn().forward_f32(&x, 2, &mut out).unwrap_err().kind(),
        ErrorKind::NonFinite { index: 21, .. }
    ));
    // Infinity in bf16 input.
    let xt = Tensor::from_vec(vec![f32::INFINITY; 16], (1, 16), &Device::Cpu)
        .unwrap()
        .to_dtype(DType::BF16)
        .unwrap();
    assert!(matches!(
        ffn().forward_tensor(&xt).unwrap_err().kind(),
        ErrorKind::NonFinite { index: 0, .. }
    ));
    // NaN in a weight.
    let s = spec();
    let w = Weights::random(&s, 1);
    let mut d: Vec<f32> = w.down.flatten_all().unwrap().to_vec1().unwrap();
    d[5] = f32::NAN;
    let down = Tensor::from_vec(d, (16, 24), &Device::Cpu).unwrap();
    let e = NeuronBundles::from_weights(
        s,
        FfnWeights::gated(w.gate.as_ref().unwrap(), &w.up, &down),
        WeightDType::F16,
    )
    .unwrap_err();
    assert!(
        matches!(e.kind(), ErrorKind::NonFinite { tensor, .. } if tensor == "down_proj.weight")
    );
}

#[test]
fn bad_budgets_and_frequencies() {
    let f = vec![vec![0.5, 0.1], vec![0.2]];
    assert!(matches!(
        plan_placement(&f, &[10, 10], 0).unwrap_err().kind(),
        ErrorKind::Budget { budget: 0, .. }
    ));
    assert!(matches!(
        plan_placement(&f, &[10, 10], 9).unwrap_err().kind(),
        ErrorKind::Budget { budget: 9, .. }
    ));
    assert!(matches!(
        plan_placement(&f, &[10], 100).unwrap_err().kind(),
        ErrorKind::Count { .. }
    ));
    let nan = vec![vec![0.5, f64::NAN]];
    assert!(matches!(
        plan_placement(&nan, &[10], 100).unwrap_err().kind(),
        ErrorKind::NonFinite { index: 1, .. }
    ));
}

#[test]
fn bad_predictor_settings() {
    assert!(matches!(
        GateFirst::new(-1.0).unwrap_err().kind(),
        ErrorKind::Config { .. }
    ));
    assert!(GateFirst::new(f32::NAN).is_err());
    let fc1 = Tensor::zeros((4, 16), DType::F32, &Device::Cpu).unwrap();
    let fc2 = Tensor::zeros((24, 5), DType::F32, &Device::Cpu).unwrap();
    assert!(
        matches!(LowRank::new(&fc1, &fc2, 0.0).unwrap_err().kind(), ErrorKind::Shape { tensor, .. } if tensor == "predictor.fc2.weight")
    );
    // A predictor for a different layer size fails at predict time with the sizes named.
    let fc2 = Tensor::zeros((30, 4), DType::F32, &Device::Cpu).unwrap();
    let f = ffn().with_predictor(LowRank::new(&fc1, &fc2, 0.0).unwrap());
    let x = Tensor::ones((1, 16), DType::F32, &Device::Cpu).unwrap();
    assert!(matches!(
        f.forward_tensor(&x).unwrap_err().kind(),
        ErrorKind::Shape { .. }
    ));
    let e = HybridFfn::new(
        ffn().bundles().clone(),
        HybridOptions {
            threads: 0,
            ..Default::default()
        },
    )
    .unwrap_err();
    assert!(matches!(e.kind(), ErrorKind::Config { setting, .. } if setting == "threads"));
}

#[test]
fn var_builder_missing_tensor_is_named() {
    let s = spec();
    let w = Weights::random(&s, 1);
    let mut m = HashMap::new();
    m.insert(
        "model.layers.3.mlp.gate_proj.weight".to_string(),
        w.gate.clone().unwrap(),
    );
    m.insert(
        "model.layers.3.mlp.down_proj.weight".to_string(),
        w.down.clone(),
    );
    let vb = VarBuilder::from_tensors(m, DType::F32, &Device::Cpu);
    let e = HybridFfn::load(
        s.activation(),
        vb.pp("model.layers.3.mlp"),
        HybridOptions::default(),
    )
    .unwrap_err();
    assert!(
        matches!(e.kind(), ErrorKind::MissingTensor { name } if name == "model.layers.3.mlp.up_proj.weight"),
        "{e}"
    );
}

#[test]
fn var_builder_load_matches_dense() {
    let s = FfnSpec::ungated(16, 24, Activation::Gelu).unwrap();
    let w = Weights::random(&s, 4);
    let mut m = HashMap::new();
    m.insert("fc1.weight".to_string(), w.up.clone());
    m.insert("fc2.weight".to_string(), w.down.clone());
    m.insert(
        "fc1.bias".to_string(),
        Tensor::ones(24, DType::F32, &Device::Cpu).unwrap(),
    );
    m.insert(
        "fc2.bias".to_string(),
        Tensor::ones(16, DType::F32, &Device::Cpu).unwrap(),
    );
    let vb = VarBuilder::from_tensors(m, DType::BF16, &Device::Cpu);
    let f = HybridFfn::load(s.activation(), vb, HybridOptions::default()).unwrap();
    assert_eq!(f.bundles().dtype(), WeightDType::BF16);
    assert_eq!(*f.spec(), s, "sizes and gating read from the weights");
    let x = Tensor::ones((2, 16), DType::F32, &Device::Cpu).unwrap();
    let (_, up, down) = f.bundles().to_dense_f32().unwrap();
    let b1 = Tensor::ones(24, DType::F32, &Device::Cpu).unwrap();
    let b2 = Tensor::ones(16, DType::F32, &Device::Cpu).unwrap();
    let wts = FfnWeights {
        up_bias: Some(&b1),
        down_bias: Some(&b2),
        ..FfnWeights::ungated(&up, &down)
    };
    let r = powerinfer::dense_reference(&x, &s, wts).unwrap();
    assert!(rel_err(&f.forward(&x).unwrap(), &r) < 1e-5);
}

/// `HybridFfn::load` reads the sizes from `up`; a `down` that disagrees is a shape error naming
/// it, and a gated MLP is recognised by its `gate_proj`.
#[test]
fn var_builder_load_infers_and_checks_sizes() {
    let s = spec();
    let w = Weights::random(&s, 2);
    let put = |down: Tensor| {
        let mut m = HashMap::new();
        m.insert("gate_proj.weight".to_string(), w.gate.clone().unwrap());
        m.insert("up_proj.weight".to_string(), w.up.clone());
        m.insert("down_proj.weight".to_string(), down);
        VarBuilder::from_tensors(m, DType::F32, &Device::Cpu)
    };
    let f = HybridFfn::load(
        s.activation(),
        put(w.down.clone()),
        HybridOptions::default(),
    )
    .unwrap();
    assert_eq!(*f.spec(), s);
    let wrong = w.down.narrow(1, 0, s.intermediate() - 1).unwrap();
    let e = HybridFfn::load(s.activation(), put(wrong), HybridOptions::default()).unwrap_err();
    assert!(
        matches!(e.kind(), ErrorKind::Shape { tensor, .. } if tensor.contains("down")),
        "{e}"
    );
}

/// A panic on a pool worker comes back to the caller with the worker's own message, and the
/// pool keeps working afterwards.
#[test]
fn pool_reraises_the_workers_panic_payload() {
    let pool = powerinfer::cpu::Pool::new(3);
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        pool.run(&|t| {
            if t == 2 {
                panic!("worker {t} saw a bad row");
            }
        })
    }));
    let payload = r.unwrap_err();
    let msg = payload
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| payload.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap();
    assert_eq!(msg, "worker 2 saw a bad row");
    let hits = std::sync::atomic::AtomicUsize::new(0);
    pool.run(&|_| {
        hits.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    });
    assert_eq!(hits.into_inner(), 3);
}
