//! TEAL's greedy allocation (`InputSparseFfn::greedy_allocation`): each step raises one matrix's
//! dropped fraction, the one with the least output error per byte, and the error it records is
//! the error the rule gives when set; the path's shape, `GreedyPath::at`, ungated FFNs, bad input.

mod common;

use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::Tensor;
use common::*;
use powerinfer::{
    input_rule::MAX_SAMPLES, input_rule::SAMPLE_EVERY, Activation, FfnSpec, InputScore,
    InputScores, InputSparseFfn, InputThresholds,
};
use rand::{rngs::StdRng, SeedableRng};

fn ffn(gated: bool, seed: u64) -> (InputSparseFfn, FfnSpec) {
    let spec = FfnSpec::new(64, 128, Activation::Silu, gated).unwrap();
    let w = Weights::random(&spec, seed);
    let q = |t: &Tensor| QTensor::quantize(t, GgmlDType::Q4_1).unwrap();
    let gate = w.gate.as_ref().map(q);
    let f = InputSparseFfn::from_qtensors(spec, gate.as_ref(), &q(&w.up), &q(&w.down), 2, None)
        .unwrap();
    (f, spec)
}

fn calibrate(f: &InputSparseFfn, rows: usize, seed: u64) -> InputScores {
    let h = f.spec().hidden();
    let mut rng = StdRng::seed_from_u64(seed);
    let x = values(&mut rng, rows * h, 1.0);
    let mut out = vec![0f32; x.len()];
    f.record_scores();
    f.forward_f32(&x, rows, &mut out).unwrap();
    f.take_scores().unwrap()
}

/// The relative squared output error of `fractions` on the samples, through the public API.
fn error(f: &mut InputSparseFfn, scores: &InputScores, fractions: [f64; 3]) -> f64 {
    let x = &scores.samples;
    let rows = x.len() / f.spec().hidden();
    let run = |f: &mut InputSparseFfn, t: InputThresholds| {
        f.set_rule(InputScore::Magnitude, t).unwrap();
        let mut y = vec![0f32; x.len()];
        f.forward_f32(x, rows, &mut y).unwrap();
        y
    };
    let dense = run(f, InputThresholds::default());
    let sparse = run(f, scores.thresholds(fractions).unwrap());
    let e: f64 = sparse
        .iter()
        .zip(&dense)
        .map(|(a, b)| ((a - b) as f64).powi(2))
        .sum();
    e / dense.iter().map(|&v| (v as f64).powi(2)).sum::<f64>()
}

#[test]
fn samples_are_every_nth_row_up_to_the_cap() {
    let (f, spec) = ffn(true, 1);
    let s = calibrate(&f, 40, 2);
    assert_eq!(s.rows, 40);
    assert_eq!(
        s.samples.len(),
        40usize.div_ceil(SAMPLE_EVERY as usize) * spec.hidden()
    );
    let s = calibrate(&f, 8 * MAX_SAMPLES + 100, 3);
    assert_eq!(s.samples.len(), MAX_SAMPLES * spec.hidden());
}

#[test]
fn each_step_takes_the_cheapest_matrix_and_records_its_error() {
    let (mut f, _) = ffn(true, 5);
    let scores = calibrate(&f, 256, 6);
    let step = 0.1;
    f.take_traffic();
    let path = f.greedy_allocation(&scores, 0.3, step).unwrap();
    assert_eq!(f.take_traffic().rows, 0, "calibration counts no traffic");
    let last = path.steps.last().unwrap();
    assert!(last.skipped >= 0.3 - 1e-9, "{last:?}");
    let mut prev = [0.0; 3];
    for s in &path.steps {
        // One matrix moved by one step.
        let moved: Vec<usize> = (0..3).filter(|&m| s.fractions[m] != prev[m]).collect();
        assert_eq!(moved.len(), 1, "{s:?} after {prev:?}");
        assert!((s.fractions[moved[0]] - prev[moved[0]] - step).abs() < 1e-9);
        // Equal matrix sizes: the skipped share is the mean fraction.
        assert!((s.skipped - s.fractions.iter().sum::<f64>() / 3.0).abs() < 1e-9);
        // The recorded error is the one the rule gives when set.
        let e = error(&mut f, &scores, s.fractions);
        assert!((e - s.error).abs() <= 1e-9 + 1e-6 * e, "{e} vs {s:?}");
        // No other candidate was cheaper (equal byte gains: the least error).
        for m in 0..3 {
            let mut c = prev;
            c[m] += step;
            let ec = error(&mut f, &scores, c);
            assert!(s.error <= ec + 1e-12, "took {s:?}, but {c:?} gives {ec}");
        }
        prev = s.fractions;
    }
    assert_eq!(path.at(0.0), Some([0.0; 3]));
    assert_eq!(
        path.at(path.steps[1].skipped),
        Some(path.steps[1].fractions)
    );
    assert_eq!(
        path.at(path.steps[1].skipped - 0.01),
        Some(path.steps[1].fractions)
    );
    assert_eq!(path.at(0.9), None);
}

#[test]
fn ungated_ffns_never_move_the_gate() {
    let (f, _) = ffn(false, 7);
    let scores = calibrate(&f, 128, 8);
    let path = f.greedy_allocation(&scores, 0.4, 0.05).unwrap();
    assert!(path.steps.iter().all(|s| s.fractions[0] == 0.0));
    assert!(path.steps.last().unwrap().skipped >= 0.4 - 1e-9);
}

#[test]
fn bad_input_is_a_typed_error() {
    let (f, _) = ffn(true, 9);
    let msg = |e: powerinfer::Error| e.to_string();
    let none = InputScores::default();
    assert!(msg(f.greedy_allocation(&none, 0.3, 0.05).unwrap_err()).contains("record scores"));
    let scores = calibrate(&f, 64, 10);
    for step in [0.0, -0.1, 0.6, f64::NAN] {
        assert!(msg(f.greedy_allocation(&scores, 0.3, step).unwrap_err()).contains("step"));
    }
    for target in [-0.1, 0.96, f64::NAN] {
        assert!(msg(f.greedy_allocation(&scores, target, 0.05).unwrap_err()).contains("target"));
    }
    let mut bad = scores.clone();
    bad.samples[3] = f32::NAN;
    assert!(msg(f.greedy_allocation(&bad, 0.3, 0.05).unwrap_err()).contains("NaN"));
    bad.samples.pop();
    assert!(msg(f.greedy_allocation(&bad, 0.3, 0.05).unwrap_err()).contains("whole rows"));
}
