//! Predictors: which neurons to compute for each input row.
//!
//! A [`Predictor`] fills an [`ActiveSet`] for a batch of rows. `All` computes every neuron,
//! `Oracle` takes the sets it is given (tests, analysis), `GateFirst` computes the cheap part of the
//! FFN for every neuron and keeps those that matter (exact for ReLU/dReLU at threshold 0), and
//! `LowRank` runs a small `fc2(relu(fc1 x))` network. This module decides *which* neurons run; it
//! must not decide *where* (that is `place`) nor compute the FFN output (that is `cpu`).

use std::fmt;

pub use crate::active::ActiveSet;
use crate::cpu::{DensePass, Kernels, Pool};
use crate::error::{Error, Result};
use crate::ffn::NeuronBundles;

mod gate_first;
mod low_rank;
mod pre_norm;

pub use gate_first::GateFirst;
pub(crate) use low_rank::stored_bytes;
pub use low_rank::LowRank;
pub use pre_norm::PreNormLowRank;

/// What a predictor sees: the FFN input rows (f32, exactly the tensor the FFN gets) and, for
/// predictors inside this crate, the layer's weights and kernels.
pub struct PredictInput<'a> {
    /// `rows * hidden` values, row-major.
    pub x: &'a [f32],
    /// Number of rows.
    pub rows: usize,
    /// Model size.
    pub hidden: usize,
    /// Per row, `sqrt(mean(u^2) + eps)` of the input `u` before the FFN's RMSNorm, when the host
    /// passed it ([`crate::HybridFfn::forward_f32_with_row_rms`]): what a predictor scored on the
    /// pre-norm residual needs ([`Predictor::needs_row_rms`]).
    pub row_rms: Option<&'a [f32]>,
    pub(crate) bundles: &'a NeuronBundles,
    pub(crate) kernels: &'a Kernels,
    pub(crate) pool: &'a Pool,
    /// The rows quantized to 8 bits (only for quantized storage).
    pub(crate) xq: &'a [crate::cpu::QuantizedRow],
}

impl PredictInput<'_> {
    /// Row `r` of the input; `None` past the last row.
    pub fn row(&self, r: usize) -> Option<&[f32]> {
        self.x.get(r * self.hidden..(r + 1) * self.hidden)
    }

    /// Every neuron's products for these rows (the dense pass, on the layer's kernels and pool).
    pub(crate) fn dense_pass(&self) -> DensePass<'_> {
        DensePass {
            bundles: self.bundles.view(),
            kernels: self.kernels,
            pool: self.pool,
            x: self.x,
            xq: self.xq,
            rows: self.rows,
        }
    }
}

/// Chooses the active neurons of a batch. `set` arrives reset to the batch's rows and the layer's
/// neurons; fill it with [`ActiveSet::insert`] or [`ActiveSet::fill_all`].
pub trait Predictor: Send + Sync + fmt::Debug {
    /// Fills `set` for the rows of `input`.
    fn predict(&self, input: &PredictInput<'_>, set: &mut ActiveSet) -> Result<()>;

    /// Bytes of weights this predictor holds (counted against a tier's budget).
    fn weight_bytes(&self) -> usize {
        0
    }

    /// `Some(t)` when this predictor is exactly "keep neuron `i` for a row when its activation
    /// passes `t`" (`act(gate) > t` for ReLU/dReLU, `|h| > t` otherwise). The FFN then applies
    /// the rule inline, in its one pass over the weights: it computes gate (and up) of every
    /// neuron and reads the down row only of neurons that pass, instead of running
    /// [`Predictor::predict`] as a separate pass. Both give the same output.
    fn inline_threshold(&self) -> Option<f32> {
        None
    }

    /// Whether [`Predictor::predict`] needs [`PredictInput::row_rms`], the RMS of each row
    /// before the FFN's norm (PowerInfer's llama predictors at a non-zero threshold). The host
    /// then calls [`crate::HybridFfn::forward_f32_with_row_rms`].
    fn needs_row_rms(&self) -> bool {
        false
    }
}

/// Every neuron, every row: the dense FFN through the sparse kernels.
#[derive(Debug, Clone, Copy, Default)]
pub struct All;

impl Predictor for All {
    fn predict(&self, _: &PredictInput<'_>, set: &mut ActiveSet) -> Result<()> {
        set.fill_all();
        Ok(())
    }
}

/// The exact sets, given up front: one per row, or one for all rows. For tests and analysis.
#[derive(Debug, Clone)]
pub struct Oracle {
    sets: Vec<Vec<u32>>,
}

impl Oracle {
    /// One set per row of the batches it will see (or a single set used for every row).
    pub fn new(sets: Vec<Vec<u32>>) -> Self {
        Oracle { sets }
    }
}

impl Predictor for Oracle {
    fn predict(&self, input: &PredictInput<'_>, set: &mut ActiveSet) -> Result<()> {
        if self.sets.len() != 1 && self.sets.len() != input.rows {
            return Err(Error::count(
                "oracle sets per batch row",
                input.rows,
                self.sets.len(),
            ));
        }
        for r in 0..input.rows {
            let s = &self.sets[if self.sets.len() == 1 { 0 } else { r }];
            for &i in s {
                set.insert(r, i as usize)?;
            }
        }
        Ok(())
    }
}
