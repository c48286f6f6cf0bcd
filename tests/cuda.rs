//! The CUDA tier against the CPU tier (feature `cuda`). On a machine without a GPU (or driver)
//! every test prints one `skipped:` line and passes, unless `POWERINFER_REQUIRE_GPU=1` is set:
//! then a missing device fails it (`scripts/gpu-check.sh` sets it, so a broken CUDA setup on
//! the GPU machine is a failure, not a skip). The host-side parts (device layouts, budgets) are
//! unit tests in `src/cuda`.
#![cfg(feature = "cuda")]

mod common;

use candle_core::Module;
use common::*;
use powerinfer::{
    predict::Oracle, tier::cuda_device, tier::CudaTier, tier::LayerPlacement, tier::TierBudget,
    Activation, ErrorKind, FfnSpec, GateFirst, HybridFfn, HybridOptions, NeuronBundles,
    WeightDType,
};
use proptest::prelude::*;
use rand::{rngs::StdRng, Rng, SeedableRng};

/// The device, or `None` after printing why the test is skipped (to stderr itself, past the
/// test harness's capture, so the line shows in every run). Panics instead under
/// `POWERINFER_REQUIRE_GPU=1`.
fn device(test: &str) -> Option<candle_core::CudaDevice> {
    use std::io::Write;
    match cuda_device(0) {
        Ok(d) => Some(d),
        Err(e) if std::env::var_os("POWERINFER_REQUIRE_GPU").is_some_and(|v| v == "1") => {
            panic!("{test}: POWERINFER_REQUIRE_GPU=1 and {e}")
        }
        Err(e) => {
            let _ = writeln!(std::io::stderr(), "skipped {test}: {e}");
            None
        }
    }
}

#[derive(Debug, Clone)]
struct Case {
    hidden: usize,
    inter: usize,
    rows: usize,
    act: Activation,
    gated: bool,
    dtype: WeightDType,
    hot_frac: f64,
    active_frac: f64,
    rule: Option<f32>,
    slots: usize,
    seed: u64,
}

fn case() -> impl Strategy<Value = Case> {
    (
        (1usize..=300, 1usize..=200, 1usize..=40),
        (0usize..5, any::<bool>(), 0usize..5),
        (
            0.0..1.0f64,
            0.0..1.0f64,
            prop_oneof![Just(None), (0.0..0.5f32).prop_map(Some)],
        ),
        (0usize..64, any::<u64>()),
    )
        .prop_map(
            |(
                (hidden, inter, rows),
                (a, gated, d),
                (hot_frac, active_frac, rule),
                (slots, seed),
            )| {
                let act = ACTIVATIONS[a];
                let dtype = [
                    WeightDType::F32,
                    WeightDType::F16,
                    WeightDType::BF16,
                    WeightDType::Q4_1,
                    WeightDType::Q8_0,
                ][d];
                let hidden = if dtype.quant().is_some() {
                    hidden.div_ceil(32) * 32
                } else {
                    hidden
                };
                Case {
                    hidden,
                    inter,
                    rows,
                    act,
                    gated: gated || act == Activation::DRelu,
                    dtype,
                    hot_frac,
                    active_frac,
                    rule,
                    slots,
                    seed,
                }
            },
        )
}

/// The block with the GPU tier and the same block on the CPU alone: outputs agree (f16/bf16
/// rows: 1e-3 of the output's scale; f32: 1e-5; quantized rows are f16 on the device and the
/// CPU quantizes the input to 8 bits: 2e-2), never NaN although the host output starts as NaN
/// and the device buffers start as NaN, on the first call and on the second (cache filled).
fn check(dev: &candle_core::CudaDevice, c: &Case) -> Result<(), TestCaseError> {
    let spec = FfnSpec::new(c.hidden, c.inter, c.act, c.gated).unwrap();
    let w = Weights::random(&spec, c.seed);
    let mut rng = StdRng::seed_from_u64(c.seed ^ 7);
    let hot: Vec<u32> = (0..c.inter as u32)
        .filter(|_| rng.random_bool(c.hot_frac))
        .collect();
    let sets: Vec<Vec<u32>> = (0..c.rows)
        .map(|_| {
            (0..c.inter as u32)
                .filter(|_| rng.random_bool(c.active_frac))
                .collect()
        })
        .collect();
    let x = tensor(&mut rng, &[c.rows, c.hidden], 1.0);
    let build = || {
        let b = NeuronBundles::from_weights(spec, w.view(), c.dtype).unwrap();
        let f = HybridFfn::new(
            b,
            HybridOptions {
                threads: 2,
                ..Default::default()
            },
        )
        .unwrap()
        .with_placement(LayerPlacement::new(c.inter, hot.clone(), None).unwrap())
        .unwrap();
        match c.rule {
            Some(t) => f.with_predictor(GateFirst::new(t).unwrap()),
            None => f.with_predictor(Oracle::new(sets.clone())),
        }
    };
    let cpu = build();
    let mut gpu = build();
    if hot.is_empty() && c.slots == 0 {
        return Ok(());
    }
    let budget = TierBudget::new(u64::MAX).unwrap();
    let tier = CudaTier::new(dev, gpu.bundles(), &hot, c.slots, &budget).unwrap();
    gpu.attach_tier(Box::new(tier)).unwrap();
    let xs = flat(&x);
    let mut want = vec![0f32; xs.len()];
    cpu.forward_f32(&xs, c.rows, &mut want).unwrap();
    let scale = want.iter().fold(1e-6f32, |a, v| a.max(v.abs()));
    let tol = match c.dtype {
        WeightDType::F32 => 1e-5,
        WeightDType::F16 | WeightDType::BF16 => 1e-3,
        _ => 2e-2,
    };
    for call in 0..2 {
        let mut got = vec![f32::NAN; xs.len()];
        gpu.forward_f32(&xs, c.rows, &mut got).unwrap();
        prop_assert!(gpu.fast_tier().is_some(), "the tier failed: {c:?}");
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            prop_assert!(g.is_finite(), "call {call}: NaN at {i} for {c:?}");
            prop_assert!(
                (g - w).abs() <= tol * scale,
                "call {call}: {g} vs {w} at {i} for {c:?}"
            );
        }
    }
    // The same bits on a repeated call with the same tier contents (deterministic kernels).
    let (mut a, mut b) = (vec![0f32; xs.len()], vec![0f32; xs.len()]);
    gpu.forward_f32(&xs, c.rows, &mut a).unwrap();
    gpu.forward_f32(&xs, c.rows, &mut b).unwrap();
    if c.slots == 0 {
        prop_assert!(a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()));
    }
    Ok(())
}

