//! PowerInfer's activation-sparse FFN in mistral.rs (cargo feature `powerinfer`).
//!
//! Added by the powerinfer-rs patch set (`adapters/mistralrs/` in powerinfer-rs). This file is
//! the seam the model files call, compiled with or without the feature:
//!
//! - each pipeline loader holds a [`LoadScope`] around building a model: it reads the
//!   configuration once and checks an artifact against the model's files;
//! - each supported model file asks for a layer's MLP with one call: [`mlp`], in place of
//!   `Mlp::new`, in the safetensors models (llama, mistral, qwen2, qwen3); [`gguf_mlp`] in the
//!   GGUF ones (`quantized_llama.rs`, `quantized_qwen.rs`, `quantized_qwen3.rs`), whose private
//!   `Mlp` implements [`DenseMlp`].
//!
//! Without the feature, or with the feature and no configuration, these calls build the dense
//! MLP and nothing else; with a configuration they build the sparse FFN instead (the dense
//! constructor is not called). The configuration, the sparse FFN and the report live in
//! `powerinfer/sparse.rs`, compiled only with the feature; see its re-exports below.

use std::sync::Arc;

use candle_core::quantized::QTensor;
use candle_core::{Result, Tensor};
use mistralrs_quant::{
    Comm, GgufMatMul, QuantMethod, QuantMethodConfig, QuantizedConfig, ShardedVarBuilder,
};

use crate::amoe::MlpLayer;
use crate::layers::{Activation, Mlp};

#[cfg(feature = "powerinfer")]
mod sparse;
#[cfg(feature = "powerinfer")]
pub use sparse::{
    config, disable, enable, engine, report, reset_report, Layouts, Neurons, PowerInferConfig,
    Sparsity, SparsityReport, ENV_CONFIG, ENV_LAYOUTS, ENV_SPARSITY, ENV_THREADS,
};

/// The sparse FFN of one layer (uninhabited without the feature).
#[cfg(feature = "powerinfer")]
pub(crate) use sparse::SparseMlp;
#[cfg(not(feature = "powerinfer"))]
pub(crate) enum SparseMlp {}

#[cfg(not(feature = "powerinfer"))]
impl SparseMlp {
    fn forward(&self, _: &Tensor) -> Result<Tensor> {
        match *self {}
    }
}

/// Held by a pipeline loader while it builds one model: while it lives, [`mlp`] and
/// [`gguf_mlp`] build the sparse FFN as the configuration in force when it began says.
///
/// Loads are one at a time with the feature: layers may be built on rayon threads, so the
/// scope's plan is process-wide, and a scope begun while another lives (nested, or a second
/// load on another thread) is refused with an error rather than handed the other load's plan.
/// Dropping the scope ends it.
pub struct LoadScope(#[cfg(feature = "powerinfer")] sparse::ActiveLoad);

impl LoadScope {
    /// Begins the load of the model in `files` (one GGUF file, or a checkpoint's
    /// `*.safetensors` plus `config.json`): reads the configuration in force and, with an
    /// artifact, loads it and checks that it was made from these files.
    pub fn begin(files: &[std::path::PathBuf]) -> Result<LoadScope> {
        #[cfg(feature = "powerinfer")]
        return sparse::ActiveLoad::begin(files).map(LoadScope);
        #[cfg(not(feature = "powerinfer"))]
        {
            let _ = files;
            Ok(LoadScope())
        }
    }
}

/// Layer `layer`'s MLP in a safetensors model: `Mlp::new`'s arguments, and what it builds
/// unless a [`LoadScope`] with a configuration lives; then the sparse FFN, from the MLP's
/// `gate_proj`, `up_proj` and `down_proj` in `vb` (pre-quantized checkpoints are refused).
pub(crate) fn mlp(
    layer: usize,
    vb: ShardedVarBuilder,
    hidden_size: usize,
    intermediate_size: usize,
    quantization_config: &Option<QuantizedConfig>,
    hidden_act: Activation,
    comm: &Arc<Comm>,
) -> Result<Box<dyn MlpLayer>> {
    #[cfg(feature = "powerinfer")]
    if let Some(plan) = sparse::current_plan() {
        return Ok(Box::new(sparse::safetensors(
            &plan,
            layer,
            &vb,
            hidden_size,
            intermediate_size,
            hidden_act,
            quantization_config.is_some(),
        )?));
    }
    let _ = layer;
    Ok(Box::new(Mlp::new(
        vb,
        hidden_size,
        intermediate_size,
        quantization_config,
        hidden_act,
        comm,
    )?))
}

/// A layer's MLP in a GGUF model: the file's own dense `Mlp`, or the sparse FFN.
pub(crate) enum Ffn<D> {
    Dense(D),
    Sparse(SparseMlp),
}

/// A GGUF model file's dense `Mlp`, as [`Ffn`] builds and calls it.
pub(crate) trait DenseMlp: Sized {
    /// The MLP over the matmuls of its `[ffn_gate, ffn_up, ffn_down]` tensors.
    fn new(weights: [Arc<dyn QuantMethod>; 3]) -> Self;
    fn forward(&self, xs: &Tensor) -> Result<Tensor>;
}

impl<D: DenseMlp> Ffn<D> {
    /// The file's dense MLP over its `[ffn_gate, ffn_up, ffn_down]` tensors.
    pub(crate) fn dense(weights: [QTensor; 3]) -> Result<Self> {
        let matmul = |q_weight: QTensor| -> Result<Arc<dyn QuantMethod>> {
            let q_weight = Arc::new(q_weight);
            Ok(Arc::new(GgufMatMul::new(QuantMethodConfig::Gguf {
                q_weight,
                b: None,
            })?))
        };
        let [gate, up, down] = weights;
        Ok(Self::Dense(D::new([
            matmul(gate)?,
            matmul(up)?,
            matmul(down)?,
        ])))
    }

    pub(crate) fn forward(&self, xs: &Tensor) -> Result<Tensor> {
        match self {
            Self::Dense(mlp) => mlp.forward(xs),
            Self::Sparse(mlp) => mlp.forward(xs),
        }
    }
}

/// Layer `layer`'s MLP in a GGUF model from its `[ffn_gate, ffn_up, ffn_down]` tensors (SiLU
/// gated): the sparse FFN while a [`LoadScope`] with a configuration lives, built from the
/// tensors' blocks, else [`Ffn::dense`].
pub(crate) fn gguf_mlp<D: DenseMlp>(layer: usize, weights: [QTensor; 3]) -> Result<Ffn<D>> {
    #[cfg(feature = "powerinfer")]
    if let Some(plan) = sparse::current_plan() {
        let [gate, up, down] = &weights;
        return sparse::gguf(&plan, layer, gate, up, down).map(Ffn::Sparse);
    }
    let _ = layer;
    Ffn::dense(weights)
}
