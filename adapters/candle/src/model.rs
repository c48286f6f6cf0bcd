//! A llama-family decoder (RMSNorm, RoPE, grouped-query attention with a KV cache) whose FFN is
//! either the dense candle FFN (the reference) or `powerinfer::HybridFfn`.
//!
//! Dense and sparse are the same code path with a different [`Ffn`]. The dense path uses candle's
//! own quantized matmul, op for op as `candle_transformers::models::quantized_llama`, so it is the
//! peer the tests compare against.

use std::sync::Arc;
use std::time::{Duration, Instant};

use candle_core::quantized::QMatMul;
use candle_core::{DType, Device, IndexOp, Module, Tensor};
use candle_nn::Embedding;
use powerinfer::{Activation, HybridFfn};

use crate::config::LlamaConfig;
use crate::error::{ErrorKind, Result};
use crate::fused::{Decoder, KernelFfn};

/// A linear layer: candle's `QMatMul` (quantized GGUF or dense safetensors weights, optional
/// bias), or powerinfer's `QLinear` on GGUF Q4_0 / Q4_1 / Q8_0 blocks.
#[derive(Debug, Clone)]
pub enum Linear {
    /// candle's matmul.
    Candle {
        /// Weights.
        w: QMatMul,
        /// Optional bias.
        b: Option<Tensor>,
    },
    /// powerinfer's integer kernels (bias inside).
    Powerinfer(std::sync::Arc<powerinfer::layers::QLinear>),
}

impl Module for Linear {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        match self {
            Linear::Candle { w, b } => {
                let y = w.forward(x)?;
                match b {
                    Some(b) => y.broadcast_add(b),
                    None => Ok(y),
                }
            }
            Linear::Powerinfer(l) => l.forward(x),
        }
    }
}

/// The dense FFN, as the host model computes it.
#[derive(Debug, Clone)]
pub struct DenseFfn {
    pub(crate) gate: Linear,
    pub(crate) up: Linear,
    pub(crate) down: Linear,
    pub(crate) act: Activation,
}

impl DenseFfn {
    /// The activations `h = act(gate x) * up x` (`[.., intermediate]`), before the down projection.
    pub fn activations(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let g = self.gate.forward(x)?;
        let u = self.up.forward(x)?;
        match self.act {
            Activation::Silu => candle_nn::ops::silu(&g)? * u,
            Activation::DRelu => g.relu()? * u.relu()?,
            a => g.apply(&a.to_candle())? * u,
        }
    }
}

impl Module for DenseFfn {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        self.down.forward(&self.activations(x)?)
    }
}

/// Sees every layer's FFN input and activations during [`Llama::probe_ffn`] (calibration).
pub trait FfnProbe {
    /// `x`: the FFN input of `layer` (`[tokens, hidden]`, f32, exactly what the FFN gets);
    /// `h`: its activations `act(gate x) * up x` (`[tokens, intermediate]`, f32).
    fn observe(&mut self, layer: usize, x: &Tensor, h: &Tensor) -> Result<()>;
}

/// The FFN of one layer: dense reference, the dense FFN on powerinfer's kernels, or the hybrid
/// sparse block.
#[derive(Debug)]
pub enum Ffn {
    /// candle's dense FFN.
    Dense(DenseFfn),
    /// The dense FFN on the file's blocks through powerinfer's integer kernels (fused decoder).
    Kernels(Box<KernelFfn>),
    /// powerinfer's sparse FFN.
    Hybrid(Box<HybridFfn>),
    /// powerinfer's input-sparse FFN (TEAL/WINA rules on column-major weights).
    InputSparse(Box<powerinfer::InputSparseFfn>),
}

