//! CHESS's gate-first filter for up: gate is computed (over its masked input, as usual), then
//! up and down only for the neurons whose score `|act(g_j)| * E|u_j|` exceeds a threshold
//! (`E|u_j|` from calibration). A skipped neuron's `h_j` is 0, so down skips its column too.
//!
//! Skipping a neuron's up skips one *row* of up, so in this layout up is kept as the file's
//! rows (GGUF blocks, row-major, the file's bytes) instead of columns, and it has no input rule.
//! A kept row is one block dot product (`Kernels::dot_gguf_q8`, scalar), whose float result can differ
//! from the packed kernel's in the last bits (on SmolLM2's Q4_1 FFN inputs most outputs do), so
//! this path equals the dense FFN to rounding, not bit for bit. It is an evaluated rule, not a tuned one:
//! on SmolLM2 it lost to TEAL at every budget (`docs/sparse-modes.md`).

use candle_core::quantized::QTensor;

use super::Columns;
use super::{InputScores, InputSparseFfn, InputThresholds, Scratch};
use crate::analysis::Histogram;
use crate::cpu::{dot_row, BlockKind, SimdLevel, CHUNK};
use crate::error::{Error, Result};
use crate::ffn::FfnSpec;
use crate::tensor_io::check_finite;

/// How up is stored.
pub(super) enum Up {
    /// By input: the TEAL / WINA rules skip columns.
    Columns(Columns),
    /// By neuron: the CHESS rule skips rows.
    Rows(UpRows),
}

impl Up {
    pub(super) fn bytes(&self) -> usize {
        match self {
            Up::Columns(m) => m.bytes(),
            Up::Rows(r) => r.data.len(),
        }
    }
}

/// Up's rows as the file stores them.
pub(super) struct UpRows {
    kind: BlockKind,
    row_bytes: usize,
    data: Vec<u8>,
}

impl UpRows {
    pub(super) fn row_bytes(&self) -> usize {
        self.row_bytes
    }

    fn row(&self, j: usize) -> &[u8] {
        &self.data[j * self.row_bytes..(j + 1) * self.row_bytes]
    }
}

/// CHESS's per-neuron rule: neuron `j`'s up row and down column are read only when
/// `|act(g_j)| * up_mean[j]` exceeds `threshold` (both finite and at least 0).
#[derive(Debug, Clone, PartialEq)]
pub struct ChessRule {
    /// Threshold on the score.
    pub threshold: f32,
    /// `E|u_j|` per neuron, from calibration.
    pub up_mean: Vec<f32>,
}

impl InputSparseFfn {
    /// A gated FFN on GGUF tensors (any block type of `cpu::BlockKind`) for the CHESS rule: gate
    /// and down as columns (with their input rules), up as the file's rows. No CHESS rule is set
    /// at first (every neuron computed).
    pub fn from_qtensors_up_rows(
        spec: FfnSpec,
        gate: &QTensor,
        up: &QTensor,
        down: &QTensor,
        threads: usize,
        tier: Option<SimdLevel>,
    ) -> Result<Self> {
        let (h, n) = (spec.hidden, spec.intermediate);
        let (kind, data) = super::matrix::blocks(up, "up_proj.weight", n, h)?;
        if h % kind.block_elems() != 0 {
            return Err(Error::shape(
                "up_proj.weight columns (a multiple of the block size)",
                &[None],
                &[h],
            ));
        }
        let data = data.into_owned();
        let row_bytes = kind.row_bytes(h);
        if data.len() != n * row_bytes {
            return Err(Error::shape(
                "up_proj.weight bytes",
                &[Some(n * row_bytes)],
                &[data.len()],
            ));
        }
        let rows = UpRows {
            kind,
            row_bytes,
            data,
        };
        let k = super::kernels(threads, tier)?;
        let gate = Columns::from_qtensor(gate, "gate_proj.weight", n, h, &k)?;
        let down = Columns::from_qtensor(down, "down_proj.weight", h, n, &k)?;
        Self::build(spec, Some(gate), Up::Rows(rows), down, threads, k)
    }

    /// Sets (or with `None` clears) the CHESS rule; needs up stored as rows
    /// ([`InputSparseFfn::from_qtensors_up_rows`]).
    pub fn set_chess_rule(&mut self, rule: Option<ChessRule>) -> Result<()> {
        if let Some(r) = &rule {
            if !matches!(self.up, Up::Rows(_)) {
                return Err(Error::config(
                    "CHESS rule",
                    "needs up stored as rows (InputSparseFfn::from_qtensors_up_rows)",
                ));
            }
            let n = self.spec.intermediate;
            if r.up_mean.len() != n {
                return Err(Error::shape(
                    "CHESS up_mean",
                    &[Some(n)],
                    &[r.up_mean.len()],
                ));
            }
            let ok = |v: f32| v.is_finite() && v >= 0.0;
            if !ok(r.threshold) || !r.up_mean.iter().all(|&v| ok(v)) {
                return Err(Error::config(
                    "CHESS rule",
                    "the threshold and up_mean must be finite and at least 0",
                ));
            }
        }
        self.chess = rule;
        Ok(())
    }

