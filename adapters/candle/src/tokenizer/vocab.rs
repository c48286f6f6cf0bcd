//! A GGUF vocabulary as llama.cpp reads it: token types, the special-token cutting step
//! ([`Specials`]) and the SentencePiece tokenizer of `llama` vocabularies ([`Spm`],
//! llama.cpp's `llm_tokenizer_spm_session`).

use std::cmp::Ordering;
use std::collections::{BinaryHeap, HashMap};

use candle_core::quantized::gguf_file;

use super::tok_err;
use crate::error::Result;

/// llama.cpp's token types (`tokenizer.ggml.token_type`, `llama_token_type`).
pub(super) mod kind {
    pub const NORMAL: i32 = 1;
    pub const UNKNOWN: i32 = 2;
    pub const CONTROL: i32 = 3;
    pub const USER_DEFINED: i32 = 4;
    pub const BYTE: i32 = 6;
}

/// Token texts llama.cpp makes control tokens whatever their type in the file (its
/// end-of-generation list in `llama_vocab::impl::load`): such a user-defined token is matched
/// in the text only where special-token text is parsed, and decoding drops it. (Gemma 3's
/// `</s>`, a user-defined HTML tag there, is one.) Not reproduced: llama.cpp's exceptions for
/// gpt-oss's `<|end|>` and for a `</s>` beside `<|tool_response>` or `<|plamo:eos|>`, and the
/// strip-spaces attributes it gives special tokens of a few models by name (Phi-3, Jina, ...).
const CONTROL_LOOKING: &[&str] = &[
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<|return|>",
    "<|call|>",
    "<|flush|>",
    "<|calls|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "</s>",
    "<|eom_id|>",
    "<EOT>",
    "_<EOT>",
    "[EOT]",
    "[EOS]",
    "<|end_of_text|>",
    "<end_of_utterance>",
    "<eos>",
    "<turn|>",
    "<|tool_response>",
    "<｜end▁of▁sentence｜>",
    "[e~[",
];

/// Token texts llama.cpp makes user-defined whatever their type (gpt-oss), after
/// [`CONTROL_LOOKING`].
const USER_DEFINED_LOOKING: &[&str] = &["<|channel|>", "<|message|>", "<|start|>", "<|constrain|>"];

/// A GGUF vocabulary as llama.cpp loads it.
pub(super) struct Vocab {
    /// Token texts (an empty one is renamed `[EMPTY_<id>]`, as llama.cpp does).
    pub(super) pieces: Vec<String>,
    /// Merge priority per token (SentencePiece only; `-0.0` made `0.0`, so `total_cmp` orders
    /// as `<` does).
    pub(super) scores: Vec<f32>,
    /// Token type per token ([`kind`]; llama.cpp's overrides applied).
    pub(super) kinds: Vec<i32>,
    /// Text to id (SentencePiece only).
    pub(super) ids: HashMap<String, u32>,
}

/// The first `n` entries of the per-token array `key` (`a`, when present), each through `conv`
/// (`None`: the entry is not `what`).
fn per_token<T>(
    a: Option<&Vec<gguf_file::Value>>,
    key: &str,
    n: usize,
    what: &str,
    conv: impl Fn(&gguf_file::Value) -> Option<T>,
) -> Result<Option<Vec<T>>> {
    let Some(a) = a else { return Ok(None) };
    if a.len() < n {
        return Err(tok_err(format!(
            "{key} has {} entries for {n} tokens",
            a.len()
        )));
    }
    a[..n]
        .iter()
        .enumerate()
        .map(|(i, v)| conv(v).ok_or_else(|| tok_err(format!("{key}[{i}] is not {what}"))))
        .collect::<Result<Vec<T>>>()
        .map(Some)
}

