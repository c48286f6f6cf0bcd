//! The `powerinfer` feature's implementation: the configuration ([`enable`], the environment),
//! the load plan behind `LoadScope`, the sparse FFN of a layer ([`SparseMlp`]) and [`report`].
//!
//! When a configuration is active, the loaders build a [`powerinfer::HybridFfn`] for each
//! layer's MLP instead of the dense one (or, with [`Sparsity::Input`], a
//! [`powerinfer::InputSparseFfn`]: training-free input sparsity on the file's exact weights).
//!
//! SDK users call [`enable`] before building a model; the `mistralrs` CLI and server read
//! [`ENV_CONFIG`] (`predictors:ARTIFACT`, `all`, `gate-first:T`, `input` or `input:ARTIFACT`),
//! [`ENV_SPARSITY`] and [`ENV_THREADS`] when nothing was enabled in code.

use std::path::PathBuf;
use std::sync::{Arc, Mutex, Weak};

use candle_core::quantized::QTensor;
use candle_core::{DType, Device, Result, Tensor};
use mistralrs_quant::{QuantMethod, ShardedVarBuilder};

use crate::amoe::{AnyMoeTrainableLayer, MlpLayer};
use crate::layers::Activation;

pub use powerinfer as engine;

/// Environment variable naming what to run: `predictors:ARTIFACT` (the trained predictors of a
/// `.powerinfer` artifact from `powerinfer analyze`), `all` (every neuron through the sparse
/// kernels), `gate-first:T` (exact thresholding at `T`),
/// `input` (the input-sparse FFN keeping every input: the dense result) or `input:ARTIFACT` (its
/// calibrated input rule).
pub const ENV_CONFIG: &str = "MISTRALRS_POWERINFER";
/// With an artifact: set the predictors' score thresholds for this FFN sparsity (0..0.95)
/// instead of the artifact's target-recall thresholds.
pub const ENV_SPARSITY: &str = "MISTRALRS_POWERINFER_SPARSITY";
/// Threads of the sparse FFN (default: all cores).
pub const ENV_THREADS: &str = "MISTRALRS_POWERINFER_THREADS";

/// What each layer computes: the engine's own setting, shared with the candle loader and the CLI
/// (same string forms).
pub use powerinfer::{Neurons, Sparsity};

/// How the input-sparse FFN stores a GGUF layer's matrices: measured per matrix (the default) or
/// all by column.
pub use powerinfer::layout::Layouts;

/// Environment variable: `columns` stores every GGUF matrix of the input-sparse FFN by column
/// (every product input-sparse, to measure the kernels) instead of [`Layouts::Measured`].
pub const ENV_LAYOUTS: &str = "MISTRALRS_POWERINFER_LAYOUTS";

/// How mistral.rs builds its FFN blocks while the configuration is enabled.
#[derive(Debug, Clone, PartialEq)]
pub struct PowerInferConfig {
    /// What runs: the hybrid FFN with a neuron rule, or the input-sparse FFN.
    pub sparsity: Sparsity,
    /// Threads of the sparse FFN's CPU tier (`None`: all cores).
    pub threads: Option<usize>,
    /// The input-sparse FFN's GGUF layouts. [`Layouts::Measured`] (the default) stores a matrix
    /// by column only where its column product, timed at load at the fraction of inputs the
    /// artifact's rule drops (its `allocation`; the `drop` given here without a rule), beats
    /// the dense packed rows; elsewhere as those rows, which run the dense decoder's kernels
    /// over the whole input. So `input` (every input kept) is powerinfer's dense FFN.
    pub layouts: Layouts,
}

impl PowerInferConfig {
    /// Trained predictors and placement from an artifact.
    pub fn artifact(path: impl Into<PathBuf>) -> Self {
        Self::new(Neurons::predictors(path).into())
    }

    /// The input-sparse FFN: `artifact`'s calibrated rule, or every input kept.
    pub fn input(artifact: Option<PathBuf>) -> Self {
        Self::new(Sparsity::Input(artifact))
    }

    /// Every neuron through the sparse kernels.
    pub fn all_neurons() -> Self {
        Self::new(Neurons::All.into())
    }

    /// Exact thresholding at `threshold` in every layer.
    pub fn gate_first(threshold: f32) -> Self {
        Self::new(Neurons::GateFirst(threshold).into())
    }

