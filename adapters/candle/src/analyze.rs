//! Offline analysis on a loaded model: per-layer `|h|` thresholds, activation counts and
//! (FFN input, active mask) training rows from calibration text, and installing a `.powerinfer`
//! artifact (trained predictors and placement) into a hybrid model.

use std::path::Path;

use candle_core::Tensor;
use powerinfer::analysis::{ActivationStats, PredictorAudit, Samples};
use powerinfer::Artifact;

use crate::error::{check_count, Error, ErrorKind, Result};
use crate::model::{Ffn, FfnProbe, Llama};

/// What [`Llama::profile`] gathers: per layer, activation counts at the layer's threshold and
/// captured training rows.
#[derive(Debug, Clone)]
pub struct Profile {
    /// Per-layer counts of `|h| > threshold`.
    pub stats: Vec<ActivationStats>,
    /// Per-layer captured rows (inputs and active masks).
    pub samples: Vec<Samples>,
}

/// Which calibration rows to keep as training samples: every `every`-th token, at most `max`.
#[derive(Debug, Clone, Copy)]
pub struct Sampling {
    /// Keep one token in this many (>= 1).
    pub every: usize,
    /// Stop capturing after this many rows per layer.
    pub max: usize,
}

struct HistogramProbe {
    stats: Vec<ActivationStats>,
}

impl FfnProbe for HistogramProbe {
    fn observe(&mut self, layer: usize, _x: &Tensor, h: &Tensor) -> Result<()> {
        let rows = h.dim(0)?;
        let h = h.flatten_all()?.to_vec1::<f32>()?;
        self.stats[layer].record_rows(&h, rows);
        Ok(())
    }
}

struct ProfileProbe {
    profile: Profile,
    sampling: Sampling,
    /// Tokens of earlier windows (the sampling clock).
    offset: usize,
}

impl FfnProbe for ProfileProbe {
    fn observe(&mut self, layer: usize, x: &Tensor, h: &Tensor) -> Result<()> {
        let rows = h.dim(0)?;
        let hv = h.flatten_all()?.to_vec1::<f32>()?;
        self.profile.stats[layer].record_rows(&hv, rows);
        let samples = &mut self.profile.samples[layer];
        let (hidden, n) = samples.dims();
        let every = self.sampling.every.max(1);
        let first = (every - self.offset % every) % every;
        if first < rows && samples.len() < self.sampling.max {
            let xv = x.flatten_all()?.to_vec1::<f32>()?;
            for r in (first..rows).step_by(every) {
                if samples.len() >= self.sampling.max {
                    break;
                }
                samples.push(&xv[r * hidden..(r + 1) * hidden], &hv[r * n..(r + 1) * n])?;
            }
        }
        Ok(())
    }
}

impl Llama {
    /// Per-layer `|h|` histograms of the (token, neuron) activations of `tokens`, computed with
    /// dense FFNs (load with [`crate::FfnMode::Analysis`]): read thresholds for a target sparsity
    /// with [`ActivationStats::threshold_for_sparsity`]. `progress(tokens_done)` after every
    /// window of `chunk`.
    pub fn magnitude_stats(
        &mut self,
        tokens: &[u32],
        chunk: usize,
        progress: &mut dyn FnMut(usize),
    ) -> Result<Vec<ActivationStats>> {
        let n = self.config.intermediate;
        let mut probe = HistogramProbe {
            stats: (0..self.config.layers)
                .map(|_| ActivationStats::with_magnitudes(n, 0.0))
                .collect(),
        };
        let chunk = chunk.max(1);
        for (k, w) in tokens.chunks(chunk).enumerate() {
            self.probe_ffn(w, chunk, &mut probe)?;
            progress((k * chunk + w.len()).min(tokens.len()));
        }
        Ok(probe.stats)
    }

