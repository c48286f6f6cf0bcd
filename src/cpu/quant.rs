//! GGUF block quantizations (Q4_0, Q4_1, Q8_0) for sparse rows: integer dot products of a row as
//! the file stores it against an input quantized once per token to 8 bits (as llama.cpp does;
//! `Kernels::dot_gguf_q8`), and `axpy` from Q8_0 rows (`Kernels::axpy_q8_0`). What skips: whole
//! rows, the ones a caller does not ask for.
//!
//! Block layouts are ggml's, 32 weights per block: Q4_0 `{d: f16, qs: [u8; 16]}` (value
//! `d * (q - 8)`), Q4_1 `{d: f16, m: f16, qs: [u8; 16]}` (value `d * q + m`), Q8_0
//! `{d: f16, qs: [i8; 32]}` (value `d * q`); weight `j < 16` is the low nibble of `qs[j]`, weight
//! `j + 16` the high nibble. Scalar kernels are the reference; AVX2 kernels are used when detected.
//!
//! Also the input side of every product: [`QuantizedRow`] holds a row quantized as ggml's
//! `block_q8_0`/`block_q8_1` (32 values) and, for the K-quants, as `block_q8_K` (`Q8K`, 256
//! values); [`Inputs`] says which forms a block type reads.

use half::f16;

/// Weights per block.
pub const QK: usize = 32;

/// Weights per K-quant super-block.
pub const QK_K: usize = 256;

/// How a block type wants its input quantized.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Inputs {
    /// 32-value blocks (ggml's Q8_0 / Q8_1: [`QuantizedRow::quantize`]).
    pub blocks32: bool,
    /// 256-value super-blocks (ggml's Q8_K), for the K-quants.
    pub k: bool,
}

impl Inputs {
    /// Both needs.
    pub fn union(self, o: Inputs) -> Inputs {
        Inputs {
            blocks32: self.blocks32 || o.blocks32,
            k: self.k || o.k,
        }
    }
}

/// A GGUF block type of sparse rows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum QuantKind {
    /// 4-bit, symmetric, 18 bytes per 32 weights.
    Q4_0,
    /// 4-bit with minimum, 20 bytes per 32 weights.
    Q4_1,
    /// 8-bit, 34 bytes per 32 weights.
    Q8_0,
}

impl QuantKind {
    /// Every block type, in the order of [`QuantKind::index`] (kernels monomorphize on it).
    pub(crate) const ALL: [QuantKind; 3] = [QuantKind::Q4_0, QuantKind::Q4_1, QuantKind::Q8_0];

    /// This block type's position in [`QuantKind::ALL`].
    pub(crate) const fn index(self) -> usize {
        match self {
            QuantKind::Q4_0 => 0,
            QuantKind::Q4_1 => 1,
            QuantKind::Q8_0 => 2,
        }
    }

    /// Bytes of one 32-weight block.
    pub fn block_bytes(self) -> usize {
        match self {
            QuantKind::Q4_0 => 18,
            QuantKind::Q4_1 => 20,
            QuantKind::Q8_0 => 34,
        }
    }

    /// Bytes of a row of `n` weights (`n` a multiple of 32).
    pub fn row_bytes(self, n: usize) -> usize {
        n / QK * self.block_bytes()
    }
}

/// One row of activations quantized to 8 bits per 32-value block, exactly as ggml (and candle's
/// quantized matmul) quantize a row to Q8_0 / Q8_1: `d = amax / 127` rounded to f16, `q =
/// round(x * 127 / amax)`, so the integer products our kernels form are the ones llama.cpp and
/// candle form. `x ~= d[b] * q[32 b + j]`; `sum[b]` is the block's `sum_j q`, and `s[b]` Q8_1's
/// rounded `d * sum` (candle: `f16(f16(sum) * d)`) used by Q4_1's min term.
#[derive(Debug, Clone, Default)]
pub struct QuantizedRow {
    pub(crate) d: Vec<f32>,
    pub(crate) sum: Vec<i32>,
    pub(crate) s: Vec<f32>,
    pub(crate) q: Vec<i8>,
    /// The values regrouped for 4-bit rows in the split layout: per group of 4 blocks, the first
    /// 16 values of each block, then their last 16 (128 bytes, zero past the last block).
    pub(crate) q4: Vec<i8>,
    /// The row as ggml's Q8_K (256-value super-blocks), for the K-quants; empty unless asked
    /// for ([`QuantizedRow::quantize_for`]).
    pub(crate) k: Q8K,
}

