//! `powerinfer eval`: perplexity on held-out text, dense and sparse, with realized sparsity; with
//! an artifact also the trained predictors' per-layer recall, precision, captured activation mass
//! and cost, and a sparsity sweep with its picture.

use anyhow::{bail, Result};
use powerinfer::analysis::PredictorAudit;
use serde_json::json;

use crate::analyze::picture_stem;
use crate::args::{InputRule, SparseMode};
use crate::common::{
    load_reference, load_sparse, mean, model_path, spinner, text_tokens, Scoring, Sparse,
    SparseSettings,
};
use crate::output::say;
use crate::plots::{bytes_perplexity, sparsity_perplexity, Series};
use crate::EvalArgs;

/// Perplexity of the sparse model as configured now, and its realized sparsity per layer.
fn sparse_run(
    sp: &mut Sparse,
    text: &[u32],
    ctx: usize,
    scoring: Scoring,
) -> Result<(f64, Vec<f64>)> {
    let pb = spinner(format!("perplexity: {}", sp.label));
    sp.m.model.enable_ffn_stats();
    let ppl = scoring.perplexity(&mut sp.m.model, text, ctx)?;
    pb.finish_and_clear();
    let per_layer =
        sp.m.model
            .take_ffn_sparsity()
            .into_iter()
            .flatten()
            .collect();
    Ok((ppl, per_layer))
}

/// The sparse mode as `demo` and `generate --sparse` run it: its perplexity on `text` against
/// `ppl_dense`, and what it skipped.
fn default_run(
    path: &std::path::Path,
    settings: &SparseSettings,
    text: &[u32],
    ctx: usize,
    scoring: Scoring,
    ppl_dense: f64,
    hot: &crate::SparseArgs,
) -> Result<()> {
    let mut sm = crate::input::load_sparse_mode(path, settings)?;
    crate::input::place_hot(&mut sm, path, settings, hot)?;
    if let Some(b) = hot.vram_budget {
        sm.label += &format!("; {} {b} on {}", hot.placement.name(), hot.tier);
    }
    sm.take_skipped();
    let pb = spinner(format!("perplexity: {}", sm.label));
    let ppl = scoring.perplexity(&mut sm.m.model, text, ctx)?;
    pb.finish_and_clear();
    let (share, skipped) = sm.take_skipped();
    say!(
        "sparse perplexity {ppl:.3} ({:+.2}%), {skipped} ({})",
        (ppl / ppl_dense - 1.0) * 100.0,
        sm.label
    );
    crate::output::record(json!({
        "tokens": text.len(), "ctx": ctx, "ppl_dense": ppl_dense, "ppl_sparse": ppl,
        "mode": sm.mode.name(), "rule": sm.label,
        "skipped": share,
    }));
    Ok(())
}

