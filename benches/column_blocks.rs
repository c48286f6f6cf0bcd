//! The input-sparse product over column-major GGUF blocks (`ColumnBlocks`) against the dense
//! packed product (`QLinear`) of the same matrix, 1 thread, at the FFN shapes of the real models
//! (gate/up: `ffn x hidden`; down: `hidden x ffn`), for every block type the shape allows.
//!
//! `cargo bench --bench column_blocks [-- FILTER]`, e.g. `-- 1536x8960/gate/Q4_K`. Throughput
//! is the bytes each product reads (the dense matrix; the sparse product's kept columns and
//! their scales), so a sparse row's GB/s over the dense row's is the efficiency the kept bytes
//! are read at. Kept channels: all (`keep100`), 60% and 50% chosen at random (`keep60`,
//! `keep50`: the channels of an activation are small or large independently, so a rule's kept
//! set looks random to the layout). `BENCH_COPIES=N` cycles N copies of each matrix (past the
//! last-level cache with enough copies, so every byte comes from DRAM);
//! `BENCH_SHAPES=576x1536,...` picks the shapes (`hidden x ffn`), `BENCH_KINDS=Q4_K,...` the
//! block types (the others are not even built: with many copies, laying them out takes longer
//! than the measurement). `BENCH_ROWS=N` (default 16, 0 skips it) adds a prompt of N rows: the
//! dense product (`dense-rowsN`) against the batched column product over the union of the rows'
//! channels (`keep60-rowsN`: each row keeps its own 60%); throughput is rows times the dense
//! bytes for both, so the two compare as rows per second.

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use powerinfer::cpu::{
    ActiveChannels, BlockKind, ColumnBlocks, Kernels, PackedRows, QuantizedRow, UNIT_ROWS,
};
use powerinfer::{cpu::SimdLevel, layers::QLinear};
use std::time::Duration;

