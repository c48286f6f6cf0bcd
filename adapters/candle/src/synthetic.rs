//! Llama-shaped GGUF files of seeded random weights: a 7B-shaped model (or any shape) for timing
//! and for checks on a machine that reaches no model hub and takes few bytes in (a GPU host
//! lent for minutes), written in seconds where the real file would take an hour to copy.
//!
//! The weights are random GGUF blocks, not quantized floats: the quantized values are random
//! bytes, and each block's scale is set so that the weights have a standard deviation of about
//! 0.02 (Llama's initialisation scale), so activations stay finite through every layer.
//! The norms are ones. The vocabulary is a SentencePiece one the tokenizer reads like Llama 2's:
//! `<unk>`, `<s>`, `</s>`, the 256 byte tokens, single letters and filler pieces, so any text
//! encodes (by byte fallback). The text such a model writes is noise; what it is for is the
//! bytes a token reads, and comparing two ways of computing the same model.
//!
//! Random weights give every FFN input channel and every neuron the same spread, where a trained
//! model's are skewed: a few channels and neurons are large most of the time (what input
//! sparsity keeps, and what a hybrid puts on the GPU). [`FfnProfile`] measures that skew on a real
//! model (each layer's per-channel RMS of the FFN input and per-neuron RMS of `h`, sorted, as a
//! curve of [`PROFILE_POINTS`] points: a few KB for a whole model), and
//! [`SyntheticLlama::write_with`] gives a synthetic model the same skew: each layer's FFN norm
//! weights follow the input curve and its up rows the `h` curve, in a seeded random order.

use std::path::Path;

use candle_core::quantized::{gguf_file, GgmlDType, QStorage, QTensor};
use candle_core::{Device, Tensor};
use half::f16;
use rand::{rngs::StdRng, seq::SliceRandom, RngCore, SeedableRng};

use crate::error::{Error, Result};
use crate::model::{FfnProbe, Llama};

/// Points of each curve of an [`FfnProfile`].
pub const PROFILE_POINTS: usize = 32;

/// How skewed a real model's FFN inputs are, per layer (see the module docs).
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct FfnProfile {
    /// What it was measured on (a free-form name).
    pub model: String,
    /// Tokens it was measured over.
    pub tokens: usize,
    /// One entry per decoder layer.
    pub layers: Vec<LayerProfile>,
}

/// One layer of an [`FfnProfile`]: the per-channel RMS of the FFN input (`x`) and the per-neuron
/// RMS of `h`, each sorted from the largest, sampled at [`PROFILE_POINTS`] evenly spaced ranks
/// and scaled to a mean square of 1.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct LayerProfile {
    /// The FFN input's curve.
    pub x: Vec<f32>,
    /// `h`'s curve.
    pub h: Vec<f32>,
}

/// Sums of squares per channel and per neuron, per layer.
#[derive(Default)]
struct Squares {
    x: Vec<Vec<f64>>,
    h: Vec<Vec<f64>>,
    tokens: usize,
}

impl FfnProbe for Squares {
    fn observe(&mut self, layer: usize, x: &Tensor, h: &Tensor) -> Result<()> {
        if self.x.len() <= layer {
            self.x.resize(layer + 1, Vec::new());
            self.h.resize(layer + 1, Vec::new());
        }
        let add = |acc: &mut Vec<f64>, t: &Tensor| -> Result<()> {
            let s: Vec<f32> = t.sqr()?.sum(0)?.to_vec1()?;
            acc.resize(s.len(), 0.0);
            acc.iter_mut()
                .zip(&s)
                .for_each(|(a, v)| *a += f64::from(*v));
            Ok(())
        };
        add(&mut self.x[layer], x)?;
        add(&mut self.h[layer], h)?;
        if layer == 0 {
            self.tokens += x.dims().first().copied().unwrap_or(0);
        }
        Ok(())
    }
}

