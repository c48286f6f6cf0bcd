//! The `.powerinfer` artifact: everything `powerinfer analyze` learned about one model file.
//!
//! One safetensors file. Tensors, per layer `N`:
//! - `blk.N.fc1.weight` f16 `[rank, hidden]`, `blk.N.fc2.weight` f16 `[intermediate, rank]`,
//!   `blk.N.fc2.bias` f32 `[intermediate]`: the low-rank predictor;
//! - `blk.N.hot` u8 `[intermediate]`: 1 for neurons placed in the fast tier (PowerInfer's
//!   `gpu_idx`);
//! - `blk.N.counts` u32 `[intermediate]`: calibration tokens on which the neuron was active;
//! - `blk.N.score_quantiles` f32 `[QUANTILE_STEPS + 1]`: predictor score thresholds for a sweep of
//!   sparsities (validation rows);
//! - `blk.N.h_quantiles` f32 `[QUANTILE_STEPS + 1]`: `|h|` thresholds for the same sparsities
//!   (calibration histogram), for exact thresholding with `GateFirst`.
//!
//! Metadata (`__metadata__`): `format` = `powerinfer`, `format_version`, and `meta`, the JSON of
//! [`ArtifactMeta`]: the source model's sha256 and file name, per-layer spec and thresholds,
//! budget, and a calibration summary. [`Artifact::load`] checks all of it, and
//! [`Artifact::check_model`] refuses an artifact made for another model file.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use half::f16;
use safetensors::tensor::{Dtype, TensorView};
use serde::{Deserialize, Serialize};

use crate::analysis::QUANTILE_STEPS;
use crate::analysis::{Trained, QUANTILE_MAX};
use crate::error::{Error, ErrorKind, Result};
use crate::ffn::FfnSpec;
use crate::hybrid::HybridFfn;
use crate::hybrid::LayerPlacement;
use crate::input_sparse::{InputScore, InputThresholds};
use crate::predict::LowRank;

/// Format name stored in the metadata.
pub const ARTIFACT_FORMAT: &str = "powerinfer";
/// Version this build writes. Version 2 added the input-sparse rule (`meta.input_rule`);
/// version 1 files still load (without one).
pub const ARTIFACT_VERSION: u32 = 2;

/// The input-sparse rule calibrated for the model: what `InputSparseFfn` runs in each layer.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct InputRuleMeta {
    /// The score (`teal` or `wina`, see [`InputScore::name`]).
    pub score: String,
    /// Target share of the FFN weight bytes skipped the thresholds were chosen for.
    pub target: f64,
    /// Fractions of the gate, up and down entries dropped in each layer (their mean over layers
    /// when `layer_allocations` is not empty).
    pub allocation: [f64; 3],
    /// Per-layer fractions when they differ between layers (the greedy split); empty otherwise.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub layer_allocations: Vec<[f64; 3]>,
    /// Calibration tokens the score histograms came from.
    pub tokens: u64,
    /// Per layer.
    pub thresholds: Vec<InputThresholds>,
    /// Input sparsity on the attention projections too, when the rule has it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attention: Option<AttentionRuleMeta>,
}

/// TEAL's `|x|` rule on the attention projections: what `InputSparseLinear` runs on the q/k/v
/// input and on the o input of each layer.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AttentionRuleMeta {
    /// Fraction of each input's calibration entries dropped.
    pub fraction: f64,
    /// `[q/k/v input, o input]` per layer.
    pub thresholds: Vec<[f32; 2]>,
}

impl InputRuleMeta {
    /// The score as a type.
    pub fn input_score(&self) -> Result<InputScore> {
        InputScore::from_name(&self.score)
    }
}

/// What the calibration run was.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
pub struct CalibrationSummary {
    /// Calibration text (file names or a description).
    pub sources: Vec<String>,
    /// Tokens profiled for activation counts.
    pub tokens: u64,
    /// Tokens whose `|h|` histogram chose the per-layer thresholds.
    pub threshold_tokens: u64,
    /// Training rows per layer.
    pub train_rows: u64,
    /// Validation rows per layer.
    pub val_rows: u64,
    /// FFN sparsity the `|h|` thresholds were chosen for.
    pub target_sparsity: f64,
    /// Recall the score thresholds were chosen for.
    pub target_recall: f64,
    /// Predictor rank.
    pub rank: usize,
    /// Training epochs.
    pub epochs: usize,
    /// Wall time of the whole analysis, seconds.
    pub seconds: f64,
}

