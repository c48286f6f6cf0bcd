//! The tier seam on the CPU: the neuron cache against a plain reference model of LRU, the byte
//! budget never exceeded, the reference tier's cache through real calls (exact outputs, hits
//! and fills counted), prefetching ahead of a call, protocol errors, and the fall-back when a fast
//! tier fails.
//! (The split itself is checked in `exactness.rs`, where every case may attach a tier.)

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use candle_core::{Module, Tensor};
use common::*;
use powerinfer::{
    predict::ActiveSet, predict::Oracle, tier::FastTier, tier::LayerPlacement, tier::NeuronCache,
    tier::ReferenceTier, tier::TierBudget, tier::TierCall, tier::TierCounters, Activation,
    ErrorKind, FfnSpec, GateFirst, HybridFfn, HybridOptions, NeuronBundles, WeightDType,
};
use proptest::prelude::*;
use rand::{rngs::StdRng, SeedableRng};

/// The cache as the plainest code can say it: a list of (neuron, last use) per slot.
#[derive(Debug)]
struct Model {
    slots: Vec<Option<(u32, u64)>>,
    clock: u64,
    window: u64,
}

impl Model {
    fn touch(&mut self, n: u32) -> bool {
        for s in self.slots.iter_mut().flatten() {
            if s.0 == n {
                s.1 = self.clock;
                return true;
            }
        }
        false
    }

    /// Empty slot first (lowest; they count as used at 0, before the clock's start at 1), else
    /// the least recently used (lowest slot on ties), unless that one was used within the last
    /// `window` ticks.
    fn admit(&mut self, n: u32) -> Option<(usize, Option<u32>)> {
        if self.slots.iter().flatten().any(|s| s.0 == n) {
            return None;
        }
        let key = |s: &Option<(u32, u64)>| s.map_or(0, |s| s.1);
        let slot = (0..self.slots.len()).min_by_key(|&i| (key(&self.slots[i]), i))?;
        if let Some((_, used)) = self.slots[slot] {
            if self.clock - used < self.window {
                return None;
            }
        }
        let evicted = self.slots[slot].map(|s| s.0);
        self.slots[slot] = Some((n, self.clock));
        Some((slot, evicted))
    }
}

#[derive(Debug, Clone)]
enum Op {
    Tick,
    Touch(u32),
    Admit(u32),
    Expect(u32),
}

