//! Activation statistics gathered while the FFN runs (for calibration and placement).
//!
//! Off by default; when off, the FFN pays one relaxed atomic load per call.

/// Per-neuron activation counts of one layer.
#[derive(Debug, Clone, PartialEq)]
pub struct ActivationStats {
    /// A neuron counts as active for a row when `|h| > threshold` (0 for ReLU: exact nonzero).
    pub threshold: f32,
    /// Rows (tokens) seen.
    pub tokens: u64,
    /// `counts[i]`: rows where neuron `i` was computed and active.
    pub counts: Vec<u64>,
}

impl ActivationStats {
    /// Empty statistics for `intermediate` neurons.
    pub fn new(intermediate: usize, threshold: f32) -> Self {
        ActivationStats {
            threshold,
            tokens: 0,
            counts: vec![0; intermediate],
        }
    }

    /// `counts[i] / tokens` (zeros before any token).
    pub fn frequencies(&self) -> Vec<f64> {
        let t = self.tokens.max(1) as f64;
        self.counts.iter().map(|&c| c as f64 / t).collect()
    }

    /// Records the `h` values of `neurons` for `rows` rows (`h[p * rows + r]`).
    pub(crate) fn record(&mut self, neurons: &[u32], h: &[f32], rows: usize) {
        for (p, &i) in neurons.iter().enumerate() {
            let active = h[p * rows..(p + 1) * rows]
                .iter()
                .filter(|v| v.abs() > self.threshold)
                .count();
            self.counts[i as usize] += active as u64;
        }
    }
}
