//! Every GGUF block type the dense packed product takes ([`BlockKind`]) and the per-block
//! reference products written from the GGUF block layouts, against which every packed kernel is
//! checked bit for bit. The inputs they read are `quant`'s: the 32-value Q8 blocks and the
//! K-quants' `Q8K` (ggml's `block_q8_K`).
//!
//! Layouts are ggml's:
//! - 32-weight blocks: Q4_0 `{d, qs[16]}` (`d (q - 8)`), Q4_1 `{d, m, qs[16]}` (`d q + m`), Q8_0
//!   `{d, qs[32]}`, Q5_0 `{d, qh: u32, qs[16]}` (`d (q - 16)`, bit `j` of `qh` the fifth bit of
//!   weight `j`), Q5_1 `{d, m, qh, qs[16]}` (`d q + m`). Weight `j < 16` is the low nibble of
//!   `qs[j]`, weight `j + 16` its high nibble.
//! - 256-weight super-blocks: Q4_K `{d, dmin, scales[12], qs[128]}` and Q5_K (the same plus
//!   `qh[32]` before `qs`): eight sub-blocks of 32 with 6-bit scales `sc` and minimums `m`,
//!   weight `d sc q - dmin m`; Q6_K `{ql[128], qh[64], scales: [i8; 16], d}`: sixteen
//!   sub-blocks of 16, weight `d sc (q - 32)`.
//!
//! The products are exact in integers per (sub-)block and scaled in a fixed order, the order the
//! packed kernels use: 32-weight blocks as in `packed` (Q5_0 like Q4_0, Q5_1 like Q4_1), and
//! per super-block `acc = fma(sumi, d_w d_x, acc)` then, for Q4_K/Q5_K,
//! `acc = fma(-summ, dmin_w d_x, acc)`, where `sumi = sum_j sc_j isum_j` and
//! `summ = sum_j m_j bsum_j` (`bsum_j`: the input's integer sum over sub-block `j`).

use half::f16;

use super::quant::{Inputs, QuantKind, QuantizedRow, QK, QK_K};

/// A GGUF block type of the dense packed product ([`crate::cpu::PackedRows`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BlockKind {
    /// 4-bit, symmetric, 18 bytes per 32 weights.
    Q4_0,
    /// 4-bit with minimum, 20 bytes per 32 weights.
    Q4_1,
    /// 8-bit, 34 bytes per 32 weights.
    Q8_0,
    /// 5-bit, symmetric, 22 bytes per 32 weights.
    Q5_0,
    /// 5-bit with minimum, 24 bytes per 32 weights.
    Q5_1,
    /// 4-bit K-quant, 144 bytes per 256 weights.
    Q4K,
    /// 5-bit K-quant, 176 bytes per 256 weights.
    Q5K,
    /// 6-bit K-quant, 210 bytes per 256 weights.
    Q6K,
}

/// One field of a block: `len` bytes at `at`. In the packed layout a 2-byte field becomes a plane
/// of 16 halves and a longer one `len / 4` chunks of 16 four-byte words.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Field {
    pub(crate) at: usize,
    pub(crate) len: usize,
}

impl Field {
    /// Bytes per lane in one chunk: 2 for a half, else 4.
    pub(crate) const fn word(self) -> usize {
        if self.len == 2 {
            2
        } else {
            4
        }
    }
}

impl BlockKind {
    /// Every block type.
    pub const ALL: [BlockKind; 8] = [
        BlockKind::Q4_0,
        BlockKind::Q4_1,
        BlockKind::Q8_0,
        BlockKind::Q5_0,
        BlockKind::Q5_1,
        BlockKind::Q4K,
        BlockKind::Q5K,
        BlockKind::Q6K,
    ];

    /// Weights per block (32, or 256 for the K-quants).
    pub const fn block_elems(self) -> usize {
        match self {
            BlockKind::Q4K | BlockKind::Q5K | BlockKind::Q6K => QK_K,
            _ => QK,
        }
    }

    /// Bytes per block.
    pub const fn block_bytes(self) -> usize {
        match self {
            BlockKind::Q4_0 => 18,
            BlockKind::Q4_1 => 20,
            BlockKind::Q8_0 => 34,
            BlockKind::Q5_0 => 22,
            BlockKind::Q5_1 => 24,
            BlockKind::Q4K => 144,
            BlockKind::Q5K => 176,
            BlockKind::Q6K => 210,
        }
    }

