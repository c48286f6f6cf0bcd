//! Calibration of per-layer thresholds, realized sparsity, and perplexity.

use candle_core::{Device, D};
use powerinfer::analysis::{ActivationStats, Histogram};
use powerinfer::{
    input_rule::ChessRule, input_rule::GreedyPath, layers::InputSparseLinear, GateFirst,
    InputScore, InputScores, InputSparseFfn, InputThresholds, WeightTraffic,
};

use crate::error::{check_count, ErrorKind, Result};
use crate::model::{Attention, Ffn, Llama, Projection};

/// Bytes of logits the perplexity functions have the LM head compute at once: 32 rows of
/// Qwen2.5's 151936-token vocabulary would be 19 MB, held twice (the head's output and its
/// scratch), 67 MB on Gemma 3's 262144.
const LOGIT_BYTES: usize = 8 << 20;

/// Rows of logits per block for a vocabulary of `vocab` tokens: [`LOGIT_BYTES`] of them, 1 to 64.
fn logit_rows(vocab: usize) -> usize {
    (LOGIT_BYTES / (4 * vocab.max(1))).clamp(1, 64)
}

/// A perplexity and its standard error (llama.cpp's estimate), over `scored` tokens.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Perplexity {
    /// `exp(mean nll)`.
    pub ppl: f64,
    /// `ppl * sqrt(var(nll) / (scored - 1))`.
    pub err: f64,
    /// Tokens scored.
    pub scored: usize,
}

/// Positions per forward call when a recording pass runs a window on the fused decoder.
const RECORD_STEP: usize = 64;

impl Llama {
    pub(crate) fn hybrids(&mut self) -> Result<Vec<&mut powerinfer::HybridFfn>> {
        self.layers
            .iter_mut()
            .map(|l| match &mut l.ffn {
                Ffn::Hybrid(h) => Ok(&mut **h),
                Ffn::Dense(_) | Ffn::Kernels(_) | Ffn::InputSparse(_) => Err(ErrorKind::Engine(
                    powerinfer::Error::from(powerinfer::ErrorKind::Config {
                        setting: "ffn".into(),
                        reason: "this needs a model loaded with FfnMode::Hybrid".into(),
                    }),
                )
                .into()),
            })
            .collect()
    }

    /// Per-layer `|h|` thresholds that drop a fraction `sparsity` of FFN neurons on `tokens`
    /// (exact thresholding of the contribution, computed densely), run in chunks of `chunk`.
    pub fn calibrate_thresholds(
        &mut self,
        tokens: &[u32],
        chunk: usize,
        sparsity: f64,
    ) -> Result<Vec<f32>> {
        for h in self.hybrids()? {
            h.set_force_dense(true);
            h.enable_stats_with_magnitudes(0.0);
        }
        let run = self.run_windows(tokens, chunk);
        // Restore every layer before reporting a failed run.
        let stats: Vec<Option<ActivationStats>> = self
            .hybrids()?
            .into_iter()
            .map(|h| {
                h.set_force_dense(false);
                h.take_stats()
            })
            .collect();
        run?;
        stats
            .into_iter()
            .enumerate()
            .map(|(l, s)| {
                s.and_then(|s| s.threshold_for_sparsity(sparsity))
                    .ok_or_else(|| {
                        ErrorKind::Prompt {
                            reason: format!(
                            "layer {l}: no calibration data (sparsity {sparsity} must be in [0, 1))"
                        ),
                        }
                        .into()
                    })
            })
            .collect()
    }

    /// Uses `GateFirst` with `thresholds[layer]` in every hybrid layer.
    pub fn set_gate_first(&mut self, thresholds: &[f32]) -> Result<()> {
        let hybrids = self.hybrids()?;
        check_count(
            "thresholds (one per layer)",
            hybrids.len(),
            thresholds.len(),
        )?;
        for (h, &t) in hybrids.into_iter().zip(thresholds) {
            h.set_predictor(GateFirst::new(t)?);
        }
        Ok(())
    }

    /// Starts counting computed neurons in every hybrid layer (no-op for dense layers).
    pub fn enable_ffn_stats(&mut self) {
        for l in &self.layers {
            if let Ffn::Hybrid(h) = &l.ffn {
                h.enable_stats(0.0);
            }
        }
    }

