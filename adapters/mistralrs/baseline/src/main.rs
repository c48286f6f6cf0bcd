//! Greedy completions from unpatched mistral.rs 0.8.1, one JSON line per prompt, for
//! `powerinfer-mistralrs compare --baseline`.
//!
//! `powerinfer-mistralrs-baseline [--concurrent] MODEL.gguf MAX_TOKENS [PROMPT..] > baseline.jsonl`
//!
//! `--concurrent` sends every prompt at once (mistral.rs batches them), as concurrent clients of
//! a server would.

#[path = "../../src/greedy.rs"]
mod greedy;

use anyhow::{Context, Result};

#[tokio::main]
async fn main() -> Result<()> {
    let mut args = std::env::args().skip(1).peekable();
    let usage =
        "usage: powerinfer-mistralrs-baseline [--concurrent] MODEL.gguf MAX_TOKENS [PROMPT..]";
    let concurrent = args.next_if_eq("--concurrent").is_some();
    let model = std::path::PathBuf::from(args.next().context(usage)?);
    let max_tokens: usize = args.next().context(usage)?.parse().context(usage)?;
    let mut prompts: Vec<String> = args.collect();
    if prompts.is_empty() {
        prompts = greedy::PROMPTS.iter().map(|s| s.to_string()).collect();
    }
    let m = std::sync::Arc::new(greedy::load(&model).await?);
    if concurrent {
        for (p, c) in prompts
            .iter()
            .zip(greedy::concurrent(&m, &prompts, max_tokens).await?)
        {
            println!("{}", c.to_json(p));
        }
        return Ok(());
    }
    for p in &prompts {
        println!("{}", greedy::greedy(&m, p, max_tokens).await?.to_json(p));
    }
    Ok(())
}
