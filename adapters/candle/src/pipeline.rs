//! The analysis pipeline behind `powerinfer analyze`, as one call: per-layer `|h|` thresholds,
//! activation counts and training rows from calibration text, one trained predictor per layer,
//! a placement under a byte budget, and the input-sparse rule, assembled into an [`Artifact`].

use std::path::Path;
use std::time::Instant;

use powerinfer::analysis::{
    predictor_bytes, train_low_rank, ActivationStats, Samples, TrainOptions, Trained, QUANTILE_MAX,
    QUANTILE_STEPS,
};
use powerinfer::{
    format::ArtifactMeta, format::CalibrationSummary, format::LayerMeta, format::LayerTensors,
    tier::plan_placement, Artifact, Error as EngineError, FfnSpec,
};

use crate::analyze::{model_sha256, native_storage, Sampling};
use crate::error::Result;
use crate::input_rule::InputRuleOptions;
use crate::load::FfnMode;

/// Settings of [`analyze`]. The defaults are `powerinfer analyze`'s.
#[derive(Debug, Clone)]
pub struct AnalyzeOptions {
    /// FFN sparsity the per-layer `|h|` thresholds (what "active" means) are chosen for, in
    /// `[0, 1)`.
    pub target_sparsity: f64,
    /// Of the calibration tokens, the first this many set the thresholds (and calibrate the
    /// input rule).
    pub threshold_tokens: usize,
    /// Context window of each calibration chunk.
    pub ctx: usize,
    /// Training rows per layer, spread over the calibration text.
    pub train_rows: usize,
    /// Validation rows per layer, after the training rows.
    pub val_rows: usize,
    /// The predictors' training.
    pub train: TrainOptions,
    /// Fast-tier byte budget for hot neurons and predictors (`None`: half the FFN weights plus
    /// the predictors).
    pub budget: Option<u64>,
    /// The input-sparse rule stored with the predictors (`None`: none). Models whose FFN blocks
    /// have no column layout get none either, with a warning.
    pub input_rule: Option<InputRuleOptions>,
    /// Threads of the input-sparse model used to calibrate the rule.
    pub threads: usize,
}

impl Default for AnalyzeOptions {
    fn default() -> Self {
        AnalyzeOptions {
            target_sparsity: 0.4,
            threshold_tokens: 32_768,
            ctx: 512,
            train_rows: 16_384,
            val_rows: 4_096,
            // Smaller batches and fewer epochs than `TrainOptions::default`: measured on SmolLM2
            // to reach the same validation recall in less time on calibration-sized row sets.
            train: TrainOptions {
                epochs: 6,
                batch: 128,
                lr: 2e-3,
                ..TrainOptions::default()
            },
            budget: None,
            input_rule: Some(InputRuleOptions::default()),
            threads: powerinfer::HybridOptions::default().threads,
        }
    }
}

impl AnalyzeOptions {
    /// Checks every setting; the error names the first one out of its domain.
    pub fn validate(&self) -> Result<()> {
        let bad = |setting: &str, reason: String| -> Result<()> {
            Err(EngineError::config(setting, reason).into())
        };
        if !(0.0..1.0).contains(&self.target_sparsity) {
            bad(
                "target_sparsity",
                format!("{} is outside [0, 1)", self.target_sparsity),
            )?;
        }
        for (name, v) in [
            ("threshold_tokens", self.threshold_tokens),
            ("ctx", self.ctx),
            ("train_rows", self.train_rows),
            ("val_rows", self.val_rows),
            ("threads", self.threads),
        ] {
            if v == 0 {
                bad(name, "must be at least 1".into())?;
            }
        }
        if self.budget == Some(0) {
            bad("budget", "must be at least 1 byte".into())?;
        }
        self.train.validate()?;
        Ok(())
    }
}

/// A step of [`analyze`], for progress reports.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Progress {
    /// `done` of `total` tokens through the `|h|` histograms (thresholds).
    Thresholds {
        /// Tokens done.
        done: usize,
        /// Tokens in all.
        total: usize,
    },
    /// `done` of `total` tokens through the activation counts and training rows.
    Profiling {
        /// Tokens done.
        done: usize,
        /// Tokens in all.
        total: usize,
    },
    /// One training epoch of one layer's predictor finished.
    Training {
        /// The layer.
        layer: usize,
        /// The epoch (from 0).
        epoch: usize,
        /// Its mean training loss.
        loss: f64,
        /// Epochs done over all layers.
        done: usize,
        /// Epochs in all (layers x epochs).
        total: usize,
    },
    /// Calibrating the input-sparse rule.
    InputRule,
}

