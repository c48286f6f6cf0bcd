//! `InputSparseFfn`: the FFN with training-free input sparsity (TEAL, WINA) on column-major
//! weights, a `candle_core::Module`.
//!
//! Per row: the entries of the FFN input `x` whose score (`|x_i|`, or `|x_i| ||W[:, i]||` for
//! WINA) is at most the matrix's threshold are set to zero, separately for gate and up; the
//! products read only the columns of the nonzero entries; then `h = act(gate) * up`, the same rule
//! on `h` for down (`|h_j|` or `|h_j| ||W_down[:, j]||`), and the down product reads only the
//! columns of the kept neurons. With every threshold at 0 nothing is dropped and the result is the
//! dense FFN's (for GGUF blocks, bit for bit the dense product over the same quantized input).
//!
//! Weights are the file's (see `ColumnMatrix`); the rule is per layer and per matrix
//! ([`InputThresholds`]), read from calibration histograms ([`InputScores`]). Two pool dispatches
//! per row (gate and up together, then down); threads take static shares of output chunks, so
//! results are bit-identical across runs and thread counts. No allocation per row once the block
//! has run.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{DType, Module, Tensor};

use crate::cpu::{
    column_product, ActiveColumns, ColumnMatrix, ColumnStorage, CpuTier, Kernels, Pool, QuantKind,
    QuantizedRow, CHUNK,
};
use crate::error::{Error, ErrorKind, Result};
use crate::ffn::{FfnSpec, FfnWeights};
use crate::input::{check_f32_rows, check_rows, to_tensor, with_f32};
use crate::profile::Histogram;

/// How an input entry is scored against its matrix's threshold.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum InputScore {
    /// `|x_i|` (TEAL).
    #[default]
    Magnitude,
    /// `|x_i| * ||W[:, i]||_2`, the input times the norm of the column it feeds (WINA; on `h`
    /// the rule of "Sparsing Law").
    Wina,
}

impl InputScore {
    /// The name used in artifacts and on the command line (`teal`, `wina`).
    pub fn name(self) -> &'static str {
        match self {
            InputScore::Magnitude => "teal",
            InputScore::Wina => "wina",
        }
    }

    /// The score named `name` (see [`InputScore::name`]).
    pub fn from_name(name: &str) -> Result<Self> {
        match name {
            "teal" => Ok(InputScore::Magnitude),
            "wina" => Ok(InputScore::Wina),
            other => Err(Error::config(
                "input score",
                format!("`{other}` is not one of teal, wina"),
            )),
        }
    }
}

/// Per-matrix thresholds of one layer: an entry is kept when its score exceeds the threshold.
/// All zero keeps every nonzero entry (the dense FFN).
#[derive(Debug, Clone, Copy, PartialEq, Default, serde::Serialize, serde::Deserialize)]
pub struct InputThresholds {
    /// On the FFN input, for the gate product.
    pub gate: f32,
    /// On the FFN input, for the up product.
    pub up: f32,
    /// On `h`, for the down product.
    pub down: f32,
}

impl InputThresholds {
    fn check(&self) -> Result<()> {
        for (name, t) in [("gate", self.gate), ("up", self.up), ("down", self.down)] {
            if !t.is_finite() || t < 0.0 {
                return Err(Error::config(
                    "input threshold",
                    format!("{name} threshold {t} must be finite and at least 0"),
                ));
            }
        }
        Ok(())
    }
}

/// The score distributions of one layer's three matrices, for calibration.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct InputScores {
    /// Scores of the FFN input entries for gate.
    pub gate: Histogram,
    /// For up.
    pub up: Histogram,
    /// Scores of `h` for down.
    pub down: Histogram,
}

impl InputScores {
    /// Thresholds that drop about the fractions `sparsity` (gate, up, down) of the recorded
    /// entries; `None` before anything was recorded or for a fraction outside `[0, 1)`.
    pub fn thresholds(&self, sparsity: [f64; 3]) -> Option<InputThresholds> {
        Some(InputThresholds {
            gate: self.gate.threshold_for_fraction(sparsity[0])?,
            up: self.up.threshold_for_fraction(sparsity[1])?,
            down: self.down.threshold_for_fraction(sparsity[2])?,
        })
    }
}

