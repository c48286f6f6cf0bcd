//! The fused decoder: the whole forward pass on powerinfer's kernels and one thread pool, with no
//! candle op, no heap allocation and no thread spawn per decoded token.
//!
//! Used when every projection of the model is a GGUF Q4_0 / Q4_1 / Q8_0 tensor (the attention
//! projections and the LM head as `QLinear`s, q/k/v stacked into one) and the FFN runs through
//! our kernels (`HybridFfn`, or [`KernelFfn`](super::KernelFfn) for the dense FFN). Per layer and token:
//!
//! 1. RMSNorm of the residual (fused with the previous residual add: one pass);
//! 2. the input quantized once (as ggml quantizes it) and one product for q, k and v;
//! 3. RoPE in place on q and k; k and v written into the preallocated cache (`[position][kv
//!    head][head dim]`, grown geometrically, never concatenated);
//! 4. attention per KV head: the query heads that share it read its keys and values once
//!    (`powerinfer::cpu::attend`: scores, softmax, weighted sum), no K/V copy per query head;
//! 5. the output projection, the residual add fused with the FFN's RMSNorm, the FFN;
//! 6. after the last layer, the final norm and the LM head (our integer kernels) on the rows
//!    whose logits are wanted.
//!
//! Every parallel step (the products, attention, the FFN) runs on the same `powerinfer::cpu::Pool`,
//! whose threads are the only ones working: candle's rayon pool is idle on this path. Norms,
//! RoPE and the residual adds are a few thousand flops per token and run on the calling thread.
//! The arithmetic is the reference model's, in candle's order: RMSNorm's sequential sum, RoPE,
//! `silu`, the attention sums (`powerinfer::cpu::attend`), and Q4_1 products bit-identical to candle's
//! quantized matmul. What differs: the float order of Q4_0/Q8_0 blocks (the Q8_0 LM head among
//! them), and a prompt's rows, which are computed as single-row steps (candle's batched matmul
//! orders its sums by batch size; ours gives a batch the bits of token-by-token decoding).

use std::sync::Arc;

use powerinfer::cpu::{attend, KvRows, Pool, QuantizedRow};
use powerinfer::layers::QLinear;

use super::kernel_ffn::KernelFfnScratch;
use super::layers::{prefetch_target, Attention, Ffn, Layer, Projection};
use super::rope::{rope_freqs, MAX_POSITIONS};
use super::timing::{Clock, Lap};
use crate::config::LlamaConfig;
use crate::error::{ErrorKind, Result};

/// One layer's keys and values, `[position][kv head][head dim]`, f32.
#[derive(Debug, Default)]
struct KvCache {
    k: Vec<f32>,
    v: Vec<f32>,
}

/// Per-thread attention scores.
#[derive(Debug, Default)]
struct AttnScratch {
    scores: Vec<f32>,
}

#[derive(Debug, Default)]
struct Scratch {
    x: Vec<f32>,
    h: Vec<f32>,
    qkv: Vec<f32>,
    att: Vec<f32>,
    f: Vec<f32>,
    xq: Vec<QuantizedRow>,
    tmp: Vec<f32>,
    rms: Vec<f32>,
    /// A later layer's FFN input, predicted for prefetching.
    pf: Vec<f32>,
    threads: Vec<AttnScratch>,
    ffn: KernelFfnScratch,
    logits: Vec<f32>,
}

/// Where the token embeddings come from.
#[derive(Debug)]
pub(crate) enum Embed {
    /// Rows of a quantized matrix (for a tied LM head, the LM head itself: held once).
    Packed(Arc<QLinear>),
    /// A dense f32 table `[vocab, hidden]`.
    F32(Vec<f32>),
}

/// The fused decoder's own state: embedding, final norm, LM head, RoPE tables, KV cache, scratch.
#[derive(Debug)]
pub(crate) struct Decoder {
    embed: Embed,
    lm_head: Arc<QLinear>,
    norm: Vec<f32>,
    eps: f32,
    /// RoPE for the (global) layers, and for Gemma 3's local layers (empty otherwise).
    rope: RopeTable,
    rope_local: RopeTable,
    /// Positions the tables may grow to (the context, at most 32768).
    max_positions: usize,
    pool: Arc<Pool>,
    kv: Vec<KvCache>,
    /// Positions the cache holds.
    len: usize,
    s: Scratch,
}