/// Per-layer scalars.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LayerMeta {
    /// Model size.
    pub hidden: usize,
    /// FFN neurons.
    pub intermediate: usize,
    /// Activation name (`relu`, `drelu`, `silu`, `gelu`, `gelu_tanh`).
    pub activation: String,
    /// Gated FFN (`down(act(gate x) * up x)`).
    pub gated: bool,
    /// A neuron counts as active when `|h| > h_threshold` (0 for ReLU: exact nonzero).
    pub h_threshold: f32,
    /// Predictor rank.
    pub rank: usize,
    /// Predictor score threshold (active when `score >= score_threshold`).
    pub score_threshold: f32,
    /// Validation recall at `score_threshold`.
    pub val_recall: f64,
    /// Validation precision at `score_threshold`.
    pub val_precision: f64,
    /// Validation share of pairs predicted active.
    pub val_predicted: f64,
    /// Validation share of pairs truly active.
    pub val_truth: f64,
    /// Validation share of the activation mass `sum |h|` the predicted pairs carry.
    #[serde(default)]
    pub val_mass: f64,
}

/// The metadata of an artifact (stored as JSON).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ArtifactMeta {
    /// sha256 (hex) of the model file the artifact was made from.
    pub model_sha256: String,
    /// Its file name, for messages.
    pub model_file: String,
    /// Fast-tier byte budget the placement was planned under.
    pub budget: u64,
    /// Bytes of the hot neurons.
    pub hot_bytes: u64,
    /// Bytes of all predictors (counted against the budget).
    pub predictor_bytes: u64,
    /// The calibration run.
    pub calibration: CalibrationSummary,
    /// One entry per layer.
    pub layers: Vec<LayerMeta>,
    /// The input-sparse rule (format version 2; `None` in version 1 files).
    #[serde(default)]
    pub input_rule: Option<InputRuleMeta>,
}

/// Per-layer tensors.
#[derive(Debug, Clone, PartialEq)]
pub struct LayerTensors {
    /// `[rank, hidden]`.
    pub fc1: Vec<f16>,
    /// `[intermediate, rank]`.
    pub fc2: Vec<f16>,
    /// `[intermediate]`.
    pub fc2_bias: Vec<f32>,
    /// Hot neurons, ascending.
    pub hot: Vec<u32>,
    /// Active-token counts per neuron.
    pub counts: Vec<u32>,
    /// Score thresholds for sparsity `k / QUANTILE_STEPS * QUANTILE_MAX`.
    pub score_quantiles: Vec<f32>,
    /// `|h|` thresholds for the same sparsities (exact thresholding, `GateFirst`).
    pub h_quantiles: Vec<f32>,
}

/// A `.powerinfer` file in memory.
#[derive(Debug, Clone, PartialEq)]
pub struct Artifact {
    /// Scalars and provenance.
    pub meta: ArtifactMeta,
    /// One entry per layer, same order as `meta.layers`.
    pub layers: Vec<LayerTensors>,
}

fn bad(path: &Path, reason: impl Into<String>) -> Error {
    ErrorKind::Artifact {
        path: path.to_path_buf(),
        reason: reason.into(),
    }
    .into()
}

fn bytes_of<T: Copy>(v: &[T], to: impl Fn(T) -> Vec<u8>) -> Vec<u8> {
    v.iter().flat_map(|&x| to(x)).collect()
}