/// Weight bytes the FFN read and would have read densely, summed over rows.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FfnTraffic {
    /// Rows computed.
    pub rows: u64,
    /// Weight bytes read.
    pub read: u64,
    /// Weight bytes a dense product reads for the same rows.
    pub dense: u64,
}

impl FfnTraffic {
    /// The fraction of the dense weight bytes not read (0 before any row).
    pub fn skipped(&self) -> f64 {
        if self.dense == 0 {
            0.0
        } else {
            1.0 - self.read as f64 / self.dense as f64
        }
    }

    /// Adds `other`'s counts.
    pub fn add(&mut self, other: &FfnTraffic) {
        self.rows += other.rows;
        self.read += other.read;
        self.dense += other.dense;
    }
}

/// One product's input: the masked row, its quantized form and the columns it keeps.
#[derive(Debug, Default)]
struct Input {
    x: Vec<f32>,
    q: QuantizedRow,
    active: ActiveColumns,
}

impl Input {
    /// `x` with the entries whose score is at most `t` zeroed (`weight`: per-entry factor of the
    /// score, `None` for `|x|`), quantized when the matrix is.
    fn mask(&mut self, x: &[f32], weight: Option<&[f32]>, t: f32, quant: bool) {
        self.x.clear();
        match weight {
            None => self
                .x
                .extend(x.iter().map(|&v| if v.abs() > t { v } else { 0.0 })),
            Some(w) => self.x.extend(
                x.iter()
                    .zip(w)
                    .map(|(&v, &n)| if v.abs() * n > t { v } else { 0.0 }),
            ),
        }
        if quant {
            self.q.quantize_values(&self.x);
            self.active.of_quantized(&self.q);
        } else {
            self.active.of_f32(&self.x);
        }
    }
}

#[derive(Debug, Default)]
struct Scratch {
    xbuf: Vec<f32>,
    gate: Input,
    up: Input,
    down: Input,
    /// Gate then up outputs, each padded to whole chunks.
    gu: Vec<f32>,
    h: Vec<f32>,
    y: Vec<f32>,
    traffic: FfnTraffic,
}

/// The FFN with input sparsity on column-major weights (see the module docs).
pub struct InputSparseFfn {
    spec: FfnSpec,
    gate: Option<ColumnMatrix>,
    up: ColumnMatrix,
    down: ColumnMatrix,
    gate_bias: Option<Vec<f32>>,
    up_bias: Option<Vec<f32>>,
    down_bias: Option<Vec<f32>>,
    score: InputScore,
    thresholds: InputThresholds,
    kernels: Kernels,
    pool: Arc<Pool>,
    recording: AtomicBool,
    scores: Mutex<Option<InputScores>>,
    scratch: Mutex<Scratch>,
}

impl std::fmt::Debug for InputSparseFfn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("InputSparseFfn")
            .field("spec", &self.spec)
            .field("storage", &self.up.storage())
            .field("score", &self.score)
            .field("thresholds", &self.thresholds)
            .field("tier", &self.kernels.tier())
            .field("threads", &self.pool.threads())
            .finish()
    }
}

fn quant_kind(t: GgmlDType) -> Option<QuantKind> {
    match t {
        GgmlDType::Q4_0 => Some(QuantKind::Q4_0),
        GgmlDType::Q4_1 => Some(QuantKind::Q4_1),
        GgmlDType::Q8_0 => Some(QuantKind::Q8_0),
        _ => None,
    }
}

/// A GGUF tensor `[rows, cols]` as a column matrix of its own blocks.
fn qcolumns(t: &QTensor, name: &str, rows: usize, cols: usize) -> Result<ColumnMatrix> {
    if t.shape().dims() != [rows, cols] {
        return Err(Error::shape(
            name,
            &[Some(rows), Some(cols)],
            t.shape().dims(),
        ));
    }
    let kind = quant_kind(t.dtype()).ok_or_else(|| {
        Error::config(
            "storage",
            format!(
                "tensor `{name}` is {:?}; column matrices keep Q4_0, Q4_1 and Q8_0 blocks",
                t.dtype()
            ),
        )
    })?;
    ColumnMatrix::from_blocks(kind, rows, cols, &t.data()?)
        .map_err(|e| Error::config(name, e.to_string()))
}

