//! AVX-512 VNNI and AVX2 forms of [`super::gemm`] for Q4_0, Q4_1 and Q8_0. Callers guarantee (see `super::gemm`):
//! `groups` lies inside the matrix, every input row has at least the matrix's blocks, and
//! `out` holds `groups.len() * xs.len() * 16` values.
use std::arch::x86_64::*;
use std::ops::Range;

use super::prefetch::prefetch_record;
use super::{record_bytes, scale_bytes, PackedRows, PACK};
use crate::cpu::blocks::BlockKind;
use crate::cpu::quant::{QuantizedRow, QK};

/// # Safety
/// The CPU must have AVX-512F, AVX-512BW, AVX-512VL and AVX-512 VNNI; the arguments must satisfy the
/// module's contract.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
pub(crate) unsafe fn gemm_vnni(
    p: &PackedRows,
    groups: Range<usize>,
    xs: &[QuantizedRow],
    out: &mut [f32],
) {
    // SAFETY: forwarded contract; one monomorphic kernel per block type.
    unsafe {
        match p.kind() {
            BlockKind::Q4_0 => vnni::<0>(p, groups, xs, out),
            BlockKind::Q4_1 => vnni::<1>(p, groups, xs, out),
            BlockKind::Q8_0 => vnni::<2>(p, groups, xs, out),
            BlockKind::Q5_0 => vnni::<3>(p, groups, xs, out),
            BlockKind::Q5_1 => vnni::<4>(p, groups, xs, out),
            _ => super::x86_more::gemm_vnni(p, groups, xs, out),
        }
    }
}

/// Per lane (a row's u32 of Q5 high bits in each 32-bit lane of `qh`), byte `m` of the lane
/// set where bit `m` (`odd`: bit `4 + m`) of the lane's byte `byte` is set: the fifth bits of
/// four consecutive weights, as a byte mask.
#[inline(always)]
unsafe fn fifth_bits(qh: __m512i, byte: i8, odd: bool) -> __mmask64 {
    // SAFETY: AVX-512F/BW are enabled in every caller.
    unsafe {
        let lanes = _mm512_set4_epi32(0x0C0C_0C0C, 0x0808_0808, 0x0404_0404, 0);
        let idx = _mm512_add_epi8(lanes, _mm512_set1_epi8(byte));
        let bits = _mm512_set1_epi32(if odd {
            0x8040_2010_u32 as i32
        } else {
            0x0804_0201
        });
        _mm512_test_epi8_mask(_mm512_shuffle_epi8(qh, idx), bits)
    }
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn vnni<const K: usize>(
    p: &PackedRows,
    groups: Range<usize>,
    xs: &[QuantizedRow],
    out: &mut [f32],
) {
    let nb = p.blocks();
    let rec = record_bytes(BlockKind::ALL[K]);
    let nx = xs.len();
    let data = p.data().as_ptr();
    for (gi, g) in groups.enumerate() {
        // SAFETY: `g < p.groups()`, so the group's `nb` records lie inside `data`.
        let gbase = unsafe { data.add(g * nb * rec) };
        let mut r0 = 0;
        while r0 < nx {
            let t = (nx - r0).min(4);
            let o = &mut out[(gi * nx + r0) * PACK..(gi * nx + r0 + t) * PACK];
            let x = &xs[r0..r0 + t];
            // SAFETY: as above; each input row holds `nb` blocks; `o` holds `t * 16` values.
            unsafe {
                match t {
                    4 => vnni_tile::<K, 4>(gbase, nb, x, o),
                    3 => vnni_tile::<K, 3>(gbase, nb, x, o),
                    2 => vnni_tile::<K, 2>(gbase, nb, x, o),
                    _ => vnni_tile::<K, 1>(gbase, nb, x, o),
                }
            }
            r0 += t;
        }
    }
}

/// One group against `T` input rows: the weights of a block are unpacked once for all `T`.
#[inline(always)]
unsafe fn vnni_tile<const K: usize, const T: usize>(
    gbase: *const u8,
    nb: usize,
    xs: &[QuantizedRow],
    out: &mut [f32],
) {
    let kind = BlockKind::ALL[K];
    let (rec, sb) = (record_bytes(kind), scale_bytes(kind));
    // SAFETY: records `0..nb` of this group are in bounds (caller); each input row has `nb`
    // blocks of 32 values; `out` holds `T * 16` floats.
    unsafe {
        let mut acc = [_mm512_setzero_ps(); T];
        let nib = _mm512_set1_epi8(0x0F);
        for b in 0..nb {
            let base = gbase.add(b * rec);
            prefetch_record(base, rec);
            let dw = _mm512_cvtph_ps(_mm256_loadu_si256(base.cast()));
            let qs = base.add(sb);
            let mut w = [_mm512_setzero_si512(); 8];
            if K == 2 {
                for (c, wc) in w.iter_mut().enumerate() {
                    *wc = _mm512_loadu_si512(qs.add(64 * c).cast());
                }
            } else {
                for c in 0..4 {
                    let v = _mm512_loadu_si512(qs.add(64 * c).cast());
                    w[c] = _mm512_and_si512(v, nib);
                    w[4 + c] = _mm512_and_si512(_mm512_srli_epi16::<4>(v), nib);
                }
                if K >= 3 {
                    // Q5: the fifth bits (one u32 per lane, before the quants) of weights
                    // `4c..4c + 4` (bits `4c..`) and `16 + 4c..` (bits `16 + 4c..`).
                    let qh = _mm512_loadu_si512(qs.sub(64).cast());
                    let sixteen = _mm512_set1_epi8(16);
                    for c in 0..4 {
                        for (half, wc) in [(0, c), (2, 4 + c)] {
                            let k = fifth_bits(qh, (half + c / 2) as i8, c % 2 == 1);
                            w[wc] = _mm512_mask_add_epi8(w[wc], k, w[wc], sixteen);
                        }
                    }
                }
            }
            for t in 0..T {
                let x = &xs[t];
                let xq = x.q.as_ptr().add(b * QK).cast::<i32>();
                let (mut a0, mut a1) = (_mm512_setzero_si512(), _mm512_setzero_si512());
                for c in (0..8).step_by(2) {
                    a0 = _mm512_dpbusd_epi32(
                        a0,
                        w[c],
                        _mm512_set1_epi32(xq.add(c).read_unaligned()),
                    );
                    a1 = _mm512_dpbusd_epi32(
                        a1,
                        w[c + 1],
                        _mm512_set1_epi32(xq.add(c + 1).read_unaligned()),
                    );
                }
                let mut s = _mm512_add_epi32(a0, a1);
                let dx = _mm512_set1_ps(*x.d.get_unchecked(b));
                if K == 1 || K == 4 {
                    let m = _mm512_cvtph_ps(_mm256_loadu_si256(base.add(2 * PACK).cast()));
                    let t1 = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(s), dw), dx);
                    let t2 = _mm512_mul_ps(m, _mm512_set1_ps(*x.s.get_unchecked(b)));
                    acc[t] = _mm512_add_ps(acc[t], _mm512_add_ps(t1, t2));
                } else {
                    let off = [8, 0, 128, 16][K];
                    s = _mm512_sub_epi32(s, _mm512_set1_epi32(off * *x.sum.get_unchecked(b)));
                    acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(dw, dx), acc[t]);
                }
            }
        }
        for (t, a) in acc.iter().enumerate() {
            _mm512_storeu_ps(out.as_mut_ptr().add(t * PACK), *a);
        }
    }
}

