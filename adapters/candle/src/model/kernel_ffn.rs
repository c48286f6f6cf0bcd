//! [`KernelFfn`]: the dense FFN of the fused decoder, on the file's blocks through powerinfer's
//! packed products and one thread pool.

use powerinfer::cpu::{PackedRows, QuantizedRow};
use powerinfer::layers::QLinear;

use crate::error::Result;

/// A dense FFN on the file's blocks through our kernels: gate and up stacked in one `QLinear`,
/// `act(gate) * up` in f32, the activations quantized once, and the down `QLinear`. With Q4_1
/// weights its products are bit-identical to candle's quantized matmul.
#[derive(Debug)]
pub struct KernelFfn {
    pub(crate) gate_up: QLinear,
    pub(crate) down: QLinear,
    pub(crate) act: powerinfer::Activation,
}

/// Reused buffers of [`KernelFfn::forward_rows`].
#[derive(Debug, Default)]
pub(crate) struct KernelFfnScratch {
    gu: Vec<f32>,
    hq: Vec<QuantizedRow>,
    h: Vec<f32>,
}

impl KernelFfn {
    /// The dense FFN on gate's, up's and down's packed rows (gate and up as one layer: one
    /// pass over the input, as the loader's stacked tensors), on `threads` threads.
    pub(crate) fn from_rows(
        [gate, up, down]: [PackedRows; 3],
        act: powerinfer::Activation,
        threads: usize,
    ) -> Result<Self> {
        Ok(KernelFfn {
            gate_up: QLinear::from_parts(vec![gate, up], None, threads)?,
            down: QLinear::from_packed(down, None, threads)?,
            act,
        })
    }

    /// `rows` normed rows `x` (already quantized in `xq`) into `out` (`rows * hidden`).
    pub(crate) fn forward_rows(
        &self,
        xq: &[QuantizedRow],
        out: &mut [f32],
        s: &mut KernelFfnScratch,
        tmp: &mut Vec<f32>,
    ) -> Result<()> {
        let rows = xq.len();
        let inter = self.down.dims().1;
        s.gu.resize(rows * 2 * inter, 0.0);
        self.gate_up.forward_quantized(xq, &mut s.gu, tmp)?;
        s.h.resize(rows * inter, 0.0);
        let (act, gu) = (self.act, &s.gu);
        let gated = |range: std::ops::Range<usize>, part: &mut [f32]| {
            for (h, r) in part.chunks_exact_mut(inter).zip(range) {
                let (g, u) = gu[2 * inter * r..2 * inter * (r + 1)].split_at(inter);
                act.gated_into(g, u, h);
            }
        };
        // A prompt's rows are shared among the threads; one row is not worth a dispatch.
        if rows > 1 {
            self.down.pool().run_chunks(&mut s.h, rows, inter, &gated);
        } else {
            gated(0..rows, &mut s.h);
        }
        let hq = self.down.quantize_input(&mut s.hq, &s.h);
        self.down.forward_quantized(hq, out, tmp)?;
        Ok(())
    }
}
