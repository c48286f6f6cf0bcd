//! AVX-512 VNNI and AVX2 forms of [`super::gemm`] for the K-quants (Q4_K, Q5_K, Q6_K), against
//! the input's Q8_K super-blocks. Callers guarantee (see `super::gemm`): `groups` lies inside
//! the matrix, every input row has at least the matrix's super-blocks (`x.k`), and `out` holds
//! `groups.len() * xs.len() * 16` values.
//!
//! Record layout (16 rows, one super-block; `super` module docs): Q4_K `d | dmin | scales (3
//! chunks) | qs (32 chunks)`, Q5_K the same with `qh` (8 chunks) before `qs`, Q6_K `ql (32
//! chunks) | qh (16 chunks) | scales (4 chunks) | d`. Per sub-block the integer sum of each lane
//! comes from `vpdpbusd` (unsigned quants, signed input), is multiplied by the lane's scale in
//! 32-bit integers and summed: exact, so each lane's float steps are the reference's
//! (`blocks::dot_block`), and the bits are equal.
use std::arch::x86_64::*;
use std::ops::Range;

use super::prefetch::prefetch_part;
use super::{record_bytes, PackedRows, PACK};
use crate::cpu::blocks::BlockKind;
use crate::cpu::quant::{QuantizedRow, QK_K};

/// # Safety
/// The CPU must have AVX-512F, AVX-512BW, AVX-512VL and AVX-512 VNNI; the arguments must satisfy
/// the module's contract.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
pub(crate) unsafe fn gemm_vnni(
    p: &PackedRows,
    groups: Range<usize>,
    xs: &[QuantizedRow],
    out: &mut [f32],
) {
    let kind = p.kind();
    let (nb, rec, nx) = (p.blocks(), record_bytes(kind), xs.len());
    let data = p.data().as_ptr();
    for (gi, g) in groups.enumerate() {
        // SAFETY: `g < p.groups()`, so the group's `nb` records lie inside `data`.
        let gbase = unsafe { data.add(g * nb * rec) };
        let mut r0 = 0;
        while r0 < nx {
            let t = (nx - r0).min(4);
            let o = &mut out[(gi * nx + r0) * PACK..(gi * nx + r0 + t) * PACK];
            let x = &xs[r0..r0 + t];
            // SAFETY: as above; each input row holds `nb` super-blocks; `o` holds `t * 16`.
            unsafe {
                match (kind, t) {
                    (BlockKind::Q4K, 4) => q45k_vnni::<false, 4>(gbase, nb, x, o),
                    (BlockKind::Q4K, 3) => q45k_vnni::<false, 3>(gbase, nb, x, o),
                    (BlockKind::Q4K, 2) => q45k_vnni::<false, 2>(gbase, nb, x, o),
                    (BlockKind::Q4K, _) => q45k_vnni::<false, 1>(gbase, nb, x, o),
                    (BlockKind::Q5K, 4) => q45k_vnni::<true, 4>(gbase, nb, x, o),
                    (BlockKind::Q5K, 3) => q45k_vnni::<true, 3>(gbase, nb, x, o),
                    (BlockKind::Q5K, 2) => q45k_vnni::<true, 2>(gbase, nb, x, o),
                    (BlockKind::Q5K, _) => q45k_vnni::<true, 1>(gbase, nb, x, o),
                    (BlockKind::Q6K, 4) => q6k_vnni::<4>(gbase, nb, x, o),
                    (BlockKind::Q6K, 3) => q6k_vnni::<3>(gbase, nb, x, o),
                    (BlockKind::Q6K, 2) => q6k_vnni::<2>(gbase, nb, x, o),
                    (BlockKind::Q6K, _) => q6k_vnni::<1>(gbase, nb, x, o),
                    // The other block types have their kernels in `x86`.
                    _ => super::gemm_scalar(p, g..g + 1, x, o),
                }
            }
            r0 += t;
        }
    }
}

