//! Attention for one query position over a KV cache, in candle's order.
//!
//! The fused decoder must compute what the reference model computes, and candle (0.10 and 0.11
//! alike) runs attention through its CPU matmul (the `gemm` crate: 8-lane f32 kernels on x86,
//! whose AVX-512 kernels are behind a feature candle does not enable) and its softmax. This
//! module reproduces their summation orders for one query row, so a decode step's attention
//! gives candle's bits:
//! - a score `q . k` over up to 256 positions is gemm's horizontal kernel: 8 lane accumulators,
//!   fused multiply-adds chunk by chunk (the last chunk zero-padded), then the AVX2 reduction tree;
//!   over more positions, gemm's row-major matrix-vector kernel: 8 groups of 8 lane accumulators
//!   over chunks of 64, added pairwise, then chunks of 8 into the first, its lanes added in order,
//!   the rest fused one by one;
//! - the softmax: the maximum, `exp(s - max)`, their sum in candle's `vec_sum` order (4 x 8 lanes
//!   over chunks of 32, a tree, then the rest in order), a division;
//! - the weighted sum: per output value a fused multiply-add chain over the positions in order
//!   (over two positions, gemm adds two rounded products).
//!
//! The rows of a prompt are computed as single-row steps rather than as candle's batched matmul
//! (whose order changes with the batch size), so a batch gives every position the bits
//! token-by-token decoding gives. Plain Rust: the orders are fixed by the code, not by the SIMD
//! tier, and the compiler vectorizes the 8-lane loops.

use crate::error::{Error, Result};

/// The cached keys and values of one KV head for [`attend`]: position `j`'s key is
/// `keys[j * stride..j * stride + head_dim]`, its value the same range of `values`.
#[derive(Debug, Clone, Copy)]
pub struct KvRows<'a> {
    /// Keys, position-major.
    pub keys: &'a [f32],
    /// Values, position-major.
    pub values: &'a [f32],
    /// Values per head.
    pub head_dim: usize,
    /// Distance between consecutive positions (at least `head_dim`).
    pub stride: usize,
    /// Positions to attend to.
    pub positions: usize,
}

/// Lanes of the kernels whose order is reproduced.
const L: usize = 8;

/// gemm's horizontal micro-kernel: one accumulator per lane over chunks of 8, then the reduction
/// tree of an AVX2 horizontal sum.
#[inline(always)]
fn horizontal(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len().min(b.len());
    let (a, b) = (&a[..n], &b[..n]);
    let mut acc = [0f32; L];
    let (ca, cb) = (a.chunks_exact(L), b.chunks_exact(L));
    let (ta, tb) = (ca.remainder(), cb.remainder());
    for (ca, cb) in ca.zip(cb) {
        for l in 0..L {
            acc[l] = ca[l].mul_add(cb[l], acc[l]);
        }
    }
    if !ta.is_empty() {
        // The last, partial chunk: zero-padded lanes add nothing (gemm's masked load).
        for (l, (x, y)) in ta.iter().zip(tb).enumerate() {
            acc[l] = x.mul_add(*y, acc[l]);
        }
    }
    let x = [
        acc[0] + acc[4],
        acc[1] + acc[5],
        acc[2] + acc[6],
        acc[3] + acc[7],
    ];
    (x[0] + x[2]) + (x[1] + x[3])
}

/// gemm's row-major matrix-vector kernel for one row.
#[inline(always)]
fn row_major(a: &[f32], b: &[f32]) -> f32 {
    let k = a.len().min(b.len());
    let (k8, k1) = (k / (8 * L) * (8 * L), k / L * L);
    let mut acc = [[0f32; L]; 8];
    let mut d = 0;
    while d < k8 {
        for (j, acc) in acc.iter_mut().enumerate() {
            for (l, acc) in acc.iter_mut().enumerate() {
                *acc = a[d + j * L + l].mul_add(b[d + j * L + l], *acc);
            }
        }
        d += 8 * L;
    }
    let add = |x: [f32; L], y: [f32; L]| std::array::from_fn::<f32, L, _>(|l| x[l] + y[l]);
    let (a01, a23) = (add(acc[0], acc[1]), add(acc[2], acc[3]));
    let (a45, a67) = (add(acc[4], acc[5]), add(acc[6], acc[7]));
    let mut a0 = add(add(a01, a23), add(a45, a67));
    while d < k1 {
        for (l, acc) in a0.iter_mut().enumerate() {
            *acc = a[d + l].mul_add(b[d + l], *acc);
        }
        d += L;
    }
    let mut r = a0[1..].iter().fold(a0[0], |s, &v| s + v);
    while d < k {
        r = a[d].mul_add(b[d], r);
        d += 1;
    }
    r
}