impl Module for Ffn {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        match self {
            Ffn::Dense(d) => d.forward(x),
            Ffn::Kernels(k) => {
                let inter = k.down.dims().1;
                let gu = k.gate_up.forward(x)?;
                let last = gu.rank() - 1;
                let (g, u) = (gu.narrow(last, 0, inter)?, gu.narrow(last, inter, inter)?);
                let h = match k.act {
                    Activation::Silu => (candle_nn::ops::silu(&g)? * u)?,
                    Activation::DRelu => (g.relu()? * u.relu()?)?,
                    a => (g.apply(&a.to_candle())? * u)?,
                };
                k.down.forward(&h)
            }
            Ffn::Hybrid(h) => h.forward(x),
            Ffn::InputSparse(f) => f.forward(x),
        }
    }
}

#[derive(Debug, Clone)]
pub(crate) struct RmsNorm {
    pub(crate) w: Tensor,
    /// The same weights as a slice, for the fused decoder.
    pub(crate) wv: Vec<f32>,
    pub(crate) eps: f32,
}

impl RmsNorm {
    pub(crate) fn new(w: Tensor, eps: f32) -> Result<Self> {
        let wv = w.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
        Ok(RmsNorm { w, wv, eps })
    }
}

impl Module for RmsNorm {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        candle_nn::ops::rms_norm(x, &self.w, self.eps)
    }
}

/// Gemma 3's norms: of each query and key head (over the head dimension, before RoPE), and of
/// the attention and FFN outputs before their residual adds.
#[derive(Debug)]
pub(crate) struct GemmaNorms {
    pub(crate) q: RmsNorm,
    pub(crate) k: RmsNorm,
    pub(crate) post_attn: RmsNorm,
    pub(crate) post_ffn: RmsNorm,
}

/// A layer's attention projections.
#[derive(Debug)]
pub(crate) enum Attention {
    /// Four projections run as candle ops around candle's attention (the reference path).
    Ops {
        q: Linear,
        k: Linear,
        v: Linear,
        o: Linear,
    },
    /// q, k and v stacked in one projection and o in another: the fused decoder.
    Fused { qkv: Projection, o: Projection },
}

/// A projection of the fused decoder.
#[derive(Debug)]
pub(crate) enum Projection {
    /// Dense rows on our integer kernels.
    Rows(Arc<powerinfer::layers::QLinear>),
    /// Input-sparse columns (`FfnMode::InputSparse { attention: true }`).
    Columns(Box<powerinfer::layers::InputSparseLinear>),
}

impl Projection {
    /// Weight bytes (values and scales).
    pub(crate) fn bytes(&self) -> usize {
        match self {
            Projection::Rows(l) => l.bytes(),
            Projection::Columns(l) => l.weight_bytes(),
        }
    }
}

#[derive(Debug)]
pub(crate) struct Layer {
    pub(crate) attn_norm: RmsNorm,
    pub(crate) attn: Attention,
    pub(crate) ffn_norm: RmsNorm,
    pub(crate) ffn: Ffn,
    /// Gemma 3's norms (fused decoder only).
    pub(crate) gemma: Option<GemmaNorms>,
    /// The candle path's KV cache.
    pub(crate) kv: Option<(Tensor, Tensor)>,
}

/// Where decode time goes, accumulated while [`Llama::timings`] is enabled.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Timings {
    /// Embedding lookup, norms and residual adds.
    pub other: Duration,
    /// Attention (projections, RoPE, softmax, KV cache).
    pub attention: Duration,
    /// FFN blocks (for the hybrid FFN this includes its predictor).
    pub ffn: Duration,
    /// Final norm and LM head.
    pub lm_head: Duration,
    /// Forward calls timed.
    pub calls: u64,
}

/// Bytes of weights (and KV cache) one decoded token reads, by component: the floor that memory
/// bandwidth puts under decode time. See [`Llama::decode_bytes`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DecodeBytes {
    /// Attention projections (q, k, v, o) of every layer.
    pub attention: usize,
    /// FFN gate and up rows (every neuron: a sparse rule decides on them).
    pub ffn_gate_up: usize,
    /// FFN down rows of every neuron (a sparse FFN reads only its active neurons' share).
    pub ffn_down: usize,
    /// The LM head.
    pub lm_head: usize,
    /// Keys and values of one cached position, all layers (f32).
    pub kv_per_position: usize,
}

