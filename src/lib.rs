//! # powerinfer
//!
//! An independent Rust implementation of activation-sparse FFN inference after PowerInfer: FFN
//! blocks that compute only what matters for each token and read only its bytes, as drop-in
//! [`candle_core::Module`]s on CPU tensors.
//!
//! - [`InputSparseFfn`] is the default sparse mode, for SiLU models (Llama 3, Qwen, Mistral,
//!   SmolLM): training-free input sparsity (TEAL, WINA). The entries of the FFN input (and of
//!   `h` for down) whose score is under a calibrated threshold are dropped, so the weight
//!   columns they multiply are never read. It takes a candle MLP's float weights
//!   ([`InputSparseFfn::load`], [`InputSparseFfn::from_weights`]) or a GGUF file's blocks, kept
//!   exactly ([`InputSparseFfn::from_qtensors`]); its thresholds come from calibration text
//!   ([`InputSparseFfn::record_scores`], [`InputScores::thresholds`],
//!   [`InputSparseFfn::set_rule`]). The [`LayoutPlanner`](layout::LayoutPlanner) stores a GGUF
//!   matrix by column only where a timed column product beats the dense rows at the rule's kept
//!   fraction; elsewhere it stays as the dense decoder's packed rows.
//! - The fused decoder (in the `powerinfer-candle` crate) runs a whole llama-family GGUF model
//!   on this crate's packed products ([`QLinear`](layers::QLinear)) and one thread pool, with
//!   the dense FFN or this one. It is the baseline every sparse mode is measured against: on
//!   the four models measured so far, at quality-safe targets, every matrix stays as rows and
//!   the default sparse mode runs the dense decoder's own FFN: it is not faster yet.
//! - [`HybridFfn`] is the neuron-major FFN for ReLU models: only the neurons a [`Predictor`]
//!   (such as [`GateFirst`]) selects are computed, reading only their bytes from
//!   [`NeuronBundles`]. A [`LayerPlacement`](tier::LayerPlacement) splits them between a fast
//!   tier ([`FastTier`](tier::FastTier); a GPU with the `cuda` feature) and the CPU tier; both
//!   partial outputs are summed in a fixed order. The example below builds one.
//!
//! The dense FFN ([`dense_reference`]) is the oracle the tests hold every path to.
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

// One candle, under its own name whichever release it is: with `candle-0-10` the 0.10 crates
// (renamed in Cargo.toml) take the names `candle_core` and `candle_nn` for every path below.
#[cfg(all(feature = "candle-0-10", feature = "candle-0-11"))]
compile_error!(
    "powerinfer: features `candle-0-10` and `candle-0-11` exclude each other; \
     for candle 0.10 use `default-features = false, features = [\"candle-0-10\"]`"
);
#[cfg(not(any(feature = "candle-0-10", feature = "candle-0-11")))]
compile_error!("powerinfer: enable `candle-0-11` (the default) or `candle-0-10`");
#[cfg(all(feature = "candle-0-10", not(feature = "candle-0-11")))]
extern crate candle_core_0_10 as candle_core;
#[cfg(all(feature = "candle-0-10", not(feature = "candle-0-11")))]
extern crate candle_nn_0_10 as candle_nn;

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
pub mod predict;
mod tensor_io;

// The user API at the root (25 names): the FFN blocks and their options, what runs
// (`Sparsity`), the input rule, the predictors, the artifact, errors. The rest lives in modules:
// `predict` (every predictor and its input), `tier` (the fast tier's seam and plumbing),
// `layers` (the fused decoder's linear layers), `input_rule` (calibrating the input rule),
// `analysis` (profiling, training), `format` (files) and `cpu` (kernels, unstable).
pub use activation::Activation;
pub use error::{Error, ErrorKind, Result};
pub use ffn::{dense_reference, FfnSpec, FfnWeights, NeuronBundles, WeightDType};
pub use format::Artifact;
pub use hybrid::{HybridFfn, HybridOptions, Neurons, PrefillPolicy, Sparsity};
pub use input_sparse::{
    InputScore, InputScores, InputSparseFfn, InputSparseOptions, InputThresholds, WeightTraffic,
};
pub use predict::{All, GateFirst, LowRank, Predictor};

/// The fast tier: the seam a GPU (or any other) tier plugs in behind
/// ([`FastTier`](tier::FastTier)), the placement that says which neurons it holds, the byte
/// budget and the cache bookkeeping every tier shares, and the two tiers:
/// [`ReferenceTier`](tier::ReferenceTier) on CPU threads of its own and, with the `cuda`
/// feature, `CudaTier`. For the input-sparse FFN: [`HotNeurons`](tier::HotNeurons), the hot
/// neurons on any candle device
/// ([`InputSparseFfn::from_qtensors_split`](crate::InputSparseFfn::from_qtensors_split)), and
/// the helpers that choose them ([`hot_neurons`](tier::hot_neurons),
/// [`hot_count`](tier::hot_count)).
pub mod tier {
    #[cfg(feature = "cuda")]
    pub use crate::cuda::{cuda_device, CudaTier, MAX_ROWS as CUDA_MAX_ROWS};
    pub use crate::hybrid::{
        plan_placement, CacheFill, FastTier, LayerPlacement, NeuronCache, Placement, ReferenceTier,
        Reservation, TierBudget, TierCall, TierCounters,
    };
    pub use crate::input_sparse::{
        hot_count, hot_neuron_bytes, hot_neurons, HotNeurons, HOT_GROUP,
    };
}

/// The linear layers around the FFN that the candle adapter's fused decoder runs on the
/// engine's kernels: [`QLinear`](layers::QLinear) (dense, on GGUF blocks) and
/// [`InputSparseLinear`](layers::InputSparseLinear) (the input rule on one projection).
pub mod layers {
    pub use crate::input_sparse::InputSparseLinear;
    pub use crate::linear::QLinear;
}

/// How the input-sparse FFN stores each GGUF matrix: by column where a measured column product
/// beats the dense rows at the fraction of inputs the rule keeps, as the dense decoder's packed
/// rows elsewhere ([`LayoutPlanner`](layout::LayoutPlanner)), so a sparse mode is never slower
/// than dense.
pub mod layout {
    pub use crate::input_sparse::{
        FfnMatrix, Layout, LayoutDecision, LayoutPlanner, Layouts, MARGIN, REPEATS,
    };
}

/// Calibrating the input-sparse rule: the target split
/// ([`split_target`](input_rule::split_target)), TEAL's greedy allocation
/// ([`GreedyPath`](input_rule::GreedyPath)), the CHESS rule, and how often calibration samples a
/// row.
pub mod input_rule {
    pub use crate::input_sparse::{
        split_target, ChessRule, GreedyPath, GreedyStep, MAX_SAMPLES, SAMPLE_EVERY,
    };
}
