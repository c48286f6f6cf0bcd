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
//! Weights are the file's blocks (see `columns`); the rule is per layer and per matrix
//! ([`InputThresholds`]), read from calibration histograms ([`InputScores`]). Two pool dispatches
//! per row (gate and up together, then down); threads take static shares of output chunks, so
//! results are bit-identical across runs and thread counts. No allocation per row once the block
//! has run.

use std::sync::{Arc, Mutex};

use candle_core::quantized::QTensor;
use candle_core::{DType, Module, Tensor};

use crate::analysis::Histogram;
use crate::cpu::{
    ColumnMatrix, ColumnStorage, FloatRows, Kernels, PackedRows, Pool, SimdLevel, CHUNK,
};
use crate::error::{Error, ErrorKind, Result};
use crate::ffn::{FfnSpec, FfnWeights};
use crate::tensor_io::{check_f32_rows, forward_tensor};

mod batch;
mod chess;
mod greedy;
mod hot;
mod linear;
mod matrix;
mod plan;
mod record;
mod rule;

pub use chess::ChessRule;
use chess::Up;
pub use greedy::{GreedyPath, GreedyStep};
pub use hot::{hot_count, hot_neuron_bytes, hot_neurons, HotNeurons, HOT_GROUP};
pub use linear::InputSparseLinear;
pub use matrix::Layout;
use matrix::{Columns, Input};
pub use plan::{FfnMatrix, LayoutDecision, LayoutPlanner, Layouts, MARGIN, REPEATS};
use record::Recorder;
pub use rule::{
    split_target, InputScore, InputScores, InputThresholds, WeightTraffic, MAX_SAMPLES,
    SAMPLE_EVERY,
};

#[derive(Debug, Default)]
struct Scratch {
    gate: Input,
    up: Input,
    down: Input,
    /// Gate then up outputs, each padded to whole chunks.
    gu: Vec<f32>,
    /// With up rows: whether each neuron's up row was computed, and the kept neurons' ids and
    /// up values.
    keep: Vec<bool>,
    kept: Vec<u32>,
    uk: Vec<f32>,
    h: Vec<f32>,
    /// With hot neurons: `h` over every neuron (the hot ones 0), down's input.
    hs: Vec<f32>,
    y: Vec<f32>,
    traffic: WeightTraffic,
}

/// The neurons of a split FFN ([`InputSparseFfn::from_qtensors_split`]): the hot ones on a
/// device, the cold ones the CPU's gate and up rows.
struct Split {
    hot: HotNeurons,
    /// Gate's and up's row `r` is neuron `cold[r]` (increasing).
    cold: Vec<u32>,
}

impl Split {
    /// `h` over the cold neurons (`rows` rows of `cold.len()`) scattered into `out`, `rows`
    /// rows of `n` with the hot neurons 0.
    fn scatter(&self, h: &[f32], rows: usize, n: usize, out: &mut Vec<f32>) {
        out.clear();
        out.resize(rows * n, 0.0);
        let nc = self.cold.len();
        for (hr, or) in h
            .chunks_exact(nc.max(1))
            .zip(out.chunks_exact_mut(n))
            .take(rows)
        {
            for (&j, &v) in self.cold.iter().zip(hr) {
                or[j as usize] = v;
            }
        }
    }
}

/// How [`InputSparseFfn::load`] builds the FFN: threads, SIMD level, the rule it starts with and
/// how the matrices are stored.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct InputSparseOptions {
    /// Threads of the FFN's pool (the calling thread included). Default: every core.
    pub threads: usize,
    /// SIMD level of the kernels (`None`: the best the CPU has).
    pub simd_level: Option<SimdLevel>,
    /// How input entries are scored (TEAL's `|x|` by default).
    pub score: InputScore,
    /// The thresholds (default all 0: every nonzero entry kept, the dense result). Calibrate
    /// them with [`InputSparseFfn::record_scores`] and [`InputScores::thresholds`].
    pub thresholds: InputThresholds,
    /// How gate, up and down are stored. `None` (the default): a matrix whose threshold in
    /// `thresholds` is 0 (nothing to skip) is [`Layout::Rows`], read by the dense row kernels,
    /// and the others by column. So the swap with the default options is a dense FFN on our
    /// kernels; to calibrate a rule after loading (a later [`InputSparseFfn::set_rule`] does not
    /// change layouts, and a matrix stored as rows ignores its threshold), ask for
    /// `Some([Layout::Columns; 3])`.
    pub layouts: Option<[Layout; 3]>,
}