    /// Realized FFN sparsity per layer since [`Llama::enable_ffn_stats`]: the share of
    /// (token, neuron) pairs not computed (or computed as zero). `None` for dense layers.
    pub fn take_ffn_sparsity(&mut self) -> Vec<Option<f64>> {
        self.layers
            .iter()
            .map(|l| match &l.ffn {
                Ffn::Hybrid(h) => h.take_stats().map(|s: ActivationStats| {
                    let kept: u64 = s.counts.iter().sum();
                    1.0 - kept as f64 / (s.tokens.max(1) as f64 * s.counts.len() as f64)
                }),
                Ffn::Dense(_) | Ffn::Kernels(_) | Ffn::InputSparse(_) => None,
            })
            .collect()
    }

    fn input_sparse(&mut self) -> Result<Vec<&mut InputSparseFfn>> {
        let dense = (0..self.layers.len()).find(|&l| self.runs_rows_dense(l));
        self.layers
            .iter_mut()
            .map(|layer| match (&mut layer.ffn, dense) {
                (Ffn::InputSparse(f), None) => Ok(&mut **f),
                (_, Some(l)) => Err(not_input_sparse(format!(
                    "layer {l}'s FFN runs as the dense one since `Llama::run_rows_dense`; \
                     load the model again to calibrate"
                ))),
                _ => Err(not_input_sparse(
                    "this needs a model loaded with FfnMode::InputSparse".into(),
                )),
            })
            .collect()
    }

    /// Calibration of the input-sparse rule: runs `tokens` (windows of `chunk`) with every
    /// threshold at 0 (the dense FFN) and returns each layer's score histograms under `score`.
    /// The layers' rules are restored afterwards.
    pub fn record_input_scores(
        &mut self,
        tokens: &[u32],
        chunk: usize,
        score: InputScore,
    ) -> Result<Vec<InputScores>> {
        let mut saved = Vec::new();
        for f in self.input_sparse()? {
            saved.push((f.score(), f.thresholds()));
            f.set_rule(score, InputThresholds::default())?;
            f.record_scores();
        }
        let run = self.run_windows(tokens, chunk);
        let mut out = Vec::new();
        for (f, (sc, t)) in self.input_sparse()?.into_iter().zip(saved) {
            out.push(f.take_scores().unwrap_or_default());
            f.set_rule(sc, t)?;
            f.take_traffic();
        }
        run?;
        Ok(out)
    }

    /// `f` on every input-sparse layer with its entry of `per_layer` (one per layer, else a
    /// typed error naming `what`).
    fn each_input_layer<T, R>(
        &mut self,
        per_layer: &[T],
        what: &str,
        f: impl Fn(&mut InputSparseFfn, &T) -> powerinfer::Result<R>,
    ) -> Result<Vec<R>> {
        let layers = self.input_sparse()?;
        check_count(what, layers.len(), per_layer.len())?;
        layers
            .into_iter()
            .zip(per_layer)
            .map(|(l, t)| Ok(f(l, t)?))
            .collect()
    }

    /// TEAL's greedy split of each layer's sparsity between gate, up and down, up to `target`
    /// in steps of `step` (see [`InputSparseFfn::greedy_allocation`]), measured on the rows
    /// sampled in `scores` (from [`Llama::record_input_scores`] on this model).
    pub fn greedy_input_allocation(
        &mut self,
        scores: &[InputScores],
        target: f64,
        step: f64,
    ) -> Result<Vec<GreedyPath>> {
        self.each_input_layer(scores, "input score histograms", |f, s| {
            f.greedy_allocation(s, target, step)
        })
    }

    /// Each layer's CHESS rule skipping about `fraction` of its neurons, from the up
    /// values and rows recorded in `scores` ([`Llama::record_input_scores`] on this model).
    pub fn chess_rules(&mut self, scores: &[InputScores], fraction: f64) -> Result<Vec<ChessRule>> {
        self.each_input_layer(scores, "input score histograms", |f, s| {
            f.chess_rule(s, fraction)
        })
    }

