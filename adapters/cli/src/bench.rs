//! `powerinfer bench`: prompt and decode speed of the dense and the sparse FFN in the same run,
//! with where decode time goes.

use std::time::Instant;

use anyhow::{bail, Result};
use powerinfer_candle::{FfnMode, Llama, Timings};

use crate::common::{corpus_tokens, load, load_sparse, model_path, SparseSettings};
use crate::BenchArgs;

/// One measured mode: `dense` (candle's FFN and matmuls, the reference), `all` (every neuron
/// through powerinfer's kernels), `sparse` (exact `GateFirst` thresholding), `trained` (the
/// artifact's predictors).
struct Row {
    mode: &'static str,
    prompt_tps: f64,
    decode_tps: f64,
    per_token: Timings,
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn argmax(logits: &candle_core::Tensor) -> Result<u32> {
    let v: Vec<f32> = logits.to_vec1()?;
    let best = v
        .iter()
        .enumerate()
        .fold((0usize, f32::NEG_INFINITY), |b, (i, &x)| {
            if x > b.1 {
                (i, x)
            } else {
                b
            }
        });
    Ok(best.0 as u32)
}

/// The peer: candle-transformers' `quantized_llama` on the same GGUF file and prompt.
fn measure_candle(
    path: &std::path::Path,
    prompt: &[u32],
    decode: usize,
    runs: usize,
) -> Result<Row> {
    use candle_transformers::models::quantized_llama::ModelWeights;
    let dev = candle_core::Device::Cpu;
    let mut f = std::fs::File::open(path)?;
    let ct = candle_core::quantized::gguf_file::Content::read(&mut f)?;
    let mut m = ModelWeights::from_gguf(ct, &mut f, &dev)?;
    let (mut p, mut d) = (Vec::new(), Vec::new());
    for _ in 0..runs {
        let t = Instant::now();
        let x = candle_core::Tensor::new(prompt, &dev)?.unsqueeze(0)?;
        let logits = m.forward(&x, 0)?.squeeze(0)?;
        p.push(prompt.len() as f64 / t.elapsed().as_secs_f64());
        let mut next = argmax(&logits)?;
        let t = Instant::now();
        for i in 0..decode {
            let x = candle_core::Tensor::new(&[next], &dev)?.unsqueeze(0)?;
            next = argmax(&m.forward(&x, prompt.len() + i)?.squeeze(0)?)?;
        }
        d.push(decode as f64 / t.elapsed().as_secs_f64());
    }
    Ok(Row {
        mode: "candle",
        prompt_tps: median(p),
        decode_tps: median(d),
        per_token: Timings::default(),
    })
}

fn measure(
    model: &mut Llama,
    prompt: &[u32],
    decode: usize,
    runs: usize,
    mode: &'static str,
) -> Result<Row> {
    let (mut p, mut d) = (Vec::new(), Vec::new());
    let mut per_token = Timings::default();
    for _ in 0..runs {
        model.clear_kv_cache();
        let t = Instant::now();
        let logits = model.forward(prompt, 0)?;
        p.push(prompt.len() as f64 / t.elapsed().as_secs_f64());
        let mut next = argmax(&logits)?;
        model.enable_timings();
        let t = Instant::now();
        for i in 0..decode {
            next = argmax(&model.forward(&[next], prompt.len() + i)?)?;
        }
        d.push(decode as f64 / t.elapsed().as_secs_f64());
        if let Some(tm) = model.timings() {
            per_token = tm.clone();
        }
    }
    Ok(Row {
        mode,
        prompt_tps: median(p),
        decode_tps: median(d),
        per_token,
    })
}

pub(crate) fn run(a: &BenchArgs) -> Result<()> {
    if a.runs == 0 || a.decode_tokens == 0 || a.prompt_tokens == 0 {
        bail!("--runs, --decode-tokens and --prompt-tokens must be at least 1");
    }
    let settings = SparseSettings::from_args(&a.model)?;
    let path = model_path(&a.model.model)?;
    let mut dense = load(&path, &FfnMode::Dense)?;
    let prompt = corpus_tokens(&dense.tok, 2000..=2021, a.prompt_tokens)?;
    if prompt.len() + a.decode_tokens > dense.model.config().context {
        bail!(
            "--prompt-tokens + --decode-tokens exceed the context of {}",
            dense.model.config().context
        );
    }
    let gguf = path.extension().is_some_and(|e| e == "gguf");
    let peer = if gguf {
        Some(measure_candle(&path, &prompt, a.decode_tokens, a.runs)?)
    } else {
        None
    };
    let mut rows = vec![measure(
        &mut dense.model,
        &prompt,
        a.decode_tokens,
        a.runs,
        "dense",
    )?];
    drop(dense);
    // Every neuron through powerinfer's kernels: separates what the kernels buy from what
    // skipping neurons buys.
    let mut all = load(&path, &settings.mode())?;
    rows.push(measure(
        &mut all.model,
        &prompt,
        a.decode_tokens,
        a.runs,
        "all",
    )?);
    drop(all);
    let mut sp = load_sparse(&path, &settings)?;
    // With an artifact: exact thresholding at its |h| thresholds, then its trained predictors.
    let mut modes = vec![("sparse", false)];
    if sp.artifact.is_some() {
        sp.use_exact(None)?;
        modes.push(("trained", true));
    }
    let mut realized = Vec::new();
    for (mode, trained) in modes {
        if trained {
            sp.use_trained(settings.predictor_sparsity)?;
        }
        rows.push(measure(
            &mut sp.m.model,
            &prompt,
            a.decode_tokens,
            a.runs,
            mode,
        )?);
        // Realized sparsity on the prompt, counted after the timed runs.
        sp.m.model.enable_ffn_stats();
        sp.m.model.clear_kv_cache();
        sp.m.model.forward(&prompt, 0)?;
        realized.push((mode, crate::common::mean_sparsity(&mut sp.m.model)));
    }

    println!(
        "{:<7} {:>12} {:>12} | per decoded token, ms: {:>9} {:>7} {:>8} {:>7}",
        "mode", "prompt tok/s", "decode tok/s", "attention", "ffn", "lm_head", "other"
    );
    rows.extend(peer);
    for r in &rows {
        let t = &r.per_token;
        let ms = |d: std::time::Duration| d.as_secs_f64() * 1e3 / t.calls.max(1) as f64;
        println!(
            "{:<7} {:>12.1} {:>12.1} |                      {:>9.3} {:>7.3} {:>8.3} {:>7.3}",
            r.mode,
            r.prompt_tps,
            r.decode_tps,
            ms(t.attention),
            ms(t.ffn),
            ms(t.lm_head),
            ms(t.other)
        );
        println!(
            "{}",
            serde_json::json!({
                "mode": r.mode, "prompt_tokens": prompt.len(), "decode_tokens": a.decode_tokens,
                "prompt_tps": r.prompt_tps, "decode_tps": r.decode_tps,
                "ms_per_token": {"attention": ms(t.attention), "ffn": ms(t.ffn), "lm_head": ms(t.lm_head), "other": ms(t.other)},
                "threads": settings.threads,
                "realized_sparsity": realized.iter().find(|m| m.0 == r.mode).map(|m| m.1),
            })
        );
    }
    for (k, (mode, s)) in realized.iter().enumerate() {
        let r = &rows[2 + k];
        println!(
            "decode vs dense (candle): {mode} {:.2}x, all neurons {:.2}x; {mode} vs all {:.2}x; realized FFN sparsity {:.1}%",
            r.decode_tps / rows[0].decode_tps,
            rows[1].decode_tps / rows[0].decode_tps,
            r.decode_tps / rows[1].decode_tps,
            s * 100.0
        );
    }
    if realized.len() == 2 {
        println!(
            "trained predictors vs exact thresholding (same run): decode {:.2}x",
            rows[3].decode_tps / rows[2].decode_tps
        );
    }
    if let Some(peer) = rows.iter().find(|r| r.mode == "candle") {
        println!(
            "our dense model vs candle-transformers quantized_llama (same file, same run): decode {:.2}x, prompt {:.2}x (no per-component times for the peer)",
            rows[0].decode_tps / peer.decode_tps,
            rows[0].prompt_tps / peer.prompt_tps
        );
    }
    Ok(())
}