impl Default for InputSparseOptions {
    fn default() -> Self {
        InputSparseOptions {
            threads: std::thread::available_parallelism().map_or(1, |n| n.get()),
            simd_level: None,
            score: InputScore::default(),
            thresholds: InputThresholds::default(),
            layouts: None,
        }
    }
}

/// The FFN with input sparsity on column-major weights (see the module docs).
pub struct InputSparseFfn {
    spec: FfnSpec,
    gate: Option<Columns>,
    up: Up,
    down: Columns,
    chess: Option<ChessRule>,
    gate_bias: Option<Vec<f32>>,
    up_bias: Option<Vec<f32>>,
    down_bias: Option<Vec<f32>>,
    score: InputScore,
    thresholds: InputThresholds,
    kernels: Kernels,
    pool: Arc<Pool>,
    scores: Recorder<InputScores>,
    scratch: Mutex<Scratch>,
    /// f16/bf16 inputs widened to f32 (`forward_tensor`).
    xbuf: Mutex<Vec<f32>>,
    /// The hot neurons on a device and which neurons the CPU's gate and up rows are.
    split: Option<Split>,
}

impl std::fmt::Debug for InputSparseFfn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("InputSparseFfn")
            .field("spec", &self.spec)
            .field("down", &self.down)
            .field("up_rows", &matches!(self.up, Up::Rows(_)))
            .field("score", &self.score)
            .field("thresholds", &self.thresholds)
            .field("tier", &self.kernels.tier())
            .field("threads", &self.pool.threads())
            .field("hot", &self.split.as_ref().map(|s| &s.hot))
            .finish()
    }
}

/// A float tensor `[rows, cols]` in `storage`, by column or as rows.
fn fcolumns(
    t: &Tensor,
    name: &str,
    rows: usize,
    cols: usize,
    storage: ColumnStorage,
    layout: Layout,
) -> Result<Columns> {
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
    let named = |e: Error| Error::config(name, e.to_string());
    match layout {
        Layout::Columns => ColumnMatrix::from_f32(storage, rows, cols, &w)
            .map(Columns::Matrix)
            .map_err(named),
        Layout::Rows => FloatRows::from_f32(storage, rows, cols, &w)
            .map(|m| Columns::FloatRows { m, masked: false })
            .map_err(named),
    }
}

/// The kernel table for `tier` (`None`: detected), `threads` checked first.
/// `f` on this thread's value of `key` (a prompt's batch buffers, kept between calls), or on a
/// fresh one when a call from inside another on this thread finds it taken (none today).
fn with_local<T: Default + 'static, R>(
    key: &'static std::thread::LocalKey<std::cell::RefCell<T>>,
    f: impl FnOnce(&mut T) -> R,
) -> R {
    key.with(|b| match b.try_borrow_mut() {
        Ok(mut b) => f(&mut b),
        Err(_) => f(&mut T::default()),
    })
}