    /// Sets every layer's CHESS rule (`None`: every neuron computed); needs a model loaded
    /// with `FfnMode::InputSparse { up_rows: true, .. }`.
    pub fn set_chess_rules(&mut self, rules: Option<&[ChessRule]>) -> Result<()> {
        match rules {
            None => {
                for f in self.input_sparse()? {
                    f.set_chess_rule(None)?;
                }
            }
            Some(r) => {
                self.each_input_layer(r, "CHESS rules", |f, r| f.set_chess_rule(Some(r.clone())))?;
            }
        }
        Ok(())
    }

    /// Sets every layer's input-sparse rule: `score` and one [`InputThresholds`] per layer.
    ///
    /// A layer [`Llama::run_rows_dense`] made dense skips nothing and ignores its entry.
    pub fn set_input_rule(
        &mut self,
        score: InputScore,
        thresholds: &[InputThresholds],
    ) -> Result<()> {
        check_count("input thresholds", self.layers.len(), thresholds.len())?;
        for (l, (layer, t)) in self.layers.iter_mut().zip(thresholds).enumerate() {
            match &mut layer.ffn {
                Ffn::InputSparse(f) => f.set_rule(score, *t)?,
                _ if self.rows_dense.get(l) == Some(&true) => {}
                _ => {
                    return Err(not_input_sparse(
                        "this needs a model loaded with FfnMode::InputSparse".into(),
                    ))
                }
            }
        }
        Ok(())
    }

    /// With `on`, every FFN matrix the layout planner stored as rows takes the masked input too
    /// ([`InputSparseFfn::mask_rows`]): the output is then the rule's whole effect on quality,
    /// whatever layouts were chosen. Off by default.
    pub fn mask_rows(&mut self, on: bool) -> Result<()> {
        for f in self.input_sparse()? {
            f.mask_rows(on);
        }
        Ok(())
    }

    /// Whether the attention projections run on input-sparse columns
    /// (`FfnMode::InputSparse { attention: true, .. }` on a GGUF file).
    pub fn input_sparse_attention(&self) -> bool {
        !self.layers.is_empty()
            && self.layers.iter().all(|l| {
                matches!(
                    &l.attn,
                    Attention::Fused {
                        qkv: Projection::Columns(_),
                        o: Projection::Columns(_)
                    }
                )
            })
    }

    /// The input-sparse attention projections, `[qkv, o]` per layer.
    fn sparse_attention(&mut self) -> Result<Vec<[&mut InputSparseLinear; 2]>> {
        self.layers
            .iter_mut()
            .map(|l| match &mut l.attn {
                Attention::Fused {
                    qkv: Projection::Columns(qkv),
                    o: Projection::Columns(o),
                } => Ok([&mut **qkv, &mut **o]),
                _ => Err(ErrorKind::Engine(powerinfer::Error::config(
                    "attention",
                    "this needs a GGUF model loaded with FfnMode::InputSparse { attention: true, .. }",
                ))
                .into()),
            })
            .collect()
    }

    /// Calibration of the attention rule: runs `tokens` (windows of `chunk`) with every
    /// attention threshold at 0 and returns each layer's `|x|` histograms of the q/k/v input and
    /// of the o input. The thresholds are restored afterwards.
    pub fn record_attention_scores(
        &mut self,
        tokens: &[u32],
        chunk: usize,
    ) -> Result<Vec<[Histogram; 2]>> {
        let mut saved = Vec::new();
        for p in self.sparse_attention()? {
            for l in p {
                saved.push(l.threshold());
                l.set_threshold(0.0)?;
                l.record_scores();
            }
        }
        let run = self.run_windows(tokens, chunk);
        let mut out = Vec::new();
        let mut saved = saved.into_iter();
        for p in self.sparse_attention()? {
            let mut hists = [Histogram::default(), Histogram::default()];
            for (l, h) in p.into_iter().zip(&mut hists) {
                l.take_traffic();
                *h = l.take_scores().unwrap_or_default();
                l.set_threshold(saved.next().unwrap_or(0.0))?;
            }
            out.push(hists);
        }
        run?;
        Ok(out)
    }

    /// Sets every layer's attention thresholds on `|x|`: `[q/k/v input, o input]` per layer.
    pub fn set_attention_rule(&mut self, thresholds: &[[f32; 2]]) -> Result<()> {
        let layers = self.sparse_attention()?;
        check_count("attention thresholds", layers.len(), thresholds.len())?;
        for ([qkv, o], t) in layers.into_iter().zip(thresholds) {
            qkv.set_threshold(t[0])?;
            o.set_threshold(t[1])?;
        }
        Ok(())
    }