impl Vocab {
    /// `tokenizer.ggml.{tokens,token_type}`, and for SentencePiece (`spm`) `tokenizer.ggml.scores`
    /// and the text-to-id map (else `scores` and `ids` stay empty).
    pub(super) fn from_gguf(ct: &gguf_file::Content, spm: bool) -> Result<Self> {
        const TOKENS: &str = "tokenizer.ggml.tokens";
        const SCORES: &str = "tokenizer.ggml.scores";
        const TYPES: &str = "tokenizer.ggml.token_type";
        let array = |key: &str| -> Result<Option<&Vec<gguf_file::Value>>> {
            match ct.metadata.get(key) {
                None => Ok(None),
                Some(gguf_file::Value::Array(a)) => Ok(Some(a)),
                Some(_) => Err(tok_err(format!("{key} is not an array"))),
            }
        };
        let tokens = array(TOKENS)?.ok_or_else(|| tok_err(format!("{TOKENS} is missing")))?;
        let n = tokens.len();
        if n == 0 || n >= u32::MAX as usize {
            return Err(tok_err(format!("{TOKENS} has {n} entries")));
        }
        let mut pieces = Vec::with_capacity(n);
        for (i, t) in tokens.iter().enumerate() {
            match t {
                gguf_file::Value::String(s) if s.is_empty() => pieces.push(format!("[EMPTY_{i}]")),
                gguf_file::Value::String(s) => pieces.push(s.clone()),
                _ => return Err(tok_err(format!("{TOKENS}[{i}] is not a string"))),
            }
        }
        let scores = if spm {
            per_token(array(SCORES)?, SCORES, n, "a number", |v| match v {
                gguf_file::Value::F32(x) if !x.is_nan() => Some(*x + 0.0), // -0.0 -> 0.0
                gguf_file::Value::I32(x) => Some(*x as f32),
                _ => None,
            })?
            .unwrap_or_else(|| vec![0.0; n])
        } else {
            Vec::new()
        };
        let mut kinds = per_token(array(TYPES)?, TYPES, n, "an i32", |v| match v {
            gguf_file::Value::I32(x) => Some(*x),
            _ => None,
        })?
        .unwrap_or_else(|| vec![kind::NORMAL; n]);
        let mut ids = HashMap::new();
        if spm {
            ids.reserve(n);
            for (i, p) in pieces.iter().enumerate() {
                if ids.insert(p.clone(), i as u32).is_some() {
                    return Err(tok_err(format!("{TOKENS}: token {p:?} appears twice")));
                }
            }
        }
        for (i, p) in pieces.iter().enumerate() {
            if CONTROL_LOOKING.contains(&p.as_str()) {
                kinds[i] = kind::CONTROL;
            }
        }
        for (i, p) in pieces.iter().enumerate() {
            if USER_DEFINED_LOOKING.contains(&p.as_str()) {
                kinds[i] = kind::USER_DEFINED;
            }
        }
        Ok(Vocab {
            pieces,
            scores,
            kinds,
            ids,
        })
    }
}

/// A part of the text: a byte range of text, or a special token.
#[derive(Clone, Copy, Debug)]
pub(super) enum Fragment {
    Text(usize, usize),
    Token(u32),
}

/// The tokens llama.cpp cuts out of the text before tokenizing the rest
/// (`tokenizer_st_partition`): control, unknown and user-defined ones, longest text first (equal
/// lengths: lowest id first; llama.cpp's order there is its sort's), each token's occurrences
/// left to right in what earlier tokens left. Only user-defined ones when special-token text is
/// not parsed.
#[derive(Debug)]
pub(super) struct Specials {
    /// `(id, text, user-defined)` in matching order.
    pub(super) list: Vec<(u32, String, bool)>,
}

impl Specials {
    pub(super) fn new(vocab: &Vocab) -> Self {
        let mut list: Vec<(u32, String, bool)> = vocab
            .kinds
            .iter()
            .enumerate()
            .filter(|(_, &k)| matches!(k, kind::CONTROL | kind::UNKNOWN | kind::USER_DEFINED))
            .map(|(i, &k)| (i as u32, vocab.pieces[i].clone(), k == kind::USER_DEFINED))
            .collect();
        list.sort_by_key(|(i, t, _)| (std::cmp::Reverse(t.len()), *i));
        Specials { list }
    }

