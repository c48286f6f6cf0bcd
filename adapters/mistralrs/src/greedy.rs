//! Loading a GGUF file through mistral.rs's own builder and greedy chat requests. Shared by the
//! example and the baseline binary built against unpatched mistral.rs (`baseline/`), so both
//! run exactly the same requests.

use std::path::Path;

use anyhow::{Context, Result};
use mistralrs::{
    GgufModelBuilder, Model, ModelDType, RequestBuilder, TextMessageRole, TextModelBuilder,
};

/// The default prompts of `compare` and the baseline.
pub const PROMPTS: &[&str] = &[
    "What is the State of the Union address, and why does it matter?",
    "Write a short poem about the sea.",
    "Explain how a binary search works.",
    "Give three tips for learning a new language.",
    "What causes the seasons on Earth?",
];

/// Loads a model on the CPU through mistral.rs's builders: a GGUF file (`GgufModelBuilder`;
/// tokenizer and chat template from the file) or a Hugging Face checkpoint directory
/// (`TextModelBuilder`, run in f32: mistral.rs's `auto` picks bf16 on the CPU, which rounds
/// every intermediate of the dense MLP).
pub async fn load(path: &Path) -> Result<Model> {
    if path.is_dir() {
        return TextModelBuilder::new(path.to_string_lossy())
            .with_dtype(ModelDType::F32)
            .with_force_cpu()
            .build()
            .await
            .with_context(|| format!("loading {} through mistral.rs", path.display()));
    }
    let dir = path.parent().filter(|d| !d.as_os_str().is_empty());
    let dir = dir.unwrap_or(Path::new("."));
    let file = path.file_name().context("model path has no file name")?;
    GgufModelBuilder::new(
        dir.to_string_lossy(),
        vec![file.to_string_lossy().into_owned()],
    )
    .with_force_cpu()
    .build()
    .await
    .with_context(|| format!("loading {} through mistral.rs", path.display()))
}

/// One greedy chat completion.
#[derive(Debug, Clone, PartialEq)]
pub struct Completion {
    pub text: String,
    /// The generated tokens (as text) and each one's log-probability under the model that
    /// chose it.
    pub pieces: Vec<String>,
    pub logprobs: Vec<f32>,
    pub tokens: usize,
    pub decode_tok_s: f32,
}

impl Completion {
    /// One JSON line: prompt, text, log-probabilities.
    #[allow(dead_code)] // each binary uses one direction
    pub fn to_json(&self, prompt: &str) -> String {
        serde_json::json!({
            "prompt": prompt,
            "text": self.text,
            "pieces": self.pieces,
            "logprobs": self.logprobs,
        })
        .to_string()
    }

    /// Reads [`Completion::to_json`]'s line back: (prompt, completion).
    #[allow(dead_code)] // each binary uses one direction
    pub fn from_json(line: &str) -> Result<(String, Completion)> {
        let v: serde_json::Value = serde_json::from_str(line)?;
        let field = |k: &str| v.get(k).with_context(|| format!("no `{k}` in {line}"));
        let prompt = field("prompt")?.as_str().context("prompt")?.to_string();
        let text = field("text")?.as_str().context("text")?.to_string();
        let logprobs: Vec<f32> = field("logprobs")?
            .as_array()
            .context("logprobs")?
            .iter()
            .map(|x| x.as_f64().map(|x| x as f32).context("logprob"))
            .collect::<Result<_>>()?;
        let pieces: Vec<String> = field("pieces")?
            .as_array()
            .context("pieces")?
            .iter()
            .map(|x| x.as_str().map(str::to_string).context("piece"))
            .collect::<Result<_>>()?;
        let tokens = logprobs.len();
        Ok((
            prompt,
            Completion {
                text,
                pieces,
                logprobs,
                tokens,
                decode_tok_s: 0.0,
            },
        ))
    }
}

/// Greedy decoding (mistral.rs's deterministic sampler: top-k 1) of a chat turn.
pub async fn greedy(model: &Model, prompt: &str, max_tokens: usize) -> Result<Completion> {
    let req = RequestBuilder::new()
        .add_message(TextMessageRole::User, prompt)
        .set_deterministic_sampler()
        .set_sampler_max_len(max_tokens)
        .return_logprobs(true);
    let resp = model.send_chat_request(req).await?;
    let choice = resp.choices.first().context("no choice in the response")?;
    let content = choice.logprobs.as_ref().and_then(|l| l.content.as_ref());
    let content = content.map(Vec::as_slice).unwrap_or_default();
    Ok(Completion {
        text: choice.message.content.clone().unwrap_or_default(),
        pieces: content.iter().map(|t| t.token.clone()).collect(),
        logprobs: content.iter().map(|t| t.logprob).collect(),
        tokens: resp.usage.completion_tokens,
        decode_tok_s: resp.usage.avg_compl_tok_per_sec,
    })
}

/// [`greedy`] on every prompt at once: the requests reach mistral.rs's scheduler together, which
/// batches them (as a server does with concurrent clients). Answers in prompt order.
#[allow(dead_code)] // each binary uses what it needs
pub async fn concurrent(
    model: &std::sync::Arc<Model>,
    prompts: &[String],
    max_tokens: usize,
) -> Result<Vec<Completion>> {
    let tasks: Vec<_> = prompts
        .iter()
        .map(|p| {
            let (m, p) = (std::sync::Arc::clone(model), p.clone());
            tokio::spawn(async move { greedy(&m, &p, max_tokens).await })
        })
        .collect();
    let mut out = Vec::new();
    for t in tasks {
        out.push(t.await.context("a request task failed")??);
    }
    Ok(out)
}
