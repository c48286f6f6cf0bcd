//! Column-major GGUF blocks (`ColumnBlocks`) for input-sparse products of every block type: over
//! an input whose skipped channels are zero, the product over the nonzero channels is the dense
//! per-row reference (`cpu::dot_row`) of that input, bit for bit, on every SIMD level and split
//! of the rows, one row at a time and batched (several rows over the union of their channels);
//! the bytes read are counted; bad weights and mismatched inputs are typed errors
//! or computed as nothing, never a panic.
//!
//! Weights are random bytes with finite random scales (every bit pattern of the quants, high
//! bits and packed 6-bit scales), so a kernel that misplaces a bit, a nibble or a scale fails;
//! kept channels come alone and in runs, so the gather of four channels sees every count and
//! spacing.

mod common;

use common::*;
use half::f16;
use powerinfer::cpu::{
    dot_row, ActiveChannels, BlockKind, ColumnBlocks, Kernels, QuantizedRow, SLAB_ROWS, UNIT_ROWS,
};
use powerinfer::{cpu::SimdLevel, ErrorKind};
use proptest::prelude::*;
use rand::{rngs::StdRng, Rng, SeedableRng};

/// `n` values with runs of `run` channels zeroed with probability `drop` each.
fn masked(rng: &mut StdRng, n: usize, drop: f64, run: usize) -> Vec<f32> {
    let mut x = values(rng, n, 2.0);
    for r in x.chunks_mut(run) {
        if rng.random_bool(drop) {
            r.fill(0.0);
        }
    }
    x
}

/// The product of `tier` with the rows split at unit `split` (two "threads"), as bits.
fn product_bits(
    k: &Kernels,
    m: &ColumnBlocks,
    x: &QuantizedRow,
    a: &ActiveChannels,
    split: usize,
) -> Vec<u32> {
    let u = m.units();
    let split = split.min(u);
    let mut out = vec![f32::NAN; u * UNIT_ROWS];
    let (lo, hi) = out.split_at_mut(split * UNIT_ROWS);
    k.column_blocks_q8(m, 0..split, x, a, lo);
    k.column_blocks_q8(m, split..u, x, a, hi);
    out[..m.rows()].iter().map(|v| v.to_bits()).collect()
}

/// A seeded random `rows x cols` matrix of `kind`: the generator (for the inputs), the blocks and
/// their column layout in slabs of `slab` rows.
fn matrix(
    kind: BlockKind,
    rows: usize,
    cols: usize,
    slab: usize,
    seed: u64,
) -> (StdRng, Vec<u8>, ColumnBlocks) {
    let mut rng = StdRng::seed_from_u64(seed);
    let w = random_rows(kind, rows, cols, &mut rng);
    let m = ColumnBlocks::from_blocks_in_slabs(kind, rows, cols, &w, slab).unwrap();
    assert_eq!(m.slab_rows(), slab);
    (rng, w, m)
}

#[allow(clippy::too_many_arguments)]
fn check(
    kind: BlockKind,
    rows: usize,
    cols: usize,
    slab: usize,
    drop: f64,
    run: usize,
    split: usize,
    seed: u64,
) {
    let (mut rng, w, m) = matrix(kind, rows, cols, slab, seed);
    let mut xq = QuantizedRow::default();
    xq.quantize_for(&masked(&mut rng, cols, drop, run), kind.inputs());
    let mut a = ActiveChannels::default();
    a.of(kind, &xq);
    let rb = kind.row_bytes(cols);
    let want: Vec<u32> = w
        .chunks_exact(rb)
        .map(|row| dot_row(kind, row, &xq).to_bits())
        .collect();
    for tier in SimdLevel::supported() {
        let k = Kernels::new(tier).unwrap();
        let got = product_bits(&k, &m, &xq, &a, split);
        assert_eq!(
            got,
            want,
            "{kind} {rows}x{cols} in slabs of {slab}, drop {drop} in runs of {run}, split {split}, \
             {tier}, {} of {} channels",
            a.channels().len(),
            cols
        );
    }
}

