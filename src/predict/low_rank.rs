//! `LowRank`: a small `fc2(relu(fc1 x))` network scores every neuron.

use std::fmt;
use std::sync::Mutex;

use candle_core::{DType, Tensor};

use crate::cpu::share;
use crate::error::{Error, Result};

use super::{ActiveSet, PredictInput, Predictor};

/// Multiply-adds below which `LowRank` runs on the calling thread alone.
const SERIAL_WORK: usize = 1 << 18;

/// A low-rank predictor `score = fc2 relu(fc1 x) + b`; neuron `i` is active when
/// `score_i >= threshold`. Skips all rows (gate, up, down) of neurons it leaves out. Weights are
/// held in f16 (the predictor's bytes count against the fast tier), computed in f32.
pub struct LowRank {
    fc1: Vec<half::f16>,
    /// `fc2` transposed, `[rank, intermediate]`: the score is a sum of `rank` scaled rows, so the
    /// ReLU zeros of the bottleneck skip whole rows.
    fc2t: Vec<half::f16>,
    bias: Option<Vec<f32>>,
    rank: usize,
    hidden: usize,
    intermediate: usize,
    threshold: f32,
    scratch: Mutex<(Vec<f32>, Vec<f32>, Vec<f32>)>,
}

impl fmt::Debug for LowRank {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LowRank")
            .field("rank", &self.rank)
            .field("hidden", &self.hidden)
            .field("intermediate", &self.intermediate)
            .field("bias", &self.bias.is_some())
            .field("threshold", &self.threshold)
            .finish()
    }
}

fn finite_f32(t: &Tensor, name: &str) -> Result<Vec<f32>> {
    crate::ffn::WeightDType::from_candle(t.dtype(), name)?;
    let v = t.flatten_all()?.to_dtype(DType::F32)?.to_vec1::<f32>()?;
    match v.iter().position(|x| !x.is_finite()) {
        Some(i) => Err(Error::non_finite(name, i)),
        None => Ok(v),
    }
}

fn to_f16(v: &[f32], name: &str) -> Result<Vec<half::f16>> {
    let h: Vec<half::f16> = v.iter().map(|&x| half::f16::from_f32(x)).collect();
    match h.iter().position(|x| !x.is_finite()) {
        Some(i) => Err(Error::config(
            name,
            format!("value {} at flat index {i} overflows f16", v[i]),
        )),
        None => Ok(h),
    }
}

impl LowRank {
    /// From `fc1: [rank, hidden]` and `fc2: [intermediate, rank]` (linear `[out, in]` layout).
    pub fn new(fc1: &Tensor, fc2: &Tensor, threshold: f32) -> Result<Self> {
        let (rank, hidden) = match fc1.dims() {
            &[r, h] if r > 0 && h > 0 => (r, h),
            d => return Err(Error::shape("predictor.fc1.weight", &[None, None], d)),
        };
        let intermediate = match fc2.dims() {
            &[n, r] if r == rank && n > 0 => n,
            d => return Err(Error::shape("predictor.fc2.weight", &[None, Some(rank)], d)),
        };
        check_threshold(threshold)?;
        let (n1, n2) = ("predictor.fc1.weight", "predictor.fc2.weight");
        let fc2 = to_f16(&finite_f32(fc2, n2)?, n2)?;
        let fc2t = (0..rank * intermediate)
            .map(|q| fc2[(q % intermediate) * rank + q / intermediate])
            .collect();
        Ok(LowRank {
            fc1: to_f16(&finite_f32(fc1, n1)?, n1)?,
            fc2t,
            bias: None,
            rank,
            hidden,
            intermediate,
            threshold,
            scratch: Mutex::new((Vec::new(), Vec::new(), Vec::new())),
        })
    }

    /// Adds a per-neuron bias `b: [intermediate]` to the score.
    pub fn with_bias(mut self, b: &Tensor) -> Result<Self> {
        if b.dims() != [self.intermediate] {
            return Err(Error::shape(
                "predictor.fc2.bias",
                &[Some(self.intermediate)],
                b.dims(),
            ));
        }
        self.bias = Some(finite_f32(b, "predictor.fc2.bias")?);
        Ok(self)
    }

    /// The same weights with another score threshold.
    pub fn with_threshold(&self, threshold: f32) -> Result<Self> {
        check_threshold(threshold)?;
        Ok(LowRank {
            fc1: self.fc1.clone(),
            fc2t: self.fc2t.clone(),
            bias: self.bias.clone(),
            threshold,
            scratch: Mutex::new((Vec::new(), Vec::new(), Vec::new())),
            ..*self
        })
    }

    /// Rank of the bottleneck.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// The score threshold.
    pub fn threshold(&self) -> f32 {
        self.threshold
    }