impl QuantizedRow {
    /// Quantizes `x` (length a multiple of 32) into this row, reusing its buffers.
    /// Any Q8_K form from an earlier [`QuantizedRow::quantize_for`] is dropped, so a K-quant
    /// product refuses this row instead of reading another input's values.
    pub fn quantize(&mut self, x: &[f32]) {
        self.k.clear();
        self.quantize_values(x);
        let nb = x.len() / QK;
        self.q4.clear();
        self.q4.resize(nb.div_ceil(4) * 128, 0);
        for (b, blk) in self.q.chunks_exact(QK).enumerate() {
            let (g, j) = (b / 4, b % 4);
            self.q4[g * 128 + 16 * j..][..16].copy_from_slice(&blk[..16]);
            self.q4[g * 128 + 64 + 16 * j..][..16].copy_from_slice(&blk[16..]);
        }
    }

    /// Quantizes `x` in the forms `inputs` asks for (32-value blocks as [`QuantizedRow::quantize`],
    /// 256-value super-blocks as ggml's Q8_K), reusing the buffers; a form not asked for is left
    /// empty.
    pub fn quantize_for(&mut self, x: &[f32], inputs: Inputs) {
        if inputs.blocks32 {
            self.quantize(x);
        } else {
            self.clear32();
        }
        if inputs.k {
            self.k.quantize(x);
        } else {
            self.k.clear();
        }
    }

    fn clear32(&mut self) {
        self.d.clear();
        self.sum.clear();
        self.s.clear();
        self.q.clear();
        self.q4.clear();
    }

    /// [`QuantizedRow::quantize_for`] over rows of `width` values, as
    /// [`QuantizedRow::quantize_rows`].
    pub fn quantize_rows_for<'a>(
        rows: &'a mut Vec<QuantizedRow>,
        x: &[f32],
        width: usize,
        inputs: Inputs,
    ) -> &'a [QuantizedRow] {
        let n = x.len().checked_div(width).unwrap_or(0);
        if rows.len() < n {
            rows.resize_with(n, Default::default);
        }
        for (q, xr) in rows.iter_mut().zip(x.chunks_exact(width.max(1))) {
            q.quantize_for(xr, inputs);
        }
        &rows[..n]
    }

    /// [`QuantizedRow::quantize`] without the regrouped copy for 4-bit split rows (`q4`, left
    /// empty): all that column products read.
    pub(crate) fn quantize_values(&mut self, x: &[f32]) {
        self.q4.clear();
        let nb = x.len() / QK;
        self.d.resize(nb, 0.0);
        self.sum.resize(nb, 0);
        self.s.resize(nb, 0.0);
        self.q.resize(nb * QK, 0);
        for (b, blk) in x.chunks_exact(QK).enumerate() {
            let amax = blk.iter().fold(0f32, |m, v| m.max(v.abs()));
            let d = amax / 127.0;
            let id = if d != 0.0 { 1.0 / d } else { 0.0 };
            let mut sum = 0i32;
            for (q, &v) in self.q[b * QK..(b + 1) * QK].iter_mut().zip(blk) {
                *q = (v * id).round() as i8;
                sum += *q as i32;
            }
            let d16 = f16::from_f32(d);
            self.d[b] = d16.to_f32();
            self.sum[b] = sum;
            self.s[b] = (f16::from_f32(sum as f32) * d16).to_f32();
        }
    }

    /// Quantizes `x`, rows of `width` values, into `rows` (grown as needed, buffers reused: no
    /// allocation once a batch this large has been seen) and returns the quantized rows.
    pub fn quantize_rows<'a>(
        rows: &'a mut Vec<QuantizedRow>,
        x: &[f32],
        width: usize,
    ) -> &'a [QuantizedRow] {
        let blocks32 = Inputs {
            blocks32: true,
            k: false,
        };
        Self::quantize_rows_for(rows, x, width, blocks32)
    }

    /// The values the integer kernels see: `out[j] = d[j / 32] * q[j]`.
    pub fn dequantize(&self, out: &mut [f32]) {
        for (j, (o, &q)) in out.iter_mut().zip(&self.q).enumerate() {
            *o = self.d[j / QK] * q as f32;
        }
    }

    /// The values the K-quant kernels see (after [`QuantizedRow::quantize_for`] with
    /// `inputs.k`): `out[j] = d_k[j / 256] * q_k[j]`.
    pub fn dequantize_k(&self, out: &mut [f32]) {
        for (j, (o, &q)) in out.iter_mut().zip(&self.k.q).enumerate() {
            *o = self.k.d[j / QK_K] * q as f32;
        }
    }

    /// Blocks in the row.
    pub fn blocks(&self) -> usize {
        self.d.len()
    }

    /// The 8-bit values, 32 per block.
    pub fn values(&self) -> &[i8] {
        &self.q
    }

    /// Per block: the scale `d` (an f16 value), `sum(q)`, and Q8_1's rounded `s`.
    pub fn block(&self, b: usize) -> Option<(f32, i32, f32)> {
        Some((*self.d.get(b)?, *self.sum.get(b)?, *self.s.get(b)?))
    }
}

