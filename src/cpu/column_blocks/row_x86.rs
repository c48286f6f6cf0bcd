//! The AVX-512 VNNI form of the one-row column-block product ([`super::ColumnBlocksFn`]).
//!
//! Rows go slab by slab. In a slab, the kept channels are walked in *passes*: up to 16 channels
//! of one scale group over the slab's rows (or a thread's share of them). Per 32 rows,
//! a pass gathers its channels four at a time into the operand of `vpdpbusd` (16 rows x 4
//! channels per vector, see [`super::x86`]) and adds their products to the group's integer sums.
//! A group's first pass starts the sums, later passes add to them (in a per-thread array), and
//! its last pass finishes them while they are still in registers: the K-quants' groups are
//! scaled into the block's integer sums (the block's last group scales those into the outputs),
//! the 32-weight blocks straight into the outputs, with the dense kernel's operations in its
//! order, so the product is the dense one bit for bit.
//!
//! For 4-bit values the high nibble is not shifted down: `v & 0xF0` is 16 times the value, so
//! rows 16-31 of a unit sum 16 times their products (exact: every term is a multiple of 16) and
//! are shifted back once per group, when the sums finish.
//!
//! The kept channels' runs form one stream with jumps between passes, which the hardware
//! prefetchers do not follow well. So while a pass walks its rows, it asks (into L2) for what
//! the next pass reads: its runs, and the byte or f16 planes its finish reads. The layout starts on a
//! cache line, so no 32-byte load of a run straddles two (unaligned, the kernel read 29 GB/s a
//! core from L3 on Qwen2.5-1.5B's gate instead of 35).

use std::arch::x86_64::*;
use std::ops::Range;

use super::x86::{gather, gather_pair, halves, neg, INTERLEAVE, PAIRS};
use super::{clamp, format, runs, ActiveChannels, ColumnBlocks, Offsets};
use super::{SLAB_ROWS, UNIT_ROWS};
use crate::cpu::blocks::BlockKind;
use crate::cpu::quant::QuantizedRow;

/// Channels per pass at most: they share one load and store of the group's sums per unit of
/// rows, and they are the runs streamed at once. Measured from DRAM on Qwen2.5-1.5B's gate (Q4_K,
/// 2 threads, one matrix each, 80% kept; time against the dense kernel's) and down (60% kept):
/// 8 channels 1.00-1.72x and 1.06-1.08x, 16 channels 0.88-1.03x and 0.98-1.00x, 32 (a whole
/// group in registers) 1.23-1.38x and 1.01-1.05x; from L3 16 and 32 read 35 and 34 GB/s a core,
/// 8 read 31.
const PASS_CHANNELS: usize = 16;

/// # Safety
/// The CPU must have AVX-512F/BW/VL/VNNI and what [`super::x86::supported`] checks.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx512vbmi,avx512bitalg,f16c,fma")]
pub(crate) unsafe fn product_vnni(
    m: &ColumnBlocks,
    units: Range<usize>,
    x: &QuantizedRow,
    active: &ActiveChannels,
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

/// How a pass ends.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Finish {
    /// Stores the group's sums for its next pass.
    Store,
    /// The last pass of a K-quant group: scales its sums into the block's (`first`: the
    /// block's first group, which starts them); at the block's last group (`last`), scales those
    /// into the outputs instead of storing them.
    Fold { first: bool, last: bool },
    /// The last pass of a 32-weight block: scales its sums into the outputs.
    Apply,
}

/// One pass: kept channels `active.channels[chans]` of group `g` (in block `b`).
#[derive(Clone, Copy)]
struct Pass {
    chans: (u32, u32),
    g: u32,
    b: u32,
    /// Adds to the sums an earlier pass of the group stored.
    load: bool,
    finish: Finish,
}

/// The passes over `channels` (ascending) for a matrix of `kind`, in order, into `passes`.
fn plan(kind: BlockKind, channels: &[u32], passes: &mut Vec<Pass>) {
    passes.clear();
    let f = format(kind);
    let (per_group, per_block) = (f.group, kind.block_elems());
    let k = kind.inputs().k;
    let mut at = 0u32;
    for block in runs(channels, per_block) {
        let b = block[0] / per_block as u32;
        let groups = runs(block, per_group).count();
        for (gi, group) in runs(block, per_group).enumerate() {
            let g = group[0] / per_group as u32;
            let n = group.chunks(PASS_CHANNELS).count();
            for (i, c) in group.chunks(PASS_CHANNELS).enumerate() {
                let finish = match (i + 1 == n, k) {
                    (false, _) => Finish::Store,
                    (true, true) => Finish::Fold {
                        first: gi == 0,
                        last: gi + 1 == groups,
                    },
                    (true, false) => Finish::Apply,
                };
                let len = c.len() as u32;
                passes.push(Pass {
                    chans: (at, at + len),
                    g,
                    b,
                    load: i > 0,
                    finish,
                });
                at += len;
            }
        }
    }
}

