//! The planner and the statistics hook.

mod common;

use candle_core::{DType, Device, Module, Tensor};
use common::*;
use powerinfer::{
    tier::plan_placement, Activation, FfnSpec, HybridFfn, HybridOptions, WeightDType,
};
use proptest::prelude::*;

proptest! {
    /// Never over budget; greedy top-K: every hot neuron is at least as frequent as every cold
    /// neuron when all layers cost the same; no neuron that would still fit is left cold.
    #[test]
    fn planner_respects_budget_and_order(
        freqs in proptest::collection::vec(proptest::collection::vec(0.0f64..1.0, 1..40), 1..6),
        bytes in 1u64..100,
        budget in 1u64..5000,
    ) {
        let nb = vec![bytes; freqs.len()];
        let budget = budget.max(bytes);
        let p = plan_placement(&freqs, &nb, budget).unwrap();
        prop_assert!(p.used <= budget);
        let hot_count: usize = p.layers.iter().map(|l| l.hot().len()).sum();
        prop_assert_eq!(p.used, hot_count as u64 * bytes);
        let total: usize = freqs.iter().map(|f| f.len()).sum();
        prop_assert_eq!(hot_count, total.min((budget / bytes) as usize));
        let freqs = &freqs;
        let min_hot = p.layers.iter().enumerate().flat_map(|(l, lp)| lp.hot().iter().map(move |&i| freqs[l][i as usize])).fold(f64::INFINITY, f64::min);
        let max_cold = p.layers.iter().enumerate().flat_map(|(l, lp)| (0..freqs[l].len()).filter(move |&i| !lp.is_hot(i)).map(move |i| freqs[l][i])).fold(f64::NEG_INFINITY, f64::max);
        prop_assert!(min_hot >= max_cold, "hot {min_hot} < cold {max_cold}");
    }
}

#[test]
fn planner_fills_with_smaller_neurons() {
    // Layer 0 neurons cost 10, layer 1 neurons cost 3; budget 15: the hottest (layer 0) fits,
    // the next layer-0 neuron does not, two layer-1 neurons do.
    let f = vec![vec![0.9, 0.8], vec![0.5, 0.4, 0.3]];
    let p = plan_placement(&f, &[10, 3], 15).unwrap();
    assert_eq!(p.layers[0].hot(), &[0]);
    assert_eq!(p.layers[1].hot(), &[0]);
    assert_eq!(p.used, 13);
}

#[test]
fn stats_count_active_neurons() {
    let spec = FfnSpec::gated(8, 6, Activation::Relu).unwrap();
    // gate rows: neuron i has gate row = e_0 * (i as f32 - 2.5): active (gate > 0) for i >= 3 when
    // x_0 > 0, for i <= 2 when x_0 < 0.
    let mut g = vec![0f32; 6 * 8];
    for i in 0..6 {
        g[i * 8] = i as f32 - 2.5;
    }
    let gate = Tensor::from_vec(g, (6, 8), &Device::Cpu).unwrap();
    let up = Tensor::ones((6, 8), DType::F32, &Device::Cpu).unwrap();
    let down = Tensor::ones((8, 6), DType::F32, &Device::Cpu).unwrap();
    let ffn = HybridFfn::from_weights(
        spec,
        powerinfer::FfnWeights::gated(&gate, &up, &down),
        WeightDType::F32,
        HybridOptions::default(),
    )
    .unwrap();
    ffn.enable_stats(0.0);
    let mut x = vec![0f32; 3 * 8];
    x[0] = 1.0;
    x[8] = 1.0;
    x[16] = -1.0;
    ffn.forward(&Tensor::from_vec(x, (3, 8), &Device::Cpu).unwrap())
        .unwrap();
    let s = ffn.take_stats().unwrap();
    assert_eq!(s.tokens, 3);
    assert_eq!(s.counts, vec![1, 1, 1, 2, 2, 2]);
    assert_eq!(s.frequencies()[3], 2.0 / 3.0);
    assert!(ffn.take_stats().is_none(), "stats are off after take");
}

/// Thresholds read from the |h| histogram drop the requested share of (row, neuron) pairs.
#[test]
fn threshold_for_sparsity_hits_the_target() {
    let spec = FfnSpec::gated(64, 512, Activation::Silu).unwrap();
    let w = Weights::random(&spec, 21);
    let ffn = HybridFfn::from_weights(spec, w.view(), WeightDType::F32, HybridOptions::default())
        .unwrap();
    ffn.enable_stats_with_magnitudes(0.0);
    let mut rng = <rand::rngs::StdRng as rand::SeedableRng>::seed_from_u64(8);
    let x = tensor(&mut rng, &[32, 64], 1.0);
    ffn.forward(&x).unwrap();
    let s = ffn.take_stats().unwrap();
    assert!(s.threshold_for_sparsity(1.5).is_none());
    for target in [0.2, 0.4, 0.5, 0.6] {
        let t = s.threshold_for_sparsity(target).unwrap();
        // Realized: GateFirst at that threshold on the same input.
        let g = HybridFfn::from_weights(spec, w.view(), WeightDType::F32, HybridOptions::default())
            .unwrap()
            .with_predictor(powerinfer::GateFirst::new(t).unwrap());
        g.enable_stats(0.0);
        g.forward(&x).unwrap();
        let kept: u64 = g.take_stats().unwrap().counts.iter().sum();
        let realized = 1.0 - kept as f64 / (32.0 * 512.0);
        assert!(
            (realized - target).abs() < 0.03,
            "target {target}: realized {realized}"
        );
    }
}

#[test]
fn force_dense_and_dense_prefill_bypass_the_predictor() {
    let spec = FfnSpec::gated(16, 32, Activation::Silu).unwrap();
    let w = Weights::random(&spec, 2);
    let opts = HybridOptions {
        prefill: powerinfer::PrefillPolicy::DenseFrom(4),
        ..Default::default()
    };
    let ffn = HybridFfn::from_weights(spec, w.view(), WeightDType::F32, opts)
        .unwrap()
        .with_predictor(powerinfer::predict::Oracle::new(vec![vec![1, 2]]));
    let x1 = Tensor::ones((1, 16), DType::F32, &Device::Cpu).unwrap();
    ffn.forward(&x1).unwrap();
    assert_eq!(ffn.last_active(), 2);
    ffn.set_force_dense(true);
    let y = ffn.forward(&x1).unwrap();
    assert_eq!(ffn.last_active(), 32);
    assert!(rel_err(&y, &dense(&x1, &spec, ffn.bundles())) < 1e-5);
    ffn.set_force_dense(false);
    let x4 = Tensor::ones((4, 16), DType::F32, &Device::Cpu).unwrap();
    ffn.forward(&x4).unwrap();
    assert_eq!(ffn.last_active(), 32, "4 rows >= DenseFrom(4)");
}
