//! The input-sparse rule as a setting: calibrate it on text ([`Llama::calibrate_input_rule`])
//! into the artifact's [`InputRuleMeta`], and set one on a model ([`Llama::apply_input_rule`]).

use powerinfer::analysis::Histogram;
use powerinfer::{
    format::AttentionRuleMeta, format::InputRuleMeta, input_rule::split_target, InputScore,
    InputScores, InputThresholds,
};

use crate::error::Result;
use crate::model::{Ffn, KernelFfn, Llama};

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

/// How [`Llama::calibrate_input_target`] picks the target: the largest of `targets` whose rule
/// keeps the perplexity of every held-out text within `max_loss` of dense.
#[derive(Debug, Clone, PartialEq)]
pub struct TargetSearch {
    /// Largest perplexity change allowed on each held-out text (0.02: +2%).
    pub max_loss: f64,
    /// Candidate targets, ascending. The search halves the list at each trial, so it assumes
    /// the loss grows with the target (it does, on every model measured).
    pub targets: Vec<f64>,
}

impl Default for TargetSearch {
    /// +2% on each text, targets 5% to 45% by 5%: at most 4 trials.
    fn default() -> Self {
        TargetSearch {
            max_loss: 0.02,
            targets: (1..=9).map(|i| f64::from(i) * 0.05).collect(),
        }
    }
}

/// A target [`Llama::calibrate_input_target`] tried.
#[derive(Debug, Clone, PartialEq)]
pub struct TargetTrial {
    /// The target.
    pub target: f64,
    /// Perplexity change against dense on each held-out text, in order (0.01: +1%).
    pub losses: Vec<f64>,
}

impl TargetTrial {
    /// Whether every held-out text stays within `max_loss`.
    pub fn passes(&self, max_loss: f64) -> bool {
        self.losses.iter().all(|l| *l <= max_loss)
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
        check_options(opts)?;
        let scores = self.record_input_scores(calib, ctx, opts.score)?;
        let attention = self.attention_histograms(calib, ctx, opts)?;
        rule_from(&scores, attention.as_deref(), calib.len(), opts)
    }

    /// Calibrates the rule as [`Llama::calibrate_input_rule`] does, at the largest target of
    /// `search` that keeps the perplexity of each `held` text (windows of `ctx` tokens; text
    /// the histograms never saw, one per kind) within `search.max_loss` of dense; `opts.target`
    /// is ignored. Each trial scores every held text once, dense once more: for the default
    /// search at most 5 passes over `held`. Returns the rule (target 0, nothing dropped, when no target
    /// passes) and the trials in the order run. The model is left on the last rule tried, its
    /// rows-stored matrices unmasked again.
    pub fn calibrate_input_target(
        &mut self,
        calib: &[u32],
        held: &[&[u32]],
        ctx: usize,
        opts: &InputRuleOptions,
        search: &TargetSearch,
    ) -> Result<(InputRuleMeta, Vec<TargetTrial>)> {
        check_options(opts)?;
        let ascending = search.targets.windows(2).all(|w| w[0] < w[1]);
        let in_range = search.targets.iter().all(|t| (0.0..=0.95).contains(t));
        if search.targets.is_empty() || !ascending || !in_range {
            let why = format!(
                "{:?}: expected ascending values in [0, 0.95]",
                search.targets
            );
            return Err(powerinfer::Error::config("target search targets", why).into());
        }
        if !(search.max_loss >= 0.0 && search.max_loss.is_finite()) {
            let why = format!("{} is not a finite value >= 0", search.max_loss);
            return Err(powerinfer::Error::config("target search max loss", why).into());
        }
        if held.is_empty() || held.iter().any(|h| h.len() < 2) {
            let why = "expected at least one text of 2 tokens or more";
            return Err(powerinfer::Error::config("held-out text", why).into());
        }
        let scores = self.record_input_scores(calib, ctx, opts.score)?;
        let attention = self.attention_histograms(calib, ctx, opts)?;
        let rule = |target: f64| {
            let o = InputRuleOptions { target, ..*opts };
            rule_from(&scores, attention.as_deref(), calib.len(), &o)
        };
        // Every matrix masked, so the loss is the rule's whole effect: a matrix the planner
        // stored as rows (here or on another thread count) can only lose less.
        self.mask_rows(true)?;
        let searched = self.search_target(held, ctx, opts.score, scores.len(), search, &rule);
        self.mask_rows(false)?;
        self.take_ffn_traffic();
        self.take_attention_traffic();
        let (target, trials) = searched?;
        Ok((rule(target)?, trials))
    }

