//! Greedy completions from unpatched mistral.rs 0.8.1, one JSON line per prompt, for
//! `powerinfer-mistralrs compare --baseline`.
//!
//! `powerinfer-mistralrs-baseline MODEL.gguf MAX_TOKENS [PROMPT..] > baseline.jsonl`

#[path = "../../src/greedy.rs"]
mod greedy;

use anyhow::{Context, Result};

#[tokio::main]
async fn main() -> Result<()> {
    let mut args = std::env::args().skip(1);
    let usage = "usage: powerinfer-mistralrs-baseline MODEL.gguf MAX_TOKENS [PROMPT..]";
    let model = std::path::PathBuf::from(args.next().context(usage)?);
    let max_tokens: usize = args.next().context(usage)?.parse().context(usage)?;
    let mut prompts: Vec<String> = args.collect();
    if prompts.is_empty() {
        prompts = greedy::PROMPTS.iter().map(|s| s.to_string()).collect();
    }
    let m = greedy::load(&model).await?;
    for p in &prompts {
        println!("{}", greedy::greedy(&m, p, max_tokens).await?.to_json(p));
    }
    Ok(())
}