#[test]
fn cuda_tier_equals_the_cpu_tier() {
    let Some(dev) = device("cuda_tier_equals_the_cpu_tier") else {
        return;
    };
    let mut runner = proptest::test_runner::TestRunner::new(ProptestConfig {
        cases: 96,
        ..ProptestConfig::default()
    });
    runner.run(&case(), |c| check(&dev, &c)).unwrap();
}

/// Edge shapes: hidden and intermediate of 1, odd sizes, a warp +-1, rows across the
/// kernels' 16-row blocks and at the tier's limit.
#[test]
fn cuda_edge_shapes() {
    let Some(dev) = device("cuda_edge_shapes") else {
        return;
    };
    for &hidden in &[1usize, 31, 32, 33, 257] {
        for &inter in &[1usize, 63, 64, 65] {
            for &rows in &[1usize, 15, 16, 17, 64] {
                let c = Case {
                    hidden,
                    inter,
                    rows,
                    act: Activation::Silu,
                    gated: true,
                    dtype: WeightDType::F16,
                    hot_frac: 0.5,
                    active_frac: 0.7,
                    rule: None,
                    slots: 3,
                    seed: (hidden * 1000 + inter * 10 + rows) as u64,
                };
                check(&dev, &c).unwrap();
            }
        }
    }
}

/// A GPU tier reserves its rows and buffers under the budget, refuses more, and gives the
/// bytes back when dropped; batches above its row limit run on the CPU, exactly.
#[test]
fn cuda_budget_and_limits() {
    let Some(dev) = device("cuda_budget_and_limits") else {
        return;
    };
    let spec = FfnSpec::gated(128, 256, Activation::Silu).unwrap();
    let w = Weights::random(&spec, 1);
    let b = NeuronBundles::from_weights(spec, w.view(), WeightDType::F16).unwrap();
    let hot: Vec<u32> = (0..128).collect();
    let need = CudaTier::neuron_bytes(&b) * 128 + CudaTier::work_bytes(&b, 128);
    let budget = TierBudget::new(need).unwrap();
    let tier = CudaTier::new(&dev, &b, &hot, 0, &budget).unwrap();
    assert_eq!(budget.used(), need);
    let e = CudaTier::new(&dev, &b, &[200], 0, &budget).unwrap_err();
    assert!(matches!(e.kind(), ErrorKind::Budget { .. }), "{e}");
    drop(tier);
    assert_eq!(budget.used(), 0);
    let mut ffn = HybridFfn::new(b, HybridOptions::default())
        .unwrap()
        .with_placement(LayerPlacement::new(256, hot.clone(), None).unwrap())
        .unwrap();
    let cpu_out = {
        let mut rng = StdRng::seed_from_u64(2);
        let x = tensor(&mut rng, &[powerinfer::tier::CUDA_MAX_ROWS + 1, 128], 1.0);
        (ffn.forward(&x).unwrap(), x)
    };
    ffn.attach_tier(Box::new(
        CudaTier::new(&dev, ffn.bundles(), &hot, 0, &budget).unwrap(),
    ))
    .unwrap();
    let y = ffn.forward(&cpu_out.1).unwrap();
    assert_eq!(
        bits(&y),
        bits(&cpu_out.0),
        "a batch above the limit runs on the CPU"
    );
    assert_eq!(ffn.fast_tier().unwrap().take_counters().calls, 0);
}
