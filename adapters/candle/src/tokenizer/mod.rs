//! Tokenizers: built from GGUF metadata or read from a `tokenizer.json` next to the weights.
//! Special ids come from the same source.
//!
//! A GGUF vocabulary is tokenized as llama.cpp tokenizes it (`llama_tokenize`), so that our ids
//! are llama.cpp's:
//!
//! 1. Special-token text is cut out of the text ([`Specials`]): user-defined tokens always,
//!    control and unknown tokens only where special-token text is parsed
//!    ([`TextTokenizer::encode`], not [`TextTokenizer::encode_sequence`]).
//! 2. Each piece of text between them goes to the vocabulary's own tokenizer: for `gpt2` BPE
//!    files the Hugging Face pipeline candle's `TokenizerFromGguf` builds (pre-tokenizer and BPE
//!    merges, with the pre-tokenizer llama.cpp uses for the file's `tokenizer.ggml.pre`), for
//!    `llama` SentencePiece files (Gemma's) our [`Spm`], llama.cpp's `llm_tokenizer_spm_session`.

use std::path::Path;

use candle_core::quantized::gguf_file;
use candle_core::quantized::tokenizer::TokenizerFromGguf;
use tokenizers::{
    Model as _, NormalizedString, NormalizerWrapper, OffsetType, PreTokenizedString,
    PreTokenizer as _, Tokenizer,
};

use crate::error::{ErrorKind, Result};

mod vocab;

use vocab::{kind, Fragment, Session, Specials, Spm, Vocab};

/// A tokenizer with the ids generation needs.
#[derive(Debug)]
pub struct TextTokenizer {
    /// The HF tokenizer. For a SentencePiece GGUF vocabulary it holds the vocabulary only (ids
    /// and pieces, no merges): encode with [`TextTokenizer::encode`], not with it.
    pub inner: Tokenizer,
    /// Beginning-of-sequence id, if the model has one.
    pub bos: Option<u32>,
    /// Whether a sequence starts with `bos` (GGUF `tokenizer.ggml.add_bos_token`; when absent,
    /// SentencePiece vocabularies add it and BPE ones do not, as llama.cpp decides).
    pub add_bos: bool,
    /// Ids that end generation.
    pub eos: Vec<u32>,
    /// llama.cpp's tokenization rules, for a tokenizer built from GGUF metadata.
    gguf: Option<GgufRules>,
}

/// How a GGUF vocabulary is tokenized (see the module documentation).
#[derive(Debug)]
struct GgufRules {
    specials: Specials,
    engine: Engine,
}

/// What tokenizes the text between special tokens.
#[derive(Debug)]
enum Engine {
    /// The pipeline of `inner` (`gpt2` files); the token types, for decoding.
    Bpe(Vec<i32>),
    /// Our SentencePiece tokenizer (`llama` files).
    Spm(Box<Spm>),
}

fn tok_err(e: impl std::fmt::Display) -> crate::error::Error {
    ErrorKind::Tokenizer(e.to_string()).into()
}

impl TextTokenizer {
    /// The tokenizer of the model at `path`, as [`crate::open`] builds it: a `.gguf` file's
    /// metadata ([`TextTokenizer::from_gguf`]), or a directory's `tokenizer.json`.
    pub fn open(path: &Path) -> Result<Self> {
        if path.is_dir() {
            Self::from_file(&path.join("tokenizer.json"))
        } else {
            Self::from_gguf(&crate::gguf::GgufFile::open(path)?.content)
        }
    }

