//! Validated settings and the steps the commands share: fetching, loading, calibrating.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{bail, Context, Result};
use indicatif::{ProgressBar, ProgressStyle};
use powerinfer::{Artifact, HybridOptions, WeightDType};
use powerinfer_candle::{
    generate, load_artifact, open, FfnMode, GenerateOptions, Generation, Llama, Neurons, Support,
    TextTokenizer,
};

use powerinfer_data as fetch;

use crate::{ModelArgs, SparseMode};

/// The sparse mode, checked.
#[derive(Debug, Clone)]
pub struct SparseSettings {
    /// Which sparse FFN runs (`bench`: `Auto`, its rows say which).
    pub mode: SparseMode,
    /// Storage of the neuron-major weights (`None`: as the file stores them).
    pub storage: Option<WeightDType>,
    /// The sparsity the mode aims at (`--target`; `None`: the mode's own choice).
    pub target: Option<f64>,
    /// A fixed `|h|` threshold for every layer (gate-first).
    pub threshold: Option<f32>,
    /// Calibration tokens.
    pub calibration_tokens: usize,
    /// Threads of the sparse FFN.
    pub threads: usize,
    /// Attention projections through powerinfer's `QLinear` in the sparse mode.
    pub powerinfer_linears: bool,
    /// A `.powerinfer` artifact: the input rule, `|h|` thresholds, trained predictors and
    /// placement it holds.
    pub artifact: Option<PathBuf>,
    /// Fraction of the attention projections' input entries the input rule drops (0: dense).
    pub attention_sparsity: f64,
}

/// The FFN sparsity gate-first's thresholds are calibrated for under `--target auto`.
const GATE_FIRST_AUTO: f64 = 0.5;

impl SparseSettings {
    /// Checks the raw flags for `bench`, whose rows name their modes.
    pub fn from_args(a: &ModelArgs) -> Result<Self> {
        Self::for_mode(a, SparseMode::Auto)
    }

    /// Checks the raw flags for `mode` (`demo`, `generate --sparse`, `eval`): a flag that sets
    /// another mode's value, or a mode without what it needs, is refused by name.
    pub fn for_mode(a: &ModelArgs, mode: SparseMode) -> Result<Self> {
        let storage = a.storage.0;
        if let Some(t) = a.threshold {
            if !t.is_finite() || t < 0.0 {
                bail!("--threshold {t}: expected a finite value >= 0");
            }
            if matches!(mode, SparseMode::Input | SparseMode::Predictors) {
                bail!(
                    "--threshold sets exact |h| thresholding's threshold, not {}'s: use \
                     --sparse=gate-first",
                    mode.name()
                );
            }
        }
        if a.calibration_tokens < 2 {
            bail!("--calibration-tokens must be at least 2");
        }
        if mode == SparseMode::Predictors && a.powerinfer.is_none() {
            bail!("--sparse=predictors needs --powerinfer ARTIFACT");
        }
        let quantiles = powerinfer::analysis::QUANTILE_MAX;
        match a.target.0 {
            Some(t) if mode == SparseMode::Predictors && t > quantiles => {
                bail!("--target {t}: the artifact's quantiles reach {quantiles} for the predictors")
            }
            _ => {}
        }
        if let Some(p) = &a.powerinfer {
            if !p.is_file() {
                bail!("--powerinfer {}: no such file", p.display());
            }
        }
        let threads = match a.threads {
            Some(0) => bail!("--threads must be at least 1"),
            Some(t) => t,
            None => HybridOptions::default().threads,
        };
        Ok(SparseSettings {
            mode,
            storage,
            target: a.target.0,
            threshold: a.threshold,
            calibration_tokens: a.calibration_tokens,
            threads,
            powerinfer_linears: !a.candle_linears,
            artifact: a.powerinfer.clone(),
            attention_sparsity: a.attention_sparsity,
        })
    }

    /// The FFN sparsity gate-first's per-layer thresholds are calibrated for.
    pub fn gate_first_sparsity(&self) -> f64 {
        self.target.unwrap_or(GATE_FIRST_AUTO)
    }

