//! AVX-512 VNNI and AVX2 forms of the quantized product. Callers guarantee (see
//! `super::product`): `chunks` lies inside the matrix, `out` holds `chunks.len() * 64`
//! values, every active column is below `cols` and the input has every block.
//!
//! AVX2: per block and chunk of 64 rows, 16-bit accumulators in registers: a 4-bit weight
//! less 8 times an input (`|q_x| <= 127`) is at most 1016 in magnitude, so 32 columns sum to
//! at most 32512 and never overflow. Q8_0 products (at most 16256) are widened to 32 bits per
//! column.

use std::arch::x86_64::*;
use std::ops::Range;

use super::{block_runs, ColumnMatrix, QuantParts, AHEAD, CHUNK, PREFETCH_BYTES, TILE};
use crate::cpu::quant::{QuantKind, QuantizedRow, QK};

/// # Safety
/// AVX-512F/BW/VL/VNNI detected; the module's contract holds.
///
/// Four active columns at a time: their 64-row chunks are widened to one byte per row
/// (`u`: Q4 values as stored, 0..15; Q8_0 values offset by 128), interleaved so that each
/// 32-bit lane holds one row's four bytes, and one `vpdpbusd` per 16 rows adds the four
/// products against the four inputs. The offset comes back out per block as
/// `off * sum(q_x)` (Q4_0: 8, Q8_0: 128; inactive inputs are 0). The lanes come out
/// grouped by 4 rows within each 128-bit lane and are put back in row order once per block.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
pub(crate) unsafe fn product_vnni(
    m: &ColumnMatrix,
    chunks: Range<usize>,
    x: &QuantizedRow,
    active: &[u32],
    out: &mut [f32],
) {
    let Some(QuantParts {
        kind,
        pad,
        cb,
        pb,
        scales,
        values,
    }) = m.quant()
    else {
        return;
    };
    let off = match kind {
        QuantKind::Q4_0 => 8,
        QuantKind::Q4_1 => 0,
        QuantKind::Q8_0 => 128,
    };
    let shifts = _mm512_set_epi64(
        0x0004_0004_0004_0004,
        0x0004_0004_0004_0004,
        0x0004_0004_0004_0004,
        0x0004_0004_0004_0004,
        0,
        0,
        0,
        0,
    );
    let (m4, flip) = (_mm512_set1_epi8(0xF), _mm512_set1_epi8(-128));
    out.fill(0.0);
    // Per quad of active columns: their offsets in `values` and the four inputs as bytes.
    let mut quads = [([0usize; 4], 0i32); QK / 4];
    let mut pos = 0;
    for run in block_runs(active) {
        let b = run[0] as usize / QK;
        let plane = scales[b * pb..].as_ptr();
        let nq = run.len().div_ceil(4);
        let run_pos = pos;
        pos += run.len();
        for (q, cols) in quads.iter_mut().zip(run.chunks(4)) {
            let mut xs = 0u32;
            for j in 0..4 {
                // A missing fourth column reads the first one's bytes with input 0.
                let c = cols.get(j).map_or(cols[0], |&c| c) as usize;
                q.0[j] = c * cb;
                let xv = cols.get(j).map_or(0, |&c| x.q[c as usize]);
                xs |= u32::from(xv as u8) << (8 * j);
            }
            q.1 = xs as i32;
        }
        let back = _mm512_set1_epi32(off * x.sum[b]);
        let (dx, sx) = (_mm512_set1_ps(x.d[b]), _mm512_set1_ps(x.s[b]));
        // Tiles of chunks: each active column's piece of the tile is read in one stretch,
        // the tile's sums wait in `acc`.
        for tile_start in chunks.clone().step_by(TILE) {
            let tile = tile_start..(tile_start + TILE).min(chunks.end);
            let mut acc = [[_mm512_setzero_si512(); 4]; TILE];
            for (qi, &(offs, xs)) in quads[..nq].iter().enumerate() {
                // Start loading this tile's piece of the columns `AHEAD` ahead (at most
                // `PREFETCH_BYTES`) into L2 while this quad computes: columns of small
                // models are a few hundred bytes, too short for the hardware prefetcher.
                let lo = tile.start * cb / m.chunks();
                let hi = (tile.end * cb / m.chunks()).min(lo + PREFETCH_BYTES);
                for &c in active.iter().skip(run_pos + 4 * qi + AHEAD).take(4) {
                    let c = c as usize * cb;
                    crate::cpu::prefetch_l2(&values[c + lo..c + hi]);
                }
                let xv = _mm512_set1_epi32(xs);
                for (a, k) in acc.iter_mut().zip(tile.clone()) {
                    let u: [__m512i; 4] = std::array::from_fn(|j| {
                        if kind == QuantKind::Q8_0 {
                            // SAFETY: the column holds `pad` bytes; chunk `k < pad / 64`.
                            let v = unsafe {
                                _mm512_loadu_si512(values.as_ptr().add(offs[j] + k * CHUNK).cast())
                            };
                            _mm512_xor_si512(v, flip)
                        } else {
                            // SAFETY: the column holds `pad / 2` bytes; chunk `k < pad / 64`.
                            let v = unsafe {
                                _mm256_loadu_si256(values.as_ptr().add(offs[j] + k * 32).cast())
                            };
                            let v = _mm512_broadcast_i64x4(v);
                            _mm512_and_si512(_mm512_srlv_epi16(v, shifts), m4)
                        }
                    });
                    let ab_lo = _mm512_unpacklo_epi8(u[0], u[1]);
                    let ab_hi = _mm512_unpackhi_epi8(u[0], u[1]);
                    let cd_lo = _mm512_unpacklo_epi8(u[2], u[3]);
                    let cd_hi = _mm512_unpackhi_epi8(u[2], u[3]);
                    a[0] = _mm512_dpbusd_epi32(a[0], _mm512_unpacklo_epi16(ab_lo, cd_lo), xv);
                    a[1] = _mm512_dpbusd_epi32(a[1], _mm512_unpackhi_epi16(ab_lo, cd_lo), xv);
                    a[2] = _mm512_dpbusd_epi32(a[2], _mm512_unpacklo_epi16(ab_hi, cd_hi), xv);
                    a[3] = _mm512_dpbusd_epi32(a[3], _mm512_unpackhi_epi16(ab_hi, cd_hi), xv);
                }
            }
            for (acc, k) in acc.iter().zip(tile.clone()) {
                let i = k - chunks.start;
                // acc[j], 128-bit lane l holds rows 16 l + 4 j .. + 4: gather lane l of each.
                let t0 = _mm512_shuffle_i64x2::<0x44>(acc[0], acc[1]);
                let t1 = _mm512_shuffle_i64x2::<0x44>(acc[2], acc[3]);
                let t2 = _mm512_shuffle_i64x2::<0xEE>(acc[0], acc[1]);
                let t3 = _mm512_shuffle_i64x2::<0xEE>(acc[2], acc[3]);
                let s = [
                    _mm512_shuffle_i64x2::<0x88>(t0, t1),
                    _mm512_shuffle_i64x2::<0xDD>(t0, t1),
                    _mm512_shuffle_i64x2::<0x88>(t2, t3),
                    _mm512_shuffle_i64x2::<0xDD>(t2, t3),
                ]
                .map(|v| _mm512_sub_epi32(v, back));
                for (g, &sg) in s.iter().enumerate() {
                    let r = k * CHUNK + 16 * g;
                    // SAFETY: row `r + 15 < pad`; the plane holds `pad` scales (Q4_1: then `pad`
                    // minimums); `out` holds `chunks.len() * 64` values.
                    unsafe {
                        let o = out.as_mut_ptr().add(i * CHUNK + 16 * g);
                        let d = _mm512_cvtph_ps(_mm256_loadu_si256(plane.add(2 * r).cast()));
                        let sf = _mm512_cvtepi32_ps(sg);
                        let acc = _mm512_loadu_ps(o);
                        let v = if kind == QuantKind::Q4_1 {
                            let mn = _mm512_cvtph_ps(_mm256_loadu_si256(
                                plane.add(2 * (pad + r)).cast(),
                            ));
                            _mm512_add_ps(
                                acc,
                                _mm512_add_ps(
                                    _mm512_mul_ps(_mm512_mul_ps(sf, d), dx),
                                    _mm512_mul_ps(mn, sx),
                                ),
                            )
                        } else {
                            _mm512_fmadd_ps(sf, _mm512_mul_ps(d, dx), acc)
                        };
                        _mm512_storeu_ps(o, v);
                    }
                }
            }
        }
    }
}

