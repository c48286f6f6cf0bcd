//! `powerinfer analyze`: calibration profiling, predictor training, budgeted placement, and the
//! `.powerinfer` artifact (with pictures next to it).

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{bail, Context, Result};
use indicatif::{ProgressBar, ProgressStyle};
use powerinfer::analysis::{train_low_rank, Samples, TrainOptions, QUANTILE_MAX, QUANTILE_STEPS};
use powerinfer::{
    activation_name, plan_placement, Artifact, ArtifactMeta, CalibrationSummary, LayerMeta,
    LayerTensors,
};
use powerinfer_candle::{model_sha256, native_storage, FfnMode, Sampling};

use crate::common::{load, model_path, text_tokens};
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

/// `--budget`: bytes with an optional K/M/G suffix (powers of 1024), or `auto`.
pub(crate) fn parse_budget(s: &str) -> Result<Option<u64>> {
    if s == "auto" {
        return Ok(None);
    }
    let (num, mult) = match s.trim().to_ascii_uppercase() {
        t if t.ends_with('K') => (t[..t.len() - 1].to_string(), 1u64 << 10),
        t if t.ends_with('M') => (t[..t.len() - 1].to_string(), 1 << 20),
        t if t.ends_with('G') => (t[..t.len() - 1].to_string(), 1 << 30),
        t => (t, 1),
    };
    let v: f64 = num
        .parse()
        .with_context(|| format!("--budget {s}: expected bytes (e.g. 64M) or `auto`"))?;
    if !(v.is_finite() && v > 0.0) {
        bail!("--budget {s}: must be positive");
    }
    Ok(Some((v * mult as f64) as u64))
}