fn ops(n: u32) -> impl Strategy<Value = Vec<Op>> {
    proptest::collection::vec(
        prop_oneof![
            1 => Just(Op::Tick),
            3 => (0..n).prop_map(Op::Touch),
            3 => (0..n).prop_map(Op::Admit),
            2 => (0..n).prop_map(Op::Expect),
        ],
        0..200,
    )
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    /// Every answer of `NeuronCache` (hit or miss, which slot, which eviction, for used and for
    /// expected neurons) equals the model's,
    /// and the two maps (slot -> neuron, neuron -> slot) stay each other's inverse.
    #[test]
    fn cache_equals_reference_model(
        n in 1u32..40,
        slots in 0usize..12,
        window in 1u64..4,
        ops in ops(40),
    ) {
        let mut cache = NeuronCache::new(n as usize, slots).unwrap().with_window(window).unwrap();
        let mut model = Model { slots: vec![None; slots], clock: 1, window };
        for op in ops {
            match op {
                Op::Tick => {
                    cache.tick();
                    model.clock += 1;
                }
                Op::Touch(i) => {
                    let i = i % n;
                    prop_assert_eq!(cache.touch(i as usize), model.touch(i));
                }
                Op::Admit(i) => {
                    let i = i % n;
                    let got = cache.admit(i as usize).unwrap().map(|f| {
                        assert_eq!(f.neuron, i);
                        (f.slot, f.evicted)
                    });
                    prop_assert_eq!(got, model.admit(i));
                }
                Op::Expect(i) => {
                    let i = i % n;
                    let got = cache.admit_expected(i as usize).unwrap().map(|f| (f.slot, f.evicted));
                    let want = model.admit(i);
                    // An expected neuron counts as used `window - 1` ticks ago (at least at 1).
                    if let Some((s, _)) = want {
                        let at = (model.clock + 1).saturating_sub(model.window).max(1);
                        model.slots[s] = Some((i, at));
                    }
                    prop_assert_eq!(got, want);
                }
            }
            for s in 0..slots {
                let held = model.slots[s].map(|s| s.0);
                prop_assert_eq!(cache.neuron(s), held);
                if let Some(i) = held {
                    prop_assert_eq!(cache.slot(i as usize), Some(s));
                }
            }
            prop_assert!(cache.len() <= slots);
        }
        // Out of range: a typed error, not a panic.
        let e = cache.admit(n as usize).unwrap_err();
        prop_assert!(matches!(e.kind(), ErrorKind::NeuronOutOfRange { .. }), "{e}");
    }

    /// Reservations and releases in any order never take the total past the limit, and the
    /// total is always the sum of the live reservations.
    #[test]
    fn budget_is_never_exceeded(
        limit in 1u64..10_000,
        steps in proptest::collection::vec((any::<bool>(), 0u64..4_000, any::<prop::sample::Index>()), 0..100),
    ) {
        let budget = TierBudget::new(limit).unwrap();
        let mut live = Vec::new();
        for (reserve, bytes, pick) in steps {
            if reserve || live.is_empty() {
                let before = budget.used();
                match budget.reserve(bytes, "test") {
                    Ok(r) => {
                        prop_assert!(before + bytes <= limit);
                        live.push(r);
                    }
                    Err(e) => {
                        prop_assert!(before + bytes > limit);
                        prop_assert!(matches!(e.kind(), ErrorKind::Budget { .. }), "{e}");
                        prop_assert!(e.to_string().contains(&bytes.to_string()), "{e}");
                    }
                }
            } else {
                live.swap_remove(pick.index(live.len()));
            }
            prop_assert!(budget.used() <= limit);
            prop_assert_eq!(budget.used(), live.iter().map(|r| r.bytes()).sum::<u64>());
        }
        drop(live);
        prop_assert_eq!(budget.used(), 0);
    }
}

/// Many threads reserving and releasing at once: the limit holds at every moment.
#[test]
fn budget_holds_under_contention() {
    let budget = TierBudget::new(1000).unwrap();
    let peak = AtomicUsize::new(0);
    std::thread::scope(|s| {
        for t in 0..8u64 {
            let (budget, peak) = (&budget, &peak);
            s.spawn(move || {
                for k in 0..2000u64 {
                    if let Ok(r) = budget.reserve(1 + (k * 7 + t * 13) % 300, "contention") {
                        peak.fetch_max(budget.used() as usize, Ordering::Relaxed);
                        drop(r);
                    }
                }
            });
        }
    });
    assert!(peak.load(Ordering::Relaxed) <= 1000);
    assert_eq!(budget.used(), 0);
    assert!(matches!(
        TierBudget::new(0).unwrap_err().kind(),
        ErrorKind::Budget { budget: 0, .. }
    ));
}

fn layer(seed: u64, dtype: WeightDType) -> (FfnSpec, NeuronBundles, Weights) {
    let spec = FfnSpec::gated(64, 96, Activation::Relu).unwrap();
    let w = Weights::random(&spec, seed);
    let b = NeuronBundles::from_weights(spec, w.view(), dtype).unwrap();
    (spec, b, w)
}

fn opts() -> HybridOptions {
    HybridOptions {
        threads: 2,
        ..Default::default()
    }
}