/// `(v >> (8 * k)) & 0xFF` in each 32-bit lane: byte `k` of every lane, as an integer.
#[inline(always)]
unsafe fn byte_of(v: __m512i, k: usize) -> __m512i {
    // SAFETY: AVX-512F is enabled in every caller.
    unsafe {
        let s = _mm512_srlv_epi32(v, _mm512_set1_epi32(8 * k as i32));
        _mm512_and_si512(s, _mm512_set1_epi32(0xFF))
    }
}

/// The input's sums over two sub-blocks of 32 (`j`, `j + 2` as the low and high halves of one
/// 32-bit lane), for `vpmaddwd` against minimums in 16-bit pairs.
#[inline(always)]
fn bsum_pair(bsum: &[i16], j: usize) -> i32 {
    let s32 = |j: usize| (bsum[2 * j] + bsum[2 * j + 1]) as u16 as u32;
    (s32(j) | (s32(j + 2) << 16)) as i32
}

/// Q4_K (`H`: Q5_K) against `T` input rows.
#[inline(always)]
unsafe fn q45k_vnni<const H: bool, const T: usize>(
    gbase: *const u8,
    nb: usize,
    xs: &[QuantizedRow],
    out: &mut [f32],
) {
    let kind = if H { BlockKind::Q5K } else { BlockKind::Q4K };
    let rec = record_bytes(kind);
    let qs_at = if H { 768 } else { 256 };
    // SAFETY: records `0..nb` of this group are in bounds (caller); each input row holds `nb`
    // super-blocks (`k.q`: 256 values, `k.bsum`: 16 sums, `k.d` each); `out` holds `T * 16`.
    unsafe {
        let mut acc = [_mm512_setzero_ps(); T];
        let nib = _mm512_set1_epi8(0x0F);
        let six = _mm512_set1_epi8(0x3F);
        let two = _mm512_set1_epi8(0x03);
        let even = _mm512_set1_epi32(0x00FF_00FF);
        for b in 0..nb {
            let base = gbase.add(b * rec);
            let dw = _mm512_cvtph_ps(_mm256_loadu_si256(base.cast()));
            let dmin = _mm512_cvtph_ps(_mm256_loadu_si256(base.add(2 * PACK).cast()));
            let (sa, sb, sc) = (
                _mm512_loadu_si512(base.add(64).cast()),
                _mm512_loadu_si512(base.add(128).cast()),
                _mm512_loadu_si512(base.add(192).cast()),
            );
            // ggml's get_scale_min_k4, 16 lanes at once: bytes sc0..3 | sc4..7, m0..3 | m4..7.
            let up = |v: __m512i| {
                _mm512_slli_epi32::<4>(_mm512_and_si512(_mm512_srli_epi32::<6>(v), two))
            };
            let scales = [
                _mm512_and_si512(sa, six),
                _mm512_or_si512(_mm512_and_si512(sc, nib), up(sa)),
            ];
            let mins = [
                _mm512_and_si512(sb, six),
                _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32::<4>(sc), nib), up(sb)),
            ];
            let mut sumi = [_mm512_setzero_si512(); T];
            let qs = base.add(qs_at);
            for j in 0..8 {
                prefetch_part(base, rec, j, 8);
                // Sub-block j: nibble (j % 2) of the quants' words 8 (j / 2) .. + 8.
                let mut w = [_mm512_setzero_si512(); 8];
                for (k, wk) in w.iter_mut().enumerate() {
                    let v = _mm512_loadu_si512(qs.add(64 * (8 * (j / 2) + k)).cast());
                    let v = if j % 2 == 1 {
                        _mm512_srli_epi16::<4>(v)
                    } else {
                        v
                    };
                    *wk = _mm512_and_si512(v, nib);
                    if H {
                        let qh = _mm512_loadu_si512(base.add(256 + 64 * k).cast());
                        let bit = _mm512_test_epi8_mask(qh, _mm512_set1_epi8((1u8 << j) as i8));
                        *wk = _mm512_mask_add_epi8(*wk, bit, *wk, _mm512_set1_epi8(16));
                    }
                }
                let scale = byte_of(scales[j / 4], j % 4);
                for t in 0..T {
                    let xq = xs[t].k.q.as_ptr().add(b * QK_K + 32 * j).cast::<i32>();
                    let (mut a0, mut a1) = (_mm512_setzero_si512(), _mm512_setzero_si512());
                    for k in (0..8).step_by(2) {
                        let x0 = _mm512_set1_epi32(xq.add(k).read_unaligned());
                        let x1 = _mm512_set1_epi32(xq.add(k + 1).read_unaligned());
                        a0 = _mm512_dpbusd_epi32(a0, w[k], x0);
                        a1 = _mm512_dpbusd_epi32(a1, w[k + 1], x1);
                    }
                    let isum = _mm512_add_epi32(a0, a1);
                    sumi[t] = _mm512_add_epi32(sumi[t], _mm512_mullo_epi32(isum, scale));
                }
            }
            for t in 0..T {
                let x = &xs[t];
                let bs = x.k.bsum.get_unchecked(b * 16..(b + 1) * 16);
                // summ = sum_j m_j bsum_j: minimums as 16-bit pairs (m0, m2), (m1, m3), ...
                let mut summ = _mm512_setzero_si512();
                for (h, m) in mins.iter().enumerate() {
                    let (e, o) = (_mm512_and_si512(*m, even), _mm512_srli_epi16::<8>(*m));
                    let (j0, j1) = (4 * h, 4 * h + 1);
                    summ = _mm512_add_epi32(
                        summ,
                        _mm512_madd_epi16(e, _mm512_set1_epi32(bsum_pair(bs, j0))),
                    );
                    summ = _mm512_add_epi32(
                        summ,
                        _mm512_madd_epi16(o, _mm512_set1_epi32(bsum_pair(bs, j1))),
                    );
                }
                let dx = _mm512_set1_ps(*x.k.d.get_unchecked(b));
                let a = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sumi[t]), _mm512_mul_ps(dw, dx), acc[t]);
                acc[t] = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(summ), _mm512_mul_ps(dmin, dx), a);
            }
        }
        for (t, a) in acc.iter().enumerate() {
            _mm512_storeu_ps(out.as_mut_ptr().add(t * PACK), *a);
        }
    }
}