/// Smallest KV capacity allocated, in positions.
const MIN_KV: usize = 256;

/// RoPE's `cos` and `sin` per position and pair of head dimensions (`[position][head_dim /
/// 2]`, the values candle's tables hold: `cos(p * f_i)` in f32), grown with the KV cache rather
/// than held for the whole context (Gemma 3's two tables of 32768 positions would be 67 MB).
#[derive(Debug, Default)]
struct RopeTable {
    freqs: Vec<f32>,
    cos: Vec<f32>,
    sin: Vec<f32>,
}

impl RopeTable {
    fn new(freqs: Vec<f32>) -> Self {
        RopeTable {
            freqs,
            ..Default::default()
        }
    }

    /// Positions the table holds.
    fn positions(&self) -> usize {
        self.cos.len() / self.freqs.len().max(1)
    }

    fn grow(&mut self, positions: usize) {
        for p in self.positions()..positions {
            for &f in &self.freqs {
                let a = p as f32 * f;
                self.cos.push(a.cos());
                self.sin.push(a.sin());
            }
        }
    }
}

impl Decoder {
    pub(crate) fn new(
        cfg: &LlamaConfig,
        embed: Embed,
        lm_head: Arc<QLinear>,
        norm: Vec<f32>,
    ) -> Result<Self> {
        let pool = Arc::clone(lm_head.pool());
        let local = cfg.gemma3.as_ref().map(|g| g.rope_theta_local);
        Ok(Decoder {
            embed,
            lm_head,
            norm,
            eps: cfg.rms_eps as f32,
            rope: RopeTable::new(rope_freqs(cfg, cfg.rope_theta)),
            rope_local: RopeTable::new(local.map_or_else(Vec::new, |b| rope_freqs(cfg, b))),
            max_positions: cfg.context.min(MAX_POSITIONS),
            pool,
            kv: (0..cfg.layers).map(|_| KvCache::default()).collect(),
            len: 0,
            s: Scratch::default(),
        })
    }

    /// Positions the decoder runs at most (the context, capped).
    pub(crate) fn max_positions(&self) -> usize {
        self.max_positions
    }

    /// Forgets the sequence (keeps the cache's memory).
    pub(crate) fn clear(&mut self) {
        self.len = 0;
    }

    /// Makes room for `positions` positions in every layer's cache (no allocation afterwards
    /// until a sequence grows past it).
    pub(crate) fn reserve(&mut self, cfg: &LlamaConfig, positions: usize) {
        let kvw = cfg.kv_heads * cfg.head_dim();
        let need = positions.min(self.max_positions);
        self.rope.grow(need);
        if !self.rope_local.freqs.is_empty() {
            self.rope_local.grow(need);
        }
        for c in &mut self.kv {
            if c.k.len() < need * kvw {
                c.k.resize(need * kvw, 0.0);
                c.v.resize(need * kvw, 0.0);
            }
        }
    }

