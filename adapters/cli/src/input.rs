//! The input-sparse FFN (TEAL / WINA rules) in the CLI: calibration on the calibration mix, the
//! choice of how a target FFN sparsity is split between gate, up and down, and its evaluation.

use anyhow::Result;
use powerinfer::analysis::Histogram;
use powerinfer::{
    format::InputRuleMeta, input_rule::split_target, input_rule::GreedyPath, InputScore,
    InputScores, InputThresholds, WeightTraffic,
};
use powerinfer_candle::{FfnMode, InputRuleOptions, Layouts, TargetSearch};

use crate::args::{InputRule, SparseMode};
use crate::common::{load, load_sparse, mean_sparsity, spinner, CalibrationMix, Loaded};
use crate::rule_cache;

/// Loads `path` for the input rule: the input-sparse FFN with its matrices laid out as
/// `layouts` says, and with `attention` (GGUF files only) the attention projections on
/// input-sparse columns.
pub(crate) fn load_input(
    path: &std::path::Path,
    threads: usize,
    attention: bool,
    layouts: Layouts,
) -> Result<Loaded> {
    load(
        path,
        &FfnMode::InputSparse {
            threads,
            attention,
            up_rows: false,
            artifact: None,
            layouts,
        },
    )
}

/// The fractions of gate's, up's and down's entries the rule will drop, where that is known
/// before loading: the artifact's rule, `--target`'s, or the one `auto` chose earlier for
/// this file (cached). `None` on `auto`'s first run.
fn planned_drop(
    path: &std::path::Path,
    settings: &crate::common::SparseSettings,
) -> Result<Option<[f64; 3]>> {
    if let Some(p) = &settings.artifact {
        if let Some(r) = powerinfer::Artifact::load(p)?.meta.input_rule {
            return Ok(Some(r.allocation));
        }
    }
    if let Some(target) = settings.target {
        let opts = InputRuleOptions {
            target,
            ..Default::default()
        };
        return Ok(Some(opts.fractions()));
    }
    Ok(auto_key(path, settings)?.read().map(|r| r.allocation))
}

/// The layouts of the default sparse mode: each FFN matrix by column only where that measures
/// faster than dense rows at the fractions `drop` (else the default rule's) says the rule
/// drops. `POWERINFER_LAYOUTS=columns` puts every matrix by column (to measure the column
/// kernels).
fn measured_layouts(drop: Option<[f64; 3]>) -> Layouts {
    if std::env::var("POWERINFER_LAYOUTS").as_deref() == Ok("columns") {
        return Layouts::Columns;
    }
    Layouts::Measured {
        drop: drop.unwrap_or_else(|| InputRuleOptions::default().fractions()),
    }
}

/// Step of the greedy allocation (share of a matrix's entries per step).
pub(crate) const GREEDY_STEP: f64 = 0.025;

/// `--input-split`: how a target share is split between gate, up and down.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Split {
    /// In every layer, down drops this multiple of the target; gate and up share the rest.
    Down(f64),
    /// TEAL's greedy allocation, per layer, by the FFN output error on sampled rows.
    Greedy,
}

impl std::str::FromStr for Split {
    type Err = String;

    /// `greedy`, or down's multiple (`1.5`).
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s.trim() {
            "greedy" => Ok(Split::Greedy),
            f => match f.parse::<f64>() {
                Ok(f) if (0.0..=3.0).contains(&f) => Ok(Split::Down(f)),
                _ => Err(format!(
                    "a split is `greedy` or down's multiple of the target in [0, 3], not `{s}`"
                )),
            },
        }
    }
}

impl Split {
    /// For tables and JSON: `greedy`, `down1.5x`.
    pub fn name(self) -> String {
        match self {
            Split::Down(f) => format!("down{f}x"),
            Split::Greedy => "greedy".into(),
        }
    }
}

