//! mistral.rs's OpenAI-compatible server with the sparse FFN, and its `--check`.

use std::path::Path;

use anyhow::Result;
use mistralrs_core::powerinfer::{self, PowerInferConfig};

use crate::{load, server};

/// Serves `path` on `127.0.0.1:port`, `limit` requests at a time, with the sparse FFN (`None`:
/// mistral.rs's dense MLP, through the patched crate).
///
/// Unpatched mistral.rs 0.8.1 gave every sequence of a batched CPU decode step the last
/// sequence's attention output (`powerinfer-mistralrs-baseline --concurrent` shows it); the
/// patch set fixes it (its `attention/backends/cpu.rs` hunk), so concurrent requests get the
/// answers they get alone: bit for bit with the dense MLP, every neuron or the input rule. With
/// trained predictors a batch's rows share one pass over the union of their neurons, whose
/// float sums the batch orders, so a greedy answer can part from its solo one at a near-tie
/// (`limit` 1 makes them equal).
pub async fn serve(
    path: &Path,
    sparse: Option<PowerInferConfig>,
    port: u16,
    check: bool,
    limit: usize,
) -> Result<()> {
    match &sparse {
        Some(cfg) => powerinfer::enable(cfg.clone()),
        None => powerinfer::disable(),
    }
    let started = server::start(path, port, limit).await;
    powerinfer::disable();
    let server = started?;
    let layers = powerinfer::report().layers;
    let ffn = match &sparse {
        Some(_) => {
            anyhow::ensure!(layers > 0, "the server's model has no sparse FFN layer");
            format!("the sparse FFN in {layers} layers")
        }
        None => "mistral.rs's dense MLP".to_string(),
    };
    println!(
        "serving {} on http://{}/v1 with {ffn}",
        path.display(),
        server.addr
    );
    if !check {
        return Ok(server.task.await??);
    }
    let base = format!("http://{}", server.addr);
    let result = match check_chat(&base, sparse.as_ref()).await {
        Ok(()) => check_concurrent(&base, limit).await,
        e => e,
    };
    server.task.abort();
    result
}

/// The sixteen prompts of [`load::PROMPTS`] alone, one after another, then from eight clients
/// at once (more than `limit`: the server queues the rest): every request must complete with
/// the answer it got alone, or part from it only at a near-tie ([`load::Verdict`]).
async fn check_concurrent(base: &str, limit: usize) -> Result<()> {
    println!("{}", load::HEADER);
    // 12 tokens: the request mix-up parts answers at their second token; mistral.rs's batch
    // differences part them later, if at all (after 8 to 29 equal tokens in the load test).
    let level = &load::run(base, "check", &[8], 1, 12).await?[0];
    if let Some(f) = &level.first_failure {
        anyhow::bail!(
            "{} of {} requests failed: {f}",
            level.failed,
            level.requests
        );
    }
    if let Some(w) = &level.first_wrong {
        anyhow::bail!(
            "{} of {} answers differ from their solo answers under load, e.g. {w}",
            level.wrong,
            level.requests
        );
    }
    if let Some(t) = &level.first_tie {
        println!("parted from the solo answer at a near-tie: {t}");
    }
    println!(
        "{} greedy requests from 8 clients ({limit} served at once) completed in {:.1} s with \
         the answers they get alone ({} parted at a near-tie)",
        level.requests, level.seconds, level.ties
    );
    Ok(())
}

/// One chat completion over HTTP: the answer must be non-empty text, from the sparse FFN when
/// there is one.
async fn check_chat(base: &str, sparse: Option<&PowerInferConfig>) -> Result<()> {
    powerinfer::reset_report();
    let client = reqwest::Client::new();
    let (answer, tokens) = load::ask(&client, base, "What is the capital of France?", 32).await?;
    anyhow::ensure!(!answer.trim().is_empty(), "empty answer");
    println!(
        "POST /v1/chat/completions -> {tokens} tokens:\n{}",
        answer.trim()
    );
    let Some(sparse) = sparse else {
        return Ok(());
    };
    let r = powerinfer::report();
    anyhow::ensure!(
        r.rows > 0,
        "the request did not run through the sparse FFN (no rows counted)"
    );
    println!(
        "sparse FFN: {} layer rows, {}",
        r.rows,
        crate::model::skipped(sparse, &r)
    );
    Ok(())
}
