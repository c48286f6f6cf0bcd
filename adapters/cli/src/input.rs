//! The input-sparse FFN (TEAL / WINA rules) in the CLI: calibration on speeches up to 1999, the
//! choice of how a target FFN sparsity is split between gate, up and down, and its evaluation.

use anyhow::{bail, Result};
use powerinfer::{InputRuleMeta, InputScore, InputScores, InputThresholds};
use powerinfer_candle::{FfnMode, Llama};

use crate::common::{corpus_tokens, load, spinner, Loaded};

/// The score the demo, `bench` and `analyze` use by default: TEAL's `|x|`. At the default
/// target both rules skip the same bytes and TEAL held perplexity slightly better on SmolLM2, on
/// held-out speeches and on license text (README); WINA stays a flag away.
pub(crate) const DEFAULT_RULE: InputScore = InputScore::Magnitude;
/// Mean fraction of gate, up and down entries the default rule drops (the share of FFN values
/// not read; the bytes skipped are lower by the scale planes, which stay read).
pub(crate) const DEFAULT_TARGET: f64 = 0.28;

/// Down's share of the default rule, as a multiple of the target.
pub(crate) const DEFAULT_DOWN: f64 = 1.5;

/// Fractions of (gate, up, down) entries dropped for a target `s` (three matrices of equal size)
/// with down taking `f` times its share and gate and up sharing the rest.
pub(crate) fn allocation(s: f64, f: f64) -> [f64; 3] {
    let d = (f * s).min(0.95);
    let gu = ((3.0 * s - d) / 2.0).clamp(0.0, 0.95);
    [gu, gu, d]
}

/// The candidate splits of target `s`: uniform, and down taking 1.5x and 2x its share (TEAL's
/// greedy allocation gives down the most).
pub(crate) fn allocations(s: f64) -> Vec<[f64; 3]> {
    [1.0, DEFAULT_DOWN, 2.0].map(|f| allocation(s, f)).to_vec()
}

/// A model on the input-sparse FFN with its calibration histograms per rule.
pub(crate) struct InputModel {
    pub m: Loaded,
    /// Windows of the calibration text.
    pub ctx: usize,
    calib: Vec<u32>,
    scores: Vec<(InputScore, Vec<InputScores>)>,
}