impl DecodeBytes {
    /// Bytes one token reads at `positions` cached positions when a share `down_skipped` of the
    /// FFN's down rows is not read.
    pub fn per_token(&self, positions: usize, down_skipped: f64) -> f64 {
        (self.attention + self.ffn_gate_up + self.lm_head) as f64
            + self.ffn_down as f64 * (1.0 - down_skipped.clamp(0.0, 1.0))
            + (self.kv_per_position * positions) as f64
    }
}

fn linear_bytes(l: &Linear) -> usize {
    match l {
        Linear::Candle { w, b } => {
            let w = match w {
                QMatMul::QTensor(q) => q.storage_size_in_bytes(),
                QMatMul::Tensor(t) | QMatMul::TensorF16(t) => {
                    t.elem_count() * t.dtype().size_in_bytes()
                }
            };
            w + b.as_ref().map_or(0, |b| b.elem_count() * 4)
        }
        Linear::Powerinfer(l) => l.bytes(),
    }
}

/// A llama-family causal LM.
#[derive(Debug)]
pub struct Llama {
    pub(crate) config: LlamaConfig,
    /// The candle path's token embedding (the fused decoder reads its own).
    pub(crate) embed: Option<TokenEmbedding>,
    pub(crate) layers: Vec<Layer>,
    pub(crate) norm: RmsNorm,
    pub(crate) lm_head: Linear,
    pub(crate) cos: Tensor,
    pub(crate) sin: Tensor,
    pub(crate) timings: Option<Timings>,
    /// The candle path's copy of the last logits for [`Llama::forward_logits`].
    pub(crate) logits_copy: Vec<f32>,
    /// Per layer, where a PowerInfer predictor with a non-zero threshold wants the pre-norm RMS
    /// of each row (see `pwri.rs`); empty otherwise.
    pub(crate) pre_norm_rms: Vec<Option<powerinfer::predict::RowRms>>,
    /// The fused decoder, when every projection runs on powerinfer's kernels.
    pub(crate) decoder: Option<Decoder>,
    /// Layers ahead whose fast tiers prefetch their predicted neurons (0: none; see
    /// [`crate::TierOptions::prefetch_depth`]).
    pub(crate) prefetch_depth: usize,
}

/// The candle path's token embedding.
#[derive(Debug)]
pub(crate) enum TokenEmbedding {
    /// A float table.
    Table(Embedding),
    /// The rows of a quantized matrix, dequantized per token: the file's blocks instead of a
    /// float copy four to eight times their size (a tied embedding shares the LM head's).
    Rows {
        w: Arc<candle_core::quantized::QTensor>,
        kind: powerinfer::cpu::BlockKind,
        hidden: usize,
    },
}

impl TokenEmbedding {
    /// `[1, tokens, hidden]` f32 for `tokens` (also given as the `[1, tokens]` tensor `ids`).
    fn forward(&self, tokens: &[u32], ids: &Tensor) -> Result<Tensor> {
        match self {
            TokenEmbedding::Table(e) => Ok(e.forward(ids)?),
            TokenEmbedding::Rows { w, kind, hidden } => {
                let data = w.data()?;
                let rb = kind.row_bytes(*hidden);
                let mut out = vec![0f32; tokens.len() * hidden];
                for (&t, o) in tokens.iter().zip(out.chunks_exact_mut(*hidden)) {
                    let src = data
                        .get(t as usize * rb..(t as usize + 1) * rb)
                        .ok_or_else(|| {
                            powerinfer::Error::config("embedding", format!("token {t} has no row"))
                        })?;
                    powerinfer::cpu::dequantize_blocks(*kind, src, o);
                }
                Ok(Tensor::from_vec(
                    out,
                    (1, tokens.len(), *hidden),
                    &Device::Cpu,
                )?)
            }
        }
    }
}

/// Positions the RoPE tables cover at most (the context, capped).
pub(crate) const MAX_POSITIONS: usize = 32_768;