/// # Safety
/// AVX2, FMA and F16C detected; the module's contract holds.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn product_avx2(
    m: &ColumnMatrix,
    chunks: Range<usize>,
    x: &QuantizedRow,
    active: &[u32],
    out: &mut [f32],
) {
    let Some(QuantParts {
        kind,
        pad,
        cb,
        pb,
        scales,
        values,
    }) = m.quant()
    else {
        return;
    };
    out.fill(0.0);
    for run in block_runs(active) {
        let b = run[0] as usize / QK;
        let plane = scales[b * pb..].as_ptr();
        for (i, k) in chunks.clone().enumerate() {
            // Eight groups of 8 rows as i32.
            let mut s = [_mm256_setzero_si256(); 8];
            if kind == QuantKind::Q8_0 {
                for &c in run {
                    let c = c as usize;
                    let xb = _mm256_set1_epi16(x.q[c] as i16);
                    for h in 0..4 {
                        // SAFETY: column `c` holds `pad` bytes; 16 bytes at `64 k + 16 h`.
                        let v = unsafe {
                            _mm_loadu_si128(values.as_ptr().add(c * cb + k * CHUNK + 16 * h).cast())
                        };
                        let p = _mm256_mullo_epi16(_mm256_cvtepi8_epi16(v), xb);
                        let a = _mm256_cvtepi16_epi32(_mm256_castsi256_si128(p));
                        let bq = _mm256_cvtepi16_epi32(_mm256_extracti128_si256::<1>(p));
                        s[2 * h] = _mm256_add_epi32(s[2 * h], a);
                        s[2 * h + 1] = _mm256_add_epi32(s[2 * h + 1], bq);
                    }
                }
            } else {
                let (m4, eight) = (_mm256_set1_epi8(0xF), _mm256_set1_epi8(8));
                let mut acc = [_mm256_setzero_si256(); 4];
                for &c in run {
                    let c = c as usize;
                    // SAFETY: column `c < cols` holds `pad / 2` bytes, chunk `k < pad / 64`.
                    let v =
                        unsafe { _mm256_loadu_si256(values.as_ptr().add(c * cb + k * 32).cast()) };
                    let ql = _mm256_sub_epi8(_mm256_and_si256(v, m4), eight);
                    let qh =
                        _mm256_sub_epi8(_mm256_and_si256(_mm256_srli_epi16::<4>(v), m4), eight);
                    let xb = _mm256_set1_epi16(x.q[c] as i16);
                    let parts = [
                        _mm256_castsi256_si128(ql),
                        _mm256_extracti128_si256::<1>(ql),
                        _mm256_castsi256_si128(qh),
                        _mm256_extracti128_si256::<1>(qh),
                    ];
                    for (a, p) in acc.iter_mut().zip(parts) {
                        *a = _mm256_add_epi16(*a, _mm256_mullo_epi16(_mm256_cvtepi8_epi16(p), xb));
                    }
                }
                let back = _mm256_set1_epi32(if kind == QuantKind::Q4_1 {
                    8 * x.sum[b]
                } else {
                    0
                });
                for (j, p) in acc.into_iter().enumerate() {
                    let a = _mm256_cvtepi16_epi32(_mm256_castsi256_si128(p));
                    let bq = _mm256_cvtepi16_epi32(_mm256_extracti128_si256::<1>(p));
                    s[2 * j] = _mm256_add_epi32(a, back);
                    s[2 * j + 1] = _mm256_add_epi32(bq, back);
                }
            }
            let (dx, sx) = (_mm256_set1_ps(x.d[b]), _mm256_set1_ps(x.s[b]));
            for (g, &sg) in s.iter().enumerate() {
                let r = k * CHUNK + 8 * g;
                // SAFETY: row `r + 7 < pad`; the plane holds `pad` scales (Q4_1: then `pad`
                // minimums); `out` holds `chunks.len() * 64` values.
                unsafe {
                    let o = out.as_mut_ptr().add(i * CHUNK + 8 * g);
                    let d = _mm256_cvtph_ps(_mm_loadu_si128(plane.add(2 * r).cast()));
                    let sf = _mm256_cvtepi32_ps(sg);
                    let acc = _mm256_loadu_ps(o);
                    let v = if kind == QuantKind::Q4_1 {
                        let mn = _mm256_cvtph_ps(_mm_loadu_si128(plane.add(2 * (pad + r)).cast()));
                        _mm256_add_ps(
                            acc,
                            _mm256_add_ps(
                                _mm256_mul_ps(_mm256_mul_ps(sf, d), dx),
                                _mm256_mul_ps(mn, sx),
                            ),
                        )
                    } else {
                        _mm256_fmadd_ps(sf, _mm256_mul_ps(d, dx), acc)
                    };
                    _mm256_storeu_ps(o, v);
                }
            }
        }
    }
}