fn env(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// Deterministic pseudo-random bytes.
fn noise(n: usize, seed: u64) -> impl Iterator<Item = u64> {
    let mut s = seed | 1;
    (0..n).map(move |_| {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        s
    })
}

/// Random blocks with small finite scales (speed does not depend on the values).
fn blocks(kind: BlockKind, rows: usize, cols: usize) -> Vec<u8> {
    let mut w: Vec<u8> = noise(rows * kind.row_bytes(cols), 7)
        .map(|v| v as u8)
        .collect();
    for b in w.chunks_exact_mut(kind.block_bytes()) {
        for &at in kind.half_offsets() {
            b[at..at + 2].copy_from_slice(&half::f16::from_f32(0.01).to_le_bytes());
        }
    }
    w
}

/// An input with every channel nonzero, then with each zeroed with probability `drop` (%).
fn input(cols: usize, drop: u64) -> Vec<f32> {
    let mut x: Vec<f32> = noise(cols, 3)
        .map(|v| (v % 2001) as f32 / 1000.0 - 1.0 + 0.0005)
        .collect();
    for (v, r) in x.iter_mut().zip(noise(cols, 11)) {
        if r % 100 < drop {
            *v = 0.0;
        }
    }
    x
}

fn shapes() -> Vec<(usize, usize)> {
    let default = "576x1536,896x4864,1536x8960,4096x11008";
    std::env::var("BENCH_SHAPES")
        .unwrap_or_else(|_| default.into())
        .split(',')
        .filter_map(|s| {
            let (h, f) = s.split_once('x')?;
            Some((h.parse().ok()?, f.parse().ok()?))
        })
        .collect()
}

/// Whether `BENCH_KINDS` (comma-separated names; unset: all) asks for `kind`.
fn wanted(kind: BlockKind) -> bool {
    std::env::var("BENCH_KINDS").map_or(true, |v| v.split(',').any(|k| k == kind.name()))
}

fn products(c: &mut Criterion) {
    let copies = env("BENCH_COPIES", 1).max(1);
    let k = Kernels::new(SimdLevel::best()).unwrap();
    for (hidden, ffn) in shapes() {
        for (name, rows, cols) in [("gate", ffn, hidden), ("down", hidden, ffn)] {
            let mut g = c.benchmark_group(format!("column_blocks/{hidden}x{ffn}/{name}"));
            g.sample_size(10)
                .warm_up_time(Duration::from_millis(300))
                .measurement_time(Duration::from_secs(1));
            for kind in BlockKind::ALL {
                if cols % kind.block_elems() != 0 || !wanted(kind) {
                    continue;
                }
                let w = blocks(kind, rows, cols);
                let dense: Vec<QLinear> = (0..copies)
                    .map(|_| {
                        QLinear::from_packed(
                            PackedRows::pack(kind, rows, cols, &w).unwrap(),
                            None,
                            1,
                        )
                        .unwrap()
                    })
                    .collect();
                let sparse: Vec<ColumnBlocks> = (0..copies)
                    .map(|_| ColumnBlocks::from_blocks(kind, rows, cols, &w).unwrap())
                    .collect();
                let mut xq = QuantizedRow::default();
                xq.quantize_for(&input(cols, 0), kind.inputs());
                let xs = [xq.clone()];
                let (mut y, mut tmp) = (vec![0f32; rows], Vec::new());
                g.throughput(Throughput::Bytes(
                    (copies * kind.row_bytes(cols) * rows) as u64,
                ));
                g.bench_function(BenchmarkId::new(kind.name(), "dense"), |b| {
                    b.iter(|| {
                        for lin in &dense {
                            lin.forward_quantized(&xs, &mut y, &mut tmp).unwrap()
                        }
                    })
                });
                let n = env("BENCH_ROWS", 16);
                if n > 0 {
                    prompt(&mut g, &k, kind, &dense, &sparse, n);
                }
                let mut out = vec![0f32; sparse[0].units() * UNIT_ROWS];
                for (label, drop) in [("keep100", 0), ("keep60", 40), ("keep50", 50)] {
                    xq.quantize_for(&input(cols, drop), kind.inputs());
                    let mut a = ActiveChannels::default();
                    a.of(kind, &xq);
                    g.throughput(Throughput::Bytes(
                        (copies * sparse[0].bytes_read(&a)) as u64,
                    ));
                    g.bench_function(BenchmarkId::new(kind.name(), label), |b| {
                        b.iter(|| {
                            for m in &sparse {
                                k.column_blocks_q8(m, 0..m.units(), &xq, &a, &mut out)
                            }
                        })
                    });
                }
            }
            g.finish();
        }
    }
}

/// A prompt of `n` rows: the dense product against the batched column product, each row
/// keeping its own 60% of the channels.
fn prompt(
    g: &mut criterion::BenchmarkGroup<'_, criterion::measurement::WallTime>,
    k: &Kernels,
    kind: BlockKind,
    dense: &[QLinear],
    sparse: &[ColumnBlocks],
    n: usize,
) {
    let (rows, cols) = (sparse[0].rows(), sparse[0].cols());
    let mut xs = vec![QuantizedRow::default(); n];
    let mut sets = vec![ActiveChannels::default(); n];
    for (i, (x, a)) in xs.iter_mut().zip(&mut sets).enumerate() {
        let mut v = input(cols, 0);
        v.rotate_left(i * 7);
        for (v, r) in v.iter_mut().zip(noise(cols, 100 + i as u64)) {
            if r % 100 < 40 {
                *v = 0.0;
            }
        }
        x.quantize_for(&v, kind.inputs());
        a.of(kind, x);
    }
    let mut all = ActiveChannels::default();
    all.union_of(kind, &sets);
    let (mut y, mut tmp) = (vec![0f32; n * rows], Vec::new());
    g.throughput(Throughput::Bytes(
        (dense.len() * n * kind.row_bytes(cols) * rows) as u64,
    ));
    g.bench_function(
        BenchmarkId::new(kind.name(), format!("dense-rows{n}")),
        |b| {
            b.iter(|| {
                for lin in dense {
                    lin.forward_quantized(&xs, &mut y, &mut tmp).unwrap()
                }
            })
        },
    );
    let mut out = vec![0f32; n * sparse[0].units() * UNIT_ROWS];
    g.bench_function(
        BenchmarkId::new(kind.name(), format!("keep60-rows{n}")),
        |b| {
            b.iter(|| {
                for m in sparse {
                    k.column_blocks_rows_q8(m, 0..m.units(), &xs, &all, 2, &mut out)
                }
            })
        },
    );
}

#[allow(missing_docs)] // criterion_group! generates an undocumented function.
mod group {
    use super::*;
    criterion_group!(benches, products);
}
use group::benches;
criterion_main!(benches);