/// `(v << (24 - 8 k)) >> 24` (arithmetic) in each 32-bit lane: signed byte `k` of every lane.
#[inline(always)]
unsafe fn signed_byte_of(v: __m512i, k: usize) -> __m512i {
    // SAFETY: AVX-512F is enabled in every caller.
    unsafe {
        let s = _mm512_sllv_epi32(v, _mm512_set1_epi32(24 - 8 * k as i32));
        _mm512_srai_epi32::<24>(s)
    }
}

/// Q6_K against `T` input rows.
#[inline(always)]
unsafe fn q6k_vnni<const T: usize>(
    gbase: *const u8,
    nb: usize,
    xs: &[QuantizedRow],
    out: &mut [f32],
) {
    let rec = record_bytes(BlockKind::Q6K);
    // SAFETY: as `q45k_vnni`.
    unsafe {
        let mut acc = [_mm512_setzero_ps(); T];
        let nib = _mm512_set1_epi8(0x0F);
        let (m03, m0c, m30) = (
            _mm512_set1_epi8(0x03),
            _mm512_set1_epi8(0x0C),
            _mm512_set1_epi8(0x30),
        );
        for b in 0..nb {
            let base = gbase.add(b * rec);
            let (ql, qh, sw) = (base, base.add(2048), base.add(3072));
            let dw = _mm512_cvtph_ps(_mm256_loadu_si256(base.add(3328).cast()));
            let mut sumi = [_mm512_setzero_si512(); T];
            for n in 0..2 {
                for g in 0..2 {
                    prefetch_part(base, rec, 2 * n + g, 4);
                    // Words 4g..4g + 4 of each 32-weight run: sub-blocks 8n + g + 2q, q = 0..4.
                    let mut w = [[_mm512_setzero_si512(); 4]; 4];
                    #[allow(clippy::needless_range_loop)] // `i` indexes the inner arrays of `w`
                    for i in 0..4 {
                        let k = 4 * g + i;
                        let l0 = _mm512_loadu_si512(ql.add(64 * (16 * n + k)).cast());
                        let l1 = _mm512_loadu_si512(ql.add(64 * (16 * n + 8 + k)).cast());
                        let h = _mm512_loadu_si512(qh.add(64 * (8 * n + k)).cast());
                        let hi = |v: __m512i| _mm512_and_si512(_mm512_srli_epi16::<4>(v), nib);
                        w[0][i] = _mm512_or_si512(
                            _mm512_and_si512(l0, nib),
                            _mm512_slli_epi16::<4>(_mm512_and_si512(h, m03)),
                        );
                        w[1][i] = _mm512_or_si512(
                            _mm512_and_si512(l1, nib),
                            _mm512_slli_epi16::<2>(_mm512_and_si512(h, m0c)),
                        );
                        w[2][i] = _mm512_or_si512(hi(l0), _mm512_and_si512(h, m30));
                        w[3][i] = _mm512_or_si512(
                            hi(l1),
                            _mm512_and_si512(_mm512_srli_epi16::<2>(h), m30),
                        );
                    }
                    for (q, wq) in w.iter().enumerate() {
                        let j = 8 * n + 2 * q + g;
                        let scale =
                            signed_byte_of(_mm512_loadu_si512(sw.add(64 * (j / 4)).cast()), j % 4);
                        for t in 0..T {
                            let x = &xs[t];
                            let xq = x.k.q.as_ptr().add(b * QK_K + 16 * j).cast::<i32>();
                            let mut isum =
                                _mm512_set1_epi32(-32 * *x.k.bsum.get_unchecked(b * 16 + j) as i32);
                            for (i, wi) in wq.iter().enumerate() {
                                let xv = _mm512_set1_epi32(xq.add(i).read_unaligned());
                                isum = _mm512_dpbusd_epi32(isum, *wi, xv);
                            }
                            sumi[t] = _mm512_add_epi32(sumi[t], _mm512_mullo_epi32(isum, scale));
                        }
                    }
                }
            }
            for t in 0..T {
                let dx = _mm512_set1_ps(*xs[t].k.d.get_unchecked(b));
                acc[t] =
                    _mm512_fmadd_ps(_mm512_cvtepi32_ps(sumi[t]), _mm512_mul_ps(dw, dx), acc[t]);
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
    let kind = p.kind();
    if !matches!(kind, BlockKind::Q4K | BlockKind::Q5K | BlockKind::Q6K) {
        // The other block types have their kernels in `x86`.
        return super::gemm_scalar(p, groups, xs, out);
    }
    let (nb, rec, nx) = (p.blocks(), record_bytes(kind), xs.len());
    let data = p.data().as_ptr();
    for (gi, g) in groups.enumerate() {
        // SAFETY: `g < p.groups()`, so the group's records are in bounds; input rows hold `nb`
        // super-blocks; `out` holds 16 values per group and row (the module's contract).
        unsafe {
            let gbase = data.add(g * nb * rec);
            for (r, x) in xs.iter().enumerate() {
                let o = &mut out[(gi * nx + r) * PACK..][..PACK];
                for h in 0..2 {
                    let acc = match kind {
                        BlockKind::Q4K => q45k_avx2::<false>(gbase, nb, h, x),
                        BlockKind::Q5K => q45k_avx2::<true>(gbase, nb, h, x),
                        _ => q6k_avx2(gbase, nb, h, x),
                    };
                    _mm256_storeu_ps(o.as_mut_ptr().add(8 * h), acc);
                }
            }
        }
    }
}

/// Byte `k` of every 32-bit lane, as an integer (AVX2).
#[inline(always)]
unsafe fn byte_of_avx2(v: __m256i, k: usize) -> __m256i {
    // SAFETY: AVX2 is enabled in every caller.
    unsafe {
        let s = _mm256_srlv_epi32(v, _mm256_set1_epi32(8 * k as i32));
        _mm256_and_si256(s, _mm256_set1_epi32(0xFF))
    }
}

/// Lanes `8 h .. 8 h + 8` of a Q4_K (`H`: Q5_K) group against one input row.
#[inline(always)]
unsafe fn q45k_avx2<const H: bool>(
    gbase: *const u8,
    nb: usize,
    h: usize,
    x: &QuantizedRow,
) -> __m256 {
    let kind = if H { BlockKind::Q5K } else { BlockKind::Q4K };
    let rec = record_bytes(kind);
    let qs_at = if H { 768 } else { 256 };
    // SAFETY: as `q45k_vnni`; half `h` of a chunk is its 32 bytes at `64 c + 32 h`.
    unsafe {
        let nib = _mm256_set1_epi8(0x0F);
        let six = _mm256_set1_epi8(0x3F);
        let two = _mm256_set1_epi8(0x03);
        let one = _mm256_set1_epi8(0x01);
        let ones = _mm256_set1_epi16(1);
        let even = _mm256_set1_epi32(0x00FF_00FF);
        let mut acc = _mm256_setzero_ps();
        for b in 0..nb {
            let base = gbase.add(b * rec);
            let ld = |at: usize| _mm256_loadu_si256(base.add(at + 32 * h).cast());
            let dw = _mm256_cvtph_ps(_mm_loadu_si128(base.add(16 * h).cast()));
            let dmin = _mm256_cvtph_ps(_mm_loadu_si128(base.add(32 + 16 * h).cast()));
            let (sa, sb, sc) = (ld(64), ld(128), ld(192));
            let up = |v: __m256i| {
                _mm256_slli_epi32::<4>(_mm256_and_si256(_mm256_srli_epi32::<6>(v), two))
            };
            let scales = [
                _mm256_and_si256(sa, six),
                _mm256_or_si256(_mm256_and_si256(sc, nib), up(sa)),
            ];
            let mins = [
                _mm256_and_si256(sb, six),
                _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32::<4>(sc), nib), up(sb)),
            ];
            let mut sumi = _mm256_setzero_si256();
            for j in 0..8 {
                if h == 0 {
                    prefetch_part(base, rec, j, 8);
                }
                let xq = x.k.q.as_ptr().add(b * QK_K + 32 * j).cast::<i32>();
                let (mut p0, mut p1) = (_mm256_setzero_si256(), _mm256_setzero_si256());
                for k in 0..8 {
                    let v = ld(qs_at + 64 * (8 * (j / 2) + k));
                    let v = if j % 2 == 1 {
                        _mm256_srli_epi16::<4>(v)
                    } else {
                        v
                    };
                    let mut w = _mm256_and_si256(v, nib);
                    if H {
                        let qh = _mm256_srl_epi16(ld(256 + 64 * k), _mm_cvtsi32_si128(j as i32));
                        w = _mm256_or_si256(w, _mm256_slli_epi16::<4>(_mm256_and_si256(qh, one)));
                    }
                    let pr = _mm256_maddubs_epi16(w, _mm256_set1_epi32(xq.add(k).read_unaligned()));
                    // At most 4 pair sums of 2 * 31 * 127 per 16-bit accumulator.
                    if k < 4 {
                        p0 = _mm256_add_epi16(p0, pr);
                    } else {
                        p1 = _mm256_add_epi16(p1, pr);
                    }
                }
                let isum =
                    _mm256_add_epi32(_mm256_madd_epi16(p0, ones), _mm256_madd_epi16(p1, ones));
                let scale = byte_of_avx2(scales[j / 4], j % 4);
                sumi = _mm256_add_epi32(sumi, _mm256_mullo_epi32(isum, scale));
            }
            let bs = x.k.bsum.get_unchecked(b * 16..(b + 1) * 16);
            let mut summ = _mm256_setzero_si256();
            for (hh, m) in mins.iter().enumerate() {
                let (e, o) = (_mm256_and_si256(*m, even), _mm256_srli_epi16::<8>(*m));
                let (j0, j1) = (4 * hh, 4 * hh + 1);
                summ = _mm256_add_epi32(
                    summ,
                    _mm256_madd_epi16(e, _mm256_set1_epi32(bsum_pair(bs, j0))),
                );
                summ = _mm256_add_epi32(
                    summ,
                    _mm256_madd_epi16(o, _mm256_set1_epi32(bsum_pair(bs, j1))),
                );
            }
            let dx = _mm256_set1_ps(*x.k.d.get_unchecked(b));
            let a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sumi), _mm256_mul_ps(dw, dx), acc);
            acc = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(summ), _mm256_mul_ps(dmin, dx), a);
        }
        acc
    }
}