/// A float tensor `[rows, cols]` as a column matrix in `storage`.
fn fcolumns(
    t: &Tensor,
    name: &str,
    rows: usize,
    cols: usize,
    storage: ColumnStorage,
) -> Result<ColumnMatrix> {
    if t.dims() != [rows, cols] {
        return Err(Error::shape(name, &[Some(rows), Some(cols)], t.dims()));
    }
    match t.dtype() {
        DType::F32 | DType::F16 | DType::BF16 => {}
        got => {
            return Err(ErrorKind::DType {
                tensor: name.into(),
                got,
            }
            .into())
        }
    }
    let w = t.flatten_all()?.to_dtype(DType::F32)?.to_vec1::<f32>()?;
    ColumnMatrix::from_f32(storage, rows, cols, &w).map_err(|e| Error::config(name, e.to_string()))
}

fn bias(t: Option<&Tensor>, name: &str, len: usize) -> Result<Option<Vec<f32>>> {
    let Some(t) = t else { return Ok(None) };
    if t.dims() != [len] {
        return Err(Error::shape(name, &[Some(len)], t.dims()));
    }
    let v = t.to_dtype(DType::F32)?.to_vec1::<f32>()?;
    if let Some(i) = v.iter().position(|x| !x.is_finite()) {
        return Err(Error::non_finite(name, i));
    }
    Ok(Some(v))
}

impl InputSparseFfn {
    fn build(
        spec: FfnSpec,
        gate: Option<ColumnMatrix>,
        up: ColumnMatrix,
        down: ColumnMatrix,
        threads: usize,
        tier: Option<CpuTier>,
    ) -> Result<Self> {
        if threads == 0 {
            return Err(Error::config("threads", "must be at least 1"));
        }
        if spec.gated != gate.is_some() {
            return Err(Error::config(
                "gated",
                "a gate matrix must be given exactly for gated specs",
            ));
        }
        let kernels = match tier {
            Some(t) => Kernels::new(t)?,
            None => Kernels::detect()?,
        };
        Ok(InputSparseFfn {
            spec,
            gate,
            up,
            down,
            gate_bias: None,
            up_bias: None,
            down_bias: None,
            score: InputScore::Magnitude,
            thresholds: InputThresholds::default(),
            kernels,
            pool: Pool::shared(threads),
            recording: AtomicBool::new(false),
            scores: Mutex::new(None),
            scratch: Mutex::new(Scratch::default()),
        })
    }

    /// The FFN on GGUF tensors as a file holds them (`[out, in]`, Q4_0 / Q4_1 / Q8_0 blocks kept
    /// exactly), on `threads` threads (`tier`: `None` detects the SIMD tier). Every threshold
    /// starts at 0 (dense).
    pub fn from_qtensors(
        spec: FfnSpec,
        gate: Option<&QTensor>,
        up: &QTensor,
        down: &QTensor,
        threads: usize,
        tier: Option<CpuTier>,
    ) -> Result<Self> {
        let (h, n) = (spec.hidden, spec.intermediate);
        let gate = gate
            .map(|g| qcolumns(g, "gate_proj.weight", n, h))
            .transpose()?;
        let up = qcolumns(up, "up_proj.weight", n, h)?;
        let down = qcolumns(down, "down_proj.weight", h, n)?;
        Self::build(spec, gate, up, down, threads, tier)
    }

    /// The FFN on float weights (`[out, in]` tensors, f32/f16/bf16, with optional biases),
    /// stored as `storage` (f32, f16 or bf16).
    pub fn from_weights(
        spec: FfnSpec,
        w: FfnWeights<'_>,
        storage: ColumnStorage,
        threads: usize,
        tier: Option<CpuTier>,
    ) -> Result<Self> {
        let (h, n) = (spec.hidden, spec.intermediate);
        let gate = w
            .gate
            .map(|g| fcolumns(g, "gate_proj.weight", n, h, storage))
            .transpose()?;
        let up = fcolumns(w.up, "up_proj.weight", n, h, storage)?;
        let down = fcolumns(w.down, "down_proj.weight", h, n, storage)?;
        let mut f = Self::build(spec, gate, up, down, threads, tier)?;
        f.gate_bias = bias(w.gate_bias, "gate_proj.bias", n)?;
        f.up_bias = bias(w.up_bias, "up_proj.bias", n)?;
        f.down_bias = bias(w.down_bias, "down_proj.bias", h)?;
        Ok(f)
    }