fn f16_at(b: &[u8], at: usize) -> f32 {
    f16::from_le_bytes([b[at], b[at + 1]]).to_f32()
}

/// Writes `src` (length a multiple of 32) as Q8_0 blocks into `dst` (ggml's rounding).
pub fn quantize_row_q8_0(src: &[f32], dst: &mut [u8]) {
    for (blk, out) in src.chunks_exact(QK).zip(dst.chunks_exact_mut(34)) {
        let amax = blk.iter().fold(0f32, |m, v| m.max(v.abs()));
        let d = amax / 127.0;
        let id = if d > 0.0 { 1.0 / d } else { 0.0 };
        out[..2].copy_from_slice(&f16::from_f32(d).to_le_bytes());
        for (o, &v) in out[2..].iter_mut().zip(blk) {
            *o = ((v * id).round() as i8) as u8;
        }
    }
}

/// Dequantizes one row of `kind` blocks into `dst` (the reference for tests).
pub fn dequantize_row(kind: QuantKind, src: &[u8], dst: &mut [f32]) {
    for (b, out) in src
        .chunks_exact(kind.block_bytes())
        .zip(dst.chunks_exact_mut(QK))
    {
        match kind {
            QuantKind::Q4_0 | QuantKind::Q4_1 => {
                let d = f16_at(b, 0);
                let (m, qs) = match kind {
                    QuantKind::Q4_1 => (f16_at(b, 2), &b[4..20]),
                    _ => (-8.0 * d, &b[2..18]),
                };
                for j in 0..16 {
                    out[j] = d * (qs[j] & 0xF) as f32 + m;
                    out[j + 16] = d * (qs[j] >> 4) as f32 + m;
                }
            }
            QuantKind::Q8_0 => {
                let d = f16_at(b, 0);
                for j in 0..QK {
                    out[j] = d * (b[2 + j] as i8) as f32;
                }
            }
        }
    }
}

/// `w . x` for a quantized row against a quantized input (scalar reference). Per block, the
/// integer sum is exact and the scaling is ggml's: Q4_0 `d_w d_x sum (q - 8) x`, Q4_1
/// `(sum q x) d_w d_x + m s`, Q8_0 `d_w d_x sum q x`.
pub fn dot_scalar(kind: QuantKind, w: &[u8], x: &QuantizedRow) -> f32 {
    let bb = kind.block_bytes();
    let mut acc = 0f32;
    for (i, b) in w.chunks_exact(bb).take(x.blocks()).enumerate() {
        let xq = &x.q[i * QK..(i + 1) * QK];
        let d = f16_at(b, 0);
        acc += match kind {
            QuantKind::Q4_0 | QuantKind::Q4_1 => {
                let qs = if kind == QuantKind::Q4_1 {
                    &b[4..20]
                } else {
                    &b[2..18]
                };
                let mut s = 0i32;
                for j in 0..16 {
                    s += (qs[j] & 0xF) as i32 * xq[j] as i32
                        + (qs[j] >> 4) as i32 * xq[j + 16] as i32;
                }
                if kind == QuantKind::Q4_1 {
                    s as f32 * d * x.d[i] + f16_at(b, 2) * x.s[i]
                } else {
                    (s - 8 * x.sum[i]) as f32 * d * x.d[i]
                }
            }
            QuantKind::Q8_0 => {
                let s: i32 = (0..QK)
                    .map(|j| (b[2 + j] as i8) as i32 * xq[j] as i32)
                    .sum();
                s as f32 * d * x.d[i]
            }
        };
    }
    acc
}