pub(crate) fn run(a: &AnalyzeArgs) -> Result<()> {
    let t0 = Instant::now();
    if !(0.0..1.0).contains(&a.target_sparsity) {
        bail!(
            "--target-sparsity {}: expected a value in [0, 1)",
            a.target_sparsity
        );
    }
    if a.train_rows == 0 || a.val_rows == 0 {
        bail!("--train-rows and --val-rows must be at least 1");
    }
    if !(0.0..=0.95).contains(&a.attention_sparsity) {
        bail!(
            "--attention-sparsity {}: expected a value in [0, 0.95]",
            a.attention_sparsity
        );
    }
    let budget = parse_budget(&a.budget)?;
    let opts = TrainOptions {
        rank: a.rank,
        epochs: a.epochs,
        target_recall: a.recall,
        batch: a.batch,
        lr: a.lr,
        pos_weight: a.pos_weight,
        ..Default::default()
    };
    opts.validate()?;
    let path = model_path(&a.model)?;
    let out = match &a.out {
        Some(o) => o.clone(),
        None => path.with_extension("powerinfer"),
    };
    let sha = model_sha256(&path)?;
    let storage = native_storage(&path)?;
    let mut m = load(&path, &FfnMode::Analysis)?;
    let cfg = m.model.config().clone();
    let (tokens, sources) = text_tokens(&m.tok, &a.calibration, 1790..=1999, a.tokens)?;
    eprintln!(
        "calibration: {} tokens from {} ({} layers x {} neurons)",
        tokens.len(),
        describe(&sources),
        cfg.layers,
        cfg.intermediate
    );

    // 1. Per-layer |h| thresholds for the target sparsity.
    let head = &tokens[..a.threshold_tokens.min(tokens.len())];
    let pb = bar(head.len() as u64, "thresholds (|h| histogram)");
    let hist = m
        .model
        .magnitude_stats(head, a.ctx, &mut |d| pb.set_position(d as u64))?;
    pb.finish();
    let quantile = |s: &powerinfer::analysis::ActivationStats, q: f64| {
        s.threshold_for_sparsity(q)
            .context("no activations recorded (is the calibration text empty?)")
    };
    let thresholds = hist
        .iter()
        .map(|s| quantile(s, a.target_sparsity))
        .collect::<Result<Vec<f32>>>()?;
    let h_quantiles = hist
        .iter()
        .map(|s| {
            (0..=QUANTILE_STEPS)
                .map(|k| quantile(s, k as f64 / QUANTILE_STEPS as f64 * QUANTILE_MAX))
                .collect::<Result<Vec<f32>>>()
        })
        .collect::<Result<Vec<_>>>()?;
    eprintln!("thresholds: {:.0} s", t0.elapsed().as_secs_f64());

    // 2. Activation counts over all calibration tokens, and training rows.
    let rows = a.train_rows + a.val_rows;
    let sampling = Sampling {
        every: (tokens.len() / rows).max(1),
        max: rows,
    };
    let pb = bar(tokens.len() as u64, "profiling (counts, samples)");
    let profile = m
        .model
        .profile(&tokens, a.ctx, &thresholds, sampling, &mut |d| {
            pb.set_position(d as u64)
        })?;
    pb.finish();
    eprintln!("profiled: {:.0} s", t0.elapsed().as_secs_f64());
    drop(m);

    // 3. One predictor per layer.
    let pb = bar((cfg.layers * a.epochs) as u64, "training predictors");
    let mut trained = Vec::with_capacity(cfg.layers);
    for (l, samples) in profile.samples.iter().enumerate() {
        let mut train: Samples = samples.clone();
        let n_train = (train.len() * a.train_rows / rows).max(1);
        let val = train.split_off(n_train);
        let t = train_low_rank(&train, &val, &opts, &mut |e, loss| {
            pb.set_message(format!("training layer {l}, epoch {e}, loss {loss:.4}"));
            tracing::info!(layer = l, epoch = e, loss, "training");
            pb.inc(1);
        })
        .with_context(|| format!("training the layer {l} predictor"))?;
        trained.push((t, train.len(), val.len()));
    }
    pb.finish();
    eprintln!("trained: {:.0} s", t0.elapsed().as_secs_f64());

    // 4. Placement under the budget, predictors counted first.
    let spec = powerinfer::FfnSpec::new(cfg.hidden, cfg.intermediate, cfg.activation, true)?;
    let neuron_bytes = spec.neuron_bytes(storage) as u64;
    let predictor_bytes: u64 = trained
        .iter()
        .map(|(t, _, _)| ((t.fc1.len() + t.fc2.len()) * 2 + t.bias.len() * 4) as u64)
        .sum();
    let ffn_bytes = neuron_bytes * (cfg.intermediate * cfg.layers) as u64;
    let budget = budget.unwrap_or(ffn_bytes / 2 + predictor_bytes);
    if budget < predictor_bytes + neuron_bytes {
        bail!(
            "--budget {budget} bytes: the predictors alone take {predictor_bytes} bytes and one \
             neuron {neuron_bytes}; give at least {}",
            predictor_bytes + neuron_bytes
        );
    }
    let freqs: Vec<Vec<f64>> = profile.stats.iter().map(|s| s.frequencies()).collect();
    let placement = plan_placement(
        &freqs,
        &vec![neuron_bytes; cfg.layers],
        budget - predictor_bytes,
    )?;

    // 5. The artifact.
    let layers_meta = trained
        .iter()
        .zip(&thresholds)
        .map(|((t, _, _), &h)| LayerMeta {
            hidden: cfg.hidden,
            intermediate: cfg.intermediate,
            activation: activation_name(cfg.activation).into(),
            gated: true,
            h_threshold: h,
            rank: t.rank,
            score_threshold: t.threshold,
            val_recall: t.quality.recall,
            val_precision: t.quality.precision,
            val_predicted: t.quality.predicted,
            val_truth: t.quality.truth,
            val_mass: t.quality.mass,
        })
        .collect();
    let layers = trained
        .iter()
        .zip(&profile.stats)
        .zip(&placement.layers)
        .zip(h_quantiles)
        .map(|((((t, _, _), s), p), hq)| LayerTensors {
            fc1: t.fc1.iter().map(|&x| half::f16::from_f32(x)).collect(),
            fc2: t.fc2.iter().map(|&x| half::f16::from_f32(x)).collect(),
            fc2_bias: t.bias.clone(),
            hot: p.hot().to_vec(),
            counts: s
                .counts
                .iter()
                .map(|&c| c.min(u64::from(u32::MAX)) as u32)
                .collect(),
            score_quantiles: t.quantiles.clone(),
            h_quantiles: hq,
        })
        .collect();
    let (n_train, n_val) = trained.first().map_or((0, 0), |(_, a, b)| (*a, *b));
    // The input-sparse rule, calibrated on the same threshold tokens (GGUF Q4_0/Q4_1/Q8_0 FFNs
    // and float checkpoints; other block types have no column layout yet).
    let threads = powerinfer::HybridOptions::default().threads;
    let attention = a.attention_sparsity;
    let input_rule = match crate::input::load_input(&path, threads, attention > 0.0) {
        Ok(mut im) => Some(crate::input::default_rule(
            &mut im.model,
            head,
            a.ctx,
            attention,
        )?),
        Err(e) => {
            eprintln!("no input-sparse rule in the artifact: {e:#}");
            None
        }
    };
    let artifact = Artifact {
        meta: ArtifactMeta {
            model_sha256: sha,
            model_file: path
                .file_name()
                .map_or_else(String::new, |f| f.to_string_lossy().into_owned()),
            budget,
            hot_bytes: placement.used,
            predictor_bytes,
            calibration: CalibrationSummary {
                sources,
                tokens: tokens.len() as u64,
                threshold_tokens: head.len() as u64,
                train_rows: n_train as u64,
                val_rows: n_val as u64,
                target_sparsity: a.target_sparsity,
                target_recall: a.recall,
                rank: a.rank,
                epochs: a.epochs,
                seconds: t0.elapsed().as_secs_f64(),
            },
            layers: layers_meta,
            input_rule,
        },
        layers,
    };
    artifact.save(&out)?;
    report(&artifact, &out, t0.elapsed().as_secs_f64(), ffn_bytes);
    let pictures = pictures(&artifact, &out, &freqs, neuron_bytes)?;
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