    /// Sets the rule: how entries are scored and the thresholds (finite, at least 0).
    pub fn set_rule(&mut self, score: InputScore, thresholds: InputThresholds) -> Result<()> {
        thresholds.check()?;
        self.score = score;
        self.thresholds = thresholds;
        Ok(())
    }

    /// The score in use.
    pub fn score(&self) -> InputScore {
        self.score
    }

    /// The thresholds in use.
    pub fn thresholds(&self) -> InputThresholds {
        self.thresholds
    }

    /// The layer's spec.
    pub fn spec(&self) -> &FfnSpec {
        &self.spec
    }

    /// Threads of the pool.
    pub fn threads(&self) -> usize {
        self.pool.threads()
    }

    /// The SIMD tier in use.
    pub fn cpu_tier(&self) -> CpuTier {
        self.kernels.tier()
    }

    /// Bytes of the weights (values and scale planes).
    pub fn weight_bytes(&self) -> usize {
        let (g, u, d) = self.matrix_bytes();
        g + u + d
    }

    /// Bytes of the gate (0 ungated), up and down weights.
    pub fn matrix_bytes(&self) -> (usize, usize, usize) {
        (
            self.gate.as_ref().map_or(0, |g| g.bytes()),
            self.up.bytes(),
            self.down.bytes(),
        )
    }

    /// Starts recording the scores of every entry (as the dense FFN sees them, before any
    /// threshold) into fresh histograms: calibration.
    pub fn record_scores(&self) {
        *self.scores.lock().unwrap_or_else(|e| e.into_inner()) = Some(InputScores::default());
        self.recording.store(true, Ordering::Relaxed);
    }

    /// Stops recording and returns the histograms.
    pub fn take_scores(&self) -> Option<InputScores> {
        self.recording.store(false, Ordering::Relaxed);
        self.scores.lock().unwrap_or_else(|e| e.into_inner()).take()
    }

    /// Returns and resets the weight bytes read since the last call.
    pub fn take_traffic(&self) -> FfnTraffic {
        std::mem::take(
            &mut self
                .scratch
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .traffic,
        )
    }

    /// The FFN on `rows` f32 rows: `x` and `out` are `rows * hidden`, row-major. NaN or infinite
    /// inputs are refused.
    pub fn forward_f32(&self, x: &[f32], rows: usize, out: &mut [f32]) -> Result<()> {
        let h = self.spec.hidden;
        check_f32_rows(x, rows, h, out)?;
        let mut s = self.scratch.lock().unwrap_or_else(|e| e.into_inner());
        for (xr, o) in x.chunks_exact(h).zip(out.chunks_exact_mut(h)) {
            self.row(&mut s, xr, o);
        }
        Ok(())
    }

    /// The FFN on a tensor `[.., hidden]` (f32, f16 or bf16, CPU); same shape and dtype out.
    pub fn forward_tensor(&self, xs: &Tensor) -> Result<Tensor> {
        let rows = check_rows(xs, self.spec.hidden, "input")?;
        if rows == 0 {
            return Ok(xs.clone());
        }
        let mut out = vec![0f32; xs.elem_count()];
        let mut buf =
            std::mem::take(&mut self.scratch.lock().unwrap_or_else(|e| e.into_inner()).xbuf);
        let res = with_f32(xs, &mut buf, |x| self.forward_f32(x, rows, &mut out));
        self.scratch.lock().unwrap_or_else(|e| e.into_inner()).xbuf = buf;
        res?;
        to_tensor(out, xs.dims(), xs.dtype())
    }