/// A tier takes exactly the bytes it says, refuses what does not fit, and gives the bytes
/// back when dropped; `cache_slots_that_fit` fills the budget without passing it.
#[test]
fn reference_tier_stays_within_its_budget() {
    let (_, bundles, _) = layer(1, WeightDType::F16);
    let hot: Vec<u32> = (0..32).collect();
    let per = ReferenceTier::new(&bundles, &[0], 0, &TierBudget::new(u64::MAX).unwrap(), 1)
        .unwrap()
        .bytes();
    let budget = TierBudget::new(per * 40 + per / 2).unwrap();
    let slots = ReferenceTier::cache_slots_that_fit(&bundles, hot.len(), &budget);
    assert_eq!(slots, 8);
    let tier = ReferenceTier::new(&bundles, &hot, slots, &budget, 1).unwrap();
    assert_eq!(tier.bytes(), per * 40);
    assert_eq!(budget.used(), per * 40);
    let e = ReferenceTier::new(&bundles, &[40], 0, &budget, 1).unwrap_err();
    assert!(matches!(e.kind(), ErrorKind::Budget { .. }), "{e}");
    drop(tier);
    assert_eq!(budget.used(), 0);
    let e = ReferenceTier::new(&bundles, &hot, 9, &budget, 1).unwrap_err();
    assert!(
        e.to_string().contains("32 hot neurons and 9 cache slots"),
        "{e}"
    );
    assert_eq!(budget.used(), 0, "a refused tier holds nothing");
}

/// Misuse of a tier is a typed error: finish without launch, a neuron it does not hold, a hot
/// neuron missing from the tier it is attached as, an index out of range, an empty tier.
#[test]
fn tier_protocol_errors_are_typed() {
    let (_, bundles, _) = layer(2, WeightDType::F32);
    let budget = TierBudget::new(u64::MAX).unwrap();
    let tier = ReferenceTier::new(&bundles, &[1, 5], 0, &budget, 1).unwrap();
    let mut out = vec![0f32; 64];
    let e = tier.finish(&mut out).unwrap_err();
    assert!(e.to_string().contains("finish without a launch"), "{e}");
    let mut set = ActiveSet::new();
    set.reset(1, 96);
    set.insert(0, 7).unwrap();
    let x = vec![0.5f32; 64];
    let call = TierCall {
        x: &x,
        rows: 1,
        neurons: &[7],
        set: &set,
        rule: None,
    };
    let e = tier.launch(&call).unwrap_err();
    assert!(
        e.to_string().contains("neuron 7, which it does not hold"),
        "{e}"
    );
    let e = ReferenceTier::new(&bundles, &[96], 0, &budget, 1).unwrap_err();
    assert!(
        matches!(e.kind(), ErrorKind::NeuronOutOfRange { neuron: 96, .. }),
        "{e}"
    );
    let e = ReferenceTier::new(&bundles, &[], 0, &budget, 1).unwrap_err();
    assert!(matches!(e.kind(), ErrorKind::Config { .. }), "{e}");
    let mut ffn = HybridFfn::new(bundles, opts())
        .unwrap()
        .with_placement(LayerPlacement::new(96, vec![1, 5, 9], None).unwrap())
        .unwrap();
    let e = ffn.attach_tier(Box::new(tier)).unwrap_err();
    assert!(e.to_string().contains("hot neuron 9"), "{e}");
}