/// What a pass's finish reads and writes, at its first row: the group's byte planes and the
/// block's f16 planes, the input's factors, the per-thread sums and the outputs.
#[derive(Clone, Copy)]
struct Fin {
    finish: Finish,
    kind: BlockKind,
    /// The group's scale and minimum planes (K-quants).
    sc: *const u8,
    mn: *const u8,
    /// The block's f16 planes (`d`, and `dmin` or `m`).
    d0: *const u8,
    d1: *const u8,
    /// Q6_K `32 bsum`; 32-weight blocks `offset * sum(x)`.
    off: __m512i,
    /// Q4_K/Q5_K: the group's input sum.
    bsum: __m512i,
    /// The input block's scale `d` and (Q4_1/Q5_1) `s`.
    dx: __m512,
    sx: __m512,
    isum: *mut i32,
    sumi: *mut i32,
    summ: *mut i32,
    acc: *mut f32,
}

impl Fin {
    /// Ends the sums `a` of rows `l..l + 16` (counted from the pass's first row; `SHIFT`: 4-bit
    /// high-nibble rows, 16 times their value, shifted back before they are scaled).
    ///
    /// # Safety
    /// The planes hold the pass's rows, the sums and outputs `l + 16` values.
    #[inline(always)]
    unsafe fn end<const SHIFT: bool>(&self, l: usize, a: __m512i) {
        // SAFETY: the caller's contract; register-only AVX-512 otherwise.
        unsafe {
            let a = match (self.finish, SHIFT) {
                (Finish::Store, _) => {
                    _mm512_storeu_si512(self.isum.add(l).cast(), a);
                    return;
                }
                (_, true) => _mm512_srai_epi32::<4>(a),
                (_, false) => a,
            };
            let acc = self.acc.add(l);
            let d = halves(self.d0.add(2 * l));
            match self.finish {
                Finish::Fold { first, last } => {
                    let sc = _mm_loadu_si128(self.sc.add(l).cast());
                    let q6 = self.kind == BlockKind::Q6K;
                    let mut si = match q6 {
                        true => _mm512_mullo_epi32(
                            _mm512_cvtepi8_epi32(sc),
                            _mm512_sub_epi32(a, self.off),
                        ),
                        false => _mm512_mullo_epi32(_mm512_cvtepu8_epi32(sc), a),
                    };
                    let mut mm = match q6 {
                        true => _mm512_setzero_si512(),
                        false => {
                            let mn = _mm_loadu_si128(self.mn.add(l).cast());
                            _mm512_mullo_epi32(_mm512_cvtepu8_epi32(mn), self.bsum)
                        }
                    };
                    let (pi, pm) = (self.sumi.add(l), self.summ.add(l));
                    if !first {
                        si = _mm512_add_epi32(_mm512_loadu_si512(pi.cast()), si);
                        mm = _mm512_add_epi32(_mm512_loadu_si512(pm.cast()), mm);
                    }
                    if !last {
                        _mm512_storeu_si512(pi.cast(), si);
                        _mm512_storeu_si512(pm.cast(), mm);
                        return;
                    }
                    let v = _mm512_loadu_ps(acc);
                    let v = _mm512_fmadd_ps(_mm512_cvtepi32_ps(si), _mm512_mul_ps(d, self.dx), v);
                    let v = match q6 {
                        true => v,
                        false => {
                            let dmin = _mm512_mul_ps(halves(self.d1.add(2 * l)), self.dx);
                            _mm512_fmadd_ps(neg(_mm512_cvtepi32_ps(mm)), dmin, v)
                        }
                    };
                    _mm512_storeu_ps(acc, v);
                }
                _ => {
                    let v = _mm512_loadu_ps(acc);
                    let v = match self.kind {
                        BlockKind::Q4_1 | BlockKind::Q5_1 => {
                            let s = _mm512_cvtepi32_ps(a);
                            let t = _mm512_mul_ps(_mm512_mul_ps(s, d), self.dx);
                            let m = halves(self.d1.add(2 * l));
                            _mm512_add_ps(v, _mm512_add_ps(t, _mm512_mul_ps(m, self.sx)))
                        }
                        _ => {
                            let s = _mm512_cvtepi32_ps(_mm512_sub_epi32(a, self.off));
                            _mm512_fmadd_ps(s, _mm512_mul_ps(d, self.dx), v)
                        }
                    };
                    _mm512_storeu_ps(acc, v);
                }
            }
        }
    }
}