/// Sums of squares over `tokens` rows as a sorted, sampled curve of mean square 1.
fn curve(squares: &[f64], tokens: usize) -> Vec<f32> {
    let mut rms: Vec<f64> = squares
        .iter()
        .map(|s| (s / tokens.max(1) as f64).sqrt())
        .collect();
    rms.sort_by(|a, b| b.total_cmp(a));
    let n = rms.len();
    let points: Vec<f64> = (0..PROFILE_POINTS)
        .map(|i| rms[((2 * i + 1) * n / (2 * PROFILE_POINTS)).min(n.saturating_sub(1))])
        .collect();
    let ms = points.iter().map(|v| v * v).sum::<f64>() / PROFILE_POINTS as f64;
    // Four significant digits are plenty for a shape, and keep the file small.
    let round = |v: f64| {
        let e = 10f64.powi(3 - v.abs().max(1e-30).log10().floor() as i32);
        ((v * e).round() / e) as f32
    };
    points
        .iter()
        .map(|v| round(v / ms.sqrt().max(1e-30)))
        .collect()
}

impl FfnProfile {
    /// Measures `model` (loaded with dense FFNs: [`crate::FfnMode::Dense`] or `Analysis`) over
    /// `tokens`, in windows of `chunk` tokens.
    pub fn measure(model: &mut Llama, name: &str, tokens: &[u32], chunk: usize) -> Result<Self> {
        if tokens.is_empty() {
            return Err(powerinfer::Error::config("profile", "no tokens to measure on").into());
        }
        let mut sq = Squares::default();
        model.probe_ffn(tokens, chunk, &mut sq)?;
        let layers =
            sq.x.iter()
                .zip(&sq.h)
                .map(|(x, h)| LayerProfile {
                    x: curve(x, sq.tokens),
                    h: curve(h, sq.tokens),
                })
                .collect();
        Ok(FfnProfile {
            model: name.into(),
            tokens: sq.tokens,
            layers,
        })
    }

    /// `n` scales following layer `l` of `of`'s share of the depth (the profile's layer at the
    /// same relative depth), `x`'s curve or `h`'s, linearly interpolated between the points, in
    /// an order shuffled by `rng`.
    fn scales(&self, l: usize, of: usize, n: usize, h: bool, rng: &mut StdRng) -> Result<Vec<f32>> {
        let bad = |what: &str| powerinfer::Error::config("profile", what.to_string());
        let at = (l * self.layers.len()) / of.max(1);
        let layer = self.layers.get(at).ok_or_else(|| bad("no layers"))?;
        let c = if h { &layer.h } else { &layer.x };
        if c.len() < 2 || c.iter().any(|v| !v.is_finite() || *v < 0.0) {
            return Err(bad("each curve needs at least 2 finite points, none negative").into());
        }
        let mut v: Vec<f32> = (0..n)
            .map(|i| {
                let last = (c.len() - 1) as f32;
                let p = ((i as f32 + 0.5) / n as f32 * c.len() as f32 - 0.5).clamp(0.0, last);
                let (i0, f) = (p.floor() as usize, p - p.floor());
                c[i0] * (1.0 - f) + c[(i0 + 1).min(c.len() - 1)] * f
            })
            .collect();
        v.shuffle(rng);
        Ok(v)
    }
}

/// The shape, block type and seed of a synthetic llama model ([`SyntheticLlama::write`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SyntheticLlama {
    /// Decoder layers.
    pub layers: usize,
    /// Hidden size (a multiple of 256 for the K-quants, of 32 otherwise).
    pub hidden: usize,
    /// FFN intermediate size (a multiple of the block size, as `hidden`).
    pub intermediate: usize,
    /// Query heads (dividing `hidden`).
    pub heads: usize,
    /// Key/value heads (dividing `heads`).
    pub kv_heads: usize,
    /// Vocabulary size (at least 311: 3 specials, 256 bytes and 52 letter pieces).
    pub vocab: usize,
    /// Context length the file declares.
    pub context: usize,
    /// Block type of every matrix: Q4_0, Q8_0, Q4_K or Q6_K.
    pub blocks: GgmlDType,
    /// Seed of every random byte: the same spec writes the same file.
    pub seed: u64,
}