    /// The loader's FFN mode for the neuron-major modes (`all`, `gate-first`, `predictors`; the
    /// thresholds and predictors are set after loading).
    pub fn hybrid_ffn_mode(&self) -> FfnMode {
        FfnMode::Hybrid {
            storage: self.storage,
            predictor: Neurons::All,
            options: HybridOptions {
                threads: self.threads,
                ..Default::default()
            },
            powerinfer_linears: self.powerinfer_linears,
        }
    }
}

pub(crate) fn spinner(msg: impl Into<String>) -> ProgressBar {
    let pb = ProgressBar::new_spinner();
    pb.set_style(
        ProgressStyle::with_template("{spinner} {msg} [{elapsed}]")
            .unwrap_or_else(|_| ProgressStyle::default_spinner()),
    );
    pb.set_message(msg.into());
    pb.enable_steady_tick(Duration::from_millis(120));
    pb
}

/// The model file named by `--model` (a path, or a model name `powerinfer-data` fetches into
/// the cache), or SmolLM2 fetched into the cache.
pub(crate) fn model_path(model: &Option<PathBuf>) -> Result<PathBuf> {
    let which = match model {
        Some(p) if p.exists() => return Ok(p.clone()),
        Some(p) => match p.to_str().map(str::parse::<fetch::Model>) {
            Some(Ok(m)) => m,
            _ => bail!(
                "--model {}: no such file or directory, nor a model name ({})",
                p.display(),
                fetch::Model::ALL.map(|m| m.name()).join(", ")
            ),
        },
        None => fetch::Model::SmolLM2,
    };
    let pb = spinner(which.file_name());
    let p = fetch::model(which, &mut |m| pb.set_message(m.to_string()))?;
    pb.finish_and_clear();
    Ok(p)
}

/// How perplexity is scored.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) enum Scoring {
    /// Every token of each window after its first (`Llama::perplexity`).
    #[default]
    Windows,
    /// llama.cpp's `llama-perplexity` rule (`Llama::perplexity_llama_cpp`): the second half of
    /// each window, its first token replaced by `bos` when the vocabulary adds one.
    LlamaCpp {
        /// The vocabulary's BOS, when it adds one.
        bos: Option<u32>,
    },
}

impl Scoring {
    /// llama.cpp's rule for `tok`'s vocabulary.
    pub(crate) fn llama_cpp(tok: &TextTokenizer) -> Self {
        Scoring::LlamaCpp {
            bos: tok.bos.filter(|_| tok.add_bos),
        }
    }

    /// Perplexity of `text` in windows of `ctx` tokens.
    pub(crate) fn perplexity(self, model: &mut Llama, text: &[u32], ctx: usize) -> Result<f64> {
        Ok(match self {
            Scoring::Windows => model.perplexity(text, ctx)?,
            Scoring::LlamaCpp { bos } => {
                model.perplexity_llama_cpp(text, ctx, usize::MAX, bos)?.ppl
            }
        })
    }
}

/// A loaded model and its tokenizer.
pub struct Loaded {
    /// The model.
    pub model: Llama,
    /// Its tokenizer.
    pub tok: TextTokenizer,
}

/// Loads `path` with `mode`, showing progress.
pub fn load(path: &Path, mode: &FfnMode) -> Result<Loaded> {
    let what = match mode {
        FfnMode::Hybrid { .. } => "sparse",
        _ => "dense",
    };
    let pb = spinner(format!("loading {} ({what} FFN)", path.display()));
    // The file's name once: an error about the file itself names it already.
    let (model, tok) = open(path, mode).map_err(|e| match e.path() == Some(path) {
        true => anyhow::Error::new(e),
        false => anyhow::Error::new(e).context(format!("loading {}", path.display())),
    })?;
    pb.finish_and_clear();
    tracing::info!(config = ?model.config(), "loaded {what} model");
    Ok(Loaded { model, tok })
}

/// The dense model users generate with: our fused decoder when the file runs on it (a GGUF file
/// whose projections are all of a block type the kernels take; Gemma 3 runs nowhere else),
/// candle's reference model otherwise (safetensors directories), decided from the file's header.
pub fn load_dense(path: &Path, threads: usize) -> Result<Loaded> {
    match Support::of(path)?.fused {
        None => load(path, &FfnMode::Fused { threads }),
        Some(why) => {
            tracing::info!("not on the fused decoder ({why}); candle's reference model instead");
            load(path, &FfnMode::Dense)
        }
    }
}