impl InputModel {
    /// Loads `path` on the input-sparse FFN and takes `calibration` tokens of speeches up to 1999.
    pub fn load(
        path: &std::path::Path,
        threads: usize,
        calibration: usize,
        ctx: usize,
    ) -> Result<Self> {
        let m = load(path, &FfnMode::InputSparse { threads })?;
        let calib = corpus_tokens(&m.tok, 1790..=1999, calibration)?;
        Ok(InputModel {
            m,
            ctx,
            calib,
            scores: Vec::new(),
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

    /// Sets `score` with per-layer thresholds dropping the fractions `alloc` of the calibration
    /// entries.
    pub fn set(&mut self, score: InputScore, alloc: [f64; 3]) -> Result<Vec<InputThresholds>> {
        let t: Vec<InputThresholds> = self
            .scores(score)?
            .iter()
            .map(|s| s.thresholds(alloc))
            .collect::<Option<_>>()
            .ok_or_else(|| anyhow::anyhow!("no calibration scores for {alloc:?}"))?;
        self.m.model.set_input_rule(score, &t)?;
        Ok(t)
    }

    /// For target `s`: the allocation with the lowest perplexity on the first `tokens` of the
    /// calibration text (never the held-out text), and that perplexity. `down` fixes down's
    /// share (a multiple of `s`); `|h|` alone has one allocation: down drops `3 s`.
    pub fn choose(
        &mut self,
        rule: Rule,
        s: f64,
        down: Option<f64>,
        tokens: usize,
    ) -> Result<(InputScore, [f64; 3], f64)> {
        let (score, candidates) = match (rule, down) {
            (Rule::Input(score), Some(f)) => (score, vec![allocation(s, f)]),
            (Rule::Input(score), None) => (score, allocations(s)),
            (Rule::HOnly, _) => (InputScore::Magnitude, vec![[0.0, 0.0, (3.0 * s).min(0.95)]]),
        };
        let text: Vec<u32> = self.calib.iter().copied().take(tokens).collect();
        let mut best: Option<([f64; 3], f64)> = None;
        for alloc in candidates {
            self.set(score, alloc)?;
            let p = self.m.model.perplexity(&text, self.ctx)?;
            if best.is_none_or(|(_, b)| p < b) {
                best = Some((alloc, p));
            }
        }
        self.m.model.take_ffn_traffic();
        let (alloc, p) = best.ok_or_else(|| anyhow::anyhow!("no allocation"))?;
        Ok((score, alloc, p))
    }

    /// Perplexity of `text` under the current rule and the share of FFN weight bytes skipped.
    pub fn perplexity(&mut self, text: &[u32]) -> Result<(f64, f64)> {
        self.m.model.take_ffn_traffic();
        let p = self.m.model.perplexity(text, self.ctx)?;
        Ok((p, self.m.model.take_ffn_traffic().skipped()))
    }
}

/// A rule of the sweep: an input score with its allocation chosen on calibration text, or
/// `|h|` on down alone (today's exact `|h|` thresholding, on the exact layout).
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum Rule {
    /// Gate, up and down thresholded by this score.
    Input(InputScore),
    /// Only down, on `|h|`: gate and up read densely.
    HOnly,
}

impl Rule {
    pub fn name(self) -> &'static str {
        match self {
            Rule::Input(s) => s.name(),
            Rule::HOnly => "h",
        }
    }
}

/// Parses `teal,wina,h`.
pub(crate) fn parse_rules(s: &str) -> Result<Vec<Rule>> {
    s.split(',')
        .map(|r| match r.trim() {
            "h" => Ok(Rule::HOnly),
            r => Ok(Rule::Input(InputScore::from_name(r)?)),
        })
        .collect()
}

/// Parses target sparsities in `[0, 0.95]`.
pub(crate) fn parse_targets(s: &str) -> Result<Vec<f64>> {
    let v: Vec<f64> = s
        .split(',')
        .map(|x| x.trim().parse::<f64>())
        .collect::<std::result::Result<_, _>>()?;
    if v.iter().any(|x| !(0.0..=0.95).contains(x)) {
        bail!("input sparsity targets must lie in [0, 0.95]");
    }
    Ok(v)
}

/// The default rule calibrated on `calib` (windows of `ctx`): per-layer thresholds of
/// [`DEFAULT_RULE`] at [`DEFAULT_TARGET`], down taking 1.5x its share.
pub(crate) fn default_rule(model: &mut Llama, calib: &[u32], ctx: usize) -> Result<InputRuleMeta> {
    let scores = model.record_input_scores(calib, ctx, DEFAULT_RULE)?;
    let alloc = allocation(DEFAULT_TARGET, DEFAULT_DOWN);
    let thresholds: Vec<InputThresholds> = scores
        .iter()
        .map(|s| s.thresholds(alloc))
        .collect::<Option<_>>()
        .ok_or_else(|| anyhow::anyhow!("no calibration scores"))?;
    Ok(InputRuleMeta {
        score: DEFAULT_RULE.name().into(),
        target: DEFAULT_TARGET,
        allocation: alloc,
        tokens: calib.len() as u64,
        thresholds,
    })
}

/// Sets `rule` on every layer of `model`.
pub(crate) fn apply(model: &mut Llama, rule: &InputRuleMeta) -> Result<()> {
    model.set_input_rule(rule.input_score()?, &rule.thresholds)?;
    model.take_ffn_traffic();
    Ok(())
}

/// The rule `bench` and the demo run on `model`: the artifact's (`--powerinfer`, format version
/// 2, checked against the model file) or the default calibrated now on `calibration` tokens of
/// speeches up to 1999.
pub(crate) fn rule_for(
    m: &mut Loaded,
    model: &std::path::Path,
    settings: &crate::common::SparseSettings,
) -> Result<InputRuleMeta> {
    if let Some(path) = &settings.artifact {
        let a = powerinfer::Artifact::load(path)?;
        a.check_model(&powerinfer_candle::model_sha256(model)?)?;
        if let Some(r) = a.meta.input_rule {
            return Ok(r);
        }
        tracing::warn!(
            "{} has no input rule (format version 1): calibrating",
            path.display()
        );
    }
    let calib = corpus_tokens(&m.tok, 1790..=1999, settings.calibration_tokens)?;
    default_rule(&mut m.model, &calib, 512)
}
