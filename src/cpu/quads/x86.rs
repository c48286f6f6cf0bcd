//! The AVX-512 VNNI form of the quad product ([`super::QuadsFn`]).
//!
//! Rows go in passes over one slab each. In a pass, each kept quad is one contiguous run of
//! `units x unit` bytes, read start to end: per 32 rows one `vpdpbusd` per 16 rows adds the
//! quad's 4 products into the group's integer sums (an `i32` array on the stack, in L1). After
//! a group the sums are scaled into the K-quants' per-block integer sums, after a block into the
//! outputs, in the dense kernel's order. The kept quads form one stream with jumps, so the
//! kernel asks for the bytes [`AHEAD`] further along that stream (not along memory), one hint
//! per unit, as the dense kernel does along its records.

use std::arch::x86_64::*;
use std::ops::Range;

use super::{
    clamp, format, runs, ActiveQuads, Format, Offsets, QuadMatrix, QUAD, QUAD_ROWS, SLAB_ROWS,
};
use crate::cpu::blocks::BlockKind;
use crate::cpu::quant::QuantizedRow;

/// Units per slab: a pass covers one slab's rows (or a thread's share of them).
const SLAB_UNITS: usize = SLAB_ROWS / QUAD_ROWS;

/// Bytes ahead, along the kept quads, that the kernel asks for (into L2), as the dense kernel's
/// 16 KiB along its records.
const AHEAD: usize = 16 * 1024;

/// # Safety
/// The CPU must have AVX-512F, AVX-512BW, AVX-512VL, AVX-512 VNNI, F16C and FMA.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,f16c,fma")]
pub(crate) unsafe fn product_vnni(
    m: &QuadMatrix,
    units: Range<usize>,
    x: &QuantizedRow,
    active: &ActiveQuads,
    out: &mut [f32],
) {
    // SAFETY: forwarded contract; one monomorphic kernel per value width.
    unsafe {
        match format(m.kind()).bits {
            4 => vnni::<4>(m, units, x, active, out),
            5 => vnni::<5>(m, units, x, active, out),
            6 => vnni::<6>(m, units, x, active, out),
            _ => vnni::<8>(m, units, x, active, out),
        }
    }
}

/// A prefetch cursor [`AHEAD`] bytes along the stream of the kept quads' runs in one pass.
struct Ahead<'a> {
    quads: &'a [u32],
    data: *const u8,
    o: Offsets,
    f: Format,
    /// Where the pass starts in each quad (bytes).
    first: usize,
    /// Bytes of one quad's run in the pass.
    run: usize,
    at: usize,
    off: usize,
    base: *const u8,
}

impl<'a> Ahead<'a> {
    /// The cursor of a pass over units `u0..u0 + units` of the slab at `data` (offsets `o`).
    fn new(
        data: *const u8,
        o: Offsets,
        f: Format,
        quads: &'a [u32],
        u0: usize,
        units: usize,
    ) -> Self {
        let run = (units * f.unit).max(1);
        let mut a = Ahead {
            quads,
            data,
            o,
            f,
            first: u0 * f.unit,
            run,
            at: AHEAD / run,
            off: AHEAD % run,
            base: std::ptr::null(),
        };
        a.locate();
        a
    }

    /// Points `base` at the run of quad `at`, if there is one.
    fn locate(&mut self) {
        if let Some(&q) = self.quads.get(self.at) {
            let at = self.o.quad(q as usize, self.f.planes) + self.first;
            self.base = self.data.wrapping_add(at);
        }
    }

    /// Asks for the next unit's bytes and moves one unit on.
    #[inline(always)]
    fn step(&mut self) {
        if self.at < self.quads.len() {
            let p = self.base.wrapping_add(self.off);
            // SAFETY: prefetches are hints and never fault; SSE is part of x86-64.
            // A unit of 64 bytes needs one hint (its last byte's line: along the stream every
            // line is some unit's last); longer units two.
            unsafe {
                _mm_prefetch::<_MM_HINT_T1>(p.wrapping_add(self.f.unit - 1).cast());
                if self.f.unit > 64 {
                    _mm_prefetch::<_MM_HINT_T1>(p.cast());
                }
            }
        }
        self.off += self.f.unit;
        if self.off >= self.run {
            self.off -= self.run;
            self.at += 1;
            self.locate();
        }
    }
}

