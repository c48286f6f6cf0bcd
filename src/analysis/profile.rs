//! Activation statistics gathered while the FFN runs (for calibration and placement).
//!
//! Off by default; when off, the FFN pays one relaxed atomic load per call. When on, it counts per
//! neuron how often `|h| > threshold` and keeps a log-scale histogram of `|h|` over all computed
//! (row, neuron) pairs, from which per-layer thresholds for a target sparsity are read.

/// Histogram bins per octave of `|h|` (the top 4 mantissa bits).
const MANTISSA_BITS: u32 = 4;
/// Smallest octave tracked (`2^-MIN_EXP`); smaller magnitudes (and zeros) go to bin 0.
const MIN_EXP: u32 = 30;
/// Octaves tracked (`2^-30 .. 2^20`); larger magnitudes and infinities go to the last bin.
const OCTAVES: u32 = 50;
const BINS: usize = 1 + (OCTAVES << MANTISSA_BITS) as usize;
/// `bits >> SHIFT` of the smallest tracked magnitude.
const BASE: u32 = (127 - MIN_EXP) << MANTISSA_BITS;
const SHIFT: u32 = 23 - MANTISSA_BITS;

/// Per-neuron activation counts and the `|h|` distribution of one layer.
#[derive(Debug, Clone, PartialEq)]
pub struct ActivationStats {
    /// A neuron counts as active for a row when `|h| > threshold` (0 for ReLU: exact nonzero).
    pub threshold: f32,
    /// Rows (tokens) seen.
    pub tokens: u64,
    /// `counts[i]`: rows where neuron `i` was computed and active.
    pub counts: Vec<u64>,
    /// Log-scale histogram of `|h|` over computed (row, neuron) pairs (only when asked for).
    hist: Option<Histogram>,
}

/// Log-scale bin of `|v|` from its bits: exponent and top mantissa bits, no logarithm.
#[inline]
fn bin(v: f32) -> usize {
    let key = (v.abs().to_bits() >> SHIFT) as usize;
    (key + 1).saturating_sub(BASE as usize).min(BINS - 1)
}

/// Upper edge of bin `b` (every value in bins `..=b` is below it).
fn edge(b: usize) -> f32 {
    if b == 0 {
        return f32::from_bits(BASE << SHIFT);
    }
    f32::from_bits(((b as u32).min(BINS as u32 - 1) + BASE) << SHIFT)
}

/// A log-scale histogram of magnitudes (1/16 octave per bin, from `2^-30` to `2^20`): the
/// distribution calibration reads thresholds from.
#[derive(Debug, Clone, PartialEq)]
pub struct Histogram {
    bins: Vec<u64>,
}

impl Default for Histogram {
    fn default() -> Self {
        Self::new()
    }
}

impl Histogram {
    /// An empty histogram.
    pub fn new() -> Self {
        Histogram {
            bins: vec![0; BINS],
        }
    }

    /// Counts `|v|`.
    #[inline]
    pub fn record(&mut self, v: f32) {
        self.bins[bin(v)] += 1;
    }

    /// Counts every `|v|` of `vs`.
    pub fn record_all(&mut self, vs: &[f32]) {
        for &v in vs {
            self.record(v);
        }
    }

    /// Values counted.
    pub fn count(&self) -> u64 {
        self.bins.iter().sum()
    }

    /// The magnitude below which a fraction `fraction` of the counted values fall: thresholding
    /// `|v| > t` then drops about that fraction. Resolution is 1/16 octave (at most 6.3%) of the
    /// magnitude; `None` before anything was counted or for `fraction` outside `[0, 1)`.
    pub fn threshold_for_fraction(&self, fraction: f64) -> Option<f32> {
        let total = self.count();
        if total == 0 || !(0.0..1.0).contains(&fraction) {
            return None;
        }
        let target = (fraction * total as f64).round() as u64;
        let mut seen = 0u64;
        for (b, &n) in self.bins.iter().enumerate() {
            if seen + n > target {
                return Some(if b == 0 { 0.0 } else { edge(b - 1) });
            }
            seen += n;
        }
        Some(edge(BINS - 1))
    }
}

impl ActivationStats {
    /// Empty per-neuron counts for `intermediate` neurons.
    pub fn new(intermediate: usize, threshold: f32) -> Self {
        ActivationStats {
            threshold,
            tokens: 0,
            counts: vec![0; intermediate],
            hist: None,
        }
    }

