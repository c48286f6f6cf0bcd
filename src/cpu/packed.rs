//! Row-interleaved GGUF blocks for dense matrix-vector (and small matrix-matrix) products.
//!
//! A matrix of `rows x cols` Q4_0 / Q4_1 / Q8_0 weights is stored in groups of [`PACK`] = 16
//! rows. For group `g` and 32-column block `b`, one record holds the 16 rows' block scales (f16,
//! 32 bytes), for Q4_1 their minimums (f16, 32 bytes), then the quantized values as 64-byte chunks:
//! chunk `c`, lane `l` is the `c`-th 4-byte word of row `16 g + l`'s block values. One vector load
//! thus holds 4 consecutive weights of 16 rows, and one `vpdpbusd` against the broadcast 4 input
//! values of those columns adds 4 products into each row's lane: no horizontal sums, and the
//! input is read once per group. The bytes per weight are the file's (18, 20 or 34 per 32);
//! only their order changes. For Q4 blocks a word holds low nibbles (columns `4c..4c + 4`) and high
//! nibbles (columns `16 + 4c..`) as GGUF stores them; Q8_0 values are stored offset by 128 (`w ^
//! 0x80`) so they are the unsigned operand, and the offset comes back out as `128 * sum(x)`.
//!
//! Per row and block the integer sum is exact, and the scaling is ggml's, in ggml's order: Q4_1
//! `acc += (sum * d_w) * d_x + m_w * s_x` (non-fused, as candle's quantized matmul computes it,
//! so a Q4_1 product is bit-identical to candle's), Q4_0 and Q8_0 `acc = fma(sum', d_w * d_x, acc)`.
//! Every tier gives the same bits as the scalar reference.
//!
//! Rows past `rows` in the last group are zero (scale 0) and are computed and dropped.

use std::ops::Range;

use half::f16;

use super::quant::{QuantKind, QuantizedRow, QK};
use crate::error::{Error, Result};

/// Rows per interleaved group.
pub const PACK: usize = 16;

/// A `rows x cols` matrix of GGUF blocks in row-interleaved groups (see the module docs).
#[derive(Clone)]
pub struct PackedRows {
    kind: QuantKind,
    rows: usize,
    cols: usize,
    data: Vec<u8>,
}

impl std::fmt::Debug for PackedRows {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PackedRows")
            .field("kind", &self.kind)
            .field("rows", &self.rows)
            .field("cols", &self.cols)
            .finish()
    }
}

/// Bytes of the scale (and minimum) planes at the start of a group record.
pub(crate) const fn scale_bytes(kind: QuantKind) -> usize {
    match kind {
        QuantKind::Q4_1 => 4 * PACK,
        _ => 2 * PACK,
    }
}

/// Bytes of one group record (16 rows x one 32-column block).
pub(crate) const fn record_bytes(kind: QuantKind) -> usize {
    match kind {
        QuantKind::Q4_0 => 18 * PACK,
        QuantKind::Q4_1 => 20 * PACK,
        QuantKind::Q8_0 => 34 * PACK,
    }
}

/// Packed rows are whole 32-column blocks.
fn check_cols(cols: usize) -> Result<()> {
    if cols == 0 || !cols.is_multiple_of(QK) {
        return Err(Error::shape(
            "packed matrix columns (a multiple of 32)",
            &[None],
            &[cols],
        ));
    }
    Ok(())
}

impl PackedRows {
    /// Packs `rows` rows of `cols` weights given in GGUF's row-major block layout (`src` holds
    /// `rows * kind.row_bytes(cols)` bytes; `cols` a positive multiple of 32).
    pub fn pack(kind: QuantKind, rows: usize, cols: usize, src: &[u8]) -> Result<Self> {
        check_cols(cols)?;
        let rb = kind.row_bytes(cols);
        if src.len() != rows * rb {
            return Err(Error::shape(
                "packed matrix bytes (rows * row bytes)",
                &[Some(rows * rb)],
                &[src.len()],
            ));
        }
        Self::pack_with(kind, rows, cols, |first, chunk| {
            chunk.copy_from_slice(&src[first * rb..][..chunk.len()]);
            Ok(())
        })
    }

