//! Quantized rows with their block scales split out: the layout of the sparse FFN's quantized
//! neuron bundles. What skips: whole rows, one neuron's (`Kernels::dot_split_q8` against a Q8
//! input, `Kernels::axpy_split_q8_0` from Q8_0 rows).
//!
//! A row of `nb` GGUF blocks is stored as the blocks' scales (`nb` f16), for Q4_1 then their
//! minimums (`nb` f16), then the blocks' values back to back (16 bytes per Q4 block, low nibbles
//! columns `0..16` and high nibbles `16..32` as GGUF packs them; 32 signed bytes per Q8_0 block).
//! The same bytes as the GGUF row, reordered: vector code loads 16 scales in one instruction and
//! two blocks of values in another, where the GGUF order interleaves 2-4 scale bytes with every
//! 16 value bytes. A neuron's row stays contiguous, so a sparse list reads only its rows.
//!
//! `dot` is `sum_b (sum_j w_bj q_bj) d_w d_x` (+ Q4_1's `m_b s_b`) against a [`QuantizedRow`];
//! `axpy` adds `a * w` of a Q8_0 row into f32 accumulators. The scalar forms are the references;
//! AVX2 and AVX-512 (VNNI) forms differ from them only in float summation order.

use super::blocks::h16;
use super::quant::{QuantKind, QuantizedRow, QK};
use crate::error::{Error, Result};

/// Bytes of the scale planes of a split row of `nb` blocks (where the values start).
pub(crate) const fn scales_bytes(kind: QuantKind, nb: usize) -> usize {
    match kind {
        QuantKind::Q4_1 => 4 * nb,
        _ => 2 * nb,
    }
}

/// Value bytes per block.
const fn value_bytes(kind: QuantKind) -> usize {
    match kind {
        QuantKind::Q8_0 => 32,
        _ => 16,
    }
}

/// Blocks of a split row of `len` bytes.
pub(crate) fn blocks_of(kind: QuantKind, len: usize) -> usize {
    len / kind.block_bytes()
}

/// Rewrites one GGUF row (`nb` blocks of `kind`) into the split layout (`out`, the same length).
/// A row that is not whole blocks, or an `out` of another length, is a typed error naming it.
pub fn split_row(kind: QuantKind, gguf: &[u8], out: &mut [u8]) -> Result<()> {
    let bb = kind.block_bytes();
    if !gguf.len().is_multiple_of(bb) {
        return Err(Error::shape(
            "quantized row (whole blocks)",
            &[Some(gguf.len() / bb * bb)],
            &[gguf.len()],
        ));
    }
    if out.len() != gguf.len() {
        return Err(Error::shape("split row", &[Some(gguf.len())], &[out.len()]));
    }
    let nb = gguf.len() / bb;
    let (sb, vb) = (scales_bytes(kind, nb), value_bytes(kind));
    for (b, blk) in gguf.chunks_exact(bb).enumerate() {
        out[2 * b..2 * b + 2].copy_from_slice(&blk[..2]);
        let vals = if kind == QuantKind::Q4_1 {
            out[2 * nb + 2 * b..2 * nb + 2 * b + 2].copy_from_slice(&blk[2..4]);
            &blk[4..]
        } else {
            &blk[2..]
        };
        out[sb + vb * b..sb + vb * (b + 1)].copy_from_slice(vals);
    }
    Ok(())
}

/// One split row dequantized into `out` (`32 * nb` values; shorter `out` gets a prefix).
pub fn dequantize_split_row(kind: QuantKind, row: &[u8], out: &mut [f32]) {
    let nb = blocks_of(kind, row.len()).min(out.len() / QK);
    let nb_row = blocks_of(kind, row.len());
    let (sb, vb) = (scales_bytes(kind, nb_row), value_bytes(kind));
    for b in 0..nb {
        let d = h16(row, 2 * b);
        let v = &row[sb + vb * b..sb + vb * (b + 1)];
        let o = &mut out[QK * b..QK * (b + 1)];
        match kind {
            QuantKind::Q8_0 => {
                for (o, &q) in o.iter_mut().zip(v) {
                    *o = d * (q as i8) as f32;
                }
            }
            _ => {
                let m = match kind {
                    QuantKind::Q4_1 => h16(row, 2 * nb_row + 2 * b),
                    _ => -8.0 * d,
                };
                for j in 0..16 {
                    o[j] = d * (v[j] & 0xF) as f32 + m;
                    o[j + 16] = d * (v[j] >> 4) as f32 + m;
                }
            }
        }
    }
}

