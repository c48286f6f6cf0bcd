//! What the AVX-512 VNNI column-block products share (the gathers), and the batched form.
//!
//! A gather takes four kept channels of a group: per 32 rows, the four channels' units are
//! loaded into vectors and a byte permute (`vpermb`, or `vpermt2b` over two channels per vector)
//! interleaves them into 16 rows x 4 channels of nibbles (4-bit units two at a time, one 32-byte
//! load per channel; the fifth and sixth bits become byte masks with `vpshufbitqmb`), so one
//! `vpdpbusd` per 16 rows adds the four products into a group's integer sums. The one-row
//! product is [`super::row_x86`].
//!
//! Several input rows (a prompt) take the batched form, [`product_rows_vnni`]: the same gathers,
//! each feeding every row of a chunk of 32, in short tiles of rows (see its docs).

use std::arch::x86_64::*;
use std::ops::Range;

use super::Offsets;
use super::UNIT_ROWS;
use super::{clamp_rows, format, piece_at, runs, ActiveChannels, ColumnBlocks, Format};
use crate::cpu::blocks::BlockKind;
use crate::cpu::quant::QuantizedRow;

/// Whether this CPU has what the kernel needs besides AVX-512 VNNI: VBMI (`vpermb`), BITALG
/// (`vpshufbitqmb`), F16C and FMA.
pub(crate) fn supported() -> bool {
    is_x86_feature_detected!("avx512vbmi")
        && is_x86_feature_detected!("avx512bitalg")
        && is_x86_feature_detected!("f16c")
        && is_x86_feature_detected!("fma")
}

/// `vpermb` indices interleaving four 16-byte units (one per channel) into 16 rows x 4
/// channels: byte `4 l + c` takes byte `l` of unit `c`.
pub(super) const INTERLEAVE: [u8; 64] = {
    let mut t = [0u8; 64];
    let mut i = 0;
    while i < 64 {
        t[i] = (16 * (i % 4) + i / 4) as u8;
        i += 1;
    }
    t
};

/// `vpermt2b` indices gathering the high-bit bytes of four 5- or 6-bit units (channel `c`'s
/// at bytes `32 c..32 c + 32` of two vectors as [`two`] loads them) for rows 0-15
/// (`HIGH[0]`) and 16-31: lane `i` (rows `16 h + 2 i` and the next) holds byte `2 h + i / 4`
/// of each channel's fifth-bit word (bytes 0-3) and sixth-bit word (bytes 4-7; for 5-bit
/// values whatever follows the unit, never picked).
const HIGH: [[u8; 64]; 2] = {
    let mut t = [[0u8; 64]; 2];
    let mut h = 0;
    while h < 2 {
        let mut i = 0;
        while i < 8 {
            let mut j = 0;
            while j < 8 {
                let (c, word) = (j % 4, j / 4);
                t[h][8 * i + j] = (32 * c + 16 + 4 * word + 2 * h + i / 4) as u8;
                j += 1;
            }
            i += 1;
        }
        h += 1;
    }
    t
};

/// `vpshufbitqmb` bit indices over a lane of [`HIGH`]'s: byte `j` of lane `i` (mask bit
/// `4 l + c` for row `l = 2 i + j / 4` of the half, channel `c = j % 4`) picks bit `l % 8` of
/// channel `c`'s byte of the plane's word (`PICK[0]`: fifth bits, `PICK[1]`: sixth).
const PICK: [[u8; 64]; 2] = {
    let mut t = [[0u8; 64]; 2];
    let mut plane = 0;
    while plane < 2 {
        let mut k = 0;
        while k < 64 {
            let (i, j) = (k / 8, k % 8);
            let (l, c) = (2 * i + j / 4, j % 4);
            t[plane][k] = (8 * (4 * plane + c) + l % 8) as u8;
            k += 1;
        }
        plane += 1;
    }
    t
};

