//! `powerinfer generate`: streams tokens as they come.

use std::io::Write;

use anyhow::{bail, Result};
use powerinfer_candle::GenerateOptions;

use crate::common::{chatml, load_dense, model_path, stream, SparseSettings};
use crate::{GenerateArgs, SparseMode};

pub(crate) fn run(a: &GenerateArgs) -> Result<()> {
    if a.prompt.trim().is_empty() {
        bail!("--prompt is empty");
    }
    if !a.temperature.is_finite() || a.temperature < 0.0 {
        bail!(
            "--temperature {}: expected a finite value >= 0",
            a.temperature
        );
    }
    if a.sparse.mode.is_none() {
        if a.sparse.vram_budget.is_some() {
            bail!("--vram-budget places the sparse mode's neurons: add --sparse");
        }
        let m = &a.model;
        if m.threshold.is_some() || m.target.0.is_some() || m.powerinfer.is_some() {
            bail!("--threshold, --target and --powerinfer set the sparse mode: add --sparse=MODE");
        }
    }
    let sparse = a.sparse.mode;
    let settings = SparseSettings::for_mode(&a.model, sparse.unwrap_or(SparseMode::Auto))?;
    let path = model_path(&a.model.model)?;
    let (mut m, label) = if sparse.is_some() {
        let mut sm = crate::input::load_sparse_mode(&path, &settings)?;
        crate::input::place_hot(&mut sm, &path, &settings, &a.sparse)?;
        let mut label = format!("sparse: {}", sm.label);
        if let Some(b) = a.sparse.vram_budget {
            label += &format!("; {} {b} on {}", a.sparse.placement.name(), a.sparse.tier);
        }
        (sm.m, label)
    } else {
        (load_dense(&path, settings.threads)?, String::new())
    };
    let text = if a.chat {
        chatml(&a.prompt)
    } else {
        a.prompt.clone()
    };
    // BOS first where the vocabulary adds one (Gemma 3 answers nonsense without it).
    let prompt = m.tok.encode_sequence(&text)?;
    let opts = GenerateOptions {
        max_tokens: a.max_tokens,
        temperature: Some(a.temperature),
        top_p: a.top_p,
        seed: a.seed,
        eos: m.tok.eos.clone(),
    };
    let mut out = std::io::stdout().lock();
    write!(out, "{}", if a.chat { &a.prompt } else { &text })?;
    if a.chat {
        writeln!(out)?;
    }
    drop(out);
    let g = stream(&mut m, &prompt, &opts)?;
    eprintln!(
        "{} prompt tokens at {:.1} tok/s, {} generated at {:.1} tok/s ({})",
        g.prompt_tokens,
        g.prompt_tps(),
        g.tokens.len(),
        g.decode_tps(),
        match (sparse.is_some(), m.model.is_fused()) {
            (true, _) => &label,
            (false, true) => "dense, fused decoder",
            (false, false) => "dense, candle's model",
        }
    );
    Ok(())
}