/// A unit's 64 values of rows 0-15 and of rows 16-31, unsigned bytes.
#[inline(always)]
unsafe fn unit_values<const BITS: u32>(p: *const u8) -> (__m512i, __m512i) {
    // SAFETY: the caller passes a whole unit (`format(kind).unit` bytes).
    unsafe {
        if BITS == 8 {
            return (
                _mm512_loadu_si512(p.cast()),
                _mm512_loadu_si512(p.add(64).cast()),
            );
        }
        let v = _mm512_loadu_si512(p.cast());
        let low = _mm512_set1_epi8(0x0F);
        let mut lo = _mm512_and_si512(v, low);
        let mut hi = _mm512_and_si512(_mm512_srli_epi16::<4>(v), low);
        let mask = |at: usize| p.add(at).cast::<u64>().read_unaligned();
        if BITS >= 5 {
            let b = _mm512_set1_epi8(0x10);
            lo = _mm512_mask_add_epi8(lo, mask(64), lo, b);
            hi = _mm512_mask_add_epi8(hi, mask(72), hi, b);
        }
        if BITS == 6 {
            let b = _mm512_set1_epi8(0x20);
            lo = _mm512_mask_add_epi8(lo, mask(80), lo, b);
            hi = _mm512_mask_add_epi8(hi, mask(88), hi, b);
        }
        (lo, hi)
    }
}

/// Adds (or, `FIRST`, stores) the products of `N` quads of one group over `units` units from
/// `src` into `isum`: one load and store of the sums per unit for all `N`.
#[inline(always)]
unsafe fn quad_pass<const BITS: u32, const N: usize, const FIRST: bool>(
    src: [*const u8; N],
    units: usize,
    unit: usize,
    xb: [__m512i; N],
    isum: *mut i32,
    ahead: &mut Ahead,
) {
    for k in 0..units {
        for _ in 0..N {
            ahead.step();
        }
        // SAFETY: each `src` starts a run of `units` whole units; `isum` holds `32 units`
        // values.
        unsafe {
            let a = isum.add(QUAD_ROWS * k);
            let (mut a0, mut a1) = match FIRST {
                true => (_mm512_setzero_si512(), _mm512_setzero_si512()),
                false => (
                    _mm512_loadu_si512(a.cast()),
                    _mm512_loadu_si512(a.add(16).cast()),
                ),
            };
            for j in 0..N {
                let (lo, hi) = unit_values::<BITS>(src[j].add(k * unit));
                a0 = _mm512_dpbusd_epi32(a0, lo, xb[j]);
                a1 = _mm512_dpbusd_epi32(a1, hi, xb[j]);
            }
            _mm512_storeu_si512(a.cast(), a0);
            _mm512_storeu_si512(a.add(16).cast(), a1);
        }
    }
}

/// [`quad_pass`] over up to 4 quads, with their input bytes from `xq`.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn quads_pass<const BITS: u32>(
    quads: &[u32],
    first: bool,
    run: impl Fn(usize) -> *const u8,
    xq: &[i8],
    units: usize,
    unit: usize,
    isum: *mut i32,
    ahead: &mut Ahead,
) {
    let x = |i: usize| {
        let q = 4 * quads[i] as usize;
        let b = i32::from_le_bytes([
            xq[q] as u8,
            xq[q + 1] as u8,
            xq[q + 2] as u8,
            xq[q + 3] as u8,
        ]);
        // SAFETY: register-only AVX-512F; the caller runs with it.
        unsafe { _mm512_set1_epi32(b) }
    };
    let src = |i: usize| run(quads[i] as usize);
    macro_rules! pass {
        ($n:literal, $($i:literal),+) => {
            // SAFETY: forwarded contract.
            unsafe {
                match first {
                    true => quad_pass::<BITS, $n, true>([$(src($i)),+], units, unit, [$(x($i)),+], isum, ahead),
                    false => quad_pass::<BITS, $n, false>([$(src($i)),+], units, unit, [$(x($i)),+], isum, ahead),
                }
            }
        };
    }
    match quads.len() {
        1 => pass!(1, 0),
        2 => pass!(2, 0, 1),
        3 => pass!(3, 0, 1, 2),
        _ => pass!(4, 0, 1, 2, 3),
    }
}

/// 16 halves at `p` as floats.
#[inline(always)]
unsafe fn halves(p: *const u8) -> __m512 {
    // SAFETY: the caller passes 32 readable bytes.
    unsafe { _mm512_cvtph_ps(_mm256_loadu_si256(p.cast())) }
}

