//! `powerinfer demo`: the main job. Our dense decoder, the default sparse mode and candle's dense
//! model on the real model, one after another, with their speed and how far they agree.

use anyhow::Result;
use powerinfer_candle::{FfnMode, GenerateOptions, Generation, Support};

use crate::common::{chatml, load, load_dense, model_path, stream, Loaded, SparseSettings};
use crate::DemoArgs;
use crate::SparseMode;

/// One mode's run, for the summary.
struct Run {
    name: &'static str,
    generation: Generation,
    /// What it skipped, in words.
    skipped: String,
}

fn run_one(m: &mut Loaded, prompt: &[u32], max_tokens: usize, label: &str) -> Result<Generation> {
    let opts = GenerateOptions {
        max_tokens,
        eos: m.tok.eos.clone(),
        ..Default::default()
    };
    println!("--- {label} ---");
    stream(m, prompt, &opts)
}

/// `(equal, first identical)` generated tokens of `a` and `b`.
fn agreement(a: &[u32], b: &[u32]) -> (usize, usize) {
    let equal = a.iter().zip(b).filter(|(x, y)| x == y).count();
    let prefix = a.iter().zip(b).take_while(|(x, y)| x == y).count();
    (equal, prefix)
}

pub(crate) fn run(a: &DemoArgs) -> Result<()> {
    let mode = a.sparse.mode.unwrap_or(SparseMode::Auto);
    let settings = SparseSettings::for_mode(&a.model, mode)?;
    let path = model_path(&a.model.model)?;
    let mut runs = Vec::new();

    let mut dense = load_dense(&path, settings.threads)?;
    let fused = dense.model.is_fused();
    let prompt = dense.tok.encode(&chatml(&a.prompt))?;
    println!("prompt: {}", a.prompt);
    let label = match fused {
        true => "our dense decoder (powerinfer, fused)",
        false => "dense (candle's model: this file does not run on the fused decoder)",
    };
    let generation = run_one(&mut dense, &prompt, a.max_tokens, label)?;
    drop(dense);
    runs.push(Run {
        name: "dense",
        generation,
        skipped: "nothing skipped".into(),
    });

    let mut sm = crate::input::load_sparse_mode(&path, &settings)?;
    let hot = crate::input::place_hot(&mut sm, &path, &settings, &a.sparse)?;
    let kind = match sm.mode {
        SparseMode::Input => "input-sparse FFN",
        _ => "sparse FFN",
    };
    let mut label = format!("{kind} (powerinfer, {})", sm.label);
    if let Some(b) = a.sparse.vram_budget {
        label += &format!(
            "; {} {b} on {}: {:.1}% of the neurons",
            a.sparse.placement.name(),
            a.sparse.tier,
            100.0 * hot.neuron_share(sm.m.model.config().intermediate)
        );
    }
    let generation = run_one(&mut sm.m, &prompt, a.max_tokens, &label)?;
    let (_, realized) = sm.take_skipped();
    runs.push(Run {
        name: "sparse",
        generation,
        skipped: format!("{realized} ({})", sm.label),
    });
    drop(sm);

    // Candle's ops run the llama, mistral and qwen2 files, not Gemma 3 (the header says which).
    if fused {
        match Support::of(&path)?.candle {
            None => {
                let mut candle = load(&path, &FfnMode::Dense)?;
                let label = "dense (candle's model)";
                let generation = run_one(&mut candle, &prompt, a.max_tokens, label)?;
                runs.push(Run {
                    name: "candle",
                    generation,
                    skipped: "nothing skipped".into(),
                });
            }
            Some(why) => println!("--- dense (candle's model): not run ({why}) ---"),
        }
    }

    println!("---");
    let reference = &runs[0].generation.tokens;
    for r in &runs {
        let g = &r.generation;
        println!(
            "{:<6}: {:>3} tokens, prompt {:>7.1} tok/s, decode {:>6.1} tok/s, {}",
            r.name,
            g.tokens.len(),
            g.prompt_tps(),
            g.decode_tps(),
            r.skipped
        );
    }
    for r in &runs[1..] {
        let (equal, prefix) = agreement(reference, &r.generation.tokens);
        println!(
            "agreement with dense: {} {equal} of {} generated tokens equal, first {prefix} identical",
            r.name,
            reference.len().min(r.generation.tokens.len())
        );
    }
    Ok(())
}