    /// Per-entry score factors of `m`'s inputs: `None` for `|x|`.
    fn weight<'a>(&self, m: &'a ColumnMatrix) -> Option<&'a [f32]> {
        match self.score {
            InputScore::Magnitude => None,
            InputScore::Wina => Some(m.column_norms()),
        }
    }

    fn record(&self, x: &[f32], h: Option<&[f32]>) {
        if !self.recording.load(Ordering::Relaxed) {
            return;
        }
        let mut g = self.scores.lock().unwrap_or_else(|e| e.into_inner());
        let Some(sc) = g.as_mut() else { return };
        let scored = |hist: &mut Histogram, v: &[f32], w: Option<&[f32]>| match w {
            None => hist.record_all(v),
            Some(w) => v
                .iter()
                .zip(w)
                .for_each(|(&v, &n)| hist.record(v.abs() * n)),
        };
        match h {
            None => {
                if let Some(gm) = &self.gate {
                    scored(&mut sc.gate, x, self.weight(gm));
                }
                scored(&mut sc.up, x, self.weight(&self.up));
            }
            Some(h) => scored(&mut sc.down, h, self.weight(&self.down)),
        }
    }

    /// One row: masked gate and up products, `h`, masked down product.
    fn row(&self, s: &mut Scratch, x: &[f32], out: &mut [f32]) {
        let (n, t) = (self.spec.intermediate, self.thresholds);
        let quant = matches!(self.up.storage(), ColumnStorage::Quant(_));
        self.record(x, None);
        let Scratch {
            gate,
            up,
            down,
            gu,
            h,
            y,
            traffic,
            ..
        } = s;
        if let Some(gm) = &self.gate {
            gate.mask(x, self.weight(gm), t.gate, quant);
        }
        // `|x|` with one threshold for gate and up (TEAL's default split): one masked input.
        let shared = self.gate.is_some() && self.score == InputScore::Magnitude && t.gate == t.up;
        if !shared {
            up.mask(x, self.weight(&self.up), t.up, quant);
        }
        let cg = self.gate.as_ref().map_or(0, |g| g.chunks());
        let cu = self.up.chunks();
        gu.resize((cg + cu) * CHUNK, 0.0);
        let k = &self.kernels;
        let (gate_in, up_in) = (&*gate, if shared { &*gate } else { &*up });
        self.pool.run_chunks(gu, cg + cu, CHUNK, &|r, part| {
            // Gate chunks first, then up chunks.
            let split = (cg.clamp(r.start, r.end) - r.start) * CHUNK;
            let (pg, pu) = part.split_at_mut(split);
            if let Some(gm) = &self.gate {
                if !pg.is_empty() {
                    let i = gate_in;
                    column_product(
                        k,
                        gm,
                        r.start..r.start + pg.len() / CHUNK,
                        &i.x,
                        &i.q,
                        &i.active.cols,
                        pg,
                    );
                }
            }
            if !pu.is_empty() {
                let start = r.start.max(cg) - cg;
                let i = up_in;
                column_product(
                    k,
                    &self.up,
                    start..start + pu.len() / CHUNK,
                    &i.x,
                    &i.q,
                    &i.active.cols,
                    pu,
                );
            }
        });
        let act = self.spec.activation;
        h.resize(n, 0.0);
        let bias = |b: &Option<Vec<f32>>, j: usize| b.as_ref().map_or(0.0, |b| b[j]);
        let ups = &gu[cg * CHUNK..cg * CHUNK + n];
        if self.gate.is_some() {
            for (j, (hv, &u)) in h.iter_mut().zip(ups).enumerate() {
                *hv = act.gated(gu[j] + bias(&self.gate_bias, j), u + bias(&self.up_bias, j));
            }
        } else {
            for (j, (hv, &u)) in h.iter_mut().zip(ups).enumerate() {
                *hv = act.ungated(u + bias(&self.up_bias, j));
            }
        }
        self.record(x, Some(h));
        down.mask(h, self.weight(&self.down), t.down, quant);
        let cd = self.down.chunks();
        y.resize(cd * CHUNK, 0.0);
        let down_in = &*down;
        self.pool.run_chunks(y, cd, CHUNK, &|r, part| {
            let i = down_in;
            column_product(k, &self.down, r, &i.x, &i.q, &i.active.cols, part);
        });
        match &self.down_bias {
            Some(b) => {
                for ((o, &v), &b) in out.iter_mut().zip(y.iter()).zip(b) {
                    *o = v + b;
                }
            }
            None => out.copy_from_slice(&y[..self.spec.hidden]),
        }
        let mut read = 0;
        let mut dense = 0;
        let products = [
            self.gate.as_ref().map(|m| (m, &gate.active)),
            Some((&self.up, &up_in.active)),
            Some((&self.down, &down.active)),
        ];
        for (m, a) in products.into_iter().flatten() {
            read += m.bytes_read(a.cols.len(), a.blocks);
            dense += m.bytes_read(m.cols(), m.cols().div_ceil(crate::cpu::QK));
        }
        traffic.rows += 1;
        traffic.read += read as u64;
        traffic.dense += dense as u64;
    }
}

impl Module for InputSparseFfn {
    fn forward(&self, xs: &Tensor) -> candle_core::Result<Tensor> {
        Ok(self.forward_tensor(xs)?)
    }
}
