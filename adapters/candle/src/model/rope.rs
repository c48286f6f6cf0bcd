//! RoPE tables and the candle path's attention (RoPE, KV cache, grouped-query attention in
//! candle ops).

use candle_core::{DType, Device, Module, Tensor};

use super::layers::{Attention, Layer};
use crate::config::LlamaConfig;
use crate::error::Result;

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

pub(super) fn attention(
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A llama 3.x file's `rope_freqs` factors divide each pair's frequency.
    #[test]
    fn rope_factors_divide_the_frequencies() {
        let mut cfg = crate::config::LlamaConfig {
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
