//! `powerinfer analyze`: calibration profiling, predictor training, budgeted placement, and the
//! `.powerinfer` artifact (with pictures next to it).

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::Result;
use indicatif::{ProgressBar, ProgressStyle};
use powerinfer::analysis::TrainOptions;
use powerinfer::Artifact;
use powerinfer_candle::{analyze, AnalyzeOptions, InputRuleOptions, Progress};

use crate::common::{model_path, text_tokens};
use crate::AnalyzeArgs;

fn bar(len: u64, what: &str) -> ProgressBar {
    let pb = ProgressBar::new(len);
    pb.set_style(
        ProgressStyle::with_template("{msg} [{bar:30}] {pos}/{len} [{elapsed} < {eta}]")
            .unwrap_or_else(|_| ProgressStyle::default_bar())
            .progress_chars("=> "),
    );
    pb.set_message(what.to_string());
    pb
}

pub(crate) fn run(a: &AnalyzeArgs) -> Result<()> {
    let t0 = Instant::now();
    let opts = AnalyzeOptions {
        target_sparsity: a.target_sparsity,
        threshold_tokens: a.threshold_tokens,
        ctx: a.ctx,
        train_rows: a.train_rows,
        val_rows: a.val_rows,
        train: TrainOptions {
            rank: a.rank,
            epochs: a.epochs,
            target_recall: a.recall,
            batch: a.batch,
            lr: a.lr,
            pos_weight: a.pos_weight,
            ..Default::default()
        },
        budget: a.budget.0,
        input_rule: Some(InputRuleOptions {
            attention: a.attention_sparsity,
            ..Default::default()
        }),
        ..Default::default()
    };
    opts.validate()?;
    let path = model_path(&a.model)?;
    let out = match &a.out {
        Some(o) => o.clone(),
        None => path.with_extension("powerinfer"),
    };
    let tok = powerinfer_candle::TextTokenizer::open(&path)?;
    let (tokens, sources) = text_tokens(&tok, &a.calibration, 1790..=1999, a.tokens)?;
    eprintln!(
        "calibration: {} tokens from {}",
        tokens.len(),
        describe(&sources)
    );
    let mut stage = None::<(&'static str, ProgressBar)>;
    let mut show = |p: Progress| {
        let (name, len, pos) = match p {
            Progress::Thresholds { done, total } => ("thresholds (|h| histogram)", total, done),
            Progress::Profiling { done, total } => ("profiling (counts, samples)", total, done),
            Progress::Training { done, total, .. } => ("training predictors", total, done),
            Progress::InputRule => ("input rule", 0, 0),
        };
        if stage.as_ref().map(|(n, _)| *n) != Some(name) {
            if let Some((n, pb)) = stage.take() {
                pb.finish();
                eprintln!("{n}: done at {:.0} s", t0.elapsed().as_secs_f64());
            }
            stage = Some((name, bar(len as u64, name)));
        }
        if let Some((_, pb)) = &stage {
            pb.set_position(pos as u64);
            if let Progress::Training {
                layer, epoch, loss, ..
            } = p
            {
                pb.set_message(format!(
                    "training layer {layer}, epoch {epoch}, loss {loss:.4}"
                ));
                tracing::info!(layer, epoch, loss, "training");
            }
        }
    };
    let analysis = analyze(&path, &tokens, &sources, &opts, &mut show)?;
    if let Some((_, pb)) = stage {
        pb.finish();
    }
    let artifact = &analysis.artifact;
    artifact.save(&out)?;
    report(
        artifact,
        &out,
        t0.elapsed().as_secs_f64(),
        analysis.ffn_bytes,
    );
    let pictures = pictures(artifact, &out, &analysis.frequencies, analysis.neuron_bytes)?;
    println!("pictures: {}", pictures.join(", "));
    Ok(())
}

/// The analysis pictures, next to the artifact.
fn pictures(
    a: &Artifact,
    out: &Path,
    freqs: &[Vec<f64>],
    neuron_bytes: u64,
) -> Result<Vec<String>> {
    let (dir, stem) = picture_stem(out);
    let model = &a.meta.model_file;
    let mut files = crate::plots::frequency_curves(
        &dir,
        &format!("{stem}.frequency"),
        &format!("{model}: neuron activation frequency per layer (sorted)"),
        freqs,
    )?;
    files.extend(crate::plots::frequency_heatmap(
        &dir,
        &format!("{stem}.heatmap"),
        &format!("{model}: activation frequency, layer x neuron"),
        freqs,
    )?);
    let split: Vec<crate::plots::SplitLayer> = a
        .layers
        .iter()
        .zip(&a.meta.layers)
        .map(|(t, m)| crate::plots::SplitLayer {
            hot_bytes: t.hot.len() as u64 * neuron_bytes,
            cold_bytes: (m.intermediate - t.hot.len()) as u64 * neuron_bytes,
        })
        .collect();
    files.extend(crate::plots::placement_split(
        &dir,
        &format!("{stem}.placement"),
        &format!("{model}: hot (fast tier) / cold (CPU) split"),
        &split,
        a.meta.budget,
        a.meta.predictor_bytes,
    )?);
    Ok(files.iter().map(|p| p.display().to_string()).collect())
}

fn describe(sources: &[String]) -> String {
    match sources {
        [] => "nothing".into(),
        [one] => one.clone(),
        [first, .., last] => format!("{} files ({first} .. {last})", sources.len()),
    }
}

fn report(a: &Artifact, out: &Path, seconds: f64, ffn_bytes: u64) {
    let m = &a.meta;
    println!(
        "wrote {} in {seconds:.0} s: {} layers, rank {}, target sparsity {:.0}%, target recall {:.2}",
        out.display(),
        m.layers.len(),
        m.calibration.rank,
        m.calibration.target_sparsity * 100.0,
        m.calibration.target_recall
    );
    println!(
        "budget {} bytes: hot neurons {} + predictors {} (FFN weights {} bytes in all)",
        m.budget, m.hot_bytes, m.predictor_bytes, ffn_bytes
    );
    println!(
        "layer  |h| thr   score thr  val recall  precision  predicted  truth  mass kept   hot"
    );
    for (l, (lm, t)) in m.layers.iter().zip(&a.layers).enumerate() {
        println!(
            "{l:>5}  {:>8.4}  {:>9.3}  {:>10.3}  {:>9.3}  {:>8.1}%  {:>5.1}%  {:>8.1}%  {:>4}",
            lm.h_threshold,
            lm.score_threshold,
            lm.val_recall,
            lm.val_precision,
            lm.val_predicted * 100.0,
            lm.val_truth * 100.0,
            lm.val_mass * 100.0,
            t.hot.len()
        );
    }
    println!(
        "{}",
        serde_json::json!({
            "artifact": out, "seconds": seconds, "budget": m.budget, "hot_bytes": m.hot_bytes,
            "predictor_bytes": m.predictor_bytes, "calibration": m.calibration,
            "val_recall": m.layers.iter().map(|l| l.val_recall).collect::<Vec<_>>(),
            "val_predicted": m.layers.iter().map(|l| l.val_predicted).collect::<Vec<_>>(),
            "val_mass": m.layers.iter().map(|l| l.val_mass).collect::<Vec<_>>(),
        })
    );
}

/// Where pictures for `artifact` go: its directory and file stem.
pub(crate) fn picture_stem(artifact: &Path) -> (PathBuf, String) {
    let dir = artifact
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .map_or_else(|| PathBuf::from("."), Path::to_path_buf);
    let stem = artifact
        .file_stem()
        .map_or_else(|| "powerinfer".into(), |s| s.to_string_lossy().into_owned());
    (dir, stem)
}
