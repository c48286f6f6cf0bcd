//! The packed product of every block type on one input row, 1 thread, on a matrix far larger
//! than L2 (`BENCH_ROWS` x `BENCH_COLS`, default 16384 x 4096: 38-71 MB), with a plain read of a
//! buffer as large in the same run: the floor the product cannot beat.
//!
//! `cargo bench --bench blocks [-- FILTER]`. Throughput is the bytes of weights read; compare
//! each row's GB/s with `read`'s. `BENCH_SCALAR=1` adds the scalar reference (slow).
//! `BENCH_COPIES=N` runs the product over N copies of the matrix, one after another, as a
//! decoder runs its layers: with N copies past the last-level cache (e.g. `BENCH_ROWS=8960
//! BENCH_COLS=1536 BENCH_COPIES=130`, 1 GB of Q4_K) every byte comes from DRAM.

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use powerinfer::cpu::{BlockKind, PackedRows, QuantizedRow};
use powerinfer::{cpu::SimdLevel, layers::QLinear};

fn env(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// Random blocks with small finite scales (the product's speed does not depend on the values).
fn blocks(kind: BlockKind, rows: usize, cols: usize) -> Vec<u8> {
    let mut state = 0x9E37_79B9_7F4A_7C15u64;
    let mut w: Vec<u8> = (0..rows * kind.row_bytes(cols))
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state as u8
        })
        .collect();
    for b in w.chunks_exact_mut(kind.block_bytes()) {
        for &at in kind.half_offsets() {
            b[at..at + 2].copy_from_slice(&half::f16::from_f32(0.01).to_le_bytes());
        }
    }
    w
}

fn products(c: &mut Criterion) {
    let (rows, cols) = (env("BENCH_ROWS", 16384), env("BENCH_COLS", 4096));
    let copies = env("BENCH_COPIES", 1).max(1);
    let mut g = c.benchmark_group("blocks");
    g.sample_size(10);
    // The floor: a sum over as many bytes as the largest matrix (u64 lanes, no dependency chain).
    let read: Vec<u64> = (0..copies * rows * BlockKind::Q8_0.row_bytes(cols) / 8)
        .map(|i| i as u64)
        .collect();
    g.throughput(Throughput::Bytes((read.len() * 8) as u64));
    g.bench_function("read", |b| {
        b.iter(|| {
            let mut a = [0u64; 8];
            for c in read.chunks_exact(8) {
                for (x, y) in a.iter_mut().zip(c) {
                    *x = x.wrapping_add(*y);
                }
            }
            std::hint::black_box(a)
        })
    });
    let x: Vec<f32> = (0..cols).map(|i| (i % 17) as f32 * 0.1 - 0.8).collect();
    let mut tiers = SimdLevel::supported();
    if std::env::var_os("BENCH_SCALAR").is_none() {
        tiers.retain(|t| *t != SimdLevel::Scalar);
    }
    for kind in BlockKind::ALL {
        let p = PackedRows::pack(kind, rows, cols, &blocks(kind, rows, cols)).unwrap();
        g.throughput(Throughput::Bytes((copies * p.bytes()) as u64));
        let mut xq = QuantizedRow::default();
        xq.quantize_for(&x, kind.inputs());
        let xs = [xq];
        let (mut y, mut tmp) = (vec![0f32; rows], Vec::new());
        for &tier in &tiers {
            let lins: Vec<QLinear> = (0..copies)
                .map(|_| {
                    QLinear::from_packed(p.clone(), None, 1)
                        .unwrap()
                        .with_simd_level(tier)
                        .unwrap()
                })
                .collect();
            g.bench_function(BenchmarkId::new(kind.name(), tier), |b| {
                b.iter(|| {
                    for lin in &lins {
                        lin.forward_quantized(&xs, &mut y, &mut tmp).unwrap()
                    }
                })
            });
        }
    }
    g.finish();
}

#[allow(missing_docs)] // criterion_group! generates an undocumented function.
mod group {
    use super::*;
    criterion_group!(benches, products);
}
use group::benches;
criterion_main!(benches);