/// What the next pass reads: up to 16 channels' runs and 4 planes, each a pointer at the pass's
/// first row and its lines there, asked for (into L2) during the pass before, a line of every
/// stream per step, up to [`LEAD`] lines each. The hardware prefetchers do not follow a pass's
/// runs well enough: asking for the next pass's first 8 lines only, Qwen2.5-1.5B's down (Q4_K,
/// 60% kept, 768-byte runs on 1 thread) read 45% of the dense kernel's GB/s from DRAM, asking
/// for all of its runs 72-81%; its gate on 1 thread (4.4 KiB runs) 58-67% with 24 lines, 70-75%
/// with 72.
#[derive(Clone, Copy)]
struct Next {
    at: [(*const u8, usize); 20],
    len: usize,
    /// The next line to ask for, and the most lines of a stream.
    line: usize,
    lines: usize,
}

/// Lines of a stream of the next pass asked for ahead at most (6 KiB: a whole run of the 7B
/// shape's 11008-row matrices, 4 bits).
const LEAD: usize = 96;

impl Next {
    const NONE: Next = Next {
        at: [(std::ptr::null(), 0); 20],
        len: 0,
        line: 0,
        lines: 0,
    };

    /// A stream of `bytes` bytes at `p`.
    fn push(&mut self, p: *const u8, bytes: usize) {
        let lines = (bytes.div_ceil(64) + 1).min(LEAD);
        self.at[self.len] = (p, lines);
        self.len += 1;
        self.lines = self.lines.max(lines);
    }

    /// Asks for one more line of every stream that has it.
    #[inline(always)]
    fn ask(&mut self) {
        if self.line < self.lines {
            for &(p, lines) in &self.at[..self.len] {
                if self.line < lines {
                    let p = p.wrapping_add(64 * self.line);
                    // SAFETY: prefetches are hints and never fault; SSE is part of x86-64.
                    unsafe { _mm_prefetch::<_MM_HINT_T1>(p.cast()) };
                }
            }
            self.line += 1;
        }
    }
}

/// A pass of `N` gathers of four channels (`src`: where each channel's run starts at the pass's
/// first row; `xb`: their input bytes as `vpdpbusd` words) over `units` units.
///
/// # Safety
/// Each `src` starts `units` whole units (and 32 readable bytes past the last for 5 and 6
/// bits); `fin` as [`Fin::end`] for `32 units` rows.
#[inline(always)]
unsafe fn pass<const BITS: u32, const N: usize>(
    src: [[*const u8; 4]; N],
    xb: [__m512i; N],
    units: usize,
    load: bool,
    fin: &Fin,
    mut next: Next,
) {
    let unit = format_unit(BITS);
    // SAFETY: constant tables of 64 bytes.
    let (idx, pairs) = unsafe {
        (
            _mm512_loadu_si512(INTERLEAVE.as_ptr().cast()),
            PAIRS.map(|t| _mm512_loadu_si512(t.as_ptr().cast())),
        )
    };
    let isum = fin.isum;
    let mut k = 0;
    // 4-bit values two units at a time: each channel's pair is one 32-byte load.
    while BITS == 4 && k + 2 <= units {
        next.ask();
        // SAFETY: the caller's contract: `k + 2 <= units`.
        unsafe {
            let a = isum.add(UNIT_ROWS * k);
            let mut acc = match load {
                false => [_mm512_setzero_si512(); 4],
                true => [0, 16, 32, 48].map(|i| _mm512_loadu_si512(a.add(i).cast())),
            };
            for j in 0..N {
                let [l0, h0, l1, h1] = gather_pair(src[j].map(|p| p.add(k * unit)), pairs);
                acc[0] = _mm512_dpbusd_epi32(acc[0], l0, xb[j]);
                acc[1] = _mm512_dpbusd_epi32(acc[1], h0, xb[j]);
                acc[2] = _mm512_dpbusd_epi32(acc[2], l1, xb[j]);
                acc[3] = _mm512_dpbusd_epi32(acc[3], h1, xb[j]);
            }
            let l = UNIT_ROWS * k;
            fin.end::<false>(l, acc[0]);
            fin.end::<true>(l + 16, acc[1]);
            fin.end::<false>(l + 32, acc[2]);
            fin.end::<true>(l + 48, acc[3]);
        }
        k += 2;
    }
    while k < units {
        next.ask();
        // SAFETY: the caller's contract: `k < units`.
        unsafe {
            let a = isum.add(UNIT_ROWS * k);
            let (mut a0, mut a1) = match load {
                false => (_mm512_setzero_si512(), _mm512_setzero_si512()),
                true => (
                    _mm512_loadu_si512(a.cast()),
                    _mm512_loadu_si512(a.add(16).cast()),
                ),
            };
            for j in 0..N {
                let (lo, hi) = gather::<BITS>(src[j].map(|p| p.add(k * unit)), idx);
                let hi = match BITS {
                    // As `gather_pair`: the high nibble unshifted.
                    4 => _mm512_slli_epi16::<4>(hi),
                    _ => hi,
                };
                a0 = _mm512_dpbusd_epi32(a0, lo, xb[j]);
                a1 = _mm512_dpbusd_epi32(a1, hi, xb[j]);
            }
            let l = UNIT_ROWS * k;
            fin.end::<false>(l, a0);
            if BITS == 4 {
                fin.end::<true>(l + 16, a1);
            } else {
                fin.end::<false>(l + 16, a1);
            }
        }
        k += 1;
    }
}

