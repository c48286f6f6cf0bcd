//! The input-sparse rule as a setting: calibrate it on text ([`Llama::calibrate_input_rule`])
//! into the artifact's [`InputRuleMeta`], and set one on a model ([`Llama::apply_input_rule`]).

use powerinfer::analysis::Histogram;
use powerinfer::{
    format::AttentionRuleMeta, format::InputRuleMeta, input_rule::split_target, InputScore,
    InputThresholds,
};

use crate::error::Result;
use crate::model::Llama;

/// How [`Llama::calibrate_input_rule`] chooses the thresholds. The default is the rule `powerinfer
/// demo`, `bench` and `analyze` use: TEAL's `|x|` dropping 28% of the FFN's input entries, down
/// taking 1.5x its share, attention projections dense.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct InputRuleOptions {
    /// The score (TEAL's `|x|` or WINA's `|x| * ||column||`).
    pub score: InputScore,
    /// Mean fraction of the gate, up and down input entries dropped (the share of FFN weight
    /// values not read; the bytes skipped are a little lower, the scale planes stay read).
    pub target: f64,
    /// Down drops this multiple of `target`; gate and up share the rest ([`split_target`]).
    pub down_multiple: f64,
    /// Fraction of the attention projections' input entries dropped (0: dense). Needs a model
    /// loaded with `FfnMode::InputSparse { attention: true, .. }`.
    pub attention: f64,
}

impl Default for InputRuleOptions {
    fn default() -> Self {
        // TEAL and WINA skip the same bytes at this target; TEAL held perplexity slightly better
        // on SmolLM2 (`docs/sparse-modes.md`), and down tolerates more sparsity than gate and up.
        InputRuleOptions {
            score: InputScore::Magnitude,
            target: 0.28,
            down_multiple: 1.5,
            attention: 0.0,
        }
    }
}

impl InputRuleOptions {
    /// The fractions of gate, up and down entries each layer drops.
    pub fn fractions(&self) -> [f64; 3] {
        split_target(self.target, self.down_multiple)
    }
}

impl Llama {
    /// Calibrates the input-sparse rule on `calib` (windows of `ctx` tokens): each layer's
    /// thresholds dropping [`InputRuleOptions::fractions`] of its entries, and with
    /// `attention > 0` the attention projections' thresholds. Needs a model loaded with
    /// `FfnMode::InputSparse`; the model's current rule is left as it was.
    pub fn calibrate_input_rule(
        &mut self,
        calib: &[u32],
        ctx: usize,
        opts: &InputRuleOptions,
    ) -> Result<InputRuleMeta> {
        for (name, v, hi) in [
            ("input rule target", opts.target, 0.95),
            ("input rule down multiple", opts.down_multiple, 3.0),
            ("attention sparsity", opts.attention, 0.95),
        ] {
            if !(0.0..=hi).contains(&v) {
                return Err(
                    powerinfer::Error::config(name, format!("{v} is outside [0, {hi}]")).into(),
                );
            }
        }
        let scores = self.record_input_scores(calib, ctx, opts.score)?;
        let fractions = opts.fractions();
        let no_scores = || powerinfer::Error::config("calibration text", "no FFN input recorded");
        let thresholds: Vec<InputThresholds> = scores
            .iter()
            .map(|s| s.thresholds(fractions))
            .collect::<Option<_>>()
            .ok_or_else(no_scores)?;
        let attention = if opts.attention > 0.0 {
            let hists = self.record_attention_scores(calib, ctx)?;
            let t = |h: &Histogram| h.threshold_for_fraction(opts.attention);
            Some(AttentionRuleMeta {
                fraction: opts.attention,
                thresholds: hists
                    .iter()
                    .map(|[qkv, o]| Some([t(qkv)?, t(o)?]))
                    .collect::<Option<_>>()
                    .ok_or_else(no_scores)?,
            })
        } else {
            None
        };
        Ok(InputRuleMeta {
            attention,
            score: opts.score.name().into(),
            target: opts.target,
            allocation: fractions,
            layer_allocations: Vec::new(),
            tokens: calib.len() as u64,
            thresholds,
        })
    }

    /// Sets `rule` (calibrated, or read from an artifact) on every layer. Its attention
    /// thresholds apply when the model runs the attention projections on input-sparse columns;
    /// otherwise they are ignored with a warning. Resets the byte counters.
    pub fn apply_input_rule(&mut self, rule: &InputRuleMeta) -> Result<()> {
        self.set_input_rule(rule.input_score()?, &rule.thresholds)?;
        match (&rule.attention, self.input_sparse_attention()) {
            (Some(a), true) => self.set_attention_rule(&a.thresholds)?,
            (Some(_), false) => tracing::warn!(
                "the rule's attention thresholds are not used: load the model with \
                 FfnMode::InputSparse {{ attention: true, .. }} to run them"
            ),
            (None, _) => {}
        }
        self.take_ffn_traffic();
        self.take_attention_traffic();
        Ok(())
    }
}