    /// The configuration running `sparsity` on all cores.
    pub fn new(sparsity: Sparsity) -> Self {
        PowerInferConfig {
            sparsity,
            threads: None,
            layouts: Layouts::Measured { drop: [0.0; 3] },
        }
    }

    /// The input-sparse FFN's GGUF layouts.
    pub fn with_layouts(mut self, layouts: Layouts) -> Self {
        self.layouts = layouts;
        self
    }

    /// With an artifact: score thresholds for this FFN sparsity.
    pub fn with_predictor_sparsity(mut self, sparsity: f64) -> Self {
        if let Sparsity::Neurons(Neurons::Predictors {
            predictor_sparsity, ..
        }) = &mut self.sparsity
        {
            *predictor_sparsity = Some(sparsity);
        }
        self
    }

    /// Threads of the sparse FFN.
    pub fn with_threads(mut self, threads: usize) -> Self {
        self.threads = Some(threads);
        self
    }

    /// The configuration the environment names ([`ENV_CONFIG`], [`ENV_SPARSITY`],
    /// [`ENV_THREADS`]); `None` when [`ENV_CONFIG`] is unset or empty.
    pub fn from_env() -> Result<Option<Self>> {
        let Some(v) = std::env::var_os(ENV_CONFIG).filter(|v| !v.is_empty()) else {
            return Ok(None);
        };
        let v = v.to_string_lossy().into_owned();
        let sparsity: Sparsity = v
            .parse()
            .map_err(|e| bad(format!("{ENV_CONFIG}={v}: {e}")))?;
        let mut cfg = Self::new(sparsity);
        if let Some(s) = env_parse::<f64>(ENV_SPARSITY)? {
            if !matches!(cfg.sparsity, Sparsity::Neurons(Neurons::Predictors { .. })) {
                return Err(bad(format!(
                    "{ENV_SPARSITY} needs an artifact in {ENV_CONFIG}"
                )));
            }
            cfg = cfg.with_predictor_sparsity(s);
        }
        if let Some(t) = env_parse::<usize>(ENV_THREADS)? {
            cfg = cfg.with_threads(t);
        }
        match std::env::var(ENV_LAYOUTS).as_deref() {
            Ok("columns") => cfg = cfg.with_layouts(Layouts::Columns),
            Ok("" | "measured") | Err(_) => {}
            Ok(v) => {
                return Err(bad(format!(
                    "{ENV_LAYOUTS}={v}: expected `columns` or `measured`"
                )))
            }
        }
        Ok(Some(cfg))
    }
}

fn env_parse<T: std::str::FromStr>(name: &str) -> Result<Option<T>> {
    match std::env::var(name) {
        Ok(v) if !v.is_empty() => v
            .parse()
            .map(Some)
            .map_err(|_| bad(format!("{name}={v} is not a valid value"))),
        _ => Ok(None),
    }
}

fn bad(msg: impl std::fmt::Display) -> candle_core::Error {
    candle_core::Error::Msg(format!("powerinfer: {msg}"))
}

fn engine_err(e: powerinfer::Error) -> candle_core::Error {
    bad(e)
}

/// What the code asked for; the environment decides only while nothing was.
enum Choice {
    FromEnv,
    On(PowerInferConfig),
    Off,
}

static CHOICE: Mutex<Choice> = Mutex::new(Choice::FromEnv);

/// Models built from now on use the sparse FFN as `config` says.
pub fn enable(config: PowerInferConfig) {
    *CHOICE.lock().unwrap_or_else(|e| e.into_inner()) = Choice::On(config);
}

/// Models built from now on use mistral.rs's dense MLP, whatever the environment says.
pub fn disable() {
    *CHOICE.lock().unwrap_or_else(|e| e.into_inner()) = Choice::Off;
}

/// The configuration in force: the one enabled in code; else, unless [`disable`] was called,
/// the environment's.
pub fn config() -> Result<Option<PowerInferConfig>> {
    match &*CHOICE.lock().unwrap_or_else(|e| e.into_inner()) {
        Choice::On(c) => Ok(Some(c.clone())),
        Choice::Off => Ok(None),
        Choice::FromEnv => PowerInferConfig::from_env(),
    }
}

