//! The input-sparse FFN (TEAL / WINA rules) in the CLI: calibration on speeches up to 1999, the
//! choice of how a target FFN sparsity is split between gate, up and down, and its evaluation.

use anyhow::{bail, Result};
use powerinfer::{InputScore, InputScores, InputThresholds};
use powerinfer_candle::{FfnMode, Llama};

use crate::common::{corpus_tokens, load, spinner, Loaded};

/// The rule the demo and `bench` use by default: TEAL scores, this share of the FFN weight bytes
/// targeted. Chosen from `eval --input-rules teal,wina` on SmolLM2 (see the README).
pub(crate) const DEFAULT_RULE: InputScore = InputScore::Magnitude;
/// Target fraction of FFN weight bytes skipped by the default rule.
pub(crate) const DEFAULT_TARGET: f64 = 0.25;

/// Fractions of (gate, up, down) entries dropped for a target share `s` of the FFN weights
/// (three matrices of equal size), one candidate per split: uniform, and down taking 1.5x and
/// 2x its share (TEAL's greedy allocation gives down the most), gate and up sharing the rest.
pub(crate) fn allocations(s: f64) -> Vec<[f64; 3]> {
    let mut v = vec![[s, s, s]];
    for f in [1.5, 2.0] {
        let d = (f * s).min(0.95);
        let gu = ((3.0 * s - d) / 2.0).max(0.0);
        v.push([gu, gu, d]);
    }
    v
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
        if !self.scores.iter().any(|(s, _)| *s == score) {
            let pb = spinner(format!("calibrating {} scores", score.name()));
            let sc = self
                .m
                .model
                .record_input_scores(&self.calib, self.ctx, score)?;
            pb.finish_and_clear();
            self.scores.push((score, sc));
        }
        Ok(&self
            .scores
            .iter()
            .find(|(s, _)| *s == score)
            .expect("recorded")
            .1)
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
    /// calibration text (never the held-out text), and that perplexity.
    pub fn choose(&mut self, score: InputScore, s: f64, tokens: usize) -> Result<([f64; 3], f64)> {
        let text: Vec<u32> = self.calib.iter().copied().take(tokens).collect();
        let mut best: Option<([f64; 3], f64)> = None;
        for alloc in allocations(s) {
            self.set(score, alloc)?;
            let p = self.m.model.perplexity(&text, self.ctx)?;
            if best.is_none_or(|(_, b)| p < b) {
                best = Some((alloc, p));
            }
        }
        self.m.model.take_ffn_traffic();
        best.ok_or_else(|| anyhow::anyhow!("no allocation"))
    }

    /// Perplexity of `text` under the current rule and the share of FFN weight bytes skipped.
    pub fn perplexity(&mut self, text: &[u32]) -> Result<(f64, f64)> {
        self.m.model.take_ffn_traffic();
        let p = self.m.model.perplexity(text, self.ctx)?;
        Ok((p, self.m.model.take_ffn_traffic().skipped()))
    }
}

/// Parses `teal,wina`.
pub(crate) fn parse_rules(s: &str) -> Result<Vec<InputScore>> {
    s.split(',')
        .map(|r| InputScore::from_name(r.trim()).map_err(Into::into))
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

/// Sets the default rule on `model` (calibrating on `calib`): what `bench` and the demo run.
pub(crate) fn set_default(model: &mut Llama, calib: &[u32], ctx: usize) -> Result<()> {
    let scores = model.record_input_scores(calib, ctx, DEFAULT_RULE)?;
    let alloc = allocations(DEFAULT_TARGET)[1];
    let t: Vec<InputThresholds> = scores
        .iter()
        .map(|s| s.thresholds(alloc))
        .collect::<Option<_>>()
        .ok_or_else(|| anyhow::anyhow!("no calibration scores"))?;
    model.set_input_rule(DEFAULT_RULE, &t)?;
    model.take_ffn_traffic();
    Ok(())
}
