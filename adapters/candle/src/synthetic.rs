//! Llama-shaped GGUF files of seeded random weights: a 7B-shaped model (or any shape) for timing
//! and for checks on a machine that reaches no model hub and takes few bytes in (a GPU host
//! lent for minutes), written in seconds where the real file would take an hour to copy.
//!
//! The weights are random GGUF blocks, not quantized floats: the quantized values are random
//! bytes, and each block's scale is set so that the weights have a standard deviation of about
//! 0.02 (what a trained 7B's projections have), so activations stay finite through every layer.
//! The norms are ones. The vocabulary is a SentencePiece one the tokenizer reads like Llama 2's:
//! `<unk>`, `<s>`, `</s>`, the 256 byte tokens, single letters and filler pieces, so any text
//! encodes (by byte fallback). The text such a model writes is noise; what it is for is the
//! bytes a token reads, and comparing two ways of computing the same model.

use std::path::Path;

use candle_core::quantized::{gguf_file, GgmlDType, QStorage, QTensor};
use candle_core::Device;
use half::f16;
use rand::{rngs::StdRng, RngCore, SeedableRng};

use crate::error::{Error, Result};

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
    /// Vocabulary size (at least 320: specials, bytes and letters).
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
        self.check()?;
        let (h, n, v) = (self.hidden, self.intermediate, self.vocab);
        let kv = h / self.heads * self.kv_heads;
        let mut rng = StdRng::seed_from_u64(self.seed);
        let mut tensors: Vec<(String, QTensor)> = Vec::new();
        let mut matrix = |name: String, rows: usize, cols: usize| -> Result<()> {
            let t = random_blocks(self.blocks, rows, cols, &mut rng)?;
            tensors.push((name, t));
            Ok(())
        };
        matrix("token_embd.weight".into(), v, h)?;
        for l in 0..self.layers {
            let p = format!("blk.{l}");
            matrix(format!("{p}.attn_q.weight"), h, h)?;
            matrix(format!("{p}.attn_k.weight"), kv, h)?;
            matrix(format!("{p}.attn_v.weight"), kv, h)?;
            matrix(format!("{p}.attn_output.weight"), h, h)?;
            matrix(format!("{p}.ffn_gate.weight"), n, h)?;
            matrix(format!("{p}.ffn_up.weight"), n, h)?;
            matrix(format!("{p}.ffn_down.weight"), h, n)?;
        }
        matrix("output.weight".into(), v, h)?;
        let ones = || {
            QTensor::quantize(
                &candle_core::Tensor::ones(h, candle_core::DType::F32, &Device::Cpu)?,
                GgmlDType::F32,
            )
        };
        for l in 0..self.layers {
            tensors.push((format!("blk.{l}.attn_norm.weight"), ones()?));
            tensors.push((format!("blk.{l}.ffn_norm.weight"), ones()?));
        }
        tensors.push(("output_norm.weight".into(), ones()?));

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
/// about 0.02: random quantized bytes, each block's f16 scale(s) overwritten.
fn random_blocks(kind: GgmlDType, rows: usize, cols: usize, rng: &mut StdRng) -> Result<QTensor> {
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
    for block in data.chunks_exact_mut(ts) {
        for &(at, d) in fields {
            block[at..at + 2].copy_from_slice(&f16::from_f32(d).to_le_bytes());
        }
    }
    let storage = QStorage::from_data(std::borrow::Cow::Owned(data), &Device::Cpu, kind)?;
    Ok(QTensor::new(storage, (rows, cols))?)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tiny(blocks: GgmlDType, seed: u64) -> SyntheticLlama {
        SyntheticLlama {
            layers: 2,
            hidden: 256,
            intermediate: 512,
            heads: 4,
            kv_heads: 2,
            vocab: 400,
            context: 128,
            blocks,
            seed,
        }
    }

    #[test]
    fn bad_shapes_are_typed_errors_naming_them() {
        let dir = std::env::temp_dir();
        let path = dir.join("powerinfer-synthetic-bad.gguf");
        for (spec, says) in [
            (
                SyntheticLlama {
                    hidden: 100,
                    ..tiny(GgmlDType::Q4K, 1)
                },
                "hidden 100",
            ),
            (
                SyntheticLlama {
                    heads: 3,
                    ..tiny(GgmlDType::Q4_0, 1)
                },
                "3 heads",
            ),
            (
                SyntheticLlama {
                    vocab: 10,
                    ..tiny(GgmlDType::Q4_0, 1)
                },
                "vocabulary 10",
            ),
            (
                SyntheticLlama {
                    layers: 0,
                    ..tiny(GgmlDType::Q4_0, 1)
                },
                "layers",
            ),
            (tiny(GgmlDType::Q5K, 1), "Q5K"),
        ] {
            let err = spec.write(&path).unwrap_err().to_string();
            assert!(err.contains(says), "{err}");
            assert!(!path.exists(), "nothing written for a bad shape");
        }
    }

    #[test]
    fn the_same_seed_writes_the_same_bytes_and_sizes_add_up() {
        let dir = std::env::temp_dir().join(format!("powerinfer-synthetic-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let read = |spec: SyntheticLlama, name: &str| {
            let p = dir.join(name);
            spec.write(&p).unwrap();
            std::fs::read(&p).unwrap()
        };
        let a = read(tiny(GgmlDType::Q4K, 7), "a.gguf");
        let b = read(tiny(GgmlDType::Q4K, 7), "b.gguf");
        let c = read(tiny(GgmlDType::Q4K, 8), "c.gguf");
        assert_eq!(a, b);
        assert_ne!(a, c);
        let spec = tiny(GgmlDType::Q6K, 1);
        let bytes = read(spec, "d.gguf").len();
        // The blocks, plus the header, the metadata (the vocabulary) and alignment padding.
        assert!(
            bytes > spec.weight_bytes() && bytes < spec.weight_bytes() + 64 * 1024,
            "{bytes}"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