/// RoPE's frequency per pair of head dimensions with base `base`: `f_i = base^(-2i /
/// head_dim) / factor_i` (the factors of a llama 3.x file's `rope_freqs`, else 1).
pub(crate) fn rope_freqs(cfg: &LlamaConfig, base: f32) -> Vec<f32> {
    let hd = cfg.head_dim();
    let factor = |i: usize| {
        cfg.rope_factors
            .as_ref()
            .and_then(|f| f.get(i / 2))
            .copied()
    };
    (0..hd)
        .step_by(2)
        .map(|i| 1f32 / base.powf(i as f32 / hd as f32) / factor(i).unwrap_or(1.0))
        .collect()
}

/// RoPE tables (`cos`, `sin` of `p * f_i`, [`rope_freqs`]) for `positions` positions.
pub(crate) fn rope_tables(
    cfg: &LlamaConfig,
    base: f32,
    positions: usize,
    dev: &Device,
) -> Result<(Tensor, Tensor)> {
    let theta = rope_freqs(cfg, base);
    let n = theta.len();
    let theta = Tensor::new(theta.as_slice(), dev)?;
    let idx = Tensor::arange(0, positions as u32, dev)?
        .to_dtype(DType::F32)?
        .reshape((positions, 1))?
        .matmul(&theta.reshape((1, n))?)?;
    Ok((idx.cos()?, idx.sin()?))
}

impl Llama {
    /// The hyper-parameters.
    pub fn config(&self) -> &LlamaConfig {
        &self.config
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
        if let Some(d) = &mut self.decoder {
            d.clear();
        }
    }

    /// Whether this model runs on the fused decoder (every projection and the FFN on
    /// powerinfer's kernels and one thread pool; see [`crate::FfnMode`]) rather than on candle ops.
    pub fn is_fused(&self) -> bool {
        self.decoder.is_some()
    }

    /// Preallocates the fused decoder's KV cache for `positions` positions (it otherwise grows
    /// geometrically as a sequence does). No effect on the candle path.
    pub fn reserve_kv_cache(&mut self, positions: usize) {
        if let Some(d) = &mut self.decoder {
            d.reserve(&self.config, positions);
        }
    }

    /// Like [`Llama::forward`] but returns the last position's logits as a slice the model owns:
    /// on the fused decoder this allocates nothing once the sequence's buffers have grown (the
    /// decode loop of a server or benchmark). On the candle path it copies the logits tensor.
    pub fn forward_logits(&mut self, tokens: &[u32], pos: usize) -> Result<&[f32]> {
        if self.decoder.is_none() {
            let t = self.forward_impl(tokens, pos, true)?;
            self.logits_copy = t.to_vec1::<f32>()?;
            return Ok(&self.logits_copy);
        }
        let mut clock = Clock::new(self.timings.is_some());
        self.check_tokens(tokens, pos)?;
        let Llama {
            config,
            layers,
            pre_norm_rms,
            decoder: Some(d),
            timings,
            prefetch_depth,
            ..
        } = self
        else {
            return Err(powerinfer::Error::config("fused decoder", "not built").into());
        };
        let logits = d.forward(
            config,
            layers,
            pre_norm_rms,
            *prefetch_depth,
            tokens,
            pos,
            true,
            &mut clock,
        )?;
        clock.lap(Lap::LmHead);
        if let Some(t) = timings {
            clock.add_to(t);
        }
        check_logits(logits)?;
        Ok(logits)
    }