fn kernels(threads: usize, tier: Option<SimdLevel>) -> Result<Kernels> {
    if threads == 0 {
        return Err(Error::config("threads", "must be at least 1"));
    }
    Kernels::for_tier(tier)
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
        gate: Option<Columns>,
        up: Up,
        down: Columns,
        threads: usize,
        kernels: Kernels,
    ) -> Result<Self> {
        if spec.gated != gate.is_some() {
            return Err(Error::config(
                "gated",
                "a gate matrix must be given exactly for gated specs",
            ));
        }
        Ok(InputSparseFfn {
            spec,
            gate,
            up,
            down,
            chess: None,
            gate_bias: None,
            up_bias: None,
            down_bias: None,
            score: InputScore::Magnitude,
            thresholds: InputThresholds::default(),
            kernels,
            pool: Pool::shared(threads),
            scores: Recorder::default(),
            scratch: Mutex::new(Scratch::default()),
            xbuf: Mutex::new(Vec::new()),
            split: None,
        })
    }

    /// The FFN on GGUF tensors as a file holds them (`[out, in]`, blocks of any type of
    /// `cpu::BlockKind` kept exactly), on `threads` threads (`tier`: `None` detects the SIMD
    /// level). Every threshold starts at 0 (dense).
    pub fn from_qtensors(
        spec: FfnSpec,
        gate: Option<&QTensor>,
        up: &QTensor,
        down: &QTensor,
        threads: usize,
        tier: Option<SimdLevel>,
    ) -> Result<Self> {
        let layouts = [Layout::Columns; 3];
        Self::from_qtensors_as(spec, gate, up, down, threads, tier, layouts)
    }

    /// [`InputSparseFfn::from_qtensors`] with gate, up and down in `layouts` (a
    /// [`LayoutPlanner`] says which pays): a matrix stored as [`Layout::Rows`] is the dense
    /// decoder's packed rows, read whole over its unmasked input whatever its threshold.
    pub fn from_qtensors_as(
        spec: FfnSpec,
        gate: Option<&QTensor>,
        up: &QTensor,
        down: &QTensor,
        threads: usize,
        tier: Option<SimdLevel>,
        layouts: [Layout; 3],
    ) -> Result<Self> {
        Self::from_blocks(spec, gate, up, down, threads, tier, layouts, None)
    }

    /// [`InputSparseFfn::from_qtensors_as`] with gate and up cut to the neurons `rows` when
    /// given (increasing, in range): the CPU's part of a split FFN.
    #[allow(clippy::too_many_arguments)]
    fn from_blocks(
        spec: FfnSpec,
        gate: Option<&QTensor>,
        up: &QTensor,
        down: &QTensor,
        threads: usize,
        tier: Option<SimdLevel>,
        layouts: [Layout; 3],
        rows: Option<&[u32]>,
    ) -> Result<Self> {
        let (h, n) = (spec.hidden, spec.intermediate);
        let k = kernels(threads, tier)?;
        let [lg, lu, ld] = layouts;
        let nr = rows.map_or(n, <[u32]>::len);
        // Gate's and up's rows: the file's, or those of `rows` copied out of them.
        let cut = |t: &QTensor, name: &str| -> Result<Option<QTensor>> {
            rows.map(|r| hot::rows_of(t, name, r, &candle_core::Device::Cpu))
                .transpose()
        };
        // Gate and up run in one dispatch (up alone without a gate), down alone.
        let su = matrix::slab_rows(nr.max(1), 1 + usize::from(gate.is_some()), threads);
        let sd = matrix::slab_rows(h, 1, threads);
        let gate = gate
            .map(|g| {
                let c = cut(g, "gate_proj.weight")?;
                Columns::from_qtensor_as(
                    c.as_ref().unwrap_or(g),
                    "gate_proj.weight",
                    nr,
                    h,
                    &k,
                    lg,
                    su,
                )
            })
            .transpose()?;
        let cu = cut(up, "up_proj.weight")?;
        let up = Columns::from_qtensor_as(
            cu.as_ref().unwrap_or(up),
            "up_proj.weight",
            nr,
            h,
            &k,
            lu,
            su,
        )?;
        let up = Up::Columns(up);
        let down = Columns::from_qtensor_as(down, "down_proj.weight", h, n, &k, ld, sd)?;
        Self::build(spec, gate, up, down, threads, k)
    }

    /// The FFN of [`InputSparseFfn::from_qtensors_as`] split by neuron: the neurons `hot`
    /// ([`hot_neurons`]: increasing, a nonzero multiple of [`HOT_GROUP`] or all of them) are
    /// computed densely on `device` ([`HotNeurons`]), while the CPU computes the others with
    /// this FFN's rule, reading only the cold rows of gate and up, all stored as `layouts` says:
    /// down by column reads only its kept cold columns (the hot ones are zeros of its input,
    /// never read), down as rows reads all of its bytes (the hot neurons' zeros add nothing), so
    /// pick down's layout for the bytes its cold part keeps. Each call queues the device's part
    /// first, computes the CPU's, then waits for the device and adds. The hot neurons skip
    /// nothing, so the output is the unsplit FFN's with the rule lifted from them, up to the
    /// device's 8-bit inputs and down's hot columns quantized again as Q8_0. Recording scores on
    /// a split FFN sees only its cold neurons: calibrate the unsplit FFN.
    #[allow(clippy::too_many_arguments)]
    pub fn from_qtensors_split(
        spec: FfnSpec,
        gate: Option<&QTensor>,
        up: &QTensor,
        down: &QTensor,
        threads: usize,
        tier: Option<SimdLevel>,
        layouts: [Layout; 3],
        hot: &[u32],
        device: &candle_core::Device,
    ) -> Result<Self> {
        let n = spec.intermediate;
        let hot = HotNeurons::new(&spec, gate, up, down, hot, device)?;
        let mut cold = Vec::with_capacity(n - hot.ids().len());
        let mut ids = hot.ids().iter().peekable();
        for j in 0..n as u32 {
            if ids.peek() == Some(&&j) {
                ids.next();
            } else {
                cold.push(j);
            }
        }
        let mut f = Self::from_blocks(spec, gate, up, down, threads, tier, layouts, Some(&cold))?;
        f.split = Some(Split { hot, cold });
        Ok(f)
    }

    /// The hot neurons on a device ([`InputSparseFfn::from_qtensors_split`]), if any.
    pub fn hot(&self) -> Option<&HotNeurons> {
        self.split.as_ref().map(|s| &s.hot)
    }

    /// How gate (columns when ungated), up and down are stored: a matrix as
    /// [`Layout::Rows`] skips nothing and ignores its threshold.
    pub fn layouts(&self) -> [Layout; 3] {
        let up = match &self.up {
            Up::Columns(u) => u.layout(),
            Up::Rows(_) => Layout::Rows,
        };
        let gate = self.gate.as_ref().map_or(Layout::Columns, |g| g.layout());
        [gate, up, self.down.layout()]
    }

    /// Gate's, up's and down's packed rows, when all three are stored as [`Layout::Rows`], none
    /// is masked ([`InputSparseFfn::mask_rows`]) and nothing else sets this FFN apart from the
    /// dense one (no biases, no CHESS rule, scores not being recorded): such an FFN skips
    /// nothing, so a caller may run the dense FFN's code on these matrices instead (the candle
    /// adapter's `Llama::run_rows_dense`).
    pub fn dense_rows(&self) -> Option<[&PackedRows; 3]> {
        let plain = self.gate_bias.is_none()
            && self.up_bias.is_none()
            && self.down_bias.is_none()
            && self.chess.is_none()
            && self.split.is_none()
            && !self.scores.is_on();
        fn rows(c: &Columns) -> Option<&PackedRows> {
            match c {
                Columns::Rows {
                    m, masked: false, ..
                } => Some(m),
                _ => None,
            }
        }
        match (&self.gate, &self.up) {
            (Some(g), Up::Columns(u)) if plain => Some([rows(g)?, rows(u)?, rows(&self.down)?]),
            _ => None,
        }
    }

    /// The FFN on float weights (`[out, in]` tensors, f32/f16/bf16, with optional biases),
    /// stored by column as `storage` (f32, f16 or bf16).
    pub fn from_weights(
        spec: FfnSpec,
        w: FfnWeights<'_>,
        storage: ColumnStorage,
        threads: usize,
        tier: Option<SimdLevel>,
    ) -> Result<Self> {
        let layouts = [Layout::Columns; 3];
        Self::from_weights_as(spec, w, storage, threads, tier, layouts)
    }

    /// [`InputSparseFfn::from_weights`] with gate, up and down in `layouts`: a matrix stored as
    /// [`Layout::Rows`] is kept row-major and read whole by the dense row kernels, over its
    /// unmasked input whatever its threshold (gate's entry is unused when ungated).
    pub fn from_weights_as(
        spec: FfnSpec,
        w: FfnWeights<'_>,
        storage: ColumnStorage,
        threads: usize,
        tier: Option<SimdLevel>,
        layouts: [Layout; 3],
    ) -> Result<Self> {
        let (h, n) = (spec.hidden, spec.intermediate);
        let [lg, lu, ld] = layouts;
        let gate = w
            .gate
            .map(|g| fcolumns(g, "gate_proj.weight", n, h, storage, lg))
            .transpose()?;
        let up = Up::Columns(fcolumns(w.up, "up_proj.weight", n, h, storage, lu)?);
        let down = fcolumns(w.down, "down_proj.weight", h, n, storage, ld)?;
        let mut f = Self::build(spec, gate, up, down, threads, kernels(threads, tier)?)?;
        f.gate_bias = bias(w.gate_bias, "gate_proj.bias", n)?;
        f.up_bias = bias(w.up_bias, "up_proj.bias", n)?;
        f.down_bias = bias(w.down_bias, "down_proj.bias", h)?;
        Ok(f)
    }

    /// The FFN of a candle-transformers MLP, read from its `VarBuilder` as
    /// [`crate::HybridFfn::load`] reads it (`gate_proj`/`up_proj`/`down_proj`, `up_proj`/
    /// `down_proj` or `fc1`/`fc2`, optional biases; sizes and gating from the weights), stored
    /// in the `VarBuilder`'s dtype (f32, f16 or bf16) and `opts`' layouts, with `opts`' rule. The
    /// swap in a model's layer is one line: `mlp: InputSparseFfn::load(act, vb.pp("mlp"), opts)?`;
    /// with the default options it computes candle's dense MLP on our row kernels.
    pub fn load(
        activation: crate::Activation,
        vb: candle_nn::VarBuilder,
        opts: InputSparseOptions,
    ) -> Result<Self> {
        let storage = match vb.dtype() {
            DType::F32 => ColumnStorage::F32,
            DType::F16 => ColumnStorage::F16,
            DType::BF16 => ColumnStorage::BF16,
            got => {
                let tensor = "VarBuilder dtype".to_string();
                return Err(ErrorKind::DType { tensor, got }.into());
            }
        };
        let t = opts.thresholds;
        let by_threshold = |t: f32| {
            if t == 0.0 {
                Layout::Rows
            } else {
                Layout::Columns
            }
        };
        let layouts = opts
            .layouts
            .unwrap_or([t.gate, t.up, t.down].map(by_threshold));
        crate::ffn::with_mlp_tensors(activation, &vb, |spec, weights| {
            let (threads, tier) = (opts.threads, opts.simd_level);
            let mut f = Self::from_weights_as(spec, weights, storage, threads, tier, layouts)?;
            f.set_rule(opts.score, opts.thresholds)?;
            Ok(f)
        })
    }

    /// Sets the rule: how entries are scored and the thresholds (finite, at least 0).
    pub fn set_rule(&mut self, score: InputScore, thresholds: InputThresholds) -> Result<()> {
        thresholds.check()?;
        if matches!(self.up, Up::Rows(_)) && thresholds.up != 0.0 {
            return Err(Error::config(
                "input threshold",
                "up is stored as rows (the up-rows layout): it has no input threshold",
            ));
        }
        self.score = score;
        self.thresholds = thresholds;
        Ok(())
    }

    /// With `on`, the matrices stored as [`Layout::Rows`] take the masked input too: they still
    /// read every byte, but compute what the column layout would, so the output is the rule's
    /// whole effect whatever layouts the planner chose (for measuring quality; off by default).
    pub fn mask_rows(&mut self, on: bool) {
        for m in [self.gate.as_mut(), Some(&mut self.down)]
            .into_iter()
            .flatten()
        {
            m.set_masked(on);
        }
        if let Up::Columns(u) = &mut self.up {
            u.set_masked(on);
        }
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

    /// The SIMD level in use.
    pub fn simd_level(&self) -> SimdLevel {
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
        self.scores.start();
    }

    /// Stops recording and returns the histograms.
    pub fn take_scores(&self) -> Option<InputScores> {
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

    /// The FFN on `rows` f32 rows: `x` and `out` are `rows * hidden`, row-major. NaN or infinite
    /// inputs are refused.
    pub fn forward_f32(&self, x: &[f32], rows: usize, out: &mut [f32]) -> Result<()> {
        let h = self.spec.hidden;
        check_f32_rows(x, rows, h, out)?;
        // The device's part first, so that it works while the CPU does.
        let pending = match &self.split {
            Some(sp) => Some(sp.hot.launch(x, rows)?),
            None => None,
        };
        if let (Some(sp), Some(p)) = (&self.split, &pending) {
            if sp.cold.is_empty() {
                // Every neuron on the device: the CPU adds only down's bias.
                for o in out.chunks_exact_mut(h) {
                    match &self.down_bias {
                        Some(b) => o.copy_from_slice(b),
                        None => o.fill(0.0),
                    }
                }
                return sp.hot.finish(p.clone(), out);
            }
        }
        let mut s = self.scratch.lock().unwrap_or_else(|e| e.into_inner());
        // Recording computes every neuron: the calibration sees the dense FFN.
        let gf = if self.scores.is_on() {
            None
        } else {
            self.chess.as_ref()
        };
        match &self.up {
            // Several rows (a prompt) stream each matrix once; up by neuron (CHESS) goes by row.
            Up::Columns(um) if rows > 1 => {
                self.rows_batched(&mut s, self.thresholds, um, x, rows, out)
            }
            _ => {
                for (xr, o) in x.chunks_exact(h).zip(out.chunks_exact_mut(h)) {
                    self.row(&mut s, self.thresholds, gf, xr, o);
                }
            }
        }
        if let (Some(sp), Some(p)) = (&self.split, pending) {
            sp.hot.finish(p, out)?;
        }
        Ok(())
    }

    /// The FFN on a tensor `[.., hidden]` (f32, f16 or bf16, CPU); same shape and dtype out.
    pub fn forward_tensor(&self, xs: &Tensor) -> Result<Tensor> {
        let h = self.spec.hidden;
        forward_tensor(xs, h, h, &self.xbuf, |x, rows, out| {
            self.forward_f32(x, rows, out)
        })
    }

    /// Per-entry score factors of `m`'s inputs: `None` for `|x|`.
    fn weight<'a>(&self, m: &'a Columns) -> Option<&'a [f32]> {
        match self.score {
            InputScore::Magnitude => None,
            InputScore::Wina => Some(m.norms()),
        }
    }

    fn record(&self, x: &[f32], h: Option<(&[f32], &[f32])>) {
        self.scores.add(|sc| self.record_into(sc, x, h));
    }

    fn record_into(&self, sc: &mut InputScores, x: &[f32], h: Option<(&[f32], &[f32])>) {
        let scored = |hist: &mut Histogram, v: &[f32], w: Option<&[f32]>| match w {
            None => hist.record_all(v),
            Some(w) => v
                .iter()
                .zip(w)
                .for_each(|(&v, &n)| hist.record(v.abs() * n)),
        };
        match h {
            None => {
                if sc.rows.is_multiple_of(SAMPLE_EVERY) && sc.samples.len() < MAX_SAMPLES * x.len()
                {
                    sc.samples.extend_from_slice(x);
                }
                sc.rows += 1;
                if let Some(gm) = &self.gate {
                    scored(&mut sc.gate, x, self.weight(gm));
                }
                if let Up::Columns(um) = &self.up {
                    scored(&mut sc.up, x, self.weight(um));
                }
            }
            Some((h, u)) => {
                scored(&mut sc.down, h, self.weight(&self.down));
                sc.h_abs.resize(h.len(), 0.0);
                for (a, &v) in sc.h_abs.iter_mut().zip(h) {
                    *a += f64::from(v.abs());
                }
                sc.up_abs.resize(u.len(), 0.0);
                for (a, &v) in sc.up_abs.iter_mut().zip(u) {
                    *a += f64::from(v.abs());
                }
            }
        }
    }

    /// One row: masked gate and up products (or, with up rows and a CHESS rule, up for the
    /// neurons it keeps), `h`, masked down product.
    fn row(
        &self,
        s: &mut Scratch,
        t: InputThresholds,
        chess: Option<&ChessRule>,
        x: &[f32],
        out: &mut [f32],
    ) {
        let n = self.spec.intermediate;
        // Gate's and up's rows: the cold neurons of a split FFN, else every neuron.
        let nc = self.split.as_ref().map_or(n, |sp| sp.cold.len());
        self.record(x, None);
        let (ups, keep) = match &self.up {
            Up::Columns(um) => (self.gate_up_columns(s, t, x, um), None),
            Up::Rows(rows) => self.gate_up_rows(s, t, chess, x, rows),
        };
        let Scratch {
            gate,
            up,
            down,
            gu,
            h,
            hs,
            y,
            traffic,
            keep: keep_mask,
            ..
        } = s;
        let act = self.spec.activation;
        h.resize(nc, 0.0);
        let u = &gu[ups..ups + nc];
        let bias = |b: &Option<Vec<f32>>, j: usize| b.as_ref().map_or(0.0, |b| b[j]);
        match (
            self.gate.is_some(),
            self.gate_bias.is_some() || self.up_bias.is_some(),
        ) {
            // Without biases the activation is one tight loop over the row.
            (true, false) => act.gated_into(&gu[..nc], u, h),
            (false, false) => act.ungated_into(u, h),
            (true, true) => {
                for (j, (hv, &u)) in h.iter_mut().zip(u).enumerate() {
                    *hv = act.gated(gu[j] + bias(&self.gate_bias, j), u + bias(&self.up_bias, j));
                }
            }
            (false, true) => {
                for (j, (hv, &u)) in h.iter_mut().zip(u).enumerate() {
                    *hv = act.ungated(u + bias(&self.up_bias, j));
                }
            }
        }
        if keep.is_some() {
            for (hv, &k) in h.iter_mut().zip(keep_mask.iter()) {
                if !k {
                    *hv = 0.0;
                }
            }
        }
        let h = match &self.split {
            Some(sp) => {
                sp.scatter(h, 1, n, hs);
                &*hs
            }
            None => &*h,
        };
        self.record(x, Some((h, u)));
        down.mask(h, self.weight(&self.down), t.down, &self.down);
        let cd = self.down.chunks();
        y.resize(cd * CHUNK, 0.0);
        let (k, down_in) = (&self.kernels, &*down);
        self.pool.run_chunks(y, cd, CHUNK, &|r, part| {
            self.down.product(k, r, down_in, part);
        });
        match &self.down_bias {
            Some(b) => {
                for ((o, &v), &b) in out.iter_mut().zip(y.iter()).zip(b) {
                    *o = v + b;
                }
            }
            None => out.copy_from_slice(&y[..self.spec.hidden]),
        }
        let mut read = self.down.bytes_read(down);
        let mut dense = self.down.dense_bytes();
        if let Some(gm) = &self.gate {
            read += gm.bytes_read(gate);
            dense += gm.dense_bytes();
        }
        match (&self.up, keep) {
            (Up::Columns(um), _) => {
                let a = if self.shares_input(t) { &*gate } else { &*up };
                read += um.bytes_read(a);
                dense += um.dense_bytes();
            }
            (Up::Rows(rows), keep) => {
                read += rows.row_bytes() * keep.unwrap_or(n);
                dense += rows.row_bytes() * n;
            }
        }
        traffic.rows += 1;
        traffic.read += read as u64;
        traffic.dense += dense as u64;
    }

    /// Whether gate and up read one input: one block type (or floats) and layout for both, and
    /// either both stored as rows (the whole row) or `|x|` with one threshold for both (TEAL's
    /// default split).
    fn shares_input(&self, t: InputThresholds) -> bool {
        match (&self.gate, &self.up) {
            (Some(g), Up::Columns(u)) if g.same_input(u) => {
                !g.reads_mask() || (self.score == InputScore::Magnitude && t.gate == t.up)
            }
            _ => false,
        }
    }

    /// Gate and up over column-major weights in one dispatch; returns where up's values start
    /// in `s.gu`.
    fn gate_up_columns(
        &self,
        s: &mut Scratch,
        t: InputThresholds,
        x: &[f32],
        um: &Columns,
    ) -> usize {
        let Scratch { gate, up, gu, .. } = s;
        if let Some(gm) = &self.gate {
            gate.mask(x, self.weight(gm), t.gate, gm);
        }
        let shared = self.shares_input(t);
        if !shared {
            up.mask(x, self.weight(um), t.up, um);
        }
        let cg = self.gate.as_ref().map_or(0, |g| g.chunks());
        let cu = um.chunks();
        gu.resize((cg + cu) * CHUNK, 0.0);
        let k = &self.kernels;
        let (gate_in, up_in) = (&*gate, if shared { &*gate } else { &*up });
        self.pool.run_chunks(gu, cg + cu, CHUNK, &|r, part| {
            // Gate chunks first, then up chunks.
            let split = (cg.clamp(r.start, r.end) - r.start) * CHUNK;
            let (pg, pu) = part.split_at_mut(split);
            if let Some(gm) = &self.gate {
                if !pg.is_empty() {
                    gm.product(k, r.start..r.start + pg.len() / CHUNK, gate_in, pg);
                }
            }
            if !pu.is_empty() {
                let start = r.start.max(cg) - cg;
                um.product(k, start..start + pu.len() / CHUNK, up_in, pu);
            }
        });
        cg * CHUNK
    }
}

impl Module for InputSparseFfn {
    fn forward(&self, xs: &Tensor) -> candle_core::Result<Tensor> {
        Ok(self.forward_tensor(xs)?)
    }
}
