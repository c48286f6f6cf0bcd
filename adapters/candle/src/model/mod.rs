//! A llama-family decoder (RMSNorm, RoPE, grouped-query attention with a KV cache) whose FFN is
//! either the dense candle FFN (the reference) or `powerinfer::HybridFfn`.
//!
//! Dense and sparse are the same code path with a different [`Ffn`]. The dense path uses candle's
//! own quantized matmul, op for op as `candle_transformers::models::quantized_llama`, so it is the
//! peer the tests compare against.

mod decoder;
mod kernel_ffn;
mod layers;
mod rope;
mod timing;

use candle_core::{DType, Device, IndexOp, Module, Tensor};
use powerinfer::layout::{Layout, LayoutDecision};
use powerinfer::HybridFfn;

use crate::config::LlamaConfig;
use crate::error::{ErrorKind, Result};

pub(crate) use decoder::{Decoder, Embed};
pub use kernel_ffn::KernelFfn;
use layers::{forward_with_row_rms, prefetch_target, row_rms};
pub(crate) use layers::{Attention, GemmaNorms, Layer, Projection, RmsNorm, TokenEmbedding};
pub use layers::{DenseFfn, Ffn, FfnProbe, Linear};
use rope::attention;
pub(crate) use rope::{rope_tables, MAX_POSITIONS};
use timing::linear_bytes;
pub(crate) use timing::{Clock, Lap};
pub use timing::{DecodeBytes, Timings};

/// How a model runs a forward pass, chosen once at load.
#[derive(Debug)]
pub(crate) enum Execution {
    /// candle ops around the FFN (the reference path): the token embedding and the RoPE tables
    /// (`[positions, head_dim / 2]`).
    Candle {
        embed: TokenEmbedding,
        cos: Tensor,
        sin: Tensor,
    },
    /// The fused decoder: every projection and the FFN on powerinfer's kernels and one thread
    /// pool (it holds its own embedding, tables and KV cache).
    Fused(Box<Decoder>),
}

/// A llama-family causal LM.
#[derive(Debug)]
pub struct Llama {
    pub(crate) config: LlamaConfig,
    /// How a forward pass runs: candle ops, or the fused decoder.
    pub(crate) exec: Execution,
    pub(crate) layers: Vec<Layer>,
    pub(crate) norm: RmsNorm,
    pub(crate) lm_head: Linear,
    pub(crate) timings: Option<Timings>,
    /// The candle path's copy of the last logits for [`Llama::forward_logits`].
    pub(crate) logits_copy: Vec<f32>,
    /// Layers ahead whose fast tiers prefetch their predicted neurons (0: none; see
    /// [`crate::TierOptions::prefetch_depth`]).
    pub(crate) prefetch_depth: usize,
    /// What the input-sparse layouts measured and chose while loading (empty unless
    /// `Layouts::Measured`).
    pub(crate) layout_decisions: Vec<LayoutDecision>,
    /// Per layer, whether [`Llama::run_rows_dense`] made its input-sparse FFN the dense one
    /// (empty before it ran).
    pub(crate) rows_dense: Vec<bool>,
}

impl Llama {
    /// The hyper-parameters.
    pub fn config(&self) -> &LlamaConfig {
        &self.config
    }

    /// What the input-sparse FFN's layout planner measured and chose while loading, one entry per
    /// (matrix, block type, shape): empty unless the mode asked for `Layouts::Measured`.
    pub fn layout_decisions(&self) -> &[LayoutDecision] {
        &self.layout_decisions
    }

    /// Per matrix (gate, up, down), how many layers' input-sparse FFNs store it by column
    /// (input-sparse) and how many as dense rows (a layer [`Llama::run_rows_dense`] made dense
    /// counts as rows).
    pub fn ffn_layout_counts(&self) -> [(usize, usize); 3] {
        let mut c = [(0, 0); 3];
        for (l, f) in self.ffns().enumerate() {
            let layouts = match f {
                Ffn::InputSparse(f) => f.layouts(),
                _ if self.runs_rows_dense(l) => [Layout::Rows; 3],
                _ => continue,
            };
            for (c, l) in c.iter_mut().zip(layouts) {
                match l {
                    Layout::Columns => c.0 += 1,
                    Layout::Rows => c.1 += 1,
                }
            }
        }
        c
    }

    /// Whether layer `l`'s input-sparse FFN runs as the dense one ([`Llama::run_rows_dense`]).
    pub(crate) fn runs_rows_dense(&self, l: usize) -> bool {
        self.rows_dense.get(l).copied().unwrap_or(false)
    }

    /// The FFN of every layer (to read statistics or switch modes).
    pub fn ffns(&self) -> impl Iterator<Item = &Ffn> {
        self.layers.iter().map(|l| &l.ffn)
    }