    /// `text` cut at the special tokens (all of them if `parse_special`, else the user-defined
    /// ones). The empty text has no fragment.
    pub(super) fn partition(&self, text: &str, parse_special: bool) -> Vec<Fragment> {
        let mut fragments = Vec::new();
        if text.is_empty() {
            return fragments;
        }
        fragments.push(Fragment::Text(0, text.len()));
        // Which bytes and byte pairs occur: most tokens can then be skipped without a search.
        let bytes = text.as_bytes();
        let mut single = [false; 256];
        let mut pairs = vec![0u64; 1024];
        for &b in bytes {
            single[b as usize] = true;
        }
        for w in bytes.windows(2) {
            let k = (w[0] as usize) << 8 | w[1] as usize;
            pairs[k >> 6] |= 1 << (k & 63);
        }
        for (id, token, user_defined) in &self.list {
            if !parse_special && !user_defined {
                continue;
            }
            let maybe = match token.as_bytes() {
                [a] => single[*a as usize],
                [a, b, ..] => {
                    let k = (*a as usize) << 8 | *b as usize;
                    pairs[k >> 6] & (1 << (k & 63)) != 0
                }
                [] => false,
            };
            if !maybe || !text.contains(token.as_str()) {
                continue;
            }
            let mut next = Vec::with_capacity(fragments.len() + 2);
            for f in fragments {
                let Fragment::Text(start, end) = f else {
                    next.push(f);
                    continue;
                };
                let mut at = start;
                for (m, _) in text[start..end].match_indices(token.as_str()) {
                    if start + m > at {
                        next.push(Fragment::Text(at, start + m));
                    }
                    next.push(Fragment::Token(*id));
                    at = start + m + token.len();
                }
                if at < end {
                    next.push(Fragment::Text(at, end));
                }
            }
            fragments = next;
        }
        fragments
    }
}

/// SentencePiece's whitespace mark, U+2581.
const SPACE_MARK: char = '\u{2581}';

/// A SentencePiece BPE vocabulary (GGUF `tokenizer.ggml.model = "llama"`) tokenized as llama.cpp
/// does (`llm_tokenizer_spm_session`), one piece of text between special tokens at a time:
/// a space is put in front when `tokenizer.ggml.add_space_prefix` is set and the piece starts
/// the text or follows a special token; spaces become U+2581; the text is split into
/// characters; then, repeatedly, the adjacent pair whose concatenation is a vocabulary token
/// (of any type) with the highest score is merged (ties: the leftmost pair). A final symbol that
/// is not a token is written as its bytes' `<0xXX>` tokens.
pub(super) struct Spm {
    pub(super) vocab: Vocab,
    /// The token of each byte: `<0xXX>`, else the one-byte text; `u32::MAX` when neither exists.
    pub(super) bytes: [u32; 256],
    /// `tokenizer.ggml.add_space_prefix` (default true for this vocabulary type).
    pub(super) add_space_prefix: bool,
}

impl std::fmt::Debug for Spm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Spm")
            .field("tokens", &self.vocab.pieces.len())
            .field("add_space_prefix", &self.add_space_prefix)
            .finish()
    }
}

/// A symbol of the merge: `len` bytes of the text from `start` (0 once merged into its left
/// neighbour), linked to its live neighbours.
#[derive(Clone, Copy)]
struct Symbol {
    pub(super) start: usize,
    pub(super) len: usize,
    pub(super) prev: Option<usize>,
    pub(super) next: Option<usize>,
}

/// A candidate merge of symbols `left` and `right`, whose texts had `size` bytes together when it
/// was queued (so a stale candidate is recognised: merging only grows symbols).
struct Bigram {
    pub(super) score: f32,
    pub(super) left: usize,
    pub(super) right: usize,
    pub(super) size: usize,
}

impl Ord for Bigram {
    /// Highest score first; ties: lowest `left` first.
    fn cmp(&self, other: &Self) -> Ordering {
        self.score
            .total_cmp(&other.score)
            .then_with(|| other.left.cmp(&self.left))
    }
}

impl PartialOrd for Bigram {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl PartialEq for Bigram {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}

impl Eq for Bigram {}

/// Buffers reused across the pieces of one text.
#[derive(Default)]
pub(super) struct Session {
    text: String,
    symbols: Vec<Symbol>,
    queue: BinaryHeap<Bigram>,
}

impl Spm {
    pub(super) fn new(vocab: Vocab, add_space_prefix: bool) -> Self {
        let mut bytes = [u32::MAX; 256];
        for (b, slot) in bytes.iter_mut().enumerate() {
            let hex = format!("<0x{b:02X}>");
            let one = (b < 0x80).then(|| char::from(b as u8).to_string());
            if let Some(&i) = vocab
                .ids
                .get(&hex)
                .or_else(|| one.as_ref().and_then(|s| vocab.ids.get(s)))
            {
                *slot = i;
            }
        }
        Spm {
            vocab,
            bytes,
            add_space_prefix,
        }
    }