/// The cache through real calls: every output equals the dense FFN; the second call on the
/// same input finds every cold neuron the first one used in the cache (slots permitting), and
/// the counters agree with what was copied.
#[test]
fn reference_tier_cache_serves_repeated_neurons() {
    for dtype in [WeightDType::F32, WeightDType::BF16, WeightDType::Q8_0] {
        let spec = FfnSpec::gated(64, 96, Activation::Relu).unwrap();
        let w = Weights::random(&spec, 3);
        let bundles = NeuronBundles::from_weights(spec, w.view(), dtype).unwrap();
        let mut ffn = HybridFfn::new(bundles, opts())
            .unwrap()
            .with_predictor(GateFirst::new(0.0).unwrap())
            .with_placement(LayerPlacement::new(96, (0..96).step_by(4).collect(), None).unwrap())
            .unwrap();
        let budget = TierBudget::new(u64::MAX).unwrap();
        ffn.attach_reference_tier(&budget, 96, 2).unwrap();
        let mut rng = StdRng::seed_from_u64(9);
        let x = tensor(&mut rng, &[1, 64], 1.0);
        let reference = dense(&x, &spec, ffn.bundles());
        let check = |y: &Tensor| {
            let e = rel_err(y, &reference);
            let tol = if dtype == WeightDType::Q8_0 {
                2e-2
            } else {
                1e-4
            };
            assert!(e <= tol, "{dtype:?}: rel err {e}");
        };
        check(&ffn.forward(&x).unwrap());
        let first = ffn.fast_tier().unwrap().take_counters();
        assert_eq!(first.hits, 0);
        assert!(first.misses > 0, "{first:?}");
        assert_eq!(first.fills, first.misses, "room for every miss: {first:?}");
        assert_eq!(first.evictions, 0);
        let per = first.bytes_copied / first.fills;
        check(&ffn.forward(&x).unwrap());
        let second = ffn.fast_tier().unwrap().take_counters();
        assert_eq!(second.misses, 0, "{second:?}");
        assert_eq!(second.hits, first.misses, "{second:?}");
        assert_eq!(second.fills, 0);
        // New inputs: hits and fills go on, the outputs stay exact, evictions happen only once
        // the slots are full.
        let mut total = TierCounters::default();
        for _ in 0..6 {
            let x = tensor(&mut rng, &[2, 64], 1.0);
            let reference = dense(&x, &spec, ffn.bundles());
            let y = ffn.forward(&x).unwrap();
            let tol = if dtype == WeightDType::Q8_0 {
                2e-2
            } else {
                1e-4
            };
            assert!(rel_err(&y, &reference) <= tol);
            let c = ffn.fast_tier().unwrap().take_counters();
            total.hits += c.hits;
            total.fills += c.fills;
            total.evictions += c.evictions;
            assert_eq!(c.bytes_copied, c.fills * per);
        }
        assert!(total.hits > 0 && total.fills > 0, "{total:?}");
    }
}

/// A small cache evicts least recently used neurons, and still every output is exact.
#[test]
fn small_cache_evicts_and_stays_exact() {
    let (spec, bundles, _) = layer(4, WeightDType::F16);
    let mut ffn = HybridFfn::new(bundles, opts())
        .unwrap()
        .with_predictor(GateFirst::new(0.0).unwrap())
        .with_placement(LayerPlacement::new(96, vec![0, 1, 2], None).unwrap())
        .unwrap();
    let budget = TierBudget::new(u64::MAX).unwrap();
    ffn.attach_reference_tier(&budget, 5, 1).unwrap();
    let mut rng = StdRng::seed_from_u64(10);
    let mut evictions = 0;
    for _ in 0..8 {
        let x = tensor(&mut rng, &[1, 64], 1.0);
        let y = ffn.forward(&x).unwrap();
        assert!(rel_err(&y, &dense(&x, &spec, ffn.bundles())) <= 1e-3);
        let c = ffn.fast_tier().unwrap().take_counters();
        assert!(c.fills <= 5, "never more fills per call than slots: {c:?}");
        evictions += c.evictions;
    }
    assert!(evictions > 0);
}

/// A fast tier that holds every neuron and fails where told.
#[derive(Debug)]
struct Failing {
    at_launch: bool,
    inner: ReferenceTier,
    /// Set if `observe` is called (it must not be, once the tier failed).
    observed: Arc<std::sync::atomic::AtomicBool>,
}

impl FastTier for Failing {
    fn name(&self) -> &str {
        "failing"
    }
    fn holds(&self, neuron: usize) -> bool {
        self.inner.holds(neuron)
    }
    fn bytes(&self) -> u64 {
        self.inner.bytes()
    }
    fn launch(&self, call: &TierCall<'_>) -> powerinfer::Result<()> {
        if self.at_launch {
            return Err(powerinfer::Error::tier("failing", "out of memory (test)"));
        }
        self.inner.launch(call)
    }
    fn finish(&self, out: &mut [f32]) -> powerinfer::Result<usize> {
        let mut scratch = vec![0f32; out.len()];
        self.inner.finish(&mut scratch)?;
        Err(powerinfer::Error::tier("failing", "lost the device (test)"))
    }
    fn observe(&self, _: &NeuronBundles, _: &[u32]) -> powerinfer::Result<()> {
        self.observed.store(true, Ordering::Relaxed);
        Ok(())
    }
    fn take_counters(&self) -> TierCounters {
        self.inner.take_counters()
    }
}