/// The batched product of `n` rows (each masked on its own) in pieces of `per` units, split
/// between two "threads" at piece `split`: every row equals `dot_row` on it, bit for bit.
#[allow(clippy::too_many_arguments)]
fn check_rows(
    kind: BlockKind,
    rows: usize,
    cols: usize,
    slab: usize,
    n: usize,
    per: usize,
    drop: f64,
    run: usize,
    split: usize,
    seed: u64,
) {
    let (mut rng, w, m) = matrix(kind, rows, cols, slab, seed);
    let mut xs = vec![QuantizedRow::default(); n];
    let mut sets = vec![ActiveChannels::default(); n];
    for (x, a) in xs.iter_mut().zip(&mut sets) {
        x.quantize_for(&masked(&mut rng, cols, drop, run), kind.inputs());
        a.of(kind, x);
    }
    let mut all = ActiveChannels::default();
    all.union_of(kind, &sets);
    let rb = kind.row_bytes(cols);
    let pieces = m.units().div_ceil(per);
    let split = split.min(pieces);
    let piece = n * per * UNIT_ROWS;
    for tier in SimdLevel::supported() {
        let k = Kernels::new(tier).unwrap();
        let mut out = vec![f32::NAN; pieces * piece];
        let (lo, hi) = out.split_at_mut(split * piece);
        k.column_blocks_rows_q8(&m, 0..split * per, &xs, &all, per, lo);
        k.column_blocks_rows_q8(&m, split * per..m.units(), &xs, &all, per, hi);
        for (r, x) in xs.iter().enumerate() {
            for (i, row) in w.chunks_exact(rb).enumerate() {
                let (u, l) = (i / UNIT_ROWS, i % UNIT_ROWS);
                let at = ((u / per * n + r) * per + u % per) * UNIT_ROWS + l;
                assert_eq!(
                    out[at].to_bits(),
                    dot_row(kind, row, x).to_bits(),
                    "{kind} {rows}x{cols} in slabs of {slab}, row {i} of input {r} of {n}, \
                     {per} units a piece, \
                     drop {drop} in runs of {run}, split {split}, {tier}"
                );
            }
        }
    }
}

fn kind_and_cols() -> impl Strategy<Value = (BlockKind, usize)> {
    (0usize..8, 1usize..4).prop_map(|(k, n)| {
        let kind = BlockKind::ALL[k];
        // 32-weight kinds: widths that are not a multiple of 256 too (Qwen2.5-0.5B: 896).
        let blocks = if kind.block_elems() == 32 { 3 * n } else { n };
        (kind, blocks * kind.block_elems())
    })
}

/// Slab heights: one unit, a few (a split falls inside or on a slab's edge), and the largest.
fn slab_rows() -> impl Strategy<Value = usize> {
    prop::sample::select(vec![
        UNIT_ROWS,
        2 * UNIT_ROWS,
        3 * UNIT_ROWS,
        12 * UNIT_ROWS,
        SLAB_ROWS,
    ])
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]
    #[test]
    fn column_product_is_the_masked_dense_product(
        (kind, cols) in kind_and_cols(),
        rows in 0usize..100,
        drop in prop::sample::select(vec![0.0, 0.3, 0.7, 1.0]),
        run in prop::sample::select(vec![1usize, 3, 4, 8, 32]),
        split in 0usize..5,
        slab in slab_rows(),
        seed in any::<u64>(),
    ) {
        check(kind, rows, cols, slab, drop, run, split, seed);
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]
    #[test]
    fn batched_product_is_each_rows_masked_dense_product(
        (kind, cols) in kind_and_cols(),
        rows in 0usize..700,
        n in 1usize..40,
        per in 1usize..4,
        drop in prop::sample::select(vec![0.0, 0.3, 0.7, 1.0]),
        run in prop::sample::select(vec![1usize, 3, 4, 8, 32]),
        split in 0usize..5,
        slab in slab_rows(),
        seed in any::<u64>(),
    ) {
        check_rows(kind, rows, cols, slab, n, per, drop, run, split, seed);
    }
}

/// Row counts around the unit (32) and AVX-512 (16) widths, every block type, all and some
/// channels kept.
#[test]
fn edge_shapes() {
    for kind in BlockKind::ALL {
        for rows in [0, 1, 15, 16, 17, 31, 32, 33, 63, 64, 65] {
            for drop in [0.0, 0.5, 1.0] {
                check(
                    kind,
                    rows,
                    kind.block_elems(),
                    SLAB_ROWS,
                    drop,
                    1,
                    1,
                    rows as u64,
                );
                check(
                    kind,
                    rows,
                    2 * kind.block_elems(),
                    UNIT_ROWS,
                    drop,
                    3,
                    0,
                    rows as u64 + 7,
                );
            }
        }
    }
}