impl Artifact {
    /// Writes the artifact to `path` (checked first, so a bad artifact is never written).
    pub fn save(&self, path: &Path) -> Result<()> {
        self.check(path)?;
        let mut bufs: Vec<(String, Dtype, Vec<usize>, Vec<u8>)> = Vec::new();
        for (l, (m, t)) in self.meta.layers.iter().zip(&self.layers).enumerate() {
            let mut hot = vec![0u8; m.intermediate];
            for &i in &t.hot {
                hot[i as usize] = 1;
            }
            let f16b = |v: &[f16]| bytes_of(v, |x| x.to_le_bytes().to_vec());
            let f32b = |v: &[f32]| bytes_of(v, |x| x.to_le_bytes().to_vec());
            bufs.push((
                format!("blk.{l}.fc1.weight"),
                Dtype::F16,
                vec![m.rank, m.hidden],
                f16b(&t.fc1),
            ));
            bufs.push((
                format!("blk.{l}.fc2.weight"),
                Dtype::F16,
                vec![m.intermediate, m.rank],
                f16b(&t.fc2),
            ));
            bufs.push((
                format!("blk.{l}.fc2.bias"),
                Dtype::F32,
                vec![m.intermediate],
                f32b(&t.fc2_bias),
            ));
            bufs.push((format!("blk.{l}.hot"), Dtype::U8, vec![m.intermediate], hot));
            bufs.push((
                format!("blk.{l}.counts"),
                Dtype::U32,
                vec![m.intermediate],
                bytes_of(&t.counts, |x| x.to_le_bytes().to_vec()),
            ));
            for (name, v) in [
                ("score_quantiles", &t.score_quantiles),
                ("h_quantiles", &t.h_quantiles),
            ] {
                bufs.push((
                    format!("blk.{l}.{name}"),
                    Dtype::F32,
                    vec![v.len()],
                    f32b(v),
                ));
            }
        }
        let views = bufs
            .iter()
            .map(|(n, d, s, b)| {
                TensorView::new(*d, s.clone(), b)
                    .map(|v| (n.clone(), v))
                    .map_err(|e| bad(path, format!("tensor `{n}`: {e}")))
            })
            .collect::<Result<Vec<_>>>()?;
        let json =
            serde_json::to_string(&self.meta).map_err(|e| bad(path, format!("metadata: {e}")))?;
        let info = HashMap::from([
            ("format".to_string(), ARTIFACT_FORMAT.to_string()),
            ("format_version".to_string(), ARTIFACT_VERSION.to_string()),
            ("meta".to_string(), json),
        ]);
        let bytes = safetensors::serialize(views, Some(info))
            .map_err(|e| bad(path, format!("serializing: {e}")))?;
        std::fs::write(path, bytes).map_err(|e| Error::io(path, "writing", e))
    }

    /// Reads and checks an artifact: format, version, every tensor's presence, dtype and shape,
    /// finite values, neuron indices.
    pub fn load(path: &Path) -> Result<Self> {
        let bytes = std::fs::read(path).map_err(|e| Error::io(path, "reading", e))?;
        let st = safetensors::SafeTensors::deserialize(&bytes)
            .map_err(|e| bad(path, format!("not a valid safetensors file ({e})")))?;
        let (_, header) = safetensors::SafeTensors::read_metadata(&bytes)
            .map_err(|e| bad(path, format!("header: {e}")))?;
        let info = header
            .metadata()
            .as_ref()
            .ok_or_else(|| bad(path, "no metadata: not a .powerinfer artifact"))?;
        if info.get("format").map(String::as_str) != Some(ARTIFACT_FORMAT) {
            return Err(bad(
                path,
                format!(
                    "format is {:?}, expected \"{ARTIFACT_FORMAT}\"",
                    info.get("format")
                ),
            ));
        }
        let version = info.get("format_version").map(String::as_str);
        if !matches!(version, Some("1" | "2")) {
            return Err(bad(
                path,
                format!("format_version {version:?}; this build reads versions 1 and 2"),
            ));
        }
        let meta: ArtifactMeta = serde_json::from_str(
            info.get("meta")
                .ok_or_else(|| bad(path, "metadata has no `meta` entry"))?,
        )
        .map_err(|e| bad(path, format!("metadata `meta`: {e}")))?;
        let mut layers = Vec::with_capacity(meta.layers.len());
        for (l, m) in meta.layers.iter().enumerate() {
            let get = |name: &str, dtype: Dtype, shape: &[usize]| -> Result<Vec<u8>> {
                let full = format!("blk.{l}.{name}");
                let t = st
                    .tensor(&full)
                    .map_err(|_| bad(path, format!("missing tensor `{full}`")))?;
                if t.dtype() != dtype || t.shape() != shape {
                    return Err(bad(
                        path,
                        format!(
                            "tensor `{full}` is {:?} {:?}, expected {dtype:?} {shape:?}",
                            t.dtype(),
                            t.shape()
                        ),
                    ));
                }
                Ok(t.data().to_vec())
            };
            let f16s = |b: Vec<u8>| -> Vec<f16> {
                b.chunks_exact(2)
                    .map(|c| f16::from_le_bytes([c[0], c[1]]))
                    .collect()
            };
            let f32s = |b: Vec<u8>| -> Vec<f32> {
                b.chunks_exact(4)
                    .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                    .collect()
            };
            let n = m.intermediate;
            let hot = get("hot", Dtype::U8, &[n])?;
            if let Some(i) = hot.iter().position(|&b| b > 1) {
                return Err(bad(
                    path,
                    format!(
                        "tensor `blk.{l}.hot` holds {} at {i}, expected 0 or 1",
                        hot[i]
                    ),
                ));
            }
            layers.push(LayerTensors {
                fc1: f16s(get("fc1.weight", Dtype::F16, &[m.rank, m.hidden])?),
                fc2: f16s(get("fc2.weight", Dtype::F16, &[n, m.rank])?),
                fc2_bias: f32s(get("fc2.bias", Dtype::F32, &[n])?),
                hot: (0..n as u32).filter(|&i| hot[i as usize] == 1).collect(),
                counts: get("counts", Dtype::U32, &[n])?
                    .chunks_exact(4)
                    .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                    .collect(),
                score_quantiles: f32s(get("score_quantiles", Dtype::F32, &[QUANTILE_STEPS + 1])?),
                h_quantiles: f32s(get("h_quantiles", Dtype::F32, &[QUANTILE_STEPS + 1])?),
            });
        }
        let a = Artifact { meta, layers };
        a.check(path)?;
        Ok(a)
    }

