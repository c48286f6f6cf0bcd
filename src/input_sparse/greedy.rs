//! TEAL's greedy allocation of one layer's sparsity between its matrices.
//!
//! Starting from the dense FFN, each step raises the dropped fraction of one matrix (gate, up or
//! down) by `step`: the one whose output error on sampled FFN inputs grows least per byte gained.
//! The path is recorded, so one run serves every target up to the last. The error is measured on
//! the engine's own products (the file's weights, the kernels that run), relative to the dense
//! output of the same rows.

use super::{InputScores, InputSparseFfn, InputThresholds};
use crate::error::{Error, Result};
use crate::tensor_io::check_finite;

/// One step of a [`GreedyPath`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GreedyStep {
    /// Fractions of the gate, up and down entries dropped.
    pub fractions: [f64; 3],
    /// Their mean weighted by the matrices' bytes: the share of the FFN's values not read.
    pub skipped: f64,
    /// Relative squared error of the FFN output on the samples:
    /// `sum |y - y_dense|^2 / sum |y_dense|^2`.
    pub error: f64,
}

/// The steps of one layer's greedy allocation, `skipped` increasing.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct GreedyPath {
    /// In order.
    pub steps: Vec<GreedyStep>,
}

impl GreedyPath {
    /// The fractions of the first step that skips at least `target` (all zero for a target of 0);
    /// `None` when the path stops short of it.
    pub fn at(&self, target: f64) -> Option<[f64; 3]> {
        if target <= 0.0 {
            return Some([0.0; 3]);
        }
        self.steps
            .iter()
            .find(|s| s.skipped >= target - 1e-9)
            .map(|s| s.fractions)
    }
}

/// The largest fraction of a matrix's entries a step may drop.
const MAX_FRACTION: f64 = 0.95;

impl InputSparseFfn {
    /// The greedy path up to `target` (byte-weighted share of the FFN's values skipped, in
    /// `[0, 0.95]`) in steps of `step` (in `(0, 0.5]`), on the rows sampled in `scores` (which
    /// must come from this layer: [`InputSparseFfn::record_scores`] under this layer's score).
    /// Thresholds come from `scores`' histograms, as at run time. Each step costs one pass over
    /// the samples per candidate matrix. A CHESS rule is not applied here; with up stored
    /// as rows, only gate and down move.
    pub fn greedy_allocation(
        &self,
        scores: &InputScores,
        target: f64,
        step: f64,
    ) -> Result<GreedyPath> {
        if !(step > 0.0 && step <= 0.5) {
            return Err(Error::config(
                "greedy step",
                format!("{step} is not in (0, 0.5]"),
            ));
        }
        if !(0.0..=MAX_FRACTION).contains(&target) {
            return Err(Error::config(
                "greedy target",
                format!("{target} is not in [0, {MAX_FRACTION}]"),
            ));
        }
        let h = self.spec.hidden;
        let x = &scores.samples;
        let rows = x.len() / h;
        if rows == 0 || !x.len().is_multiple_of(h) {
            return Err(Error::config(
                "greedy allocation",
                format!(
                    "{} sampled values are not whole rows of {h}: record scores on this layer first",
                    x.len()
                ),
            ));
        }
        check_finite(x)?;
        let (g, u, d) = self.matrix_bytes();
        let bytes = [g as f64, u as f64, d as f64];
        let total: f64 = bytes.iter().sum();
        let skipped = |f: &[f64; 3]| f.iter().zip(&bytes).map(|(f, b)| f * b).sum::<f64>() / total;

        let mut s = self.scratch.lock().unwrap_or_else(|e| e.into_inner());
        let traffic = s.traffic;
        let mut dense = vec![0f32; rows * h];
        for (xr, o) in x.chunks_exact(h).zip(dense.chunks_exact_mut(h)) {
            self.row(&mut s, InputThresholds::default(), None, xr, o);
        }
        let norm = dense
            .iter()
            .map(|&v| (v as f64).powi(2))
            .sum::<f64>()
            .max(f64::MIN_POSITIVE);
        let mut out = vec![0f32; h];
        let mut error = |f: [f64; 3], s: &mut super::Scratch| -> Result<f64> {
            let t = scores.thresholds(f).ok_or_else(|| {
                Error::config("greedy allocation", "the score histograms are empty")
            })?;
            let mut e = 0f64;
            for (xr, yr) in x.chunks_exact(h).zip(dense.chunks_exact(h)) {
                self.row(s, t, None, xr, &mut out);
                e += out
                    .iter()
                    .zip(yr)
                    .map(|(&a, &b)| ((a - b) as f64).powi(2))
                    .sum::<f64>();
            }
            Ok(e / norm)
        };

        // Up stored as rows has no input rule.
        let candidates: &[usize] = match (self.gate.is_some(), self.has_up_rows()) {
            (true, false) => &[0, 1, 2],
            (true, true) => &[0, 2],
            (false, _) => &[1, 2],
        };
        let (mut f, mut err) = ([0f64; 3], 0f64);
        let mut path = GreedyPath::default();
        let run = (|| {
            while skipped(&f) < target - 1e-9 {
                let mut best: Option<(f64, [f64; 3], f64)> = None;
                for &m in candidates {
                    if f[m] >= MAX_FRACTION - 1e-9 {
                        continue;
                    }
                    let mut next = f;
                    next[m] = (next[m] + step).min(MAX_FRACTION);
                    let e = error(next, &mut s)?;
                    let cost = (e - err) / (skipped(&next) - skipped(&f));
                    if best.is_none_or(|(c, ..)| cost < c) {
                        best = Some((cost, next, e));
                    }
                }
                let Some((_, next, e)) = best else { break };
                (f, err) = (next, e);
                path.steps.push(GreedyStep {
                    fractions: f,
                    skipped: skipped(&f),
                    error: e,
                });
            }
            Ok(())
        })();
        s.traffic = traffic;
        run.map(|()| path)
    }
}