/// The candidate splits: uniform, down taking 1.5x and 2x its share, and the greedy one.
pub(crate) const SPLITS: [Split; 4] = [
    Split::Down(1.0),
    Split::Down(1.5),
    Split::Down(2.0),
    Split::Greedy,
];

/// Per-layer fractions of `split` at target `s`, the greedy ones read from `paths`.
fn fractions(split: Split, s: f64, paths: &[GreedyPath]) -> Result<Vec<[f64; 3]>> {
    match split {
        Split::Down(f) => Ok(vec![split_target(s, f); paths.len()]),
        Split::Greedy => paths
            .iter()
            .map(|p| p.at(s))
            .collect::<Option<_>>()
            .ok_or_else(|| anyhow::anyhow!("the greedy path stops short of {s}")),
    }
}

/// The mean of per-layer fractions.
pub(crate) fn mean(fr: &[[f64; 3]]) -> [f64; 3] {
    let n = fr.len().max(1) as f64;
    [0, 1, 2].map(|m| fr.iter().map(|f| f[m]).sum::<f64>() / n)
}

/// A model on the input-sparse FFN with its calibration histograms per rule.
pub(crate) struct InputModel {
    pub m: Loaded,
    /// Windows of the calibration text.
    pub ctx: usize,
    /// How [`InputModel::perplexity`] scores (calibration always scores every window's tokens).
    pub scoring: crate::common::Scoring,
    calib: Vec<u32>,
    scores: Vec<(InputScore, Vec<InputScores>)>,
    /// Greedy paths per score and the target they reach.
    paths: Vec<(InputScore, f64, Vec<GreedyPath>)>,
    /// `|x|` histograms of the attention projections' inputs (`[q/k/v, o]` per layer).
    attention: Option<Vec<[Histogram; 2]>>,
}

impl InputModel {
    /// Loads `path` on the input-sparse FFN (with `up_rows`, up as rows for the CHESS rule;
    /// with `attention`, input-sparse attention projections too) and takes `calibration` tokens
    /// of the calibration mix ([`CalibrationMix`]: speeches up to 1999, prose, Python source).
    pub fn load(
        path: &std::path::Path,
        threads: usize,
        calibration: usize,
        ctx: usize,
        attention: bool,
        up_rows: bool,
    ) -> Result<Self> {
        let m = load(
            path,
            &FfnMode::InputSparse {
                threads,
                attention,
                up_rows,
                artifact: None,
                layouts: Layouts::Columns,
            },
        )?;
        let calib = CalibrationMix::load(&m.tok, calibration, 0, ctx)?.tokens;
        Ok(InputModel {
            m,
            ctx,
            scoring: Default::default(),
            calib,
            scores: Vec::new(),
            paths: Vec::new(),
            attention: None,
        })
    }

    fn scores(&mut self, score: InputScore) -> Result<&[InputScores]> {
        let at = match self.scores.iter().position(|(s, _)| *s == score) {
            Some(at) => at,
            None => {
                let pb = spinner(format!("calibrating {} scores", score.name()));
                let sc = self
                    .m
                    .model
                    .record_input_scores(&self.calib, self.ctx, score)?;
                pb.finish_and_clear();
                self.scores.push((score, sc));
                self.scores.len() - 1
            }
        };
        Ok(&self.scores[at].1)
    }

    /// The greedy paths of `score` reaching at least `s`.
    fn paths(&mut self, score: InputScore, s: f64) -> Result<Vec<GreedyPath>> {
        if let Some((_, _, p)) = self
            .paths
            .iter()
            .find(|(sc, reach, _)| *sc == score && *reach >= s)
        {
            return Ok(p.clone());
        }
        let scores = self.scores(score)?.to_vec();
        let pb = spinner(format!(
            "greedy {} allocation up to {:.0}%",
            score.name(),
            s * 100.0
        ));
        let p = self
            .m
            .model
            .greedy_input_allocation(&scores, s, GREEDY_STEP)?;
        pb.finish_and_clear();
        self.paths.retain(|(sc, ..)| *sc != score);
        self.paths.push((score, s, p.clone()));
        Ok(p)
    }