    /// Weight bytes the input-sparse attention projections read since the last call, summed
    /// over layers (zero when they are dense rows).
    pub fn take_attention_traffic(&mut self) -> WeightTraffic {
        let mut t = WeightTraffic::default();
        for l in &self.layers {
            if let Attention::Fused {
                qkv: Projection::Columns(qkv),
                o: Projection::Columns(o),
            } = &l.attn
            {
                t.add(&qkv.take_traffic());
                t.add(&o.take_traffic());
            }
        }
        t
    }

    /// Weight bytes the input-sparse FFNs read since the last call, summed over layers (zero
    /// for other FFNs).
    ///
    /// A layer [`Llama::run_rows_dense`] made dense reads every byte of its matrices for each
    /// row the others saw (every layer sees every row).
    pub fn take_ffn_traffic(&mut self) -> WeightTraffic {
        let mut t = WeightTraffic::default();
        let mut rows = 0;
        for l in &self.layers {
            if let Ffn::InputSparse(f) = &l.ffn {
                let lt = f.take_traffic();
                rows = rows.max(lt.rows);
                t.add(&lt);
            }
        }
        for (i, l) in self.layers.iter().enumerate() {
            if let (Ffn::Kernels(k), true) = (&l.ffn, self.runs_rows_dense(i)) {
                let bytes = rows * (k.gate_up.bytes() + k.down.bytes()) as u64;
                t.add(&WeightTraffic {
                    rows,
                    read: bytes,
                    dense: bytes,
                });
            }
        }
        t
    }