    /// Bytes of a row of `n` weights (`n` a multiple of [`BlockKind::block_elems`]).
    pub const fn row_bytes(self, n: usize) -> usize {
        n / self.block_elems() * self.block_bytes()
    }

    /// The input quantization its products read.
    pub const fn inputs(self) -> Inputs {
        match self {
            BlockKind::Q4K | BlockKind::Q5K | BlockKind::Q6K => Inputs {
                blocks32: false,
                k: true,
            },
            _ => Inputs {
                blocks32: true,
                k: false,
            },
        }
    }

    /// candle's (ggml's) block type, if the packed product takes it.
    pub fn from_ggml(t: candle_core::quantized::GgmlDType) -> Option<BlockKind> {
        use candle_core::quantized::GgmlDType as G;
        Some(match t {
            G::Q4_0 => BlockKind::Q4_0,
            G::Q4_1 => BlockKind::Q4_1,
            G::Q8_0 => BlockKind::Q8_0,
            G::Q5_0 => BlockKind::Q5_0,
            G::Q5_1 => BlockKind::Q5_1,
            G::Q4K => BlockKind::Q4K,
            G::Q5K => BlockKind::Q5K,
            G::Q6K => BlockKind::Q6K,
            _ => return None,
        })
    }

    /// The sparse layouts' block type, for Q4_0, Q4_1 and Q8_0.
    pub const fn quant_kind(self) -> Option<QuantKind> {
        match self {
            BlockKind::Q4_0 => Some(QuantKind::Q4_0),
            BlockKind::Q4_1 => Some(QuantKind::Q4_1),
            BlockKind::Q8_0 => Some(QuantKind::Q8_0),
            _ => None,
        }
    }

    /// The block's fields in ggml's order.
    pub(crate) const fn fields(self) -> &'static [Field] {
        match self {
            BlockKind::Q4_0 => &[Field { at: 0, len: 2 }, Field { at: 2, len: 16 }],
            BlockKind::Q4_1 => &[
                Field { at: 0, len: 2 },
                Field { at: 2, len: 2 },
                Field { at: 4, len: 16 },
            ],
            BlockKind::Q8_0 => &[Field { at: 0, len: 2 }, Field { at: 2, len: 32 }],
            BlockKind::Q5_0 => &[
                Field { at: 0, len: 2 },
                Field { at: 2, len: 4 },
                Field { at: 6, len: 16 },
            ],
            BlockKind::Q5_1 => &[
                Field { at: 0, len: 2 },
                Field { at: 2, len: 2 },
                Field { at: 4, len: 4 },
                Field { at: 8, len: 16 },
            ],
            BlockKind::Q4K => &[
                Field { at: 0, len: 2 },
                Field { at: 2, len: 2 },
                Field { at: 4, len: 12 },
                Field { at: 16, len: 128 },
            ],
            BlockKind::Q5K => &[
                Field { at: 0, len: 2 },
                Field { at: 2, len: 2 },
                Field { at: 4, len: 12 },
                Field { at: 16, len: 32 },
                Field { at: 48, len: 128 },
            ],
            BlockKind::Q6K => &[
                Field { at: 0, len: 128 },
                Field { at: 128, len: 64 },
                Field { at: 192, len: 16 },
                Field { at: 208, len: 2 },
            ],
        }
    }

    /// Where the block's f16 fields (scales, minimums) lie: a block's values are finite exactly
    /// when these are, since its quants are integers.
    pub const fn half_offsets(self) -> &'static [usize] {
        match self {
            BlockKind::Q4_1 | BlockKind::Q5_1 | BlockKind::Q4K | BlockKind::Q5K => &[0, 2],
            BlockKind::Q6K => &[208],
            _ => &[0],
        }
    }

    /// ggml's name (`Q4_K`, ...).
    pub const fn name(self) -> &'static str {
        match self {
            BlockKind::Q4_0 => "Q4_0",
            BlockKind::Q4_1 => "Q4_1",
            BlockKind::Q8_0 => "Q8_0",
            BlockKind::Q5_0 => "Q5_0",
            BlockKind::Q5_1 => "Q5_1",
            BlockKind::Q4K => "Q4_K",
            BlockKind::Q5K => "Q5_K",
            BlockKind::Q6K => "Q6_K",
        }
    }
}

impl From<QuantKind> for BlockKind {
    fn from(k: QuantKind) -> Self {
        match k {
            QuantKind::Q4_0 => BlockKind::Q4_0,
            QuantKind::Q4_1 => BlockKind::Q4_1,
            QuantKind::Q8_0 => BlockKind::Q8_0,
        }
    }
}