    /// Sets `score` with per-layer thresholds dropping, at target `s`, the fractions `split`
    /// gives of the calibration entries; returns the per-layer fractions and thresholds.
    pub fn set(
        &mut self,
        score: InputScore,
        split: Split,
        s: f64,
    ) -> Result<(Vec<[f64; 3]>, Vec<InputThresholds>)> {
        let layers = self.scores(score)?.len();
        let fr = match split {
            Split::Greedy => fractions(split, s, &self.paths(score, s)?)?,
            Split::Down(_) => fractions(split, s, &vec![GreedyPath::default(); layers])?,
        };
        let t: Vec<InputThresholds> = self
            .scores(score)?
            .iter()
            .zip(&fr)
            .map(|(sc, f)| sc.thresholds(*f))
            .collect::<Option<_>>()
            .ok_or_else(|| anyhow::anyhow!("no calibration scores for target {s}"))?;
        self.m.model.set_input_rule(score, &t)?;
        Ok((fr, t))
    }

    /// Sets `|h|` on down alone, dropping the fraction `d` of `h`.
    fn set_h_only(&mut self, d: f64) -> Result<()> {
        let t: Vec<InputThresholds> = self
            .scores(InputScore::Magnitude)?
            .iter()
            .map(|sc| sc.thresholds([0.0, 0.0, d]))
            .collect::<Option<_>>()
            .ok_or_else(|| anyhow::anyhow!("no calibration scores"))?;
        self.m.model.set_input_rule(InputScore::Magnitude, &t)?;
        Ok(())
    }

    /// Sets `rule` at target `s` with the split that gives the lowest perplexity on the first
    /// `tokens` of the calibration text (never the held-out text), or `split` when given.
    /// Returns the split, the mean fractions over layers and that perplexity. `|h|` alone has one
    /// allocation: down drops `3 s`.
    pub fn choose(
        &mut self,
        rule: InputRule,
        s: f64,
        split: Option<Split>,
        tokens: usize,
    ) -> Result<(Option<Split>, [f64; 3], f64)> {
        let text: Vec<u32> = self.calib.iter().copied().take(tokens).collect();
        let score = match rule {
            InputRule::H => {
                let d = (3.0 * s).min(0.95);
                self.set_h_only(d)?;
                let p = self.m.model.perplexity(&text, self.ctx)?;
                self.m.model.take_ffn_traffic();
                return Ok((None, [0.0, 0.0, d], p));
            }
            InputRule::Chess => {
                let f = (1.5 * s).min(0.95);
                self.set_h_only(f)?;
                let scores = self.scores(InputScore::Magnitude)?.to_vec();
                let rules = self.m.model.chess_rules(&scores, f)?;
                self.m.model.set_chess_rules(Some(&rules))?;
                let p = self.m.model.perplexity(&text, self.ctx)?;
                self.m.model.take_ffn_traffic();
                return Ok((None, [0.0, f, f], p));
            }
            InputRule::Teal => InputScore::Magnitude,
            InputRule::Wina => InputScore::Wina,
        };
        let candidates = split.map_or(SPLITS.to_vec(), |s| vec![s]);
        let mut best: Option<(Split, f64)> = None;
        for c in candidates {
            self.set(score, c, s)?;
            let p = self.m.model.perplexity(&text, self.ctx)?;
            if best.is_none_or(|(_, b)| p < b) {
                best = Some((c, p));
            }
        }
        self.m.model.take_ffn_traffic();
        let (c, p) = best.ok_or_else(|| anyhow::anyhow!("no split"))?;
        let (fr, _) = self.set(score, c, s)?;
        Ok((Some(c), mean(&fr), p))
    }

