//! `powerinfer::cpu::attend` (one query position, the query heads that share a KV head) against a
//! naive f64 reference, against candle's own attention ops bit for bit, plus the typed errors for
//! short slices. It is plain Rust, the same code on every SIMD level.

use powerinfer::cpu::{attend, KvRows};
use powerinfer::ErrorKind;
use proptest::prelude::*;

/// Softmax-weighted values, in f64.
fn naive(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    hd: usize,
    stride: usize,
    n: usize,
    scale: f32,
) -> Vec<f64> {
    let heads = q.len() / hd;
    let mut out = vec![0f64; q.len()];
    for h in 0..heads {
        let s: Vec<f64> = (0..n)
            .map(|j| {
                (0..hd)
                    .map(|d| q[h * hd + d] as f64 * k[j * stride + d] as f64)
                    .sum::<f64>()
                    * scale as f64
            })
            .collect();
        let m = s.iter().fold(f64::NEG_INFINITY, |a, &b| a.max(b));
        let e: Vec<f64> = s.iter().map(|x| (x - m).exp()).collect();
        let z: f64 = e.iter().sum();
        for j in 0..n {
            for d in 0..hd {
                out[h * hd + d] += e[j] / z * v[j * stride + d] as f64;
            }
        }
    }
    out
}

fn check(heads: usize, hd: usize, extra: usize, n: usize, seed: u64) -> Result<(), TestCaseError> {
    let stride = hd + extra;
    let mut x = seed | 1;
    let mut rnd = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        ((x >> 40) as f32 / (1u64 << 24) as f32) * 4.0 - 2.0
    };
    let q: Vec<f32> = (0..heads * hd).map(|_| rnd()).collect();
    let kv = (n.max(1) - 1) * stride + hd;
    let k: Vec<f32> = (0..kv).map(|_| rnd()).collect();
    let v: Vec<f32> = (0..kv).map(|_| rnd()).collect();
    let scale = 1.0 / (hd as f32).sqrt();
    let want = naive(&q, &k, &v, hd, stride, n, scale);
    {
        let mut scores = vec![0f32; heads * n];
        let mut out = vec![f32::NAN; heads * hd];
        let kv = KvRows {
            keys: &k,
            values: &v,
            head_dim: hd,
            stride,
            positions: n,
        };
        attend(&q, &kv, scale, &mut scores, &mut out).unwrap();
        for (i, (&g, &w)) in out.iter().zip(&want).enumerate() {
            // Weights sum to 1 and values lie in [-2, 2]: absolute 1e-5 is a relative bound.
            prop_assert!(
                (g as f64 - w).abs() <= 1e-5,
                "heads {heads} hd {hd} n {n} [{i}]: {g} vs {w}"
            );
        }
        for h in 0..heads {
            let sum: f32 = scores[h * n..(h + 1) * n].iter().sum();
            prop_assert!(n == 0 || (sum - 1.0).abs() < 1e-5, "weights sum to {sum}");
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]
    #[test]
    fn attend_matches_naive(heads in 1usize..5, hd in 1usize..80, extra in 0usize..20, n in 0usize..50, seed in any::<u64>()) {
        check(heads, hd, extra, n, seed)?;
    }
}

/// Head sizes of 1, odd, SIMD widths +-1; one and many positions; no positions.
#[test]
fn attend_edge_shapes() {
    for &hd in &[1usize, 3, 7, 8, 9, 15, 16, 17, 31, 32, 33, 63, 64, 65, 128] {
        for &n in &[0usize, 1, 2, 17, 64] {
            for heads in [1, 3] {
                check(heads, hd, hd % 3, n, (hd * 100 + n) as u64).unwrap();
            }
        }
    }
}

#[test]
fn attend_rejects_short_slices() {
    let q = vec![0.5f32; 16];
    let kv = vec![0.1f32; 4 * 16];
    let mut s = vec![0f32; 4];
    let mut o = vec![0f32; 16];
    let rows = |keys: &'static [f32], values: &'static [f32], head_dim, stride| KvRows {
        keys,
        values,
        head_dim,
        stride,
        positions: 4,
    };
    let kv: &'static [f32] = Box::leak(kv.into_boxed_slice());
    attend(&q, &rows(kv, kv, 16, 16), 0.25, &mut s, &mut o).unwrap();
    let shape = |e: powerinfer::Error| matches!(e.kind(), ErrorKind::Shape { .. });
    let bad = |r: KvRows<'_>, s: &mut [f32], o: &mut [f32]| attend(&q, &r, 0.25, s, o).unwrap_err();
    assert!(shape(bad(rows(&kv[..63], kv, 16, 16), &mut s, &mut o)));
    assert!(shape(bad(rows(kv, &kv[..10], 16, 16), &mut s, &mut o)));
    assert!(shape(bad(rows(kv, kv, 16, 16), &mut s[..3], &mut o)));
    assert!(shape(bad(rows(kv, kv, 16, 16), &mut s, &mut o[..15])));
    // A head size that does not divide the query, or a stride below it: configuration errors.
    for (hd, stride) in [(5, 16), (16, 8), (0, 16)] {
        let e = bad(rows(kv, kv, hd, stride), &mut s, &mut o);
        assert!(matches!(e.kind(), ErrorKind::Config { .. }), "{e}");
    }
}

/// One query row through candle's ops (matmul, scale, softmax, matmul) gives the kernel's bits:
/// the kernel reproduces their summation orders (gemm's 8-lane f32 kernels on x86).
#[cfg(target_arch = "x86_64")]
#[test]
fn attend_equals_candle_bit_for_bit() {
    use candle_core::{Device, Tensor};
    for &hd in &[64usize, 48, 128, 20] {
        for &n in &[1usize, 2, 3, 7, 31, 32, 33, 64, 100, 256, 257, 300] {
            let heads = 3;
            let dev = Device::Cpu;
            let q = (Tensor::randn(0f32, 1.0, (1, heads, 1, hd), &dev).unwrap() * 2.0).unwrap();
            let kt = (Tensor::randn(0f32, 1.0, (1, heads, n, hd), &dev).unwrap() * 2.0).unwrap();
            let v = Tensor::randn(0f32, 1.0, (1, heads, n, hd), &dev).unwrap();
            let att = (q.matmul(&kt.t().unwrap()).unwrap() / (hd as f64).sqrt()).unwrap();
            let att = candle_nn::ops::softmax_last_dim(&att).unwrap();
            let want: Vec<u32> = att
                .matmul(&v)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1::<f32>()
                .unwrap()
                .iter()
                .map(|x| x.to_bits())
                .collect();
            let (qv, kv, vv) = (
                q.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
                kt.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
                v.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
            );
            let mut got = Vec::new();
            for h in 0..heads {
                let rows = KvRows {
                    keys: &kv[h * n * hd..],
                    values: &vv[h * n * hd..],
                    head_dim: hd,
                    stride: hd,
                    positions: n,
                };
                let (mut s, mut o) = (vec![0f32; n], vec![0f32; hd]);
                let scale = (1.0 / (hd as f64).sqrt()) as f32;
                attend(&qv[h * hd..(h + 1) * hd], &rows, scale, &mut s, &mut o).unwrap();
                got.extend(o.iter().map(|x| x.to_bits()));
            }
            assert_eq!(got, want, "head dim {hd}, {n} positions");
        }
    }
}