/// `-v`, the sign bit flipped (as Rust's `-` on each lane).
#[inline(always)]
unsafe fn neg(v: __m512) -> __m512 {
    // SAFETY: register-only AVX-512F operations.
    unsafe {
        let sign = _mm512_set1_epi32(i32::MIN);
        _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(v), sign))
    }
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,f16c,fma")]
unsafe fn vnni<const BITS: u32>(
    m: &QuadMatrix,
    units: Range<usize>,
    x: &QuantizedRow,
    active: &ActiveQuads,
    out: &mut [f32],
) {
    let Some(units) = clamp(m, units, x, out) else {
        return;
    };
    let (kind, f) = (m.kind(), format(m.kind()));
    let xq: &[i8] = if kind.inputs().k { &x.k.q } else { &x.q };
    let (qpg, qpb) = (f.group / QUAD, kind.block_elems() / QUAD);
    let (mut isum, mut sumi, mut summ) = ([0i32; SLAB_ROWS], [0i32; SLAB_ROWS], [0i32; SLAB_ROWS]);
    let mut u = units.start;
    while u < units.end {
        let s = u / SLAB_UNITS;
        let end = ((s + 1) * SLAB_UNITS).min(units.end);
        let (base, o) = m.slab(s);
        let data = m.data()[base..].as_ptr();
        let (u0, n) = (u - s * SLAB_UNITS, (end - u) * QUAD_ROWS);
        let row0 = u0 * QUAD_ROWS;
        let acc = &mut out[(u - units.start) * QUAD_ROWS..][..n];
        acc.fill(0.0);
        let mut ahead = Ahead::new(data, o, f, &active.quads, u0, end - u);
        for block in runs(&active.quads, qpb) {
            let b = block[0] as usize / qpb;
            for (gi, group) in runs(block, qpg).enumerate() {
                let run = |q: usize| data.wrapping_add(o.quad(q, f.planes) + u0 * f.unit);
                for (i, quads) in group.chunks(4).enumerate() {
                    let s = isum.as_mut_ptr();
                    // SAFETY: the slab's run of each quad holds `o.pad / 32` units, of which
                    // `u0..u0 + n / 32` are read; `isum` holds `SLAB_ROWS >= n` values.
                    unsafe {
                        quads_pass::<BITS>(
                            quads,
                            i == 0,
                            run,
                            xq,
                            n / QUAD_ROWS,
                            f.unit,
                            s,
                            &mut ahead,
                        )
                    }
                }
                if kind.inputs().k {
                    let g = group[0] as usize / qpg;
                    let planes = [o.plane(g, 0) + row0, o.plane(g, 1) + row0];
                    // SAFETY: a group's planes hold a byte per row of the slab, rows
                    // `row0..row0 + n` inside; the arrays hold `n` values.
                    unsafe {
                        fold_group(
                            kind,
                            data,
                            planes,
                            x,
                            g,
                            gi == 0,
                            &isum[..n],
                            &mut sumi,
                            &mut summ,
                        )
                    };
                }
            }
            let heads = [o.head(b, 0) + 2 * row0, o.head(b, 1) + 2 * row0];
            // SAFETY: a block's head planes hold a half per row of the slab, rows
            // `row0..row0 + n` inside; `acc` and the arrays hold `n` values.
            unsafe { apply_block(kind, f, data, heads, x, b, &isum, &sumi, &summ, acc) };
        }
        u = end;
    }
}