    /// Sets the attention projections' thresholds dropping the fraction `a` of the calibration
    /// entries of each input (0: dense).
    pub fn set_attention(&mut self, a: f64) -> Result<()> {
        if self.attention.is_none() {
            let pb = spinner("calibrating attention scores".to_string());
            let h = self
                .m
                .model
                .record_attention_scores(&self.calib, self.ctx)?;
            pb.finish_and_clear();
            self.attention = Some(h);
        }
        let t = |h: &Histogram| {
            if a == 0.0 {
                Some(0.0)
            } else {
                h.threshold_for_fraction(a)
            }
        };
        let t: Vec<[f32; 2]> = self
            .attention
            .iter()
            .flatten()
            .map(|[qkv, o]| Some([t(qkv)?, t(o)?]))
            .collect::<Option<_>>()
            .ok_or_else(|| anyhow::anyhow!("no attention calibration scores for {a}"))?;
        self.m.model.set_attention_rule(&t)?;
        Ok(())
    }

    /// Perplexity of `text` under the current rule and the weight bytes the FFNs and the
    /// attention projections read.
    pub fn perplexity(&mut self, text: &[u32]) -> Result<(f64, WeightTraffic, WeightTraffic)> {
        self.m.model.take_ffn_traffic();
        self.m.model.take_attention_traffic();
        let p = self.scoring.perplexity(&mut self.m.model, text, self.ctx)?;
        Ok((
            p,
            self.m.model.take_ffn_traffic(),
            self.m.model.take_attention_traffic(),
        ))
    }
}

impl InputRule {
    /// Whether the rule needs up stored as rows.
    pub(crate) fn up_rows(self) -> bool {
        self == InputRule::Chess
    }

    pub(crate) fn name(self) -> &'static str {
        match self {
            InputRule::Teal => "teal",
            InputRule::Wina => "wina",
            InputRule::H => "h",
            InputRule::Chess => "chess",
        }
    }
}

/// The rule `bench` and the demo run on `model`: the artifact's (`--powerinfer`, format version
/// 2, checked against the model file), or one calibrated on the calibration mix: at
/// `--input-target`, or (`auto`) at the largest target that holds perplexity on the mix's
/// held-out part, searched once per model file and then read from the cache.
pub(crate) fn rule_for(
    m: &mut Loaded,
    model: &std::path::Path,
    settings: &crate::common::SparseSettings,
) -> Result<InputRuleMeta> {
    if let Some(path) = &settings.artifact {
        let a = powerinfer_candle::load_artifact(path, model)?;
        if let Some(r) = a.meta.input_rule {
            return Ok(r);
        }
        tracing::warn!(
            "{} has no input rule (format version 1): calibrating",
            path.display()
        );
    }
    let opts = InputRuleOptions {
        attention: settings.attention_sparsity,
        ..Default::default()
    };
    let n = settings.calibration_tokens;
    if let Some(target) = settings.target {
        let mix = CalibrationMix::load(&m.tok, n, 0, CTX)?;
        let opts = InputRuleOptions { target, ..opts };
        return Ok(m.model.calibrate_input_rule(&mix.tokens, CTX, &opts)?);
    }
    let search = TargetSearch::default();
    let key = auto_key(model, settings)?;
    if let Some(rule) = key.read() {
        eprintln!(
            "input rule target: {:.0}% (chosen earlier, {})",
            rule.target * 100.0,
            key.path().display()
        );
        return Ok(rule);
    }
    let mix = CalibrationMix::load(&m.tok, n, HELD_TOKENS, CTX)?;
    let kinds: Vec<&str> = mix.held.iter().map(|(k, _)| *k).collect();
    let pb = spinner(format!(
        "choosing the input rule's target: perplexity within +{:.0}% on held-out {} \
         (once for this model file)",
        search.max_loss * 100.0,
        kinds.join(", ")
    ));
    let held: Vec<&[u32]> = mix.held.iter().map(|(_, t)| t.as_slice()).collect();
    let (rule, trials) = m
        .model
        .calibrate_input_target(&mix.tokens, &held, CTX, &opts, &search)?;
    pb.finish_and_clear();
    for t in &trials {
        let losses: Vec<String> = kinds
            .iter()
            .zip(&t.losses)
            .map(|(k, l)| format!("{k} {:+.2}%", l * 100.0))
            .collect();
        eprintln!("  target {:.0}%: {}", t.target * 100.0, losses.join(", "));
    }
    eprintln!("input rule target: {:.0}%", rule.target * 100.0);
    key.write(&rule, &kinds, &trials);
    Ok(rule)
}