    /// Starts (or resets) per-component timing.
    pub fn enable_timings(&mut self) {
        self.timings = Some(Timings::default());
    }

    /// Per-component times since [`Llama::enable_timings`].
    pub fn timings(&self) -> Option<&Timings> {
        self.timings.as_ref()
    }

    /// Bytes of weights one decoded token reads, by component, as this model stores them.
    pub fn decode_bytes(&self) -> DecodeBytes {
        let cfg = &self.config;
        let mut b = DecodeBytes {
            lm_head: linear_bytes(&self.lm_head),
            kv_per_position: 2 * cfg.layers * cfg.kv_heads * cfg.head_dim() * 4,
            ..Default::default()
        };
        for l in &self.layers {
            b.attention += match &l.attn {
                Attention::Ops { q, k, v, o } => [q, k, v, o].iter().map(|l| linear_bytes(l)).sum(),
                Attention::Fused { qkv, o } => qkv.bytes() + o.bytes(),
            };
            let (gu, d) = match &l.ffn {
                Ffn::Dense(f) => (
                    linear_bytes(&f.gate) + linear_bytes(&f.up),
                    linear_bytes(&f.down),
                ),
                Ffn::Kernels(f) => (f.gate_up.bytes(), f.down.bytes()),
                Ffn::InputSparse(f) => {
                    let (g, u, d) = f.matrix_bytes();
                    (g + u, d)
                }
                Ffn::Hybrid(h) => {
                    let (spec, dt) = (h.spec(), h.bundles().dtype());
                    let rows = if spec.is_gated() { 2 } else { 1 };
                    (
                        rows * dt.row_bytes(spec.hidden()) * spec.intermediate(),
                        dt.down().row_bytes(spec.hidden()) * spec.intermediate(),
                    )
                }
            };
            b.ffn_gate_up += gu;
            b.ffn_down += d;
        }
        b
    }

    /// Forgets the KV cache (start a new sequence).
    pub fn clear_kv_cache(&mut self) {
        for l in &mut self.layers {
            l.kv = None;
        }
        if let Execution::Fused(d) = &mut self.exec {
            d.clear();
        }
    }

    /// Whether this model runs on the fused decoder (every projection and the FFN on
    /// powerinfer's kernels and one thread pool; see [`crate::FfnMode`]) rather than on candle ops.
    pub fn is_fused(&self) -> bool {
        matches!(self.exec, Execution::Fused(_))
    }

    /// Preallocates the fused decoder's KV cache for `positions` positions (it otherwise grows
    /// geometrically as a sequence does). No effect on the candle path.
    pub fn reserve_kv_cache(&mut self, positions: usize) {
        if let Execution::Fused(d) = &mut self.exec {
            d.reserve(&self.config, positions);
        }
    }

    /// Like [`Llama::forward`] but returns the last position's logits as a slice the model owns:
    /// on the fused decoder this allocates nothing once the sequence's buffers have grown (the
    /// decode loop of a server or benchmark). On the candle path it copies the logits tensor.
    pub fn forward_logits(&mut self, tokens: &[u32], pos: usize) -> Result<&[f32]> {
        if !self.is_fused() {
            let t = self.forward_impl(tokens, pos, true)?;
            self.logits_copy = t.to_vec1::<f32>()?;
            return Ok(&self.logits_copy);
        }
        let logits = self.fused(tokens, pos, |d, config, layers, depth, clock| {
            d.forward(config, layers, depth, tokens, pos, true, clock)
        })?;
        check_logits(logits)?;
        Ok(logits)
    }

    /// Checks `tokens` at `pos`, runs `run` on the fused decoder and its model, and books the
    /// clock's laps (the LM head last) into the timings.
    fn fused<'s, R>(
        &'s mut self,
        tokens: &[u32],
        pos: usize,
        run: impl FnOnce(&'s mut Decoder, &'s LlamaConfig, &'s [Layer], usize, &mut Clock) -> Result<R>,
    ) -> Result<R> {
        let mut clock = Clock::new(self.timings.is_some());
        self.check_tokens(tokens, pos)?;
        let Llama {
            config,
            layers,
            exec: Execution::Fused(d),
            timings,
            prefetch_depth,
            ..
        } = self
        else {
            return Err(powerinfer::Error::config("fused decoder", "not built").into());
        };
        let out = run(d, config, layers, *prefetch_depth, &mut clock)?;
        clock.lap(Lap::LmHead);
        if let Some(t) = timings {
            clock.add_to(t);
        }
        Ok(out)
    }

    /// Runs `tokens` (one sequence) at positions `pos..pos + tokens.len()` and returns the logits
    /// of every position (`[tokens, vocab]`, f32). Tokens past the context are a typed error.
    pub fn forward_all(&mut self, tokens: &[u32], pos: usize) -> Result<Tensor> {
        self.forward_impl(tokens, pos, false)
    }

