//! # powerinfer
//!
//! An independent Rust implementation of the PowerInfer technique: activation-sparse FFN inference
//! with hot/cold neuron placement, as a drop-in [`candle_core::Module`].
//!
//! For each token only the FFN neurons a [`Predictor`] selects are computed, reading only their
//! bytes from neuron-major storage ([`NeuronBundles`]). A [`LayerPlacement`] splits them between a
//! fast tier (GPU, in a later release; the CPU today) and the CPU tier; both partial outputs are
//! summed in a fixed order. The dense FFN ([`dense_reference`]) is the oracle the tests hold every
//! path to.
//!
//! ```
//! use candle_core::{Device, Module, Tensor};
//! use powerinfer::{Activation, FfnSpec, FfnWeights, GateFirst, HybridFfn, HybridOptions, WeightDType};
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let (hidden, inter) = (64, 256);
//! let dev = Device::Cpu;
//! let gate = Tensor::randn(0f32, 0.1, (inter, hidden), &dev)?;
//! let up = Tensor::randn(0f32, 0.1, (inter, hidden), &dev)?;
//! let down = Tensor::randn(0f32, 0.1, (hidden, inter), &dev)?;
//! let spec = FfnSpec::gated(hidden, inter, Activation::Relu)?;
//! let ffn = HybridFfn::from_weights(spec, FfnWeights::gated(&gate, &up, &down), WeightDType::F16,
//!     HybridOptions::default())?
//!     .with_predictor(GateFirst::new(0.0)?);
//! let x = Tensor::randn(0f32, 1.0, (1, 3, hidden), &dev)?;
//! let y = ffn.forward(&x)?;
//! assert_eq!(y.dims(), &[1, 3, hidden]);
//! # Ok(()) }
//! ```

mod activation;
mod active;
pub mod analysis;
pub mod cpu;
#[cfg(feature = "cuda")]
mod cuda;
mod error;
mod ffn;
pub mod format;
mod hybrid;
mod input_sparse;
mod linear;
mod predict;
mod tensor_io;

// The user API: the FFN blocks, their options, rules and predictors, the artifact, errors.
// Kernels, calibration and training, and file readers live in `cpu`, `analysis` and `format`.
pub use activation::Activation;
pub use active::ActiveSet;
pub use cpu::{ColumnStorage, SimdLevel, SIMD_LEVEL_ENV};
#[cfg(feature = "cuda")]
pub use cuda::{cuda_device, CudaTier, MAX_ROWS as CUDA_MAX_ROWS};
pub use error::{Error, ErrorKind, Result};
pub use ffn::{dense_reference, FfnSpec, FfnWeights, NeuronBundles, WeightDType};
pub use format::{
    model_sha256, Artifact, ArtifactMeta, AttentionRuleMeta, CalibrationSummary, InputRuleMeta,
    LayerMeta, LayerTensors, ARTIFACT_FORMAT, ARTIFACT_VERSION,
};
pub use hybrid::{
    plan_placement, CacheFill, FastTier, HybridFfn, HybridOptions, LayerPlacement, NeuronCache,
    Neurons, Placement, PrefillPolicy, ReferenceTier, Reservation, TierBudget, TierCall,
    TierCounters,
};
pub use input_sparse::{
    split_target, ChessRule, GreedyPath, GreedyStep, InputScore, InputScores, InputSparseFfn,
    InputSparseLinear, InputSparseOptions, InputThresholds, WeightTraffic, MAX_SAMPLES,
    SAMPLE_EVERY,
};
pub use linear::QLinear;
pub use predict::{
    All, GateFirst, LowRank, Oracle, PreNormLowRank, PredictInput, Predictor, RowRms,
};