/// The values of rows 0-15 and 16-31 of four channels' units at `p`, as unsigned bytes in
/// `vpdpbusd` order (lane `4 l + c`: row `l`, channel `c`).
#[inline(always)]
pub(super) unsafe fn gather<const BITS: u32>(
    p: [*const u8; 4],
    idx: __m512i,
) -> (__m512i, __m512i) {
    // SAFETY: the caller passes four whole units, and for 5 and 6 bits 32 readable bytes at
    // each (the column data ends in slack).
    unsafe {
        let four = |off: usize| {
            let v = _mm512_castsi128_si512(_mm_loadu_si128(p[0].add(off).cast()));
            let v = _mm512_inserti32x4::<1>(v, _mm_loadu_si128(p[1].add(off).cast()));
            let v = _mm512_inserti32x4::<2>(v, _mm_loadu_si128(p[2].add(off).cast()));
            let v = _mm512_inserti32x4::<3>(v, _mm_loadu_si128(p[3].add(off).cast()));
            _mm512_permutexvar_epi8(idx, v)
        };
        if BITS == 8 {
            return (four(0), four(16));
        }
        if BITS == 4 {
            let v = four(0);
            let low = _mm512_set1_epi8(0x0F);
            return (
                _mm512_and_si512(v, low),
                _mm512_and_si512(_mm512_srli_epi16::<4>(v), low),
            );
        }
        // 5 and 6 bits: a unit (20 or 24 bytes) and what follows it, 32 bytes per channel, two
        // channels per vector. One two-source permute interleaves the nibbles; per half of the
        // rows, another puts the high-bit bytes each group of 2 rows needs into one 64-bit lane
        // (bytes 0-3: the fifth bits of channels 0-3, bytes 4-7: the sixth bits), and
        // `vpshufbitqmb` picks each lane's bit into a byte mask.
        let (v01, v23) = (two(p[0], p[1]), two(p[2], p[3]));
        let nib = _mm512_permutex2var_epi8(v01, _mm512_loadu_si512(PAIRS[0].as_ptr().cast()), v23);
        let low = _mm512_set1_epi8(0x0F);
        let mut lo = _mm512_and_si512(nib, low);
        let mut hi = _mm512_and_si512(_mm512_srli_epi16::<4>(nib), low);
        let hl = _mm512_permutex2var_epi8(v01, _mm512_loadu_si512(HIGH[0].as_ptr().cast()), v23);
        let hh = _mm512_permutex2var_epi8(v01, _mm512_loadu_si512(HIGH[1].as_ptr().cast()), v23);
        for (plane, pick) in PICK.iter().enumerate().take(BITS as usize - 4) {
            let pick = _mm512_loadu_si512(pick.as_ptr().cast());
            let b = _mm512_set1_epi8(0x10 << plane);
            lo = _mm512_mask_add_epi8(lo, _mm512_bitshuffle_epi64_mask(hl, pick), lo, b);
            hi = _mm512_mask_add_epi8(hi, _mm512_bitshuffle_epi64_mask(hh, pick), hi, b);
        }
        (lo, hi)
    }
}

/// `vpermt2b` indices taking units `k` (`PAIRS[0]`) and `k + 1` (`PAIRS[1]`) of four channels
/// out of two vectors, each holding two channels' 32 bytes (units `k` and `k + 1`), into
/// [`INTERLEAVE`]'s order.
pub(super) const PAIRS: [[u8; 64]; 2] = {
    let mut t = [[0u8; 64]; 2];
    let mut i = 0;
    while i < 64 {
        let (l, c) = (i / 4, i % 4);
        t[0][i] = (32 * c + l) as u8;
        t[1][i] = (32 * c + 16 + l) as u8;
        i += 1;
    }
    t
};

/// Two channels' 32 bytes at `a` and `b` in one vector.
#[inline(always)]
unsafe fn two(a: *const u8, b: *const u8) -> __m512i {
    // SAFETY: the caller passes 32 readable bytes at each.
    unsafe {
        let v = _mm512_castsi256_si512(_mm256_loadu_si256(a.cast()));
        _mm512_inserti64x4::<1>(v, _mm256_loadu_si256(b.cast()))
    }
}

