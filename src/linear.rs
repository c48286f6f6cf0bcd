//! `QLinear`: a dense linear layer on GGUF Q4_0 / Q4_1 / Q8_0 weights through the engine's
//! integer kernels and pool, for the parts of a model around the sparse FFN (attention
//! projections, the LM head) where candle's own quantized matmul has no SIMD path for the block
//! type.
//!
//! The weights are kept in row-interleaved groups of 16 rows ([`PackedRows`], the file's bytes in
//! another order). Each input row is quantized once, exactly as ggml quantizes it; every group is
//! one pass of 16 output features. Threads take static ranges of groups.

use std::sync::{Arc, Mutex};

use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{DType, Module, Tensor};

use crate::cpu::{gemm, Kernels, PackedRows, Pool, QuantKind, QuantizedRow, SimdLevel, PACK};
use crate::error::{Error, Result};
use crate::tensor_io::{check_rows, to_tensor, with_f32};

/// A quantized linear layer `y = W x (+ b)` with `W: [out, in]` in GGUF blocks.
pub struct QLinear {
    w: PackedRows,
    bias: Option<Vec<f32>>,
    kernels: Kernels,
    pool: Arc<Pool>,
    scratch: Mutex<(Vec<QuantizedRow>, Vec<f32>)>,
}

impl std::fmt::Debug for QLinear {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("QLinear")
            .field("kind", &self.w.kind())
            .field("out", &self.w.rows())
            .field("in", &self.w.cols())
            .finish()
    }
}

/// The block type of a GGUF tensor our integer kernels take.
pub(crate) fn quant_kind(w: &QTensor) -> Result<QuantKind> {
    match w.dtype() {
        GgmlDType::Q4_0 => Ok(QuantKind::Q4_0),
        GgmlDType::Q4_1 => Ok(QuantKind::Q4_1),
        GgmlDType::Q8_0 => Ok(QuantKind::Q8_0),
        other => Err(Error::config(
            "QLinear weight",
            format!("block type {other:?} is not Q4_0, Q4_1 or Q8_0"),
        )),
    }
}

pub(crate) fn dims2(w: &QTensor) -> Result<(usize, usize)> {
    match w.shape().dims() {
        &[o, i] if o > 0 && i > 0 && i % crate::cpu::QK == 0 => Ok((o, i)),
        d => Err(Error::shape("QLinear weight", &[None, None], d)),
    }
}

impl QLinear {
    /// From a GGUF tensor of Q4_0, Q4_1 or Q8_0 blocks (`[out, in]`, `in` a multiple of 32); other
    /// block types are a typed error (use candle's `QMatMul` for those).
    pub fn new(w: &QTensor, bias: Option<&Tensor>, threads: usize) -> Result<Self> {
        Self::stacked(&[w], bias, threads)
    }

    /// Several GGUF tensors with the same block type and input width as one layer, output
    /// features stacked in order (e.g. q, k and v: one pass over the input for all three).
    pub fn stacked(ws: &[&QTensor], bias: Option<&Tensor>, threads: usize) -> Result<Self> {
        let Some(first) = ws.first() else {
            return Err(Error::config("QLinear weight", "no tensor given"));
        };
        let (kind, inp) = (quant_kind(first)?, dims2(first)?.1);
        let mut data = Vec::with_capacity(ws.len());
        for w in ws {
            let (o, i) = dims2(w)?;
            if quant_kind(w)? != kind || i != inp {
                return Err(Error::config(
                    "QLinear weight",
                    format!(
                        "stacked tensors differ: {:?} [_, {i}] after {kind:?} [_, {inp}]",
                        w.dtype()
                    ),
                ));
            }
            data.push((o, w.data()?));
        }
        let parts: Vec<(usize, &[u8])> = data.iter().map(|(o, d)| (*o, &d[..])).collect();
        Self::from_packed(PackedRows::stack(kind, inp, &parts)?, bias, threads)
    }

    /// A layer over rows already packed (e.g. [`PackedRows::pack`] on a GGUF tensor's bytes read
    /// straight from the file, without a candle `QTensor` in between).
    pub fn from_packed(w: PackedRows, bias: Option<&Tensor>, threads: usize) -> Result<Self> {
        let out = w.rows();
        let bias = match bias {
            Some(b) if b.dims() != [out] => {
                return Err(Error::shape("QLinear bias", &[Some(out)], b.dims()))
            }
            Some(b) => Some(b.to_dtype(DType::F32)?.to_vec1::<f32>()?),
            None => None,
        };
        Ok(QLinear {
            w,
            bias,
            kernels: Kernels::detect()?,
            pool: Pool::shared(threads.max(1)),
            scratch: Mutex::new((Vec::new(), Vec::new())),
        })
    }