/// The dense model perplexity is measured against: candle's reference model, or for a file
/// candle's ops do not run (Gemma 3) our fused decoder, decided from the file's header.
pub(crate) fn load_reference(path: &Path, threads: usize) -> Result<Loaded> {
    match Support::of(path)?.candle {
        None => load(path, &FfnMode::Dense),
        Some(why) => {
            tracing::info!("not on candle's ops ({why}); our fused decoder instead");
            load(path, &FfnMode::Fused { threads })
        }
    }
}

/// Up to `n` tokens of State of the Union speeches from `years`, latest first.
pub(crate) fn corpus_tokens(
    tok: &TextTokenizer,
    years: std::ops::RangeInclusive<u32>,
    n: usize,
) -> Result<Vec<u32>> {
    Ok(text_tokens(tok, &[], years, n)?.0)
}

/// Up to `n` tokens of the given text files in order, or of State of the Union speeches from
/// `years` (latest first) when none are given, with the names of the sources used.
pub(crate) fn text_tokens(
    tok: &TextTokenizer,
    files: &[PathBuf],
    years: std::ops::RangeInclusive<u32>,
    n: usize,
) -> Result<(Vec<u32>, Vec<String>)> {
    let files = if files.is_empty() {
        let pb = spinner("State of the Union corpus");
        let dir = fetch::sotu(&mut |m| pb.set_message(m.to_string()))?;
        pb.finish_and_clear();
        let mut f = fetch::speeches(&dir, years.clone())?;
        f.reverse();
        f
    } else {
        files.to_vec()
    };
    let (mut out, mut used) = (Vec::with_capacity(n), Vec::new());
    for f in &files {
        if out.len() >= n {
            break;
        }
        let text =
            std::fs::read_to_string(f).with_context(|| format!("reading {}", f.display()))?;
        out.extend(tok.encode(&text)?);
        used.push(
            f.file_name()
                .map_or_else(|| f.display().to_string(), |s| s.to_string_lossy().into()),
        );
    }
    out.truncate(n);
    if out.len() < 2 {
        bail!("the text ({}) has fewer than 2 tokens", used.join(", "));
    }
    Ok((out, used))
}

/// Python standard library modules in the calibration mix (held out from it: `argparse.py` and
/// every other module, which `eval --text` can score).
const PYTHON_CALIBRATION: [&str; 6] = [
    "textwrap.py",
    "shutil.py",
    "tarfile.py",
    "dataclasses.py",
    "functools.py",
    "inspect.py",
];

