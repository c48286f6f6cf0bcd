//! `InputSparseLinear`: a linear layer with TEAL's input sparsity, for the attention projections.
//!
//! `y = W x (+ b)` where the entries of `x` with `|x_i|` at most the threshold are set to zero and
//! their columns of `W` are never read. The weights are the file's GGUF blocks of any type the
//! dense decoder runs, laid out by column ([`crate::cpu::ColumnBlocks`]); with a threshold of 0
//! the result is `QLinear`'s, bit for bit (the same quantized input, the same block sums in the
//! same order).

use std::cell::RefCell;
use std::sync::{Arc, Mutex};

use candle_core::quantized::QTensor;
use candle_core::{DType, Module, Tensor};

use super::matrix::{chunked_at, Inputs};
use super::record::Recorder;
use super::{Columns, Input, WeightTraffic};
use crate::analysis::Histogram;
use crate::cpu::{Kernels, Pool, SimdLevel, CHUNK};
use crate::error::{Error, Result};
use crate::linear::{block_kind, dims2};
use crate::tensor_io::{check_f32_rows_io, forward_tensor};

#[derive(Debug, Default)]
struct Scratch {
    input: Input,
    y: Vec<f32>,
    traffic: WeightTraffic,
}

/// A prompt's rows at once: buffers of `rows x` the layer's width, one set per calling thread
/// shared by every projection (held per projection they added up to hundreds of MB at a
/// 512-row window).
#[derive(Debug, Default)]
struct Batch {
    inputs: Inputs,
    y: Vec<f32>,
}

thread_local! {
    static BATCH: RefCell<Batch> = RefCell::default();
}

/// A linear layer on GGUF blocks whose small inputs are skipped (see the module docs).
pub struct InputSparseLinear {
    w: Columns,
    bias: Option<Vec<f32>>,
    threshold: f32,
    kernels: Kernels,
    pool: Arc<Pool>,
    scores: Recorder<Histogram>,
    scratch: Mutex<Scratch>,
    /// f16/bf16 inputs widened to f32 (`forward_tensor`).
    xbuf: Mutex<Vec<f32>>,
}

impl std::fmt::Debug for InputSparseLinear {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("InputSparseLinear")
            .field("out", &self.w.rows())
            .field("in", &self.w.cols())
            .field("storage", &self.w)
            .field("threshold", &self.threshold)
            .finish()
    }
}

impl InputSparseLinear {
    /// GGUF tensors of one block type (any the dense decoder runs) and input width, `[out, in]`,
    /// output features stacked in order (q, k and v: one masked input for all three), with an
    /// optional bias over the stacked outputs; on `threads` threads (`tier`: `None` detects).
    /// The threshold starts at 0 (dense).
    pub fn from_qtensors(
        ws: &[&QTensor],
        bias: Option<&Tensor>,
        threads: usize,
        tier: Option<SimdLevel>,
    ) -> Result<Self> {
        let kernels = super::kernels(threads, tier)?;
        let Some(first) = ws.first() else {
            return Err(Error::config("InputSparseLinear weight", "no tensor given"));
        };
        let (kind, cols) = (block_kind(first.dtype())?, dims2(first)?.1);
        let (mut rows, mut data) = (0, Vec::new());
        for w in ws {
            let (o, i) = dims2(w)?;
            if block_kind(w.dtype())? != kind || i != cols {
                return Err(Error::config(
                    "InputSparseLinear weight",
                    format!(
                        "stacked tensors differ: {:?} [_, {i}] after {kind:?} [_, {cols}]",
                        w.dtype()
                    ),
                ));
            }
            rows += o;
            data.extend_from_slice(&w.data()?);
        }
        let w = Columns::from_blocks(
            kind,
            rows,
            cols,
            &data,
            "InputSparseLinear weight",
            &kernels,
            super::matrix::slab_rows(rows, 1, threads),
        )?;
        let bias = match bias {
            Some(b) if b.dims() != [rows] => {
                return Err(Error::shape(
                    "InputSparseLinear bias",
                    &[Some(rows)],
                    b.dims(),
                ))
            }
            Some(b) => {
                let v = b.to_dtype(DType::F32)?.to_vec1::<f32>()?;
                if let Some(i) = v.iter().position(|x| !x.is_finite()) {
                    return Err(Error::non_finite("InputSparseLinear bias", i));
                }
                Some(v)
            }
            None => None,
        };
        Ok(InputSparseLinear {
            w,
            bias,
            threshold: 0.0,
            kernels,
            pool: Pool::shared(threads),
            scores: Recorder::default(),
            scratch: Mutex::new(Scratch::default()),
            xbuf: Mutex::new(Vec::new()),
        })
    }

    /// `(out, in)`.
    pub fn dims(&self) -> (usize, usize) {
        (self.w.rows(), self.w.cols())
    }