    /// The CHESS rule in use.
    pub fn chess_rule_in_use(&self) -> Option<&ChessRule> {
        self.chess.as_ref()
    }

    /// Whether up is stored as rows (the up-rows layout).
    pub fn has_up_rows(&self) -> bool {
        matches!(self.up, Up::Rows(_))
    }

    /// The CHESS rule that skips about the fraction `fraction` (in `[0, 1)`) of the neurons
    /// on the rows sampled in `scores` (which must come from this layer): `E|u_j|` from the
    /// recorded up values, the threshold from the scores of the samples' dense gate.
    pub fn chess_rule(&self, scores: &InputScores, fraction: f64) -> Result<ChessRule> {
        let (h, n) = (self.spec.hidden, self.spec.intermediate);
        if !self.spec.gated {
            return Err(Error::config("CHESS rule", "needs a gated FFN"));
        }
        if !(0.0..1.0).contains(&fraction) {
            return Err(Error::config(
                "CHESS fraction",
                format!("{fraction} is not in [0, 1)"),
            ));
        }
        let x = &scores.samples;
        if scores.rows == 0
            || scores.up_abs.len() != n
            || x.is_empty()
            || !x.len().is_multiple_of(h)
        {
            return Err(Error::config(
                "CHESS rule",
                "no recorded up values or samples for this layer: record scores on it first",
            ));
        }
        check_finite(x)?;
        let up_mean: Vec<f32> = scores
            .up_abs
            .iter()
            .map(|&a| (a / scores.rows as f64) as f32)
            .collect();
        let act = self.spec.activation;
        let mut hist = Histogram::default();
        let mut s = self.scratch.lock().unwrap_or_else(|e| e.into_inner());
        let traffic = s.traffic;
        let mut out = vec![0f32; h];
        for xr in x.chunks_exact(h) {
            self.row(&mut s, InputThresholds::default(), None, xr, &mut out);
            for (j, &g) in s.gu[..n].iter().enumerate() {
                let b = self.gate_bias.as_ref().map_or(0.0, |b| b[j]);
                hist.record(act.gated(g + b, 1.0).abs() * up_mean[j]);
            }
        }
        s.traffic = traffic;
        let threshold = if fraction == 0.0 {
            0.0
        } else {
            hist.threshold_for_fraction(fraction).unwrap_or(0.0)
        };
        Ok(ChessRule { threshold, up_mean })
    }

    /// Gate over its masked input, the CHESS rule, up's kept rows over the whole input;
    /// returns where up's values start in `s.gu` and, with a rule, how many neurons it kept
    /// (`s.keep` marks them).
    pub(super) fn gate_up_rows(
        &self,
        s: &mut Scratch,
        t: InputThresholds,
        rule: Option<&ChessRule>,
        x: &[f32],
        rows: &UpRows,
    ) -> (usize, Option<usize>) {
        let n = self.spec.intermediate;
        let Some(gm) = &self.gate else {
            return (0, None);
        };
        let Scratch {
            gate,
            up,
            gu,
            keep,
            kept,
            uk,
            ..
        } = s;
        gate.mask(x, self.weight(gm), t.gate, gm);
        let cg = gm.chunks();
        gu.resize(cg * CHUNK + n, 0.0);
        let (gp, ups) = gu.split_at_mut(cg * CHUNK);
        let k = &self.kernels;
        let gi = &*gate;
        self.pool.run_chunks(gp, cg, CHUNK, &|r, part| {
            gm.product(k, r, gi, part);
        });
        keep.clear();
        kept.clear();
        let act = self.spec.activation;
        match rule {
            None => keep.resize(n, true),
            Some(rule) => keep.extend(gp[..n].iter().zip(&rule.up_mean).enumerate().map(
                |(j, (&g, &m))| {
                    let b = self.gate_bias.as_ref().map_or(0.0, |b| b[j]);
                    act.gated(g + b, 1.0).abs() * m > rule.threshold
                },
            )),
        }
        kept.extend((0..n as u32).filter(|&j| keep[j as usize]));
        // Up's rows take the whole input (no input rule on rows).
        up.whole(x, rows.kind);
        uk.resize(kept.len(), 0.0);
        let (ui, ids) = (&*up, &*kept);
        self.pool.run_chunks(uk, ids.len(), 1, &|r, part| {
            for (o, &j) in part.iter_mut().zip(&ids[r]) {
                *o = dot_row(rows.kind, rows.row(j as usize), ui.quantized());
            }
        });
        ups.fill(0.0);
        for (&j, &u) in kept.iter().zip(uk.iter()) {
            ups[j as usize] = u;
        }
        (cg * CHUNK, rule.map(|_| kept.len()))
    }
}