/// Realized sparsity of the sparse FFN: what [`report`] returns.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct SparsityReport {
    /// Sparse FFN layers alive (all models).
    pub layers: usize,
    /// Rows (tokens x layers) they computed since the last [`reset_report`].
    pub rows: u64,
    /// (row, neuron) pairs seen.
    pub pairs: u64,
    /// Pairs computed with a nonzero contribution.
    pub active: u64,
    /// Input-sparse layers: FFN weight bytes read, and what dense products would have read.
    pub ffn_bytes: powerinfer::WeightTraffic,
    /// Input-sparse layers alive: their gate, up and down matrices, and how many of those are
    /// stored by column (input-sparse products; the rest are dense packed rows).
    pub input_matrices: usize,
    /// See `input_matrices`.
    pub input_columns: usize,
}

impl SparsityReport {
    /// Share of (row, neuron) pairs skipped (hybrid layers).
    pub fn sparsity(&self) -> f64 {
        1.0 - self.active as f64 / self.pairs.max(1) as f64
    }

    /// Share of the FFN weight bytes not read (input-sparse layers).
    pub fn ffn_bytes_skipped(&self) -> f64 {
        self.ffn_bytes.skipped()
    }
}

static LIVE: Mutex<Vec<Weak<powerinfer::HybridFfn>>> = Mutex::new(Vec::new());
static LIVE_INPUT: Mutex<Vec<Weak<powerinfer::InputSparseFfn>>> = Mutex::new(Vec::new());
static TOTALS: Mutex<SparsityReport> = Mutex::new(SparsityReport {
    layers: 0,
    rows: 0,
    pairs: 0,
    active: 0,
    ffn_bytes: powerinfer::WeightTraffic {
        rows: 0,
        read: 0,
        dense: 0,
    },
    input_matrices: 0,
    input_columns: 0,
});

/// Moves every live layer's counts into the totals and sets what describes the live layers
/// (their count, the input-sparse layers' layouts).
fn collect(totals: &mut SparsityReport) {
    let mut live = LIVE.lock().unwrap_or_else(|e| e.into_inner());
    live.retain(|w| w.strong_count() > 0);
    for ffn in live.iter().filter_map(Weak::upgrade) {
        // Taking the counts stops them; restart at once (a call in between is not counted).
        if let Some(s) = ffn.take_stats() {
            totals.rows += s.tokens;
            totals.pairs += s.tokens * s.counts.len() as u64;
            totals.active += s.counts.iter().sum::<u64>();
        }
        ffn.enable_stats(0.0);
    }
    let mut input = LIVE_INPUT.lock().unwrap_or_else(|e| e.into_inner());
    input.retain(|w| w.strong_count() > 0);
    (totals.input_matrices, totals.input_columns) = (0, 0);
    for ffn in input.iter().filter_map(Weak::upgrade) {
        let t = ffn.take_traffic();
        totals.rows += t.rows;
        totals.ffn_bytes.add(&t);
        let layouts = ffn.layouts();
        totals.input_matrices += layouts.len();
        totals.input_columns += layouts
            .iter()
            .filter(|l| **l == powerinfer::layout::Layout::Columns)
            .count();
    }
    totals.layers = live.len() + input.len();
}

/// Realized sparsity of the sparse FFN layers built so far, since the last [`reset_report`].
pub fn report() -> SparsityReport {
    let mut totals = TOTALS.lock().unwrap_or_else(|e| e.into_inner());
    collect(&mut totals);
    *totals
}

/// Zeroes the counts [`report`] sums.
pub fn reset_report() {
    let mut totals = TOTALS.lock().unwrap_or_else(|e| e.into_inner());
    collect(&mut totals);
    *totals = SparsityReport::default();
}

/// What one model load uses: the configuration and, with an artifact, the artifact checked
/// against the model's files.
pub(crate) struct Plan {
    config: PowerInferConfig,
    artifact: Option<powerinfer::Artifact>,
    /// The input-sparse FFN's layout planner (with [`Layouts::Measured`]), shared by the
    /// layers: each (matrix, block type, shape) is timed once per load.
    planner: Option<powerinfer::layout::LayoutPlanner>,
}

/// The load in progress: `None` when there is none, `Some(None)` for a load with no
/// configuration (dense), `Some(Some(plan))` for a sparse one. Process-wide rather than per
/// thread, since layers may load on rayon threads (`par_iter_if_isq`).
static LOAD: Mutex<Option<Option<Arc<Plan>>>> = Mutex::new(None);

