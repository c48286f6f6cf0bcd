//! The rule's types: how entries are scored, the per-layer thresholds, the calibration
//! histograms they are read from, and the weight bytes a run read.

use crate::analysis::Histogram;
use crate::error::{Error, Result};

/// How an input entry is scored against its matrix's threshold.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum InputScore {
    /// `|x_i|` (TEAL).
    #[default]
    Magnitude,
    /// `|x_i| * ||W[:, i]||_2`, the input times the norm of the column it feeds (WINA; on `h`
    /// the rule of "Sparsing Law").
    Wina,
}

impl InputScore {
    /// The name used in artifacts and on the command line (`teal`, `wina`).
    pub fn name(self) -> &'static str {
        match self {
            InputScore::Magnitude => "teal",
            InputScore::Wina => "wina",
        }
    }

    /// The score named `name` (see [`InputScore::name`]).
    pub fn from_name(name: &str) -> Result<Self> {
        match name {
            "teal" => Ok(InputScore::Magnitude),
            "wina" => Ok(InputScore::Wina),
            other => Err(Error::config(
                "input score",
                format!("`{other}` is not one of teal, wina"),
            )),
        }
    }
}

/// Fractions of the (gate, up, down) entries dropped for a mean `target` over the three
/// matrices (of equal size): down drops `down_multiple` times the target (at most 0.95), gate
/// and up share the rest equally.
pub fn split_target(target: f64, down_multiple: f64) -> [f64; 3] {
    let d = (down_multiple * target).min(0.95);
    let gu = ((3.0 * target - d) / 2.0).clamp(0.0, 0.95);
    [gu, gu, d]
}

/// Per-matrix thresholds of one layer: an entry is kept when its score exceeds the threshold.
/// All zero keeps every nonzero entry (the dense FFN).
#[derive(Debug, Clone, Copy, PartialEq, Default, serde::Serialize, serde::Deserialize)]
pub struct InputThresholds {
    /// On the FFN input, for the gate product.
    pub gate: f32,
    /// On the FFN input, for the up product.
    pub up: f32,
    /// On `h`, for the down product.
    pub down: f32,
}

impl InputThresholds {
    pub(crate) fn check(&self) -> Result<()> {
        for (name, t) in [("gate", self.gate), ("up", self.up), ("down", self.down)] {
            if !t.is_finite() || t < 0.0 {
                return Err(Error::config(
                    "input threshold",
                    format!("{name} threshold {t} must be finite and at least 0"),
                ));
            }
        }
        Ok(())
    }
}

/// The score distributions of one layer's three matrices, for calibration.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct InputScores {
    /// Scores of the FFN input entries for gate.
    pub gate: Histogram,
    /// For up.
    pub up: Histogram,
    /// Scores of `h` for down.
    pub down: Histogram,
    /// FFN input rows sampled while recording (every [`SAMPLE_EVERY`]-th row, at most
    /// [`MAX_SAMPLES`]), row-major: what [`InputSparseFfn::greedy_allocation`] measures the
    /// output error on.
    ///
    /// [`InputSparseFfn::greedy_allocation`]: crate::InputSparseFfn::greedy_allocation
    pub samples: Vec<f32>,
    /// Rows recorded.
    pub rows: u64,
    /// Per neuron, the sum of `|u_j|` (up's output) over the recorded rows: `E|u_j|` for the
    /// CHESS rule.
    pub up_abs: Vec<f64>,
    /// Per neuron, the sum of `|h_j|` (down's input) over the recorded rows: which neurons
    /// [`crate::tier::hot_neurons`] puts on a device.
    pub h_abs: Vec<f64>,
}

/// While recording, every `SAMPLE_EVERY`-th FFN input row is kept as a sample.
pub const SAMPLE_EVERY: u64 = 8;
/// The most rows kept as samples per layer.
pub const MAX_SAMPLES: usize = 128;

impl InputScores {
    /// Thresholds that drop about the fractions `sparsity` (gate, up, down) of the recorded
    /// entries; `None` before anything was recorded or for a fraction outside `[0, 1)`.
    /// A fraction of 0 gives the threshold 0 (every nonzero entry kept, also for a matrix with
    /// no histogram, such as the gate of an ungated FFN).
    pub fn thresholds(&self, sparsity: [f64; 3]) -> Option<InputThresholds> {
        let t = |hist: &Histogram, f: f64| {
            if f == 0.0 {
                Some(0.0)
            } else {
                hist.threshold_for_fraction(f)
            }
        };
        Some(InputThresholds {
            gate: t(&self.gate, sparsity[0])?,
            up: t(&self.up, sparsity[1])?,
            down: t(&self.down, sparsity[2])?,
        })
    }
}

/// Weight bytes a layer (an FFN or a projection) read and would have read densely, summed over
/// rows.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct WeightTraffic {
    /// Rows computed.
    pub rows: u64,
    /// Weight bytes read.
    pub read: u64,
    /// Weight bytes a dense product reads for the same rows.
    pub dense: u64,
}

impl WeightTraffic {
    /// The fraction of the dense weight bytes not read (0 before any row).
    pub fn skipped(&self) -> f64 {
        if self.dense == 0 {
            0.0
        } else {
            1.0 - self.read as f64 / self.dense as f64
        }
    }

    /// Adds `other`'s counts.
    pub fn add(&mut self, other: &WeightTraffic) {
        self.rows += other.rows;
        self.read += other.read;
        self.dense += other.dense;
    }
}