pub(crate) fn run(a: &EvalArgs) -> Result<()> {
    if a.ctx < 2 || a.tokens < 2 {
        bail!("--ctx and --tokens must be at least 2");
    }
    let sweep = &a.sweep;
    let mode = a.sparse.mode.unwrap_or(SparseMode::Auto);
    let mut settings = SparseSettings::for_mode(&a.model, mode)?;
    if !sweep.is_empty() && mode != SparseMode::Predictors {
        bail!(
            "--sweep needs --sparse=predictors --powerinfer ARTIFACT (its quantiles set each \
             point's thresholds)"
        );
    }
    let path = model_path(&a.model.model)?;
    if a.input_rules.is_empty() {
        settings.mode = crate::input::resolve_mode(&path, &settings)?;
    }
    let mut dense = load_reference(&path, settings.threads)?;
    let (mut text, sources) = text_tokens(&dense.tok, &a.text, 2000..=2021, a.tokens)?;
    let scoring = if a.llama_cpp_rule {
        // llama.cpp scores the text as one sequence: BOS first when the vocabulary adds one.
        if let (true, Some(b)) = (dense.tok.add_bos, dense.tok.bos) {
            text.insert(0, b);
        }
        Scoring::llama_cpp(&dense.tok)
    } else {
        Scoring::Windows
    };
    let source = if a.text.is_empty() {
        "State of the Union 2000-2021".to_string()
    } else {
        sources.join(", ")
    };
    let pb = spinner(format!(
        "dense perplexity on {} held-out tokens",
        text.len()
    ));
    let ppl_dense = scoring.perplexity(&mut dense.model, &text, a.ctx)?;
    pb.finish_and_clear();
    drop(dense);
    say!(
        "held-out: {source}, {} tokens, context {}",
        text.len(),
        a.ctx
    );
    say!("dense perplexity {ppl_dense:.3}");
    let rel = |p: f64| (p / ppl_dense - 1.0) * 100.0;

    if !a.input_rules.is_empty() {
        let rules = &a.input_rules;
        return input_sweep(a, &path, &settings, rules, &text, ppl_dense, scoring);
    }
    if settings.mode == SparseMode::Input {
        return default_run(
            &path, &settings, &text, a.ctx, scoring, ppl_dense, &a.sparse,
        );
    }
    let mut sp = load_sparse(&path, &settings)?;
    if settings.mode == SparseMode::GateFirst {
        let (ppl, per_layer) = sparse_run(&mut sp, &text, a.ctx, scoring)?;
        say!(
            "sparse perplexity {ppl:.3} ({:+.2}%), realized FFN sparsity {:.1}% ({})",
            rel(ppl),
            mean(&per_layer) * 100.0,
            sp.label
        );
        say!("layer  sparsity  threshold");
        for (l, (s, t)) in per_layer.iter().zip(&sp.thresholds).enumerate() {
            say!("{l:>5}  {:>7.1}%  {t:>9.4}", s * 100.0);
        }
        crate::output::record(json!({
            "tokens": text.len(), "ctx": a.ctx, "ppl_dense": ppl_dense, "ppl_sparse": ppl,
            "mode": settings.mode.name(),
            "target_sparsity": settings.threshold.is_none().then(|| settings.gate_first_sparsity()),
            "sparsity_per_layer": per_layer, "thresholds": sp.thresholds,
        }));
        return Ok(());
    }

    // Exact thresholding at the artifact's |h| thresholds: the quality ceiling of any predictor.
    sp.use_exact(None)?;
    let (ppl_exact, exact_layers) = sparse_run(&mut sp, &text, a.ctx, scoring)?;
    // The trained predictors, audited against the exact sets on the same held-out text.
    sp.use_trained(settings.target)?;
    sp.m.model.enable_audit(&sp.thresholds)?;
    let (ppl_pred, _) = sparse_run(&mut sp, &text, a.ctx, scoring)?;
    let audits: Vec<PredictorAudit> = sp.m.model.take_audit().into_iter().flatten().collect();
    let costs = predictor_costs(&sp);
    let realized = |v: &[PredictorAudit]| mean(&v.iter().map(|x| x.sparsity()).collect::<Vec<_>>());
    say!(
        "exact thresholding  perplexity {ppl_exact:.3} ({:+.2}%), realized FFN sparsity {:.1}%",
        rel(ppl_exact),
        mean(&exact_layers) * 100.0
    );
    say!(
        "trained predictors  perplexity {ppl_pred:.3} ({:+.2}%), realized FFN sparsity {:.1}% ({})",
        rel(ppl_pred),
        realized(&audits) * 100.0,
        sp.label
    );
    say!("layer  sparsity  recall  precision  mass kept  predictor KiB  us/token");
    for (l, (x, bytes)) in audits.iter().zip(&costs).enumerate() {
        say!(
            "{l:>5}  {:>7.1}%  {:>6.3}  {:>9.3}  {:>8.1}%  {:>13.1}  {:>7.1}",
            x.sparsity() * 100.0,
            x.recall(),
            x.precision(),
            x.mass_captured() * 100.0,
            *bytes as f64 / 1024.0,
            x.predict_time.as_secs_f64() * 1e6 / x.tokens.max(1) as f64
        );
    }
    let min_recall = audits.iter().map(|x| x.recall()).fold(1.0, f64::min);
    say!(
        "recall of above-threshold neurons: min {min_recall:.3}, mean {:.3} over {} layers",
        mean(&audits.iter().map(|x| x.recall()).collect::<Vec<_>>()),
        audits.len()
    );

    // The sweep: exact and trained at each target sparsity, from the artifact's quantiles.
    let (mut exact_pts, mut pred_pts) = (Vec::new(), Vec::new());
    for &s in sweep {
        sp.use_exact(Some(s))?;
        let (p, layers) = sparse_run(&mut sp, &text, a.ctx, scoring)?;
        exact_pts.push((mean(&layers), p));
        sp.use_trained(Some(s))?;
        let (q, layers) = sparse_run(&mut sp, &text, a.ctx, scoring)?;
        pred_pts.push((mean(&layers), q));
        say!(
            "sweep {:>3.0}%: exact {p:.3} ({:+.2}%, realized {:.1}%), trained {q:.3} ({:+.2}%, realized {:.1}%)",
            s * 100.0,
            rel(p),
            exact_pts.last().map_or(0.0, |x| x.0) * 100.0,
            rel(q),
            pred_pts.last().map_or(0.0, |x| x.0) * 100.0,
        );
    }
    let mut pictures = Vec::new();
    if !sweep.is_empty() {
        let artifact = settings.artifact.as_deref().unwrap_or(path.as_path());
        let (dir, stem) = picture_stem(artifact);
        let series = [
            Series {
                name: "exact |h| thresholding".into(),
                points: exact_pts.clone(),
            },
            Series {
                name: "trained predictors".into(),
                points: pred_pts.clone(),
            },
        ];
        pictures = sparsity_perplexity(
            &dir,
            &format!("{stem}.sweep"),
            &format!(
                "FFN sparsity vs perplexity ({} held-out tokens)",
                text.len()
            ),
            ppl_dense,
            &series,
        )?;
        print_pictures(&pictures);
    }
    crate::output::record(json!({
        "tokens": text.len(), "ctx": a.ctx, "ppl_dense": ppl_dense,
        "exact": {"ppl": ppl_exact, "sparsity_per_layer": exact_layers},
        "trained": {
            "ppl": ppl_pred,
            "sparsity_per_layer": audits.iter().map(|x| x.sparsity()).collect::<Vec<_>>(),
            "recall": audits.iter().map(|x| x.recall()).collect::<Vec<_>>(),
            "precision": audits.iter().map(|x| x.precision()).collect::<Vec<_>>(),
            "mass_captured": audits.iter().map(|x| x.mass_captured()).collect::<Vec<_>>(),
            "predictor_bytes": costs,
            "predict_us_per_token": audits.iter().map(|x| x.predict_time.as_secs_f64() * 1e6 / x.tokens.max(1) as f64).collect::<Vec<_>>(),
        },
        "sweep": sweep.iter().zip(exact_pts.iter().zip(&pred_pts)).map(|(s, (e, p))| json!({
            "target": s, "exact": {"sparsity": e.0, "ppl": e.1}, "trained": {"sparsity": p.0, "ppl": p.1},
        })).collect::<Vec<_>>(),
        "pictures": pictures,
    }));
    Ok(())
}