/// Scales group `g`'s integer sums into the K-quants' per-block sums (`first`: the block's first
/// group, stored rather than added): Q4_K/Q5_K `sumi += sc isum`, `summ += m bsum`; Q6_K
/// `sumi += sc (isum - 32 bsum)`.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
unsafe fn fold_group(
    kind: BlockKind,
    data: *const u8,
    planes: [usize; 2],
    x: &QuantizedRow,
    g: usize,
    first: bool,
    isum: &[i32],
    sumi: &mut [i32],
    summ: &mut [i32],
) {
    let q6 = kind == BlockKind::Q6K;
    let bsum = match q6 {
        true => x.k.bsum[g] as i32,
        false => x.k.bsum[2 * g] as i32 + x.k.bsum[2 * g + 1] as i32,
    };
    // SAFETY: register-only AVX-512F operations; the caller runs with AVX-512F.
    let (off, bs) = unsafe { (_mm512_set1_epi32(32 * bsum), _mm512_set1_epi32(bsum)) };
    for i in (0..isum.len()).step_by(16) {
        // SAFETY: see the caller; `i + 16 <= n` as `n` is a multiple of 32.
        unsafe {
            let s = _mm512_loadu_si512(isum.as_ptr().add(i).cast());
            let sc = _mm_loadu_si128(data.add(planes[0] + i).cast());
            let (si, mm) = match q6 {
                true => (
                    _mm512_mullo_epi32(_mm512_cvtepi8_epi32(sc), _mm512_sub_epi32(s, off)),
                    _mm512_setzero_si512(),
                ),
                false => {
                    let mn = _mm_loadu_si128(data.add(planes[1] + i).cast());
                    (
                        _mm512_mullo_epi32(_mm512_cvtepu8_epi32(sc), s),
                        _mm512_mullo_epi32(_mm512_cvtepu8_epi32(mn), bs),
                    )
                }
            };
            let (pi, pm) = (sumi.as_mut_ptr().add(i), summ.as_mut_ptr().add(i));
            if first {
                _mm512_storeu_si512(pi.cast(), si);
                _mm512_storeu_si512(pm.cast(), mm);
            } else {
                _mm512_storeu_si512(
                    pi.cast(),
                    _mm512_add_epi32(_mm512_loadu_si512(pi.cast()), si),
                );
                _mm512_storeu_si512(
                    pm.cast(),
                    _mm512_add_epi32(_mm512_loadu_si512(pm.cast()), mm),
                );
            }
        }
    }
}

/// Scales block `b`'s sums into `acc` in the dense kernel's order: 32-weight blocks from
/// `isum` (`s = isum - offset * sum(x)`), the K-quants from `sumi`/`summ`.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
unsafe fn apply_block(
    kind: BlockKind,
    f: Format,
    data: *const u8,
    heads: [usize; 2],
    x: &QuantizedRow,
    b: usize,
    isum: &[i32],
    sumi: &[i32],
    summ: &[i32],
    acc: &mut [f32],
) {
    let (d0, d1) = (data.wrapping_add(heads[0]), data.wrapping_add(heads[1]));
    let k = kind.inputs().k;
    let (dx, off, sx) = match k {
        true => (x.k.d[b], 0, 0.0),
        false => (x.d[b], f.offset * x.sum[b], x.s[b]),
    };
    // SAFETY: register-only AVX-512F operations; the caller runs with AVX-512F.
    let (dx, off, sx) = unsafe {
        (
            _mm512_set1_ps(dx),
            _mm512_set1_epi32(off),
            _mm512_set1_ps(sx),
        )
    };
    for i in (0..acc.len()).step_by(16) {
        // SAFETY: see the caller; `i + 16 <= n` as `n` is a multiple of 32.
        unsafe {
            let a = acc.as_mut_ptr().add(i);
            let load = |s: &[i32]| _mm512_loadu_si512(s.as_ptr().add(i).cast());
            let v = _mm512_loadu_ps(a);
            let d = halves(d0.add(2 * i));
            let v = match kind {
                BlockKind::Q4K | BlockKind::Q5K => {
                    let v =
                        _mm512_fmadd_ps(_mm512_cvtepi32_ps(load(sumi)), _mm512_mul_ps(d, dx), v);
                    let dmin = _mm512_mul_ps(halves(d1.add(2 * i)), dx);
                    _mm512_fmadd_ps(neg(_mm512_cvtepi32_ps(load(summ))), dmin, v)
                }
                BlockKind::Q6K => {
                    _mm512_fmadd_ps(_mm512_cvtepi32_ps(load(sumi)), _mm512_mul_ps(d, dx), v)
                }
                BlockKind::Q4_1 | BlockKind::Q5_1 => {
                    let s = _mm512_cvtepi32_ps(load(isum));
                    let t = _mm512_mul_ps(_mm512_mul_ps(s, d), dx);
                    let t = _mm512_add_ps(t, _mm512_mul_ps(halves(d1.add(2 * i)), sx));
                    _mm512_add_ps(v, t)
                }
                _ => {
                    let s = _mm512_cvtepi32_ps(_mm512_sub_epi32(load(isum), off));
                    _mm512_fmadd_ps(s, _mm512_mul_ps(d, dx), v)
                }
            };
            _mm512_storeu_ps(a, v);
        }
    }
}