/// The input rule's calibration text: three kinds (speeches up to 1999, latest first; *Moby-Dick*
/// from chapter 1; Python standard library source), about `n / 3` tokens of each for the
/// histograms, and of each kind about `held` tokens after those, which the histograms never
/// see, for choosing the target. Each part is whole windows of `ctx` tokens, each window
/// starting with BOS where the vocabulary adds one (as a prompt does: Gemma 3's activations
/// without it are nothing like a real run's).
pub(crate) struct CalibrationMix {
    /// The histograms' tokens, kind after kind.
    pub tokens: Vec<u32>,
    /// Per kind: its name and its held-out tokens.
    pub held: Vec<(&'static str, Vec<u32>)>,
}

impl CalibrationMix {
    /// Fetches (or reads from the cache) and tokenizes the three kinds. Python source is read
    /// from the newest `/usr/lib/python3.*` on this machine; where there is none the mix is two
    /// kinds, with a warning.
    pub(crate) fn load(tok: &TextTokenizer, n: usize, held: usize, ctx: usize) -> Result<Self> {
        if ctx < 2 {
            bail!("calibration windows of {ctx} tokens: need at least 2");
        }
        let pb = spinner("calibration text");
        let speeches = {
            let dir = fetch::sotu(&mut |m| pb.set_message(m.to_string()))?;
            let mut f = fetch::speeches(&dir, 1790..=1999)?;
            f.reverse();
            f
        };
        let moby = {
            let dir = fetch::moby_dick(&mut |m| pb.set_message(m.to_string()))?;
            let mut f: Vec<PathBuf> = std::fs::read_dir(&dir)
                .with_context(|| format!("reading {}", dir.display()))?
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.extension().is_some_and(|x| x == "txt"))
                .collect();
            f.sort();
            f
        };
        pb.finish_and_clear();
        let mut kinds = vec![("speeches", speeches), ("prose", moby)];
        match python_stdlib() {
            Some(dir) => kinds.push((
                "python",
                PYTHON_CALIBRATION.iter().map(|f| dir.join(f)).collect(),
            )),
            None => eprintln!(
                "warning: no Python standard library in /usr/lib/python3.*: calibrating on \
                 speeches and prose only"
            ),
        }
        let bos = tok.bos.filter(|_| tok.add_bos);
        let body = ctx - usize::from(bos.is_some());
        let windows = |tokens: usize| tokens.div_ceil(ctx).max(1);
        let (each, held) = (
            windows(n.div_ceil(kinds.len())),
            windows(held) * usize::from(held > 0),
        );
        let mut mix = CalibrationMix {
            tokens: Vec::new(),
            held: Vec::new(),
        };
        for (kind, files) in kinds {
            let files: Vec<PathBuf> = files.into_iter().filter(|f| f.is_file()).collect();
            if files.is_empty() {
                bail!("no {kind} calibration text found");
            }
            let need = (each + held) * body;
            let (text, _) = text_tokens(tok, &files, 0..=0, need)?;
            if text.len() < need {
                bail!(
                    "the {kind} calibration text has {} tokens, fewer than {need}",
                    text.len()
                );
            }
            let mut w: Vec<u32> = text
                .chunks(body)
                .flat_map(|c| bos.into_iter().chain(c.iter().copied()))
                .collect();
            mix.held.push((kind, w.split_off(each * ctx)));
            mix.tokens.extend(w);
        }
        Ok(mix)
    }
}

/// The newest `/usr/lib/python3.N` holding the calibration modules.
fn python_stdlib() -> Option<PathBuf> {
    let mut dirs: Vec<(u32, PathBuf)> = std::fs::read_dir("/usr/lib")
        .ok()?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter_map(|p| {
            let minor = p
                .file_name()?
                .to_str()?
                .strip_prefix("python3.")?
                .parse()
                .ok()?;
            PYTHON_CALIBRATION
                .iter()
                .all(|f| p.join(f).is_file())
                .then_some((minor, p))
        })
        .collect();
    dirs.sort();
    dirs.pop().map(|(_, p)| p)
}

/// The sparse model: exact thresholding (`GateFirst`) at per-layer `|h|` thresholds, and with an
/// artifact also its trained predictors ([`SparseMode::Predictors`]).
pub(crate) struct Sparse {
    /// Model and tokenizer.
    pub m: Loaded,
    /// Per-layer `|h|` thresholds (calibrated, fixed, or the artifact's).
    pub thresholds: Vec<f32>,
    /// The artifact, checked against the model file.
    pub artifact: Option<Artifact>,
    /// What the model runs now, for labels.
    pub label: String,
}

impl Sparse {
    /// Exact thresholding at `thresholds` (or at the artifact's `|h|` quantile for `sparsity`).
    pub fn use_exact(&mut self, sparsity: Option<f64>) -> Result<()> {
        let t = match (sparsity, &self.artifact) {
            (None, _) => self.thresholds.clone(),
            (Some(s), Some(a)) => a
                .layers
                .iter()
                .map(|l| {
                    powerinfer::analysis::Trained::threshold_for_sparsity(&l.h_quantiles, s)
                        .with_context(|| format!("sparsity {s} outside the artifact's sweep"))
                })
                .collect::<Result<_>>()?,
            (Some(_), None) => bail!("a sparsity sweep needs --powerinfer ARTIFACT"),
        };
        self.m.model.set_gate_first(&t)?;
        self.label = match sparsity {
            Some(s) => format!("exact |h| thresholds for {:.0}%", s * 100.0),
            None => "exact |h| thresholds".into(),
        };
        Ok(())
    }