/// Bytes of a unit of `bits`-wide values.
const fn format_unit(bits: u32) -> usize {
    match bits {
        4 => 16,
        5 => 20,
        6 => 24,
        _ => 32,
    }
}

/// Where each channel's run starts at a pass's first row.
#[derive(Clone, Copy)]
struct Runs {
    /// The slab's data, moved on to the pass's first unit.
    data: *const u8,
    o: Offsets,
    planes: usize,
}

impl Runs {
    #[inline(always)]
    fn at(&self, c: u32) -> *const u8 {
        self.data
            .wrapping_add(self.o.column(c as usize, self.planes))
    }
}

/// [`pass`] over up to 16 channels (`run.at(c)`: where channel `c`'s run starts at the pass's first
/// row), their input bytes from `xq`; channels past a multiple of four are padded with the first
/// one against an input byte of 0.
///
/// # Safety
/// As [`pass`].
#[inline(always)]
unsafe fn channels_pass<const BITS: u32>(
    channels: &[u32],
    run: Runs,
    xq: &[i8],
    units: usize,
    load: bool,
    fin: &Fin,
    next: Next,
) {
    // Written without closures: a closure has no target features, so the intrinsics (and the
    // offset arithmetic around them) would become calls.
    let mut src = [[run.at(channels[0]); 4]; 4];
    let mut words = [[0u8; 4]; 4];
    for (i, &c) in channels.iter().enumerate().take(16) {
        src[i / 4][i % 4] = run.at(c);
        words[i / 4][i % 4] = xq[c as usize] as u8;
    }
    macro_rules! pass {
        ($n:literal, $($j:literal),+) => {{
            let src = [$(src[$j]),+];
            // SAFETY: register-only AVX-512F; the caller runs with it.
            let xb = unsafe { [$(_mm512_set1_epi32(i32::from_le_bytes(words[$j]))),+] };
            // SAFETY: forwarded contract.
            unsafe { pass::<BITS, $n>(src, xb, units, load, fin, next) }
        }};
    }
    match channels.len().div_ceil(4) {
        1 => pass!(1, 0),
        2 => pass!(2, 0, 1),
        3 => pass!(3, 0, 1, 2),
        _ => pass!(4, 0, 1, 2, 3),
    }
}