/// `y += a * w` for a Q8_0 row (scalar reference).
pub fn axpy_q8_0_scalar(y: &mut [f32], a: f32, w: &[u8]) {
    for (b, out) in w.chunks_exact(34).zip(y.chunks_exact_mut(QK)) {
        let ad = a * f16_at(b, 0);
        for j in 0..QK {
            out[j] += ad * (b[2 + j] as i8) as f32;
        }
    }
}

#[cfg(target_arch = "x86_64")]
pub(crate) mod avx2 {
    //! AVX2 forms of the quantized kernels.
    use std::arch::x86_64::*;

    use super::{f16_at, QuantKind, QuantizedRow, QK};

    /// # Safety
    /// The CPU must have AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    pub(crate) unsafe fn dot(kind: QuantKind, w: &[u8], x: &QuantizedRow) -> f32 {
        // SAFETY: forwarded contract; one monomorphic loop per block type.
        unsafe {
            match kind {
                QuantKind::Q4_0 => dot_kind::<0>(w, x),
                QuantKind::Q4_1 => dot_kind::<1>(w, x),
                QuantKind::Q8_0 => dot_kind::<2>(w, x),
            }
        }
    }

    /// Integer products of one block (`K`: 0 Q4_0, 1 Q4_1, 2 Q8_0) as 8 i32 lanes in f32.
    #[inline(always)]
    unsafe fn block<const K: usize>(b: *const u8, xq: *const i8) -> __m256 {
        // SAFETY: the caller guarantees a whole block at `b` and 32 values at `xq`.
        unsafe {
            let xv = _mm256_loadu_si256(xq.cast());
            let prod = if K == 2 {
                let wv = _mm256_loadu_si256(b.add(2).cast());
                _mm256_maddubs_epi16(_mm256_sign_epi8(wv, wv), _mm256_sign_epi8(xv, wv))
            } else {
                let qs = _mm_loadu_si128(b.add(if K == 1 { 4 } else { 2 }).cast());
                let low = _mm_set1_epi8(0x0F);
                let lo = _mm_and_si128(qs, low);
                let hi = _mm_and_si128(_mm_srli_epi16::<4>(qs), low);
                _mm256_maddubs_epi16(_mm256_set_m128i(hi, lo), xv)
            };
            _mm256_cvtepi32_ps(_mm256_madd_epi16(prod, _mm256_set1_epi16(1)))
        }
    }

    #[target_feature(enable = "avx2,fma")]
    unsafe fn dot_kind<const K: usize>(w: &[u8], x: &QuantizedRow) -> f32 {
        let bb = [18, 20, 34][K];
        let nb = (w.len() / bb).min(x.blocks()).min(x.q.len() / QK);
        let (wp, xp) = (w.as_ptr(), x.q.as_ptr());
        let mut off = 0f32;
        // SAFETY: blocks `i < nb` lie inside `w` (bb bytes each) and `x.q` (32 each).
        unsafe {
            let (mut a0, mut a1) = (_mm256_setzero_ps(), _mm256_setzero_ps());
            let mut i = 0;
            while i + 2 <= nb {
                let (d0, d1) = (f16_at(w, i * bb), f16_at(w, (i + 1) * bb));
                let p0 = block::<K>(wp.add(i * bb), xp.add(i * QK));
                let p1 = block::<K>(wp.add((i + 1) * bb), xp.add((i + 1) * QK));
                a0 = _mm256_fmadd_ps(p0, _mm256_set1_ps(d0 * x.d[i]), a0);
                a1 = _mm256_fmadd_ps(p1, _mm256_set1_ps(d1 * x.d[i + 1]), a1);
                if K == 1 {
                    off +=
                        f16_at(w, i * bb + 2) * x.s[i] + f16_at(w, (i + 1) * bb + 2) * x.s[i + 1];
                } else if K == 0 {
                    off -= 8.0
                        * (d0 * x.d[i] * x.sum[i] as f32 + d1 * x.d[i + 1] * x.sum[i + 1] as f32);
                }
                i += 2;
            }
            if i < nb {
                let d0 = f16_at(w, i * bb);
                let p0 = block::<K>(wp.add(i * bb), xp.add(i * QK));
                a0 = _mm256_fmadd_ps(p0, _mm256_set1_ps(d0 * x.d[i]), a0);
                if K == 1 {
                    off += f16_at(w, i * bb + 2) * x.s[i];
                } else if K == 0 {
                    off -= 8.0 * d0 * x.d[i] * x.sum[i] as f32;
                }
            }
            let acc = _mm256_add_ps(a0, a1);
            let s = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps::<1>(acc));
            let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
            let s = _mm_add_ss(s, _mm_shuffle_ps::<0b01>(s, s));
            _mm_cvtss_f32(s) + off
        }
    }

    /// # Safety
    /// The CPU must have AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    pub(crate) unsafe fn axpy_q8_0(y: &mut [f32], a: f32, w: &[u8]) {
        let nb = (w.len() / 34).min(y.len() / QK);
        // SAFETY: block `i < nb` reads 34 bytes of `w` and writes 32 floats of `y`, both in bounds.
        unsafe {
            for i in 0..nb {
                let b = w.as_ptr().add(i * 34 + 2);
                let ad = _mm256_set1_ps(a * f16_at(w, i * 34));
                let yp = y.as_mut_ptr().add(i * QK);
                for k in 0..4 {
                    let q = _mm_loadl_epi64(b.add(8 * k).cast());
                    let wf = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q));
                    let yv = _mm256_loadu_ps(yp.add(8 * k));
                    _mm256_storeu_ps(yp.add(8 * k), _mm256_fmadd_ps(ad, wf, yv));
                }
            }
        }
    }
}

