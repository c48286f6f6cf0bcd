//! SmolLM2 through mistral.rs with PowerInfer's sparse FFN (the `powerinfer` feature of a patched
//! mistralrs-core): chat, greedy comparison against the dense MLP, decode benchmark, and
//! mistral.rs's OpenAI-compatible server.

mod greedy;
mod load;
mod model;
mod serve;
mod server;

use std::path::PathBuf;

use anyhow::Result;
use clap::{Args, Parser, Subcommand};
use mistralrs_core::powerinfer::{Neurons, PowerInferConfig, Sparsity};

#[derive(Parser)]
#[command(version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Answer prompts with the sparse FFN (greedy) and report the realized sparsity.
    Chat {
        #[command(flatten)]
        model: ModelArgs,
        /// The prompts (one request each).
        #[arg(long, required = true, num_args = 1..)]
        prompt: Vec<String>,
        /// Tokens to generate at most per prompt.
        #[arg(long, default_value_t = 96)]
        max_tokens: usize,
    },
    /// Greedy output of mistral.rs's dense MLP, of the sparse FFN computing every neuron, and of
    /// `--powerinfer` (when given) on the same prompts.
    Compare {
        #[command(flatten)]
        model: ModelArgs,
        /// Prompts (default: five built-in ones).
        #[arg(long, num_args = 1..)]
        prompt: Vec<String>,
        /// Tokens to generate per prompt.
        #[arg(long, default_value_t = 64)]
        max_tokens: usize,
        /// JSON lines from `powerinfer-mistralrs-baseline` (built against unpatched mistral.rs):
        /// its prompts are used, and the dense and every-neuron runs must match it too.
        #[arg(long)]
        baseline: Option<PathBuf>,
        /// Fail unless every neuron gives the dense MLP's tokens exactly (true where both compute
        /// on the same values: an f32 checkpoint; a GGUF file's sparse FFN stores the down rows
        /// re-quantized to Q8_0 and quantizes activations differently than candle's matmul).
        #[arg(long)]
        strict: bool,
        /// Fail unless the input-sparse FFN keeping every input gives the dense MLP's tokens
        /// exactly (its products are the dense ones over the file's exact blocks).
        #[arg(long)]
        strict_input: bool,
        /// Fail unless every neuron gives at least this many leading tokens of the dense MLP's
        /// output for every prompt.
        #[arg(long, default_value_t = 0)]
        min_prefix: usize,
    },
    /// Decode tokens/s through mistral.rs with the dense MLP and with the sparse FFN, same run.
    Bench {
        #[command(flatten)]
        model: ModelArgs,
        /// Measured requests per model (alternating, after one warm-up each).
        #[arg(long, default_value_t = 5)]
        runs: usize,
        /// Tokens generated per request.
        #[arg(long, default_value_t = 64)]
        max_tokens: usize,
    },
    /// mistral.rs's OpenAI-compatible server on loopback, with the sparse FFN.
    Serve {
        #[command(flatten)]
        model: ModelArgs,
        /// Port on 127.0.0.1 (0: any free one).
        #[arg(long, default_value_t = 8080)]
        port: u16,
        /// Send one `/v1/chat/completions` request, check the answer, print it; then send
        /// sixteen different greedy requests one after another, and again from eight clients at
        /// once, and check that every one completes with the answer it got alone; exit.
        #[arg(long)]
        check: bool,
        /// Requests served at once (the rest wait); mistral.rs batches them.
        #[arg(long, default_value_t = 16, value_parser = clap::value_parser!(u32).range(1..))]
        concurrent_requests: u32,
        /// Serve mistral.rs's dense MLP (the patched crate, no sparse FFN) instead of
        /// `--powerinfer`.
        #[arg(long)]
        dense: bool,
    },
    /// Load test of an OpenAI-compatible server (this one, or any other): sixteen different
    /// greedy prompts sent alone, then from N concurrent clients per level; prints throughput,
    /// p50 and p99 latency, and the answers that differ from their solo answers.
    Load {
        /// The server's base URL, e.g. `http://127.0.0.1:8080`.
        #[arg(long)]
        url: String,
        /// Concurrent clients, one level each.
        #[arg(long, value_delimiter = ',', default_value = "1,4,16")]
        clients: Vec<usize>,
        /// Requests per prompt and level (a level sends 16 x rounds).
        #[arg(long, default_value_t = 2)]
        rounds: usize,
        /// Tokens per answer at most.
        #[arg(long, default_value_t = 32)]
        max_tokens: u32,
        /// The server's name in the table.
        #[arg(long, default_value = "server")]
        label: String,
        /// Print the table header first.
        #[arg(long)]
        header: bool,
        /// Exit with an error when an answer is wrong (differs from its solo answer other than
        /// at a near-tie) or a request fails.
        #[arg(long)]
        strict: bool,
    },
}