    /// Consistency of metadata and tensors (sizes, finite values, indices, budget).
    fn check(&self, path: &Path) -> Result<()> {
        let m = &self.meta;
        if m.layers.len() != self.layers.len() {
            return Err(bad(
                path,
                format!(
                    "{} layers in metadata, {} in tensors",
                    m.layers.len(),
                    self.layers.len()
                ),
            ));
        }
        for (l, (lm, t)) in m.layers.iter().zip(&self.layers).enumerate() {
            let at = |what: &str| format!("layer {l}: {what}");
            self.spec(l).map_err(|e| bad(path, at(&e.to_string())))?;
            if lm.rank == 0 {
                return Err(bad(path, at("predictor rank 0")));
            }
            let sizes = [
                ("fc1", t.fc1.len(), lm.rank * lm.hidden),
                ("fc2", t.fc2.len(), lm.intermediate * lm.rank),
                ("fc2 bias", t.fc2_bias.len(), lm.intermediate),
                ("counts", t.counts.len(), lm.intermediate),
                (
                    "score quantiles",
                    t.score_quantiles.len(),
                    QUANTILE_STEPS + 1,
                ),
                ("h quantiles", t.h_quantiles.len(), QUANTILE_STEPS + 1),
            ];
            for (name, got, want) in sizes {
                if got != want {
                    return Err(bad(
                        path,
                        at(&format!("{name} has {got} values, expected {want}")),
                    ));
                }
            }
            let finite = t.fc1.iter().chain(&t.fc2).all(|x| x.is_finite())
                && t.fc2_bias
                    .iter()
                    .chain(&t.score_quantiles)
                    .chain(&t.h_quantiles)
                    .all(|x| x.is_finite())
                && lm.h_threshold.is_finite()
                && lm.score_threshold.is_finite();
            if !finite {
                return Err(bad(
                    path,
                    at("a NaN or infinity in the predictor or thresholds"),
                ));
            }
            LayerPlacement::new(lm.intermediate, t.hot.clone(), Some(l))
                .map_err(|e| bad(path, e.to_string()))?;
        }
        if let Some(r) = &m.input_rule {
            r.input_score().map_err(|e| bad(path, e.to_string()))?;
            if r.thresholds.len() != m.layers.len() {
                return Err(bad(
                    path,
                    format!(
                        "input rule has {} layers of thresholds, the model {}",
                        r.thresholds.len(),
                        m.layers.len()
                    ),
                ));
            }
            let ok = |v: f32| v.is_finite() && v >= 0.0;
            if let Some(l) = r
                .thresholds
                .iter()
                .position(|t| !(ok(t.gate) && ok(t.up) && ok(t.down)))
            {
                return Err(bad(
                    path,
                    format!("input rule, layer {l}: thresholds must be finite and at least 0"),
                ));
            }
            if let Some(a) = &r.attention {
                if a.thresholds.len() != m.layers.len() {
                    return Err(bad(
                        path,
                        format!(
                            "attention rule has {} layers of thresholds, the model {}",
                            a.thresholds.len(),
                            m.layers.len()
                        ),
                    ));
                }
                if let Some(l) = a.thresholds.iter().position(|t| !(ok(t[0]) && ok(t[1]))) {
                    return Err(bad(
                        path,
                        format!(
                            "attention rule, layer {l}: thresholds must be finite and at least 0"
                        ),
                    ));
                }
            }
        }
        if m.hot_bytes + m.predictor_bytes > m.budget {
            return Err(bad(
                path,
                format!(
                    "hot neurons ({} bytes) and predictors ({} bytes) exceed the budget of {}",
                    m.hot_bytes, m.predictor_bytes, m.budget
                ),
            ));
        }
        Ok(())
    }