/// Bytes of each layer's predictor.
fn predictor_costs(sp: &Sparse) -> Vec<usize> {
    sp.m.model
        .ffns()
        .filter_map(|f| match f {
            powerinfer_candle::Ffn::Hybrid(h) => Some(h.predictor().weight_bytes()),
            _ => None,
        })
        .collect()
}

/// `--input-rules`: each rule at each target, its split chosen on calibration text, its
/// held-out perplexity and the share of FFN weight bytes skipped; with `--input-attention`, each
/// point also at each attention fraction. A JSON line per point.
fn input_sweep(
    a: &EvalArgs,
    path: &std::path::Path,
    settings: &SparseSettings,
    rules: &[InputRule],
    text: &[u32],
    ppl_dense: f64,
    scoring: Scoring,
) -> Result<()> {
    let targets = &a.input_sweep;
    let split = a.input_split;
    let mut attention = a.input_attention.clone();
    attention.retain(|&x| x > 0.0);
    attention.insert(0, 0.0);
    let with_attention = attention.len() > 1;
    // One model per layout: up as columns (teal, wina, h) or as rows (chess).
    let mut models: [Option<crate::input::InputModel>; 2] = [None, None];
    let rel = |p: f64| (p / ppl_dense - 1.0) * 100.0;
    say!("rule  target  split     allocation (gate/up/down)  attention  calib ppl  held-out ppl  vs dense  FFN bytes skipped  projection bytes skipped");
    let mut series = Vec::new();
    for &rule in rules {
        let im = match &mut models[usize::from(rule.up_rows())] {
            Some(im) => im,
            slot => {
                let mut im = crate::input::InputModel::load(
                    path,
                    settings.threads,
                    settings.calibration_tokens,
                    a.ctx,
                    with_attention,
                    rule.up_rows(),
                )?;
                im.scoring = scoring;
                slot.insert(im)
            }
        };
        let mut points = vec![Vec::new(); attention.len()];
        for &s in targets {
            if with_attention {
                im.set_attention(0.0)?;
            }
            let (chosen, alloc, calib) = im.choose(rule, s, split, 1024)?;
            let split_name = chosen.map_or("-".to_string(), |s| s.name());
            for (i, &att) in attention.iter().enumerate() {
                if with_attention {
                    im.set_attention(att)?;
                }
                let pb = spinner(format!(
                    "{} at {:.0}%, attention {:.0}%",
                    rule.name(),
                    s * 100.0,
                    att * 100.0
                ));
                let (p, ffn, attn) = im.perplexity(text)?;
                pb.finish_and_clear();
                let mut all = ffn;
                all.add(&attn);
                let (skipped, projections) = (ffn.skipped(), all.skipped());
                points[i].push((if with_attention { projections } else { skipped }, p));
                say!(
                    "{:<5} {:>5.0}%  {:<8}  {:>4.0}% / {:>3.0}% / {:>3.0}%          {:>8.0}%  {calib:>9.3}  {p:>12.3}  {:>+7.2}%  {:>16.1}%  {:>23.1}%",
                    rule.name(),
                    s * 100.0,
                    split_name,
                    alloc[0] * 100.0,
                    alloc[1] * 100.0,
                    alloc[2] * 100.0,
                    att * 100.0,
                    rel(p),
                    skipped * 100.0,
                    projections * 100.0,
                );
                crate::output::record(json!({
                    "rule": rule.name(), "target": s, "split": split_name, "allocation": alloc,
                    "attention": att, "tokens": text.len(), "ctx": a.ctx,
                    "ppl_dense": ppl_dense, "ppl_sparse": p, "ffn_bytes_skipped": skipped,
                    "attention_bytes_skipped": attn.skipped(),
                    "projection_bytes_skipped": projections, "calibration_ppl": calib,
                }));
            }
        }
        for (points, &att) in points.into_iter().zip(&attention) {
            // Points past 1.5x the dense perplexity would flatten every other curve: left out
            // of the picture (they are in the table and the JSON lines).
            let kept: Vec<(f64, f64)> = points
                .iter()
                .copied()
                .filter(|&(_, p)| p <= 1.5 * ppl_dense)
                .collect();
            let cut = if kept.len() < points.len() {
                " (points above 1.5x dense left out)"
            } else {
                ""
            };
            let name = match rule {
                InputRule::H => "|h| on down only".to_string(),
                InputRule::Chess => "chess (up rows, |h| on down)".to_string(),
                InputRule::Teal | InputRule::Wina => format!("{} (gate, up, down)", rule.name()),
            };
            let att = if with_attention {
                format!(", attention {:.0}%", att * 100.0)
            } else {
                String::new()
            };
            series.push(Series {
                name: format!("{name}{att}{cut}"),
                points: kept,
            });
        }
    }
    let (dir, stem) = picture_stem(path);
    let (what, x) = if with_attention {
        (
            "input-attention",
            "FFN and attention weight bytes skipped per token (%)",
        )
    } else {
        ("input-sweep", "FFN weight bytes skipped per token (%)")
    };
    let pictures = bytes_perplexity(
        &dir,
        &format!("{stem}.{what}"),
        &format!(
            "Input sparsity: bytes skipped vs perplexity ({} held-out tokens)",
            text.len()
        ),
        x,
        ppl_dense,
        &series,
    )?;
    print_pictures(&pictures);
    Ok(())
}

fn print_pictures(pictures: &[std::path::PathBuf]) {
    let names: Vec<String> = pictures.iter().map(|p| p.display().to_string()).collect();
    say!("pictures: {}", names.join(", "));
}