/// [`gather`] of two units at once for 4-bit values: rows 0-15 and 16-31 of unit `k`, then of
/// unit `k + 1`. The high nibbles are not shifted down: rows 16-31 come as 16 times their values
/// (`v & 0xF0`), one operation less per vector, and their sums are shifted back once per group.
#[inline(always)]
pub(super) unsafe fn gather_pair(p: [*const u8; 4], pairs: [__m512i; 2]) -> [__m512i; 4] {
    // SAFETY: the caller passes two whole units at each.
    unsafe {
        let (v01, v23) = (two(p[0], p[1]), two(p[2], p[3]));
        let low = _mm512_set1_epi8(0x0F);
        let [u0, u1] = pairs.map(|i| _mm512_permutex2var_epi8(v01, i, v23));
        [
            _mm512_and_si512(u0, low),
            _mm512_andnot_si512(low, u0),
            _mm512_and_si512(u1, low),
            _mm512_andnot_si512(low, u1),
        ]
    }
}

/// Units per tile of the batched kernel (384 rows): a kept channel's bytes of a tile are one
/// stretch of its run (192 for 4 bits), which the hardware prefetchers follow. Measured from
/// DRAM, 32 rows, time against the dense kernel's: Qwen2.5-1.5B's gate (Q5_0, Q4_K) 1.07-1.14x
/// with 12 units, 1.06x with 16, 1.19x with 8 (Q4_K), 1.5-1.6x with 4; Qwen2.5-0.5B's gate
/// (Q5_0) 1.26x with 12, 1.42x with 16, 1.21x with 8. Software prefetches of the next tile's
/// lines cost more than they saved (up to 35% from L3), so there are none.
const TILE_UNITS: usize = 12;

/// Rows of a tile.
const TILE: usize = TILE_UNITS * UNIT_ROWS;

/// Input rows per chunk of the batched kernel: a unit's gathers feed this many rows.
const ROW_CHUNK: usize = 32;

/// What a batched product walks, built once per call: the union's blocks, groups and quads
/// (four channels, the last of a group padded with its first channel against an input byte of
/// 0), each quad's run starts in the current slab, and the rows' input bytes per quad.
#[derive(Default)]
struct Plan {
    /// Per block: its index, and its groups `start..end`.
    blocks: Vec<(usize, usize, usize)>,
    /// Per group: its index, and its quads `start..end`.
    groups: Vec<(usize, usize, usize)>,
    /// Per quad: its channels (`u32::MAX`: padding).
    chans: Vec<[u32; 4]>,
    /// Per quad: where its channels' runs start in the slab.
    runs: Vec<[usize; 4]>,
    /// The rows' input bytes, four channels to a word: row `r`, quad `q` at `r * quads + q`
    /// (a row's words of a group side by side).
    words: Vec<i32>,
}

impl Plan {
    fn build(&mut self, kind: BlockKind, f: Format, active: &ActiveChannels, xs: &[QuantizedRow]) {
        self.blocks.clear();
        self.groups.clear();
        self.chans.clear();
        for block in runs(&active.channels, kind.block_elems()) {
            let first = self.groups.len();
            for group in runs(block, f.group) {
                let q0 = self.chans.len();
                for quad in group.chunks(4) {
                    let mut c = [u32::MAX; 4];
                    c[..quad.len()].copy_from_slice(quad);
                    self.chans.push(c);
                }
                let g = group[0] as usize / f.group;
                self.groups.push((g, q0, self.chans.len()));
            }
            let b = block[0] as usize / kind.block_elems();
            self.blocks.push((b, first, self.groups.len()));
        }
        let quads = self.chans.len();
        self.words.clear();
        self.words.resize(quads * xs.len(), 0);
        let k = kind.inputs().k;
        for (x, words) in xs.iter().zip(self.words.chunks_exact_mut(quads.max(1))) {
            let xq: &[i8] = if k { &x.k.q } else { &x.q };
            for (w, c) in words.iter_mut().zip(&self.chans) {
                *w = i32::from_le_bytes(c.map(|c| xq.get(c as usize).map_or(0, |&v| v as u8)));
            }
        }
    }

    /// Points the quads' runs into the slab laid out by `o`.
    fn locate(&mut self, o: &Offsets, planes: usize) {
        self.runs.clear();
        for c in &self.chans {
            let first = o.column(c[0] as usize, planes);
            self.runs.push(c.map(|c| {
                if c == u32::MAX {
                    first
                } else {
                    o.column(c as usize, planes)
                }
            }));
        }
    }
}

/// A tile's per-row sums: the K-quants' per-block integer sums, and the outputs (on the heap:
/// 144 KiB).
struct Sums {
    sumi: Vec<[i32; TILE]>,
    summ: Vec<[i32; TILE]>,
    acc: Vec<[f32; TILE]>,
}