    /// Refuses the artifact unless it was made from the model file whose sha256 is `sha256`.
    pub fn check_model(&self, sha256: &str) -> Result<()> {
        if self.meta.model_sha256.eq_ignore_ascii_case(sha256) {
            Ok(())
        } else {
            Err(ErrorKind::ArtifactMismatch {
                artifact_model: format!(
                    "{} (sha256 {})",
                    self.meta.model_file, self.meta.model_sha256
                ),
                model_sha256: sha256.to_string(),
            }
            .into())
        }
    }

    /// Layer `l`'s FFN spec as recorded.
    pub fn spec(&self, l: usize) -> Result<FfnSpec> {
        let (m, _) = self.layer(l)?;
        FfnSpec::new(m.hidden, m.intermediate, m.activation.parse()?, m.gated)
    }

    /// Layer `l`'s predictor at its stored score threshold (or `threshold` when given).
    pub fn predictor(&self, l: usize, threshold: Option<f32>) -> Result<LowRank> {
        let (m, t) = self.layer(l)?;
        let dev = candle_core::Device::Cpu;
        let fc1 = candle_core::Tensor::from_slice(&t.fc1, (m.rank, m.hidden), &dev)?;
        let fc2 = candle_core::Tensor::from_slice(&t.fc2, (m.intermediate, m.rank), &dev)?;
        let b = candle_core::Tensor::from_slice(&t.fc2_bias, m.intermediate, &dev)?;
        LowRank::new(&fc1, &fc2, threshold.unwrap_or(m.score_threshold))?.with_bias(&b)
    }

    /// Layer `l`'s placement.
    pub fn placement(&self, l: usize) -> Result<LayerPlacement> {
        let (m, t) = self.layer(l)?;
        LayerPlacement::new(m.intermediate, t.hot.clone(), Some(l))
    }

    /// Layer `l`'s metadata and tensors, or a typed error past the last layer.
    fn layer(&self, l: usize) -> Result<(&LayerMeta, &LayerTensors)> {
        match (self.meta.layers.get(l), self.layers.get(l)) {
            (Some(m), Some(t)) => Ok((m, t)),
            _ => Err(Error::config(
                "artifact layer",
                format!(
                    "layer {l} is past the artifact's {} layers",
                    self.layers.len()
                ),
            )),
        }
    }

    /// Installs layer `l`'s predictor and placement in `ffn`, after checking that the layer was
    /// analyzed with `ffn`'s spec. With `sparsity`, the predictor's score threshold is the one
    /// the validation quantiles give for that FFN sparsity instead of the stored target-recall
    /// threshold.
    pub fn install(&self, l: usize, ffn: &mut HybridFfn, sparsity: Option<f64>) -> Result<()> {
        let spec = self.spec(l)?;
        if spec != *ffn.spec() {
            return Err(Error::config(
                "artifact",
                format!(
                    "layer {l} was analyzed as {spec:?}, the model has {:?}",
                    ffn.spec()
                ),
            ));
        }
        let threshold = match sparsity {
            None => None,
            Some(s) => Some(
                Trained::threshold_for_sparsity(&self.layer(l)?.1.score_quantiles, s).ok_or_else(
                    || {
                        Error::config(
                            "sparsity",
                            format!("{s} is outside the artifact's sweep [0, {QUANTILE_MAX}]"),
                        )
                    },
                )?,
            ),
        };
        ffn.set_predictor(self.predictor(l, threshold)?);
        ffn.set_placement(self.placement(l)?)
    }
}

/// The sha256 of a file's bytes, as lowercase hex (streamed; the file is not held in memory).
pub fn file_sha256(path: &Path) -> Result<String> {
    use sha2::{Digest, Sha256};
    let mut f = std::fs::File::open(path).map_err(|e| Error::io(path, "open", e))?;
    let mut h = Sha256::new();
    std::io::copy(&mut f, &mut h).map_err(|e| Error::io(path, "reading", e))?;
    Ok(hex(&h.finalize()))
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// The fingerprint [`Artifact::check_model`] compares: the [`file_sha256`] of a single model
/// file; for several files (a checkpoint's `*.safetensors` and `config.json`), the sha256 of
/// their hex sums concatenated in path order.
pub fn model_sha256(files: &[PathBuf]) -> Result<String> {
    use sha2::{Digest, Sha256};
    match files {
        [] => Err(Error::config("model file", "no file to fingerprint")),
        [one] => file_sha256(one),
        many => {
            let mut sorted = many.to_vec();
            sorted.sort();
            let mut all = String::new();
            for f in &sorted {
                all.push_str(&file_sha256(f)?);
            }
            Ok(hex(&Sha256::digest(all.as_bytes())))
        }
    }
}