/// Lanes `8 h .. 8 h + 8` of a Q6_K group against one input row.
#[inline(always)]
unsafe fn q6k_avx2(gbase: *const u8, nb: usize, h: usize, x: &QuantizedRow) -> __m256 {
    let rec = record_bytes(BlockKind::Q6K);
    // SAFETY: as `q6k_vnni`; half `h` of a chunk is its 32 bytes at `64 c + 32 h`.
    unsafe {
        let nib = _mm256_set1_epi8(0x0F);
        let (m03, m0c, m30) = (
            _mm256_set1_epi8(0x03),
            _mm256_set1_epi8(0x0C),
            _mm256_set1_epi8(0x30),
        );
        let ones = _mm256_set1_epi16(1);
        let mut acc = _mm256_setzero_ps();
        for b in 0..nb {
            let base = gbase.add(b * rec);
            let ld = |at: usize| _mm256_loadu_si256(base.add(at + 32 * h).cast());
            let dw = _mm256_cvtph_ps(_mm_loadu_si128(base.add(3328 + 16 * h).cast()));
            let mut sumi = _mm256_setzero_si256();
            for j in 0..16 {
                if h == 0 {
                    prefetch_part(base, rec, j, 16);
                }
                // Sub-block j = 8n + 2q + g: words 4g..4g + 4 of run q of half n.
                let (n, q, g) = (j / 8, (j % 8) / 2, j % 2);
                let xq = x.k.q.as_ptr().add(b * QK_K + 16 * j).cast::<i32>();
                let mut isum = _mm256_set1_epi32(-32 * *x.k.bsum.get_unchecked(b * 16 + j) as i32);
                let mut p = _mm256_setzero_si256();
                for i in 0..4 {
                    let k = 4 * g + i;
                    let lq = ld(64 * (16 * n + 8 * (q % 2) + k));
                    let hq = ld(2048 + 64 * (8 * n + k));
                    let lo = if q < 2 {
                        _mm256_and_si256(lq, nib)
                    } else {
                        _mm256_and_si256(_mm256_srli_epi16::<4>(lq), nib)
                    };
                    let hb = match q {
                        0 => _mm256_slli_epi16::<4>(_mm256_and_si256(hq, m03)),
                        1 => _mm256_slli_epi16::<2>(_mm256_and_si256(hq, m0c)),
                        2 => _mm256_and_si256(hq, m30),
                        _ => _mm256_and_si256(_mm256_srli_epi16::<2>(hq), m30),
                    };
                    let xv = _mm256_set1_epi32(xq.add(i).read_unaligned());
                    p = _mm256_add_epi16(p, _mm256_maddubs_epi16(_mm256_or_si256(lo, hb), xv));
                    // Two pair sums of 2 * 63 * 127 fit 16 bits; widen every second.
                    if i % 2 == 1 {
                        isum = _mm256_add_epi32(isum, _mm256_madd_epi16(p, ones));
                        p = _mm256_setzero_si256();
                    }
                }
                let shift = _mm256_set1_epi32(24 - 8 * (j % 4) as i32);
                let scale =
                    _mm256_srai_epi32::<24>(_mm256_sllv_epi32(ld(3072 + 64 * (j / 4)), shift));
                sumi = _mm256_add_epi32(sumi, _mm256_mullo_epi32(isum, scale));
            }
            let dx = _mm256_set1_ps(*x.k.d.get_unchecked(b));
            acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sumi), _mm256_mul_ps(dw, dx), acc);
        }
        acc
    }
}