/// When the fast tier fails (at launch, or after it), the call still returns the exact output,
/// computed on the CPU, and later calls stay on the CPU.
#[test]
fn failing_tier_falls_back_to_the_cpu() {
    for at_launch in [true, false] {
        let (spec, bundles, _) = layer(5, WeightDType::F32);
        let hot: Vec<u32> = (0..96).step_by(2).collect();
        let budget = TierBudget::new(u64::MAX).unwrap();
        let inner = ReferenceTier::new(&bundles, &hot, 0, &budget, 1).unwrap();
        let mut ffn = HybridFfn::new(bundles, opts())
            .unwrap()
            .with_placement(LayerPlacement::new(96, hot, None).unwrap())
            .unwrap();
        let observed = Arc::new(std::sync::atomic::AtomicBool::new(false));
        ffn.attach_tier(Box::new(Failing {
            at_launch,
            inner,
            observed: observed.clone(),
        }))
        .unwrap();
        let mut rng = StdRng::seed_from_u64(6);
        for _ in 0..2 {
            let x = tensor(&mut rng, &[3, 64], 1.0);
            let y = ffn.forward(&x).unwrap();
            let e = rel_err(&y, &dense(&x, &spec, ffn.bundles()));
            assert!(e <= 1e-5, "at_launch={at_launch}: rel err {e}");
            assert!(ffn.fast_tier().is_none(), "a failed tier is not used again");
        }
        assert!(
            !observed.load(Ordering::Relaxed),
            "a failed tier is not asked to fill"
        );
    }
}

/// Tiers are shared across threads as `Arc<HybridFfn>` is.
#[test]
fn tiers_are_send_and_sync() {
    fn check<T: Send + Sync>() {}
    check::<ReferenceTier>();
    check::<Box<dyn FastTier>>();
    check::<Arc<TierBudget>>();
    check::<HybridFfn>();
}

/// `attach_tier` then `detach_tier`: the block computes on the CPU again, same result.
#[test]
fn detach_restores_the_cpu_path() {
    let (spec, bundles, _) = layer(7, WeightDType::F32);
    let mut ffn = HybridFfn::new(bundles, opts())
        .unwrap()
        .with_placement(LayerPlacement::new(96, (0..48).collect(), None).unwrap())
        .unwrap();
    let mut rng = StdRng::seed_from_u64(8);
    let x = tensor(&mut rng, &[2, 64], 1.0);
    let cpu = ffn.forward(&x).unwrap();
    ffn.attach_reference_tier(&TierBudget::new(u64::MAX).unwrap(), 0, 1)
        .unwrap();
    let split = ffn.forward(&x).unwrap();
    assert!(rel_err(&split, &cpu) <= 1e-5);
    assert!(ffn.detach_tier().is_some());
    assert_eq!(bits(&ffn.forward(&x).unwrap()), bits(&cpu));
    assert!(rel_err(&cpu, &dense(&x, &spec, ffn.bundles())) <= 1e-5);
}

/// `masked_reference` with one set for every row.
fn oracle_reference(x: &Tensor, spec: &FfnSpec, b: &NeuronBundles, set: &[u32]) -> Tensor {
    let rows = x.elem_count() / spec.hidden();
    let mut row = vec![false; spec.intermediate()];
    set.iter().for_each(|&i| row[i as usize] = true);
    masked_reference(x, spec, b, Some(&vec![row; rows]))
}