#[derive(Args, Clone)]
struct ModelArgs {
    /// A GGUF file or a Hugging Face checkpoint directory (default: SmolLM2-135M-Instruct Q4_1
    /// in ~/.cache/powerinfer, where `powerinfer demo` fetches it).
    #[arg(long)]
    model: Option<PathBuf>,
    /// What the sparse FFN computes: `input` (the input-sparse FFN keeping every input: the
    /// dense MLP's products over the file's exact blocks), `input:ARTIFACT` (the artifact's
    /// calibrated input rule), `predictors:ARTIFACT` (the trained predictors of a `.powerinfer`
    /// artifact from `powerinfer analyze`), `all` (every neuron) or `gate-first:T` (exact |h|
    /// thresholding at T).
    #[arg(long, default_value = "input")]
    powerinfer: Sparsity,
    /// With an artifact: the predictors' score thresholds for this FFN sparsity.
    #[arg(long)]
    predictor_sparsity: Option<f64>,
    /// Threads of the sparse FFN (default: all cores).
    #[arg(long)]
    threads: Option<usize>,
}

impl ModelArgs {
    fn sparse(&self) -> Result<PowerInferConfig> {
        let mut cfg = PowerInferConfig::new(self.powerinfer.clone());
        if let Some(s) = self.predictor_sparsity {
            anyhow::ensure!(
                matches!(cfg.sparsity, Sparsity::Neurons(Neurons::Predictors { .. })),
                "--predictor-sparsity needs an artifact in --powerinfer"
            );
            cfg = cfg.with_predictor_sparsity(s);
        }
        if let Some(t) = self.threads {
            cfg = cfg.with_threads(t);
        }
        Ok(cfg)
    }

    fn model(&self) -> Result<PathBuf> {
        let path = match &self.model {
            Some(p) => p.clone(),
            None => model::default_model()?,
        };
        anyhow::ensure!(
            path.exists(),
            "{} does not exist (run `powerinfer demo` once to fetch SmolLM2, or pass --model)",
            path.display()
        );
        Ok(path)
    }
}

#[tokio::main]
async fn main() -> Result<()> {
    match Cli::parse().command {
        Command::Chat {
            model,
            prompt,
            max_tokens,
        } => model::chat(&model.model()?, model.sparse()?, &prompt, max_tokens).await,
        Command::Compare {
            model,
            prompt,
            max_tokens,
            baseline,
            strict,
            strict_input,
            min_prefix,
        } => {
            let (path, sparse) = (model.model()?, model.sparse()?);
            let base = baseline.as_deref();
            let min_prefix = min_prefix.min(max_tokens);
            let s = (strict, strict_input);
            model::compare(&path, sparse, &prompt, max_tokens, base, s, min_prefix).await
        }
        Command::Bench {
            model,
            runs,
            max_tokens,
        } => model::bench(&model.model()?, model.sparse()?, runs, max_tokens).await,
        Command::Serve {
            model,
            port,
            check,
            concurrent_requests,
            dense,
        } => {
            let limit = concurrent_requests as usize;
            let sparse = if dense { None } else { Some(model.sparse()?) };
            serve::serve(&model.model()?, sparse, port, check, limit).await
        }
        Command::Load {
            url,
            clients,
            rounds,
            max_tokens,
            label,
            header,
            strict,
        } => {
            anyhow::ensure!(
                clients.iter().all(|&c| c > 0) && rounds > 0 && max_tokens > 0,
                "--clients, --rounds and --max-tokens must be positive"
            );
            if header {
                println!("{}", load::HEADER);
            }
            let base = url.trim_end_matches('/');
            let levels = load::run(base, &label, &clients, rounds, max_tokens).await?;
            for l in &levels {
                let firsts = [
                    ("near-tie", &l.first_tie),
                    ("wrong", &l.first_wrong),
                    ("failed", &l.first_failure),
                ];
                for (what, first) in firsts {
                    if let Some(f) = first {
                        eprintln!("{label}, {} clients, first {what}: {f}", l.clients);
                    }
                }
                if !l.wrong_at.is_empty() {
                    let at: Vec<String> = l
                        .wrong_at
                        .iter()
                        .map(|(t, g)| match g {
                            Some(g) => format!("{t} tokens, gap {g:.3}"),
                            None => format!("{t} tokens, no candidate"),
                        })
                        .collect();
                    eprintln!(
                        "{label}, {} clients, wrong after: {}",
                        l.clients,
                        at.join("; ")
                    );
                }
            }
            let bad: usize = levels.iter().map(|l| l.wrong + l.failed).sum();
            anyhow::ensure!(!strict || bad == 0, "{bad} wrong or failed answers");
            Ok(())
        }
    }
}