    /// Counts plus the `|h|` histogram that [`ActivationStats::threshold_for_sparsity`] reads.
    pub fn with_magnitudes(intermediate: usize, threshold: f32) -> Self {
        ActivationStats {
            hist: Some(Histogram::new()),
            ..Self::new(intermediate, threshold)
        }
    }

    /// `counts[i] / tokens` (zeros before any token).
    pub fn frequencies(&self) -> Vec<f64> {
        let t = self.tokens.max(1) as f64;
        self.counts.iter().map(|&c| c as f64 / t).collect()
    }

    /// The `|h|` threshold below which a fraction `sparsity` of the recorded (row, neuron) pairs
    /// fall: thresholding `|h| > t` then drops about that fraction (see
    /// [`Histogram::threshold_for_fraction`]). `None` without magnitudes.
    pub fn threshold_for_sparsity(&self, sparsity: f64) -> Option<f32> {
        self.hist.as_ref()?.threshold_for_fraction(sparsity)
    }

    /// Records `rows` rows of activations given row-major (`h[r * intermediate + i]`, every
    /// neuron computed), counting the rows as tokens.
    pub fn record_rows(&mut self, h: &[f32], rows: usize) {
        let n = self.counts.len();
        for row in h.chunks_exact(n).take(rows) {
            for (c, &v) in self.counts.iter_mut().zip(row) {
                *c += u64::from(v.abs() > self.threshold);
            }
            if let Some(hist) = &mut self.hist {
                hist.record_all(row);
            }
        }
        self.tokens += rows as u64;
    }

    /// Records the `h` values of `neurons` for `rows` rows (`h[p * rows + r]`).
    pub(crate) fn record(&mut self, neurons: &[u32], h: &[f32], rows: usize) {
        for (p, &i) in neurons.iter().enumerate() {
            let mut active = 0;
            for &v in &h[p * rows..(p + 1) * rows] {
                active += u64::from(v.abs() > self.threshold);
                if let Some(hist) = &mut self.hist {
                    hist.record(v);
                }
            }
            self.counts[i as usize] += active;
        }
    }
}

/// A predictor's quality on live traffic: each call's predicted set against the exact set
/// `|h_i| > threshold`, computed densely next to it (evaluation only: it costs a dense FFN).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct PredictorAudit {
    /// The `|h|` threshold that defines "truly active".
    pub threshold: f32,
    /// Rows seen.
    pub tokens: u64,
    /// (row, neuron) pairs seen.
    pub pairs: u64,
    /// Pairs truly active.
    pub truth: u64,
    /// Pairs predicted active.
    pub predicted: u64,
    /// Pairs both.
    pub hits: u64,
    /// `sum |h|` over all pairs.
    pub mass: f64,
    /// `sum |h|` over predicted pairs.
    pub mass_kept: f64,
    /// Time spent in the predictor.
    pub predict_time: std::time::Duration,
    /// Predictor calls timed.
    pub calls: u64,
}

impl PredictorAudit {
    /// Share of truly active pairs that were predicted.
    pub fn recall(&self) -> f64 {
        self.hits as f64 / self.truth.max(1) as f64
    }

    /// Share of predicted pairs that were truly active.
    pub fn precision(&self) -> f64 {
        self.hits as f64 / self.predicted.max(1) as f64
    }

    /// Share of pairs not predicted (realized sparsity).
    pub fn sparsity(&self) -> f64 {
        1.0 - self.predicted as f64 / self.pairs.max(1) as f64
    }

    /// Share of the activation mass `sum |h|` the predicted pairs carry.
    pub fn mass_captured(&self) -> f64 {
        self.mass_kept / self.mass.max(f64::MIN_POSITIVE)
    }

    /// Compares one call: `h[i * rows + r]` against `predicted(r, i)`.
    pub(crate) fn record(
        &mut self,
        h: &[f32],
        rows: usize,
        predicted: impl Fn(usize, usize) -> bool,
    ) {
        for (q, &v) in h.iter().enumerate() {
            let (i, r) = (q / rows, q % rows);
            let (t, p) = (v.abs() > self.threshold, predicted(r, i));
            self.truth += u64::from(t);
            self.predicted += u64::from(p);
            self.hits += u64::from(t && p);
            let a = f64::from(v.abs());
            self.mass += a;
            if p {
                self.mass_kept += a;
            }
        }
        self.pairs += h.len() as u64;
        self.tokens += rows as u64;
    }
}
