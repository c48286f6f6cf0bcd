//! `powerinfer demo`: the main job. Dense and sparse generation on the real model, side by side.

use anyhow::Result;
use powerinfer_candle::{FfnMode, GenerateOptions, Generation};

use crate::common::{chatml, load, model_path, stream, Loaded, SparseSettings};
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

    let mut sm = crate::input::load_default_sparse(&path, &settings)?;
    let kind = match sm.input {
        true => "input-sparse FFN",
        false => "sparse FFN",
    };
    let s = run_one(
        &mut sm.m,
        &prompt,
        a.max_tokens,
        &format!("{kind} (powerinfer, {})", sm.label),
    )?;
    let (label, (_, realized)) = (sm.label.clone(), sm.take_skipped());

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