impl SyntheticLlama {
    /// Llama 2 7B's shape (32 layers, hidden 4096, FFN 11008, 32 heads, vocabulary 32000) in
    /// Q4_K blocks: 3.8 GB of weights.
    pub fn llama_7b(seed: u64) -> Self {
        SyntheticLlama {
            layers: 32,
            hidden: 4096,
            intermediate: 11008,
            heads: 32,
            kv_heads: 32,
            vocab: 32000,
            context: 4096,
            blocks: GgmlDType::Q4K,
            seed,
        }
    }

    /// Bytes of the weight blocks the file holds (norms included).
    pub fn weight_bytes(&self) -> usize {
        let (h, n, v) = (self.hidden, self.intermediate, self.vocab);
        let kv = h / self.heads.max(1) * self.kv_heads;
        let m = |rows: usize, cols: usize| {
            rows * cols / self.blocks.block_size() * self.blocks.type_size()
        };
        let layer = m(h, h) * 2 + m(kv, h) * 2 + m(n, h) * 2 + m(h, n) + 2 * 4 * h;
        self.layers * layer + 2 * m(v, h) + 4 * h
    }

    fn check(&self) -> Result<()> {
        let bad = |what: String| Err(powerinfer::Error::config("synthetic model", what).into());
        let block = self.blocks.block_size();
        if !matches!(
            self.blocks,
            GgmlDType::Q4_0 | GgmlDType::Q8_0 | GgmlDType::Q4K | GgmlDType::Q6K
        ) {
            return bad(format!(
                "{:?} blocks: expected Q4_0, Q8_0, Q4_K or Q6_K",
                self.blocks
            ));
        }
        if self.layers == 0 || self.heads == 0 || self.kv_heads == 0 {
            return bad("layers and heads must be at least 1".into());
        }
        if self.hidden == 0
            || !self.hidden.is_multiple_of(block)
            || self.intermediate == 0
            || !self.intermediate.is_multiple_of(block)
        {
            return bad(format!(
                "hidden {} and intermediate {} must be positive multiples of the {block}-weight block",
                self.hidden, self.intermediate
            ));
        }
        if !self.hidden.is_multiple_of(self.heads)
            || !self.heads.is_multiple_of(self.kv_heads)
            || !(self.hidden / self.heads).is_multiple_of(2)
        {
            return bad(format!(
                "{} heads and {} KV heads do not split hidden {} into even head sizes",
                self.heads, self.kv_heads, self.hidden
            ));
        }
        if self.vocab < MIN_VOCAB || self.context == 0 {
            return bad(format!(
                "vocabulary {} (at least {MIN_VOCAB}) and context {} (at least 1)",
                self.vocab, self.context
            ));
        }
        Ok(())
    }

    /// Writes the model to `path` as a GGUF file (`general.architecture = llama`), every
    /// matrix in [`SyntheticLlama::blocks`], all of it from [`SyntheticLlama::seed`]. A bad
    /// shape is a typed error naming it; nothing is written then.
    pub fn write(&self, path: &Path) -> Result<()> {
        self.write_with(path, None)
    }

