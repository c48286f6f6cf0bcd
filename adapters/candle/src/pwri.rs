//! PowerInfer's own files in a loaded [`Llama`]: the predictors of a `PWRI`-magic GGUF model
//! (`blk.N.fc1` / `blk.N.fc2`) and `.gpuidx` placements. The file formats are read by the engine
//! (`powerinfer::format::PowerInferFile`, `powerinfer::format::read_gpuidx`); the `PWRI` header
//! and its transposed down (`blk.N.ffn_down_t.weight`) by [`crate::GgufFile`].

use powerinfer::format::PowerInferFile;
use powerinfer::tier::LayerPlacement;

use crate::error::{check_count, Error, Result};
use crate::model::{Ffn, Llama};

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