/// Two "threads" over a matrix of two slabs (`SLAB_ROWS` rows each), split inside the first.
#[test]
fn rows_past_one_pass() {
    for kind in [
        BlockKind::Q4_0,
        BlockKind::Q5K,
        BlockKind::Q6K,
        BlockKind::Q8_0,
    ] {
        let rows = SLAB_ROWS + 8;
        check(kind, rows, 256, SLAB_ROWS, 0.5, 2, 70, 11);
        check_rows(kind, rows, 256, SLAB_ROWS, 3, 2, 0.5, 2, 100, 12);
    }
}

/// The batched product around its tiles (12 units of rows, 32 input rows), every block type:
/// one row, one and several tiles, a last tile of one unit, one input row to more than a chunk.
#[test]
fn batched_edge_shapes() {
    for kind in BlockKind::ALL {
        for (rows, n) in [
            (0, 3),
            (1, 1),
            (33, 2),
            (383, 31),
            (384, 32),
            (385, 33),
            (1057, 40),
            (300, 65),
        ] {
            for slab in [UNIT_ROWS, 3 * UNIT_ROWS, SLAB_ROWS] {
                check_rows(
                    kind,
                    rows,
                    kind.block_elems(),
                    slab,
                    n,
                    2,
                    0.5,
                    1,
                    1,
                    rows as u64,
                );
            }
        }
    }
}

#[test]
fn bytes_read_counts_columns_planes_and_heads() {
    let mut rng = StdRng::seed_from_u64(5);
    for kind in BlockKind::ALL {
        let (rows, cols) = (40, 2 * kind.block_elems());
        let w = random_rows(kind, rows, cols, &mut rng);
        let m = ColumnBlocks::from_blocks(kind, rows, cols, &w).unwrap();
        let mut xq = QuantizedRow::default();
        let mut a = ActiveChannels::default();
        let x: Vec<f32> = (0..cols).map(|i| 1.0 - (i % 7) as f32 * 0.1).collect();
        xq.quantize_for(&x, kind.inputs());
        a.of(kind, &xq);
        assert_eq!(a.channels().len(), cols, "{kind}");
        assert_eq!(
            m.bytes_read(&a),
            m.bytes(),
            "{kind}: every channel reads everything"
        );
        // One channel: its run, its group's planes and its block's heads.
        let mut one = vec![0f32; cols];
        one[5] = 1.0;
        xq.quantize_for(&one, kind.inputs());
        a.of(kind, &xq);
        assert_eq!((a.channels(), a.groups(), a.blocks()), (&[5u32][..], 1, 1));
        let pad = 64;
        let (unit, heads, planes) = match kind {
            BlockKind::Q4_0 => (16, 1, 0),
            BlockKind::Q4_1 => (16, 2, 0),
            BlockKind::Q8_0 => (32, 1, 0),
            BlockKind::Q5_0 => (20, 1, 0),
            BlockKind::Q5_1 => (20, 2, 0),
            BlockKind::Q4K => (16, 2, 2),
            BlockKind::Q5K => (20, 2, 2),
            BlockKind::Q6K => (24, 1, 1),
        };
        let want = pad / UNIT_ROWS * unit + planes * pad + 2 * heads * pad;
        assert_eq!(m.bytes_read(&a), want, "{kind}");
    }
}

/// Each thread's share of a dispatch is one slab (the pool splits chunks statically, the first
/// threads one more), and a share that holds a whole matrix keeps the largest slab.
#[test]
fn thread_slabs_follow_the_pools_shares() {
    // Qwen2.5-1.5B's down (1536 rows) by chunks of 64 on 2 threads: 12 chunks each.
    assert_eq!(ColumnBlocks::thread_slab_rows(1536, 1, 2, 64), 768);
    // 7 chunks on 2 threads: 4 and 3, so slabs of 4 chunks.
    assert_eq!(ColumnBlocks::thread_slab_rows(7 * 64, 1, 2, 64), 256);
    // Gate and up in one dispatch on 2 threads: one matrix each.
    assert_eq!(ColumnBlocks::thread_slab_rows(8960, 2, 2, 64), SLAB_ROWS);
    assert_eq!(ColumnBlocks::thread_slab_rows(8960, 1, 1, 64), SLAB_ROWS);
    // A share that is not a whole unit rounds up; a huge one is capped.
    assert_eq!(ColumnBlocks::thread_slab_rows(100, 1, 4, 8), 32);
    assert_eq!(
        ColumnBlocks::thread_slab_rows(8 * SLAB_ROWS, 1, 2, 64),
        SLAB_ROWS
    );
    // No threads or chunk of zero are read as one.
    assert_eq!(ColumnBlocks::thread_slab_rows(64, 1, 0, 0), SLAB_ROWS);
}