/// The one load in progress; dropping it ends the load (`LoadScope` holds it).
pub(crate) struct ActiveLoad(());

impl ActiveLoad {
    /// Refuses to begin while another load lives; else reads the configuration in force and,
    /// with an artifact, loads it and checks it was made from `files`.
    pub(crate) fn begin(files: &[PathBuf]) -> Result<ActiveLoad> {
        let mut load = LOAD.lock().unwrap_or_else(|e| e.into_inner());
        if load.is_some() {
            return Err(bad(
                "a model load is already in progress (a LoadScope is alive): with the \
                 powerinfer feature, models load one at a time, not nested or overlapping",
            ));
        }
        let plan = match config()? {
            None => None,
            Some(config) => {
                let artifact = match config.sparsity.artifact() {
                    Some(path) => Some(checked_artifact(&config, path, files)?),
                    None => None,
                };
                tracing::info!("powerinfer: sparse FFN on, {}", config.sparsity);
                let planner = layout_planner(&config, artifact.as_ref())?;
                Some(Arc::new(Plan {
                    config,
                    artifact,
                    planner,
                }))
            }
        };
        *load = Some(plan);
        Ok(ActiveLoad(()))
    }
}

impl Drop for ActiveLoad {
    fn drop(&mut self) {
        *LOAD.lock().unwrap_or_else(|e| e.into_inner()) = None;
    }
}

/// The layout planner of an input-sparse load with [`Layouts::Measured`], expecting the
/// artifact's rule to drop its allocation of gate's, up's and down's inputs (without a rule:
/// the configuration's `drop`).
fn layout_planner(
    config: &PowerInferConfig,
    artifact: Option<&powerinfer::Artifact>,
) -> Result<Option<powerinfer::layout::LayoutPlanner>> {
    let (Sparsity::Input(_), Layouts::Measured { drop }) = (&config.sparsity, config.layouts)
    else {
        return Ok(None);
    };
    let drop = artifact
        .and_then(|a| a.meta.input_rule.as_ref())
        .map_or(drop, |rule| rule.allocation);
    powerinfer::layout::LayoutPlanner::new(drop, threads(config), None)
        .map(Some)
        .map_err(engine_err)
}

/// The artifact at `path`, made from `files` and holding what `config` runs.
fn checked_artifact(
    config: &PowerInferConfig,
    path: &std::path::Path,
    files: &[PathBuf],
) -> Result<powerinfer::Artifact> {
    let a = powerinfer::Artifact::load(path).map_err(engine_err)?;
    let sha = powerinfer::format::model_sha256(files).map_err(engine_err)?;
    a.check_model(&sha).map_err(engine_err)?;
    if matches!(config.sparsity, Sparsity::Input(_)) && a.meta.input_rule.is_none() {
        return Err(bad(format!(
            "{} has no input rule (format version 1); rerun `powerinfer analyze`",
            path.display()
        )));
    }
    Ok(a)
}

/// The plan of the sparse load in progress; `None` outside a load or for a dense one.
pub(crate) fn current_plan() -> Option<Arc<Plan>> {
    LOAD.lock()
        .unwrap_or_else(|e| e.into_inner())
        .clone()
        .flatten()
}

fn engine_activation(act: Activation) -> Result<powerinfer::Activation> {
    Ok(match act {
        Activation::Silu | Activation::Swish => powerinfer::Activation::Silu,
        Activation::Relu => powerinfer::Activation::Relu,
        Activation::Gelu => powerinfer::Activation::Gelu,
        Activation::NewGelu | Activation::GeluPytorchTanh => powerinfer::Activation::GeluTanh,
        other => return Err(bad(format!("activation {other:?} is not supported"))),
    })
}

