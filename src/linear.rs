//! `QLinear`: a dense linear layer on GGUF blocks (Q4_0, Q4_1, Q8_0, Q5_0, Q5_1, Q4_K, Q5_K,
//! Q6_K) through the engine's integer kernels and pool, for the parts of a model around the
//! sparse FFN (attention projections, the LM head) and the fused decoder's dense FFN.
//!
//! The weights are kept in row-interleaved groups of 16 rows ([`PackedRows`], the file's bytes in
//! another order). Each input row is quantized once, exactly as ggml quantizes it for the block
//! type (Q8_0/Q8_1 blocks of 32, or Q8_K super-blocks of 256 for the K-quants); every group is
//! one pass of 16 output features. Stacked tensors of different block types (a Q4_K_M file's
//! Q4_K q and k beside a Q6_K v) are kept as parts of one layer: one pass over the input, one
//! pool dispatch, threads on static ranges of groups across the parts.

use std::ops::Range;
use std::sync::{Arc, Mutex};

use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{DType, Module, Tensor};

use crate::cpu::{
    gemm, BlockKind, Inputs, Kernels, PackedRows, Pool, QuantizedRow, SimdLevel, PACK,
};
use crate::error::{Error, Result};
use crate::tensor_io::{check_rows, to_tensor, with_f32};

/// A quantized linear layer `y = W x (+ b)` with `W: [out, in]` in GGUF blocks.
pub struct QLinear {
    /// Row ranges of `W` in order, each in one block type.
    parts: Vec<PackedRows>,
    /// Per part: its first output feature and its first group in the layer's group order.
    starts: Vec<(usize, usize)>,
    out: usize,
    inp: usize,
    inputs: Inputs,
    bias: Option<Vec<f32>>,
    kernels: Kernels,
    pool: Arc<Pool>,
    scratch: Mutex<(Vec<QuantizedRow>, Vec<f32>)>,
}

impl std::fmt::Debug for QLinear {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kinds: Vec<_> = self.parts.iter().map(|p| p.kind()).collect();
        f.debug_struct("QLinear")
            .field("kinds", &kinds)
            .field("out", &self.out)
            .field("in", &self.inp)
            .finish()
    }
}

/// The block type of a GGUF tensor our integer kernels take, or a typed error naming it.
pub(crate) fn block_kind(dtype: GgmlDType) -> Result<BlockKind> {
    BlockKind::from_ggml(dtype).ok_or_else(|| {
        Error::config(
            "QLinear weight",
            format!(
                "block type {dtype:?} is not one of Q4_0, Q4_1, Q8_0, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K"
            ),
        )
    })
}

pub(crate) fn dims2(w: &QTensor) -> Result<(usize, usize)> {
    match w.shape().dims() {
        &[o, i] if o > 0 && i > 0 && i % crate::cpu::QK == 0 => Ok((o, i)),
        d => Err(Error::shape("QLinear weight", &[None, None], d)),
    }
}

impl QLinear {
    /// From a GGUF tensor (`[out, in]`) of a block type the kernels take ([`BlockKind`]); other
    /// block types are a typed error (use candle's `QMatMul` for those).
    pub fn new(w: &QTensor, bias: Option<&Tensor>, threads: usize) -> Result<Self> {
        Self::stacked(&[w], bias, threads)
    }

    /// Several GGUF tensors with the same input width as one layer, output features stacked in
    /// order (e.g. q, k and v: one pass over the input for all three). Consecutive tensors of
    /// one block type are packed together; each change of type starts a new part.
    pub fn stacked(ws: &[&QTensor], bias: Option<&Tensor>, threads: usize) -> Result<Self> {
        let Some(first) = ws.first() else {
            return Err(Error::config("QLinear weight", "no tensor given"));
        };
        // A block type the kernels do not take is the error to report, whatever the shape.
        block_kind(first.dtype())?;
        let inp = dims2(first)?.1;
        let mut data = Vec::with_capacity(ws.len());
        for w in ws {
            let kind = block_kind(w.dtype())?;
            let (o, i) = dims2(w)?;
            if i != inp {
                return Err(Error::config(
                    "QLinear weight",
                    format!("stacked tensors differ: [_, {i}] after [_, {inp}]"),
                ));
            }
            data.push((kind, o, w.data()?));
        }
        let mut parts = Vec::new();
        let mut at = 0;
        while at < data.len() {
            let kind = data[at].0;
            let run = data[at..].iter().take_while(|d| d.0 == kind).count();
            let rows: Vec<(usize, &[u8])> = data[at..at + run]
                .iter()
                .map(|(_, o, d)| (*o, &d[..]))
                .collect();
            parts.push(PackedRows::stack(kind, inp, &rows)?);
            at += run;
        }
        Self::from_parts(parts, bias, threads)
    }

    /// A layer over rows already packed (e.g. [`PackedRows::pack`] on a GGUF tensor's bytes read
    /// straight from the file, without a candle `QTensor` in between).
    pub fn from_packed(w: PackedRows, bias: Option<&Tensor>, threads: usize) -> Result<Self> {
        Self::from_parts(vec![w], bias, threads)
    }