impl Default for Sums {
    fn default() -> Self {
        Sums {
            sumi: vec![[0; TILE]; ROW_CHUNK],
            summ: vec![[0; TILE]; ROW_CHUNK],
            acc: vec![[0.0; TILE]; ROW_CHUNK],
        }
    }
}

thread_local! {
    /// Each thread's plan and sums, reused across calls.
    static SCRATCH: std::cell::RefCell<(Plan, Sums)> = std::cell::RefCell::default();
}

/// The batched product ([`super::ColumnBlocksRowsFn`]). Per tile of [`TILE_UNITS`] units (one
/// slab's) and chunk of [`ROW_CHUNK`] input rows, per unit, a group's quads are gathered as the
/// one-row kernel gathers them (up to 8, 16 rows x 4 channels each, twice) and held in registers
/// while every row of the chunk sums its products; 32-weight blocks are scaled straight into the
/// rows' outputs, the K-quants' groups folded into per-block sums, with the one-row kernel's
/// operations in the dense kernel's order.
///
/// # Safety
/// The CPU must have AVX-512F/BW/VL/VNNI and what [`supported`] checks.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx512vbmi,avx512bitalg,f16c,fma")]
pub(crate) unsafe fn product_rows_vnni(
    m: &ColumnBlocks,
    units: Range<usize>,
    xs: &[QuantizedRow],
    active: &ActiveChannels,
    per: usize,
    out: &mut [f32],
) {
    let Some(units) = clamp_rows(m, units, xs, per, out) else {
        return;
    };
    let (kind, f) = (m.kind(), format(m.kind()));
    SCRATCH.with_borrow_mut(|(plan, sums)| {
        plan.build(kind, f, active, xs);
        let mut slab = usize::MAX;
        let mut u = units.start;
        while u < units.end {
            let (su, s) = (m.slab_units(), u / m.slab_units());
            let end = (u + TILE_UNITS).min((s + 1) * su).min(units.end);
            let (base, o) = m.slab(s);
            if s != slab {
                slab = s;
                plan.locate(&o, f.planes);
            }
            for r0 in (0..xs.len()).step_by(ROW_CHUNK) {
                let t = Tile {
                    kind,
                    plan,
                    data: m.data()[base..].as_ptr(),
                    o,
                    units: u - s * su..end - s * su,
                    xs,
                    rows: r0..(r0 + ROW_CHUNK).min(xs.len()),
                    at: u - units.start,
                    per,
                };
                // SAFETY: forwarded contract; `clamp_rows` cut the units to the matrix and to
                // whole pieces of `out`, and a tile stays in one slab.
                unsafe {
                    match f.bits {
                        4 => t.run::<4>(sums, out),
                        5 => t.run::<5>(sums, out),
                        6 => t.run::<6>(sums, out),
                        _ => t.run::<8>(sums, out),
                    }
                }
            }
            u = end;
        }
    });
}

/// One tile of a batched product: units `units` of the slab at `data`, input rows `rows`.
struct Tile<'a> {
    kind: BlockKind,
    plan: &'a Plan,
    data: *const u8,
    o: Offsets,
    units: Range<usize>,
    xs: &'a [QuantizedRow],
    rows: Range<usize>,
    /// The tile's first unit, counted in the output.
    at: usize,
    per: usize,
}