/// A row quantized as ggml's `quantize_row_q8_K` does: per 256 values `d = max / -127` (the
/// signed value of largest magnitude, f32), `q = nearest_int(x / d)` (ties to even) capped at
/// 127, and the sums of each 16 values.
#[derive(Debug, Clone, Default)]
pub(crate) struct Q8K {
    pub(crate) d: Vec<f32>,
    pub(crate) q: Vec<i8>,
    pub(crate) bsum: Vec<i16>,
}

impl Q8K {
    /// Quantizes the whole super-blocks of `x`, reusing the buffers.
    pub(crate) fn quantize(&mut self, x: &[f32]) {
        let nb = x.len() / QK_K;
        self.d.resize(nb, 0.0);
        self.q.resize(nb * QK_K, 0);
        self.bsum.resize(nb * QK_K / 16, 0);
        for (b, blk) in x.chunks_exact(QK_K).enumerate() {
            let (mut amax, mut max) = (0f32, 0f32);
            for &v in blk {
                if v.abs() > amax {
                    amax = v.abs();
                    max = v;
                }
            }
            let q = &mut self.q[b * QK_K..(b + 1) * QK_K];
            if amax == 0.0 {
                self.d[b] = 0.0;
                q.fill(0);
            } else {
                let iscale = -127.0 / max;
                for (q, &v) in q.iter_mut().zip(blk) {
                    *q = (iscale * v).round_ties_even().clamp(-128.0, 127.0) as i8;
                }
                self.d[b] = 1.0 / iscale;
            }
            for (s, q16) in self.bsum[b * 16..(b + 1) * 16]
                .iter_mut()
                .zip(q.chunks_exact(16))
            {
                *s = q16.iter().map(|&v| v as i16).sum();
            }
        }
    }

    /// Holds nothing (the row was not quantized in this form).
    pub(crate) fn clear(&mut self) {
        self.d.clear();
        self.q.clear();
        self.bsum.clear();
    }

    /// Super-blocks held.
    pub(crate) fn blocks(&self) -> usize {
        self.d.len()
    }
}