    /// [`PackedRows::pack`] with the rows read in groups of [`PACK`]: `read(first, chunk)` fills
    /// `chunk` with the bytes of the rows from `first` on (e.g. from a file), so only one group
    /// is held besides the packed matrix.
    pub fn pack_with(
        kind: QuantKind,
        rows: usize,
        cols: usize,
        mut read: impl FnMut(usize, &mut [u8]) -> Result<()>,
    ) -> Result<Self> {
        check_cols(cols)?;
        let rb = kind.row_bytes(cols);
        let nb = cols / QK;
        let groups = rows.div_ceil(PACK);
        let (rec, sb) = (record_bytes(kind), scale_bytes(kind));
        let mut data = vec![0u8; groups * nb * rec];
        let mut chunk = vec![0u8; PACK * rb];
        for g in 0..groups {
            let n = PACK.min(rows - g * PACK);
            let chunk = &mut chunk[..n * rb];
            read(g * PACK, chunk)?;
            for l in 0..n {
                for b in 0..nb {
                    let blk = &chunk[l * rb + b * kind.block_bytes()..][..kind.block_bytes()];
                    let out = &mut data[(g * nb + b) * rec..][..rec];
                    out[2 * l..2 * l + 2].copy_from_slice(&blk[..2]);
                    let vals = match kind {
                        QuantKind::Q4_1 => {
                            out[2 * PACK + 2 * l..2 * PACK + 2 * l + 2].copy_from_slice(&blk[2..4]);
                            &blk[4..]
                        }
                        _ => &blk[2..],
                    };
                    for (c, word) in vals.chunks_exact(4).enumerate() {
                        let dst = &mut out[sb + 64 * c + 4 * l..][..4];
                        dst.copy_from_slice(word);
                        if kind == QuantKind::Q8_0 {
                            dst.iter_mut().for_each(|v| *v ^= 0x80);
                        }
                    }
                }
            }
        }
        Ok(PackedRows {
            kind,
            rows,
            cols,
            data,
        })
    }

    /// Packs several matrices with the same block type and width as one, rows stacked in order
    /// (e.g. the q, k and v projections, so one pass computes all three).
    pub fn stack(kind: QuantKind, cols: usize, parts: &[(usize, &[u8])]) -> Result<Self> {
        // One part is packed from where it lies: no copy of a whole matrix at load.
        if let [(rows, bytes)] = parts {
            return Self::pack(kind, *rows, cols, bytes);
        }
        let rows = parts.iter().map(|p| p.0).sum();
        let mut src = Vec::with_capacity(rows * kind.row_bytes(cols));
        for (r, bytes) in parts {
            if bytes.len() != r * kind.row_bytes(cols) {
                return Err(Error::shape(
                    "stacked matrix bytes (rows * row bytes)",
                    &[Some(r * kind.row_bytes(cols))],
                    &[bytes.len()],
                ));
            }
            src.extend_from_slice(bytes);
        }
        Self::pack(kind, rows, cols, &src)
    }

    /// The block type.
    pub fn kind(&self) -> QuantKind {
        self.kind
    }

    /// Rows (output features).
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Columns (input features).
    pub fn cols(&self) -> usize {
        self.cols
    }

    /// Groups of [`PACK`] rows.
    pub fn groups(&self) -> usize {
        self.rows.div_ceil(PACK)
    }

    /// 32-column blocks per row.
    pub fn blocks(&self) -> usize {
        self.cols / QK
    }

    /// Bytes held (the file's bytes for these rows, plus the padding of the last group).
    pub fn bytes(&self) -> usize {
        self.data.len()
    }

    pub(crate) fn data(&self) -> &[u8] {
        &self.data
    }

    /// Row `r` dequantized into `out` (`cols` values): an embedding lookup. `None` if `r` is out of
    /// range or `out` has the wrong length.
    pub fn dequantize_row(&self, r: usize, out: &mut [f32]) -> Option<()> {
        if r >= self.rows || out.len() != self.cols {
            return None;
        }
        let (g, l, nb) = (r / PACK, r % PACK, self.blocks());
        let (rec, sb) = (record_bytes(self.kind), scale_bytes(self.kind));
        for (b, o) in out.chunks_exact_mut(QK).enumerate() {
            let recd = &self.data[(g * nb + b) * rec..][..rec];
            let d = f16::from_le_bytes([recd[2 * l], recd[2 * l + 1]]).to_f32();
            let word = |c: usize| &recd[sb + 64 * c + 4 * l..][..4];
            match self.kind {
                QuantKind::Q8_0 => {
                    for c in 0..8 {
                        for (j, &v) in word(c).iter().enumerate() {
                            o[4 * c + j] = ((v ^ 0x80) as i8) as f32 * d;
                        }
                    }
                }
                QuantKind::Q4_0 | QuantKind::Q4_1 => {
                    let m = match self.kind {
                        QuantKind::Q4_1 => {
                            f16::from_le_bytes([recd[2 * PACK + 2 * l], recd[2 * PACK + 2 * l + 1]])
                                .to_f32()
                        }
                        _ => -8.0 * d,
                    };
                    for c in 0..4 {
                        for (j, &v) in word(c).iter().enumerate() {
                            o[4 * c + j] = d * (v & 0xF) as f32 + m;
                            o[16 + 4 * c + j] = d * (v >> 4) as f32 + m;
                        }
                    }
                }
            }
        }
        Some(())
    }
}