thread_local! {
    /// The integer sums of one slab's rows, per group (`isum`) and per block (the K-quants'
    /// `sumi`, `summ`), and the passes, once per thread.
    static SCRATCH: std::cell::RefCell<(Vec<i32>, Vec<Pass>)> =
        std::cell::RefCell::new((vec![0; 3 * SLAB_ROWS], Vec::new()));
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx512vbmi,avx512bitalg,f16c,fma")]
unsafe fn vnni<const BITS: u32>(
    m: &ColumnBlocks,
    units: Range<usize>,
    x: &QuantizedRow,
    active: &ActiveChannels,
    out: &mut [f32],
) {
    let Some(units) = clamp(m, units, x, out) else {
        return;
    };
    SCRATCH.with_borrow_mut(|(sums, passes)| {
        plan(m.kind(), &active.channels, passes);
        let (isum, rest) = sums.split_at_mut(SLAB_ROWS);
        let (sumi, summ) = rest.split_at_mut(SLAB_ROWS);
        let mut u = units.start;
        while u < units.end {
            let (su, s) = (m.slab_units(), u / m.slab_units());
            let end = ((s + 1) * su).min(units.end);
            let acc = &mut out[(u - units.start) * UNIT_ROWS..][..(end - u) * UNIT_ROWS];
            acc.fill(0.0);
            let sums = [isum.as_mut_ptr(), sumi.as_mut_ptr(), summ.as_mut_ptr()];
            // SAFETY: forwarded contract; the sums hold a slab's rows, `acc` the units'.
            unsafe { slab::<BITS>(m, s, u - s * su..end - s * su, x, active, passes, sums, acc) };
            u = end;
        }
    })
}

/// Units `units` of slab `s` over `passes`, into `acc`.
///
/// # Safety
/// As [`product_vnni`]; `units` inside the slab, each of `sums` holding its rows, `acc` its
/// rows.
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx512vbmi,avx512bitalg,f16c,fma")]
unsafe fn slab<const BITS: u32>(
    m: &ColumnBlocks,
    s: usize,
    units: Range<usize>,
    x: &QuantizedRow,
    active: &ActiveChannels,
    passes: &[Pass],
    sums: [*mut i32; 3],
    acc: &mut [f32],
) {
    let (kind, f) = (m.kind(), format(m.kind()));
    let k = kind.inputs().k;
    let xq: &[i8] = if k { &x.k.q } else { &x.q };
    let (base, o) = m.slab(s);
    let data = m.data()[base..].as_ptr();
    let (u0, n) = (units.start, units.len());
    let row0 = u0 * UNIT_ROWS;
    let run = Runs {
        data: data.wrapping_add(u0 * f.unit),
        o,
        planes: f.planes,
    };
    // Where a pass's finish reads its planes, at the slab's first row.
    let planes = |p: &Pass| -> [*const u8; 4] {
        let (g, b) = (p.g as usize, p.b as usize);
        [
            data.wrapping_add(o.plane(g, 0) + row0),
            data.wrapping_add(o.plane(g, 1) + row0),
            data.wrapping_add(o.head(b, 0) + 2 * row0),
            data.wrapping_add(o.head(b, 1) + 2 * row0),
        ]
    };
    let chans = |p: &Pass| &active.channels[p.chans.0 as usize..p.chans.1 as usize];
    let rows = n * UNIT_ROWS;
    for (i, p) in passes.iter().enumerate() {
        let mut next = Next::NONE;
        if let Some(q) = passes.get(i + 1) {
            for &c in chans(q) {
                next.push(run.at(c), n * f.unit);
            }
            let [sc, mn, d0, d1] = planes(q);
            match q.finish {
                Finish::Store => {}
                Finish::Fold { last, .. } => {
                    next.push(sc, rows);
                    if f.planes > 1 {
                        next.push(mn, rows);
                    }
                    if last {
                        next.push(d0, 2 * rows);
                        if f.heads > 1 {
                            next.push(d1, 2 * rows);
                        }
                    }
                }
                Finish::Apply => {
                    next.push(d0, 2 * rows);
                    if f.heads > 1 {
                        next.push(d1, 2 * rows);
                    }
                }
            }
        }
        let [sc, mn, d0, d1] = planes(p);
        let (g, b) = (p.g as usize, p.b as usize);
        let (off, bsum, dx, sx) = {
            match k {
                true if kind == BlockKind::Q6K => (
                    _mm512_set1_epi32(32 * x.k.bsum[g] as i32),
                    _mm512_setzero_si512(),
                    _mm512_set1_ps(x.k.d[b]),
                    _mm512_setzero_ps(),
                ),
                true => (
                    _mm512_setzero_si512(),
                    _mm512_set1_epi32(x.k.bsum[2 * g] as i32 + x.k.bsum[2 * g + 1] as i32),
                    _mm512_set1_ps(x.k.d[b]),
                    _mm512_setzero_ps(),
                ),
                false => (
                    _mm512_set1_epi32(f.offset * x.sum[b]),
                    _mm512_setzero_si512(),
                    _mm512_set1_ps(x.d[b]),
                    _mm512_set1_ps(x.s[b]),
                ),
            }
        };
        let fin = Fin {
            finish: p.finish,
            kind,
            sc,
            mn,
            d0,
            d1,
            off,
            bsum,
            dx,
            sx,
            isum: sums[0],
            sumi: sums[1],
            summ: sums[2],
            acc: acc.as_mut_ptr(),
        };
        // SAFETY: each run holds the slab's units, `units` inside; the planes a byte (heads a
        // half) per row of the slab; the sums and `acc` the units' rows.
        unsafe { channels_pass::<BITS>(chans(p), run, xq, n, p.load, &fin, next) };
    }
}
