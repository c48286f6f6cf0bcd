//! Every SIMD level's row kernels against a naive f64 reference, random lengths plus edge lengths.

use half::{bf16, f16};
use powerinfer::cpu::Kernels;
use powerinfer::cpu::SimdLevel;
use proptest::prelude::*;

fn naive_dot(w: &[f64], x: &[f32]) -> f64 {
    w.iter().zip(x).map(|(a, b)| a * *b as f64).sum()
}

/// Checks dot and axpy for every storage dtype on every supported tier.
fn check(w: &[f32], x: &[f32], a: f32) -> Result<(), TestCaseError> {
    let n = w.len();
    let wh: Vec<f16> = w.iter().map(|&v| f16::from_f32(v)).collect();
    let wb: Vec<bf16> = w.iter().map(|&v| bf16::from_f32(v)).collect();
    let exact = [
        w.iter().map(|&v| v as f64).collect::<Vec<_>>(),
        wh.iter().map(|v| v.to_f64()).collect(),
        wb.iter().map(|v| v.to_f64()).collect(),
    ];
    let mag: f64 = w
        .iter()
        .zip(x)
        .map(|(p, q)| (p * q).abs() as f64)
        .sum::<f64>()
        + 1e-6;
    // Four-row variants: rows are w rotated, so each row differs.
    let rot = |s: usize| -> Vec<f32> { (0..n).map(|i| w[(i + s) % n.max(1)]).collect() };
    let rows4: Vec<Vec<f32>> = (0..4).map(rot).collect();
    let rows4h: Vec<Vec<f16>> = rows4
        .iter()
        .map(|r| r.iter().map(|&v| f16::from_f32(v)).collect())
        .collect();
    let rows4b: Vec<Vec<bf16>> = rows4
        .iter()
        .map(|r| r.iter().map(|&v| bf16::from_f32(v)).collect())
        .collect();
    let exact4: [Vec<Vec<f64>>; 3] = [
        rows4
            .iter()
            .map(|r| r.iter().map(|&v| v as f64).collect())
            .collect(),
        rows4h
            .iter()
            .map(|r| r.iter().map(|v| v.to_f64()).collect())
            .collect(),
        rows4b
            .iter()
            .map(|r| r.iter().map(|v| v.to_f64()).collect())
            .collect(),
    ];
    let a4 = [a, -0.5 * a, 0.25, 1.5];
    for tier in SimdLevel::supported() {
        let k = Kernels::new(tier).unwrap();
        let d4 = [
            k.dot4_f32(std::array::from_fn(|j| &rows4[j][..]), x),
            k.dot4_f16(std::array::from_fn(|j| &rows4h[j][..]), x),
            k.dot4_bf16(std::array::from_fn(|j| &rows4b[j][..]), x),
        ];
        for (d, e) in d4.iter().zip(&exact4) {
            for j in 0..4 {
                let r = naive_dot(&e[j], x);
                prop_assert!(
                    ((d[j] as f64) - r).abs() <= 1e-5 * mag,
                    "{tier} dot4 n={n} row {j}: {} vs {r}",
                    d[j]
                );
            }
        }
        let y0: Vec<f32> = x.iter().map(|v| v * 0.5).collect();
        let mut ys = [y0.clone(), y0.clone(), y0.clone()];
        k.axpy4_f32(&mut ys[0], a4, std::array::from_fn(|j| &rows4[j][..]));
        k.axpy4_f16(&mut ys[1], a4, std::array::from_fn(|j| &rows4h[j][..]));
        k.axpy4_bf16(&mut ys[2], a4, std::array::from_fn(|j| &rows4b[j][..]));
        for (y, e) in ys.iter().zip(&exact4) {
            for i in 0..n {
                let terms: Vec<f64> = (0..4).map(|j| a4[j] as f64 * e[j][i]).collect();
                let r = y0[i] as f64 + terms.iter().sum::<f64>();
                let tol =
                    1e-6 * (y0[i].abs() as f64 + terms.iter().map(|t| t.abs()).sum::<f64>() + 1e-6);
                prop_assert!(
                    (y[i] as f64 - r).abs() <= tol,
                    "{tier} axpy4 n={n} i={i}: {} vs {r}",
                    y[i]
                );
            }
        }
        let dots = [k.dot_f32(w, x), k.dot_f16(&wh, x), k.dot_bf16(&wb, x)];
        for (d, e) in dots.iter().zip(&exact) {
            let r = naive_dot(e, x);
            prop_assert!(
                ((*d as f64) - r).abs() <= 1e-5 * mag,
                "{tier} dot n={n}: {d} vs {r}"
            );
        }
        let y0: Vec<f32> = x.iter().map(|v| v * 0.5).collect();
        let mut ys = [y0.clone(), y0.clone(), y0.clone()];
        k.axpy_f32(&mut ys[0], a, w);
        k.axpy_f16(&mut ys[1], a, &wh);
        k.axpy_bf16(&mut ys[2], a, &wb);
        for (y, e) in ys.iter().zip(&exact) {
            for i in 0..n {
                let r = y0[i] as f64 + a as f64 * e[i];
                let tol = 1e-6 * (y0[i].abs() as f64 + (a as f64 * e[i]).abs() + 1e-6);
                prop_assert!(
                    (y[i] as f64 - r).abs() <= tol,
                    "{tier} axpy n={n} i={i}: {} vs {r}",
                    y[i]
                );
            }
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 200, ..ProptestConfig::default() })]
    #[test]
    fn kernels_match_naive(
        (w, x) in (0usize..300).prop_flat_map(|n| (
            proptest::collection::vec(-4.0f32..4.0, n),
            proptest::collection::vec(-4.0f32..4.0, n),
        )),
        a in -3.0f32..3.0,
    ) {
        check(&w, &x, a)?;
    }
}