/// The integer sum `sum_j w[r][32 b + j] * q[32 b + j]` of lane `l` in record `rec`, with Q8_0's
/// offset and Q4_0's `- 8` taken out: exactly `sum w x` over the block's stored integers.
fn block_sum(kind: QuantKind, rec: &[u8], l: usize, xq: &[i8], xsum: i32) -> i32 {
    let sb = scale_bytes(kind);
    let word = |c: usize| &rec[sb + 64 * c + 4 * l..][..4];
    let mut s = 0i32;
    match kind {
        QuantKind::Q8_0 => {
            for c in 0..8 {
                for (j, &v) in word(c).iter().enumerate() {
                    s += v as i32 * xq[4 * c + j] as i32;
                }
            }
            s - 128 * xsum
        }
        QuantKind::Q4_0 | QuantKind::Q4_1 => {
            for c in 0..4 {
                for (j, &v) in word(c).iter().enumerate() {
                    s += (v & 0xF) as i32 * xq[4 * c + j] as i32
                        + (v >> 4) as i32 * xq[16 + 4 * c + j] as i32;
                }
            }
            if kind == QuantKind::Q4_0 {
                s - 8 * xsum
            } else {
                s
            }
        }
    }
}

/// The scalar reference of [`gemm`]: every lane and block in the documented order.
pub(crate) fn gemm_scalar(
    p: &PackedRows,
    groups: Range<usize>,
    xs: &[QuantizedRow],
    out: &mut [f32],
) {
    let (kind, nb) = (p.kind, p.blocks());
    let rec = record_bytes(kind);
    let nx = xs.len();
    let h16 = |b: &[u8], at: usize| f16::from_le_bytes([b[at], b[at + 1]]).to_f32();
    for (gi, g) in groups.enumerate() {
        for (r, x) in xs.iter().enumerate() {
            let Some(o) = out.get_mut((gi * nx + r) * PACK..(gi * nx + r + 1) * PACK) else {
                return;
            };
            for (l, o) in o.iter_mut().enumerate() {
                let mut acc = 0f32;
                for b in 0..nb.min(x.blocks()) {
                    let recd = &p.data[(g * nb + b) * rec..][..rec];
                    let s = block_sum(kind, recd, l, &x.q[b * QK..(b + 1) * QK], x.sum[b]);
                    let d = h16(recd, 2 * l);
                    acc = match kind {
                        QuantKind::Q4_1 => {
                            acc + ((s as f32 * d) * x.d[b] + h16(recd, 2 * PACK + 2 * l) * x.s[b])
                        }
                        _ => (s as f32).mul_add(d * x.d[b], acc),
                    };
                }
                *o = acc;
            }
        }
    }
}

/// The groups of `p` a kernel may compute into `out` for `nx` input rows: `groups` cut to the
/// matrix and to what `out` holds.
pub(crate) fn clamp_groups(
    p: &PackedRows,
    groups: Range<usize>,
    nx: usize,
    out: &[f32],
) -> Range<usize> {
    let end = groups.end.min(p.groups());
    let fit = if nx == 0 { 0 } else { out.len() / (nx * PACK) };
    let end = end.min(groups.start + fit);
    groups.start.min(end)..end
}

/// `out[((g - groups.start) * xs.len() + r) * 16 + l] = row (16 g + l) . xs[r]` for the groups in
/// `groups`, with the kernels of `k`. Inputs with fewer blocks than the matrix, groups past the
/// matrix or an `out` too short are cut to what fits (never read or written out of bounds).
pub(crate) fn gemm(
    k: &super::Kernels,
    p: &PackedRows,
    groups: Range<usize>,
    xs: &[QuantizedRow],
    out: &mut [f32],
) {
    let groups = clamp_groups(p, groups, xs.len(), out);
    if groups.is_empty() {
        return;
    }
    if xs
        .iter()
        .any(|x| x.blocks() < p.blocks() || x.q.len() < p.cols)
    {
        // A short input row: the reference cuts each row to its own blocks.
        return gemm_scalar(p, groups, xs, out);
    }
    (k.gemm_q)(p, groups, xs, out)
}