/// What [`analyze`] made.
#[derive(Debug, Clone)]
pub struct Analysis {
    /// The artifact, ready for [`Artifact::save`].
    pub artifact: Artifact,
    /// Per layer, each neuron's activation frequency over the calibration tokens.
    pub frequencies: Vec<Vec<f64>>,
    /// Bytes of one neuron's weights in the storage the placement assumed.
    pub neuron_bytes: u64,
    /// Bytes of all FFN weights in that storage.
    pub ffn_bytes: u64,
}

/// Runs the whole analysis of the model at `path` (a `.gguf` file or a safetensors directory) on
/// calibration `tokens` (named by `sources` in the artifact): thresholds, profiling, training,
/// placement and the input rule. The model is loaded here twice (dense in f32 for the
/// calibration passes, then input-sparse for the rule); `progress` hears every step.
pub fn analyze(
    path: &Path,
    tokens: &[u32],
    sources: &[String],
    opts: &AnalyzeOptions,
    progress: &mut dyn FnMut(Progress),
) -> Result<Analysis> {
    let t0 = Instant::now();
    opts.validate()?;
    if tokens.is_empty() {
        return Err(EngineError::config("calibration text", "no tokens").into());
    }
    let sha = model_sha256(path)?;
    let storage = native_storage(path)?;
    let (mut model, _) = crate::load::open(path, &FfnMode::Analysis)?;
    let cfg = model.config().clone();
    // The budget is checked before any calibration: predictors and one neuron must fit.
    let spec = FfnSpec::gated(cfg.hidden, cfg.intermediate, cfg.activation)?;
    let neuron_bytes = spec.neuron_bytes(storage) as u64;
    let ffn_bytes = neuron_bytes * (cfg.intermediate * cfg.layers) as u64;
    let predictor_bytes =
        predictor_bytes(cfg.hidden, cfg.intermediate, opts.train.rank) * cfg.layers as u64;
    let budget = opts.budget.unwrap_or(ffn_bytes / 2 + predictor_bytes);
    if budget < predictor_bytes + neuron_bytes {
        return Err(EngineError::from(powerinfer::ErrorKind::Budget {
            budget,
            reason: format!(
                "the predictors alone take {predictor_bytes} bytes and one neuron \
                 {neuron_bytes}; give at least {}",
                predictor_bytes + neuron_bytes
            ),
        })
        .into());
    }

    // 1. Per-layer |h| thresholds for the target sparsity, and the quantiles kept for sweeps.
    let head = &tokens[..opts.threshold_tokens.min(tokens.len())];
    let total = head.len();
    let hist = model.magnitude_stats(head, opts.ctx, &mut |done| {
        progress(Progress::Thresholds { done, total })
    })?;
    let quantile = |s: &ActivationStats, q: f64| {
        s.threshold_for_sparsity(q)
            .ok_or_else(|| EngineError::config("calibration text", "no activation recorded"))
    };
    let thresholds = hist
        .iter()
        .map(|s| quantile(s, opts.target_sparsity))
        .collect::<powerinfer::Result<Vec<f32>>>()?;
    let h_quantiles = hist
        .iter()
        .map(|s| {
            (0..=QUANTILE_STEPS)
                .map(|k| quantile(s, k as f64 / QUANTILE_STEPS as f64 * QUANTILE_MAX))
                .collect::<powerinfer::Result<Vec<f32>>>()
        })
        .collect::<powerinfer::Result<Vec<_>>>()?;

    // 2. Activation counts over all calibration tokens, and training rows.
    let rows = opts.train_rows + opts.val_rows;
    let sampling = Sampling {
        every: (tokens.len() / rows).max(1),
        max: rows,
    };
    let total = tokens.len();
    let profile = model.profile(tokens, opts.ctx, &thresholds, sampling, &mut |done| {
        progress(Progress::Profiling { done, total })
    })?;
    drop(model);

    // 3. One predictor per layer.
    let total = cfg.layers * opts.train.epochs;
    let mut trained: Vec<(Trained, usize, usize)> = Vec::with_capacity(cfg.layers);
    for (layer, samples) in profile.samples.iter().enumerate() {
        let mut train: Samples = samples.clone();
        let n_train = (train.len() * opts.train_rows / rows).max(1);
        let val = train.split_off(n_train);
        let t = train_low_rank(&train, &val, &opts.train, &mut |epoch, loss| {
            let done = layer * opts.train.epochs + epoch + 1;
            progress(Progress::Training {
                layer,
                epoch,
                loss,
                done,
                total,
            })
        })?;
        trained.push((t, train.len(), val.len()));
    }

    // 4. Placement under the budget, predictors counted first (a trained predictor's size is
    // `predictor_bytes`, checked above: `tests/train.rs`).
    let frequencies: Vec<Vec<f64>> = profile.stats.iter().map(|s| s.frequencies()).collect();
    let placement = plan_placement(
        &frequencies,
        &vec![neuron_bytes; cfg.layers],
        budget - predictor_bytes,
    )?;

    // 5. The input-sparse rule, calibrated on the threshold tokens (GGUF Q4_0/Q4_1/Q8_0 FFNs
    // and float checkpoints; other block types have no column layout).
    let input_rule = match &opts.input_rule {
        None => None,
        Some(rule) => {
            progress(Progress::InputRule);
            let mode = FfnMode::InputSparse {
                threads: opts.threads,
                attention: rule.attention > 0.0,
                up_rows: false,
                artifact: None,
                layouts: powerinfer::layout::Layouts::Columns,
            };
            match crate::load::open(path, &mode) {
                Ok((mut m, _)) => Some(m.calibrate_input_rule(head, opts.ctx, rule)?),
                Err(e) => {
                    tracing::warn!("no input-sparse rule in the artifact: {e}");
                    None
                }
            }
        }
    };

    // 6. The artifact.
    let layers_meta = trained
        .iter()
        .zip(&thresholds)
        .map(|((t, _, _), &h)| LayerMeta {
            hidden: cfg.hidden,
            intermediate: cfg.intermediate,
            activation: cfg.activation.name().into(),
            gated: true,
            h_threshold: h,
            rank: t.rank,
            score_threshold: t.threshold,
            val_recall: t.quality.recall,
            val_precision: t.quality.precision,
            val_predicted: t.quality.predicted,
            val_truth: t.quality.truth,
            val_mass: t.quality.mass,
        })
        .collect();
    let layers = trained
        .iter()
        .zip(&profile.stats)
        .zip(&placement.layers)
        .zip(h_quantiles)
        .map(|((((t, _, _), s), p), hq)| LayerTensors {
            fc1: t.fc1.iter().map(|&x| half::f16::from_f32(x)).collect(),
            fc2: t.fc2.iter().map(|&x| half::f16::from_f32(x)).collect(),
            fc2_bias: t.bias.clone(),
            hot: p.hot().to_vec(),
            counts: s
                .counts
                .iter()
                .map(|&c| c.min(u64::from(u32::MAX)) as u32)
                .collect(),
            score_quantiles: t.quantiles.clone(),
            h_quantiles: hq,
        })
        .collect();
    let (n_train, n_val) = trained.first().map_or((0, 0), |(_, a, b)| (*a, *b));
    let artifact = Artifact {
        meta: ArtifactMeta {
            model_sha256: sha,
            model_file: path
                .file_name()
                .map_or_else(String::new, |f| f.to_string_lossy().into_owned()),
            budget,
            hot_bytes: placement.used,
            predictor_bytes,
            calibration: CalibrationSummary {
                sources: sources.to_vec(),
                tokens: tokens.len() as u64,
                threshold_tokens: head.len() as u64,
                train_rows: n_train as u64,
                val_rows: n_val as u64,
                target_sparsity: opts.target_sparsity,
                target_recall: opts.train.target_recall,
                rank: opts.train.rank,
                epochs: opts.train.epochs,
                seconds: t0.elapsed().as_secs_f64(),
            },
            layers: layers_meta,
            input_rule,
        },
        layers,
    };
    Ok(Analysis {
        artifact,
        frequencies,
        neuron_bytes,
        ffn_bytes,
    })
}