    /// Runs `tokens` at positions `pos..` through `layers` and returns the logits of the last
    /// position (`last_only`) or of every position (`[tokens][vocab]`). `pos` must be at most the
    /// number of positions already cached (a smaller one rewinds the sequence).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn forward(
        &mut self,
        cfg: &LlamaConfig,
        layers: &[Layer],
        prefetch_depth: usize,
        tokens: &[u32],
        pos: usize,
        last_only: bool,
        clock: &mut Clock,
    ) -> Result<&[f32]> {
        self.trunk(cfg, layers, prefetch_depth, tokens, pos, clock)?;
        self.head(tokens.len(), last_only, clock)
    }

    /// The embedding and every layer for `tokens` at positions `pos..`, the cache advanced.
    fn trunk(
        &mut self,
        cfg: &LlamaConfig,
        layers: &[Layer],
        prefetch_depth: usize,
        tokens: &[u32],
        pos: usize,
        clock: &mut Clock,
    ) -> Result<()> {
        let end = self.prepare(cfg, pos, tokens.len())?;
        self.embed_rows(cfg, tokens)?;
        clock.lap(Lap::Other);
        for (l, layer) in layers.iter().enumerate() {
            self.attention_step(cfg, l, layer, pos, end, clock)?;
            self.ffn_step(cfg, layers, l, prefetch_depth, clock)?;
        }
        self.len = end;
        Ok(())
    }

    /// Runs `tokens` as [`Decoder::forward`] does and hands the logits of every position to `f`
    /// in blocks of at most `block` rows (`f(first_row, logits)`, `logits` row-major): a window's
    /// logits are never held whole (`[tokens, vocab]`: 311 MB for 512 tokens on a 151936-token
    /// vocabulary).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn forward_each(
        &mut self,
        cfg: &LlamaConfig,
        layers: &[Layer],
        prefetch_depth: usize,
        tokens: &[u32],
        pos: usize,
        block: usize,
        clock: &mut Clock,
        f: &mut dyn FnMut(usize, &[f32]) -> Result<()>,
    ) -> Result<()> {
        self.trunk(cfg, layers, prefetch_depth, tokens, pos, clock)?;
        self.residual(clock);
        let block = block.max(1);
        for first in (0..tokens.len()).step_by(block) {
            let logits = self.head_rows(first, block.min(tokens.len() - first))?;
            f(first, logits)?;
        }
        Ok(())
    }

    /// Checks `pos`, grows the KV cache to hold `pos + rows` positions and sizes the scratch
    /// for `rows` rows; returns `pos + rows`.
    fn prepare(&mut self, cfg: &LlamaConfig, pos: usize, rows: usize) -> Result<usize> {
        if pos > self.len {
            return Err(ErrorKind::Prompt {
                reason: format!(
                    "position {pos} is past the {} positions in the KV cache",
                    self.len
                ),
            }
            .into());
        }
        let (hidden, hd) = (cfg.hidden, cfg.head_dim());
        let (qw, kvw) = (cfg.heads * hd, cfg.kv_heads * hd);
        let end = pos + rows;
        let capacity = |kv: &[KvCache]| kv.first().map_or(0, |c| c.k.len() / kvw.max(1));
        if end > capacity(&self.kv) {
            let grow = end.max(2 * capacity(&self.kv)).max(MIN_KV);
            self.reserve(cfg, grow);
        }
        let cap = capacity(&self.kv);
        if end > cap {
            return Err(ErrorKind::Prompt {
                reason: format!("{end} positions exceed the {cap} the model supports"),
            }
            .into());
        }
        let s = &mut self.s;
        s.x.resize(rows * hidden, 0.0);
        s.h.resize(rows * hidden, 0.0);
        s.f.resize(rows * hidden, 0.0);
        s.qkv.resize(rows * (qw + 2 * kvw), 0.0);
        s.att.resize(rows * qw, 0.0);
        s.threads.resize_with(self.pool.threads(), Default::default);
        // Scores for every cached position: grown with the cache, not per token.
        let rep = cfg.heads / cfg.kv_heads.max(1);
        for t in &mut s.threads {
            if t.scores.capacity() < rep * cap {
                t.scores.reserve(rep * cap - t.scores.len());
            }
        }
        Ok(end)
    }

    /// The tokens' embedding rows into the residual stream `x`.
    fn embed_rows(&mut self, cfg: &LlamaConfig, tokens: &[u32]) -> Result<()> {
        let hidden = cfg.hidden;
        for (r, &t) in tokens.iter().enumerate() {
            let row = &mut self.s.x[r * hidden..(r + 1) * hidden];
            match &self.embed {
                Embed::Packed(e) => e.dequantize_row(t as usize, row)?,
                Embed::F32(e) => {
                    let at = t as usize * hidden;
                    let src = e.get(at..at + hidden).ok_or_else(|| {
                        fused_error("a token id is past the embedding table's rows")
                    })?;
                    row.copy_from_slice(src);
                }
            }
            if cfg.embedding_scale != 1.0 {
                row.iter_mut().for_each(|v| *v *= cfg.embedding_scale);
            }
        }
        Ok(())
    }

    /// Layer `l`'s attention block on the rows at positions `pos..end`: its norm (with the
    /// previous layer's FFN residual added in the same pass), q/k/v in one product, RoPE and
    /// the cache, attention, the output projection into `f`.
    fn attention_step(
        &mut self,
        cfg: &LlamaConfig,
        l: usize,
        layer: &Layer,
        pos: usize,
        end: usize,
        clock: &mut Clock,
    ) -> Result<()> {
        let Attention::Fused { qkv, o } = &layer.attn else {
            return Err(fused_error("a layer's attention is not fused"));
        };
        let s = &mut self.s;
        let rows = end - pos;
        // 1. Norm (the previous layer's FFN residual was added in the same pass).
        if l == 0 {
            rms_norm_rows(&s.x, &layer.attn_norm.wv, layer.attn_norm.eps, &mut s.h);
        } else {
            add_rms_norm_rows(
                &mut s.x,
                &s.f,
                &layer.attn_norm.wv,
                layer.attn_norm.eps,
                &mut s.h,
            );
        }
        clock.lap(Lap::Other);
        // 2. q, k, v in one product.
        match qkv {
            Projection::Rows(qkv) => {
                let xq = qkv.quantize_input(&mut s.xq, &s.h);
                qkv.forward_quantized(xq, &mut s.qkv, &mut s.tmp)?;
            }
            Projection::Columns(qkv) => qkv.forward_f32(&s.h, rows, &mut s.qkv)?,
        }
        // 3. (Gemma 3: each q and k head normed), RoPE in place, keys and values into the cache.
        let local = cfg.gemma3.as_ref().filter(|g| g.local[l]);
        let table = match local {
            Some(_) => &self.rope_local,
            None => &self.rope,
        };
        rope_rows(cfg, layer, table, &mut s.qkv, &mut self.kv[l], pos, rows);
        // 4. Attention: one item per (row, KV head), its query heads side by side in `att`.
        attend_rows(
            cfg,
            &self.pool,
            s,
            &self.kv[l],
            pos,
            end,
            local.map(|g| g.window),
        )?;
        match o {
            Projection::Rows(o) => {
                let xq = o.quantize_input(&mut s.xq, &s.att);
                o.forward_quantized(xq, &mut s.f, &mut s.tmp)?;
            }
            Projection::Columns(o) => o.forward_f32(&s.att, rows, &mut s.f)?,
        }
        if let Some(g) = &layer.gemma {
            rms_norm_in_place(&mut s.f, &g.post_attn.wv, g.post_attn.eps);
        }
        clock.lap(Lap::Attention);
        Ok(())
    }

    /// Layer `l`'s FFN block: the attention residual added, the FFN norm, a prefetch for the
    /// layer `prefetch_depth` ahead, the FFN into `f`.
    fn ffn_step(
        &mut self,
        cfg: &LlamaConfig,
        layers: &[Layer],
        l: usize,
        prefetch_depth: usize,
        clock: &mut Clock,
    ) -> Result<()> {
        let (s, layer, hidden) = (&mut self.s, &layers[l], cfg.hidden);
        let rows = s.x.len() / hidden;
        // A predictor on the pre-norm residual (PowerInfer's) gets each row's RMS.
        let wants_rms = matches!(&layer.ffn, Ffn::Hybrid(h) if h.needs_row_rms());
        s.rms.clear();
        if wants_rms {
            for (xr, fr) in s.x.chunks_exact_mut(hidden).zip(s.f.chunks_exact(hidden)) {
                xr.iter_mut().zip(fr).for_each(|(x, f)| *x += *f);
            }
            s.rms.extend(
                s.x.chunks_exact(hidden)
                    .map(|xr| rms(xr, layer.ffn_norm.eps)),
            );
            rms_norm_rows(&s.x, &layer.ffn_norm.wv, layer.ffn_norm.eps, &mut s.h);
        } else {
            add_rms_norm_rows(
                &mut s.x,
                &s.f,
                &layer.ffn_norm.wv,
                layer.ffn_norm.eps,
                &mut s.h,
            );
        }
        clock.lap(Lap::Other);
        // The layer `prefetch_depth` ahead predicts its neurons on this residual, normed as it
        // will norm its own, and its tier copies them in while this layer runs.
        if let Some((norm, ahead)) = prefetch_target(layers, prefetch_depth, l) {
            s.pf.resize(rows * hidden, 0.0);
            rms_norm_rows(&s.x, &norm.wv, norm.eps, &mut s.pf);
            ahead.prefetch(&s.pf, rows)?;
        }
        match &layer.ffn {
            Ffn::Hybrid(ffn) if wants_rms => {
                ffn.forward_f32_with_row_rms(&s.h, rows, &s.rms, &mut s.f)?
            }
            Ffn::Hybrid(ffn) => ffn.forward_f32(&s.h, rows, &mut s.f)?,
            Ffn::InputSparse(ffn) => ffn.forward_f32(&s.h, rows, &mut s.f)?,
            Ffn::Kernels(ffn) => {
                let xq = ffn.gate_up.quantize_input(&mut s.xq, &s.h);
                ffn.forward_rows(xq, &mut s.f, &mut s.ffn, &mut s.tmp)?;
            }
            Ffn::Dense(_) => return Err(fused_error("a layer's FFN is candle's")),
        }
        if let Some(g) = &layer.gemma {
            rms_norm_in_place(&mut s.f, &g.post_ffn.wv, g.post_ffn.eps);
        }
        clock.lap(Lap::Ffn);
        Ok(())
    }

    /// The last residual add, the final norm and the LM head: the logits of the last row
    /// (`last_only`) or of all `rows`.
    fn head(&mut self, rows: usize, last_only: bool, clock: &mut Clock) -> Result<&[f32]> {
        let out_rows = if last_only { 1 } else { rows };
        self.residual(clock);
        self.head_rows(rows - out_rows, out_rows)
    }

    /// The last residual add, on every row.
    fn residual(&mut self, clock: &mut Clock) {
        let s = &mut self.s;
        let hidden = self.norm.len();
        for (xr, fr) in s.x.chunks_exact_mut(hidden).zip(s.f.chunks_exact(hidden)) {
            xr.iter_mut().zip(fr).for_each(|(x, f)| *x += *f);
        }
        clock.lap(Lap::Other);
    }

    /// The final norm and the LM head of rows `first..first + out_rows` (after
    /// [`Decoder::residual`]).
    fn head_rows(&mut self, first: usize, out_rows: usize) -> Result<&[f32]> {
        let s = &mut self.s;
        let hidden = self.norm.len();
        rms_norm_rows(
            &s.x[first * hidden..(first + out_rows) * hidden],
            &self.norm,
            self.eps,
            &mut s.h[..out_rows * hidden],
        );
        let xq = self
            .lm_head
            .quantize_input(&mut s.xq, &s.h[..out_rows * hidden]);
        let vocab = self.lm_head.dims().0;
        s.logits.resize(out_rows * vocab, 0.0);
        self.lm_head
            .forward_quantized(xq, &mut s.logits, &mut s.tmp)?;
        Ok(&s.logits)
    }
}

