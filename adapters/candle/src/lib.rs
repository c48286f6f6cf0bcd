//! # powerinfer-candle
//!
//! Llama-family models written against candle 0.11 (llama, mistral, qwen2 and gemma3 GGUF files;
//! llama, mistral and qwen2 safetensors directories) with powerinfer's FFNs. [`open`] loads a
//! model and its tokenizer ([`TextTokenizer`], from GGUF metadata or `tokenizer.json`);
//! [`generate()`] samples with candle-transformers' sampler.
//!
//! - **The fused decoder.** [`FfnMode::Fused`] (the dense FFN) and the input-sparse mode run
//!   every step of a layer and the LM head on powerinfer's packed products and one thread pool,
//!   on GGUF files whose projections, FFN and LM head are Q4_0, Q4_1, Q8_0, Q5_0, Q5_1, Q4_K,
//!   Q5_K or Q6_K (another block type is a typed error naming the tensor). [`FfnMode::Dense`]
//!   is the reference model on candle's ops; [`Llama::is_fused`] says which path a model is on.
//! - **The default sparse mode**, `powerinfer::InputSparseFfn` on that decoder:
//!   [`FfnMode::sparse`] with [`Sparsity::Input`], then [`Llama::calibrate_input_rule`] and
//!   [`Llama::apply_input_rule`] (or an artifact's rule), then [`Llama::run_rows_dense`], so
//!   that layers where no matrix pays by column run the dense decoder's FFN. On the models
//!   measured so far that is every layer: the mode is not faster than dense yet.
//! - **`powerinfer::HybridFfn`**, the neuron-major FFN with predictors and placement (for ReLU
//!   models), optionally with hot neurons on a fast tier ([`Llama::attach_tiers`]). The example
//!   below runs it with exact `|h|` thresholding ([`FfnMode::gate_first`]).
//!
//! ```no_run
//! use powerinfer_candle::{open, FfnMode, GenerateOptions, generate};
//! # fn main() -> powerinfer_candle::Result<()> {
//! let (mut model, tok) = open("SmolLM2-135M-Instruct.Q4_1.gguf".as_ref(), &FfnMode::gate_first(0.01))?;
//! let ids = tok.encode("The state of the union is")?;
//! let out = generate(&mut model, &ids, &GenerateOptions { eos: tok.eos.clone(), ..Default::default() }, |_| Ok(()))?;
//! println!("{}", tok.decode(&out.tokens)?);
//! # Ok(()) }
//! ```

mod analyze;
mod config;
mod error;
mod eval;
mod generate;
mod gguf;
mod hot;
mod input_rule;
mod load;
mod model;
mod pipeline;
mod pwri;
mod synthetic;
mod tiers;
mod tokenizer;

/// The README's and the `docs/` guides' Rust snippets, compiled by `cargo test --doc` (and run
/// where they need no model file), so the documented API cannot drift from the code.
#[cfg(doctest)]
pub mod doc_snippets {
    #[doc = include_str!("../../../README.md")]
    pub struct Readme;
    #[doc = include_str!("../../../docs/usage.md")]
    pub struct Usage;
    #[doc = include_str!("../../../docs/predictors.md")]
    pub struct Predictors;
    #[doc = include_str!("../../../docs/candle.md")]
    pub struct Candle;
    #[doc = include_str!("../../../docs/fast-tier.md")]
    pub struct FastTier;
    #[doc = include_str!("../../../docs/mistralrs.md")]
    pub struct MistralRs;
    #[doc = include_str!("../../../docs/powerinfer-files.md")]
    pub struct PowerInferFiles;
    #[doc = include_str!("../../../docs/sparse-modes.md")]
    pub struct SparseModes;
    #[doc = include_str!("../../../docs/models.md")]
    pub struct Models;
}

pub use analyze::{load_artifact, model_sha256, native_storage, Profile, Sampling};
pub use config::{activation_from_name, LlamaConfig};
pub use error::{Error, ErrorKind, Result};
pub use eval::Perplexity;
pub use generate::{generate, GenerateOptions, Generation};
pub use gguf::GgufFile;
pub use hot::{ffn_file_bytes, hot_device, HotPlacement, HotReport};
pub use input_rule::{InputRuleOptions, TargetSearch, TargetTrial};
pub use load::{load_gguf, load_safetensors, open, read_config, FfnMode, Support};
pub use model::{DecodeBytes, DenseFfn, Ffn, FfnProbe, KernelFfn, Llama, Timings};
pub use pipeline::{analyze, Analysis, AnalyzeOptions, Progress};
pub use powerinfer::layout::Layouts;
pub use powerinfer::{Neurons, Sparsity};
pub use synthetic::{FfnProfile, LayerProfile, SyntheticLlama, PROFILE_POINTS};
pub use tiers::{TierKind, TierOptions, TierReport};
pub use tokenizer::TextTokenizer;