    /// Runs `tokens` (one sequence) at positions `pos..pos + tokens.len()` and returns the logits
    /// of every position (`[tokens, vocab]`, f32). Tokens past the context are a typed error.
    pub fn forward_all(&mut self, tokens: &[u32], pos: usize) -> Result<Tensor> {
        self.forward_impl(tokens, pos, false)
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
        if self.decoder.is_some() {
            self.check_tokens(tokens, pos)?;
        }
        if let Some(d) = &mut self.decoder {
            let logits = d.forward(
                &self.config,
                &self.layers,
                &self.pre_norm_rms,
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
        if pos + seq > self.config.context.min(self.cos.dim(0)?) {
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
        let Some(embed) = &self.embed else {
            return Err(powerinfer::Error::config(
                "embedding",
                "fused models run on the fused decoder",
            )
            .into());
        };
        let mut x = embed.forward(tokens, &ids)?;
        let (cos, sin) = (self.cos.narrow(0, pos, seq)?, self.sin.narrow(0, pos, seq)?);
        clock.lap(Lap::Other);
        let cfg = &self.config;
        for l in 0..self.layers.len() {
            let layer = &mut self.layers[l];
            let h = layer.attn_norm.forward(&x)?;
            clock.lap(Lap::Other);
            let a = attention(layer, cfg, &h, &cos, &sin, mask.as_ref(), pos)?;
            clock.lap(Lap::Attention);
            x = (a + &x)?;
            if let Some(Some(rms)) = self.pre_norm_rms.get(l) {
                crate::pwri::set_row_rms(rms, &x, layer.ffn_norm.eps)?;
            }
            let h = layer.ffn_norm.forward(&x)?;
            clock.lap(Lap::Other);
            if let Some((ahead, ffn)) = self.prefetch_target(l) {
                let p = ahead.forward(&x)?.flatten_all()?.to_dtype(DType::F32)?;
                ffn.prefetch(&p.to_vec1::<f32>()?, seq)?;
            }
            let layer = &self.layers[l];
            let f = match (&layer.ffn, probe.as_deref_mut()) {
                (Ffn::Dense(d), Some(p)) => {
                    let act = d.activations(&h)?;
                    let rows = (seq, cfg.hidden);
                    p.observe(l, &h.reshape(rows)?, &act.reshape((seq, cfg.intermediate))?)?;
                    d.down.forward(&act)?
                }
                (ffn, _) => ffn.forward(&h)?,
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
    match logits.iter().position(|v| !v.is_finite()) {
        Some(index) => Err(powerinfer::Error::from(powerinfer::ErrorKind::NonFinite {
            tensor: "logits".into(),
            index,
        })
        .into()),
        None => Ok(()),
    }
}

/// See [`Llama::prefetch_target`] (the fused decoder borrows the layers alone).
pub(crate) fn prefetch_target(
    layers: &[Layer],
    depth: usize,
    l: usize,
) -> Option<(&RmsNorm, &HybridFfn)> {
    if depth == 0 {
        return None;
    }
    let ahead = layers.get(l + depth)?;
    match &ahead.ffn {
        Ffn::Hybrid(h) if h.fast_tier().is_some() => Some((&ahead.ffn_norm, h)),
        _ => None,
    }
}

fn attention(
    l: &mut Layer,
    cfg: &LlamaConfig,
    x: &Tensor,
    cos: &Tensor,
    sin: &Tensor,
    mask: Option<&Tensor>,
    pos: usize,
) -> Result<Tensor> {
    let (b, seq, hidden) = x.dims3()?;
    let hd = cfg.head_dim();
    let Attention::Ops { q, k, v, o } = &l.attn else {
        return Err(powerinfer::Error::config(
            "attention",
            "fused layers run on the fused decoder",
        )
        .into());
    };
    let q = q
        .forward(x)?
        .reshape((b, seq, cfg.heads, hd))?
        .transpose(1, 2)?;
    let k = k
        .forward(x)?
        .reshape((b, seq, cfg.kv_heads, hd))?
        .transpose(1, 2)?;
    let v = v
        .forward(x)?
        .reshape((b, seq, cfg.kv_heads, hd))?
        .transpose(1, 2)?
        .contiguous()?;
    let rope = |t: &Tensor| -> candle_core::Result<Tensor> {
        if cfg.rope_interleaved {
            candle_nn::rotary_emb::rope_i(&t.contiguous()?, cos, sin)
        } else {
            candle_nn::rotary_emb::rope(&t.contiguous()?, cos, sin)
        }
    };
    let (q, k) = (rope(&q)?, rope(&k)?);
    let (k, v) = match &l.kv {
        Some((kc, vc)) if pos > 0 => (Tensor::cat(&[kc, &k], 2)?, Tensor::cat(&[vc, &v], 2)?),
        _ => (k, v),
    };
    l.kv = Some((k.clone(), v.clone()));
    let rep = cfg.heads / cfg.kv_heads;
    let k = candle_transformers::utils::repeat_kv(k, rep)?;
    let v = candle_transformers::utils::repeat_kv(v, rep)?;
    let att = (q.matmul(&k.t()?)? / (hd as f64).sqrt())?;
    let att = match mask {
        Some(m) => {
            let m = m.broadcast_as(att.shape())?;
            let neg = Tensor::new(f32::NEG_INFINITY, att.device())?.broadcast_as(att.shape())?;
            m.where_cond(&neg, &att)?
        }
        None => att,
    };
    let att = candle_nn::ops::softmax_last_dim(&att)?;
    let y = att.matmul(&v.contiguous()?)?;
    let y = y.transpose(1, 2)?.reshape((b, seq, hidden))?;
    Ok(o.forward(&y)?)
}

#[derive(Clone, Copy)]
pub(crate) enum Lap {
    Other,
    Attention,
    Ffn,
    LmHead,
}

/// Splits wall time between components when timing is on; free when off.
pub(crate) struct Clock {
    last: Option<Instant>,
    t: Timings,
}

impl Clock {
    pub(crate) fn new(on: bool) -> Self {
        Clock {
            last: on.then(Instant::now),
            t: Timings::default(),
        }
    }

    pub(crate) fn lap(&mut self, what: Lap) {
        let Some(last) = self.last.as_mut() else {
            return;
        };
        let now = Instant::now();
        let d = now - *last;
        *last = now;
        let slot = match what {
            Lap::Other => &mut self.t.other,
            Lap::Attention => &mut self.t.attention,
            Lap::Ffn => &mut self.t.ffn,
            Lap::LmHead => &mut self.t.lm_head,
        };
        *slot += d;
    }

    pub(crate) fn add_to(&self, t: &mut Timings) {
        t.other += self.t.other;
        t.attention += self.t.attention;
        t.ffn += self.t.ffn;
        t.lm_head += self.t.lm_head;
        t.calls += 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A llama 3.x file's `rope_freqs` factors divide each pair's frequency.
    #[test]
    fn rope_factors_divide_the_frequencies() {
        let mut cfg = crate::LlamaConfig {
            hidden: 16,
            intermediate: 32,
            layers: 1,
            heads: 2,
            kv_heads: 1,
            vocab: 8,
            rms_eps: 1e-6,
            rope_theta: 10_000.0,
            context: 64,
            activation: powerinfer::Activation::Silu,
            rope_interleaved: true,
            attention_bias: false,
            head_dim: 8,
            attention_scale: 1.0 / 8f32.sqrt(),
            embedding_scale: 1.0,
            gemma3: None,
            rope_factors: None,
        };
        let (c0, _) = rope_tables(&cfg, 10_000.0, 8, &Device::Cpu).unwrap();
        cfg.rope_factors = Some(vec![1.0, 2.0, 4.0, 8.0]);
        let (c1, s1) = rope_tables(&cfg, 500_000.0, 8, &Device::Cpu).unwrap();
        let rows = |t: Tensor| -> Vec<Vec<f32>> { t.to_vec2().unwrap() };
        let (c0, c1, s1) = (rows(c0), rows(c1), rows(s1));
        for p in 0..8 {
            for i in 0..4 {
                let f = 1.0 / 500_000f32.powf(2.0 * i as f32 / 8.0) / [1.0, 2.0, 4.0, 8.0][i];
                let a = p as f32 * f;
                assert!((c1[p][i] - a.cos()).abs() < 1e-5 && (s1[p][i] - a.sin()).abs() < 1e-5);
            }
        }
        assert_eq!(c0[3][0], 3f32.cos());
    }
}
