//! The decode path allocates nothing, a loaded block holds its weights once, and the
//! input-sparse layers' prompt buffers are one set per thread, not one per layer.
//!
//! One test in this binary on purpose: the counting allocator is process-wide.

mod common;

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicIsize, AtomicUsize, Ordering};

use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{DType, Device, Tensor};
use common::*;
use powerinfer::{
    tier::LayerPlacement, Activation, FfnSpec, GateFirst, HybridFfn, HybridOptions, InputSparseFfn,
    LowRank, WeightDType,
};

struct Counting;
static ALLOCS: AtomicUsize = AtomicUsize::new(0);
static LIVE: AtomicIsize = AtomicIsize::new(0);

// SAFETY: forwards to the system allocator unchanged, only counting.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        ALLOCS.fetch_add(1, Ordering::Relaxed);
        LIVE.fetch_add(l.size() as isize, Ordering::Relaxed);
        // SAFETY: same contract as the caller's.
        unsafe { System.alloc(l) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        LIVE.fetch_sub(l.size() as isize, Ordering::Relaxed);
        // SAFETY: same contract as the caller's.
        unsafe { System.dealloc(p, l) }
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, new: usize) -> *mut u8 {
        ALLOCS.fetch_add(1, Ordering::Relaxed);
        LIVE.fetch_add(new as isize - l.size() as isize, Ordering::Relaxed);
        // SAFETY: same contract as the caller's.
        unsafe { System.realloc(p, l, new) }
    }
}

#[global_allocator]
static A: Counting = Counting;

#[test]
fn no_allocation_per_token_and_weights_held_once() {
    let (hidden, inter) = (512, 1536);
    let spec = FfnSpec::gated(hidden, inter, Activation::Relu).unwrap();
    let live0 = LIVE.load(Ordering::SeqCst);
    let ffn = {
        let w = Weights::random(&spec, 9);
        let half = w.gate.as_ref().unwrap().to_dtype(DType::F16).unwrap();
        let (up, down) = (
            w.up.to_dtype(DType::F16).unwrap(),
            w.down.to_dtype(DType::F16).unwrap(),
        );
        let opts = HybridOptions {
            threads: 2,
            ..Default::default()
        };
        HybridFfn::from_weights(
            spec,
            powerinfer::FfnWeights::gated(&half, &up, &down),
            WeightDType::F16,
            opts,
        )
        .unwrap()
        .with_placement(
            LayerPlacement::new(inter, (0..inter as u32).step_by(2).collect(), None).unwrap(),
        )
        .unwrap()
        .with_predictor(GateFirst::new(0.0).unwrap())
    };
    let weights = ffn.bundles().weight_bytes() as f64;
    assert_eq!(weights, (3 * hidden * inter * 2) as f64);

    let x: Vec<f32> = (0..hidden)
        .map(|i| ((i * 7 % 13) as f32 - 6.0) * 0.1)
        .collect();
    let mut out = vec![0f32; hidden];
    for _ in 0..3 {
        ffn.forward_f32(&x, 1, &mut out).unwrap();
    }
    let held = (LIVE.load(Ordering::SeqCst) - live0) as f64;
    assert!(
        (held - weights).abs() <= 0.05 * weights,
        "resident {held} bytes vs weights {weights} bytes"
    );

    let before = ALLOCS.load(Ordering::SeqCst);
    for _ in 0..200 {
        ffn.forward_f32(&x, 1, &mut out).unwrap();
    }
    let n = ALLOCS.load(Ordering::SeqCst) - before;
    assert_eq!(n, 0, "{n} heap allocations in 200 decode calls (GateFirst)");

    // Same with a low-rank predictor and a 4-row batch.
    let fc1 = Tensor::ones((16, hidden), DType::F32, &Device::Cpu).unwrap();
    let fc2 = Tensor::ones((inter, 16), DType::F32, &Device::Cpu).unwrap();
    let ffn = ffn.with_predictor(LowRank::new(&fc1, &fc2, 0.0).unwrap());
    let x4: Vec<f32> = x.iter().cycle().take(4 * hidden).copied().collect();
    let mut out4 = vec![0f32; 4 * hidden];
    for _ in 0..3 {
        ffn.forward_f32(&x4, 4, &mut out4).unwrap();
    }
    let before = ALLOCS.load(Ordering::SeqCst);
    for _ in 0..100 {
        ffn.forward_f32(&x4, 4, &mut out4).unwrap();
    }
    let n = ALLOCS.load(Ordering::SeqCst) - before;
    assert_eq!(n, 0, "{n} heap allocations in 100 batch calls (LowRank)");

    // Two input-sparse layers (every matrix by column): a 64-row prompt through the first
    // grows the batched path's buffers (64 rows x 1536 neurons, several of them); through
    // the second it finds them grown and holds almost nothing more.
    let spec = FfnSpec::gated(hidden, inter, Activation::Silu).unwrap();
    let q = |t: &Tensor| QTensor::quantize(t, GgmlDType::Q4K).unwrap();
    let layer = |seed| {
        let w = Weights::random(&spec, seed);
        let (g, u, d) = (q(w.gate.as_ref().unwrap()), q(&w.up), q(&w.down));
        InputSparseFfn::from_qtensors(spec, Some(&g), &u, &d, 2, None).unwrap()
    };
    let (a, b) = (layer(1), layer(2));
    let rows = 64;
    let x64: Vec<f32> = x.iter().cycle().take(rows * hidden).copied().collect();
    let mut out64 = vec![0f32; rows * hidden];
    let live = LIVE.load(Ordering::SeqCst);
    a.forward_f32(&x64, rows, &mut out64).unwrap();
    let first = LIVE.load(Ordering::SeqCst) - live;
    assert!(
        first >= (3 * rows * inter * 4) as isize,
        "the first layer's prompt grew {first} bytes: is the batched path measured?"
    );
    let live = LIVE.load(Ordering::SeqCst);
    b.forward_f32(&x64, rows, &mut out64).unwrap();
    let second = LIVE.load(Ordering::SeqCst) - live;
    assert!(
        second * 10 < first,
        "the second layer's prompt held {second} bytes more, the first's {first}"
    );
}