    /// From GGUF metadata (`tokenizer.ggml.*`), tokenizing as llama.cpp does.
    ///
    /// `tokenizer.ggml.model = "gpt2"`: vocabulary, merges and special tokens through candle's
    /// `TokenizerFromGguf`, then the pre-tokenizer llama.cpp uses for the file's
    /// `tokenizer.ggml.pre` where candle's differs: GPT-2-style files (`gpt2`, `smollm`, and
    /// unknown types) split without inserting a leading space, and `smollm` splits digits one by
    /// one, as SmolLM's own `tokenizer.json` does. Without this, encoding adds a space before the
    /// first word and decoding does not give the text back. No Unicode normalization (candle
    /// gives `qwen2` NFC; llama.cpp does not normalize).
    ///
    /// `tokenizer.ggml.model = "llama"`: a SentencePiece BPE vocabulary (tokens, scores and
    /// token types, no merges; Gemma's), tokenized by our implementation of llama.cpp's
    /// `llm_tokenizer_spm_session`. `inner` then holds the vocabulary only.
    ///
    /// A malformed vocabulary is an [`ErrorKind::Tokenizer`] error naming the key.
    pub fn from_gguf(ct: &gguf_file::Content) -> Result<Self> {
        let model = ct
            .metadata
            .get("tokenizer.ggml.model")
            .and_then(|v| v.to_string().ok())
            .map(|s| s.to_lowercase());
        let spm = model.as_deref() == Some("llama");
        let (inner, rules) = if spm {
            let vocab = Vocab::from_gguf(ct, true)?;
            let bpe_vocab: tokenizers::models::bpe::Vocab =
                vocab.ids.iter().map(|(k, &v)| (k.clone(), v)).collect();
            let bpe = tokenizers::models::bpe::BPE::builder()
                .vocab_and_merges(bpe_vocab, Vec::new())
                .build()
                .map_err(|e| tok_err(format!("tokenizer.ggml.tokens: {e}")))?;
            let specials = Specials::new(&vocab);
            let add_space_prefix = match ct.metadata.get("tokenizer.ggml.add_space_prefix") {
                Some(gguf_file::Value::Bool(b)) => *b,
                _ => true,
            };
            let spm = Spm::new(vocab, add_space_prefix);
            (
                Tokenizer::new(bpe),
                GgufRules {
                    specials,
                    engine: Engine::Spm(Box::new(spm)),
                },
            )
        } else {
            let mut inner = Tokenizer::from_gguf(ct).map_err(tok_err)?;
            let pre = ct
                .metadata
                .get("tokenizer.ggml.pre")
                .and_then(|v| v.to_string().ok())
                .map(|s| s.to_lowercase())
                .unwrap_or_default();
            if !matches!(pre.as_str(), "qwen2" | "smaug-bpe" | "lfm2" | "llama3") {
                use tokenizers::pre_tokenizers::{
                    byte_level::ByteLevel, digits::Digits, sequence::Sequence, PreTokenizerWrapper,
                };
                let byte_level = ByteLevel::new(false, true, true);
                let pt: PreTokenizerWrapper = if pre == "smollm" {
                    Sequence::new(vec![Digits::new(true).into(), byte_level.into()]).into()
                } else {
                    byte_level.into()
                };
                inner.with_pre_tokenizer(Some(pt));
                inner.with_decoder(Some(tokenizers::decoders::byte_level::ByteLevel::new(
                    false, true, true,
                )));
            }
            inner
                .with_normalizer(None::<NormalizerWrapper>)
                .map_err(tok_err)?;
            let vocab = Vocab::from_gguf(ct, false)?;
            let specials = Specials::new(&vocab);
            (
                inner,
                GgufRules {
                    specials,
                    engine: Engine::Bpe(vocab.kinds),
                },
            )
        };
        let id = |k: &str| ct.metadata.get(k).and_then(|v| v.to_u32().ok());
        let mut eos: Vec<u32> = id("tokenizer.ggml.eos_token_id").into_iter().collect();
        // Chat models end turns with `<|im_end|>` (ChatML) or `<end_of_turn>` (Gemma) too.
        for name in ["<|im_end|>", "<end_of_turn>"] {
            if let Some(t) = inner.token_to_id(name) {
                if !eos.contains(&t) {
                    eos.push(t);
                }
            }
        }
        let add_bos = match ct.metadata.get("tokenizer.ggml.add_bos_token") {
            Some(gguf_file::Value::Bool(b)) => *b,
            _ => spm,
        };
        Ok(TextTokenizer {
            inner,
            bos: id("tokenizer.ggml.bos_token_id"),
            add_bos,
            eos,
            gguf: Some(rules),
        })
    }

    /// From a `tokenizer.json` file, with eos/bos read from the tokens it names.
    pub fn from_file(path: &Path) -> Result<Self> {
        let inner = Tokenizer::from_file(path).map_err(tok_err)?;
        let id = |names: &[&str]| names.iter().find_map(|n| inner.token_to_id(n));
        let eos = ["</s>", "<|endoftext|>", "<|im_end|>", "<|eot_id|>"]
            .iter()
            .filter_map(|n| inner.token_to_id(n))
            .collect();
        let bos = id(&["<s>", "<|begin_of_text|>"]);
        Ok(TextTokenizer {
            add_bos: bos.is_some(),
            bos,
            eos,
            inner,
            gguf: None,
        })
    }