    /// [`SyntheticLlama::write`], with the FFN inputs skewed as `profile` measured on a real
    /// model (see the module docs).
    pub fn write_with(&self, path: &Path, profile: Option<&FfnProfile>) -> Result<()> {
        self.check()?;
        let (h, n, v) = (self.hidden, self.intermediate, self.vocab);
        let kv = h / self.heads * self.kv_heads;
        let mut rng = StdRng::seed_from_u64(self.seed);
        let mut tensors: Vec<(String, QTensor)> = Vec::new();
        // The profile's orders and scales come from their own stream, so the weights' bytes
        // are the same with and without one.
        let mut order = StdRng::seed_from_u64(self.seed ^ 0x5eed_0f5c_a1e5);
        let mut scales = |l: usize, len: usize, h_curve: bool| {
            profile
                .map(|p| p.scales(l, self.layers, len, h_curve, &mut order))
                .transpose()
        };
        let mut norms = Vec::with_capacity(self.layers);
        let mut push =
            |name: String, rows: usize, cols: usize, scale: Option<&[f32]>| -> Result<()> {
                let t = random_blocks(self.blocks, rows, cols, scale, &mut rng)?;
                tensors.push((name, t));
                Ok(())
            };
        push("token_embd.weight".into(), v, h, None)?;
        for l in 0..self.layers {
            norms.push(scales(l, h, false)?);
            let up = scales(l, n, true)?;
            let p = format!("blk.{l}");
            push(format!("{p}.attn_q.weight"), h, h, None)?;
            push(format!("{p}.attn_k.weight"), kv, h, None)?;
            push(format!("{p}.attn_v.weight"), kv, h, None)?;
            push(format!("{p}.attn_output.weight"), h, h, None)?;
            push(format!("{p}.ffn_gate.weight"), n, h, None)?;
            push(format!("{p}.ffn_up.weight"), n, h, up.as_deref())?;
            push(format!("{p}.ffn_down.weight"), h, n, None)?;
        }
        push("output.weight".into(), v, h, None)?;
        let vector = |v: Option<&[f32]>| -> Result<QTensor> {
            let t = match v {
                Some(v) => Tensor::new(v, &Device::Cpu)?,
                None => Tensor::ones(h, candle_core::DType::F32, &Device::Cpu)?,
            };
            Ok(QTensor::quantize(&t, GgmlDType::F32)?)
        };
        for (l, norm) in norms.iter().enumerate() {
            tensors.push((format!("blk.{l}.attn_norm.weight"), vector(None)?));
            tensors.push((format!("blk.{l}.ffn_norm.weight"), vector(norm.as_deref())?));
        }
        tensors.push(("output_norm.weight".into(), vector(None)?));

        let u32v = |x: usize| gguf_file::Value::U32(x as u32);
        let mut meta: Vec<(String, gguf_file::Value)> = vec![
            (
                "general.architecture".into(),
                gguf_file::Value::String("llama".into()),
            ),
            (
                "general.name".into(),
                gguf_file::Value::String(format!("synthetic llama, seed {}", self.seed)),
            ),
            ("llama.block_count".into(), u32v(self.layers)),
            ("llama.embedding_length".into(), u32v(h)),
            ("llama.feed_forward_length".into(), u32v(n)),
            ("llama.attention.head_count".into(), u32v(self.heads)),
            ("llama.attention.head_count_kv".into(), u32v(self.kv_heads)),
            ("llama.context_length".into(), u32v(self.context)),
            ("llama.rope.dimension_count".into(), u32v(h / self.heads)),
            (
                "llama.rope.freq_base".into(),
                gguf_file::Value::F32(10_000.0),
            ),
            (
                "llama.attention.layer_norm_rms_epsilon".into(),
                gguf_file::Value::F32(1e-5),
            ),
            ("llama.vocab_size".into(), u32v(v)),
        ];
        meta.extend(vocabulary(v));
        let meta_refs: Vec<(&str, &gguf_file::Value)> =
            meta.iter().map(|(k, v)| (k.as_str(), v)).collect();
        let tensor_refs: Vec<(&str, &QTensor)> =
            tensors.iter().map(|(k, t)| (k.as_str(), t)).collect();
        let file = std::fs::File::create(path).map_err(|e| Error::io(path, e))?;
        let mut w = std::io::BufWriter::new(file);
        gguf_file::write(&mut w, &meta_refs, &tensor_refs)?;
        use std::io::Write;
        w.flush().map_err(|e| Error::io(path, e))?;
        Ok(())
    }
}

/// Specials, the 256 byte tokens and 26 + 26 letters (with and without the word marker).
const MIN_VOCAB: usize = 3 + 256 + 52;