/// Per row at positions `pos..pos + rows`: Gemma 3's q and k head norms, RoPE on every q and k
/// head in place, and the row's key and value into the layer's cache.
fn rope_rows(
    cfg: &LlamaConfig,
    layer: &Layer,
    table: &RopeTable,
    qkv: &mut [f32],
    cache: &mut KvCache,
    pos: usize,
    rows: usize,
) {
    let hd = cfg.head_dim();
    let (qw, kvw, half) = (cfg.heads * hd, cfg.kv_heads * hd, hd / 2);
    let qkvw = qw + 2 * kvw;
    for r in 0..rows {
        let p = pos + r;
        let (cos, sin) = (
            &table.cos[p * half..][..half],
            &table.sin[p * half..][..half],
        );
        let row = &mut qkv[r * qkvw..(r + 1) * qkvw];
        if let Some(g) = &layer.gemma {
            rms_norm_in_place(&mut row[..qw], &g.q.wv, g.q.eps);
            rms_norm_in_place(&mut row[qw..qw + kvw], &g.k.wv, g.k.eps);
        }
        for head in row[..qw + kvw].chunks_exact_mut(hd) {
            rope(head, cos, sin, cfg.rope_interleaved);
        }
        cache.k[p * kvw..(p + 1) * kvw].copy_from_slice(&row[qw..qw + kvw]);
        cache.v[p * kvw..(p + 1) * kvw].copy_from_slice(&row[qw + kvw..]);
    }
}