    /// Appends the ids of `piece` (a text between special tokens) to `out`.
    pub(super) fn encode(
        &self,
        piece: &str,
        after_special: bool,
        s: &mut Session,
        out: &mut Vec<u32>,
    ) -> Result<()> {
        let Session {
            text,
            symbols,
            queue,
        } = s;
        text.clear();
        if self.add_space_prefix && after_special {
            text.push(SPACE_MARK);
        }
        for c in piece.chars() {
            text.push(if c == ' ' { SPACE_MARK } else { c });
        }
        symbols.clear();
        queue.clear();
        let count = text.chars().count();
        for (i, (start, c)) in text.char_indices().enumerate() {
            symbols.push(Symbol {
                start,
                len: c.len_utf8(),
                prev: i.checked_sub(1),
                next: (i + 1 < count).then_some(i + 1),
            });
        }
        let text = text.as_str();
        let try_pair = |symbols: &[Symbol],
                        queue: &mut BinaryHeap<Bigram>,
                        l: Option<usize>,
                        r: Option<usize>| {
            let (Some(left), Some(right)) = (l, r) else {
                return;
            };
            let start = symbols[left].start;
            let size = symbols[left].len + symbols[right].len;
            if let Some(&id) = self.vocab.ids.get(&text[start..start + size]) {
                queue.push(Bigram {
                    score: self.vocab.scores[id as usize],
                    left,
                    right,
                    size,
                });
            }
        };
        for i in 1..symbols.len() {
            try_pair(symbols, queue, Some(i - 1), Some(i));
        }
        while let Some(b) = queue.pop() {
            let (l, r) = (symbols[b.left], symbols[b.right]);
            if l.len == 0 || r.len == 0 || l.len + r.len != b.size {
                continue;
            }
            symbols[b.left].len += r.len;
            symbols[b.right].len = 0;
            symbols[b.left].next = r.next;
            if let Some(n) = r.next {
                symbols[n].prev = Some(b.left);
            }
            try_pair(symbols, queue, l.prev, Some(b.left));
            try_pair(symbols, queue, Some(b.left), r.next);
        }
        let mut at = (!symbols.is_empty()).then_some(0);
        while let Some(i) = at {
            let sym = symbols[i];
            let piece = &text[sym.start..sym.start + sym.len];
            if let Some(&id) = self.vocab.ids.get(piece) {
                out.push(id);
            } else {
                for &b in piece.as_bytes() {
                    match self.bytes[b as usize] {
                        u32::MAX => {
                            return Err(tok_err(format!(
                                "tokenizer.ggml.tokens: no token for byte 0x{b:02X} \
                                 (<0x{b:02X}>) to write {piece:?} with"
                            )))
                        }
                        id => out.push(id),
                    }
                }
            }
            at = sym.next;
        }
        Ok(())
    }

    /// The text of `ids` as llama.cpp detokenizes them without special tokens: control, unknown
    /// and unused tokens give nothing (as do ids out of range), user-defined ones their text,
    /// U+2581 becomes a space, byte tokens their byte; with `add_space_prefix`, the first piece
    /// loses one leading space.
    pub(super) fn decode(&self, ids: &[u32]) -> String {
        let mut out: Vec<u8> = Vec::new();
        let mut first = true;
        for &id in ids {
            let Some(piece) = self.vocab.pieces.get(id as usize) else {
                continue;
            };
            let start = out.len();
            match self.vocab.kinds[id as usize] {
                kind::NORMAL => {
                    for c in piece.chars() {
                        let c = if c == SPACE_MARK { ' ' } else { c };
                        out.extend_from_slice(c.encode_utf8(&mut [0u8; 4]).as_bytes());
                    }
                }
                kind::USER_DEFINED => out.extend_from_slice(piece.as_bytes()),
                kind::BYTE => {
                    if let Some(b) = piece.get(3..5).and_then(|h| u8::from_str_radix(h, 16).ok()) {
                        out.push(b);
                    }
                }
                _ => continue,
            }
            if first && self.add_space_prefix && out.get(start) == Some(&b' ') {
                out.remove(start);
            }
            first = false;
        }
        String::from_utf8_lossy(&out).into_owned()
    }
}
