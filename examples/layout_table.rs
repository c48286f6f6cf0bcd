//! The kernel table behind the input-sparse layouts: for each FFN shape, block type, matrix
//! (gate: `ffn x hidden`; down: `hidden x ffn`), kept fraction and thread count, the dense packed
//! product and the column product at that kept fraction, each timed from DRAM exactly as
//! `LayoutPlanner` times it while a model loads (median of 9, after a pass over twice the
//! last-level cache), with the GB/s each reads and the layout the planner would choose.
//!
//! `cargo run --release --example layout_table` prints one line per case and one JSON line.
//! `TABLE_SHAPES=1536x8960,4096x11008` (hidden x ffn), `TABLE_KINDS=Q4_K,Q6_K,Q5_K,Q8_0,Q4_0`,
//! `TABLE_KEPT=0.5,0.75,0.9`, `TABLE_THREADS=1,2` choose the cases (defaults as shown). The
//! weights are random blocks with small finite scales: speed does not depend on the values.

use candle_core::quantized::{ggml_file::qtensor_from_ggml, QTensor};
use candle_core::Device;
use powerinfer::cpu::BlockKind;
use powerinfer::layout::{FfnMatrix, LayoutPlanner};

fn list<T: std::str::FromStr>(name: &str, default: &str) -> Vec<T> {
    std::env::var(name)
        .unwrap_or_else(|_| default.into())
        .split(',')
        .filter_map(|s| s.trim().parse().ok())
        .collect()
}

/// Random blocks of `kind` for a `rows x cols` matrix, every f16 field 0.01.
fn matrix(
    kind: BlockKind,
    rows: usize,
    cols: usize,
) -> Result<QTensor, Box<dyn std::error::Error>> {
    let mut s = 0x2545_f491_4f6c_dd1du64;
    let mut w: Vec<u8> = (0..rows * kind.row_bytes(cols))
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            s as u8
        })
        .collect();
    for b in w.chunks_exact_mut(kind.block_bytes()) {
        for &at in kind.half_offsets() {
            b[at..at + 2].copy_from_slice(&half::f16::from_f32(0.01).to_le_bytes());
        }
    }
    use candle_core::quantized::GgmlDType::*;
    let dt = [Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4K, Q5K, Q6K]
        .into_iter()
        .find(|&d| BlockKind::from_ggml(d) == Some(kind))
        .ok_or("no ggml type")?;
    Ok(qtensor_from_ggml(dt, &w, vec![rows, cols], &Device::Cpu)?)
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let shapes: Vec<String> = list("TABLE_SHAPES", "1536x8960,4096x11008");
    let kinds: Vec<String> = list("TABLE_KINDS", "Q4_K,Q6_K,Q5_K,Q8_0,Q4_0");
    let kept: Vec<f64> = list("TABLE_KEPT", "0.5,0.75,0.9");
    let threads: Vec<usize> = list("TABLE_THREADS", "1,2");
    println!("# dense rows against columns at a kept fraction, from DRAM, median of 9");
    for shape in &shapes {
        let Some((h, f)) = shape.split_once('x') else {
            continue;
        };
        let (hidden, ffn): (usize, usize) = (h.parse()?, f.parse()?);
        for name in &kinds {
            let Some(kind) = BlockKind::ALL.into_iter().find(|k| k.name() == name) else {
                return Err(format!("unknown block type {name}").into());
            };
            for (which, rows, cols) in [
                (FfnMatrix::Gate, ffn, hidden),
                (FfnMatrix::Down, hidden, ffn),
            ] {
                if cols % kind.block_elems() != 0 {
                    continue;
                }
                let t = matrix(kind, rows, cols)?;
                for &th in &threads {
                    for &k in &kept {
                        let planner = LayoutPlanner::new([1.0 - k; 3], th, None)?;
                        planner.layout(which, &t, rows, cols)?;
                        for d in planner.decisions() {
                            let share = (d.columns_bytes as f64 / d.columns_ms)
                                / (d.rows_bytes as f64 / d.rows_ms);
                            println!(
                                "{d}; columns read at {:.0}% of the rows' GB/s",
                                share * 100.0
                            );
                            println!(
                                "{{\"matrix\":\"{}\",\"kind\":\"{}\",\"rows\":{rows},\"cols\":{cols},\"threads\":{th},\"kept\":{k},\"rows_ms\":{:.4},\"columns_ms\":{:.4},\"rows_bytes\":{},\"columns_bytes\":{},\"gbs_share\":{share:.3},\"layout\":\"{}\"}}",
                                which.name(),
                                kind,
                                d.rows_ms,
                                d.columns_ms,
                                d.rows_bytes,
                                d.columns_bytes,
                                d.layout.name()
                            );
                        }
                    }
                }
            }
        }
    }
    Ok(())
}
