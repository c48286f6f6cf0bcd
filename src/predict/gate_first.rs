//! `GateFirst`: the cheap part of the FFN for every neuron decides which neurons run.

use crate::cpu::NeuronRow;
use crate::error::{Error, Result};

use super::{ActiveSet, PredictInput, Predictor};

/// Compute the cheap part of the FFN for every neuron, keep the neurons that matter.
///
/// - ReLU / dReLU: computes `gate x` (or `fc1 x` ungated) for all neurons and keeps those with
///   `act > threshold`; at threshold 0 this is exact (the others contribute exact zeros). Saves the
///   up and down rows of inactive neurons.
/// - SiLU / GELU: computes gate and up for all neurons and keeps those whose contribution
///   `|h_i| = |act(gate_i x) * up_i x|` exceeds `threshold`. Saves only the down rows; thresholding
///   `h`, not the gate, is what keeps quality (on SmolLM2 at 40% sparsity: +1.3% perplexity
///   against +15% for thresholding the gate alone).
///
/// Values computed here are handed to the FFN, never recomputed.
#[derive(Debug, Clone, Copy)]
pub struct GateFirst {
    threshold: f32,
}

impl GateFirst {
    /// A gate-first predictor; `threshold` must be finite and `>= 0`.
    pub fn new(threshold: f32) -> Result<Self> {
        if !threshold.is_finite() || threshold < 0.0 {
            return Err(Error::config(
                "threshold",
                format!("{threshold} must be finite and >= 0"),
            ));
        }
        Ok(GateFirst { threshold })
    }

    /// The threshold.
    pub fn threshold(&self) -> f32 {
        self.threshold
    }
}

impl Predictor for GateFirst {
    fn inline_threshold(&self) -> Option<f32> {
        Some(self.threshold)
    }

    fn predict(&self, input: &PredictInput<'_>, set: &mut ActiveSet) -> Result<()> {
        let spec = *input.bundles.spec();
        let (n, rows, t) = (spec.intermediate, input.rows, self.threshold);
        let act = spec.activation;
        let exact = act.exact_zeros();
        let dense = input.dense_pass();
        // What decides: the gate alone (exact zeros), else `h` (smooth gated, or `act(up)`).
        let gate_only = spec.gated && exact;
        let mut v = Vec::new();
        if gate_only {
            dense.products(&[NeuronRow::Gate], &mut v);
        } else {
            dense.contributions(&mut v, &mut Vec::new());
        }
        let keep = |i: usize, r: usize| {
            let x = v[i * rows + r];
            if gate_only {
                act.apply(x) > t
            } else {
                x.abs() > t
            }
        };
        for i in 0..n {
            for r in 0..rows {
                if keep(i, r) {
                    set.insert(r, i)?;
                }
            }
        }
        Ok(())
    }
}