/// Prefetching fills the predicted cold neurons before the call, so the call computes all of
/// them on the tier (no miss), with the output unchanged; a second prefetch finds them held.
#[test]
fn prefetch_fills_predicted_neurons_ahead_of_the_call() {
    for dtype in [WeightDType::F32, WeightDType::F16, WeightDType::Q4_1] {
        let (spec, bundles, _) = layer(11, dtype);
        let set: Vec<u32> = (0..96).step_by(3).collect(); // 32 neurons
        let hot: Vec<u32> = set.iter().copied().step_by(4).collect(); // 8 of them
        let mut ffn = HybridFfn::new(bundles, opts())
            .unwrap()
            .with_predictor(Oracle::new(vec![set.clone()]))
            .with_placement(LayerPlacement::new(96, hot.clone(), None).unwrap())
            .unwrap();
        let budget = TierBudget::new(u64::MAX).unwrap();
        ffn.attach_reference_tier(&budget, 40, 1).unwrap();
        let mut rng = StdRng::seed_from_u64(12);
        let x = tensor(&mut rng, &[2, 64], 1.0);
        let xs = flat(&x);
        assert_eq!(ffn.prefetch(&xs, 2).unwrap(), 24, "{dtype:?}");
        let c = ffn.fast_tier().unwrap().take_counters();
        assert_eq!((c.fills, c.prefetched, c.calls), (24, 24, 0), "{c:?}");
        assert_eq!(c.bytes_copied % 24, 0);
        assert_eq!(ffn.prefetch(&xs, 2).unwrap(), 0, "already held");
        let y = ffn.forward(&x).unwrap();
        let tol = if dtype == WeightDType::Q4_1 {
            3e-2
        } else {
            1e-3
        };
        let e = rel_err(&y, &oracle_reference(&x, &spec, ffn.bundles(), &set));
        assert!(e <= tol, "{dtype:?}: rel err {e}");
        let c = ffn.fast_tier().unwrap().take_counters();
        assert_eq!(c.neurons, 32, "the whole set on the tier: {c:?}");
        assert_eq!((c.misses, c.fills), (0, 0), "{c:?}");
        assert!(c.hits > 0 && c.hits <= 24, "{c:?}");
    }
}