    /// `(hidden, intermediate)` this predictor was built for.
    pub fn dims(&self) -> (usize, usize) {
        (self.hidden, self.intermediate)
    }
}

fn check_threshold(threshold: f32) -> Result<()> {
    if threshold.is_finite() {
        Ok(())
    } else {
        Err(Error::config(
            "threshold",
            format!("{threshold} is not finite"),
        ))
    }
}

impl LowRank {
    /// Computes every (row, neuron) score `fc2 relu(fc1 x) + b` of `input` and hands each to
    /// `keep(set, row, neuron, score)`. Shared by `LowRank` and PowerInfer's pre-norm predictor.
    pub(crate) fn score_rows(
        &self,
        input: &PredictInput<'_>,
        set: &mut ActiveSet,
        mut keep: impl FnMut(&mut ActiveSet, usize, usize, f32) -> Result<()>,
    ) -> Result<()> {
        if input.hidden != self.hidden || set.intermediate() != self.intermediate {
            return Err(Error::shape(
                "predictor (hidden, intermediate)",
                &[Some(self.hidden), Some(self.intermediate)],
                &[input.hidden, set.intermediate()],
            ));
        }
        let (rows, rank, k) = (input.rows, self.rank, input.kernels);
        let mut guard = self.scratch.lock().unwrap_or_else(|e| e.into_inner());
        let (z, zt, scores) = &mut *guard;
        z.clear();
        z.resize(rows * rank, 0.0);
        let (h, n) = (self.hidden, self.intermediate);
        // A decode-sized predictor (a few hundred thousand multiply-adds) runs on the calling
        // thread: waking the pool twice would cost more than the work.
        let parts = if rows * rank * (h + n) <= SERIAL_WORK {
            1
        } else {
            input.pool.threads()
        };
        let run = |data: &mut [f32],
                   items: usize,
                   f: &(dyn Fn(std::ops::Range<usize>, &mut [f32]) + Sync)| {
            if parts == 1 {
                f(0..items, data);
            } else {
                input.pool.run_chunks(data, items, rows, f);
            }
        };
        // fc1 by bottleneck unit `j` (`z[j * rows + r]`), then ReLU.
        run(z, rank, &|range, part| {
            for (p, j) in range.enumerate() {
                let w = &self.fc1[j * h..(j + 1) * h];
                for r in 0..rows {
                    // `r < rows`: always a row.
                    part[p * rows + r] = input.row(r).map_or(0.0, |x| k.dot_f16(w, x).max(0.0));
                }
            }
        });
        // Back to row-major (`zt[r * rank + j]`) for fc2.
        zt.clear();
        zt.extend((0..rows * rank).map(|q| z[(q % rank) * rows + q / rank]));
        let z: &[f32] = zt;
        // fc2 by neuron range: part `t` holds its share of neurons for every row, laid out
        // `[r * len + p]`, as `bias + sum_j z_j fc2t_j` (rows of zero `z_j` skipped).
        scores.clear();
        scores.resize(n * rows, 0.0);
        let bias = self.bias.as_deref();
        run(scores, n, &|range, part| {
            let len = range.len();
            for (r, out) in part.chunks_exact_mut(len.max(1)).take(rows).enumerate() {
                match bias {
                    Some(b) => out.copy_from_slice(&b[range.clone()]),
                    None => out.fill(0.0),
                }
                for (j, &a) in z[r * rank..(r + 1) * rank].iter().enumerate() {
                    if a != 0.0 {
                        k.axpy_f16(out, a, &self.fc2t[j * n + range.start..j * n + range.end]);
                    }
                }
            }
        });
        for t in 0..parts {
            let range = share(n, t, parts);
            let (len, base) = (range.len(), range.start * rows);
            for r in 0..rows {
                for (p, i) in range.clone().enumerate() {
                    keep(set, r, i, scores[base + r * len + p])?;
                }
            }
        }
        Ok(())
    }
}

impl Predictor for LowRank {
    fn predict(&self, input: &PredictInput<'_>, set: &mut ActiveSet) -> Result<()> {
        let t = self.threshold;
        self.score_rows(input, set, |set, r, i, s| {
            if s >= t {
                set.insert(r, i)?;
            }
            Ok(())
        })
    }

    fn weight_bytes(&self) -> usize {
        stored_bytes(
            self.fc1.len(),
            self.fc2t.len(),
            self.bias.as_ref().map_or(0, Vec::len),
        )
    }
}

/// Bytes a low-rank predictor takes where it is kept (and in a placement budget): f16 `fc1` and
/// `fc2` weights, f32 bias.
pub(crate) fn stored_bytes(fc1: usize, fc2: usize, bias: usize) -> usize {
    (fc1 + fc2) * 2 + bias * 4
}
