//! The dense pass: gate and/or up of every neuron for every row, and every neuron's contribution
//! `h`, in one parallel pass over the bundles. What exact-threshold predictors decide from and
//! what audits compare a predictor against (not the FFN's own path: that is `sparse.rs`).

use super::bundles::{BundleData, BundleView};
use super::kernels::{Kernels, RowElem};
use super::pool::Pool;
use super::quant::QuantizedRow;

/// A row of a neuron's bundle.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum NeuronRow {
    Gate,
    Up,
}

/// The inputs of a dense pass.
pub(crate) struct DensePass<'a> {
    pub bundles: BundleView<'a>,
    pub kernels: &'a Kernels,
    pub pool: &'a Pool,
    /// `rows * hidden` f32 values.
    pub x: &'a [f32],
    /// The rows quantized (quantized storage only).
    pub xq: &'a [QuantizedRow],
    pub rows: usize,
}

impl DensePass<'_> {
    /// `out[(i * K + s) * rows + r] = which[s](neuron i) . x_r + bias` for every neuron `i`,
    /// slot `s < K = which.len()` and row `r`. `Gate` of an ungated FFN reads its up row.
    pub fn products(&self, which: &[NeuronRow], out: &mut Vec<f32>) {
        let b = &self.bundles;
        let (n, rows, k) = (b.intermediate, self.rows, which.len());
        out.clear();
        out.resize(n * k * rows, 0.0);
        if k == 0 {
            return;
        }
        match b.data {
            BundleData::F32(w) => self.fill(w, which, out),
            BundleData::F16(w) => self.fill(w, which, out),
            BundleData::BF16(w) => self.fill(w, which, out),
            BundleData::Quant { kind, bytes } => {
                let kind = *kind;
                self.run(which, out, &|row, r| {
                    self.kernels.dot_split_q8(kind, &bytes[row], &self.xq[r])
                });
            }
        }
    }

    fn fill<E: RowElem>(&self, w: &[E], which: &[NeuronRow], out: &mut [f32]) {
        let (dot, h) = (self.kernels.dot::<E>(), self.bundles.hidden);
        self.run(which, out, &|row, r| {
            dot(&w[row], &self.x[r * h..(r + 1) * h])
        });
    }

    /// The pass: neurons in static shares, each neuron's rows read once for every input row
    /// (`dot(range of the row in storage, input row)`), prefetching a few neurons ahead.
    fn run(
        &self,
        which: &[NeuronRow],
        out: &mut [f32],
        dot: &(dyn Fn(std::ops::Range<usize>, usize) -> f32 + Sync),
    ) {
        let b = &self.bundles;
        let (rows, k, lay) = (self.rows, which.len(), b.layout);
        let at = |i: usize, which: NeuronRow| {
            let start = i * lay.stride()
                + match which {
                    NeuronRow::Gate if lay.gated => 0,
                    _ => lay.up_at(),
                };
            start..start + lay.row
        };
        let bias = |which: NeuronRow, i: usize| {
            let v = match which {
                NeuronRow::Gate if lay.gated => b.gate_bias,
                _ => b.up_bias,
            };
            v.map_or(0.0, |v| v[i])
        };
        // The rows this pass reads of neuron `i` (not its down row).
        let span = |i: usize| at(i, which[0]).start..at(i, which[k - 1]).end;
        let prefetch = |i: usize| match b.data {
            BundleData::F32(w) => super::prefetch(&w[span(i)]),
            BundleData::F16(w) => super::prefetch(&w[span(i)]),
            BundleData::BF16(w) => super::prefetch(&w[span(i)]),
            BundleData::Quant { bytes, .. } => super::prefetch(&bytes[span(i)]),
        };
        self.pool
            .run_chunks(out, b.intermediate, k * rows, &|range, part| {
                let end = range.end;
                for (p, i) in range.enumerate() {
                    if i + super::PREFETCH_AHEAD < end {
                        prefetch(i + super::PREFETCH_AHEAD);
                    }
                    for (s, &w) in which.iter().enumerate() {
                        for r in 0..rows {
                            part[(p * k + s) * rows + r] = dot(at(i, w), r) + bias(w, i);
                        }
                    }
                }
            });
    }

    /// Every neuron's contribution `h_i` for every row (`h[i * rows + r]`), computed densely.
    pub fn contributions(&self, h: &mut Vec<f32>, tmp: &mut Vec<f32>) {
        let b = &self.bundles;
        let (rows, act) = (self.rows, b.activation);
        h.clear();
        if b.layout.gated {
            self.products(&[NeuronRow::Gate, NeuronRow::Up], tmp);
            h.extend((0..b.intermediate * rows).map(|q| {
                let (i, r) = (q / rows, q % rows);
                act.gated(tmp[(i * 2) * rows + r], tmp[(i * 2 + 1) * rows + r])
            }));
        } else {
            self.products(&[NeuronRow::Up], tmp);
            h.extend(tmp.iter().map(|&u| act.ungated(u)));
        }
    }
}