    /// The same layer on the kernels of SIMD level `tier` (every tier gives the same bits; tests
    /// and benchmarks compare them). A typed error if this CPU cannot run it.
    pub fn with_simd_level(mut self, tier: SimdLevel) -> Result<Self> {
        self.kernels = Kernels::new(tier)?;
        Ok(self)
    }

    /// `(out, in)` features.
    pub fn dims(&self) -> (usize, usize) {
        (self.w.rows(), self.w.cols())
    }

    /// The packed weights.
    pub fn weights(&self) -> &PackedRows {
        &self.w
    }

    /// The pool the products run on.
    pub fn pool(&self) -> &Arc<Pool> {
        &self.pool
    }

    /// Row `r` of `W` dequantized into `out` (`in` values): an embedding lookup for a tied LM
    /// head. A typed error if `r` is out of range or `out` has the wrong length.
    pub fn dequantize_row(&self, r: usize, out: &mut [f32]) -> Result<()> {
        self.w.dequantize_row(r, out).ok_or_else(|| {
            Error::config(
                "QLinear row",
                format!(
                    "row {r} of {} into {} values (expected {})",
                    self.w.rows(),
                    out.len(),
                    self.w.cols()
                ),
            )
        })
    }

    /// `y = W x + b` for `rows` rows of `x` (`rows * in`) into `y` (`rows * out`).
    pub fn forward_f32(&self, x: &[f32], rows: usize, y: &mut [f32]) -> Result<()> {
        let (out, inp) = self.dims();
        if x.len() != rows * inp {
            return Err(Error::shape(
                "QLinear input",
                &[Some(rows * inp)],
                &[x.len()],
            ));
        }
        if y.len() != rows * out {
            return Err(Error::shape(
                "QLinear output",
                &[Some(rows * out)],
                &[y.len()],
            ));
        }
        let mut guard = self.scratch.lock().unwrap_or_else(|e| e.into_inner());
        let (xq, tmp) = &mut *guard;
        let xq = QuantizedRow::quantize_rows(xq, x, inp);
        self.forward_quantized(xq, y, tmp)
    }

    /// `y = W x + b` for inputs already quantized with [`QuantizedRow::quantize`] (`in` values
    /// each): `y` holds `xq.len() * out` values, row-major. `tmp` is scratch, reused between calls
    /// (untouched for a single row). Allocation-free once `tmp` has grown.
    pub fn forward_quantized(
        &self,
        xq: &[QuantizedRow],
        y: &mut [f32],
        tmp: &mut Vec<f32>,
    ) -> Result<()> {
        let (out, inp) = self.dims();
        let rows = xq.len();
        if y.len() != rows * out {
            return Err(Error::shape(
                "QLinear output",
                &[Some(rows * out)],
                &[y.len()],
            ));
        }
        if let Some(x) = xq.iter().find(|x| x.blocks() * crate::cpu::QK != inp) {
            return Err(Error::shape(
                "QLinear quantized input",
                &[Some(inp)],
                &[x.blocks() * crate::cpu::QK],
            ));
        }
        let groups = self.w.groups();
        let (k, w, n) = (&self.kernels, &self.w, self.pool.threads());
        let direct = rows == 1 && out % PACK == 0;
        let buf: &mut [f32] = if direct {
            y
        } else {
            tmp.clear();
            tmp.resize(groups * rows * PACK, 0.0);
            tmp
        };
        if n == 1 || groups < 2 {
            gemm(k, w, 0..groups, xq, buf);
        } else {
            self.pool
                .run_chunks(buf, groups, rows * PACK, &|range, part| {
                    gemm(k, w, range, xq, part)
                });
        }
        if !direct {
            for r in 0..rows {
                for j in 0..out {
                    y[r * out + j] = tmp[((j / PACK) * rows + r) * PACK + j % PACK];
                }
            }
        }
        if let Some(b) = &self.bias {
            for yr in y.chunks_exact_mut(out) {
                yr.iter_mut().zip(b).for_each(|(v, b)| *v += b);
            }
        }
        Ok(())
    }
}

impl Module for QLinear {
    fn forward(&self, xs: &Tensor) -> candle_core::Result<Tensor> {
        let (out, inp) = self.dims();
        let rows = check_rows(xs, inp, "QLinear input")?;
        let mut y = vec![0f32; rows * out];
        // Contiguous f32 (the decode path) is read in place; the output is the only allocation.
        with_f32(xs, &mut Vec::new(), |x| self.forward_f32(x, rows, &mut y))?;
        let mut dims = xs.dims().to_vec();
        if let Some(l) = dims.last_mut() {
            *l = out;
        }
        Ok(to_tensor(y, &dims, xs.dtype())?)
    }
}