/// Layer `layer`'s hybrid FFN over its neuron bundles, running `neurons`.
fn build(
    plan: &Plan,
    neurons: &Neurons,
    layer: usize,
    bundles: powerinfer::NeuronBundles,
) -> Result<SparseMlp> {
    use powerinfer::{GateFirst, HybridFfn, HybridOptions};
    let spec = *bundles.spec();
    let mut opts = HybridOptions {
        layer: Some(layer),
        ..Default::default()
    };
    if let Some(t) = plan.config.threads {
        opts.threads = t;
    }
    let mut ffn = HybridFfn::new(bundles, opts).map_err(engine_err)?;
    match (neurons, &plan.artifact) {
        (Neurons::All, _) => {}
        (Neurons::GateFirst(t), _) => {
            ffn.set_predictor(GateFirst::new(*t).map_err(engine_err)?);
        }
        (
            Neurons::Predictors {
                predictor_sparsity, ..
            },
            Some(a),
        ) => {
            a.install(layer, &mut ffn, *predictor_sparsity)
                .map_err(engine_err)?;
        }
        (Neurons::Predictors { artifact, .. }, None) => {
            return Err(bad(format!("{} was not loaded", artifact.display())));
        }
    }
    ffn.enable_stats(0.0);
    let ffn = Arc::new(ffn);
    LIVE.lock()
        .unwrap_or_else(|e| e.into_inner())
        .push(Arc::downgrade(&ffn));
    Ok(SparseMlp {
        ffn: Engine::Hybrid(ffn),
        params: vec![spec.hidden(), spec.intermediate()],
        act: Activation::Silu,
    })
}

/// Layer `layer`'s input-sparse FFN, with the artifact's rule when the plan has one.
fn build_input(
    plan: &Plan,
    layer: usize,
    mut ffn: powerinfer::InputSparseFfn,
) -> Result<SparseMlp> {
    if let Some(rule) = plan
        .artifact
        .as_ref()
        .and_then(|a| a.meta.input_rule.as_ref())
    {
        let t = rule.thresholds.get(layer).ok_or_else(|| {
            bad(format!(
                "the artifact's input rule has {} layers; the model has more",
                rule.thresholds.len()
            ))
        })?;
        ffn.set_rule(rule.input_score().map_err(engine_err)?, *t)
            .map_err(engine_err)?;
    }
    let spec = *ffn.spec();
    let ffn = Arc::new(ffn);
    LIVE_INPUT
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .push(Arc::downgrade(&ffn));
    Ok(SparseMlp {
        ffn: Engine::Input(ffn),
        params: vec![spec.hidden(), spec.intermediate()],
        act: Activation::Silu,
    })
}

fn threads(config: &PowerInferConfig) -> usize {
    config
        .threads
        .unwrap_or_else(|| powerinfer::HybridOptions::default().threads)
}

/// The sparse FFN of a GGUF layer, from its quantized `ffn_gate`, `ffn_up`, `ffn_down` (SiLU
/// gated; the tensors' blocks are kept as they are where the kernels read them).
pub(crate) fn gguf(
    plan: &Plan,
    layer: usize,
    gate: &QTensor,
    up: &QTensor,
    down: &QTensor,
) -> Result<SparseMlp> {
    cpu_only(layer, &gate.device())?;
    let (n, h) = gate.shape().dims2()?;
    let spec =
        powerinfer::FfnSpec::gated(h, n, powerinfer::Activation::Silu).map_err(engine_err)?;
    match &plan.config.sparsity {
        Sparsity::Input(_) => {
            use powerinfer::layout::Layout;
            let layouts = match &plan.planner {
                Some(p) => p
                    .ffn_layouts(&spec, Some(gate), up, down)
                    .map_err(engine_err)?,
                None => [Layout::Columns; 3],
            };
            let ffn = powerinfer::InputSparseFfn::from_qtensors_as(
                spec,
                Some(gate),
                up,
                down,
                threads(&plan.config),
                None,
                layouts,
            )
            .map_err(engine_err)?;
            build_input(plan, layer, ffn)
        }
        Sparsity::Neurons(neurons) => {
            let bundles = powerinfer::NeuronBundles::from_qtensors(spec, Some(gate), up, down)
                .map_err(engine_err)?;
            build(plan, neurons, layer, bundles)
        }
    }
}