#[test]
fn edge_lengths() {
    for n in [
        0usize, 1, 2, 3, 4, 5, 7, 8, 9, 15, 16, 17, 31, 32, 33, 63, 64, 65, 127, 128, 129,
    ] {
        let w: Vec<f32> = (0..n)
            .map(|i| ((i * 37 % 11) as f32 - 5.0) * 0.25)
            .collect();
        let x: Vec<f32> = (0..n).map(|i| ((i * 13 % 7) as f32 - 3.0) * 0.5).collect();
        check(&w, &x, 0.75).unwrap();
    }
}

/// Mismatched lengths are cut to the shorter operand: no out-of-bounds access, no panic.
#[test]
fn mismatched_lengths_use_common_prefix() {
    let k = Kernels::new(SimdLevel::best()).unwrap();
    let w = vec![1.0f32; 40];
    let x = vec![2.0f32; 33];
    assert_eq!(k.dot_f32(&w, &x), 66.0);
    let mut y = vec![0.0f32; 17];
    k.axpy_f32(&mut y, 1.0, &w);
    assert!(y.iter().all(|&v| v == 1.0));
}

#[test]
fn env_override_parses_and_rejects() {
    assert_eq!("AVX2".parse::<SimdLevel>().unwrap(), SimdLevel::Avx2);
    assert!("sse9".parse::<SimdLevel>().is_err());
    assert!(SimdLevel::Scalar.is_supported());
    assert_eq!(SimdLevel::supported()[0], SimdLevel::Scalar);
}

mod quantized {
    use half::f16;
    use powerinfer::cpu::SimdLevel;
    use powerinfer::cpu::{
        dequantize_row, dequantize_split_row, quantize_row_q8_0, split_row, Kernels, QuantKind,
        QuantizedRow, QK,
    };
    use proptest::prelude::*;

    /// Random blocks of `kind` with finite f16 scales (raw bytes, as a GGUF file holds them).
    fn blocks(kind: QuantKind, nb: usize, seed: &[u8]) -> Vec<u8> {
        let mut out = Vec::with_capacity(nb * kind.block_bytes());
        let mut k = 0usize;
        let mut next = || {
            k += 1;
            seed[k % seed.len()].wrapping_mul(31).wrapping_add(k as u8)
        };
        for _ in 0..nb {
            let d = f16::from_f32((next() as f32 + 1.0) / 4096.0);
            out.extend_from_slice(&d.to_le_bytes());
            if kind == QuantKind::Q4_1 {
                out.extend_from_slice(&f16::from_f32(next() as f32 / 2048.0 - 0.06).to_le_bytes());
            }
            let n = if kind == QuantKind::Q8_0 { QK } else { QK / 2 };
            for _ in 0..n {
                let b = next();
                out.push(if kind == QuantKind::Q8_0 && b == 128 {
                    0
                } else {
                    b
                });
            }
        }
        out
    }