    /// `tokens` cut into windows of `chunk` tokens (2 to the context), those of 2 or more.
    fn windows<'t>(&self, tokens: &'t [u32], chunk: usize) -> impl Iterator<Item = &'t [u32]> {
        let chunk = chunk.clamp(2, self.config.context);
        tokens.chunks(chunk).filter(|w| w.len() >= 2)
    }

    /// Runs `tokens` in independent windows of `chunk` tokens for what the layers record
    /// (scores, statistics): the LM head computes only each window's last row. On the fused
    /// decoder a window goes in steps of [`RECORD_STEP`] positions, which give the same bits
    /// as the whole window (its rows are computed as single-row steps either way) with a
    /// fraction of its activation buffers (a 512-token window's are about 200 MB on
    /// Qwen2.5-1.5B).
    fn run_windows(&mut self, tokens: &[u32], chunk: usize) -> Result<()> {
        let step = match self.is_fused() {
            true => RECORD_STEP,
            false => usize::MAX,
        };
        for w in self.windows(tokens, chunk) {
            self.clear_kv_cache();
            for (i, part) in w.chunks(step).enumerate() {
                self.forward(part, i * step)?;
            }
        }
        powerinfer::cpu::release_freed_memory();
        Ok(())
    }

    /// One window from position 0 (the cache cleared), its logits handed to `f` in blocks of
    /// rows (`f(first_row, logits)`): a window's logits whole are `[len, vocab]` (311 MB for 512
    /// tokens on a 151936-token vocabulary). On the fused decoder the window also goes in steps
    /// of [`RECORD_STEP`] positions, with the same bits as the whole window and a fraction of its
    /// activation buffers.
    fn window_logits(
        &mut self,
        w: &[u32],
        mut f: impl FnMut(usize, &[f32]) -> Result<()>,
    ) -> Result<()> {
        let step = match self.is_fused() {
            true => RECORD_STEP,
            false => w.len().max(1),
        };
        let block = logit_rows(self.config.vocab);
        for (i, part) in w.chunks(step).enumerate() {
            let at = i * step;
            self.forward_all_each(part, at, block, |first, rows| f(at + first, rows))?;
        }
        Ok(())
    }

    /// Runs `tokens` in independent windows of `chunk` tokens, handing each window's logits
    /// (`[len, vocab]`) and tokens to `f`.
    pub fn run_chunks(
        &mut self,
        tokens: &[u32],
        chunk: usize,
        mut f: impl FnMut(&candle_core::Tensor, &[u32]) -> Result<()>,
    ) -> Result<()> {
        for w in self.windows(tokens, chunk) {
            self.clear_kv_cache();
            let logits = self.forward_all(w, 0)?;
            f(&logits, w)?;
        }
        Ok(())
    }

    /// Perplexity by llama.cpp's `llama-perplexity` rule, so the two numbers compare: `tokens`
    /// is the whole text as a sequence starts ([`crate::TextTokenizer::encode_sequence`]); it is
    /// cut into at most `chunks` windows of `ctx` tokens (the tail that does not fill one is
    /// dropped), each run from an empty cache with its first token replaced by `bos` when given
    /// (the tokenizer's `add_bos`), and only the second half of each window is scored: the logits
    /// at positions `ctx / 2 .. ctx - 1` predict the next token. Per token
    /// `nll = -(z_t - max z - ln sum exp(z - max z))`, the sum in f64.
    pub fn perplexity_llama_cpp(
        &mut self,
        tokens: &[u32],
        ctx: usize,
        chunks: usize,
        bos: Option<u32>,
    ) -> Result<Perplexity> {
        if ctx < 4 || tokens.len() < ctx {
            return Err(ErrorKind::Prompt {
                reason: format!(
                    "need a window of at least 4 tokens and a text of at least one window \
                     ({} tokens, window {ctx})",
                    tokens.len()
                ),
            }
            .into());
        }
        let n = chunks.min(tokens.len() / ctx);
        let (mut sum, mut sum2, mut count) = (0f64, 0f64, 0usize);
        let mut window = Vec::with_capacity(ctx);
        for c in 0..n {
            window.clear();
            window.extend_from_slice(&tokens[c * ctx..(c + 1) * ctx]);
            if let Some(b) = bos {
                window[0] = b;
            }
            self.clear_kv_cache();
            let vocab = self.config.vocab;
            self.window_logits(&window, |first, block| {
                for (p, z) in (first..).zip(block.chunks_exact(vocab)) {
                    if p < ctx / 2 || p + 1 >= ctx {
                        continue;
                    }
                    let m = z.iter().fold(f32::NEG_INFINITY, |a, &v| a.max(v));
                    let s: f64 = z.iter().map(|&v| (v - m).exp() as f64).sum();
                    let nll = -((z[window[p + 1] as usize] - m) as f64 - s.ln());
                    sum += nll;
                    sum2 += nll * nll;
                    count += 1;
                }
                Ok(())
            })?;
        }
        let mean = sum / count as f64;
        let ppl = mean.exp();
        let var = (sum2 / count as f64 - mean * mean) / (count as f64 - 1.0).max(1.0);
        Ok(Perplexity {
            ppl,
            err: ppl * var.max(0.0).sqrt(),
            scored: count,
        })
    }

    /// Perplexity of `tokens` in independent windows of `chunk` tokens (each window predicts its
    /// tokens 1.. from the ones before).
    pub fn perplexity(&mut self, tokens: &[u32], chunk: usize) -> Result<f64> {
        let (mut nll, mut n) = (0f64, 0usize);
        let vocab = self.config.vocab;
        for w in self.windows(tokens, chunk) {
            self.clear_kv_cache();
            self.window_logits(w, |first, block| {
                for (i, z) in (first..).zip(block.chunks_exact(vocab)) {
                    if i + 1 < w.len() {
                        let row = candle_core::Tensor::from_slice(z, vocab, &Device::Cpu)?;
                        let lp = candle_nn::ops::log_softmax(&row, D::Minus1)?;
                        nll -= lp.get(w[i + 1] as usize)?.to_scalar::<f32>()? as f64;
                        n += 1;
                    }
                }
                Ok(())
            })?;
        }
        // The rows' tensors above come and go a vocabulary at a time; glibc keeps them.
        powerinfer::cpu::release_freed_memory();
        if n == 0 {
            return Err(ErrorKind::Prompt {
                reason: "need at least 2 tokens for perplexity".into(),
            }
            .into());
        }
        Ok((nll / n as f64).exp())
    }
}

/// The typed error of an input-sparse call on a model whose FFN is not input-sparse.
fn not_input_sparse(why: String) -> crate::error::Error {
    ErrorKind::Engine(powerinfer::Error::config("ffn", why)).into()
}
