//! `QLinear`: a dense linear layer on GGUF Q4_0 / Q4_1 / Q8_0 weights through the engine's
//! integer kernels and pool, for the parts of a model around the sparse FFN (attention
//! projections) where candle's own quantized matmul has no SIMD path for the block type.
//!
//! Each input row is quantized to 8 bits per 32 values once; every output feature is one
//! `dot_q` of its weight row. Threads take static ranges of output features.

use std::sync::{Arc, Mutex};

use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{DType, Module, Tensor};

use crate::cpu::{Kernels, Pool, QuantKind, QuantizedRow};
use crate::error::{Error, Result};
use crate::input::{check_rows, to_tensor, with_f32};

/// A quantized linear layer `y = W x (+ b)` with `W: [out, in]` in GGUF blocks.
pub struct QLinear {
    kind: QuantKind,
    w: Vec<u8>,
    out: usize,
    inp: usize,
    bias: Option<Vec<f32>>,
    kernels: Kernels,
    pool: Arc<Pool>,
    scratch: Mutex<(Vec<QuantizedRow>, Vec<f32>)>,
}

impl std::fmt::Debug for QLinear {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("QLinear")
            .field("kind", &self.kind)
            .field("out", &self.out)
            .field("in", &self.inp)
            .finish()
    }
}

impl QLinear {
    /// From a GGUF tensor of Q4_0, Q4_1 or Q8_0 blocks (`[out, in]`, `in` a multiple of 32); other
    /// block types are a typed error (use candle's `QMatMul` for those).
    pub fn new(w: &QTensor, bias: Option<&Tensor>, threads: usize) -> Result<Self> {
        let kind = match w.dtype() {
            GgmlDType::Q4_0 => QuantKind::Q4_0,
            GgmlDType::Q4_1 => QuantKind::Q4_1,
            GgmlDType::Q8_0 => QuantKind::Q8_0,
            other => {
                return Err(Error::config(
                    "QLinear weight",
                    format!("block type {other:?} is not Q4_0, Q4_1 or Q8_0"),
                ))
            }
        };
        let (out, inp) = match w.shape().dims() {
            &[o, i] if o > 0 && i > 0 && i % crate::cpu::QK == 0 => (o, i),
            d => return Err(Error::shape("QLinear weight", &[None, None], d)),
        };
        let bias = match bias {
            Some(b) if b.dims() != [out] => {
                return Err(Error::shape("QLinear bias", &[Some(out)], b.dims()))
            }
            Some(b) => Some(b.to_dtype(DType::F32)?.to_vec1::<f32>()?),
            None => None,
        };
        Ok(QLinear {
            kind,
            w: w.data()?.into_owned(),
            out,
            inp,
            bias,
            kernels: Kernels::detect()?,
            pool: Pool::shared(threads.max(1)),
            scratch: Mutex::new((Vec::new(), Vec::new())),
        })
    }

    /// `(out, in)` features.
    pub fn dims(&self) -> (usize, usize) {
        (self.out, self.inp)
    }

    /// `y = W x + b` for `rows` rows of `x` (`rows * in`) into `y` (`rows * out`).
    pub fn forward_f32(&self, x: &[f32], rows: usize, y: &mut [f32]) -> Result<()> {
        if x.len() != rows * self.inp || y.len() != rows * self.out {
            return Err(Error::shape(
                "QLinear input",
                &[Some(rows * self.inp)],
                &[x.len()],
            ));
        }
        let mut guard = self.scratch.lock().unwrap_or_else(|e| e.into_inner());
        let (xq, tmp) = &mut *guard;
        if xq.len() < rows {
            xq.resize_with(rows, Default::default);
        }
        for (q, xr) in xq.iter_mut().zip(x.chunks_exact(self.inp)) {
            q.quantize(xr);
        }
        tmp.clear();
        tmp.resize(self.out * rows, 0.0);
        let rb = self.kind.row_bytes(self.inp);
        let (w, k, kind, xq) = (&self.w, &self.kernels, self.kind, &xq[..rows]);
        let bias = self.bias.as_deref();
        self.pool.run_chunks(tmp, self.out, rows, &|range, part| {
            let end = range.end;
            for (p, j) in range.enumerate() {
                if j + crate::cpu::PREFETCH_AHEAD < end {
                    let a = j + crate::cpu::PREFETCH_AHEAD;
                    crate::cpu::prefetch(&w[a * rb..(a + 1) * rb]);
                }
                let row = &w[j * rb..(j + 1) * rb];
                let b = bias.map_or(0.0, |b| b[j]);
                for (r, q) in xq.iter().enumerate() {
                    part[p * rows + r] = k.dot_q(kind, row, q) + b;
                }
            }
        });
        for r in 0..rows {
            for j in 0..self.out {
                y[r * self.out + j] = tmp[j * rows + r];
            }
        }
        Ok(())
    }
}

impl Module for QLinear {
    fn forward(&self, xs: &Tensor) -> candle_core::Result<Tensor> {
        let rows = check_rows(xs, self.inp, "QLinear input")?;
        let mut y = vec![0f32; rows * self.out];
        // Contiguous f32 (the decode path) is read in place; the output is the only allocation.
        with_f32(xs, &mut Vec::new(), |x| self.forward_f32(x, rows, &mut y))?;
        let mut dims = xs.dims().to_vec();
        if let Some(l) = dims.last_mut() {
            *l = self.out;
        }
        Ok(to_tensor(y, &dims, xs.dtype())?)
    }
}
