//! The CPU tier: the FFN restricted to a list of neurons, over a batch of rows.
//!
//! For each listed neuron it reads the neuron's contiguous bundle once per block of rows, computes
//! `h = act(gate . x) * (up . x)` for the rows where the neuron is active (reusing values the
//! predictor already computed), and adds `h * down^T_i` into a per-thread accumulator. Threads take
//! static contiguous shares of the list, so each accumulator's summation order is fixed.

use super::kernels::{Kernels, RowElem};
use super::pool::{share, Pool};
use crate::ffn::{BundleData, NeuronBundles};
use crate::predict::ActiveSet;

/// Rows processed per pass over the weights: enough reuse of each bundle from L1/L2, small enough
/// that the rows' inputs and accumulators stay in L2.
const ROW_BLOCK: usize = 8;

/// One thread's reusable buffers.
#[derive(Debug, Default, Clone)]
pub(crate) struct ThreadScratch {
    /// `rows * hidden` partial output.
    pub acc: Vec<f32>,
    /// `h` per (position in this thread's share, row): `[p * rows + r]`.
    pub h: Vec<f32>,
}

/// Everything a tier run reads.
pub(crate) struct SparseJob<'a> {
    pub bundles: &'a NeuronBundles,
    pub kernels: &'a Kernels,
    pub x: &'a [f32],
    pub rows: usize,
    pub set: &'a ActiveSet,
}

impl SparseJob<'_> {
    /// Computes the partial output of `neurons` into `states[t].acc` (zeroed first), one static
    /// share per pool thread. `states` must hold `pool.threads()` entries.
    pub fn run(&self, pool: &Pool, neurons: &[u32], states: &mut [ThreadScratch]) {
        let (rows, h) = (self.rows, self.bundles.spec().hidden);
        let n = pool.threads();
        pool.run_with(states, &|t, st| {
            let mine = &neurons[share(neurons.len(), t, n)];
            st.acc.clear();
            st.acc.resize(rows * h, 0.0);
            st.h.clear();
            st.h.resize(mine.len() * rows, 0.0);
            match &self.bundles.data {
                BundleData::F32(w) => self.partial(w, mine, st),
                BundleData::F16(w) => self.partial(w, mine, st),
                BundleData::BF16(w) => self.partial(w, mine, st),
            }
        });
    }

    fn partial<E: RowElem>(&self, w: &[E], neurons: &[u32], st: &mut ThreadScratch) {
        let spec = self.bundles.spec();
        let (h, rows, act) = (spec.hidden, self.rows, spec.activation);
        let stride = spec.rows_per_neuron() * h;
        let (dot, axpy) = (self.kernels.dot::<E>(), self.kernels.axpy::<E>());
        let gate_bias = self.bundles.gate_bias.as_deref();
        let up_bias = self.bundles.up_bias.as_deref();
        let set = self.set;
        for rb in (0..rows).step_by(ROW_BLOCK) {
            let re = (rb + ROW_BLOCK).min(rows);
            for (p, &i) in neurons.iter().enumerate() {
                let i = i as usize;
                let b = &w[i * stride..(i + 1) * stride];
                let (gate, up, down) = if spec.gated {
                    (Some(&b[..h]), &b[h..2 * h], &b[2 * h..])
                } else {
                    (None, &b[..h], &b[h..])
                };
                for r in rb..re {
                    let v = if set.contains(r, i) {
                        let xr = &self.x[r * h..(r + 1) * h];
                        let u = set
                            .known_up(r, i)
                            .unwrap_or_else(|| dot(up, xr) + up_bias.map_or(0.0, |b| b[i]));
                        match gate {
                            Some(g) => {
                                let gv = set.known_gate(r, i).unwrap_or_else(|| {
                                    dot(g, xr) + gate_bias.map_or(0.0, |b| b[i])
                                });
                                act.gated(gv, u)
                            }
                            None => act.ungated(u),
                        }
                    } else {
                        0.0
                    };
                    st.h[p * rows + r] = v;
                    if v != 0.0 {
                        axpy(&mut st.acc[r * h..(r + 1) * h], v, down);
                    }
                }
            }
        }
    }
}
