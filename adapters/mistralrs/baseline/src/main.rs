//! Unpatched mistral.rs 0.8.1: greedy completions, one JSON line per prompt, for
//! `powerinfer-mistralrs compare --baseline`; or its OpenAI-compatible server, for
//! `powerinfer-mistralrs load`.
//!
//! `powerinfer-mistralrs-baseline [--concurrent] MODEL.gguf MAX_TOKENS [PROMPT..] > baseline.jsonl`
//! `powerinfer-mistralrs-baseline --serve MODEL.gguf PORT [CONCURRENT_REQUESTS]`
//!
//! `--concurrent` sends every prompt at once (mistral.rs batches them), as concurrent clients of
//! a server would. `--serve` serves exactly as `powerinfer-mistralrs serve` does (default 16
//! requests at a time).

#[path = "../../src/greedy.rs"]
mod greedy;
#[path = "../../src/server.rs"]
mod server;

use anyhow::{Context, Result};

#[tokio::main]
async fn main() -> Result<()> {
    let mut args = std::env::args().skip(1).peekable();
    let usage = "usage: powerinfer-mistralrs-baseline [--concurrent] MODEL.gguf MAX_TOKENS \
                 [PROMPT..]\n       powerinfer-mistralrs-baseline --serve MODEL.gguf PORT \
                 [CONCURRENT_REQUESTS]";
    if args.next_if_eq("--serve").is_some() {
        let model = std::path::PathBuf::from(args.next().context(usage)?);
        let port: u16 = args.next().context(usage)?.parse().context(usage)?;
        let limit: usize = match args.next() {
            Some(n) => n.parse().context(usage)?,
            None => 16,
        };
        anyhow::ensure!(limit > 0, "{usage}");
        let server = server::start(&model, port, limit).await?;
        println!(
            "serving {} on http://{}/v1 with unpatched mistral.rs",
            model.display(),
            server.addr
        );
        return Ok(server.task.await??);
    }
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