    /// Like [`Llama::forward_all`], but hands the logits to `f` in blocks of at most `block`
    /// rows (`f(first_row, logits)`, row-major `[rows, vocab]`) instead of returning them: on the
    /// fused decoder the LM head runs block by block, so a window's logits are never held whole
    /// (311 MB for 512 tokens on Qwen2.5's vocabulary). The candle path computes them whole and
    /// hands out slices.
    pub fn forward_all_each(
        &mut self,
        tokens: &[u32],
        pos: usize,
        block: usize,
        mut f: impl FnMut(usize, &[f32]) -> Result<()>,
    ) -> Result<()> {
        if !self.is_fused() {
            let all = self.forward_impl(tokens, pos, false)?;
            let all = all.flatten_all()?.to_vec1::<f32>()?;
            let (vocab, block) = (self.config.vocab, block.max(1));
            for (b, rows) in all.chunks(block * vocab).enumerate() {
                f(b * block, rows)?;
            }
            return Ok(());
        }
        let vocab = self.config.vocab;
        let mut checked = |first: usize, logits: &[f32]| {
            check_logits_from(logits, first * vocab)?;
            f(first, logits)
        };
        self.fused(tokens, pos, |d, config, layers, depth, clock| {
            d.forward_each(
                config,
                layers,
                depth,
                tokens,
                pos,
                block,
                clock,
                &mut checked,
            )
        })
    }

    /// Like [`Llama::forward_all`] but returns only the last position's logits (`[vocab]`).
    pub fn forward(&mut self, tokens: &[u32], pos: usize) -> Result<Tensor> {
        self.forward_impl(tokens, pos, true)
    }

    /// Runs `tokens` in independent windows of `chunk` tokens through the decoder layers only (no
    /// LM head), showing each layer's FFN input and activations to `probe`. Needs dense FFNs
    /// (load with [`crate::FfnMode::Analysis`] for speed: f32 GEMMs).
    pub fn probe_ffn(
        &mut self,
        tokens: &[u32],
        chunk: usize,
        probe: &mut dyn FfnProbe,
    ) -> Result<()> {
        if self.layers.iter().any(|l| matches!(l.ffn, Ffn::Hybrid(_))) {
            return Err(powerinfer::Error::config(
                "ffn",
                "probing needs dense FFNs (FfnMode::Analysis or Dense)",
            )
            .into());
        }
        let chunk = chunk.clamp(1, self.config.context);
        for w in tokens.chunks(chunk) {
            self.clear_kv_cache();
            self.trunk(w, 0, Some(&mut *probe))?;
        }
        self.clear_kv_cache();
        Ok(())
    }

    fn forward_impl(&mut self, tokens: &[u32], pos: usize, last_only: bool) -> Result<Tensor> {
        let mut clock = Clock::new(self.timings.is_some());
        if self.is_fused() {
            self.check_tokens(tokens, pos)?;
        }
        if let Execution::Fused(d) = &mut self.exec {
            let logits = d.forward(
                &self.config,
                &self.layers,
                self.prefetch_depth,
                tokens,
                pos,
                last_only,
                &mut clock,
            )?;
            let vocab = self.config.vocab;
            check_logits(logits)?;
            let t = if last_only {
                Tensor::from_slice(logits, vocab, &Device::Cpu)?
            } else {
                Tensor::from_slice(logits, (tokens.len(), vocab), &Device::Cpu)?
            };
            clock.lap(Lap::LmHead);
            if let Some(t) = &mut self.timings {
                clock.add_to(t);
            }
            return Ok(t);
        }
        let x = self.trunk_timed(tokens, pos, None, &mut clock)?;
        let seq = tokens.len();
        let x = if last_only {
            x.i((.., seq - 1..seq, ..))?
        } else {
            x
        };
        let x = self.norm.forward(&x)?;
        let logits = self.lm_head.forward(&x)?.squeeze(0)?;
        let logits = if last_only {
            logits.squeeze(0)?
        } else {
            logits
        };
        let logits = logits.to_dtype(DType::F32)?;
        // One sum finds a NaN or infinity without copying the logits out.
        if !logits.sum_all()?.to_scalar::<f32>()?.is_finite() {
            check_logits(&logits.flatten_all()?.to_vec1::<f32>()?)?;
        }
        clock.lap(Lap::LmHead);
        if let Some(t) = &mut self.timings {
            clock.add_to(t);
        }
        Ok(logits)
    }

    /// While layer `l` runs: the layer `prefetch_depth` ahead, if it has a fast tier to prefetch
    /// into, with its FFN norm.
    fn prefetch_target(&self, l: usize) -> Option<(&RmsNorm, &HybridFfn)> {
        prefetch_target(&self.layers, self.prefetch_depth, l)
    }

