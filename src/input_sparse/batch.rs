//! A prompt's rows through the input-sparse FFN at once: each row is masked by the same rule as
//! a decoded row, and each product reads the union of the rows' kept channels once per tile of
//! rows ([`Columns::product_rows`]), so the weights stream once per prompt instead of once per
//! row. Each row's result is what [`InputSparseFfn`] computes for it alone, bit for bit: prefill
//! computes the sparse rows generation computes, and `eval` over a text measures exactly what
//! decoding it would.

use std::cell::RefCell;

use super::matrix::{chunked_at as at, Columns, Inputs};
use super::{InputSparseFfn, InputThresholds, Scratch};
use crate::cpu::CHUNK;

/// Reused buffers of the batched path, one set per calling thread and shared by every layer
/// (a layer's call does not outlive it): held per layer they were the model's size again at a
/// 512-row window (28 layers x 5 buffers of `rows x intermediate` on Qwen2.5-1.5B).
#[derive(Debug, Default)]
struct Batch {
    gate: Inputs,
    up: Inputs,
    down: Inputs,
    /// Gate then up outputs, by chunk (see [`Columns::product_rows`]).
    gu: Vec<f32>,
    /// `h` and up's values, `rows * intermediate` each.
    h: Vec<f32>,
    u: Vec<f32>,
    /// With hot neurons: `h` over every neuron (the hot ones 0), swapped into `h`.
    hs: Vec<f32>,
    /// Down's outputs, by chunk.
    y: Vec<f32>,
}

thread_local! {
    static BATCH: RefCell<Batch> = RefCell::default();
}

impl InputSparseFfn {
    /// `rows` rows of `x` (up stored by column) into `out`: masks, gate and up in one dispatch,
    /// `h`, down in a second, as [`InputSparseFfn::row`] per row.
    pub(super) fn rows_batched(
        &self,
        s: &mut Scratch,
        t: InputThresholds,
        um: &Columns,
        x: &[f32],
        rows: usize,
        out: &mut [f32],
    ) {
        super::with_local(&BATCH, |b| self.rows_batched_in(b, s, t, um, x, rows, out))
    }

    #[allow(clippy::too_many_arguments)]
    fn rows_batched_in(
        &self,
        b: &mut Batch,
        s: &mut Scratch,
        t: InputThresholds,
        um: &Columns,
        x: &[f32],
        rows: usize,
        out: &mut [f32],
    ) {
        let (hd, n) = (self.spec.hidden, self.spec.intermediate);
        // Gate's and up's rows: the cold neurons of a split FFN, else every neuron.
        let nc = self.split.as_ref().map_or(n, |sp| sp.cold.len());
        for xr in x.chunks_exact(hd) {
            self.record(xr, None);
        }
        if let Some(gm) = &self.gate {
            b.gate.mask(x, self.weight(gm), t.gate, gm, &self.pool);
        }
        let shared = self.shares_input(t);
        if !shared {
            b.up.mask(x, self.weight(um), t.up, um, &self.pool);
        }
        let cg = self.gate.as_ref().map_or(0, |g| g.chunks());
        let cu = um.chunks();
        b.gu.resize((cg + cu) * rows * CHUNK, 0.0);
        let k = &self.kernels;
        let (gate_in, up_in) = (&b.gate, if shared { &b.gate } else { &b.up });
        self.pool
            .run_chunks(&mut b.gu, cg + cu, rows * CHUNK, &|r, part| {
                // Gate chunks first, then up chunks.
                let split = (cg.clamp(r.start, r.end) - r.start) * rows * CHUNK;
                let (pg, pu) = part.split_at_mut(split);
                if let Some(gm) = &self.gate {
                    if !pg.is_empty() {
                        gm.product_rows(k, r.start..cg.min(r.end), gate_in, pg);
                    }
                }
                if !pu.is_empty() {
                    um.product_rows(k, r.start.max(cg) - cg..r.end - cg, up_in, pu);
                }
            });
        let act = self.spec.activation;
        let bias = |b: &Option<Vec<f32>>, j: usize| b.as_ref().map_or(0.0, |b| b[j]);
        b.h.resize(rows * nc, 0.0);
        b.u.resize(rows * nc, 0.0);
        // Each row's `h` and up values on the pool (rows in static shares), then recorded in
        // row order.
        let gu = &b.gu;
        let gated = self.gate.is_some();
        let biased = self.gate_bias.is_some() || self.up_bias.is_some();
        self.pool.run_chunks(&mut b.h, rows, nc, &|rr, part| {
            for (r, h) in rr.zip(part.chunks_exact_mut(nc)) {
                if biased {
                    for (j, hv) in h.iter_mut().enumerate() {
                        let up = gu[at(cg, rows, r, j)] + bias(&self.up_bias, j);
                        *hv = match gated {
                            true => act.gated(gu[at(0, rows, r, j)] + bias(&self.gate_bias, j), up),
                            false => act.ungated(up),
                        };
                    }
                    continue;
                }
                // Without biases, one tight loop per chunk (contiguous in `gu`).
                for (c, hc) in h.chunks_mut(CHUNK).enumerate() {
                    let u = &gu[at(cg, rows, r, c * CHUNK)..][..hc.len()];
                    match gated {
                        true => act.gated_into(&gu[at(0, rows, r, c * CHUNK)..][..hc.len()], u, hc),
                        false => act.ungated_into(u, hc),
                    }
                }
            }
        });
        self.pool.run_chunks(&mut b.u, rows, nc, &|rr, part| {
            for (r, u) in rr.zip(part.chunks_exact_mut(nc)) {
                for (j, uv) in u.iter_mut().enumerate() {
                    *uv = gu[at(cg, rows, r, j)];
                }
            }
        });
        if let Some(sp) = &self.split {
            sp.scatter(&b.h, rows, n, &mut b.hs);
            std::mem::swap(&mut b.h, &mut b.hs);
        }
        for r in 0..rows {
            let (h, u) = (&b.h[r * n..(r + 1) * n], &b.u[r * nc..(r + 1) * nc]);
            self.record(&x[r * hd..(r + 1) * hd], Some((h, u)));
        }
        b.down.mask(
            &b.h,
            self.weight(&self.down),
            t.down,
            &self.down,
            &self.pool,
        );
        let cd = self.down.chunks();
        b.y.resize(cd * rows * CHUNK, 0.0);
        let down_in = &b.down;
        self.pool
            .run_chunks(&mut b.y, cd, rows * CHUNK, &|r, part| {
                self.down.product_rows(k, r, down_in, part);
            });
        for (r, o) in out.chunks_exact_mut(hd).enumerate() {
            for (i, o) in o.iter_mut().enumerate() {
                let v = b.y[at(0, rows, r, i)];
                *o = self.down_bias.as_ref().map_or(v, |b| v + b[i]);
            }
        }
        let dense = self.down.dense_bytes()
            + self.gate.as_ref().map_or(0, |g| g.dense_bytes())
            + um.dense_bytes();
        for r in 0..rows {
            let mut read = self.down.row_bytes_read(&b.down, r) + um.row_bytes_read(up_in, r);
            if let Some(gm) = &self.gate {
                read += gm.row_bytes_read(&b.gate, r);
            }
            s.traffic.rows += 1;
            s.traffic.read += read as u64;
            s.traffic.dense += dense as u64;
        }
    }
}