/// The sparse FFN of a safetensors layer from the MLP's var builder (`gate_proj`, `up_proj`,
/// `down_proj`), stored in the model's dtype (f32, f16 or bf16; others as f16). Pre-quantized
/// checkpoints are refused.
pub(crate) fn safetensors(
    plan: &Plan,
    layer: usize,
    vb: &ShardedVarBuilder,
    hidden: usize,
    intermediate: usize,
    act: Activation,
    quantized: bool,
) -> Result<SparseMlp> {
    if quantized {
        return Err(bad(format!(
            "layer {layer}: pre-quantized checkpoints are not supported; use the float checkpoint or a GGUF file"
        )));
    }
    cpu_only(layer, vb.device())?;
    let get = |name: &str, shape: (usize, usize)| -> Result<Tensor> {
        vb.pp(name).get(shape, "weight")?.to_dtype(DType::F32)
    };
    let g = get("gate_proj", (intermediate, hidden))?;
    let u = get("up_proj", (intermediate, hidden))?;
    let d = get("down_proj", (hidden, intermediate))?;
    let spec = powerinfer::FfnSpec::gated(hidden, intermediate, engine_activation(act)?)
        .map_err(engine_err)?;
    let weights = powerinfer::FfnWeights::gated(&g, &u, &d);
    let mut mlp = match &plan.config.sparsity {
        Sparsity::Input(_) => {
            let storage = match vb.dtype() {
                DType::F32 => powerinfer::cpu::ColumnStorage::F32,
                DType::BF16 => powerinfer::cpu::ColumnStorage::BF16,
                _ => powerinfer::cpu::ColumnStorage::F16,
            };
            // Row-major where the rule is expected to drop nothing (as the GGUF path's planner
            // decides for every block type there), by column otherwise.
            let layouts = plan
                .planner
                .as_ref()
                .map_or([powerinfer::layout::Layout::Columns; 3], |p| p.float_layouts());
            let ffn = powerinfer::InputSparseFfn::from_weights_as(
                spec,
                weights,
                storage,
                threads(&plan.config),
                None,
                layouts,
            )
            .map_err(engine_err)?;
            build_input(plan, layer, ffn)?
        }
        Sparsity::Neurons(neurons) => {
            let storage = match vb.dtype() {
                DType::F32 => powerinfer::WeightDType::F32,
                DType::BF16 => powerinfer::WeightDType::BF16,
                _ => powerinfer::WeightDType::F16,
            };
            let bundles = powerinfer::NeuronBundles::from_weights(spec, weights, storage)
                .map_err(engine_err)?;
            build(plan, neurons, layer, bundles)?
        }
    };
    mlp.act = act;
    Ok(mlp)
}

fn cpu_only(layer: usize, device: &Device) -> Result<()> {
    if device.is_cpu() {
        Ok(())
    } else {
        Err(bad(format!(
            "layer {layer} is mapped to {device:?}; the sparse FFN runs on the CPU in this version"
        )))
    }
}

/// The engine behind a [`SparseMlp`].
#[derive(Clone)]
enum Engine {
    Hybrid(Arc<powerinfer::HybridFfn>),
    Input(Arc<powerinfer::InputSparseFfn>),
}

/// A layer's MLP run by [`powerinfer::HybridFfn`] or [`powerinfer::InputSparseFfn`].
#[derive(Clone)]
pub(crate) struct SparseMlp {
    ffn: Engine,
    params: Vec<usize>,
    act: Activation,
}

impl SparseMlp {
    pub(crate) fn forward(&self, xs: &Tensor) -> Result<Tensor> {
        match &self.ffn {
            Engine::Hybrid(f) => f.forward_tensor(xs),
            Engine::Input(f) => f.forward_tensor(xs),
        }
        .map_err(engine_err)
    }
}

impl AnyMoeTrainableLayer for SparseMlp {}

impl MlpLayer for SparseMlp {
    fn forward(&self, xs: &Tensor) -> Result<Tensor> {
        SparseMlp::forward(self, xs)
    }
    fn get_isq_layers(&mut self) -> Vec<&mut Arc<dyn QuantMethod>> {
        // The sparse FFN keeps its own storage; in-situ quantization leaves it as it is.
        Vec::new()
    }
    fn clone(&self) -> Box<dyn MlpLayer> {
        Box::new(Clone::clone(self))
    }
    fn get_params(&self) -> &[usize] {
        &self.params
    }
    fn hidden_act(&self) -> Activation {
        self.act
    }
    fn new_added_delta(&self, _deltas: Vec<Option<Tensor>>) -> Result<Box<dyn MlpLayer>> {
        Err(bad(
            "LoRA / AnyMoE deltas on the sparse FFN are not supported",
        ))
    }
    fn dtype_device(&self) -> (DType, Device) {
        (DType::F32, Device::Cpu)
    }
}
