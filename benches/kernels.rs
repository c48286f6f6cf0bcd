//! Row kernels per SIMD level, the scalar reference in the same run (criterion).
//!
//! `cargo bench --bench kernels`. Rows of 4096 (the Llama-7B hidden size); throughput is the bytes
//! of weights read. The working set stays in L2, so this measures the kernels, not DRAM.

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use half::f16;
use powerinfer::cpu::Kernels;
use powerinfer::cpu::SimdLevel;

const N: usize = 4096;

fn kernels(c: &mut Criterion) {
    let x: Vec<f32> = (0..N).map(|i| (i % 17) as f32 * 0.1 - 0.8).collect();
    let w: Vec<Vec<f32>> = (0..4)
        .map(|k| (0..N).map(|i| ((i + k) % 13) as f32 * 0.05 - 0.3).collect())
        .collect();
    let wh: Vec<Vec<f16>> = w
        .iter()
        .map(|r| r.iter().map(|&v| f16::from_f32(v)).collect())
        .collect();
    let tiers = SimdLevel::supported();

    let mut g = c.benchmark_group("dot");
    for tier in &tiers {
        let k = Kernels::new(*tier).unwrap();
        g.throughput(Throughput::Bytes((N * 4) as u64));
        g.bench_function(BenchmarkId::new("f32", tier), |b| {
            b.iter(|| k.dot_f32(std::hint::black_box(&w[0]), &x))
        });
        g.throughput(Throughput::Bytes((N * 2) as u64));
        g.bench_function(BenchmarkId::new("f16", tier), |b| {
            b.iter(|| k.dot_f16(std::hint::black_box(&wh[0]), &x))
        });
        g.throughput(Throughput::Bytes((4 * N * 2) as u64));
        g.bench_function(BenchmarkId::new("f16x4", tier), |b| {
            b.iter(|| {
                k.dot4_f16(
                    std::array::from_fn(|j| std::hint::black_box(&wh[j][..])),
                    &x,
                )
            })
        });
    }
    g.finish();

    let mut g = c.benchmark_group("axpy");
    let mut y = vec![0f32; N];
    for tier in &tiers {
        let k = Kernels::new(*tier).unwrap();
        g.throughput(Throughput::Bytes((N * 2) as u64));
        g.bench_function(BenchmarkId::new("f16", tier), |b| {
            b.iter(|| k.axpy_f16(&mut y, 1e-3, std::hint::black_box(&wh[0])))
        });
        g.throughput(Throughput::Bytes((4 * N * 2) as u64));
        g.bench_function(BenchmarkId::new("f16x4", tier), |b| {
            b.iter(|| {
                k.axpy4_f16(
                    &mut y,
                    [1e-3, -1e-3, 2e-3, -2e-3],
                    std::array::from_fn(|j| std::hint::black_box(&wh[j][..])),
                )
            })
        });
    }
    g.finish();
}

fn quantized(c: &mut Criterion) {
    use powerinfer::cpu::{QuantKind, QuantizedRow};
    // One SmolLM2 row (576 = 18 blocks) and one Llama-7B row (4096 = 128 blocks).
    let mut g = c.benchmark_group("dot_gguf_q8");
    for n in [576usize, 4096] {
        let x: Vec<f32> = (0..n).map(|i| (i % 17) as f32 * 0.1 - 0.8).collect();
        let mut xq = QuantizedRow::default();
        xq.quantize(&x);
        for kind in [QuantKind::Q4_0, QuantKind::Q4_1, QuantKind::Q8_0] {
            let w: Vec<u8> = (0..kind.row_bytes(n)).map(|i| (i * 7 % 61) as u8).collect();
            // Valid f16 scales at the start of every block.
            let mut w = w;
            for b in w.chunks_mut(kind.block_bytes()) {
                b[..2].copy_from_slice(&half::f16::from_f32(0.01).to_le_bytes());
                if kind == QuantKind::Q4_1 {
                    b[2..4].copy_from_slice(&half::f16::from_f32(-0.05).to_le_bytes());
                }
            }
            let mut split = vec![0u8; w.len()];
            powerinfer::cpu::split_row(kind, &w, &mut split).unwrap();
            g.throughput(Throughput::Bytes(w.len() as u64));
            for tier in SimdLevel::supported() {
                let k = Kernels::new(tier).unwrap();
                g.bench_function(BenchmarkId::new(format!("{kind:?}/{n}"), tier), |b| {
                    b.iter(|| k.dot_gguf_q8(kind, std::hint::black_box(&w), &xq))
                });
                g.bench_function(BenchmarkId::new(format!("{kind:?}/{n}/split"), tier), |b| {
                    b.iter(|| k.dot_split_q8(kind, std::hint::black_box(&split), &xq))
                });
            }
        }
    }
    g.finish();
}

/// `QLinear` (row-interleaved groups of 16 rows) on one input row, per tier, the scalar reference
/// in the same run: SmolLM2's stacked gate+up (3072 x 576, Q4_1) and its LM head (49152 x 576,
/// Q8_0, 30 MB: out of cache, so this one reads DRAM).
fn packed(c: &mut Criterion) {
    use candle_core::quantized::{GgmlDType, QTensor};
    use candle_core::{Device, Tensor};
    use powerinfer::cpu::QuantizedRow;
    use powerinfer::layers::QLinear;
    let mut g = c.benchmark_group("qlinear");
    g.sample_size(20);
    for (rows, cols, dt) in [
        (3072usize, 576usize, GgmlDType::Q4_1),
        (49152, 576, GgmlDType::Q8_0),
    ] {
        let w = Tensor::randn(0f32, 1.0, (rows, cols), &Device::Cpu).unwrap();
        let q = QTensor::quantize(&w, dt).unwrap();
        let x: Vec<f32> = (0..cols).map(|i| (i % 17) as f32 * 0.1 - 0.8).collect();
        let mut xq = QuantizedRow::default();
        xq.quantize(&x);
        let xs = [xq];
        let mut y = vec![0f32; rows];
        g.throughput(Throughput::Bytes(q.storage_size_in_bytes() as u64));
        for tier in SimdLevel::supported() {
            let lin = QLinear::new(&q, None, 1)
                .unwrap()
                .with_simd_level(tier)
                .unwrap();
            let mut tmp = Vec::new();
            g.bench_function(
                BenchmarkId::new(format!("{dt:?}/{rows}x{cols}"), tier),
                |b| b.iter(|| lin.forward_quantized(&xs, &mut y, &mut tmp).unwrap()),
            );
        }
    }
    g.finish();
}

#[allow(missing_docs)] // criterion_group! generates an undocumented function.
mod group {
    use super::*;
    criterion_group!(benches, kernels, quantized, packed);
}
use group::benches;
criterion_main!(benches);
