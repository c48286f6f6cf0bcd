//! What a skip unit of several channels costs an input-sparse rule, and whether a calibrated
//! channel order inside each scale group wins it back: the study behind `cpu::ColumnBlocks`'s
//! one-channel skip unit.
//!
//! `cargo run --release -p powerinfer-candle --example skip_units -- MODEL.gguf SPEECHES_DIR [TOKENS]`
//! (`SPEECHES_DIR`: the State of the Union text files `powerinfer eval` fetches into the data
//! cache, named `YEAR_*.txt`).
//!
//! Per layer it captures the FFN input `x` (gate/up's input) and the activations `h` (down's
//! input) on the speeches of 1990-1999 (calibration) and 2000-2004 (held out), and prints, per
//! target sparsity, the share of the input's energy (`sum v^2`) each rule drops on the held-out
//! tokens:
//! - `channel`: TEAL, per entry `|v| <= t`;
//! - `quad`: per group of 4 adjacent channels, its energy `<= t`;
//! - `quad+perm`: the same after sorting each 32-channel scale group by calibration mean `|v|`
//!   (a permutation inside a scale group would keep the file's bytes exact);
//! - and the share of 4-channel groups the channel rule empties (what a 4-channel layout could
//!   skip at the channel rule's quality), in file order and sorted.
//!
//! Measured on Qwen2.5-Coder-0.5B, 1024 + 1024 tokens, 40% sparsity: `x` loses 2.7% of its
//! energy per channel against 12.8% per 4 channels (11.7% sorted); the channel rule empties
//! 2.9% of the groups (3.5% sorted), about `0.4^4`: the channels are small independently.

use std::path::PathBuf;

use candle_core::Tensor;
use powerinfer_candle::{FfnMode, FfnProbe, Result};

#[derive(Default)]
struct Capture {
    x: Vec<Vec<f32>>,
    h: Vec<Vec<f32>>,
    dims: (usize, usize),
}

impl FfnProbe for Capture {
    fn observe(&mut self, layer: usize, x: &Tensor, h: &Tensor) -> Result<()> {
        if self.x.len() <= layer {
            self.x.resize_with(layer + 1, Vec::new);
            self.h.resize_with(layer + 1, Vec::new);
        }
        self.dims = (x.dim(1)?, h.dim(1)?);
        self.x[layer].extend(x.flatten_all()?.to_vec1::<f32>()?);
        self.h[layer].extend(h.flatten_all()?.to_vec1::<f32>()?);
        Ok(())
    }
}

fn quantile(mut v: Vec<f32>, q: f64) -> f32 {
    if v.is_empty() {
        return 0.0;
    }
    let k = ((v.len() as f64 * q) as usize).min(v.len() - 1);
    *v.select_nth_unstable_by(k, |a, b| a.total_cmp(b)).1
}

/// Energy share dropped on `eval` by each rule at sparsity `s` (thresholds from `cal`), and the
/// realized quad sparsity of the quad rules.
fn study(cal: &[f32], eval: &[f32], n: usize, group: usize, s: f64) -> [f64; 7] {
    let energy: f64 = eval.iter().map(|&v| (v * v) as f64).sum();
    // Channel rule.
    let t = quantile(cal.iter().map(|v| v.abs()).collect(), s);
    let chan: f64 = eval
        .iter()
        .filter(|v| v.abs() <= t)
        .map(|&v| (v * v) as f64)
        .sum();
    // Permutation: per group, channels by calibration mean |v|.
    let rows = cal.len() / n;
    let mut mean = vec![0f64; n];
    for r in cal.chunks_exact(n) {
        for (m, &v) in mean.iter_mut().zip(r) {
            *m += v.abs() as f64 / rows as f64;
        }
    }
    let mut perm: Vec<usize> = (0..n).collect();
    for g in perm.chunks_mut(group) {
        g.sort_by(|&a, &b| mean[a].total_cmp(&mean[b]));
    }
    let ident: Vec<usize> = (0..n).collect();
    let mut out = [chan / energy, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0];
    for (i, order) in [&ident, &perm].into_iter().enumerate() {
        let quad_e = |row: &[f32]| -> Vec<f32> {
            order
                .chunks_exact(4)
                .map(|q| q.iter().map(|&c| row[c] * row[c]).sum())
                .collect()
        };
        let tq = quantile(cal.chunks_exact(n).flat_map(quad_e).collect(), s);
        let (mut dropped, mut skipped, mut quads) = (0f64, 0usize, 0usize);
        for row in eval.chunks_exact(n) {
            for e in quad_e(row) {
                quads += 1;
                if e <= tq {
                    skipped += 1;
                    dropped += e as f64;
                }
            }
        }
        out[1 + 2 * i] = dropped / energy;
        out[2 + 2 * i] = skipped as f64 / quads as f64;
        // The channel rule's quality with a quad kernel: quads with every channel dropped.
        let empty = eval
            .chunks_exact(n)
            .flat_map(|row| {
                order
                    .chunks_exact(4)
                    .map(move |q| q.iter().all(|&c| row[c].abs() <= t))
            })
            .filter(|&e| e)
            .count();
        out[5 + i] = empty as f64 / (eval.len() / 4) as f64;
    }
    out
}

fn main() -> std::result::Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let model = PathBuf::from(&args[1]);
    let sotu = PathBuf::from(&args[2]);
    let tokens: usize = args.get(3).and_then(|t| t.parse().ok()).unwrap_or(1024);
    let (mut llama, tok) = powerinfer_candle::open(&model, &FfnMode::Analysis)?;
    let text = |years: std::ops::RangeInclusive<u32>| -> std::result::Result<Vec<u32>, Box<dyn std::error::Error>> {
        let mut ids = Vec::new();
        let mut files: Vec<_> = std::fs::read_dir(&sotu)?.flatten().map(|e| e.path()).collect();
        files.sort();
        for f in files {
            let name = f.file_name().unwrap_or_default().to_string_lossy().to_string();
            let year: u32 = name.get(..4).and_then(|y| y.parse().ok()).unwrap_or(0);
            if years.contains(&year) && ids.len() < tokens {
                ids.extend(tok.encode(&std::fs::read_to_string(&f)?)?);
            }
        }
        ids.truncate(tokens);
        Ok(ids)
    };
    let (cal_ids, eval_ids) = (text(1990..=1999)?, text(2000..=2004)?);
    let mut cal = Capture::default();
    llama.probe_ffn(&cal_ids, 256, &mut cal)?;
    let mut eval = Capture::default();
    llama.probe_ffn(&eval_ids, 256, &mut eval)?;
    let (hidden, ffn) = cal.dims;
    println!(
        "energy dropped (held out): channel | quad (quad sparsity) | quad+perm (quad sparsity)"
    );
    for s in [0.3, 0.4, 0.5] {
        for (name, n, c, e) in [("x", hidden, &cal.x, &eval.x), ("h", ffn, &cal.h, &eval.h)] {
            let mut sum = [0f64; 7];
            for (c, e) in c.iter().zip(e) {
                let r = study(c, e, n, 32, s);
                sum.iter_mut().zip(r).for_each(|(a, b)| *a += b);
            }
            let l = c.len() as f64;
            println!(
                "s {s:.1} {name}: channel {:.4} | quad {:.4} ({:.3}) | quad+perm {:.4} ({:.3}) | channel rule's empty quads {:.3}, permuted {:.3}",
                sum[0] / l,
                sum[1] / l,
                sum[2] / l,
                sum[3] / l,
                sum[4] / l,
                sum[5] / l,
                sum[6] / l
            );
        }
    }
    Ok(())
}