    /// Token ids of `text` as a sequence starts, as llama.cpp tokenizes a prompt or a
    /// perplexity text (`common_tokenize(.., add_special = true, parse_special = false)`):
    /// `bos` first when [`TextTokenizer::add_bos`], and special-token text in `text` NOT parsed
    /// (for a GGUF vocabulary: `<|im_start|>` is tokenized as the characters it is written
    /// with; user-defined tokens are still matched).
    pub fn encode_sequence(&self, text: &str) -> Result<Vec<u32>> {
        let mut ids = Vec::new();
        if let (true, Some(b)) = (self.add_bos, self.bos) {
            ids.push(b);
        }
        match &self.gguf {
            Some(rules) => self.encode_gguf(rules, text, false, &mut ids)?,
            None => ids.extend(self.encode(text)?),
        }
        Ok(ids)
    }

    /// Token ids of `text`, with no special token added and special-token text in `text`
    /// parsed: chat markup such as `<|im_start|>` or `<start_of_turn>` becomes its token.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        if let Some(rules) = &self.gguf {
            let mut ids = Vec::new();
            self.encode_gguf(rules, text, true, &mut ids)?;
            return Ok(ids);
        }
        Ok(self
            .inner
            .encode(text, false)
            .map_err(tok_err)?
            .get_ids()
            .to_vec())
    }

    /// Text of `ids` (special tokens skipped). For a GGUF vocabulary as llama.cpp detokenizes
    /// without special tokens: control, unknown and unused tokens give nothing, user-defined ones
    /// their text.
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        match self.gguf.as_ref().map(|r| &r.engine) {
            Some(Engine::Spm(spm)) => Ok(spm.decode(ids)),
            Some(Engine::Bpe(kinds)) => {
                let shown: Vec<u32> = ids
                    .iter()
                    .copied()
                    .filter(|&i| {
                        kinds.get(i as usize).is_some_and(|k| {
                            matches!(*k, kind::NORMAL | kind::USER_DEFINED | kind::BYTE)
                        })
                    })
                    .collect();
                self.inner.decode(&shown, false).map_err(tok_err)
            }
            None => self.inner.decode(ids, true).map_err(tok_err),
        }
    }

    /// llama.cpp's tokenization of `text` by a GGUF vocabulary, appended to `out`.
    fn encode_gguf(
        &self,
        rules: &GgufRules,
        text: &str,
        parse_special: bool,
        out: &mut Vec<u32>,
    ) -> Result<()> {
        let mut session = Session::default();
        let mut after_special = true;
        for f in rules.specials.partition(text, parse_special) {
            match f {
                Fragment::Token(id) => {
                    out.push(id);
                    after_special = true;
                }
                Fragment::Text(start, end) => {
                    let piece = &text[start..end];
                    match &rules.engine {
                        Engine::Spm(spm) => spm.encode(piece, after_special, &mut session, out)?,
                        Engine::Bpe(_) => self.encode_bpe(piece, out)?,
                    }
                    after_special = false;
                }
            }
        }
        Ok(())
    }

    /// `inner`'s pipeline (normalizer, pre-tokenizer, model) on `text`, without its added-token
    /// matching, appended to `out`.
    fn encode_bpe(&self, text: &str, out: &mut Vec<u32>) -> Result<()> {
        use tokenizers::Normalizer as _;
        let mut normalized = NormalizedString::from(text);
        if let Some(n) = self.inner.get_normalizer() {
            n.normalize(&mut normalized).map_err(tok_err)?;
        }
        let mut pre = PreTokenizedString::from(normalized);
        if let Some(p) = self.inner.get_pre_tokenizer() {
            p.pre_tokenize(&mut pre).map_err(tok_err)?;
        }
        let model = self.inner.get_model();
        pre.tokenize(|s| model.tokenize(s.get())).map_err(tok_err)?;
        let encoding = pre
            .into_encoding(None, 0, OffsetType::Byte)
            .map_err(tok_err)?;
        out.extend_from_slice(encoding.get_ids());
        Ok(())
    }
}