#[test]
fn bad_slab_rows_are_typed_errors() {
    let mut rng = StdRng::seed_from_u64(4);
    let w = random_rows(BlockKind::Q4K, 64, 256, &mut rng);
    for slab in [0, 1, UNIT_ROWS + 1, SLAB_ROWS + UNIT_ROWS] {
        let e = ColumnBlocks::from_blocks_in_slabs(BlockKind::Q4K, 64, 256, &w, slab).unwrap_err();
        assert!(matches!(e.kind(), ErrorKind::Shape { .. }), "{slab}: {e}");
        assert!(e.to_string().contains("slab"), "{slab}: {e}");
    }
}

#[test]
fn bad_weights_are_typed_errors() {
    let mut rng = StdRng::seed_from_u64(9);
    for kind in BlockKind::ALL {
        let cols = kind.block_elems();
        let w = random_rows(kind, 3, cols, &mut rng);
        let e = ColumnBlocks::from_blocks(kind, 3, cols + 1, &w).unwrap_err();
        assert!(matches!(e.kind(), ErrorKind::Shape { .. }), "{kind}: {e}");
        let e = ColumnBlocks::from_blocks(kind, 3, 0, &w).unwrap_err();
        assert!(matches!(e.kind(), ErrorKind::Shape { .. }), "{kind}: {e}");
        let e = ColumnBlocks::from_blocks(kind, 4, cols, &w).unwrap_err();
        assert!(matches!(e.kind(), ErrorKind::Shape { .. }), "{kind}: {e}");
        for &at in kind.half_offsets() {
            let mut bad = w.clone();
            let off = kind.row_bytes(cols) + at;
            bad[off..off + 2].copy_from_slice(&f16::NAN.to_le_bytes());
            let e = ColumnBlocks::from_blocks(kind, 3, cols, &bad).unwrap_err();
            assert!(
                matches!(e.kind(), ErrorKind::NonFinite { index, .. } if *index == off),
                "{kind}: {e}"
            );
        }
    }
}

/// An input quantized for another block type or width computes nothing, and an output too
/// short is cut: no panic, nothing written past what fits.
#[test]
fn mismatched_inputs_compute_nothing() {
    let mut rng = StdRng::seed_from_u64(3);
    let w = random_rows(BlockKind::Q4K, 64, 256, &mut rng);
    let m = ColumnBlocks::from_blocks(BlockKind::Q4K, 64, 256, &w).unwrap();
    let x = values(&mut rng, 256, 1.0);
    let mut a = ActiveChannels::default();
    for tier in SimdLevel::supported() {
        let k = Kernels::new(tier).unwrap();
        let mut xq = QuantizedRow::default();
        xq.quantize_for(&x, BlockKind::Q4_0.inputs());
        a.of(BlockKind::Q4_0, &xq);
        let mut out = vec![7f32; 64];
        k.column_blocks_q8(&m, 0..2, &xq, &a, &mut out);
        assert!(
            out.iter().all(|&v| v == 7.0),
            "{tier}: 32-value input to Q4_K"
        );
        xq.quantize_for(&x[..255 / 32 * 32], BlockKind::Q4K.inputs());
        a.of(BlockKind::Q4K, &xq);
        k.column_blocks_q8(&m, 0..2, &xq, &a, &mut out);
        assert!(out.iter().all(|&v| v == 7.0), "{tier}: short input");
        xq.quantize_for(&x, BlockKind::Q4K.inputs());
        a.of(BlockKind::Q4K, &xq);
        let mut short = vec![7f32; 40];
        k.column_blocks_q8(&m, 0..2, &xq, &a, &mut short);
        assert!(
            short[..32].iter().all(|&v| v != 7.0),
            "{tier}: first unit computed"
        );
        assert!(
            short[32..].iter().all(|&v| v == 7.0),
            "{tier}: no partial unit"
        );
    }
}
