//! The parts of a layer: linear layers, the FFN kinds, norms, the attention projections, and
//! the candle path's token embedding.

use std::sync::Arc;

use candle_core::quantized::{QMatMul, QTensor};
use candle_core::{DType, Device, Module, Tensor, D};
use candle_nn::Embedding;
use powerinfer::{Activation, HybridFfn};

use super::kernel_ffn::KernelFfn;
use crate::error::Result;
use crate::gguf::GgufFile;

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

impl Linear {
    /// A linear layer `{name}.weight` (kept quantized) with `{name}.bias` if present: powerinfer's
    /// `QLinear` on `threads` threads when given and the block type allows, else candle's matmul.
    pub fn from_gguf(
        gguf: &mut GgufFile,
        name: &str,
        powerinfer_threads: Option<usize>,
    ) -> Result<Linear> {
        let w = gguf.tensor(&format!("{name}.weight"))?;
        let b = gguf.bias(name)?;
        if let Some(t) = powerinfer_threads {
            if let Ok(l) = powerinfer::layers::QLinear::new(&w, b.as_ref(), t) {
                return Ok(Linear::Powerinfer(Arc::new(l)));
            }
        }
        Linear::quantized(w, b)
    }

    /// candle's quantized matmul on `q` (with an optional bias).
    pub(crate) fn quantized(q: QTensor, b: Option<Tensor>) -> Result<Linear> {
        Ok(Linear::Candle {
            w: QMatMul::from_qtensor(q)?,
            b,
        })
    }
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

/// Sees every layer's FFN input and activations during [`Llama::probe_ffn`](crate::Llama::probe_ffn) (calibration).
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
    pub(super) fn forward(&self, tokens: &[u32], ids: &Tensor) -> Result<Tensor> {
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

/// See [`Llama::prefetch_target`](super::Llama::prefetch_target) (the fused decoder borrows the
/// layers alone).
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

/// `sqrt(mean(x^2) + eps)` of each row of the pre-norm input `x`, for a PowerInfer predictor.
pub(crate) fn row_rms(x: &Tensor, eps: f32) -> Result<Vec<f32>> {
    Ok(x.to_dtype(DType::F32)?
        .sqr()?
        .mean_keepdim(D::Minus1)?
        .affine(1.0, eps as f64)?
        .sqrt()?
        .flatten_all()?
        .to_vec1::<f32>()?)
}

/// The hybrid FFN on the normed input `h` (`[.., hidden]`) with its rows' pre-norm RMS.
pub(crate) fn forward_with_row_rms(ffn: &HybridFfn, h: &Tensor, row_rms: &[f32]) -> Result<Tensor> {
    let x = h.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
    let mut out = vec![0f32; x.len()];
    ffn.forward_f32_with_row_rms(&x, row_rms.len(), row_rms, &mut out)?;
    Ok(Tensor::from_vec(out, h.dims(), h.device())?.to_dtype(h.dtype())?)
}