/// Where `--target auto`'s rule for `model` and these settings is cached.
fn auto_key(
    model: &std::path::Path,
    settings: &crate::common::SparseSettings,
) -> Result<rule_cache::Key> {
    let opts = InputRuleOptions {
        attention: settings.attention_sparsity,
        ..Default::default()
    };
    let n = settings.calibration_tokens;
    rule_cache::Key::new(model, &opts, &TargetSearch::default(), n, HELD_TOKENS)
}

/// Calibration windows.
const CTX: usize = 512;
/// Held-out tokens of each kind the target search scores.
const HELD_TOKENS: usize = 512;

/// A sparse model as `demo`, `generate --sparse` and `eval` run it, and what names it.
pub(crate) struct SparseModel {
    pub m: Loaded,
    /// The mode and its setting, for output.
    pub label: String,
    /// The mode it runs (`Input`, `GateFirst` or `Predictors`, never `Auto`).
    pub mode: SparseMode,
}

impl SparseModel {
    /// What the calls since the last one skipped, as a share and in words: the input rule's
    /// share of FFN weight bytes not read (and the attention projections' where they are
    /// input-sparse), or |h| thresholding's realized FFN sparsity.
    pub(crate) fn take_skipped(&mut self) -> (f64, String) {
        let model = &mut self.m.model;
        if self.mode != SparseMode::Input {
            let s = mean_sparsity(model);
            return (s, format!("realized FFN sparsity {:.1}%", s * 100.0));
        }
        let ffn = model.take_ffn_traffic().skipped();
        let attention = model.take_attention_traffic();
        let attention = match attention.rows {
            0 => String::new(),
            _ => format!(", {:.1}% of the attention's", attention.skipped() * 100.0),
        };
        let words = format!(
            "{:.1}% of the FFN weight bytes skipped{attention}",
            ffn * 100.0
        );
        (ffn, words)
    }
}

/// How `rule` reads in output: score, target and per-matrix allocation (and the attention
/// fraction where `attention` runs).
pub(crate) fn rule_label(rule: &InputRuleMeta, attention: bool) -> String {
    let attention = match (&rule.attention, attention) {
        (Some(a), true) => format!(", attention {:.0}%", a.fraction * 100.0),
        _ => String::new(),
    };
    format!(
        "{} rule at {:.0}% target (gate/up/down {:.0}/{:.0}/{:.0}% of entries{attention})",
        rule.score,
        rule.target * 100.0,
        rule.allocation[0] * 100.0,
        rule.allocation[1] * 100.0,
        rule.allocation[2] * 100.0
    )
}

/// The input-sparse FFN with the rule [`rule_for`] gives, applied; and its label.
pub(crate) fn load_rule(
    path: &std::path::Path,
    settings: &crate::common::SparseSettings,
) -> Result<SparseModel> {
    let planned = planned_drop(path, settings)?;
    let m = load_input(
        path,
        settings.threads,
        settings.attention_sparsity > 0.0,
        measured_layouts(planned),
    )?;
    with_rule(m, path, settings, planned.is_none())
}