    /// The artifact's trained predictors (score thresholds for `sparsity`, or the stored ones).
    pub fn use_trained(&mut self, sparsity: Option<f64>) -> Result<()> {
        let a = self
            .artifact
            .as_ref()
            .context("trained predictors need --powerinfer ARTIFACT")?;
        self.m.model.use_artifact(a, sparsity)?;
        self.label = match sparsity {
            Some(s) => format!("trained predictors at {:.0}%", s * 100.0),
            None => format!(
                "trained predictors (recall {:.2})",
                a.meta.calibration.target_recall
            ),
        };
        Ok(())
    }
}

/// Loads the neuron-major sparse model: `GateFirst` at the per-layer thresholds (`--threshold`'s,
/// the artifact's, or calibrated now for the target sparsity), and for
/// [`SparseMode::Predictors`] the artifact's trained predictors and placement on top. An artifact
/// is checked against the model file's hash.
pub(crate) fn load_sparse(path: &Path, s: &SparseSettings) -> Result<Sparse> {
    let mut m = load(path, &s.hybrid_ffn_mode())?;
    let layers = m.model.config().layers;
    let artifact = match &s.artifact {
        Some(p) => {
            let pb = spinner(format!("reading {} and hashing the model", p.display()));
            let a = load_artifact(p, path)?;
            pb.finish_and_clear();
            Some(a)
        }
        None => None,
    };
    let thresholds = match (s.threshold, &artifact) {
        (Some(t), _) => vec![t; layers],
        (None, Some(a)) => a.meta.layers.iter().map(|l| l.h_threshold).collect(),
        (None, None) => {
            let calib = corpus_tokens(&m.tok, 1790..=1999, s.calibration_tokens)?;
            let sparsity = s.gate_first_sparsity();
            let pb = spinner(format!(
                "calibrating per-layer thresholds for {:.0}% sparsity on {} tokens",
                sparsity * 100.0,
                calib.len()
            ));
            let t = m.model.calibrate_thresholds(&calib, 512, sparsity)?;
            pb.finish_and_clear();
            t
        }
    };
    tracing::info!(?thresholds, "per-layer |h| thresholds");
    let mut sp = Sparse {
        m,
        thresholds,
        artifact,
        label: String::new(),
    };
    if s.mode == SparseMode::Predictors {
        sp.use_trained(s.target)?;
    } else {
        sp.use_exact(None)?;
        sp.label = match (s.threshold, &sp.artifact) {
            (Some(t), _) => format!("|h| > {t}"),
            (None, Some(_)) => "the artifact's |h| thresholds".into(),
            (None, None) => format!(
                "per-layer |h| thresholds for {:.0}% sparsity",
                s.gate_first_sparsity() * 100.0
            ),
        };
    }
    Ok(sp)
}

/// SmolLM2's chat template (ChatML) around one user message.
pub(crate) fn chatml(user: &str) -> String {
    format!("<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n")
}

pub(crate) fn mean(v: &[f64]) -> f64 {
    v.iter().sum::<f64>() / v.len().max(1) as f64
}

/// Generates from `prompt`, printing the text to stdout as tokens come.
pub(crate) fn stream(m: &mut Loaded, prompt: &[u32], opts: &GenerateOptions) -> Result<Generation> {
    use std::io::Write;
    let mut ids = Vec::new();
    let mut printed = 0;
    let tok = &m.tok;
    let mut out = std::io::stdout().lock();
    let g = generate(&mut m.model, prompt, opts, |t| {
        ids.push(t);
        let s = tok.decode(&ids)?;
        if s.len() > printed && s.is_char_boundary(printed) {
            let _ = write!(out, "{}", &s[printed..]);
            let _ = out.flush();
            printed = s.len();
        }
        Ok(())
    })?;
    writeln!(out)?;
    Ok(g)
}

/// Mean realized FFN sparsity over the hybrid layers since `enable_ffn_stats`.
pub(crate) fn mean_sparsity(model: &mut Llama) -> f64 {
    let per_layer: Vec<f64> = model.take_ffn_sparsity().into_iter().flatten().collect();
    mean(&per_layer)
}
