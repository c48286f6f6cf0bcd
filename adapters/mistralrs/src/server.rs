//! mistral.rs's OpenAI-compatible server (`mistralrs-server-core`) for a GGUF file on loopback.
//! Shared by the example (with the sparse FFN) and the baseline binary built against unpatched
//! mistral.rs (`baseline/`), so both serve exactly the same way.

use std::net::SocketAddr;
use std::path::Path;

use anyhow::{Context, Result};
use mistralrs_core::{AutoDeviceMapParams, ModelDType, ModelSelected};
use mistralrs_server_core::mistralrs_for_server_builder::MistralRsForServerBuilder;
use mistralrs_server_core::mistralrs_server_router_builder::MistralRsServerRouterBuilder;
use tokio::task::JoinHandle;

/// A server running on a tokio task.
pub struct Server {
    pub addr: SocketAddr,
    pub task: JoinHandle<std::io::Result<()>>,
}

/// Loads the GGUF file at `path` on the CPU and serves it on `127.0.0.1:port` (0: any free
/// port), `limit` requests at a time (the rest queue), which mistral.rs's scheduler batches.
/// Activations are f32 (mistral.rs's `Auto` picks bf16 on the CPU, whose rounding of the
/// attention inputs and KV cache made batched answers part from solo ones more often, and
/// which served more slowly here). The prefix cache is off, so a request's answer does not
/// depend on the requests before it.
pub async fn start(path: &Path, port: u16, limit: usize) -> Result<Server> {
    anyhow::ensure!(
        path.is_file(),
        "serve takes a GGUF file; {} is not one",
        path.display()
    );
    let dir = path.parent().filter(|d| !d.as_os_str().is_empty());
    let dir = dir.unwrap_or(Path::new("."));
    let file = path.file_name().context("model path has no file name")?;
    let state = MistralRsForServerBuilder::new()
        .with_model(ModelSelected::GGUF {
            tok_model_id: None,
            quantized_model_id: dir.to_string_lossy().into_owned(),
            quantized_filename: file.to_string_lossy().into_owned(),
            dtype: ModelDType::F32,
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
    let router = MistralRsServerRouterBuilder::new()
        .with_mistralrs(state)
        .build()
        .await?
        .layer(tower::limit::ConcurrencyLimitLayer::new(limit));
    let listener = tokio::net::TcpListener::bind(("127.0.0.1", port)).await?;
    let addr = listener.local_addr()?;
    let task = tokio::spawn(async move { axum::serve(listener, router).await });
    Ok(Server { addr, task })
}