    /// Bytes of the weights (values and scale planes).
    pub fn weight_bytes(&self) -> usize {
        self.w.bytes()
    }

    /// Sets the threshold on `|x_i|` (finite, at least 0; 0 keeps every nonzero input).
    pub fn set_threshold(&mut self, t: f32) -> Result<()> {
        if !t.is_finite() || t < 0.0 {
            return Err(Error::config(
                "input threshold",
                format!("{t} must be finite and at least 0"),
            ));
        }
        self.threshold = t;
        Ok(())
    }

    /// The threshold in use.
    pub fn threshold(&self) -> f32 {
        self.threshold
    }

    /// Starts recording `|x_i|` of every input entry into a fresh histogram (calibration).
    pub fn record_scores(&self) {
        self.scores.start();
    }

    /// Stops recording and returns the histogram.
    pub fn take_scores(&self) -> Option<Histogram> {
        self.scores.take()
    }

    /// Returns and resets the weight bytes read since the last call.
    pub fn take_traffic(&self) -> WeightTraffic {
        std::mem::take(
            &mut self
                .scratch
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .traffic,
        )
    }

    /// `out = W x (+ b)` on `rows` f32 rows (`x`: `rows * in`, `out`: `rows * out`). NaN or
    /// infinite inputs are refused.
    pub fn forward_f32(&self, x: &[f32], rows: usize, out: &mut [f32]) -> Result<()> {
        let (o, i) = self.dims();
        check_f32_rows_io(x, rows, i, out, o)?;
        self.scores.add(|h| h.record_all(x));
        let mut s = self.scratch.lock().unwrap_or_else(|e| e.into_inner());
        if rows > 1 {
            self.rows_batched(&mut s, x, rows, out);
            return Ok(());
        }
        let Scratch {
            input, y, traffic, ..
        } = &mut *s;
        let chunks = self.w.chunks();
        y.resize(chunks * CHUNK, 0.0);
        let dense = self.w.dense_bytes();
        for (xr, or) in x.chunks_exact(i).zip(out.chunks_exact_mut(o)) {
            input.mask(xr, None, self.threshold, &self.w);
            let (k, inp) = (&self.kernels, &*input);
            self.pool.run_chunks(y, chunks, CHUNK, &|r, part| {
                self.w.product(k, r, inp, part);
            });
            match &self.bias {
                Some(b) => or
                    .iter_mut()
                    .zip(y.iter().zip(b))
                    .for_each(|(o, (&v, &b))| *o = v + b),
                None => or.copy_from_slice(&y[..o]),
            }
            traffic.rows += 1;
            traffic.read += self.w.bytes_read(input) as u64;
            traffic.dense += dense as u64;
        }
        Ok(())
    }

    /// Several rows (a prompt) at once: each masked as alone, the weights read once per tile
    /// of rows over the union of their kept channels; each row's result is its own, bit for
    /// bit.
    fn rows_batched(&self, s: &mut Scratch, x: &[f32], rows: usize, out: &mut [f32]) {
        let traffic = &mut s.traffic;
        super::with_local(&BATCH, |b| self.rows_batched_in(b, traffic, x, rows, out))
    }

    fn rows_batched_in(
        &self,
        b: &mut Batch,
        traffic: &mut WeightTraffic,
        x: &[f32],
        rows: usize,
        out: &mut [f32],
    ) {
        let o = self.w.rows();
        let Batch { inputs, y } = b;
        inputs.mask(x, None, self.threshold, &self.w, &self.pool);
        let chunks = self.w.chunks();
        y.resize(chunks * rows * CHUNK, 0.0);
        let (k, inp) = (&self.kernels, &*inputs);
        self.pool.run_chunks(y, chunks, rows * CHUNK, &|r, part| {
            self.w.product_rows(k, r, inp, part);
        });
        let dense = self.w.dense_bytes() as u64;
        for (r, or) in out.chunks_exact_mut(o).enumerate() {
            for (j, v) in or.iter_mut().enumerate() {
                let y = y[chunked_at(0, rows, r, j)];
                *v = self.bias.as_ref().map_or(y, |b| y + b[j]);
            }
            traffic.rows += 1;
            traffic.read += self.w.row_bytes_read(inputs, r) as u64;
            traffic.dense += dense;
        }
    }

    /// The layer on a tensor `[.., in]` (f32, f16 or bf16, CPU); `[.., out]` in the same dtype.
    pub fn forward_tensor(&self, xs: &Tensor) -> Result<Tensor> {
        let (o, i) = self.dims();
        forward_tensor(xs, i, o, &self.xbuf, |x, rows, out| {
            self.forward_f32(x, rows, out)
        })
    }
}

impl Module for InputSparseLinear {
    fn forward(&self, xs: &Tensor) -> candle_core::Result<Tensor> {
        Ok(self.forward_tensor(xs)?)
    }
}