/// Attention of the rows at positions `pos..end` over the cache (all positions, or a local
/// layer's last `window`) on the pool: one item per (row, KV head), its query heads side by
/// side in `s.att`.
fn attend_rows(
    cfg: &LlamaConfig,
    pool: &Pool,
    s: &mut Scratch,
    cache: &KvCache,
    pos: usize,
    end: usize,
    window: Option<usize>,
) -> Result<()> {
    let hd = cfg.head_dim();
    let (kvh, rep) = (cfg.kv_heads, cfg.heads / cfg.kv_heads.max(1));
    let kvw = kvh * hd;
    let qkvw = cfg.heads * hd + 2 * kvw;
    let (rows, scale) = (end - pos, cfg.attention_scale);
    let (qkv_rows, kc, vc) = (&s.qkv, &cache.k[..end * kvw], &cache.v[..end * kvw]);
    let failed = std::sync::atomic::AtomicBool::new(false);
    pool.run_chunks_with(
        &mut s.att,
        rows * kvh,
        rep * hd,
        &mut s.threads,
        &|items, part, st| {
            for (i, out) in items.zip(part.chunks_exact_mut(rep * hd)) {
                let (r, g) = (i / kvh, i % kvh);
                // Positions `first..=pos + r`: all of them, or a local layer's window.
                let n = pos + r + 1;
                let first = window.map_or(0, |w| n.saturating_sub(w));
                st.scores.resize(rep * (n - first), 0.0);
                let q = &qkv_rows[r * qkvw + g * rep * hd..][..rep * hd];
                let kv = KvRows {
                    keys: &kc[first * kvw + g * hd..],
                    values: &vc[first * kvw + g * hd..],
                    head_dim: hd,
                    stride: kvw,
                    positions: n - first,
                };
                if attend(q, &kv, scale, &mut st.scores, out).is_err() {
                    failed.store(true, std::sync::atomic::Ordering::Relaxed);
                }
            }
        },
    );
    match failed.into_inner() {
        true => Err(fused_error("attention slices do not match the cache")),
        false => Ok(()),
    }
}