    /// Runs `tokens` through the dense model counting, per layer and neuron, the tokens with
    /// `|h| > thresholds[layer]`, and capturing training rows as `sampling` says.
    pub fn profile(
        &mut self,
        tokens: &[u32],
        chunk: usize,
        thresholds: &[f32],
        sampling: Sampling,
        progress: &mut dyn FnMut(usize),
    ) -> Result<Profile> {
        let (layers, n, hidden) = (
            self.config.layers,
            self.config.intermediate,
            self.config.hidden,
        );
        check_count("thresholds (one per layer)", layers, thresholds.len())?;
        let mut probe = ProfileProbe {
            profile: Profile {
                stats: thresholds
                    .iter()
                    .map(|&t| ActivationStats::new(n, t))
                    .collect(),
                samples: thresholds
                    .iter()
                    .map(|&t| Samples::new(hidden, n, t))
                    .collect(),
            },
            sampling,
            offset: 0,
        };
        let chunk = chunk.max(1);
        for w in tokens.chunks(chunk) {
            self.probe_ffn(w, chunk, &mut probe)?;
            probe.offset += w.len();
            progress(probe.offset);
        }
        Ok(probe.profile)
    }

    /// Installs an artifact's predictors and placement in every hybrid layer. `sparsity`, when
    /// given, replaces each layer's score threshold by the one reaching that sparsity on the
    /// validation rows (for sweeps); otherwise the stored (target-recall) threshold is used.
    pub fn use_artifact(&mut self, a: &Artifact, sparsity: Option<f64>) -> Result<()> {
        let hybrids = self.hybrids()?;
        check_count("artifact layers", hybrids.len(), a.layers.len())?;
        for (l, h) in hybrids.into_iter().enumerate() {
            a.install(l, h, sparsity)?;
        }
        Ok(())
    }

    /// Starts auditing every hybrid layer's predictor against `|h| > thresholds[layer]`.
    pub fn enable_audit(&mut self, thresholds: &[f32]) -> Result<()> {
        let hybrids = self.hybrids()?;
        check_count(
            "thresholds (one per layer)",
            hybrids.len(),
            thresholds.len(),
        )?;
        for (h, &t) in hybrids.into_iter().zip(thresholds) {
            h.enable_audit(t);
        }
        Ok(())
    }

    /// Per-layer audit totals since [`Llama::enable_audit`] (`None` for dense layers).
    pub fn take_audit(&mut self) -> Vec<Option<PredictorAudit>> {
        self.layers
            .iter()
            .map(|l| match &l.ffn {
                Ffn::Hybrid(h) => h.take_audit(),
                Ffn::Dense(_) | Ffn::Kernels(_) | Ffn::InputSparse(_) => None,
            })
            .collect()
    }
}

/// Reads the `.powerinfer` artifact at `artifact` and checks it was made from the model at
/// `model` (its [`model_sha256`]); another model's artifact is `ArtifactMismatch`.
pub fn load_artifact(artifact: &Path, model: &Path) -> Result<Artifact> {
    let a = Artifact::load(artifact)?;
    a.check_model(&model_sha256(model)?)?;
    Ok(a)
}

/// sha256 (hex) identifying a model: the file's hash, or for a safetensors directory the hash of
/// `config.json` and every `*.safetensors` file's hash, in name order.
pub fn model_sha256(path: &Path) -> Result<String> {
    if !path.is_dir() {
        return Ok(powerinfer::format::file_sha256(path)?);
    }
    let files: Vec<_> = std::fs::read_dir(path)
        .map_err(|e| Error::io(path, e))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            p.extension().is_some_and(|x| x == "safetensors")
                || p.file_name().is_some_and(|n| n == "config.json")
        })
        .collect();
    Ok(powerinfer::format::model_sha256(&files)?)
}

/// The storage the hybrid FFN uses for a model by default (`FfnMode::Hybrid { storage: None }`):
/// a GGUF file's up block type (Q4_0, Q4_1; every other type is stored as Q8_0), f16 for
/// safetensors. This is what a neuron costs in the placement budget.
pub fn native_storage(path: &Path) -> Result<powerinfer::WeightDType> {
    use candle_core::quantized::GgmlDType;
    use powerinfer::WeightDType;
    if path.is_dir() {
        return Ok(WeightDType::F16);
    }
    let g = crate::gguf::GgufFile::open(path)?;
    let name = "blk.0.ffn_up.weight";
    let info = g
        .content
        .tensor_infos
        .get(name)
        .ok_or_else(|| Error::from(ErrorKind::MissingTensor { name: name.into() }))?;
    Ok(match info.ggml_dtype {
        GgmlDType::Q4_0 => WeightDType::Q4_0,
        GgmlDType::Q4_1 => WeightDType::Q4_1,
        _ => WeightDType::Q8_0,
    })
}