/// `row . x` for a split row (scalar reference). Blocks past the shorter of the two are ignored.
pub(crate) fn dot_scalar(kind: QuantKind, row: &[u8], x: &QuantizedRow) -> f32 {
    let nb_row = blocks_of(kind, row.len());
    let nb = nb_row.min(x.blocks());
    let (sb, vb) = (scales_bytes(kind, nb_row), value_bytes(kind));
    let mut acc = 0f32;
    for b in 0..nb {
        let v = &row[sb + vb * b..sb + vb * (b + 1)];
        let xq = &x.q[QK * b..QK * (b + 1)];
        let d = h16(row, 2 * b);
        let s: i32 = match kind {
            QuantKind::Q8_0 => v
                .iter()
                .zip(xq)
                .map(|(&w, &x)| (w as i8) as i32 * x as i32)
                .sum(),
            _ => (0..16)
                .map(|j| {
                    (v[j] & 0xF) as i32 * xq[j] as i32 + (v[j] >> 4) as i32 * xq[j + 16] as i32
                })
                .sum(),
        };
        acc += match kind {
            QuantKind::Q4_1 => s as f32 * d * x.d[b] + h16(row, 2 * nb_row + 2 * b) * x.s[b],
            QuantKind::Q4_0 => (s - 8 * x.sum[b]) as f32 * d * x.d[b],
            QuantKind::Q8_0 => s as f32 * d * x.d[b],
        };
    }
    acc
}

/// Two rows against the same input (scalar reference).
pub(crate) fn dot2_scalar(kind: QuantKind, rows: [&[u8]; 2], x: &QuantizedRow) -> [f32; 2] {
    rows.map(|r| dot_scalar(kind, r, x))
}

/// `y += a * row` for a split Q8_0 row (scalar reference), over the common length.
pub(crate) fn axpy_scalar(y: &mut [f32], a: f32, row: &[u8]) {
    let nb_row = blocks_of(QuantKind::Q8_0, row.len());
    let nb = nb_row.min(y.len() / QK);
    let sb = scales_bytes(QuantKind::Q8_0, nb_row);
    for b in 0..nb {
        let ad = a * h16(row, 2 * b);
        let v = &row[sb + 32 * b..sb + 32 * (b + 1)];
        for (o, &q) in y[QK * b..QK * (b + 1)].iter_mut().zip(v) {
            *o += ad * (q as i8) as f32;
        }
    }
}

/// Four rows into the same accumulator (scalar reference).
pub(crate) fn axpy4_scalar(y: &mut [f32], a: [f32; 4], rows: [&[u8]; 4]) {
    for (a, r) in a.into_iter().zip(rows) {
        axpy_scalar(y, a, r);
    }
}

#[cfg(target_arch = "x86_64")]
pub(crate) mod x86 {
    //! AVX2 and AVX-512 (F, BW, VNNI) forms. Each clamps to the blocks both operands hold.
    use std::arch::x86_64::*;

    use super::{blocks_of, h16, scales_bytes, value_bytes};
    use crate::cpu::quant::{QuantKind, QuantizedRow, QK};

    /// Split Q8_0 rows added into `y_len` accumulators: the blocks all of them cover, and where
    /// each row's values start.
    fn q8_rows<const N: usize>(rows: &[&[u8]; N], y_len: usize) -> (usize, [usize; N]) {
        let q8 = QuantKind::Q8_0;
        let nb = rows
            .iter()
            .map(|r| blocks_of(q8, r.len()))
            .fold(y_len / QK, usize::min);
        (nb, rows.map(|r| scales_bytes(q8, blocks_of(q8, r.len()))))
    }

    /// # Safety
    /// The CPU must have AVX-512F, AVX-512BW, AVX-512VL and AVX-512 VNNI.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
    pub(crate) unsafe fn dot_vnni(kind: QuantKind, row: &[u8], x: &QuantizedRow) -> f32 {
        // SAFETY: forwarded contract.
        unsafe {
            match kind.index() {
                0 => dot_vnni_n::<0, 1>([row], x)[0],
                1 => dot_vnni_n::<1, 1>([row], x)[0],
                _ => dot_vnni_n::<2, 1>([row], x)[0],
            }
        }
    }

    /// Two rows (a neuron's gate and up) against the same input: the input is loaded once.
    ///
    /// # Safety
    /// The CPU must have AVX-512F, AVX-512BW, AVX-512VL and AVX-512 VNNI.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
    pub(crate) unsafe fn dot2_vnni(
        kind: QuantKind,
        rows: [&[u8]; 2],
        x: &QuantizedRow,
    ) -> [f32; 2] {
        // SAFETY: forwarded contract.
        unsafe {
            match kind.index() {
                0 => dot_vnni_n::<0, 2>(rows, x),
                1 => dot_vnni_n::<1, 2>(rows, x),
                _ => dot_vnni_n::<2, 2>(rows, x),
            }
        }
    }