impl Tile<'_> {
    /// # Safety
    /// As [`product_rows_vnni`], the tile inside the matrix, one slab and `out`.
    #[target_feature(
        enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx512vbmi,avx512bitalg,f16c,fma"
    )]
    unsafe fn run<const BITS: u32>(&self, s: &mut Sums, out: &mut [f32]) {
        let (kind, o, plan, data) = (self.kind, &self.o, self.plan, self.data);
        let f = format(kind);
        let (nr, nu) = (self.rows.len(), self.units.len());
        let (n, row0) = (nu * UNIT_ROWS, self.units.start * UNIT_ROWS);
        for a in &mut s.acc[..nr] {
            a[..n].fill(0.0);
        }
        for &(b, g0, g1) in &plan.blocks {
            let heads = [o.head(b, 0) + 2 * row0, o.head(b, 1) + 2 * row0];
            for (gi, &(g, q0, q1)) in plan.groups[g0..g1].iter().enumerate() {
                let end = match kind.inputs().k {
                    true => End::Group {
                        g,
                        first: gi == 0,
                        planes: [o.plane(g, 0) + row0, o.plane(g, 1) + row0],
                    },
                    false => End::Block { b, heads },
                };
                // SAFETY: the quads' runs hold the tile's units; `words` holds `xs.len()`
                // values per quad; the sums `n` values per row.
                unsafe { self.group::<BITS>(q0..q1, end, s) };
            }
            if kind.inputs().k {
                let q45 = matches!(kind, BlockKind::Q4K | BlockKind::Q5K);
                // SAFETY: the block's minimum planes hold a byte per row of the slab, the
                // tile's `n` inside.
                let mins = q45.then(|| unsafe { Minimums::load(data, o, b, row0, nu) });
                for (r, x) in self.xs[self.rows.clone()].iter().enumerate() {
                    if let Some(m) = &mins {
                        // SAFETY: `summ` holds `TILE >= n` values.
                        unsafe { m.sums(x, b, nu, &mut s.summ[r]) };
                    }
                    // SAFETY: a block's head planes hold a half per row of the slab, the
                    // tile's `n` inside; the arrays hold `n` values.
                    unsafe {
                        apply_block(
                            kind,
                            f,
                            data,
                            heads,
                            x,
                            b,
                            &s.sumi[r],
                            &s.sumi[r],
                            &s.summ[r],
                            &mut s.acc[r][..n],
                        )
                    };
                }
            }
        }
        for (r, acc) in s.acc[..nr].iter().enumerate() {
            for (i, v) in acc[..n].chunks_exact(UNIT_ROWS).enumerate() {
                let at = piece_at(self.at + i, self.rows.start + r, self.xs.len(), self.per);
                out[at..at + UNIT_ROWS].copy_from_slice(v);
            }
        }
    }

    /// One group's quads `quads` over the tile's units for the chunk's rows: per unit its
    /// gathers stay in registers while each row sums its products and ends them as `end` says.
    ///
    /// # Safety
    /// As [`Tile::run`].
    #[inline(always)]
    unsafe fn group<const BITS: u32>(&self, quads: Range<usize>, end: End, s: &mut Sums) {
        // SAFETY: forwarded; one monomorphic loop per quad count, so the gathers stay in
        // registers.
        unsafe {
            match quads.len() {
                1 => self.group_n::<BITS, 1>(quads.start, end, s),
                2 => self.group_n::<BITS, 2>(quads.start, end, s),
                3 => self.group_n::<BITS, 3>(quads.start, end, s),
                4 => self.group_n::<BITS, 4>(quads.start, end, s),
                5 => self.group_n::<BITS, 5>(quads.start, end, s),
                6 => self.group_n::<BITS, 6>(quads.start, end, s),
                7 => self.group_n::<BITS, 7>(quads.start, end, s),
                _ => self.group_n::<BITS, 8>(quads.start, end, s),
            }
        }
    }

    #[inline(always)]
    unsafe fn group_n<const BITS: u32, const N: usize>(&self, q: usize, end: End, s: &mut Sums) {
        let (kind, plan, data) = (self.kind, self.plan, self.data);
        let f = format(kind);
        let unit = f.unit;
        let base = data.wrapping_add(self.units.start * unit);
        let rows = &self.xs[self.rows.clone()];
        let quads = plan.chans.len();
        let w = plan.words[self.rows.start * quads + q..].as_ptr();
        // SAFETY: a constant table of 64 bytes.
        let idx = unsafe { _mm512_loadu_si512(INTERLEAVE.as_ptr().cast()) };
        // The rows' input-side factors of the end, once per group rather than per unit.
        let mut fac = [RowFactors::default(); ROW_CHUNK];
        for (fac, x) in fac.iter_mut().zip(rows) {
            *fac = RowFactors::of(kind, f, end, x);
        }
        for k in 0..self.units.len() {
            let l0 = UNIT_ROWS * k;
            // SAFETY: each quad's runs hold the tile's units from `base`; `w` holds `all`
            // values per quad from the chunk's first row; planes and heads hold the tile's
            // rows; the sums `32 units` values per row.
            unsafe {
                // A loop, not `array::from_fn`: a closure has no target features, so the
                // intrinsics in it would not inline.
                let z = _mm512_setzero_si512();
                let mut g = [(z, z); N];
                for (j, g) in g.iter_mut().enumerate() {
                    let r = &plan.runs[q + j];
                    let at = k * unit;
                    let p = [
                        base.add(r[0] + at),
                        base.add(r[1] + at),
                        base.add(r[2] + at),
                        base.add(r[3] + at),
                    ];
                    *g = gather::<BITS>(p, idx);
                }
                let ends = Ends::load(kind, data, end, l0);
                for (r, fac) in fac.iter().enumerate().take(rows.len()) {
                    let (mut a0, mut a1) = (z, z);
                    let w = w.add(r * quads);
                    for (j, &(lo, hi)) in g.iter().enumerate() {
                        let xv = _mm512_set1_epi32(*w.add(j));
                        a0 = _mm512_dpbusd_epi32(a0, lo, xv);
                        a1 = _mm512_dpbusd_epi32(a1, hi, xv);
                    }
                    ends.apply(kind, end, fac, [a0, a1], s, r, l0);
                }
            }
        }
    }
}

