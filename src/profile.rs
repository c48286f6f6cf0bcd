//! Activation statistics gathered while the FFN runs (for calibration and placement).
//!
//! Off by default; when off, the FFN pays one relaxed atomic load per call. When on, it counts per
//! neuron how often `|h| > threshold` and keeps a log-scale histogram of `|h|` over all computed
//! (row, neuron) pairs, from which per-layer thresholds for a target sparsity are read.

/// Histogram bins per octave of `|h|`.
const PER_OCTAVE: f32 = 16.0;
/// Smallest octave tracked (`2^-MIN_EXP`); smaller magnitudes (and zeros) go to bin 0.
const MIN_EXP: f32 = 30.0;
/// Octaves tracked.
const OCTAVES: usize = 50;
const BINS: usize = 1 + OCTAVES * PER_OCTAVE as usize;

/// Per-neuron activation counts and the `|h|` distribution of one layer.
#[derive(Debug, Clone, PartialEq)]
pub struct ActivationStats {
    /// A neuron counts as active for a row when `|h| > threshold` (0 for ReLU: exact nonzero).
    pub threshold: f32,
    /// Rows (tokens) seen.
    pub tokens: u64,
    /// `counts[i]`: rows where neuron `i` was computed and active.
    pub counts: Vec<u64>,
    /// Log-scale histogram of `|h|` over computed (row, neuron) pairs (empty unless asked for:
    /// it costs a logarithm per pair).
    hist: Vec<u64>,
}

fn bin(v: f32) -> usize {
    let a = v.abs();
    if a == 0.0 || !a.is_finite() {
        return if a.is_finite() { 0 } else { BINS - 1 };
    }
    let b = ((a.log2() + MIN_EXP) * PER_OCTAVE).floor() + 1.0;
    b.clamp(0.0, (BINS - 1) as f32) as usize
}

/// Upper edge of bin `b`.
fn edge(b: usize) -> f32 {
    if b == 0 {
        return 0.0;
    }
    ((b as f32) / PER_OCTAVE - MIN_EXP).exp2()
}

impl ActivationStats {
    /// Empty per-neuron counts for `intermediate` neurons.
    pub fn new(intermediate: usize, threshold: f32) -> Self {
        ActivationStats {
            threshold,
            tokens: 0,
            counts: vec![0; intermediate],
            hist: Vec::new(),
        }
    }

    /// Counts plus the `|h|` histogram that [`ActivationStats::threshold_for_sparsity`] reads.
    pub fn with_magnitudes(intermediate: usize, threshold: f32) -> Self {
        ActivationStats {
            hist: vec![0; BINS],
            ..Self::new(intermediate, threshold)
        }
    }

    /// `counts[i] / tokens` (zeros before any token).
    pub fn frequencies(&self) -> Vec<f64> {
        let t = self.tokens.max(1) as f64;
        self.counts.iter().map(|&c| c as f64 / t).collect()
    }

    /// The `|h|` threshold below which a fraction `sparsity` of the recorded (row, neuron) pairs
    /// fall: thresholding `|h| > t` then drops about that fraction. Resolution is 1/16 octave
    /// (4.4%) of `|h|`; `None` before anything was recorded, without magnitudes, or for `sparsity`
    /// outside `[0, 1)`.
    pub fn threshold_for_sparsity(&self, sparsity: f64) -> Option<f32> {
        let total: u64 = self.hist.iter().sum();
        if total == 0 || !(0.0..1.0).contains(&sparsity) {
            return None;
        }
        let target = (sparsity * total as f64).round() as u64;
        let mut seen = 0u64;
        for (b, &n) in self.hist.iter().enumerate() {
            if seen + n > target {
                return Some(if b == 0 { 0.0 } else { edge(b - 1) });
            }
            seen += n;
        }
        Some(edge(BINS - 1))
    }

    /// Records the `h` values of `neurons` for `rows` rows (`h[p * rows + r]`).
    pub(crate) fn record(&mut self, neurons: &[u32], h: &[f32], rows: usize) {
        for (p, &i) in neurons.iter().enumerate() {
            let mut active = 0;
            for &v in &h[p * rows..(p + 1) * rows] {
                active += u64::from(v.abs() > self.threshold);
                if let Some(b) = self.hist.get_mut(bin(v)) {
                    *b += 1;
                }
            }
            self.counts[i as usize] += active;
        }
    }
}
