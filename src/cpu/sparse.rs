//! The CPU tier: the FFN restricted to a list of neurons, over a batch of rows.
//!
//! For each listed neuron it reads the neuron's contiguous bundle once per block of rows, computes
//! `h = act(gate . x) * (up . x)` for the rows where the neuron is active (reusing values the
//! predictor already computed), and adds `h * down^T_i` into a per-thread accumulator. Threads take
//! static contiguous shares of the list, so each accumulator's summation order is fixed.

use super::bundles::{BundleData, BundleView};
use super::kernels::{Kernels, RowElem};
use super::pool::{share, Pool};
use super::quant::{QuantKind, QuantizedRow};
use crate::active::ActiveSet;

/// Rows processed per pass over the weights: enough reuse of each bundle from L1/L2, small enough
/// that the rows' inputs and accumulators stay in L2.
const ROW_BLOCK: usize = 8;

/// Neurons whose down rows are accumulated together (one accumulator pass per group).
const GROUP: usize = 4;

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
    pub bundles: BundleView<'a>,
    pub kernels: &'a Kernels,
    pub x: &'a [f32],
    pub rows: usize,
    pub set: &'a ActiveSet,
    /// The input rows quantized to 8 bits (filled only for quantized storage).
    pub xq: &'a [QuantizedRow],
    /// A predictor's threshold applied inline (see `Predictor::inline_threshold`).
    pub rule: Option<f32>,
}