/// Q4_K's and Q5_K's minimum sums of one block over a tile, `summ = sum_j m_j bsum_j` (`m_j`
/// the 6-bit minimum of group `j` per row, `bsum_j` the row's input sum over the group): the
/// minimums as 16-bit pairs of groups, one `vpmaddwd` per pair, as the dense kernel does, in
/// place of a multiply per group and row.
struct Minimums {
    /// Unit, pair of groups `(2p, 2p + 1)`, rows 0-15 / 16-31: `m_2p | m_2p+1 << 16`.
    m: [[[__m512i; 2]; 4]; TILE_UNITS],
}

impl Minimums {
    /// The pairs of block `b`'s 8 groups for units `0..units` of the tile at row `row0`.
    #[inline(always)]
    unsafe fn load(data: *const u8, o: &Offsets, b: usize, row0: usize, units: usize) -> Self {
        // SAFETY: the caller's planes hold the tile's rows; register-only AVX-512 otherwise.
        unsafe {
            let mut m = Minimums {
                m: [[[_mm512_setzero_si512(); 2]; 4]; TILE_UNITS],
            };
            for (k, mk) in m.m.iter_mut().enumerate().take(units) {
                for (p, mp) in mk.iter_mut().enumerate() {
                    for (h, v) in mp.iter_mut().enumerate() {
                        // No closure here: a closure has no target features, so the
                        // intrinsics in it would not inline.
                        let g = b * o.groups_per_block + 2 * p;
                        let at = row0 + UNIT_ROWS * k + 16 * h;
                        let m0 = _mm_loadu_si128(data.add(o.plane(g, 1) + at).cast());
                        let m1 = _mm_loadu_si128(data.add(o.plane(g + 1, 1) + at).cast());
                        let (m0, m1) = (_mm512_cvtepu8_epi32(m0), _mm512_cvtepu8_epi32(m1));
                        *v = _mm512_or_si512(m0, _mm512_slli_epi32::<16>(m1));
                    }
                }
            }
            m
        }
    }

    /// Row `x`'s minimum sums of block `b` for units `0..units` into `summ`.
    #[inline(always)]
    unsafe fn sums(&self, x: &QuantizedRow, b: usize, units: usize, summ: &mut [i32; TILE]) {
        // A group's input sum: two 16-value sums of at most 16 x 127 each, so it fits 16 bits.
        let bs = |g: usize| (x.k.bsum[2 * g] + x.k.bsum[2 * g + 1]) as u16 as u32;
        let w: [i32; 4] =
            std::array::from_fn(|p| (bs(8 * b + 2 * p) | bs(8 * b + 2 * p + 1) << 16) as i32);
        // SAFETY: `summ` holds `32 units` values; register-only AVX-512 otherwise.
        unsafe {
            let w = [
                _mm512_set1_epi32(w[0]),
                _mm512_set1_epi32(w[1]),
                _mm512_set1_epi32(w[2]),
                _mm512_set1_epi32(w[3]),
            ];
            for (k, mk) in self.m.iter().enumerate().take(units) {
                for h in 0..2 {
                    let mut v = _mm512_setzero_si512();
                    for (m, &w) in mk.iter().zip(&w) {
                        v = _mm512_add_epi32(v, _mm512_madd_epi16(m[h], w));
                    }
                    _mm512_storeu_si512(summ.as_mut_ptr().add(UNIT_ROWS * k + 16 * h).cast(), v);
                }
            }
        }
    }
}

