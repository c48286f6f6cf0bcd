//! Tokenizers: built from GGUF metadata (`gpt2` BPE, via candle's `TokenizerFromGguf`) or read
//! from a `tokenizer.json` next to the weights. Special ids come from the same source.

use std::path::Path;

use candle_core::quantized::gguf_file;
use candle_core::quantized::tokenizer::TokenizerFromGguf;
use tokenizers::Tokenizer;

use crate::error::{ErrorKind, Result};

/// A tokenizer with the ids generation needs.
#[derive(Debug)]
pub struct TextTokenizer {
    /// The HF tokenizer.
    pub inner: Tokenizer,
    /// Beginning-of-sequence id, if the model has one.
    pub bos: Option<u32>,
    /// Whether a sequence starts with `bos` (GGUF `tokenizer.ggml.add_bos_token`; when absent,
    /// SentencePiece vocabularies add it and BPE ones do not, as llama.cpp decides).
    pub add_bos: bool,
    /// Ids that end generation.
    pub eos: Vec<u32>,
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
            Self::from_gguf(&crate::GgufFile::open(path)?.content)
        }
    }

    /// From GGUF metadata (`tokenizer.ggml.*`): vocabulary, merges and special tokens through
    /// candle's `TokenizerFromGguf`, then the pre-tokenizer llama.cpp uses for the file's
    /// `tokenizer.ggml.pre` where candle's differs: GPT-2-style files (`gpt2`, `smollm`, and
    /// unknown types) split without inserting a leading space, and `smollm` splits digits one by
    /// one, as SmolLM's own `tokenizer.json` does. Without this, encoding adds a space before the
    /// first word and decoding does not give the text back.
    pub fn from_gguf(ct: &gguf_file::Content) -> Result<Self> {
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
        let id = |k: &str| ct.metadata.get(k).and_then(|v| v.to_u32().ok());
        let mut eos: Vec<u32> = id("tokenizer.ggml.eos_token_id").into_iter().collect();
        // Chat models end turns with `<|im_end|>` too.
        if let Some(t) = inner.token_to_id("<|im_end|>") {
            if !eos.contains(&t) {
                eos.push(t);
            }
        }
        let spm = ct
            .metadata
            .get("tokenizer.ggml.model")
            .and_then(|v| v.to_string().ok())
            .is_some_and(|m| m == "llama");
        let add_bos = match ct.metadata.get("tokenizer.ggml.add_bos_token") {
            Some(gguf_file::Value::Bool(b)) => *b,
            _ => spm,
        };
        Ok(TextTokenizer {
            inner,
            bos: id("tokenizer.ggml.bos_token_id"),
            add_bos,
            eos,
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
        })
    }

    /// Token ids of `text` as a sequence starts: `bos` first when [`TextTokenizer::add_bos`]
    /// (llama.cpp's tokenization of a prompt or a perplexity text).
    pub fn encode_sequence(&self, text: &str) -> Result<Vec<u32>> {
        let mut ids = Vec::new();
        if let (true, Some(b)) = (self.add_bos, self.bos) {
            ids.push(b);
        }
        ids.extend(self.encode(text)?);
        Ok(ids)
    }

    /// Token ids of `text` (no special tokens added).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        Ok(self
            .inner
            .encode(text, false)
            .map_err(tok_err)?
            .get_ids()
            .to_vec())
    }

    /// Text of `ids` (special tokens skipped).
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        self.inner.decode(ids, true).map_err(tok_err)
    }
}
