//! mistral.rs's OpenAI-compatible server (`mistralrs-server-core`) with the sparse FFN.

use std::path::Path;

use anyhow::{Context, Result};
use mistralrs_core::powerinfer::{self, PowerInferConfig};
use mistralrs_core::{AutoDeviceMapParams, ModelDType, ModelSelected};
use mistralrs_server_core::mistralrs_for_server_builder::MistralRsForServerBuilder;
use mistralrs_server_core::mistralrs_server_router_builder::MistralRsServerRouterBuilder;

/// Serves `path` on `127.0.0.1:port`, `limit` requests at a time (the rest queue), which
/// mistral.rs's scheduler batches.
///
/// Unpatched mistral.rs 0.8.1 gave every sequence of a batched CPU decode step the last
/// sequence's attention output (`powerinfer-mistralrs-baseline --concurrent` shows it); the
/// patch set fixes it (its `attention/backends/cpu.rs` hunk), so concurrent requests get the
/// answers they get alone: bit for bit with the dense MLP, every neuron or the input rule. With
/// trained predictors a batch's rows share one pass over the union of their neurons, whose
/// float sums the batch orders, so a greedy answer can part from its solo one at a near-tie
/// (`limit` 1 makes them equal). The prefix cache is off, so a request's answer does not
/// depend on the requests before it either.
pub async fn serve(
    path: &Path,
    sparse: PowerInferConfig,
    port: u16,
    check: bool,
    limit: usize,
) -> Result<()> {
    anyhow::ensure!(
        path.is_file(),
        "serve takes a GGUF file; {} is not one",
        path.display()
    );
    let dir = path.parent().filter(|d| !d.as_os_str().is_empty());
    let dir = dir.unwrap_or(Path::new("."));
    let file = path.file_name().context("model path has no file name")?;
    powerinfer::enable(sparse.clone());
    let state = MistralRsForServerBuilder::new()
        .with_model(ModelSelected::GGUF {
            tok_model_id: None,
            quantized_model_id: dir.to_string_lossy().into_owned(),
            quantized_filename: file.to_string_lossy().into_owned(),
            dtype: ModelDType::Auto,
            topology: None,
            max_seq_len: AutoDeviceMapParams::DEFAULT_MAX_SEQ_LEN,
            max_batch_size: AutoDeviceMapParams::DEFAULT_MAX_BATCH_SIZE,
        })
        .with_cpu(true)
        // No prefix cache: a cached prompt prefix changes which rows a sparse layer's call holds
        // (the union of the rows' neurons), so how the CPU tier splits the neurons across
        // threads and the order of the float sums; a repeated greedy request could then part
        // from its first answer at a near-tie.
        .with_prefix_cache_n(0)
        .build()
        .await
        .with_context(|| format!("loading {} for the server", path.display()))?;
    powerinfer::disable();
    let layers = powerinfer::report().layers;
    anyhow::ensure!(layers > 0, "the server's model has no sparse FFN layer");
    let router = MistralRsServerRouterBuilder::new()
        .with_mistralrs(state)
        .build()
        .await?
        .layer(tower::limit::ConcurrencyLimitLayer::new(limit));
    let listener = tokio::net::TcpListener::bind(("127.0.0.1", port)).await?;
    let addr = listener.local_addr()?;
    println!(
        "serving {} on http://{addr}/v1 with the sparse FFN in {layers} layers",
        path.display()
    );
    let server = tokio::spawn(async move { axum::serve(listener, router).await });
    if !check {
        return Ok(server.await??);
    }
    let base = format!("http://{addr}");
    let result = match check_chat(&base, &sparse).await {
        Ok(()) => check_concurrent(&base).await,
        e => e,
    };
    server.abort();
    result
}

/// One greedy chat completion over HTTP: its text and how many tokens it has.
async fn ask(
    client: &reqwest::Client,
    base: &str,
    prompt: &str,
    tokens: u32,
) -> Result<(String, u64)> {
    let body = serde_json::json!({
        "model": "default",
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": tokens,
        "temperature": 0.0,
    });
    let resp = client
        .post(format!("{base}/v1/chat/completions"))
        .json(&body)
        .send()
        .await
        .context("POST /v1/chat/completions")?;
    let status = resp.status();
    let text = resp.text().await?;
    anyhow::ensure!(status.is_success(), "HTTP {status}: {text}");
    let json: serde_json::Value = serde_json::from_str(&text).context("response is not JSON")?;
    let answer = json["choices"][0]["message"]["content"]
        .as_str()
        .with_context(|| format!("no choices[0].message.content in {text}"))?;
    let tokens = json["usage"]["completion_tokens"].as_u64().unwrap_or(0);
    Ok((answer.to_string(), tokens))
}

/// Four greedy requests one after another, then each of them three times, all twelve at once
/// (a bounded stress test on loopback): every request must complete with the answer it got
/// alone (not another request's).
async fn check_concurrent(base: &str) -> Result<()> {
    let client = reqwest::Client::new();
    let prompts: Vec<String> = (1..=4)
        .map(|i| format!("Write about the number {i}."))
        .collect();
    let mut alone = Vec::new();
    for p in &prompts {
        alone.push(ask(&client, base, p, 16).await?.0);
    }
    let started = std::time::Instant::now();
    let tasks: Vec<_> = (0..3 * prompts.len())
        .map(|k| {
            let (client, base) = (client.clone(), base.to_string());
            let p = prompts[k % prompts.len()].clone();
            tokio::spawn(
                async move { Ok::<_, anyhow::Error>(ask(&client, &base, &p, 16).await?.0) },
            )
        })
        .collect();
    for (k, t) in tasks.into_iter().enumerate() {
        let got = t.await??;
        let want = &alone[k % prompts.len()];
        anyhow::ensure!(
            &got == want,
            "prompt {}: sent alone it got {want:?}, sent with eleven others {got:?}",
            k % prompts.len() + 1
        );
    }
    println!(
        "12 concurrent greedy requests completed in {:.1} s with the answers they get alone",
        started.elapsed().as_secs_f64()
    );
    Ok(())
}

/// One chat completion over HTTP: the answer must be non-empty text from the sparse FFN.
async fn check_chat(base: &str, sparse: &PowerInferConfig) -> Result<()> {
    powerinfer::reset_report();
    let client = reqwest::Client::new();
    let (answer, tokens) = ask(&client, base, "What is the capital of France?", 32).await?;
    anyhow::ensure!(!answer.trim().is_empty(), "empty answer");
    let r = powerinfer::report();
    anyhow::ensure!(
        r.rows > 0,
        "the request did not run through the sparse FFN (no rows counted)"
    );
    println!(
        "POST /v1/chat/completions -> {tokens} tokens:\n{}",
        answer.trim()
    );
    println!(
        "sparse FFN: {} layer rows, {}",
        r.rows,
        crate::model::skipped(sparse, &r)
    );
    Ok(())
}
