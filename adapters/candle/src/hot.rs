//! A VRAM budget for the default sparse mode: per layer, which FFN neurons live on a device
//! ([`powerinfer::tier::HotNeurons`]) while the CPU computes the rest with the input rule, and
//! the layer split it is measured against, at the same bytes.

use std::path::Path;

use candle_core::Device;
use powerinfer::layout::Layout;
use powerinfer::tier::{hot_count, hot_neurons};
use powerinfer::{FfnSpec, InputScore, InputScores, InputSparseFfn, InputThresholds};

use crate::error::{check_count, ErrorKind, Result};
use crate::gguf::GgufFile;
use crate::model::{Ffn, Llama};
use crate::tiers::TierKind;

/// How [`Llama::place_hot`] spends a budget of device bytes on the FFN layers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HotPlacement {
    /// PowerInfer's hybrid: every layer gets an equal share of the budget and holds the neurons
    /// with the largest calibrated `|h|` that fit it (the whole layer when it fits); the CPU
    /// computes the cold neurons of every layer with the input rule.
    Hybrid,
    /// The split users run today (llama.cpp's `-ngl`, mistral.rs's device map): whole layers'
    /// FFNs on the device from the first layer on, as many as fit, and the others on the CPU.
    LayerSplit,
}

impl std::fmt::Display for HotPlacement {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            HotPlacement::Hybrid => "hybrid",
            HotPlacement::LayerSplit => "layer split",
        })
    }
}

/// What [`Llama::place_hot`] put on the device.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct HotReport {
    /// Per layer, the neurons on the device.
    pub neurons: Vec<usize>,
    /// Device bytes they take, all layers.
    pub bytes: u64,
    /// The FFN weights' bytes in the file, all layers: what a budget is a share of.
    pub ffn_bytes: u64,
}

impl HotReport {
    /// The share of all layers' neurons on the device.
    pub fn neuron_share(&self, intermediate: usize) -> f64 {
        let total = (self.neurons.len() * intermediate).max(1);
        self.neurons.iter().sum::<usize>() as f64 / total as f64
    }
}

/// The device a tier kind names: the CPU for the reference tier (the hot part computed on the
/// calling thread, before the CPU's part: a check of the split, not a speed-up).
pub fn hot_device(kind: TierKind) -> Result<Device> {
    Ok(match kind {
        TierKind::Reference { .. } => Device::Cpu,
        TierKind::Cuda { ordinal } => Device::new_cuda(ordinal)?,
    })
}

/// Bytes of a GGUF tensor's data.
fn data_bytes(gguf: &GgufFile, name: &str) -> Result<u64> {
    let info = gguf
        .content
        .tensor_infos
        .get(name)
        .ok_or_else(|| ErrorKind::MissingTensor { name: name.into() })?;
    let d = info.ggml_dtype;
    Ok((info.shape.elem_count() / d.block_size() * d.type_size()) as u64)
}

/// Bytes of the FFN weights (gate, up and down of every layer) in the GGUF file at `path`:
/// what a share of a VRAM budget is a share of.
pub fn ffn_file_bytes(path: &Path) -> Result<u64> {
    let gguf = GgufFile::open(path)?;
    let mut total = 0;
    for (name, _) in gguf.content.tensor_infos.iter() {
        if ["ffn_gate.weight", "ffn_up.weight", "ffn_down.weight"]
            .iter()
            .any(|m| name.starts_with("blk.") && name.ends_with(m))
        {
            total += data_bytes(&gguf, name)?;
        }
    }
    Ok(total)
}

impl Llama {
    /// Puts FFN neurons of this input-sparse model (loaded from `path` with
    /// `FfnMode::InputSparse`) on `device` within `budget` bytes, as `placement` says; `scores`
    /// (one per layer, from [`Llama::record_input_scores`]) rank the neurons for
    /// [`HotPlacement::Hybrid`] (record them before [`Llama::run_rows_dense`]). Each changed
    /// layer is read again from the file and rebuilt with
    /// [`InputSparseFfn::from_qtensors_split`], keeping its threads, layouts and rule (a layer
    /// running the dense FFN keeps dense rows for its cold gate and up rows); a layer with no
    /// neuron on the device is left as it is. Call it once, on a freshly loaded model.
    pub fn place_hot(
        &mut self,
        path: &Path,
        scores: &[InputScores],
        budget: u64,
        placement: HotPlacement,
        device: &Device,
    ) -> Result<HotReport> {
        let layers = self.layers.len();
        if placement == HotPlacement::Hybrid {
            check_count("input scores", layers, scores.len())?;
        }
        let mut gguf = GgufFile::open(path)?;
        let cfg = &self.config;
        let (h, n) = (cfg.hidden, cfg.intermediate);
        let spec = FfnSpec::gated(h, n, cfg.activation)?;
        let mut report = HotReport::default();
        let mut left = budget;
        for l in 0..layers {
            let name = |m: &str| format!("blk.{l}.{m}.weight");
            let [g, u, d] = ["ffn_gate", "ffn_up", "ffn_down"].map(name);
            let file = data_bytes(&gguf, &g)? + data_bytes(&gguf, &u)? + data_bytes(&gguf, &d)?;
            report.ffn_bytes += file;
            let count = match placement {
                HotPlacement::LayerSplit if left >= file => n,
                HotPlacement::LayerSplit => 0,
                HotPlacement::Hybrid => {
                    let share = budget / layers as u64;
                    let row = (data_bytes(&gguf, &u)? / n as u64) as usize;
                    hot_count(share, n, h, row, file as usize)
                }
            };
            report.neurons.push(count);
            if count == 0 {
                continue;
            }
            // The CPU part keeps the layer's threads, layouts and rule; a layer that runs the
            // dense FFN (`Llama::run_rows_dense`) keeps its dense rows for gate and up.
            let (threads, simd, layouts, score, thresholds) = match &self.layers[l].ffn {
                Ffn::InputSparse(f) => (
                    f.threads(),
                    Some(f.simd_level()),
                    f.layouts(),
                    f.score(),
                    f.thresholds(),
                ),
                Ffn::Kernels(k) => (
                    k.gate_up.pool().threads(),
                    None,
                    [Layout::Rows; 3],
                    InputScore::default(),
                    InputThresholds::default(),
                ),
                _ => {
                    let why = "hot neurons need a model loaded with FfnMode::InputSparse";
                    return Err(powerinfer::Error::config("vram budget", why).into());
                }
            };
            let ids: Vec<u32> = match placement {
                HotPlacement::LayerSplit => (0..n as u32).collect(),
                HotPlacement::Hybrid => {
                    check_count("h_abs", n, scores[l].h_abs.len())?;
                    hot_neurons(&scores[l].h_abs, count)
                }
            };
            let (gate, up, down) = (gguf.tensor(&g)?, gguf.tensor(&u)?, gguf.tensor(&d)?);
            let mut f = InputSparseFfn::from_qtensors_split(
                spec,
                Some(&gate),
                &up,
                &down,
                threads,
                simd,
                layouts,
                &ids,
                device,
            )?;
            f.set_rule(score, thresholds)?;
            let bytes = f.hot().map_or(0, |t| t.bytes()) as u64;
            report.bytes += bytes;
            left = left.saturating_sub(bytes);
            self.layers[l].ffn = Ffn::InputSparse(Box::new(f));
        }
        Ok(report)
    }
}
