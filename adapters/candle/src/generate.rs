//! Generation with the host's sampler (`candle_transformers::generation::LogitsProcessor`).

use std::time::{Duration, Instant};

use candle_transformers::generation::LogitsProcessor;

use crate::error::{ErrorKind, Result};
use crate::model::Llama;

/// Sampling and length settings.
#[derive(Debug, Clone)]
pub struct GenerateOptions {
    /// Tokens to generate at most.
    pub max_tokens: usize,
    /// `None` or `<= 0`: greedy (argmax).
    pub temperature: Option<f64>,
    /// Nucleus sampling.
    pub top_p: Option<f64>,
    /// Sampler seed.
    pub seed: u64,
    /// Stop at any of these ids.
    pub eos: Vec<u32>,
}

impl Default for GenerateOptions {
    fn default() -> Self {
        GenerateOptions {
            max_tokens: 64,
            temperature: None,
            top_p: None,
            seed: 299_792_458,
            eos: Vec::new(),
        }
    }
}

/// What a generation produced and how long it took.
#[derive(Debug, Clone)]
pub struct Generation {
    /// Generated ids (prompt excluded).
    pub tokens: Vec<u32>,
    /// Time to run the prompt (prefill) and sample the first token.
    pub prompt_time: Duration,
    /// Time for the remaining tokens.
    pub decode_time: Duration,
    /// Prompt length.
    pub prompt_tokens: usize,
}

impl Generation {
    /// Prompt tokens per second.
    pub fn prompt_tps(&self) -> f64 {
        self.prompt_tokens as f64 / self.prompt_time.as_secs_f64().max(1e-9)
    }

    /// Decode tokens per second (tokens after the first).
    pub fn decode_tps(&self) -> f64 {
        self.tokens.len().saturating_sub(1) as f64 / self.decode_time.as_secs_f64().max(1e-9)
    }
}

/// Runs `prompt` and generates up to `opts.max_tokens` tokens, calling `on_token` with each as
/// it comes. Empty prompts and prompts that do not fit the context are typed errors.
pub fn generate(
    model: &mut Llama,
    prompt: &[u32],
    opts: &GenerateOptions,
    mut on_token: impl FnMut(u32) -> Result<()>,
) -> Result<Generation> {
    if prompt.is_empty() {
        return Err(ErrorKind::Prompt {
            reason: "the prompt is empty".into(),
        }
        .into());
    }
    let ctx = model.config().context;
    if prompt.len() >= ctx {
        return Err(ErrorKind::Prompt {
            reason: format!(
                "{} prompt tokens do not fit the context of {ctx}",
                prompt.len()
            ),
        }
        .into());
    }
    let temp = opts.temperature.filter(|t| *t > 0.0);
    let mut sampler = LogitsProcessor::new(opts.seed, temp, opts.top_p);
    model.clear_kv_cache();
    let start = Instant::now();
    let logits = model.forward(prompt, 0)?;
    let mut next = sampler.sample(&logits)?;
    let prompt_time = start.elapsed();
    let mut tokens = vec![next];
    on_token(next)?;
    let start = Instant::now();
    let budget = opts.max_tokens.min(ctx - prompt.len());
    while tokens.len() < budget && !opts.eos.contains(&next) {
        let pos = prompt.len() + tokens.len() - 1;
        let logits = model.forward(&[next], pos)?;
        next = sampler.sample(&logits)?;
        tokens.push(next);
        on_token(next)?;
    }
    Ok(Generation {
        tokens,
        prompt_time,
        decode_time: start.elapsed(),
        prompt_tokens: prompt.len(),
    })
}