    #[inline(always)]
    unsafe fn dot_vnni_n<const K: usize, const N: usize>(
        rows: [&[u8]; N],
        x: &QuantizedRow,
    ) -> [f32; N] {
        let kind = QuantKind::ALL[K];
        let nb_row = rows.map(|r| blocks_of(kind, r.len()));
        let nb = nb_row.iter().fold(
            x.blocks().min(x.q.len() / QK).min(x.q4.len() / 32),
            |m, &n| m.min(n),
        );
        let vb = value_bytes(kind);
        let sb: [usize; N] = std::array::from_fn(|r| scales_bytes(kind, nb_row[r]));
        let p = rows.map(|r| r.as_ptr());
        // SAFETY: every read below is of blocks `< nb`, inside each row (`nb_row` blocks) and the
        // input (`nb` blocks of 32 values, scales and sums; `q4` is padded to whole groups of 4
        // blocks, 128 bytes each, and read a whole group at a time from a group's first block);
        // masked loads touch only those lanes. The caller guarantees the CPU features.
        unsafe {
            let nib = _mm512_set1_epi8(0x0F);
            let half = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
            let quarter = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
            let mut acc = [_mm512_setzero_ps(); N];
            let mut extra = [_mm512_setzero_ps(); N];
            let mut c = 0;
            while c < nb {
                let n = (nb - c).min(16);
                let mask: __mmask16 = if n == 16 { 0xFFFF } else { (1u16 << n) - 1 };
                let dx = _mm512_maskz_loadu_ps(mask, x.d.as_ptr().add(c));
                let sx = if K == 1 {
                    _mm512_maskz_loadu_ps(mask, x.s.as_ptr().add(c))
                } else {
                    _mm512_cvtepi32_ps(_mm512_maskz_loadu_epi32(mask, x.sum.as_ptr().add(c)))
                };
                let s16: [__m512; N] = std::array::from_fn(|r| {
                    let dw =
                        _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, p[r].add(2 * c).cast()));
                    _mm512_mul_ps(dw, dx)
                });
                for r in 0..N {
                    if K == 1 {
                        let m = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(
                            mask,
                            p[r].add(2 * nb_row[r] + 2 * c).cast(),
                        ));
                        extra[r] = _mm512_fmadd_ps(m, sx, extra[r]);
                    } else if K == 0 {
                        extra[r] = _mm512_fmadd_ps(s16[r], sx, extra[r]);
                    }
                }
                if K != 2 {
                    // 4-bit rows: four blocks per step. One 64-byte load holds their values; its
                    // low nibbles meet the blocks' first 16 inputs and its high nibbles their last
                    // 16 (`x.q4` holds the inputs in that order), so int32 lane `l` sums block
                    // `l / 4` only and no shuffle of the weights is needed.
                    let mut j = 0;
                    while j < n {
                        let m = (n - j).min(4);
                        let b = c + j;
                        let xq = x.q4.as_ptr().add(32 * b);
                        let (xl, xh) = (
                            _mm512_loadu_si512(xq.cast()),
                            _mm512_loadu_si512(xq.add(64).cast()),
                        );
                        let lanes: __mmask64 = if m == 4 { !0 } else { (1u64 << (16 * m)) - 1 };
                        let idx = _mm512_add_epi32(quarter, _mm512_set1_epi32(j as i32));
                        for r in 0..N {
                            let v = _mm512_maskz_loadu_epi8(lanes, p[r].add(sb[r] + 16 * b).cast());
                            let lo = _mm512_and_si512(v, nib);
                            let hi = _mm512_and_si512(_mm512_srli_epi16::<4>(v), nib);
                            let i = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, xl);
                            let i = _mm512_dpbusd_epi32(i, hi, xh);
                            let sc = _mm512_permutexvar_ps(idx, s16[r]);
                            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i), sc, acc[r]);
                        }
                        j += 4;
                    }
                    c += n;
                    continue;
                }
                // Q8_0 rows: two blocks per step, signs moved onto the input (`vpdpbusd` takes
                // unsigned weights).
                let mut j = 0;
                while j < n {
                    let two = j + 2 <= n;
                    let b = c + j;
                    let xv = if two {
                        _mm512_loadu_si512(x.q.as_ptr().add(QK * b).cast())
                    } else {
                        _mm512_maskz_loadu_epi8(0xFFFF_FFFF, x.q.as_ptr().add(QK * b).cast())
                    };
                    let idx = _mm512_add_epi32(half, _mm512_set1_epi32(j as i32));
                    for r in 0..N {
                        let v = p[r].add(sb[r] + vb * b);
                        let w = if two {
                            _mm512_loadu_si512(v.cast())
                        } else {
                            _mm512_maskz_loadu_epi8(0xFFFF_FFFF, v.cast())
                        };
                        let neg = _mm512_movepi8_mask(w);
                        let xs = _mm512_mask_sub_epi8(xv, neg, _mm512_setzero_si512(), xv);
                        let prod =
                            _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_abs_epi8(w), xs);
                        let sc = _mm512_permutexvar_ps(idx, s16[r]);
                        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(prod), sc, acc[r]);
                    }
                    j += 2;
                }
                c += n;
            }
            // One horizontal sum per row: the min (Q4_1) or `- 8 sum` (Q4_0) terms folded in.
            std::array::from_fn(|r| {
                _mm512_reduce_add_ps(match K {
                    1 => _mm512_add_ps(acc[r], extra[r]),
                    0 => _mm512_fmadd_ps(extra[r], _mm512_set1_ps(-8.0), acc[r]),
                    _ => acc[r],
                })
            })
        }
    }

    /// # Safety
    /// The CPU must have AVX-512F, AVX-512BW and AVX-512VL.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    pub(crate) unsafe fn axpy4_avx512(y: &mut [f32], a: [f32; 4], rows: [&[u8]; 4]) {
        let (nb, sbs) = q8_rows(&rows, y.len());
        let ps = rows.map(|r| r.as_ptr());
        let yp = y.as_mut_ptr();
        // SAFETY: blocks `< nb` lie inside every row (values after its scale plane) and `y`.
        unsafe {
            let mut c = 0;
            while c < nb {
                let n = (nb - c).min(16);
                let mask: __mmask16 = if n == 16 { 0xFFFF } else { (1u16 << n) - 1 };
                let s: [__m512; 4] = std::array::from_fn(|k| {
                    let d =
                        _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, ps[k].add(2 * c).cast()));
                    _mm512_mul_ps(d, _mm512_set1_ps(a[k]))
                });
                for j in 0..n {
                    let b = c + j;
                    let idx = _mm512_set1_epi32(j as i32);
                    let (mut y0, mut y1) = (
                        _mm512_loadu_ps(yp.add(QK * b)),
                        _mm512_loadu_ps(yp.add(QK * b + 16)),
                    );
                    for k in 0..4 {
                        let v = ps[k].add(sbs[k] + 32 * b);
                        let sc = _mm512_permutexvar_ps(idx, s[k]);
                        let q0 =
                            _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(v.cast())));
                        let q1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(
                            v.add(16).cast(),
                        )));
                        y0 = _mm512_fmadd_ps(q0, sc, y0);
                        y1 = _mm512_fmadd_ps(q1, sc, y1);
                    }
                    _mm512_storeu_ps(yp.add(QK * b), y0);
                    _mm512_storeu_ps(yp.add(QK * b + 16), y1);
                }
                c += n;
            }
        }
    }

    /// # Safety
    /// The CPU must have AVX-512F, AVX-512BW and AVX-512VL.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    pub(crate) unsafe fn axpy_avx512(y: &mut [f32], a: f32, row: &[u8]) {
        let (nb, [sb]) = q8_rows(&[row], y.len());
        let (p, yp) = (row.as_ptr(), y.as_mut_ptr());
        // SAFETY: blocks `< nb` lie inside the row and `y`.
        unsafe {
            let mut c = 0;
            while c < nb {
                let n = (nb - c).min(16);
                let mask: __mmask16 = if n == 16 { 0xFFFF } else { (1u16 << n) - 1 };
                let d = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, p.add(2 * c).cast()));
                let s = _mm512_mul_ps(d, _mm512_set1_ps(a));
                for j in 0..n {
                    let b = c + j;
                    let v = p.add(sb + 32 * b);
                    let sc = _mm512_permutexvar_ps(_mm512_set1_epi32(j as i32), s);
                    let q0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(v.cast())));
                    let q1 =
                        _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(v.add(16).cast())));
                    let y0 = _mm512_fmadd_ps(q0, sc, _mm512_loadu_ps(yp.add(QK * b)));
                    let y1 = _mm512_fmadd_ps(q1, sc, _mm512_loadu_ps(yp.add(QK * b + 16)));
                    _mm512_storeu_ps(yp.add(QK * b), y0);
                    _mm512_storeu_ps(yp.add(QK * b + 16), y1);
                }
                c += n;
            }
        }
    }

    /// # Safety
    /// The CPU must have AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    pub(crate) unsafe fn dot_avx2(kind: QuantKind, row: &[u8], x: &QuantizedRow) -> f32 {
        // SAFETY: forwarded contract.
        unsafe {
            match kind.index() {
                0 => dot_avx2_k::<0>(row, x),
                1 => dot_avx2_k::<1>(row, x),
                _ => dot_avx2_k::<2>(row, x),
            }
        }
    }

    #[target_feature(enable = "avx2,fma")]
    unsafe fn dot_avx2_k<const K: usize>(row: &[u8], x: &QuantizedRow) -> f32 {
        let kind = QuantKind::ALL[K];
        let nb_row = blocks_of(kind, row.len());
        let nb = nb_row.min(x.blocks()).min(x.q.len() / QK);
        let (sb, vb) = (scales_bytes(kind, nb_row), value_bytes(kind));
        let p = row.as_ptr();
        let mut extra = 0f32;
        // SAFETY: blocks `< nb` lie inside the row and the input.
        unsafe {
            let nib = _mm_set1_epi8(0x0F);
            let ones = _mm256_set1_epi16(1);
            let (mut a0, mut a1) = (_mm256_setzero_ps(), _mm256_setzero_ps());
            for b in 0..nb {
                let d = h16(row, 2 * b) * x.d[b];
                let xv = _mm256_loadu_si256(x.q.as_ptr().add(QK * b).cast());
                let v = p.add(sb + vb * b);
                let prod = if K == 2 {
                    let w = _mm256_loadu_si256(v.cast());
                    _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(xv, w))
                } else {
                    let q = _mm_loadu_si128(v.cast());
                    let lo = _mm_and_si128(q, nib);
                    let hi = _mm_and_si128(_mm_srli_epi16::<4>(q), nib);
                    _mm256_maddubs_epi16(_mm256_set_m128i(hi, lo), xv)
                };
                let f = _mm256_cvtepi32_ps(_mm256_madd_epi16(prod, ones));
                if b % 2 == 0 {
                    a0 = _mm256_fmadd_ps(f, _mm256_set1_ps(d), a0);
                } else {
                    a1 = _mm256_fmadd_ps(f, _mm256_set1_ps(d), a1);
                }
                match K {
                    1 => extra += h16(row, 2 * nb_row + 2 * b) * x.s[b],
                    0 => extra -= 8.0 * d * x.sum[b] as f32,
                    _ => {}
                }
            }
            let acc = _mm256_add_ps(a0, a1);
            let s = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps::<1>(acc));
            let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
            let s = _mm_add_ss(s, _mm_shuffle_ps::<0b01>(s, s));
            _mm_cvtss_f32(s) + extra
        }
    }

    /// # Safety
    /// The CPU must have AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    pub(crate) unsafe fn axpy4_avx2(y: &mut [f32], a: [f32; 4], rows: [&[u8]; 4]) {
        let (nb, sbs) = q8_rows(&rows, y.len());
        let yp = y.as_mut_ptr();
        // SAFETY: blocks `< nb` lie inside every row and `y`.
        unsafe {
            for b in 0..nb {
                let s: [__m256; 4] =
                    std::array::from_fn(|k| _mm256_set1_ps(a[k] * h16(rows[k], 2 * b)));
                for part in 0..4 {
                    let o = QK * b + 8 * part;
                    let mut acc = _mm256_loadu_ps(yp.add(o));
                    for k in 0..4 {
                        let v = rows[k].as_ptr().add(sbs[k] + 32 * b + 8 * part);
                        let q = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(v.cast())));
                        acc = _mm256_fmadd_ps(q, s[k], acc);
                    }
                    _mm256_storeu_ps(yp.add(o), acc);
                }
            }
        }
    }

    /// # Safety
    /// The CPU must have AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    pub(crate) unsafe fn axpy_avx2(y: &mut [f32], a: f32, row: &[u8]) {
        let (nb, [sb]) = q8_rows(&[row], y.len());
        let yp = y.as_mut_ptr();
        // SAFETY: blocks `< nb` lie inside the row and `y`.
        unsafe {
            for b in 0..nb {
                let s = _mm256_set1_ps(a * h16(row, 2 * b));
                for part in 0..4 {
                    let o = QK * b + 8 * part;
                    let v = row.as_ptr().add(sb + 32 * b + 8 * part);
                    let q = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(v.cast())));
                    _mm256_storeu_ps(yp.add(o), _mm256_fmadd_ps(q, s, _mm256_loadu_ps(yp.add(o))));
                }
            }
        }
    }
}