impl std::fmt::Display for BlockKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// The little-endian f16 at `b[at..at + 2]`, as f32.
pub(crate) fn h16(b: &[u8], at: usize) -> f32 {
    f16::from_le_bytes([b[at], b[at + 1]]).to_f32()
}

/// Q4_K/Q5_K's 6-bit scale and minimum of sub-block `j` (ggml's `get_scale_min_k4`).
pub(crate) fn scale_min_k4(j: usize, s: &[u8]) -> (i32, i32) {
    if j < 4 {
        ((s[j] & 63) as i32, (s[j + 4] & 63) as i32)
    } else {
        (
            ((s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4)) as i32,
            ((s[j + 4] >> 4) | ((s[j] >> 6) << 4)) as i32,
        )
    }
}

/// The stored integer of every weight of a block (`out[..block_elems]`): Q4_0 `q - 8`, Q4_1
/// `q`, Q8_0 `q`, Q5_0 `q - 16`, Q5_1 `q`, Q4_K/Q5_K `q` (unsigned), Q6_K `q - 32`.
pub(crate) fn block_ints(kind: BlockKind, b: &[u8], out: &mut [i32]) {
    match kind {
        BlockKind::Q4_0 | BlockKind::Q4_1 => {
            let (qs, off) = match kind {
                BlockKind::Q4_0 => (&b[2..18], 8),
                _ => (&b[4..20], 0),
            };
            for j in 0..16 {
                out[j] = (qs[j] & 0xF) as i32 - off;
                out[j + 16] = (qs[j] >> 4) as i32 - off;
            }
        }
        BlockKind::Q8_0 => {
            for j in 0..QK {
                out[j] = (b[2 + j] as i8) as i32;
            }
        }
        BlockKind::Q5_0 | BlockKind::Q5_1 => {
            let (h, qs, off) = match kind {
                BlockKind::Q5_0 => (2, &b[6..22], 16),
                _ => (4, &b[8..24], 0),
            };
            let qh = u32::from_le_bytes([b[h], b[h + 1], b[h + 2], b[h + 3]]);
            for j in 0..16 {
                let h0 = ((qh >> j) << 4) & 0x10;
                let h1 = (qh >> (j + 12)) & 0x10;
                out[j] = ((qs[j] & 0xF) as u32 | h0) as i32 - off;
                out[j + 16] = ((qs[j] >> 4) as u32 | h1) as i32 - off;
            }
        }
        BlockKind::Q4K | BlockKind::Q5K => {
            let (qs, qh) = match kind {
                BlockKind::Q4K => (&b[16..144], None),
                _ => (&b[48..176], Some(&b[16..48])),
            };
            for j in 0..4 {
                for l in 0..32 {
                    let (lo, hi) = match qh {
                        Some(qh) => (
                            ((qh[l] >> (2 * j)) & 1) << 4,
                            ((qh[l] >> (2 * j + 1)) & 1) << 4,
                        ),
                        None => (0, 0),
                    };
                    out[64 * j + l] = ((qs[32 * j + l] & 0xF) | lo) as i32;
                    out[64 * j + 32 + l] = ((qs[32 * j + l] >> 4) | hi) as i32;
                }
            }
        }
        BlockKind::Q6K => {
            let (ql, qh) = (&b[..128], &b[128..192]);
            for n in 0..2 {
                let (ql, qh) = (&ql[64 * n..], &qh[32 * n..]);
                for l in 0..32 {
                    let o = &mut out[128 * n..];
                    o[l] = ((ql[l] & 0xF) | ((qh[l] & 3) << 4)) as i32 - 32;
                    o[l + 32] = ((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) as i32 - 32;
                    o[l + 64] = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i32 - 32;
                    o[l + 96] = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i32 - 32;
                }
            }
        }
    }
}

/// One block (GGUF bytes `b`) dequantized into `out` (`block_elems` values), as ggml does.
pub(crate) fn dequantize_block(kind: BlockKind, b: &[u8], out: &mut [f32]) {
    let mut q = [0i32; QK_K];
    block_ints(kind, b, &mut q);
    match kind {
        BlockKind::Q4_0 | BlockKind::Q8_0 | BlockKind::Q5_0 => {
            let d = h16(b, 0);
            for (o, &q) in out[..QK].iter_mut().zip(&q) {
                *o = q as f32 * d;
            }
        }
        BlockKind::Q4_1 | BlockKind::Q5_1 => {
            let (d, m) = (h16(b, 0), h16(b, 2));
            for (o, &q) in out[..QK].iter_mut().zip(&q) {
                *o = d * q as f32 + m;
            }
        }
        BlockKind::Q4K | BlockKind::Q5K => {
            let (d, dmin) = (h16(b, 0), h16(b, 2));
            for j in 0..8 {
                let (sc, m) = scale_min_k4(j, &b[4..16]);
                let (d1, m1) = (d * sc as f32, dmin * m as f32);
                for (o, &q) in out[32 * j..32 * (j + 1)].iter_mut().zip(&q[32 * j..]) {
                    *o = d1 * q as f32 - m1;
                }
            }
        }
        BlockKind::Q6K => {
            let d = h16(b, 208);
            for (j, (o, q)) in out[..QK_K]
                .chunks_exact_mut(16)
                .zip(q.chunks_exact(16))
                .enumerate()
            {
                let sc = b[192 + j] as i8 as f32;
                for (o, &q) in o.iter_mut().zip(q) {
                    *o = d * sc * q as f32;
                }
            }
        }
    }
}

/// `acc` plus block `b` of a row (GGUF bytes `blk`) against the input `x`, in the packed
/// kernels' order (module docs). The reference every packed kernel equals bit for bit.
pub(crate) fn dot_block(kind: BlockKind, blk: &[u8], x: &QuantizedRow, b: usize, acc: f32) -> f32 {
    let mut q = [0i32; QK_K];
    block_ints(kind, blk, &mut q);
    match kind {
        BlockKind::Q4K | BlockKind::Q5K | BlockKind::Q6K => {
            let xq = &x.k.q[b * QK_K..(b + 1) * QK_K];
            let sub = if kind == BlockKind::Q6K { 16 } else { 32 };
            let (mut sumi, mut summ) = (0i32, 0i32);
            for j in 0..QK_K / sub {
                let r = j * sub..(j + 1) * sub;
                let isum: i32 = q[r.clone()]
                    .iter()
                    .zip(&xq[r.clone()])
                    .map(|(&w, &v)| w * v as i32)
                    .sum();
                if kind == BlockKind::Q6K {
                    sumi += blk[192 + j] as i8 as i32 * isum;
                } else {
                    let (sc, m) = scale_min_k4(j, &blk[4..16]);
                    let bsum: i32 = xq[r].iter().map(|&v| v as i32).sum();
                    sumi += sc * isum;
                    summ += m * bsum;
                }
            }
            let dx = x.k.d[b];
            if kind == BlockKind::Q6K {
                (sumi as f32).mul_add(h16(blk, 208) * dx, acc)
            } else {
                let acc = (sumi as f32).mul_add(h16(blk, 0) * dx, acc);
                (-(summ as f32)).mul_add(h16(blk, 2) * dx, acc)
            }
        }
        _ => {
            let xq = &x.q[b * QK..(b + 1) * QK];
            let s: i32 = q[..QK].iter().zip(xq).map(|(&w, &v)| w * v as i32).sum();
            let (d, dx) = (h16(blk, 0), x.d[b]);
            match kind {
                BlockKind::Q4_1 | BlockKind::Q5_1 => {
                    acc + ((s as f32 * d) * dx + h16(blk, 2) * x.s[b])
                }
                _ => (s as f32).mul_add(d * dx, acc),
            }
        }
    }
}

/// `w . x` for one row of GGUF blocks `w` (`kind.row_bytes(n)` bytes), the per-row reference of
/// the packed product: blocks in order through `dot_block`. Blocks past what `x` holds are
/// not read.
pub fn dot_row(kind: BlockKind, w: &[u8], x: &QuantizedRow) -> f32 {
    let held = match kind.inputs().k {
        true => x.k.blocks().min(x.k.q.len() / QK_K),
        false => x.blocks().min(x.q.len() / QK),
    };
    w.chunks_exact(kind.block_bytes())
        .take(held)
        .enumerate()
        .fold(0f32, |acc, (b, blk)| dot_block(kind, blk, x, b, acc))
}

/// One row of GGUF blocks dequantized into `out` (the reference for tests and embeddings).
pub fn dequantize_blocks(kind: BlockKind, w: &[u8], out: &mut [f32]) {
    for (b, o) in w
        .chunks_exact(kind.block_bytes())
        .zip(out.chunks_exact_mut(kind.block_elems()))
    {
        dequantize_block(kind, b, o);
    }
}