/// # Safety
/// The CPU must have AVX2, FMA and F16C; the arguments must satisfy the module's contract.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn gemm_avx2(
    p: &PackedRows,
    groups: Range<usize>,
    xs: &[QuantizedRow],
    out: &mut [f32],
) {
    // SAFETY: forwarded contract.
    unsafe {
        match p.kind() {
            BlockKind::Q4_0 => avx2::<0>(p, groups, xs, out),
            BlockKind::Q4_1 => avx2::<1>(p, groups, xs, out),
            BlockKind::Q8_0 => avx2::<2>(p, groups, xs, out),
            BlockKind::Q5_0 => avx2::<3>(p, groups, xs, out),
            BlockKind::Q5_1 => avx2::<4>(p, groups, xs, out),
            _ => super::x86_more::gemm_avx2(p, groups, xs, out),
        }
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn avx2<const K: usize>(
    p: &PackedRows,
    groups: Range<usize>,
    xs: &[QuantizedRow],
    out: &mut [f32],
) {
    let nb = p.blocks();
    let kind = BlockKind::ALL[K];
    let (rec, sb) = (record_bytes(kind), scale_bytes(kind));
    let nx = xs.len();
    let data = p.data().as_ptr();
    // SAFETY: `g < p.groups()` so its records are in bounds; input rows hold `nb` blocks;
    // `out` holds `groups.len() * nx * 16` values (the module's contract).
    unsafe {
        let nib = _mm256_set1_epi8(0x0F);
        let flip = _mm256_set1_epi8(-128);
        let ones = _mm256_set1_epi16(1);
        for (gi, g) in groups.enumerate() {
            let gbase = data.add(g * nb * rec);
            for (r, x) in xs.iter().enumerate() {
                for h in 0..2 {
                    let mut acc = _mm256_setzero_ps();
                    for b in 0..nb {
                        let base = gbase.add(b * rec);
                        if h == 0 {
                            prefetch_record(base, rec);
                        }
                        let dw = _mm256_cvtph_ps(_mm_loadu_si128(base.add(16 * h).cast()));
                        let qs = base.add(sb + 32 * h);
                        let xq = x.q.as_ptr().add(b * QK).cast::<i32>();
                        let bx = |c: usize| _mm256_set1_epi32(xq.add(c).read_unaligned());
                        let s = if K == 2 {
                            let mut s = _mm256_setzero_si256();
                            for c in 0..8 {
                                let v = _mm256_xor_si256(
                                    _mm256_loadu_si256(qs.add(64 * c).cast()),
                                    flip,
                                );
                                let p = _mm256_maddubs_epi16(
                                    _mm256_sign_epi8(v, v),
                                    _mm256_sign_epi8(bx(c), v),
                                );
                                s = _mm256_add_epi32(s, _mm256_madd_epi16(p, ones));
                            }
                            s
                        } else {
                            // 4- and 5-bit products: 4 pair sums of at most 2 * 31 * 127
                            // fit i16; low and high nibbles apart.
                            let (mut pl, mut ph) = (_mm256_setzero_si256(), _mm256_setzero_si256());
                            let qh = if K >= 3 {
                                _mm256_loadu_si256(qs.sub(64).cast())
                            } else {
                                _mm256_setzero_si256()
                            };
                            for c in 0..4 {
                                let v = _mm256_loadu_si256(qs.add(64 * c).cast());
                                let mut lo = _mm256_and_si256(v, nib);
                                let mut hi = _mm256_and_si256(_mm256_srli_epi16::<4>(v), nib);
                                if K >= 3 {
                                    lo = _mm256_or_si256(lo, fifth_bits_avx2(qh, c / 2, c % 2));
                                    hi = _mm256_or_si256(hi, fifth_bits_avx2(qh, 2 + c / 2, c % 2));
                                }
                                pl = _mm256_add_epi16(pl, _mm256_maddubs_epi16(lo, bx(c)));
                                ph = _mm256_add_epi16(ph, _mm256_maddubs_epi16(hi, bx(4 + c)));
                            }
                            let s = _mm256_add_epi32(
                                _mm256_madd_epi16(pl, ones),
                                _mm256_madd_epi16(ph, ones),
                            );
                            match K {
                                0 => _mm256_sub_epi32(s, _mm256_set1_epi32(8 * x.sum[b])),
                                3 => _mm256_sub_epi32(s, _mm256_set1_epi32(16 * x.sum[b])),
                                _ => s,
                            }
                        };
                        let dx = _mm256_set1_ps(x.d[b]);
                        acc = if K == 1 || K == 4 {
                            let m = _mm256_cvtph_ps(_mm_loadu_si128(
                                base.add(2 * PACK + 16 * h).cast(),
                            ));
                            let t1 = _mm256_mul_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(s), dw), dx);
                            let t2 = _mm256_mul_ps(m, _mm256_set1_ps(x.s[b]));
                            _mm256_add_ps(acc, _mm256_add_ps(t1, t2))
                        } else {
                            _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_mul_ps(dw, dx), acc)
                        };
                    }
                    let o = (gi * nx + r) * PACK + 8 * h;
                    _mm256_storeu_ps(out[o..o + 8].as_mut_ptr(), acc);
                }
            }
        }
    }
}

/// The AVX2 form of [`fifth_bits`]: `16` in byte `m` of each 32-bit lane where bit `m`
/// (`odd`: `4 + m`) of the lane's byte `byte` is set, else 0.
#[inline(always)]
unsafe fn fifth_bits_avx2(qh: __m256i, byte: usize, odd: usize) -> __m256i {
    // SAFETY: AVX2 is enabled in every caller.
    unsafe {
        let lanes = _mm256_setr_epi32(
            0,
            0x0404_0404,
            0x0808_0808,
            0x0C0C_0C0C,
            0,
            0x0404_0404,
            0x0808_0808,
            0x0C0C_0C0C,
        );
        let idx = _mm256_add_epi8(lanes, _mm256_set1_epi8(byte as i8));
        let bits = _mm256_set1_epi32(if odd == 1 {
            0x8040_2010_u32 as i32
        } else {
            0x0804_0201
        });
        let set = _mm256_and_si256(_mm256_shuffle_epi8(qh, idx), bits);
        _mm256_and_si256(_mm256_cmpeq_epi8(set, bits), _mm256_set1_epi8(16))
    }
}