    /// Integer dots against the dequantize-then-f32 reference on the same quantized input.
    /// Tolerance: both sides use exactly the same quantized values; only the f32 summation order
    /// and the per-block f16 scale products differ: 1e-5 of the sum of |terms|.
    fn check(kind: QuantKind, nb: usize, seed: &[u8], x: &[f32]) -> Result<(), TestCaseError> {
        let w = blocks(kind, nb, seed);
        let mut wf = vec![0f32; nb * QK];
        dequantize_row(kind, &w, &mut wf);
        let mut xq = QuantizedRow::default();
        xq.quantize(x);
        // The quantized input, dequantized: what the integer kernel really multiplies.
        let mut xd = vec![0f32; nb * QK];
        let xq8: Vec<u8> = {
            let mut b = vec![0u8; nb * 34];
            quantize_row_q8_0(x, &mut b);
            b
        };
        dequantize_row(QuantKind::Q8_0, &xq8, &mut xd);
        let reference: f64 = wf.iter().zip(&xd).map(|(a, b)| *a as f64 * *b as f64).sum();
        // The size of the terms summed: products, and for Q4_1 also each block's min times its
        // inputs (its f16-rounded `d * sum(q)` is where the kernels differ from this reference).
        let mins: f64 = if kind == QuantKind::Q4_1 {
            w.chunks(20)
                .zip(xd.chunks(QK))
                .map(|(b, x)| {
                    let m = f16::from_le_bytes([b[2], b[3]]).to_f64().abs();
                    m * x.iter().map(|v| v.abs() as f64).sum::<f64>()
                })
                .sum()
        } else {
            0.0
        };
        let mag: f64 = wf
            .iter()
            .zip(&xd)
            .map(|(a, b)| (*a as f64 * *b as f64).abs())
            .sum::<f64>()
            + mins
            + 1e-3;
        // The split layout holds the same values.
        let mut split = vec![0u8; w.len()];
        split_row(kind, &w, &mut split).unwrap();
        let mut sf = vec![0f32; nb * QK];
        dequantize_split_row(kind, &split, &mut sf);
        prop_assert_eq!(&sf, &wf);
        for tier in SimdLevel::supported() {
            let k = Kernels::new(tier).unwrap();
            // Q4_1's min term uses Q8_1's f16-rounded `d * sum(q)` (2^-10 of it at most).
            for (got, layout) in [
                (k.dot_gguf_q8(kind, &w, &xq), "gguf"),
                (k.dot_split_q8(kind, &split, &xq), "split"),
            ] {
                let got = got as f64;
                prop_assert!(
                    (got - reference).abs() <= 2e-3 * mag,
                    "{tier} {kind:?} {layout} nb={nb}: {got} vs {reference}"
                );
            }
        }
        Ok(())
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 120, ..ProptestConfig::default() })]
        #[test]
        fn quantized_dot_matches_dequantized(
            nb in 0usize..40,
            seed in proptest::collection::vec(any::<u8>(), 1..64),
            xs in proptest::collection::vec(-3.0f32..3.0, 40 * 32),
            kind in 0usize..3,
        ) {
            let kind = [QuantKind::Q4_0, QuantKind::Q4_1, QuantKind::Q8_0][kind];
            check(kind, nb, &seed, &xs[..nb * QK])?;
        }

        #[test]
        fn axpy_q8_0_matches_dequantized(
            nb in 0usize..20,
            xs in proptest::collection::vec(-3.0f32..3.0, 20 * 32),
            a in -2.0f32..2.0,
        ) {
            let src = &xs[..nb * QK];
            let mut w = vec![0u8; nb * 34];
            quantize_row_q8_0(src, &mut w);
            let mut wf = vec![0f32; nb * QK];
            dequantize_row(QuantKind::Q8_0, &w, &mut wf);
            // Round trip error of Q8_0: half a step, plus the f16 rounding of the scale times the
            // largest code (127 * 2^-11 of a step).
            for (blk, o) in src.chunks(QK).zip(wf.chunks(QK)) {
                let step = blk.iter().fold(0f32, |m, v| m.max(v.abs())) / 127.0;
                for (a, b) in blk.iter().zip(o) {
                    prop_assert!((a - b).abs() <= (0.5 + 127.0 / 2048.0) * step + 1e-6, "{a} vs {b}");
                }
            }
            let mut split = vec![0u8; w.len()];
            split_row(QuantKind::Q8_0, &w, &mut split).unwrap();
            for tier in SimdLevel::supported() {
                let k = Kernels::new(tier).unwrap();
                let y0: Vec<f32> = (0..nb * QK).map(|i| i as f32 * 0.01).collect();
                let (mut y, mut ys) = (y0.clone(), y0.clone());
                k.axpy_q8_0(&mut y, a, &w);
                k.axpy_split_q8_0(&mut ys, a, &split);
                for i in 0..nb * QK {
                    let r = y0[i] + a * wf[i];
                    let tol = 1e-5 * (y0[i].abs() + (a * wf[i]).abs() + 1e-6);
                    prop_assert!((y[i] - r).abs() <= tol, "{tier} i={i}");
                    prop_assert!((ys[i] - r).abs() <= tol, "{tier} split i={i}");
                }
            }
        }

        /// A row that is not whole blocks, or an output of another length: typed errors.
        #[test]
        fn split_row_rejects_bad_lengths(nb in 1usize..4, cut in 1usize..20) {
            let w = vec![0u8; nb * 20];
            let mut out = vec![0u8; nb * 20];
            prop_assert!(split_row(QuantKind::Q4_1, &w, &mut out).is_ok());
            prop_assert!(split_row(QuantKind::Q4_1, &w[..nb * 20 - cut], &mut out[..nb * 20 - cut]).is_err());
            prop_assert!(split_row(QuantKind::Q4_1, &w, &mut out[..nb * 20 - cut]).is_err());
        }

        /// Four split Q8_0 rows into one accumulator, against four single-row references.
        #[test]
        fn axpy4_q8_0_split_matches_dequantized(
            nb in 0usize..40,
            xs in proptest::collection::vec(-3.0f32..3.0, 4 * 40 * 32),
            a in proptest::array::uniform4(-2.0f32..2.0),
        ) {
            let n = nb * QK;
            let rows: Vec<Vec<u8>> = (0..4)
                .map(|k| {
                    let mut w = vec![0u8; nb * 34];
                    quantize_row_q8_0(&xs[k * n..(k + 1) * n], &mut w);
                    let mut sp = vec![0u8; w.len()];
                    split_row(QuantKind::Q8_0, &w, &mut sp).unwrap();
                    sp
                })
                .collect();
            let deq: Vec<Vec<f32>> = rows
                .iter()
                .map(|r| {
                    let mut o = vec![0f32; n];
                    dequantize_split_row(QuantKind::Q8_0, r, &mut o);
                    o
                })
                .collect();
            for tier in SimdLevel::supported() {
                let k = Kernels::new(tier).unwrap();
                let y0: Vec<f32> = (0..n).map(|i| (i % 7) as f32 * 0.1 - 0.3).collect();
                let mut y = y0.clone();
                k.axpy4_split_q8_0(&mut y, a, std::array::from_fn(|j| &rows[j][..]));
                for i in 0..n {
                    let terms: Vec<f32> = (0..4).map(|j| a[j] * deq[j][i]).collect();
                    let r = y0[i] + terms.iter().sum::<f32>();
                    let mag = y0[i].abs() + terms.iter().map(|t| t.abs()).sum::<f32>() + 1e-6;
                    prop_assert!((y[i] - r).abs() <= 1e-5 * mag, "{tier} i={i}: {} vs {r}", y[i]);
                }
            }
        }
    }
}