/// A SentencePiece vocabulary of `n` tokens, as `tokenizer.ggml.*` metadata.
fn vocabulary(n: usize) -> Vec<(String, gguf_file::Value)> {
    use gguf_file::Value;
    // llama.cpp's token types.
    const NORMAL: i32 = 1;
    const UNKNOWN: i32 = 2;
    const CONTROL: i32 = 3;
    const BYTE: i32 = 6;
    let mut tokens: Vec<(String, i32)> = vec![
        ("<unk>".into(), UNKNOWN),
        ("<s>".into(), CONTROL),
        ("</s>".into(), CONTROL),
    ];
    tokens.extend((0..=255u8).map(|b| (format!("<0x{b:02X}>"), BYTE)));
    for c in 'a'..='z' {
        tokens.push((format!("\u{2581}{c}"), NORMAL));
        tokens.push((c.to_string(), NORMAL));
    }
    let mut i = 0;
    while tokens.len() < n {
        tokens.push((format!("\u{2581}w{i}"), NORMAL));
        i += 1;
    }
    let scores = (0..n).map(|i| Value::F32(-(i as f32))).collect();
    vec![
        ("tokenizer.ggml.model".into(), Value::String("llama".into())),
        (
            "tokenizer.ggml.tokens".into(),
            Value::Array(
                tokens
                    .iter()
                    .map(|(t, _)| Value::String(t.clone()))
                    .collect(),
            ),
        ),
        ("tokenizer.ggml.scores".into(), Value::Array(scores)),
        (
            "tokenizer.ggml.token_type".into(),
            Value::Array(tokens.iter().map(|(_, k)| Value::I32(*k)).collect()),
        ),
        ("tokenizer.ggml.unknown_token_id".into(), Value::U32(0)),
        ("tokenizer.ggml.bos_token_id".into(), Value::U32(1)),
        ("tokenizer.ggml.eos_token_id".into(), Value::U32(2)),
        ("tokenizer.ggml.add_bos_token".into(), Value::Bool(true)),
    ]
}

/// A `rows x cols` tensor of random `kind` blocks whose weights have a standard deviation of
/// about 0.02 (times `row_scale[r]` in row `r`): random quantized bytes, each block's f16
/// scale(s) overwritten.
fn random_blocks(
    kind: GgmlDType,
    rows: usize,
    cols: usize,
    row_scale: Option<&[f32]>,
    rng: &mut StdRng,
) -> Result<QTensor> {
    const STD: f32 = 0.02;
    let (bs, ts) = (kind.block_size(), kind.type_size());
    let mut data = vec![0u8; rows * cols / bs * ts];
    rng.fill_bytes(&mut data);
    // Where each block's f16 scales sit, and the scale for STD (the standard deviation of the
    // quantized value times the block's multipliers, for uniform random bytes).
    let fields: &[(usize, f32)] = match kind {
        // d * (q - 8), q uniform in 0..16: std 4.6.
        GgmlDType::Q4_0 => &[(0, STD / 4.6)],
        // d * q, q uniform i8: std 74.
        GgmlDType::Q8_0 => &[(0, STD / 74.0)],
        // d * sc * q - dmin * m with 6-bit sc, m and 4-bit q: std about 195 d when dmin = 7.5 d
        // (which also centres the weights on average).
        GgmlDType::Q4K => &[(0, STD / 195.0), (2, 7.5 * STD / 195.0)],
        // d * sc * (q - 32), i8 sc and 6-bit q: std about 1369 d; d is the block's last field.
        GgmlDType::Q6K => &[(208, STD / 1369.0)],
        other => {
            return Err(
                powerinfer::Error::config("synthetic model", format!("{other:?} blocks")).into(),
            )
        }
    };
    let per_row = cols / bs;
    for (i, block) in data.chunks_exact_mut(ts).enumerate() {
        let s = row_scale.map_or(1.0, |r| r[i / per_row]);
        for &(at, d) in fields {
            block[at..at + 2].copy_from_slice(&f16::from_f32(d * s).to_le_bytes());
        }
    }
    let storage = QStorage::from_data(std::borrow::Cow::Owned(data), &Device::Cpu, kind)?;
    Ok(QTensor::new(storage, (rows, cols))?)
}
