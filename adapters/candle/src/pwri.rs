//! PowerInfer's own files in the llama model: `PWRI`-magic GGUF models (ReLU FFN, down stored
//! transposed as `blk.N.ffn_down_t.weight`, predictors `blk.N.fc1` / `blk.N.fc2`) and `.gpuidx`
//! placements. The file formats are read by the engine (`powerinfer::format::PowerInferFile`,
//! `powerinfer::format::read_gpuidx`); this module wires them into a loaded [`Llama`].

use std::fs::File;
use std::path::Path;

use candle_core::quantized::{gguf_file, GgmlDType, QTensor};
use candle_core::{DType, Device, Tensor, D};
use powerinfer::format::{GgufMagic, PowerInferFile};
use powerinfer::{tier::LayerPlacement, Activation, HybridFfn};

use crate::config::LlamaConfig;
use crate::error::{check_count, Error, Result};
use crate::gguf::GgufFile;
use crate::model::{Ffn, Llama};

/// Reads a GGUF header whose magic is `GGUF` or `PWRI`; file-level problems (magic, truncation,
/// malformed header) are this crate's `Format` error naming the file.
pub(crate) fn read_header(file: &mut File, path: &Path) -> Result<(GgufMagic, gguf_file::Content)> {
    powerinfer::format::read_gguf(file, &path.display().to_string()).map_err(|e| {
        match e.file_problem() {
            Some(problem) => Error::format(path, problem),
            None => e.into(),
        }
    })
}

/// PowerInfer runs every `PWRI` llama file with a ReLU FFN (`LLM_FFN_RELU` in its
/// `llm_build_ffn_sparse` call); the file has no activation key.
pub(crate) fn adjust_config(gguf: &GgufFile, cfg: &mut LlamaConfig) {
    if gguf.magic == GgufMagic::PowerInfer {
        cfg.activation = Activation::Relu;
    }
}

/// Serves `blk.N.ffn_down.weight` from `blk.N.ffn_down_t.weight` (PowerInfer stores down
/// transposed, `[intermediate, hidden]`) when only the latter is in the file: transposed back to
/// `[hidden, intermediate]`, in f16 if stored f16, else f32 (exact for every source type).
pub(crate) fn down_from_transposed(gguf: &mut GgufFile, name: &str) -> Result<Option<QTensor>> {
    let Some(prefix) = name.strip_suffix(".ffn_down.weight") else {
        return Ok(None);
    };
    let t_name = format!("{prefix}.ffn_down_t.weight");
    if gguf.content.tensor_infos.contains_key(name)
        || !gguf.content.tensor_infos.contains_key(&t_name)
    {
        return Ok(None);
    }
    let q = gguf.tensor(&t_name)?;
    if q.shape().dims().len() != 2 {
        return Err(powerinfer::Error::from(powerinfer::ErrorKind::Shape {
            tensor: t_name,
            expected: vec![None, None],
            got: q.shape().dims().to_vec(),
        })
        .into());
    }
    let keep = if q.dtype() == GgmlDType::F16 {
        GgmlDType::F16
    } else {
        GgmlDType::F32
    };
    let down = q.dequantize(&Device::Cpu)?.t()?.contiguous()?;
    Ok(Some(QTensor::quantize(&down, keep)?))
}

/// `sqrt(mean(x^2) + eps)` of each row of the pre-norm input `x`, for a PowerInfer predictor.
pub(crate) fn row_rms(x: &Tensor, eps: f32) -> Result<Vec<f32>> {
    Ok(x.to_dtype(DType::F32)?
        .sqr()?
        .mean_keepdim(D::Minus1)?
        .affine(1.0, eps as f64)?
        .sqrt()?
        .flatten_all()?
        .to_vec1::<f32>()?)
}

/// The hybrid FFN on the normed input `h` (`[.., hidden]`) with its rows' pre-norm RMS.
pub(crate) fn forward_with_row_rms(ffn: &HybridFfn, h: &Tensor, row_rms: &[f32]) -> Result<Tensor> {
    let x = h.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
    let mut out = vec![0f32; x.len()];
    ffn.forward_f32_with_row_rms(&x, row_rms.len(), row_rms, &mut out)?;
    Ok(Tensor::from_vec(out, h.dims(), h.device())?.to_dtype(h.dtype())?)
}

fn config_error(setting: &str, reason: String) -> Error {
    powerinfer::Error::from(powerinfer::ErrorKind::Config {
        setting: setting.into(),
        reason,
    })
    .into()
}

impl Llama {
    /// Installs PowerInfer's per-layer predictors from `file` (usually the same `PWRI` file the
    /// model was loaded from) into every layer's hybrid FFN, with the file's
    /// `powerinfer.sparse_threshold` (0 when absent).
    ///
    /// PowerInfer feeds its llama predictors the residual stream before the FFN norm; each layer
    /// gets a `powerinfer::predict::PreNormLowRank` built with that layer's norm weight, and for a
    /// non-zero threshold the model hands it each row's pre-norm RMS on every forward call, so
    /// the active set is PowerInfer's rule `fc2 relu(fc1 u) >= threshold`, exactly.
    ///
    /// Every layer must be hybrid (`FfnMode::Hybrid`), and the file must have as many layers.
    pub fn use_powerinfer_predictors(&mut self, file: &mut PowerInferFile) -> Result<()> {
        let n = file.layers()?;
        check_count(
            "layers in the PowerInfer predictor file",
            self.layers.len(),
            n,
        )?;
        for (l, layer) in self.layers.iter_mut().enumerate() {
            let Ffn::Hybrid(h) = &mut layer.ffn else {
                return Err(config_error(
                    "ffn",
                    format!("layer {l} has a dense FFN; load the model with FfnMode::Hybrid"),
                ));
            };
            // At a non-zero threshold the predictor asks for each row's pre-norm RMS, which
            // both decoders pass in the call (`HybridFfn::needs_row_rms`).
            h.set_predictor(file.pre_norm_predictor(l, &layer.ffn_norm.w)?);
        }
        Ok(())
    }

    /// Applies one placement per layer (e.g. from `powerinfer::format::read_gpuidx`) to the hybrid FFNs.
    /// Placement decides where a neuron is computed, never whether: outputs do not change.
    pub fn apply_placements(&mut self, placements: Vec<LayerPlacement>) -> Result<()> {
        check_count(
            "placements (one per layer)",
            self.layers.len(),
            placements.len(),
        )?;
        for (l, (layer, p)) in self.layers.iter_mut().zip(placements).enumerate() {
            let Ffn::Hybrid(h) = &mut layer.ffn else {
                return Err(config_error(
                    "ffn",
                    format!("layer {l} has a dense FFN; load the model with FfnMode::Hybrid"),
                ));
            };
            h.set_placement(p)?;
        }
        Ok(())
    }
}
