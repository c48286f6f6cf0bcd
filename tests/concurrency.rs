//! Many threads on one shared block, as a server calls it: the public types a server shares are
//! `Send + Sync`, and N threads calling `forward` on one `Arc<HybridFfn>` at the same time get
//! exactly the bits a single thread gets for the same inputs (every predictor kind, every
//! storage, with and without a fast tier holding the hot neurons).

mod common;

use std::sync::Arc;

use candle_core::{Module, Tensor};
use common::*;
use powerinfer::{
    predict::Oracle, tier::FastTier, tier::LayerPlacement, tier::ReferenceTier, tier::TierBudget,
    Activation, Artifact, FfnSpec, GateFirst, HybridFfn, HybridOptions, InputSparseFfn, LowRank,
    NeuronBundles, WeightDType,
};
use rand::{rngs::StdRng, SeedableRng};

#[test]
fn server_shared_types_are_send_and_sync() {
    fn check<T: Send + Sync>() {}
    check::<HybridFfn>();
    check::<Arc<HybridFfn>>();
    check::<InputSparseFfn>();
    check::<NeuronBundles>();
    check::<LowRank>();
    check::<GateFirst>();
    check::<Artifact>();
    check::<TierBudget>();
    check::<ReferenceTier>();
    check::<Box<dyn FastTier>>();
    check::<powerinfer::Error>();
}

/// One block per configuration: (name, block).
fn blocks() -> Vec<(String, HybridFfn)> {
    let spec = FfnSpec::gated(64, 160, Activation::Silu).unwrap();
    let w = Weights::random(&spec, 11);
    let mut out = Vec::new();
    for dtype in [WeightDType::F32, WeightDType::BF16, WeightDType::Q4_1] {
        for predictor in 0..3 {
            for tier in [false, true] {
                let b = NeuronBundles::from_weights(spec, w.view(), dtype).unwrap();
                let opts = HybridOptions {
                    threads: 2,
                    ..Default::default()
                };
                let mut f = HybridFfn::new(b, opts).unwrap();
                match predictor {
                    0 => f.set_predictor(GateFirst::new(0.05).unwrap()),
                    1 => f.set_predictor(Oracle::new(vec![(0..160).step_by(3).collect()])),
                    _ => {
                        let mut rng = StdRng::seed_from_u64(5);
                        let fc1 = tensor(&mut rng, &[16, 64], 0.3);
                        let fc2 = tensor(&mut rng, &[160, 16], 0.3);
                        f.set_predictor(LowRank::new(&fc1, &fc2, 0.0).unwrap());
                    }
                }
                if tier {
                    // Hot neurons only: a cache would make the split depend on the order of calls.
                    let hot = LayerPlacement::new(160, (0..160).step_by(2).collect(), None);
                    f.set_placement(hot.unwrap()).unwrap();
                    f.attach_reference_tier(&TierBudget::new(u64::MAX).unwrap(), 0, 1)
                        .unwrap();
                }
                out.push((format!("{dtype:?}, predictor {predictor}, tier {tier}"), f));
            }
        }
    }
    out
}

#[test]
fn threads_sharing_one_block_get_the_single_thread_bits() {
    const THREADS: usize = 8;
    const CALLS: usize = 12;
    let mut rng = StdRng::seed_from_u64(3);
    let inputs: Vec<Tensor> = (0..THREADS * CALLS)
        .map(|k| tensor(&mut rng, &[1 + k % 3, 64], 1.0))
        .collect();
    for (name, block) in blocks() {
        let block = Arc::new(block);
        let alone: Vec<Vec<u32>> = inputs
            .iter()
            .map(|x| bits(&block.forward(x).unwrap()))
            .collect();
        let together: Vec<Vec<Vec<u32>>> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..THREADS)
                .map(|t| {
                    let (block, inputs) = (Arc::clone(&block), &inputs);
                    s.spawn(move || {
                        // Each thread takes every THREADS-th input, so calls interleave.
                        (t..inputs.len())
                            .step_by(THREADS)
                            .map(|k| bits(&block.forward(&inputs[k]).unwrap()))
                            .collect::<Vec<_>>()
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for (t, got) in together.iter().enumerate() {
            for (j, g) in got.iter().enumerate() {
                assert_eq!(g, &alone[t + j * THREADS], "{name}: thread {t}, call {j}");
            }
        }
    }
}