/// `m` (loaded by [`load_input`]) with the rule [`rule_for`] gives. With `replan` (the layouts
/// were planned for the default rule's fractions) and a rule that drops other fractions, the
/// model is loaded again with its layouts planned for them.
fn with_rule(
    mut m: Loaded,
    path: &std::path::Path,
    settings: &crate::common::SparseSettings,
    replan: bool,
) -> Result<SparseModel> {
    crate::memory::trace("input-sparse model loaded");
    let rule = rule_for(&mut m, path, settings)?;
    crate::memory::trace("input rule chosen");
    let layouts = measured_layouts(Some(rule.allocation));
    if replan && layouts != measured_layouts(None) {
        eprintln!("planning the FFN's layouts again for the chosen target");
        drop(m);
        m = load_input(
            path,
            settings.threads,
            settings.attention_sparsity > 0.0,
            layouts,
        )?;
    }
    m.model.apply_input_rule(&rule)?;
    // Where no matrix of a layer pays by column, the layer runs the dense decoder's FFN.
    let dense = m.model.run_rows_dense()?;
    tracing::info!(
        "{dense} of {} layers run the dense FFN",
        m.model.config().layers
    );
    crate::memory::trace("input rule applied");
    let label = rule_label(&rule, m.model.input_sparse_attention());
    Ok(SparseModel {
        m,
        label,
        mode: SparseMode::Input,
    })
}

/// The mode `auto` stands for on `path`, decided from the file's header before anything loads:
/// `input` where the file has an input-sparse FFN, else `gate-first`, saying why. `input` asked
/// for by name on a file without one is an error naming the reason; other modes stay as they are.
pub(crate) fn resolve_mode(
    path: &std::path::Path,
    settings: &crate::common::SparseSettings,
) -> Result<SparseMode> {
    let mode = settings.mode;
    if !matches!(mode, SparseMode::Auto | SparseMode::Input) {
        return Ok(mode);
    }
    let support = powerinfer_candle::Support::of(path)?;
    // Input-sparse attention projections run on the fused decoder only.
    let why = match settings.attention_sparsity > 0.0 {
        true => support
            .fused
            .map(|w| format!("input-sparse attention needs the fused decoder, which {w}")),
        false => support.input_sparse,
    };
    match (why, mode) {
        (None, _) => Ok(SparseMode::Input),
        (Some(why), SparseMode::Auto) => {
            eprintln!("no input-sparse FFN for this file ({why}); exact |h| thresholding instead");
            Ok(SparseMode::GateFirst)
        }
        (Some(why), _) => {
            anyhow::bail!("--sparse=input: no input-sparse FFN for this file ({why})")
        }
    }
}

/// The sparse mode of `demo`, `generate --sparse` and `eval` as `settings.mode` names it (`auto`
/// resolved by [`resolve_mode`] first): the input rule, the artifact's or calibrated now; exact
/// `|h|` thresholding; or the artifact's trained predictors.
pub(crate) fn load_sparse_mode(
    path: &std::path::Path,
    settings: &crate::common::SparseSettings,
) -> Result<SparseModel> {
    let mode = resolve_mode(path, settings)?;
    if mode == SparseMode::Input {
        return load_rule(path, settings);
    }
    let settings = crate::common::SparseSettings {
        mode,
        ..settings.clone()
    };
    let mut sp = load_sparse(path, &settings)?;
    sp.m.model.enable_ffn_stats();
    Ok(SparseModel {
        m: sp.m,
        label: sp.label,
        mode,
    })
}

/// Puts `sm`'s FFN neurons (the default sparse mode, loaded from `path`) on the device of
/// `hot.tier` within `hot.vram_budget`, as `hot.placement` says (nothing without a budget).
pub(crate) fn place_hot(
    sm: &mut SparseModel,
    path: &std::path::Path,
    settings: &crate::common::SparseSettings,
    hot: &crate::SparseArgs,
) -> Result<powerinfer_candle::HotReport> {
    let Some(budget) = hot.vram_budget else {
        return Ok(powerinfer_candle::HotReport::default());
    };
    if sm.mode != SparseMode::Input {
        anyhow::bail!(
            "--vram-budget puts the input mode's neurons on a device; {} has its own tier in \
             `bench --modes {0} --vram-budget ..`",
            sm.mode.name()
        );
    }
    let placement = hot.placement.into();
    let scores = match placement {
        powerinfer_candle::HotPlacement::Hybrid => neuron_scores(path, settings.threads)?,
        powerinfer_candle::HotPlacement::LayerSplit => Vec::new(),
    };
    place_hot_with(&mut sm.m, path, &scores, budget, placement, hot.tier)
}