impl SparseJob<'_> {
    /// `h` after the inline rule: `act(g)` must exceed `t` for exact-zero activations (checked
    /// before `up` is computed, see `gate_passes`), `|h|` must exceed `t` otherwise.
    #[inline(always)]
    fn keep(&self, h: f32) -> f32 {
        let b = &self.bundles;
        let pass = match self.rule {
            None => true,
            // Gated: the gate already passed in `gate_passes`. Ungated: h = act(up) itself.
            Some(t) if b.activation.exact_zeros() => b.layout.gated || h > t,
            Some(t) => h.abs() > t,
        };
        if pass {
            h
        } else {
            0.0
        }
    }

    /// For exact-zero gated activations under an inline rule: whether the gate value passes, so
    /// the up row is read at all.
    #[inline(always)]
    fn gate_passes(&self, g: f32) -> bool {
        let act = self.bundles.activation;
        match self.rule {
            Some(t) if act.exact_zeros() => act.apply(g) > t,
            _ => true,
        }
    }

    /// Computes the partial output of `neurons` into `states[t].acc` (zeroed first), one static
    /// share per pool thread. `states` must hold `pool.threads()` entries.
    pub fn run(&self, pool: &Pool, neurons: &[u32], states: &mut [ThreadScratch]) {
        let (rows, h) = (self.rows, self.bundles.hidden);
        let n = pool.threads();
        pool.run_with(states, &|t, st| {
            let mine = &neurons[share(neurons.len(), t, n)];
            st.acc.clear();
            st.acc.resize(rows * h, 0.0);
            st.h.clear();
            st.h.resize(mine.len() * rows, 0.0);
            match self.bundles.data {
                BundleData::F32(w) => self.partial(w, mine, st),
                BundleData::F16(w) => self.partial(w, mine, st),
                BundleData::BF16(w) => self.partial(w, mine, st),
                BundleData::Quant { kind, bytes } => self.partial_quant(*kind, bytes, mine, st),
            }
        });
    }

    /// The CPU tier on quantized bundles (rows in the split layout, see `split.rs`): integer dots
    /// of gate/up rows against the quantized input, the down rows of four neurons added per pass
    /// over the accumulator.
    fn partial_quant(&self, kind: QuantKind, w: &[u8], neurons: &[u32], st: &mut ThreadScratch) {
        let b = &self.bundles;
        let (h, rows, act, gated) = (b.hidden, self.rows, b.activation, b.layout.gated);
        let lay = b.layout;
        let (rg, stride, up_at) = (lay.row, lay.stride(), lay.up_at());
        let k = self.kernels;
        let (gate_bias, up_bias) = (b.gate_bias, b.up_bias);
        let set = self.set;
        // Every neuron in every row and `up` needed whatever the gate is: gate and up in one
        // pass over the input.
        let both = gated && set.is_all() && !(self.rule.is_some() && act.exact_zeros());
        // `h` of neuron `i` (bundle `b`) for row `r`, or 0 when not in the row's set or dropped.
        let contribution = |b: &[u8], i: usize, r: usize| -> f32 {
            let xq = &self.xq[r];
            if both {
                let [g, u] = k.dot2_split_q8(kind, [&b[..rg], &b[rg..2 * rg]], xq);
                let g = g + gate_bias.map_or(0.0, |b| b[i]);
                return self.keep(act.gated(g, u + up_bias.map_or(0.0, |b| b[i])));
            }
            if !set.has(r, i) {
                return 0.0;
            }
            let up =
                || k.dot_split_q8(kind, &b[up_at..up_at + rg], xq) + up_bias.map_or(0.0, |b| b[i]);
            if gated {
                let g = k.dot_split_q8(kind, &b[..rg], xq) + gate_bias.map_or(0.0, |b| b[i]);
                if self.gate_passes(g) {
                    self.keep(act.gated(g, up()))
                } else {
                    0.0
                }
            } else {
                self.keep(act.ungated(up()))
            }
        };
        let down_of = |i: usize| &w[i * stride + lay.down_at()..(i + 1) * stride];
        // Down rows waiting to be added, per row of the block: four at a time (`axpy4` reads and
        // writes the accumulator once for four rows), from whichever neurons passed, in list order.
        let mut pending = [[(0f32, 0usize); GROUP]; ROW_BLOCK];
        let mut waiting = [0usize; ROW_BLOCK];
        for rb in (0..rows).step_by(ROW_BLOCK) {
            let re = (rb + ROW_BLOCK).min(rows);
            for (g, group) in neurons.chunks(GROUP).enumerate() {
                // The next group's bundles (PREFETCH_AHEAD neurons ahead).
                let ahead = (g + 1) * GROUP + crate::cpu::PREFETCH_AHEAD - GROUP;
                for &a in neurons.iter().skip(ahead).take(GROUP) {
                    let a = a as usize;
                    crate::cpu::prefetch(&w[lay.bundle(a)]);
                }
                for r in rb..re {
                    let (p, n) = (&mut pending[r - rb], &mut waiting[r - rb]);
                    for (j, &i) in group.iter().enumerate() {
                        let i = i as usize;
                        let v = contribution(&w[lay.bundle(i)], i, r);
                        st.h[(g * GROUP + j) * rows + r] = v;
                        if v != 0.0 {
                            p[*n] = (v, i);
                            *n += 1;
                            if *n == GROUP {
                                k.axpy4_split_q8_0(
                                    &mut st.acc[r * h..(r + 1) * h],
                                    p.map(|(v, _)| v),
                                    p.map(|(_, i)| down_of(i)),
                                );
                                *n = 0;
                            }
                        }
                    }
                }
            }
            for r in rb..re {
                let n = std::mem::take(&mut waiting[r - rb]);
                for &(v, i) in &pending[r - rb][..n] {
                    k.axpy_split_q8_0(&mut st.acc[r * h..(r + 1) * h], v, down_of(i));
                }
            }
        }
    }

    fn partial<E: RowElem>(&self, w: &[E], neurons: &[u32], st: &mut ThreadScratch) {
        let bv = &self.bundles;
        let (h, rows, act, gated) = (bv.hidden, self.rows, bv.activation, bv.layout.gated);
        let lay = bv.layout;
        let (dot, axpy, axpy4, dot4) = (
            self.kernels.dot::<E>(),
            self.kernels.axpy::<E>(),
            self.kernels.axpy4::<E>(),
            self.kernels.dot4::<E>(),
        );
        let (gate_bias, up_bias) = (bv.gate_bias, bv.up_bias);
        let set = self.set;
        // `h` of neuron `i` for row `r`, or 0 when the neuron is not in the row's set.
        let contribution = |b: &[E], i: usize, r: usize| -> f32 {
            if !set.has(r, i) {
                return 0.0;
            }
            let xr = &self.x[r * h..(r + 1) * h];
            let (gate, up) = if gated {
                (Some(&b[..h]), &b[h..2 * h])
            } else {
                (None, &b[..h])
            };
            let u = || dot(up, xr) + up_bias.map_or(0.0, |b| b[i]);
            match gate {
                Some(g) => {
                    let gv = dot(g, xr) + gate_bias.map_or(0.0, |b| b[i]);
                    if self.gate_passes(gv) {
                        self.keep(act.gated(gv, u()))
                    } else {
                        0.0
                    }
                }
                None => self.keep(act.ungated(u())),
            }
        };
        let (down_off, up_off) = (lay.down_at(), lay.up_at());
        for rb in (0..rows).step_by(ROW_BLOCK) {
            let re = (rb + ROW_BLOCK).min(rows);
            // Groups of four neurons: the accumulator row is read and written once per group.
            for (g, group) in neurons.chunks(GROUP).enumerate() {
                let bundles: [&[E]; GROUP] = std::array::from_fn(|k| {
                    let i = group.get(k).map_or(group[0], |&i| i) as usize;
                    &w[lay.bundle(i)]
                });
                let full = group.len() == GROUP;
                for r in rb..re {
                    let mut hv = [0f32; GROUP];
                    if full && group.iter().all(|&i| set.has(r, i as usize)) {
                        // All four active: four rows per pass over x.
                        let xr = &self.x[r * h..(r + 1) * h];
                        let u = dot4(bundles.map(|b| &b[up_off..up_off + h]), xr);
                        let bias =
                            |b: Option<&[f32]>, k: usize| b.map_or(0.0, |b| b[group[k] as usize]);
                        if gated {
                            let gv = dot4(bundles.map(|b| &b[..h]), xr);
                            for k in 0..GROUP {
                                let g = gv[k] + bias(gate_bias, k);
                                hv[k] = if self.gate_passes(g) {
                                    self.keep(act.gated(g, u[k] + bias(up_bias, k)))
                                } else {
                                    0.0
                                };
                            }
                        } else {
                            for k in 0..GROUP {
                                hv[k] = self.keep(act.ungated(u[k] + bias(up_bias, k)));
                            }
                        }
                    } else {
                        for (k, &i) in group.iter().enumerate() {
                            hv[k] = contribution(bundles[k], i as usize, r);
                        }
                    }
                    for (k, &v) in hv.iter().enumerate().take(group.len()) {
                        st.h[(g * GROUP + k) * rows + r] = v;
                    }
                    let acc = &mut st.acc[r * h..(r + 1) * h];
                    if group.len() == GROUP && hv.iter().all(|&v| v != 0.0) {
                        axpy4(acc, hv, bundles.map(|b| &b[down_off..]));
                    } else {
                        for (&v, b) in hv.iter().zip(&bundles).take(group.len()) {
                            if v != 0.0 {
                                axpy(acc, v, &b[down_off..]);
                            }
                        }
                    }
                }
            }
        }
    }
}