    /// A layer over several packed parts with the same width, output features stacked in order.
    pub fn from_parts(
        parts: Vec<PackedRows>,
        bias: Option<&Tensor>,
        threads: usize,
    ) -> Result<Self> {
        let Some(inp) = parts.first().map(|p| p.cols()) else {
            return Err(Error::config("QLinear weight", "no part given"));
        };
        let (mut starts, mut out, mut groups) = (Vec::with_capacity(parts.len()), 0, 0);
        let mut inputs = Inputs::default();
        for p in &parts {
            if p.cols() != inp {
                return Err(Error::shape(
                    "QLinear part width",
                    &[Some(inp)],
                    &[p.cols()],
                ));
            }
            starts.push((out, groups));
            out += p.rows();
            groups += p.groups();
            inputs = inputs.union(p.kind().inputs());
        }
        let bias = match bias {
            Some(b) if b.dims() != [out] => {
                return Err(Error::shape("QLinear bias", &[Some(out)], b.dims()))
            }
            Some(b) => Some(b.to_dtype(DType::F32)?.to_vec1::<f32>()?),
            None => None,
        };
        Ok(QLinear {
            parts,
            starts,
            out,
            inp,
            inputs,
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
        (self.out, self.inp)
    }

    /// The packed weights, one part per run of one block type.
    pub fn parts(&self) -> &[PackedRows] {
        &self.parts
    }

    /// Weight bytes held (what a product reads).
    pub fn bytes(&self) -> usize {
        self.parts.iter().map(|p| p.bytes()).sum()
    }

    /// The input quantization the products read: quantize inputs for
    /// [`QLinear::forward_quantized`] with [`QuantizedRow::quantize_for`] and these.
    pub fn inputs(&self) -> Inputs {
        self.inputs
    }

    /// The pool the products run on.
    pub fn pool(&self) -> &Arc<Pool> {
        &self.pool
    }

    /// Row `r` of `W` dequantized into `out` (`in` values): an embedding lookup for a tied LM
    /// head. A typed error if `r` is out of range or `out` has the wrong length.
    pub fn dequantize_row(&self, r: usize, out: &mut [f32]) -> Result<()> {
        let part = self
            .parts
            .iter()
            .zip(&self.starts)
            .find(|(p, (first, _))| r >= *first && r < first + p.rows());
        part.and_then(|(p, (first, _))| p.dequantize_row(r - first, out))
            .ok_or_else(|| {
                Error::config(
                    "QLinear row",
                    format!(
                        "row {r} of {} into {} values (expected {})",
                        self.out,
                        out.len(),
                        self.inp
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
        let xq = self.quantize_input(xq, x);
        self.forward_quantized(xq, y, tmp)
    }

    /// `x` (rows of `in` values) quantized as this layer reads its input
    /// ([`QuantizedRow::quantize_rows_for`] with [`QLinear::inputs`]) into `buf`: the rows shared
    /// among the layer's threads when there are several. Allocation-free once `buf` has grown.
    pub fn quantize_input<'a>(
        &self,
        buf: &'a mut Vec<QuantizedRow>,
        x: &[f32],
    ) -> &'a [QuantizedRow] {
        let inp = self.dims().1;
        let n = x.len().checked_div(inp).unwrap_or(0);
        if n < 2 || self.pool.threads() == 1 {
            return QuantizedRow::quantize_rows_for(buf, x, inp, self.inputs);
        }
        if buf.len() < n {
            buf.resize_with(n, Default::default);
        }
        let inputs = self.inputs;
        self.pool.run_chunks(&mut buf[..n], n, 1, &|range, part| {
            for (q, r) in part.iter_mut().zip(range) {
                q.quantize_for(&x[r * inp..(r + 1) * inp], inputs);
            }
        });
        &buf[..n]
    }

    /// The groups of the layer (across parts) in `range` against `xq` into `buf` (`range.len()
    /// * rows * 16` values): each part's share through its kernels.
    fn groups(&self, range: Range<usize>, xq: &[QuantizedRow], buf: &mut [f32]) {
        let per = xq.len() * PACK;
        for (p, &(_, g0)) in self.parts.iter().zip(&self.starts) {
            let (lo, hi) = (range.start.max(g0), range.end.min(g0 + p.groups()));
            if lo < hi {
                let part = &mut buf[(lo - range.start) * per..(hi - range.start) * per];
                gemm(&self.kernels, p, lo - g0..hi - g0, xq, part);
            }
        }
    }

    /// `y = W x + b` for inputs already quantized with [`QuantizedRow::quantize_for`] and
    /// [`QLinear::inputs`] (`in` values each): `y` holds `xq.len() * out` values, row-major.
    /// `tmp` is scratch, reused between calls (untouched for a single row when every part's
    /// rows are whole groups). Allocation-free once `tmp` has grown.
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
        for x in xq {
            let held = [
                (self.inputs.blocks32, x.blocks() * crate::cpu::QK),
                (self.inputs.k, x.k.blocks() * crate::cpu::QK_K),
            ];
            if let Some((_, n)) = held.iter().find(|(need, n)| *need && *n != inp) {
                return Err(Error::shape("QLinear quantized input", &[Some(inp)], &[*n]));
            }
        }
        let groups =
            self.starts.last().map_or(0, |s| s.1) + self.parts.last().map_or(0, |p| p.groups());
        let n = self.pool.threads();
        let direct = rows == 1 && self.parts.iter().all(|p| p.rows() % PACK == 0);
        let buf: &mut [f32] = if direct {
            y
        } else {
            tmp.clear();
            tmp.resize(groups * rows * PACK, 0.0);
            tmp
        };
        if n == 1 || groups < 2 {
            self.groups(0..groups, xq, buf);
        } else {
            self.pool
                .run_chunks(buf, groups, rows * PACK, &|range, part| {
                    self.groups(range, xq, part)
                });
        }
        if !direct {
            // Group `g` of a part holds its rows `16 g ..` for every input row in turn.
            for (p, &(first, g0)) in self.parts.iter().zip(&self.starts) {
                for g in 0..p.groups() {
                    let n = PACK.min(p.rows() - g * PACK);
                    for r in 0..rows {
                        let at = r * out + first + g * PACK;
                        y[at..at + n].copy_from_slice(&tmp[((g0 + g) * rows + r) * PACK..][..n]);
                    }
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