    /// Bisection over `search.targets` for the last one whose rule (`rule(target)`) passes;
    /// 0 when none does.
    fn search_target(
        &mut self,
        held: &[&[u32]],
        ctx: usize,
        score: InputScore,
        layers: usize,
        search: &TargetSearch,
        rule: &dyn Fn(f64) -> Result<InputRuleMeta>,
    ) -> Result<(f64, Vec<TargetTrial>)> {
        self.set_input_rule(score, &vec![InputThresholds::default(); layers])?;
        if self.input_sparse_attention() {
            self.set_attention_rule(&vec![[0.0; 2]; layers])?;
        }
        let dense = held
            .iter()
            .map(|h| self.perplexity(h, ctx))
            .collect::<Result<Vec<f64>>>()?;
        let mut trials = Vec::new();
        // `lo` passes (or is -1), `hi` fails (or is the length).
        let (mut lo, mut hi) = (-1isize, search.targets.len() as isize);
        while hi - lo > 1 {
            let mid = (lo + hi) / 2;
            let target = search.targets[mid as usize];
            self.apply_input_rule(&rule(target)?)?;
            let losses = held
                .iter()
                .zip(&dense)
                .map(|(h, d)| Ok(self.perplexity(h, ctx)? / d - 1.0))
                .collect::<Result<Vec<f64>>>()?;
            let trial = TargetTrial { target, losses };
            if trial.passes(search.max_loss) {
                lo = mid;
            } else {
                hi = mid;
            }
            trials.push(trial);
        }
        let target = usize::try_from(lo).map_or(0.0, |i| search.targets[i]);
        Ok((target, trials))
    }

    /// The attention projections' `|x|` histograms on `calib` when `opts` asks for attention
    /// sparsity.
    fn attention_histograms(
        &mut self,
        calib: &[u32],
        ctx: usize,
        opts: &InputRuleOptions,
    ) -> Result<Option<Vec<[Histogram; 2]>>> {
        if opts.attention > 0.0 {
            Ok(Some(self.record_attention_scores(calib, ctx)?))
        } else {
            Ok(None)
        }
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

    /// Runs every layer whose input-sparse FFN the layout planner stored wholly as rows (gate,
    /// up and down: at the rule's fractions no column layout paid) as the dense FFN of
    /// `FfnMode::Fused`: the same matrices and the same code, so where sparsity does
    /// not pay the sparse model runs exactly as fast as the dense one, prompts included. Call
    /// it once the rule is set: a layer made dense no longer records scores nor masks its
    /// rows, so calibrating again is then a typed error (load the model again for that), while
    /// [`Llama::apply_input_rule`] still works (such a layer ignores its thresholds). Returns
    /// how many layers run dense; a model with none to convert is left as it was.
    pub fn run_rows_dense(&mut self) -> Result<usize> {
        let n = self.layers.len();
        self.rows_dense.resize(n, false);
        let act = self.config.activation;
        let mut converted = 0;
        for (layer, dense) in self.layers.iter_mut().zip(&mut self.rows_dense) {
            let Ffn::InputSparse(f) = &layer.ffn else {
                continue;
            };
            let Some([g, u, d]) = f.dense_rows() else {
                continue;
            };
            // Copied, then the input-sparse FFN dropped: one layer's matrices held twice at a
            // time, and the model stays whole if building the dense layer fails.
            let rows = [g.clone(), u.clone(), d.clone()];
            let kernels = KernelFfn::from_rows(rows, act, f.threads())?;
            layer.ffn = Ffn::Kernels(Box::new(kernels));
            *dense = true;
            converted += 1;
        }
        // The input-sparse layers' matrices and buffers go back to the system, not to the
        // allocator's free lists.
        if converted > 0 {
            powerinfer::cpu::release_freed_memory();
        }
        Ok(converted)
    }
}

fn check_options(opts: &InputRuleOptions) -> Result<()> {
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
    Ok(())
}

/// The rule `opts` gives from recorded FFN scores (and attention histograms when
/// `opts.attention > 0`) of `tokens` calibration tokens.
fn rule_from(
    scores: &[InputScores],
    attention: Option<&[[Histogram; 2]]>,
    tokens: usize,
    opts: &InputRuleOptions,
) -> Result<InputRuleMeta> {
    let fractions = opts.fractions();
    let no_scores = || powerinfer::Error::config("calibration text", "no FFN input recorded");
    let thresholds: Vec<InputThresholds> = scores
        .iter()
        .map(|s| s.thresholds(fractions))
        .collect::<Option<_>>()
        .ok_or_else(no_scores)?;
    let attention = match attention {
        Some(hists) if opts.attention > 0.0 => {
            let t = |h: &Histogram| h.threshold_for_fraction(opts.attention);
            Some(AttentionRuleMeta {
                fraction: opts.attention,
                thresholds: hists
                    .iter()
                    .map(|[qkv, o]| Some([t(qkv)?, t(o)?]))
                    .collect::<Option<_>>()
                    .ok_or_else(no_scores)?,
            })
        }
        _ => None,
    };
    Ok(InputRuleMeta {
        attention,
        score: opts.score.name().into(),
        target: opts.target,
        allocation: fractions,
        layer_allocations: Vec::new(),
        tokens: tokens as u64,
        thresholds,
    })
}