/// Each layer's neuron statistics for the hybrid: the summed `|h|` of every neuron on 1024
/// tokens of calibration speeches (1790-1999), recorded on a dense load of its own (the
/// default sparse mode may have made layers dense already).
pub(crate) fn neuron_scores(path: &std::path::Path, threads: usize) -> Result<Vec<InputScores>> {
    let mut d = load_input(path, threads, false, dense_layouts())?;
    let calib = crate::common::corpus_tokens(&d.tok, 1790..=1999, 1024)?;
    let pb = spinner("ranking neurons on calibration text");
    let s = d
        .model
        .record_input_scores(&calib, 256, InputScore::Magnitude)?;
    pb.finish_and_clear();
    Ok(s)
}

/// [`place_hot`] with the hybrid's `scores` given, saying what went where on stderr.
pub(crate) fn place_hot_with(
    m: &mut Loaded,
    path: &std::path::Path,
    scores: &[InputScores],
    budget: crate::args::VramBudget,
    placement: powerinfer_candle::HotPlacement,
    tier: crate::args::Tier,
) -> Result<powerinfer_candle::HotReport> {
    let device = powerinfer_candle::hot_device(tier.0)?;
    let bytes = budget.bytes(powerinfer_candle::ffn_file_bytes(path)?);
    let r = m.model.place_hot(path, scores, bytes, placement, &device)?;
    let layers = r.neurons.iter().filter(|&&n| n > 0).count();
    eprintln!(
        "{placement} {budget} on {tier}: {:.1} MB of {:.1} MB FFN bytes, {:.1}% of the \
         neurons, in {layers} of {} layers",
        r.bytes as f64 / 1e6,
        r.ffn_bytes as f64 / 1e6,
        100.0 * r.neuron_share(m.model.config().intermediate),
        r.neurons.len(),
    );
    Ok(r)
}

/// Every matrix as dense rows (the rule drops nothing): the layer split's CPU layers and the
/// hybrid's calibration load.
pub(crate) fn dense_layouts() -> Layouts {
    Layouts::Measured { drop: [0.0; 3] }
}

#[cfg(test)]
mod tests {
    use super::*;
    use powerinfer::input_rule::GreedyStep;

    #[test]
    fn splits_parse_and_give_fractions() {
        assert_eq!("greedy".parse(), Ok(Split::Greedy));
        assert_eq!(" 1.5".parse(), Ok(Split::Down(1.5)));
        for bad in ["", "down", "-1", "4", "NaN"] {
            assert!(bad.parse::<Split>().is_err(), "{bad}");
        }
        let fr = fractions(Split::Down(1.5), 0.2, &vec![GreedyPath::default(); 2]).unwrap();
        assert_eq!(fr.len(), 2);
        assert!((fr[0][2] - 0.3).abs() < 1e-12 && (fr[0][0] - 0.15).abs() < 1e-12);
        let step = |f: [f64; 3]| GreedyStep {
            fractions: f,
            skipped: f.iter().sum::<f64>() / 3.0,
            error: 0.0,
        };
        let path = GreedyPath {
            steps: vec![step([0.0, 0.0, 0.3]), step([0.0, 0.3, 0.3])],
        };
        let fr = fractions(Split::Greedy, 0.15, std::slice::from_ref(&path)).unwrap();
        assert_eq!(fr, vec![[0.0, 0.3, 0.3]]);
        assert!(fractions(Split::Greedy, 0.5, &[path]).is_err());
        assert_eq!(mean(&[[0.0, 0.2, 0.4], [0.2, 0.2, 0.0]]), [0.1, 0.2, 0.2]);
    }
}
