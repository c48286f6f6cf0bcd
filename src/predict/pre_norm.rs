//! PowerInfer's llama predictor, scored on the normed FFN input: `PreNormLowRank`, which reads
//! the per-row RMS the host passes in [`PredictInput::row_rms`].

use candle_core::{DType, Tensor};

use crate::error::{Error, Result};

use super::{ActiveSet, LowRank, PredictInput, Predictor};

/// PowerInfer's llama predictor where the FFN input is normed: PowerInfer computes
/// `score = fc2 relu(fc1 u)` on the residual stream `u` *before* the FFN's RMSNorm, and runs
/// neuron `i` when `score_i >= threshold`; the FFN (and so a [`Predictor`]) sees
/// `n = norm_weight * u / rms(u)`.
///
/// Since `relu` and `fc2` are positively homogeneous, `score(u) = rms(u) * fc2 relu(fc1' n)` with
/// `fc1' = fc1 diag(1 / norm_weight)`. So:
/// - at threshold 0 (PowerInfer's default) the rule is exact without knowing `rms(u)`;
/// - at any other threshold the host must hand over `rms(u)` per row in the call
///   ([`PredictInput::row_rms`], through `HybridFfn::forward_f32_with_row_rms`); without it
///   `predict` is a typed error.
///
/// A zero in `norm_weight` makes `u` unrecoverable and is rejected at construction.
pub struct PreNormLowRank {
    /// `fc1 diag(1 / norm_weight)` and `fc2`, scored as a plain `LowRank` on the normed input.
    inner: LowRank,
    threshold: f32,
}

impl std::fmt::Debug for PreNormLowRank {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PreNormLowRank")
            .field("inner", &self.inner)
            .field("threshold", &self.threshold)
            .finish()
    }
}

impl PreNormLowRank {
    /// From `fc1: [rank, hidden]`, `fc2: [intermediate, rank]`, the FFN norm's weight `[hidden]`
    /// and the threshold.
    pub fn new(fc1: &Tensor, fc2: &Tensor, norm_weight: &Tensor, threshold: f32) -> Result<Self> {
        // LowRank checks shapes, dtypes, finiteness and the threshold the same way.
        let lr = LowRank::new(fc1, fc2, threshold)?;
        let (hidden, _) = lr.dims();
        if norm_weight.dims() != [hidden] {
            return Err(Error::shape(
                "ffn_norm.weight",
                &[Some(hidden)],
                norm_weight.dims(),
            ));
        }
        let w = norm_weight.to_dtype(DType::F32)?.to_vec1::<f32>()?;
        if let Some(k) = w.iter().position(|&x| x == 0.0 || !x.is_finite()) {
            return Err(Error::config(
                "ffn_norm.weight",
                format!(
                    "element {k} is {}: the pre-norm input cannot be recovered",
                    w[k]
                ),
            ));
        }
        let mut f1 = fc1.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
        for row in f1.chunks_mut(hidden) {
            for (a, &s) in row.iter_mut().zip(&w) {
                *a /= s;
            }
        }
        if let Some(i) = f1.iter().position(|x| !x.is_finite()) {
            return Err(Error::non_finite("fc1.weight / ffn_norm.weight", i));
        }
        let f1 = Tensor::from_vec(f1, (lr.rank(), hidden), &candle_core::Device::Cpu)?;
        Ok(PreNormLowRank {
            inner: LowRank::new(&f1, fc2, threshold)?,
            threshold,
        })
    }

    /// The threshold.
    pub fn threshold(&self) -> f32 {
        self.threshold
    }
}

impl Predictor for PreNormLowRank {
    fn predict(&self, input: &PredictInput<'_>, set: &mut ActiveSet) -> Result<()> {
        if self.threshold == 0.0 {
            // rms(u) > 0 does not change the sign: exact without it.
            return self.inner.score_rows(input, set, |set, r, i, s| {
                if s >= 0.0 {
                    set.insert(r, i)?;
                }
                Ok(())
            });
        }
        let rms = input.row_rms.ok_or_else(|| {
            Error::config(
                "row_rms",
                "a non-zero PowerInfer threshold needs the pre-norm RMS of each row \
                 (HybridFfn::forward_f32_with_row_rms)",
            )
        })?;
        if rms.len() != input.rows {
            return Err(Error::count(
                "row_rms values per batch row",
                input.rows,
                rms.len(),
            ));
        }
        let t = self.threshold;
        self.inner.score_rows(input, set, |set, r, i, s| {
            if rms[r] * s >= t {
                set.insert(r, i)?;
            }
            Ok(())
        })
    }

    fn weight_bytes(&self) -> usize {
        self.inner.weight_bytes()
    }

    /// At a non-zero threshold (at 0 the rule is exact without it).
    fn needs_row_rms(&self) -> bool {
        self.threshold != 0.0
    }
}