/// How a group's integer sums end: 32-weight blocks (a group is a block) are scaled into the
/// outputs; the K-quants' groups are folded into the block's integer sums.
#[derive(Clone, Copy)]
enum End {
    Block {
        b: usize,
        heads: [usize; 2],
    },
    Group {
        g: usize,
        first: bool,
        planes: [usize; 2],
    },
}

/// One input row's factors of an [`End`]: a 32-weight block's `d` and `s` and the offset's
/// `offset * sum(x)`; Q6_K's group offset `32 * bsum`; 0 otherwise.
#[derive(Clone, Copy, Default)]
struct RowFactors {
    d: f32,
    s: f32,
    off: i32,
}

impl RowFactors {
    #[inline(always)]
    fn of(kind: BlockKind, f: Format, end: End, x: &QuantizedRow) -> Self {
        match end {
            End::Block { b, .. } => RowFactors {
                d: x.d[b],
                s: x.s[b],
                off: f.offset * x.sum[b],
            },
            End::Group { g, .. } if kind == BlockKind::Q6K => RowFactors {
                off: 32 * x.k.bsum[g] as i32,
                ..Default::default()
            },
            End::Group { .. } => RowFactors::default(),
        }
    }
}

/// One unit's weight-side factors of an [`End`], shared by the rows: a block's f16 planes as
/// floats, or a group's byte planes as `i32`.
struct Ends {
    p: [[__m512; 2]; 2],
    b: [__m512i; 2],
}

impl Ends {
    /// The factors of rows `l0..l0 + 32` of the slab at `data`.
    #[inline(always)]
    unsafe fn load(kind: BlockKind, data: *const u8, end: End, l0: usize) -> Ends {
        // SAFETY: the caller's planes and heads hold the unit's 32 rows; register-only
        // AVX-512 otherwise.
        unsafe {
            let (zf, zi) = (_mm512_setzero_ps(), _mm512_setzero_si512());
            let mut e = Ends {
                p: [[zf; 2]; 2],
                b: [zi; 2],
            };
            match end {
                End::Block { heads, .. } => {
                    for (h, &at) in heads.iter().enumerate().take(format(kind).heads) {
                        let p = data.add(at + 2 * l0);
                        e.p[h] = [halves(p), halves(p.add(32))];
                    }
                }
                End::Group { planes, .. } => {
                    for i in 0..2 {
                        // No closure: its intrinsics would not inline.
                        let bytes = _mm_loadu_si128(data.add(planes[0] + l0 + 16 * i).cast());
                        e.b[i] = match kind {
                            BlockKind::Q6K => _mm512_cvtepi8_epi32(bytes),
                            _ => _mm512_cvtepu8_epi32(bytes),
                        };
                    }
                }
            }
            e
        }
    }

