//! `powerinfer demo`: the main job. Dense and sparse generation on the real model, side by side.

use anyhow::Result;
use powerinfer_candle::{FfnMode, GenerateOptions, Generation};

use crate::common::{
    chatml, load, load_sparse, mean_sparsity, model_path, stream, Loaded, SparseSettings,
};
use crate::DemoArgs;

fn run_one(m: &mut Loaded, prompt: &[u32], max_tokens: usize, label: &str) -> Result<Generation> {
    let opts = GenerateOptions {
        max_tokens,
        eos: m.tok.eos.clone(),
        ..Default::default()
    };
    println!("--- {label} ---");
    stream(m, prompt, &opts)
}

pub(crate) fn run(a: &DemoArgs) -> Result<()> {
    let settings = SparseSettings::from_args(&a.model)?;
    let path = model_path(&a.model.model)?;
    let mut dense = load(&path, &FfnMode::Dense)?;
    let prompt = dense.tok.encode(&chatml(&a.prompt))?;
    println!("prompt: {}", a.prompt);
    let d = run_one(&mut dense, &prompt, a.max_tokens, "dense FFN (candle)")?;
    drop(dense);

    // The input-sparse FFN with the calibrated rule (the artifact's, or calibrated now); files
    // whose FFN blocks have no column layout fall back to exact |h| thresholding.
    let (s, label, realized) = match crate::input::load_input(
        &path,
        settings.threads,
        settings.attention_sparsity > 0.0,
    ) {
        Ok(mut m) => {
            let rule = crate::input::rule_for(&mut m, &path, &settings)?;
            m.model.apply_input_rule(&rule)?;
            let attention = match (&rule.attention, m.model.input_sparse_attention()) {
                (Some(a), true) => format!(", attention {:.0}%", a.fraction * 100.0),
                _ => String::new(),
            };
            let label = format!(
                "{} rule at {:.0}% target (gate/up/down {:.0}/{:.0}/{:.0}% of entries{attention})",
                rule.score,
                rule.target * 100.0,
                rule.allocation[0] * 100.0,
                rule.allocation[1] * 100.0,
                rule.allocation[2] * 100.0
            );
            let s = run_one(
                &mut m,
                &prompt,
                a.max_tokens,
                &format!("input-sparse FFN (powerinfer, {label})"),
            )?;
            let skipped = m.model.take_ffn_traffic().skipped();
            let attention = m.model.take_attention_traffic();
            let attention = if attention.rows > 0 {
                format!(", {:.1}% of the attention's", attention.skipped() * 100.0)
            } else {
                String::new()
            };
            (
                s,
                label,
                format!(
                    "{:.1}% of the FFN weight bytes skipped{attention}",
                    skipped * 100.0
                ),
            )
        }
        Err(e) => {
            eprintln!("no input-sparse FFN for this file ({e:#}); exact |h| thresholding instead");
            let mut sp = load_sparse(&path, &settings)?;
            let label = sp.label.clone();
            sp.m.model.enable_ffn_stats();
            let s = run_one(
                &mut sp.m,
                &prompt,
                a.max_tokens,
                &format!("sparse FFN (powerinfer, {label})"),
            )?;
            let realized = mean_sparsity(&mut sp.m.model);
            (
                s,
                label,
                format!("realized FFN sparsity {:.1}%", realized * 100.0),
            )
        }
    };

    let same = d
        .tokens
        .iter()
        .zip(&s.tokens)
        .filter(|(x, y)| x == y)
        .count();
    let prefix = d
        .tokens
        .iter()
        .zip(&s.tokens)
        .take_while(|(x, y)| x == y)
        .count();
    println!("---");
    println!(
        "dense : {:>3} tokens, prompt {:>7.1} tok/s, decode {:>6.1} tok/s",
        d.tokens.len(),
        d.prompt_tps(),
        d.decode_tps()
    );
    println!(
        "sparse: {:>3} tokens, prompt {:>7.1} tok/s, decode {:>6.1} tok/s, {realized} ({label})",
        s.tokens.len(),
        s.prompt_tps(),
        s.decode_tps(),
    );
    println!(
        "agreement: {same} of {} generated tokens equal, first {prefix} identical",
        d.tokens.len().min(s.tokens.len())
    );
    Ok(())
}