#[cfg(target_arch = "x86_64")]
pub(crate) mod x86 {
    //! AVX-512 VNNI and AVX2 forms of [`super::gemm`]. Callers guarantee (see `super::gemm`):
    //! `groups` lies inside the matrix, every input row has at least the matrix's blocks, and
    //! `out` holds `groups.len() * xs.len() * 16` values.
    use std::arch::x86_64::*;
    use std::ops::Range;

    use super::{record_bytes, scale_bytes, PackedRows, PACK};
    use crate::cpu::quant::{QuantKind, QuantizedRow, QK};

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
            match p.kind().index() {
                0 => vnni::<0>(p, groups, xs, out),
                1 => vnni::<1>(p, groups, xs, out),
                _ => vnni::<2>(p, groups, xs, out),
            }
        }
    }

    /// How far ahead of the record being read the kernels prefetch (a hint: it never faults,
    /// also past the end of the matrix).
    const PREFETCH_BYTES: usize = 2048;

    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
    unsafe fn vnni<const K: usize>(
        p: &PackedRows,
        groups: Range<usize>,
        xs: &[QuantizedRow],
        out: &mut [f32],
    ) {
        let nb = p.blocks();
        let rec = record_bytes(QuantKind::ALL[K]);
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
        let kind = QuantKind::ALL[K];
        let (rec, sb) = (record_bytes(kind), scale_bytes(kind));
        // SAFETY: records `0..nb` of this group are in bounds (caller); each input row has `nb`
        // blocks of 32 values; `out` holds `T * 16` floats.
        unsafe {
            let mut acc = [_mm512_setzero_ps(); T];
            let nib = _mm512_set1_epi8(0x0F);
            for b in 0..nb {
                let base = gbase.add(b * rec);
                // Stream ahead: records are read once, in address order.
                let ahead = base.add(PREFETCH_BYTES);
                let mut off = 0;
                while off < rec {
                    _mm_prefetch::<_MM_HINT_T0>(ahead.add(off).cast());
                    off += 64;
                }
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
                    if K == 1 {
                        let m = _mm512_cvtph_ps(_mm256_loadu_si256(base.add(2 * PACK).cast()));
                        let t1 = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(s), dw), dx);
                        let t2 = _mm512_mul_ps(m, _mm512_set1_ps(*x.s.get_unchecked(b)));
                        acc[t] = _mm512_add_ps(acc[t], _mm512_add_ps(t1, t2));
                    } else {
                        let off = if K == 0 { 8 } else { 128 };
                        s = _mm512_sub_epi32(s, _mm512_set1_epi32(off * *x.sum.get_unchecked(b)));
                        acc[t] =
                            _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(dw, dx), acc[t]);
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
            match p.kind().index() {
                0 => avx2::<0>(p, groups, xs, out),
                1 => avx2::<1>(p, groups, xs, out),
                _ => avx2::<2>(p, groups, xs, out),
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
        let kind = QuantKind::ALL[K];
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
                                // 4-bit products: 8 pair sums of at most 2 * 15 * 128 fit i16.
                                let mut p = _mm256_setzero_si256();
                                for c in 0..4 {
                                    let v = _mm256_loadu_si256(qs.add(64 * c).cast());
                                    let lo = _mm256_and_si256(v, nib);
                                    let hi = _mm256_and_si256(_mm256_srli_epi16::<4>(v), nib);
                                    p = _mm256_add_epi16(p, _mm256_maddubs_epi16(lo, bx(c)));
                                    p = _mm256_add_epi16(p, _mm256_maddubs_epi16(hi, bx(4 + c)));
                                }
                                let s = _mm256_madd_epi16(p, ones);
                                if K == 0 {
                                    _mm256_sub_epi32(s, _mm256_set1_epi32(8 * x.sum[b]))
                                } else {
                                    s
                                }
                            };
                            let dx = _mm256_set1_ps(x.d[b]);
                            acc = if K == 1 {
                                let m = _mm256_cvtph_ps(_mm_loadu_si128(
                                    base.add(2 * PACK + 16 * h).cast(),
                                ));
                                let t1 =
                                    _mm256_mul_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(s), dw), dx);
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
}