    /// Ends row `r`'s sums `a` (rows 0-15, 16-31 of the unit at `l0`) as `end` says, with the
    /// operations and order of [`fold_group`] and [`apply_block`].
    #[allow(clippy::too_many_arguments)]
    #[inline(always)]
    unsafe fn apply(
        &self,
        kind: BlockKind,
        end: End,
        fac: &RowFactors,
        a: [__m512i; 2],
        s: &mut Sums,
        r: usize,
        l0: usize,
    ) {
        // SAFETY: the sums hold `l0 + 32` values per row; register-only AVX-512 otherwise.
        unsafe {
            match end {
                End::Block { .. } => {
                    let dx = _mm512_set1_ps(fac.d);
                    let off = _mm512_set1_epi32(fac.off);
                    let sx = _mm512_set1_ps(fac.s);
                    for (i, &a) in a.iter().enumerate() {
                        let p = s.acc[r].as_mut_ptr().add(l0 + 16 * i);
                        let v = _mm512_loadu_ps(p);
                        let d = self.p[0][i];
                        let v = match kind {
                            BlockKind::Q4_1 | BlockKind::Q5_1 => {
                                let t = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(a), d), dx);
                                let t = _mm512_add_ps(t, _mm512_mul_ps(self.p[1][i], sx));
                                _mm512_add_ps(v, t)
                            }
                            _ => {
                                let s = _mm512_cvtepi32_ps(_mm512_sub_epi32(a, off));
                                _mm512_fmadd_ps(s, _mm512_mul_ps(d, dx), v)
                            }
                        };
                        _mm512_storeu_ps(p, v);
                    }
                }
                End::Group { first, .. } => {
                    // Q6_K: `sc (isum - 32 bsum)`; Q4_K/Q5_K: `sc isum` (their minimums' sums
                    // come per block, [`minimum_sums`]).
                    let off = _mm512_set1_epi32(fac.off);
                    for (i, &a) in a.iter().enumerate() {
                        let si = _mm512_mullo_epi32(self.b[i], _mm512_sub_epi32(a, off));
                        let pi = s.sumi[r].as_mut_ptr().add(l0 + 16 * i);
                        if first {
                            _mm512_storeu_si512(pi.cast(), si);
                        } else {
                            let v = _mm512_add_epi32(_mm512_loadu_si512(pi.cast()), si);
                            _mm512_storeu_si512(pi.cast(), v);
                        }
                    }
                }
            }
        }
    }
}

/// Values `i..i + 16` of `s`.
#[inline(always)]
pub(super) unsafe fn ints(s: &[i32], i: usize) -> __m512i {
    // SAFETY: the caller passes `i + 16 <= s.len()`.
    unsafe { _mm512_loadu_si512(s.as_ptr().add(i).cast()) }
}

/// 16 halves at `p` as floats.
#[inline(always)]
pub(super) unsafe fn halves(p: *const u8) -> __m512 {
    // SAFETY: the caller passes 32 readable bytes.
    unsafe { _mm512_cvtph_ps(_mm256_loadu_si256(p.cast())) }
}

/// `-v`, the sign bit flipped (as Rust's `-` on each lane).
#[inline(always)]
pub(super) unsafe fn neg(v: __m512) -> __m512 {
    // SAFETY: register-only AVX-512F operations.
    unsafe {
        let sign = _mm512_set1_epi32(i32::MIN);
        _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(v), sign))
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
    // One loop per block type: a `match` inside the loop was a jump table per 16 rows.
    macro_rules! rows {
        (|$i:ident, $v:ident, $d:ident| $body:expr) => {
            for $i in (0..acc.len()).step_by(16) {
                // SAFETY: see the caller; `i + 16 <= n` as `n` is a multiple of 32.
                unsafe {
                    let a = acc.as_mut_ptr().add($i);
                    let ($v, $d) = (_mm512_loadu_ps(a), halves(d0.add(2 * $i)));
                    _mm512_storeu_ps(a, $body);
                }
            }
        };
    }
    match kind {
        BlockKind::Q4K | BlockKind::Q5K => rows!(|i, v, d| {
            let v = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ints(sumi, i)), _mm512_mul_ps(d, dx), v);
            let dmin = _mm512_mul_ps(halves(d1.add(2 * i)), dx);
            _mm512_fmadd_ps(neg(_mm512_cvtepi32_ps(ints(summ, i))), dmin, v)
        }),
        BlockKind::Q6K => rows!(|i, v, d| {
            _mm512_fmadd_ps(_mm512_cvtepi32_ps(ints(sumi, i)), _mm512_mul_ps(d, dx), v)
        }),
        BlockKind::Q4_1 | BlockKind::Q5_1 => rows!(|i, v, d| {
            let s = _mm512_cvtepi32_ps(ints(isum, i));
            let t = _mm512_mul_ps(_mm512_mul_ps(s, d), dx);
            let t = _mm512_add_ps(t, _mm512_mul_ps(halves(d1.add(2 * i)), sx));
            _mm512_add_ps(v, t)
        }),
        _ => rows!(|i, v, d| {
            let s = _mm512_cvtepi32_ps(_mm512_sub_epi32(ints(isum, i), off));
            _mm512_fmadd_ps(s, _mm512_mul_ps(d, dx), v)
        }),
    }
}
