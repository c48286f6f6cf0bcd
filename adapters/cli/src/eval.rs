//! `powerinfer eval`: perplexity on held-out text, dense and sparse, with realized sparsity.

use anyhow::{bail, Result};
use powerinfer_candle::FfnMode;

use crate::common::{corpus_tokens, load, load_sparse, mean, model_path, spinner, SparseSettings};
use crate::EvalArgs;

pub(crate) fn run(a: &EvalArgs) -> Result<()> {
    if a.ctx < 2 || a.tokens < 2 {
        bail!("--ctx and --tokens must be at least 2");
    }
    let settings = SparseSettings::from_args(&a.model)?;
    let path = model_path(&a.model.model)?;
    let mut dense = load(&path, &FfnMode::Dense)?;
    let text = corpus_tokens(&dense.tok, 2000..=2021, a.tokens)?;
    let pb = spinner(format!(
        "dense perplexity on {} held-out tokens",
        text.len()
    ));
    let ppl_dense = dense.model.perplexity(&text, a.ctx)?;
    pb.finish_and_clear();
    drop(dense);

    let (mut sparse, thresholds) = load_sparse(&path, &settings)?;
    sparse.model.enable_ffn_stats();
    let pb = spinner("sparse perplexity");
    let ppl_sparse = sparse.model.perplexity(&text, a.ctx)?;
    pb.finish_and_clear();
    let per_layer: Vec<f64> = sparse
        .model
        .take_ffn_sparsity()
        .into_iter()
        .flatten()
        .collect();

    println!(
        "held-out: State of the Union 2000-2021, {} tokens, context {}",
        text.len(),
        a.ctx
    );
    println!("dense  perplexity {ppl_dense:.3}");
    println!(
        "sparse perplexity {ppl_sparse:.3} ({:+.2}%), realized FFN sparsity {:.1}% (target {})",
        (ppl_sparse / ppl_dense - 1.0) * 100.0,
        mean(&per_layer) * 100.0,
        match settings.threshold {
            Some(t) => format!("fixed threshold {t}"),
            None => format!("{:.0}%", settings.sparsity * 100.0),
        }
    );
    println!("layer  sparsity  threshold");
    for (l, (s, t)) in per_layer.iter().zip(&thresholds).enumerate() {
        println!("{l:>5}  {:>7.1}%  {t:>9.4}", s * 100.0);
    }
    println!(
        "{}",
        serde_json::json!({
            "tokens": text.len(), "ctx": a.ctx, "ppl_dense": ppl_dense, "ppl_sparse": ppl_sparse,
            "target_sparsity": settings.threshold.is_none().then_some(settings.sparsity),
            "sparsity_per_layer": per_layer, "thresholds": thresholds,
        })
    );
    Ok(())
}
