//! Whether the input rule's perplexity loss sits in a few layers: the study behind keeping one
//! target for every layer.
//!
//! `cargo run --release -p powerinfer-candle --example layer_sensitivity -- MODEL.gguf TARGET
//! TOKENS TEXT` (`TEXT`: a plain-text file of another kind, such as
//! `/usr/share/common-licenses/GPL-3`; the State of the Union speeches are fetched on first use).
//!
//! It calibrates the default rule at `TARGET` on 4096 tokens of the speeches of 1990-1999 and
//! prints the perplexity change, against the dense FFN, on `TOKENS` tokens of the speeches of
//! 1950-1979 and of `TEXT`: with every layer on the rule, then with only one layer on it, for each
//! layer.
//!
//! Measured on Qwen2.5-Coder-1.5B Q4_K_M, target 0.28, 1024 tokens each (GPL-3): every layer on
//! the rule costs +1.0% on the speeches and +6.7% on GPL-3. One layer alone moves GPL-3 by -1.1%
//! to +1.4%, spread over the whole depth (the largest +1.4%, 13 of 28 layers above +0.4%; the 28 changes add up to +9.8%), and
//! the single-layer changes are as large as their noise (several are negative). No few layers
//! carry the loss, so keeping some layers dense buys little.

use std::error::Error;
use std::path::{Path, PathBuf};

use powerinfer::InputThresholds;
use powerinfer_candle::{FfnMode, InputRuleOptions, TextTokenizer};

type Res<T> = std::result::Result<T, Box<dyn Error>>;

/// Up to `n` tokens of the speeches from `years` in the corpus at `dir`, latest first.
fn speeches(
    tok: &TextTokenizer,
    dir: &Path,
    years: std::ops::RangeInclusive<u32>,
    n: usize,
) -> Res<Vec<u32>> {
    let mut ids = Vec::new();
    for f in powerinfer_data::speeches(dir, years)?.iter().rev() {
        if ids.len() >= n {
            break;
        }
        ids.extend(tok.encode(&std::fs::read_to_string(f)?)?);
    }
    ids.truncate(n);
    Ok(ids)
}

fn main() -> Res<()> {
    let args: Vec<String> = std::env::args().collect();
    if args.len() != 5 {
        return Err("usage: layer_sensitivity MODEL TARGET TOKENS TEXT".into());
    }
    let model = PathBuf::from(&args[1]);
    let target: f64 = args[2].parse()?;
    let n: usize = args[3].parse()?;
    let dir = powerinfer_data::sotu(&mut |_| ())?;
    let mode = FfnMode::InputSparse {
        threads: 2,
        attention: false,
        up_rows: false,
        artifact: None,
        layouts: powerinfer_candle::Layouts::Columns,
    };
    let (mut llama, tok) = powerinfer_candle::open(&model, &mode)?;
    let calibration = speeches(&tok, &dir, 1990..=1999, 4096)?;
    let held = speeches(&tok, &dir, 1950..=1979, n)?;
    let mut other = tok.encode(&std::fs::read_to_string(&args[4])?)?;
    other.truncate(n);

    let opts = InputRuleOptions {
        target,
        ..Default::default()
    };
    let rule = llama.calibrate_input_rule(&calibration, 512, &opts)?;
    let score = rule.input_score()?;
    let dense = vec![InputThresholds::default(); rule.thresholds.len()];
    let mut ppl = |th: &[InputThresholds]| -> Res<[f64; 2]> {
        llama.set_input_rule(score, th)?;
        Ok([
            llama.perplexity(&held, 512)?,
            llama.perplexity(&other, 512)?,
        ])
    };
    let base = ppl(&dense)?;
    let change = |p: [f64; 2]| [0, 1].map(|i| (p[i] / base[i] - 1.0) * 100.0);
    println!(
        "dense perplexity: speeches {:.4}, text {:.4}",
        base[0], base[1]
    );
    let all = change(ppl(&rule.thresholds)?);
    println!(
        "every layer: speeches {:+.3}%, text {:+.3}%",
        all[0], all[1]
    );
    for (l, t) in rule.thresholds.iter().enumerate() {
        let mut one = dense.clone();
        one[l] = *t;
        let c = change(ppl(&one)?);
        println!(
            "layer {l:2} alone: speeches {:+.3}%, text {:+.3}%",
            c[0], c[1]
        );
    }
    Ok(())
}