/// Prefetching never evicts a neuron the last call used (the window), fills only free or
/// stale slots, and is a no-op or a typed error where it cannot apply.
#[test]
fn prefetch_keeps_the_last_calls_neurons_and_rejects_bad_input() {
    let (_, bundles, _) = layer(13, WeightDType::F32);
    let first: Vec<u32> = (0..10).collect();
    let mut ffn = HybridFfn::new(bundles.clone(), opts())
        .unwrap()
        .with_predictor(Oracle::new(vec![first.clone()]))
        .with_placement(LayerPlacement::new(96, vec![], None).unwrap())
        .unwrap();
    let budget = TierBudget::new(u64::MAX).unwrap();
    ffn.attach_reference_tier(&budget, 6, 1).unwrap();
    let mut rng = StdRng::seed_from_u64(14);
    let x = tensor(&mut rng, &[1, 64], 4.0);
    ffn.forward(&x).unwrap();
    let used = ffn.fast_tier().unwrap().take_counters();
    assert!(used.fills > 0, "{used:?}");
    let held_now = |f: &HybridFfn| -> Vec<usize> {
        let t = f.fast_tier().unwrap();
        (0..96).filter(|&i| t.holds(i)).collect()
    };
    let before = held_now(&ffn);
    let held = before.len();
    // Another set: only the slots the last call left empty may take it.
    ffn.set_predictor(Oracle::new(vec![(50..60).collect()]));
    let n = ffn.prefetch(&flat(&x), 1).unwrap();
    assert_eq!(n, 6 - held, "only empty slots");
    let c = ffn.fast_tier().unwrap().take_counters();
    assert_eq!(c.evictions, 0, "{c:?}");
    let after = held_now(&ffn);
    assert!(
        before.iter().all(|i| after.contains(i)),
        "the last call's neurons stay"
    );
    assert_eq!(after.len(), held + n);
    // After a call on the new set, the old neurons are stale and a prefetch may replace them.
    ffn.forward(&x).unwrap();
    ffn.set_predictor(Oracle::new(vec![(70..80).collect()]));
    ffn.fast_tier().unwrap().take_counters();
    ffn.forward(&x).unwrap();
    ffn.set_predictor(Oracle::new(vec![(30..40).collect()]));
    let n = ffn.prefetch(&flat(&x), 1).unwrap();
    let c = ffn.fast_tier().unwrap().take_counters();
    assert!(n <= 6 && c.prefetched == n as u64, "{c:?}");

    // Bad input and no-ops.
    let e = ffn.prefetch(&[0.0; 63], 1).unwrap_err();
    assert!(matches!(e.kind(), ErrorKind::Count { .. }), "{e}");
    let e = ffn
        .fast_tier()
        .unwrap()
        .prefetch(ffn.bundles(), &[96])
        .unwrap_err();
    assert!(
        matches!(e.kind(), ErrorKind::NeuronOutOfRange { neuron: 96, .. }),
        "{e}"
    );
    let spec = FfnSpec::gated(64, 128, Activation::Relu).unwrap();
    let other =
        NeuronBundles::from_weights(spec, Weights::random(&spec, 15).view(), WeightDType::F32)
            .unwrap();
    let e = ffn.fast_tier().unwrap().prefetch(&other, &[1]).unwrap_err();
    assert!(matches!(e.kind(), ErrorKind::Tier { .. }), "{e}");
    let rule = HybridFfn::new(bundles.clone(), opts())
        .unwrap()
        .with_predictor(GateFirst::new(0.0).unwrap());
    assert_eq!(rule.prefetch(&flat(&x), 1).unwrap(), 0, "no tier");
    let mut rule = rule;
    rule.attach_reference_tier(&budget, 6, 1).unwrap();
    assert_eq!(
        rule.prefetch(&flat(&x), 1).unwrap(),
        0,
        "an inline rule has no cheap prediction"
    );
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    /// Random sequences of prefetches and calls over random sets, hot neurons and slots: every
    /// output equals the masked dense reference, the tier never holds more than its hot
    /// neurons and slots, and its hot neurons stay held.
    #[test]
    fn prefetch_and_calls_stay_exact(
        seed in 0u64..1000,
        hot_every in 2usize..9,
        slots in 0usize..40,
        steps in proptest::collection::vec((proptest::collection::vec(0u32..96, 0..40), any::<bool>(), 1usize..4), 1..8),
    ) {
        let (spec, bundles, _) = layer(seed, WeightDType::F32);
        let hot: Vec<u32> = (0..96).step_by(hot_every).map(|i| i as u32).collect();
        let mut ffn = HybridFfn::new(bundles, opts())
            .unwrap()
            .with_placement(LayerPlacement::new(96, hot.clone(), None).unwrap())
            .unwrap();
        let budget = TierBudget::new(u64::MAX).unwrap();
        ffn.attach_reference_tier(&budget, slots, 1).unwrap();
        let mut rng = StdRng::seed_from_u64(seed);
        for (mut set, prefetch, rows) in steps {
            set.sort_unstable();
            set.dedup();
            ffn.set_predictor(Oracle::new(vec![set.clone()]));
            let x = tensor(&mut rng, &[rows, 64], 1.0);
            if prefetch {
                let n = ffn.prefetch(&flat(&x), rows).unwrap();
                prop_assert!(n <= slots);
            }
            let y = ffn.forward(&x).unwrap();
            let e = rel_err(&y, &oracle_reference(&x, &spec, ffn.bundles(), &set));
            prop_assert!(e <= 1e-4, "rel err {}", e);
            let t = ffn.fast_tier().unwrap();
            let held = (0..96).filter(|&i| t.holds(i)).count();
            prop_assert!(held <= hot.len() + slots);
            prop_assert!(hot.iter().all(|&i| t.holds(i as usize)));
        }
    }
}