/// candle's `vec_sum`: four 8-lane accumulators over chunks of 32, their tree, then the rest.
fn vec_sum(x: &[f32]) -> f32 {
    let np = x.len() / (4 * L) * (4 * L);
    let mut acc = [[0f32; L]; 4];
    for c in x[..np].chunks_exact(4 * L) {
        for (j, acc) in acc.iter_mut().enumerate() {
            for (l, acc) in acc.iter_mut().enumerate() {
                *acc += c[j * L + l];
            }
        }
    }
    let s: [f32; L] = std::array::from_fn(|l| (acc[0][l] + acc[1][l]) + (acc[2][l] + acc[3][l]));
    let t = [s[0] + s[4], s[1] + s[5], s[2] + s[6], s[3] + s[7]];
    let mut sum = (t[0] + t[1]) + (t[2] + t[3]);
    for &v in &x[np..] {
        sum += v;
    }
    sum
}

/// `scores[i * n + j] = score(k_j, q_i) * scale` for every head `i` and position `j`.
#[inline(always)]
fn fill_scores(
    score: impl Fn(&[f32], &[f32]) -> f32,
    q: &[f32],
    kv: &KvRows<'_>,
    scale: f32,
    scores: &mut [f32],
) {
    let (hd, stride, n) = (kv.head_dim, kv.stride, kv.positions);
    for j in 0..n {
        let kj = &kv.keys[j * stride..j * stride + hd];
        for (i, qi) in q.chunks_exact(hd).enumerate() {
            scores[i * n + j] = score(kj, qi) * scale;
        }
    }
}

/// Attention for one query position of the `q.len() / head_dim` query heads sharing one KV head,
/// over `kv.positions` cached positions: scaled scores into `scores` (`heads * positions`), a
/// softmax per head, and the weighted sum of values into `out` (`q.len()`), every sum in the
/// order candle's CPU attention uses for one query row (see the module docs), so the bits
/// are candle's on every CPU tier. A typed error names a slice that is too short; nothing is read
/// out of bounds.
pub fn attend(
    q: &[f32],
    kv: &KvRows<'_>,
    scale: f32,
    scores: &mut [f32],
    out: &mut [f32],
) -> Result<()> {
    let (hd, stride, n) = (kv.head_dim, kv.stride, kv.positions);
    if hd == 0 || !q.len().is_multiple_of(hd) || stride < hd {
        return Err(Error::config(
            "attention",
            format!(
                "query of {} values, head size {hd}, stride {stride}",
                q.len()
            ),
        ));
    }
    let heads = q.len() / hd;
    let need = if n == 0 { 0 } else { (n - 1) * stride + hd };
    for (name, len, need) in [
        ("attention keys", kv.keys.len(), need),
        ("attention values", kv.values.len(), need),
        ("attention scores", scores.len(), heads * n),
        ("attention output", out.len(), q.len()),
    ] {
        if len < need {
            return Err(Error::shape(name, &[Some(need)], &[len]));
        }
    }
    if n == 0 {
        out[..q.len()].fill(0.0);
        return Ok(());
    }
    attend_checked(q, kv, scale, scores, out);
    Ok(())
}

/// [`attend`] once the lengths are checked.
fn attend_checked(q: &[f32], kv: &KvRows<'_>, scale: f32, scores: &mut [f32], out: &mut [f32]) {
    let (hd, stride, n) = (kv.head_dim, kv.stride, kv.positions);
    let heads = q.len() / hd;
    if n <= 256 {
        fill_scores(horizontal, q, kv, scale, scores);
    } else {
        fill_scores(row_major, q, kv, scale, scores);
    }
    for s in scores[..heads * n].chunks_exact_mut(n) {
        let max = s.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
        for v in s.iter_mut() {
            *v = (*v - max).exp();
        }
        let sum = vec_sum(s);
        for v in s.iter_mut() {
            *v /= sum;
        }
    }
    let value = |j: usize| &kv.values[j * stride..j * stride + hd];
    for (i, o) in out[..heads * hd].chunks_exact_mut(hd).enumerate() {
        let w = &scores[i * n..(i + 1) * n];
        if n == 2 {
            let (v0, v1) = (value(0), value(1));
            for (d, o) in o.iter_mut().enumerate() {
                *o = w[0] * v0[d] + w[1] * v1[d];
            }
            continue;
        }
        o.fill(0.0);
        for (j, &wj) in w.iter().enumerate() {
            for (o, &v) in o.iter_mut().zip(value(j)) {
                *o = wj.mul_add(v, *o);
            }
        }
    }
}
