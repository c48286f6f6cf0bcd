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

    let mut sp = load_sparse(&path, &settings)?;
    let label = format!("sparse FFN (powerinfer, {})", sp.label);
    let sparse = &mut sp.m;
    sparse.model.enable_ffn_stats();
    let s = run_one(sparse, &prompt, a.max_tokens, &label)?;
    let realized = mean_sparsity(&mut sparse.model);

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
        "sparse: {:>3} tokens, prompt {:>7.1} tok/s, decode {:>6.1} tok/s, realized FFN sparsity {:.1}% ({})",
        s.tokens.len(),
        s.prompt_tps(),
        s.decode_tps(),
        realized * 100.0,
        sp.label,
    );
    println!(
        "agreement: {same} of {} generated tokens equal, first {prefix} identical",
        d.tokens.len().min(s.tokens.len())
    );
    Ok(())
}