    /// Tokens to run at `pos`: at least one, inside the context and the vocabulary.
    fn check_tokens(&self, tokens: &[u32], pos: usize) -> Result<()> {
        let seq = tokens.len();
        if seq == 0 {
            return Err(ErrorKind::Prompt {
                reason: "no tokens to run".into(),
            }
            .into());
        }
        let positions = match &self.exec {
            Execution::Candle { cos, .. } => cos.dim(0)?,
            Execution::Fused(d) => d.max_positions(),
        };
        if pos + seq > self.config.context.min(positions) {
            return Err(ErrorKind::Prompt {
                reason: format!(
                    "{} tokens exceed the context of {}",
                    pos + seq,
                    self.config.context
                ),
            }
            .into());
        }
        if let Some(&t) = tokens.iter().find(|&&t| t as usize >= self.config.vocab) {
            return Err(ErrorKind::Prompt {
                reason: format!(
                    "token id {t} is outside the vocabulary ({})",
                    self.config.vocab
                ),
            }
            .into());
        }
        Ok(())
    }

    fn trunk(
        &mut self,
        tokens: &[u32],
        pos: usize,
        probe: Option<&mut dyn FfnProbe>,
    ) -> Result<Tensor> {
        self.trunk_timed(tokens, pos, probe, &mut Clock::new(false))
    }

    /// Embedding and decoder layers: the hidden states `[1, tokens, hidden]` before the final norm.
    fn trunk_timed(
        &mut self,
        tokens: &[u32],
        pos: usize,
        mut probe: Option<&mut dyn FfnProbe>,
        clock: &mut Clock,
    ) -> Result<Tensor> {
        self.check_tokens(tokens, pos)?;
        let seq = tokens.len();
        let dev = Device::Cpu;
        let ids = Tensor::new(tokens, &dev)?.unsqueeze(0)?;
        let mask = if seq == 1 {
            None
        } else {
            Some(candle_transformers::utils::build_causal_mask(
                seq, pos, &dev,
            )?)
        };
        let Execution::Candle { embed, cos, sin } = &self.exec else {
            return Err(powerinfer::Error::config(
                "embedding",
                "fused models run on the fused decoder",
            )
            .into());
        };
        let mut x = embed.forward(tokens, &ids)?;
        let (cos, sin) = (cos.narrow(0, pos, seq)?, sin.narrow(0, pos, seq)?);
        clock.lap(Lap::Other);
        let cfg = &self.config;
        for l in 0..self.layers.len() {
            let layer = &mut self.layers[l];
            let h = layer.attn_norm.forward(&x)?;
            clock.lap(Lap::Other);
            let a = attention(layer, cfg, &h, &cos, &sin, mask.as_ref(), pos)?;
            clock.lap(Lap::Attention);
            x = (a + &x)?;
            // A predictor on the pre-norm residual (PowerInfer's) gets each row's RMS.
            let row_rms = match &layer.ffn {
                Ffn::Hybrid(h) if h.needs_row_rms() => Some(row_rms(&x, layer.ffn_norm.eps)?),
                _ => None,
            };
            let h = layer.ffn_norm.forward(&x)?;
            clock.lap(Lap::Other);
            if let Some((ahead, ffn)) = self.prefetch_target(l) {
                let p = ahead.forward(&x)?.flatten_all()?.to_dtype(DType::F32)?;
                ffn.prefetch(&p.to_vec1::<f32>()?, seq)?;
            }
            let layer = &self.layers[l];
            let f = match (&layer.ffn, probe.as_deref_mut(), &row_rms) {
                (Ffn::Dense(d), Some(p), _) => {
                    let act = d.activations(&h)?;
                    let rows = (seq, cfg.hidden);
                    p.observe(l, &h.reshape(rows)?, &act.reshape((seq, cfg.intermediate))?)?;
                    d.down.forward(&act)?
                }
                (Ffn::Hybrid(ffn), _, Some(r)) => forward_with_row_rms(ffn, &h, r)?,
                (ffn, _, _) => ffn.forward(&h)?,
            };
            clock.lap(Lap::Ffn);
            x = (f + &x)?;
        }
        Ok(x)
    }
}

/// Non-finite logits (from NaN or infinite weights the load could not see, or values that
/// overflowed) are a typed error rather than a token sampled from garbage.
fn check_logits(logits: &[f32]) -> Result<()> {
    check_logits_from(logits, 0)
}

/// [`check_logits`] on a block of logits that starts at element `offset` of the whole.
fn check_logits_from(logits: &[f32], offset: usize) -> Result<()> {
    match logits.iter().position(|v| !v.is_finite()) {
        Some(i) => Err(powerinfer::Error::from(powerinfer::ErrorKind::NonFinite {
            tensor: "logits".into(),
            index: offset + i,
        })
        .into()),
        None => Ok(()),
    }
}