fn fused_error(reason: &str) -> crate::error::Error {
    powerinfer::Error::config("fused decoder", reason).into()
}

/// candle's `rms_norm` per row: `x / sqrt(sum(x^2) / n + eps) * w`, the sum taken in order.
fn rms_norm_rows(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let n = w.len();
    for (xr, or) in x.chunks_exact(n).zip(out.chunks_exact_mut(n)) {
        let m = rms(xr, eps);
        for ((o, &v), &a) in or.iter_mut().zip(xr).zip(w) {
            *o = v / m * a;
        }
    }
}

/// `sqrt(sum(x^2) / n + eps)`, the sum taken in order.
fn rms(x: &[f32], eps: f32) -> f32 {
    (x.iter().map(|v| v * v).sum::<f32>() / x.len() as f32 + eps).sqrt()
}

/// [`rms_norm_rows`] in place, per row of `w.len()` values (Gemma 3's q/k heads and its
/// attention and FFN outputs).
fn rms_norm_in_place(x: &mut [f32], w: &[f32], eps: f32) {
    let n = w.len();
    for xr in x.chunks_exact_mut(n) {
        let m = rms(xr, eps);
        for (v, &a) in xr.iter_mut().zip(w) {
            *v = *v / m * a;
        }
    }
}

/// `x += f` and then [`rms_norm_rows`] of the new `x` into `out`, in one pass over `x` (the
/// squares are summed as the sums are formed, in candle's order).
fn add_rms_norm_rows(x: &mut [f32], f: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let n = w.len();
    for ((xr, fr), or) in x
        .chunks_exact_mut(n)
        .zip(f.chunks_exact(n))
        .zip(out.chunks_exact_mut(n))
    {
        let mut sum2 = 0f32;
        for (v, &a) in xr.iter_mut().zip(fr) {
            *v += a;
            sum2 += *v * *v;
        }
        let m = (sum2 / n as f32 + eps).sqrt();
        for ((o, &v), &a) in or.iter_mut().zip(xr.iter()).zip(w) {
            *o = v / m * a;
        }
    }
}

/// Rotary embedding of one head in place: pairs `(x[2i], x[2i+1])` (GGUF llama, candle's `rope_i`)
/// or `(x[i], x[i + d/2])` (HF layout, `rope`).
fn rope(x: &mut [f32], cos: &[f32], sin: &[f32], interleaved: bool) {
    let half = x.len() / 2;
    for i in 0..half {
        let (a, b) = if interleaved {
            (2 * i, 2 * i + 1)
        } else {
            (i, i + half)
        };
        let (x0, x1) = (x[a], x[b]);
        x[a] = x0 * cos[i] - x1 * sin[i];
        x[b] = x0 * sin[i] + x1 * cos[i];
    }
}
