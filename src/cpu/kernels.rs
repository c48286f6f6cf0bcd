//! The kernel table: one set of row kernels per SIMD level, chosen at run time.
//!
//! The portable table is always available; each tier the CPU supports can replace it. The choice
//! is made once per [`Kernels`] value (by detection, by `POWERINFER_CPU`, or explicitly in tests),
//! so every tier can be exercised on a machine that has it.

use std::fmt;
use std::str::FromStr;

use half::{bf16, f16};

use std::ops::Range;

use super::column_blocks::{self, ActiveChannels, ColumnBlocks};
use super::column_matrix::{self, ActiveColumns, ColumnData, ColumnMatrix};
use super::packed::{self, PackedRows};
use super::quant::{self, QuantKind, QuantizedRow, QK};
use super::simd::{self, Scalar};
use super::split;
use crate::error::{Error, Result};

/// A SIMD level of the CPU kernels.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum SimdLevel {
    /// Plain Rust, one lane. Always available.
    Scalar,
    /// x86-64 AVX2 + FMA + F16C, 8 lanes.
    Avx2,
    /// x86-64 AVX-512F, 16 lanes.
    Avx512,
    /// aarch64 NEON, 4 lanes.
    Neon,
}

/// The environment variable that forces a tier (`scalar`, `avx2`, `avx512`, `neon`).
pub const SIMD_LEVEL_ENV: &str = "POWERINFER_CPU";

impl SimdLevel {
    /// Every tier, best last.
    pub const ALL: [SimdLevel; 4] = [
        SimdLevel::Scalar,
        SimdLevel::Neon,
        SimdLevel::Avx2,
        SimdLevel::Avx512,
    ];

    /// True when this CPU can run the tier.
    pub fn is_supported(self) -> bool {
        match self {
            SimdLevel::Scalar => true,
            #[cfg(target_arch = "x86_64")]
            SimdLevel::Avx2 => {
                std::arch::is_x86_feature_detected!("avx2")
                    && std::arch::is_x86_feature_detected!("fma")
                    && std::arch::is_x86_feature_detected!("f16c")
            }
            #[cfg(target_arch = "x86_64")]
            SimdLevel::Avx512 => std::arch::is_x86_feature_detected!("avx512f"),
            #[cfg(target_arch = "aarch64")]
            SimdLevel::Neon => true,
            #[allow(unreachable_patterns)]
            _ => false,
        }
    }

    /// The tiers this CPU supports, best last.
    pub fn supported() -> Vec<SimdLevel> {
        Self::ALL.into_iter().filter(|t| t.is_supported()).collect()
    }

    /// The best supported tier.
    pub fn best() -> SimdLevel {
        Self::supported().pop().unwrap_or(SimdLevel::Scalar)
    }

    /// The tier named by `POWERINFER_CPU`, if set; a typed error when it names an unknown tier or
    /// one this CPU lacks.
    pub fn from_env() -> Result<Option<SimdLevel>> {
        match std::env::var(SIMD_LEVEL_ENV) {
            Ok(s) if !s.is_empty() => {
                let t: SimdLevel = s.parse()?;
                if !t.is_supported() {
                    return Err(Error::config(
                        SIMD_LEVEL_ENV,
                        format!("tier `{t}` is not supported by this CPU"),
                    ));
                }
                Ok(Some(t))
            }
            _ => Ok(None),
        }
    }
}

impl fmt::Display for SimdLevel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            SimdLevel::Scalar => "scalar",
            SimdLevel::Avx2 => "avx2",
            SimdLevel::Avx512 => "avx512",
            SimdLevel::Neon => "neon",
        })
    }
}

impl FromStr for SimdLevel {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s.to_ascii_lowercase().as_str() {
            "scalar" => Ok(SimdLevel::Scalar),
            "avx2" => Ok(SimdLevel::Avx2),
            "avx512" => Ok(SimdLevel::Avx512),
            "neon" => Ok(SimdLevel::Neon),
            _ => Err(Error::config(
                SIMD_LEVEL_ENV,
                format!("unknown tier `{s}` (scalar, avx2, avx512, neon)"),
            )),
        }
    }
}

/// AVX-512 with the byte, vector-length and VNNI extensions the integer kernels need.
#[cfg(target_arch = "x86_64")]
fn has_vnni512() -> bool {
    std::arch::is_x86_feature_detected!("avx512f")
        && std::arch::is_x86_feature_detected!("avx512bw")
        && std::arch::is_x86_feature_detected!("avx512vl")
        && std::arch::is_x86_feature_detected!("avx512vnni")
        && std::arch::is_x86_feature_detected!("f16c")
}

type DotFn<E> = fn(&[E], &[f32]) -> f32;
type AxpyFn<E> = fn(&mut [f32], f32, &[E]);
type Dot4Fn<E> = fn([&[E]; 4], &[f32]) -> [f32; 4];
type Axpy4Fn<E> = fn(&mut [f32], [f32; 4], [&[E]; 4]);

/// Row kernels of one tier. Lengths: both operands are cut to the shorter one.
///
/// A kernel's name says what it reads, ggml's way (`vec_dot_q4_K_q8_K`): the operation, the
/// weights' layout or block type, then the input's. `dot_f16`: an f16 row against f32;
/// `dot_gguf_q8`: a Q4_0 / Q4_1 / Q8_0 row as the file stores it against a Q8 input;
/// `dot_split_q8`: the same blocks with their scales split out (`split_row`, the neuron
/// bundles); `axpy_q8_0`, `axpy_split_q8_0`: `y += a w` from Q8_0 rows; `gemm_packed_q8`:
/// [`PackedRows`] (every GGUF type the dense decoder runs) against Q8 or Q8_K inputs;
/// `column_matrix_q8`: a [`ColumnMatrix`] (column-major Q4_0 / Q4_1 / Q8_0 with scale planes,
/// or floats against f32); `column_blocks_q8`, `column_blocks_rows_q8`: [`ColumnBlocks`]
/// (column-major GGUF blocks of every type) against Q8 or Q8_K inputs, one row or a prompt's.
#[derive(Clone, Copy)]
pub struct Kernels {
    tier: SimdLevel,
    dot_f32: DotFn<f32>,
    dot_f16: DotFn<f16>,
    dot_bf16: DotFn<bf16>,
    axpy_f32: AxpyFn<f32>,
    axpy_f16: AxpyFn<f16>,
    axpy_bf16: AxpyFn<bf16>,
    dot4_f32: Dot4Fn<f32>,
    dot4_f16: Dot4Fn<f16>,
    dot4_bf16: Dot4Fn<bf16>,
    axpy4_f32: Axpy4Fn<f32>,
    axpy4_f16: Axpy4Fn<f16>,
    axpy4_bf16: Axpy4Fn<bf16>,
    dot_gguf_q8: fn(QuantKind, &[u8], &QuantizedRow) -> f32,
    axpy_q8_0: fn(&mut [f32], f32, &[u8]),
    pub(crate) gemm_packed_q8: GemmFn,
    pub(crate) column_matrix_q8: column_matrix::ColumnsFn,
    column_blocks_q8: column_blocks::ColumnBlocksFn,
    column_blocks_rows_q8: column_blocks::ColumnBlocksRowsFn,
    /// Whether `column_blocks_q8` is a SIMD kernel (else the portable product).
    column_blocks_simd: bool,
    dot_split_q8: fn(QuantKind, &[u8], &QuantizedRow) -> f32,
    dot2_split_q8: fn(QuantKind, [&[u8]; 2], &QuantizedRow) -> [f32; 2],
    axpy_split_q8_0: fn(&mut [f32], f32, &[u8]),
    axpy4_split_q8_0: fn(&mut [f32], [f32; 4], [&[u8]; 4]),
}

/// The packed-matrix product (see `packed::gemm` for the contract the kernels rely on).
pub(crate) type GemmFn = fn(&PackedRows, Range<usize>, &[QuantizedRow], &mut [f32]);

impl fmt::Debug for Kernels {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Kernels").field("tier", &self.tier).finish()
    }
}

/// Builds a table from a `Simd` type behind a `#[target_feature]` wrapper per kernel.
macro_rules! table {
    ($tier:expr, $S:ty, $feat:literal) => {{
        #[target_feature(enable = $feat)]
        unsafe fn dot<E: simd::Elem>(w: &[E], x: &[f32]) -> f32 {
            // SAFETY: only reachable through a table built after detecting these features.
            unsafe { simd::dot::<$S, E>(w, x) }
        }
        #[target_feature(enable = $feat)]
        unsafe fn axpy<E: simd::Elem>(y: &mut [f32], a: f32, w: &[E]) {
            // SAFETY: only reachable through a table built after detecting these features.
            unsafe { simd::axpy::<$S, E>(y, a, w) }
        }
        #[target_feature(enable = $feat)]
        unsafe fn dot4<E: simd::Elem>(w: [&[E]; 4], x: &[f32]) -> [f32; 4] {
            // SAFETY: only reachable through a table built after detecting these features.
            unsafe { simd::dot4::<$S, E>(w, x) }
        }
        #[target_feature(enable = $feat)]
        unsafe fn axpy4<E: simd::Elem>(y: &mut [f32], a: [f32; 4], w: [&[E]; 4]) {
            // SAFETY: only reachable through a table built after detecting these features.
            unsafe { simd::axpy4::<$S, E>(y, a, w) }
        }
        Kernels {
            tier: $tier,
            // SAFETY (all twelve): `Kernels::new` builds this table only when `is_supported()`.
            dot_f32: |w, x| unsafe { dot::<f32>(w, x) },
            dot_f16: |w, x| unsafe { dot::<f16>(w, x) },
            dot_bf16: |w, x| unsafe { dot::<bf16>(w, x) },
            axpy_f32: |y, a, w| unsafe { axpy::<f32>(y, a, w) },
            axpy_f16: |y, a, w| unsafe { axpy::<f16>(y, a, w) },
            axpy_bf16: |y, a, w| unsafe { axpy::<bf16>(y, a, w) },
            dot4_f32: |w, x| unsafe { dot4::<f32>(w, x) },
            dot4_f16: |w, x| unsafe { dot4::<f16>(w, x) },
            dot4_bf16: |w, x| unsafe { dot4::<bf16>(w, x) },
            axpy4_f32: |y, a, w| unsafe { axpy4::<f32>(y, a, w) },
            axpy4_f16: |y, a, w| unsafe { axpy4::<f16>(y, a, w) },
            axpy4_bf16: |y, a, w| unsafe { axpy4::<bf16>(y, a, w) },
            // The integer kernels start portable; `Kernels::new` replaces those the CPU has.
            ..Kernels::scalar()
        }
    }};
}

impl Kernels {
    /// The table for `tier`, or a typed error if this CPU cannot run it.
    // The tables' closures share one `// SAFETY` line per table (see `table!` and `scalar`).
    #[allow(clippy::undocumented_unsafe_blocks)]
    pub fn new(tier: SimdLevel) -> Result<Kernels> {
        if !tier.is_supported() {
            return Err(Error::config(
                "simd_level",
                format!("tier `{tier}` is not supported by this CPU"),
            ));
        }
        #[allow(unused_mut)]
        let mut k = match tier {
            #[cfg(target_arch = "x86_64")]
            SimdLevel::Avx2 => table!(SimdLevel::Avx2, super::x86::Avx2, "avx2,fma,f16c"),
            #[cfg(target_arch = "x86_64")]
            SimdLevel::Avx512 => table!(SimdLevel::Avx512, super::x86::Avx512, "avx512f"),
            #[cfg(target_arch = "aarch64")]
            SimdLevel::Neon => table!(SimdLevel::Neon, super::neon::Neon, "neon"),
            _ => Kernels::scalar(),
        };
        // The integer kernels have an AVX2 form, used by every x86 tier above scalar.
        #[cfg(target_arch = "x86_64")]
        if tier != SimdLevel::Scalar && SimdLevel::Avx2.is_supported() {
            // SAFETY (both): AVX2 and FMA were detected just above.
            k.dot_gguf_q8 = |kind, w, x| unsafe { quant::avx2::dot(kind, w, x) };
            k.axpy_q8_0 = |y, a, w| unsafe { quant::avx2::axpy_q8_0(y, a, w) };
            // SAFETY (six): AVX2, FMA and F16C are part of every tier above scalar (checked
            // above).
            k.gemm_packed_q8 = |p, g, x, o| unsafe { packed::x86::gemm_avx2(p, g, x, o) };
            k.dot_split_q8 = |kind, w, x| unsafe { split::x86::dot_avx2(kind, w, x) };
            k.dot2_split_q8 = |kind, w, x| unsafe {
                [
                    split::x86::dot_avx2(kind, w[0], x),
                    split::x86::dot_avx2(kind, w[1], x),
                ]
            };
            k.axpy_split_q8_0 = |y, a, w| unsafe { split::x86::axpy_avx2(y, a, w) };
            k.axpy4_split_q8_0 = |y, a, w| unsafe { split::x86::axpy4_avx2(y, a, w) };
            k.column_matrix_q8 =
                |m, c, x, a, o| unsafe { column_matrix::x86::product_avx2(m, c, x, a, o) };
        }
        // The integer products use AVX-512 VNNI where the AVX-512 tier has it.
        #[cfg(target_arch = "x86_64")]
        if tier == SimdLevel::Avx512 && has_vnni512() {
            // SAFETY (six): AVX-512F/BW/VL/VNNI detected by `has_vnni512`.
            k.gemm_packed_q8 = |p, g, x, o| unsafe { packed::x86::gemm_vnni(p, g, x, o) };
            k.dot_split_q8 = |kind, w, x| unsafe { split::x86::dot_vnni(kind, w, x) };
            k.dot2_split_q8 = |kind, w, x| unsafe { split::x86::dot2_vnni(kind, w, x) };
            k.axpy_split_q8_0 = |y, a, w| unsafe { split::x86::axpy_avx512(y, a, w) };
            k.axpy4_split_q8_0 = |y, a, w| unsafe { split::x86::axpy4_avx512(y, a, w) };
            k.column_matrix_q8 =
                |m, c, x, a, o| unsafe { column_matrix::x86::product_vnni(m, c, x, a, o) };
        }
        // The column-block product also needs VBMI and BITALG (its gather), F16C and FMA.
        #[cfg(target_arch = "x86_64")]
        if tier == SimdLevel::Avx512 && has_vnni512() && column_blocks::x86::supported() {
            // SAFETY: AVX-512F/BW/VL/VNNI detected by `has_vnni512`, the rest by `supported`.
            k.column_blocks_q8 =
                |m, u, x, a, o| unsafe { column_blocks::row_x86::product_vnni(m, u, x, a, o) };
            // SAFETY: as above.
            k.column_blocks_rows_q8 = |m, u, x, a, p, o| unsafe {
                column_blocks::x86::product_rows_vnni(m, u, x, a, p, o)
            };
            k.column_blocks_simd = true;
        }
        Ok(k)
    }

    /// Whether [`Kernels::column_blocks_q8`] runs a SIMD kernel on this tier (AVX-512 VNNI with
    /// VBMI and BITALG); elsewhere it runs the portable product, several times slower.
    pub fn has_column_blocks_simd(&self) -> bool {
        self.column_blocks_simd
    }

    /// True when the integer kernels of this table use AVX-512 VNNI.
    pub fn uses_vnni(&self) -> bool {
        #[cfg(target_arch = "x86_64")]
        {
            self.tier == SimdLevel::Avx512 && has_vnni512()
        }
        #[cfg(not(target_arch = "x86_64"))]
        false
    }

    // One `// SAFETY` line covers the table's closures.
    #[allow(clippy::undocumented_unsafe_blocks)]
    fn scalar() -> Kernels {
        Kernels {
            tier: SimdLevel::Scalar,
            // SAFETY (all twelve): the scalar tier needs no CPU feature.
            dot_f32: |w, x| unsafe { simd::dot::<Scalar, f32>(w, x) },
            dot_f16: |w, x| unsafe { simd::dot::<Scalar, f16>(w, x) },
            dot_bf16: |w, x| unsafe { simd::dot::<Scalar, bf16>(w, x) },
            axpy_f32: |y, a, w| unsafe { simd::axpy::<Scalar, f32>(y, a, w) },
            axpy_f16: |y, a, w| unsafe { simd::axpy::<Scalar, f16>(y, a, w) },
            axpy_bf16: |y, a, w| unsafe { simd::axpy::<Scalar, bf16>(y, a, w) },
            dot4_f32: |w, x| unsafe { simd::dot4::<Scalar, f32>(w, x) },
            dot4_f16: |w, x| unsafe { simd::dot4::<Scalar, f16>(w, x) },
            dot4_bf16: |w, x| unsafe { simd::dot4::<Scalar, bf16>(w, x) },
            axpy4_f32: |y, a, w| unsafe { simd::axpy4::<Scalar, f32>(y, a, w) },
            axpy4_f16: |y, a, w| unsafe { simd::axpy4::<Scalar, f16>(y, a, w) },
            axpy4_bf16: |y, a, w| unsafe { simd::axpy4::<Scalar, bf16>(y, a, w) },
            dot_gguf_q8: quant::dot_scalar,
            axpy_q8_0: quant::axpy_q8_0_scalar,
            gemm_packed_q8: packed::gemm_scalar,
            column_matrix_q8: column_matrix::product_scalar,
            column_blocks_q8: column_blocks::product_scalar,
            column_blocks_rows_q8: column_blocks::product_rows_scalar,
            column_blocks_simd: false,
            dot_split_q8: split::dot_scalar,
            dot2_split_q8: split::dot2_scalar,
            axpy_split_q8_0: split::axpy_scalar,
            axpy4_split_q8_0: split::axpy4_scalar,
        }
    }

    /// `out = W x` for the rows of `m` in units `units` of [`crate::cpu::UNIT_ROWS`] rows (`out`
    /// holds `units.len() * 32` values), reading only the channels in `active`, which must come
    /// from `x` ([`ActiveChannels::of`]); `x` is the input quantized for the matrix's block type
    /// ([`QuantizedRow::quantize_for`] with `kind.inputs()`). Over an input whose skipped
    /// channels are zero this is the dense product of that input, bit for bit. Arguments that do
    /// not fit are cut to what fits; an input quantized for another block type computes nothing.
    pub fn column_blocks_q8(
        &self,
        m: &ColumnBlocks,
        units: Range<usize>,
        x: &QuantizedRow,
        active: &ActiveChannels,
        out: &mut [f32],
    ) {
        (self.column_blocks_q8)(m, units, x, active, out)
    }

    /// [`Kernels::column_blocks_q8`] for every row of `xs` at once (a prompt's rows), reading each
    /// channel in `active` once per tile of rows: `active` must hold every channel where some row
    /// is nonzero ([`ActiveChannels::union_of`]). `out` is in pieces of `per` units: unit `u`
    /// (counted from `units.start`) of row `r` starts at `((u / per) * rows + r) * per * 32 + (u %
    /// per) * 32`, so pieces of `per` units can be split among threads. Each row's result is
    /// [`Kernels::column_blocks_q8`]'s for that row, bit for bit. Arguments that do not fit are cut
    /// to what fits (whole pieces of `out`).
    pub fn column_blocks_rows_q8(
        &self,
        m: &ColumnBlocks,
        units: Range<usize>,
        xs: &[QuantizedRow],
        active: &ActiveChannels,
        per: usize,
        out: &mut [f32],
    ) {
        (self.column_blocks_rows_q8)(m, units, xs, active, per, out)
    }

    /// `out = W x` for the rows of `m` in chunks `chunks` (`out` holds `chunks.len() * 64`
    /// values), reading only the columns in `active`. Quantized matrices take `xq` (the input
    /// quantized by [`QuantizedRow::quantize`]; `active` must list its nonzero values, as
    /// [`ActiveColumns::of_quantized`] does), float ones `x` (`active` from
    /// [`ActiveColumns::of_f32`]). Arguments that do not fit are cut to what fits.
    pub fn column_matrix_q8(
        &self,
        m: &ColumnMatrix,
        chunks: Range<usize>,
        x: &[f32],
        xq: &QuantizedRow,
        active: &ActiveColumns,
        out: &mut [f32],
    ) {
        column_product(self, m, chunks, x, xq, active.columns(), out)
    }

    /// `POWERINFER_CPU` if set, else the best detected tier.
    pub fn detect() -> Result<Kernels> {
        Kernels::new(SimdLevel::from_env()?.unwrap_or_else(SimdLevel::best))
    }

    /// The table for `tier`, or for the detected tier ([`Kernels::detect`]) with `None`.
    pub fn for_tier(tier: Option<SimdLevel>) -> Result<Kernels> {
        match tier {
            Some(t) => Kernels::new(t),
            None => Kernels::detect(),
        }
    }

    /// The tier of this table.
    pub fn tier(&self) -> SimdLevel {
        self.tier
    }

    /// `sum_i w[i] * x[i]` for an f32 row.
    pub fn dot_f32(&self, w: &[f32], x: &[f32]) -> f32 {
        (self.dot_f32)(w, x)
    }

    /// `y += a * w` for an f32 row.
    pub fn axpy_f32(&self, y: &mut [f32], a: f32, w: &[f32]) {
        (self.axpy_f32)(y, a, w)
    }

    /// `sum_i w[i] * x[i]` for an f16 row.
    pub fn dot_f16(&self, w: &[f16], x: &[f32]) -> f32 {
        (self.dot_f16)(w, x)
    }

    /// `sum_i w[i] * x[i]` for a bf16 row.
    pub fn dot_bf16(&self, w: &[bf16], x: &[f32]) -> f32 {
        (self.dot_bf16)(w, x)
    }

    /// `y += a * w` for an f16 row.
    pub fn axpy_f16(&self, y: &mut [f32], a: f32, w: &[f16]) {
        (self.axpy_f16)(y, a, w)
    }

    /// `y += a * w` for a bf16 row.
    pub fn axpy_bf16(&self, y: &mut [f32], a: f32, w: &[bf16]) {
        (self.axpy_bf16)(y, a, w)
    }

    /// Four f32 rows dotted with the same `x`.
    pub fn dot4_f32(&self, w: [&[f32]; 4], x: &[f32]) -> [f32; 4] {
        (self.dot4_f32)(w, x)
    }

    /// Four f16 rows dotted with the same `x`.
    pub fn dot4_f16(&self, w: [&[f16]; 4], x: &[f32]) -> [f32; 4] {
        (self.dot4_f16)(w, x)
    }

    /// Four bf16 rows dotted with the same `x`.
    pub fn dot4_bf16(&self, w: [&[bf16]; 4], x: &[f32]) -> [f32; 4] {
        (self.dot4_bf16)(w, x)
    }

    /// `y += a[0] w[0] + .. + a[3] w[3]` for f32 rows.
    pub fn axpy4_f32(&self, y: &mut [f32], a: [f32; 4], w: [&[f32]; 4]) {
        (self.axpy4_f32)(y, a, w)
    }

    /// `y += a[0] w[0] + .. + a[3] w[3]` for f16 rows.
    pub fn axpy4_f16(&self, y: &mut [f32], a: [f32; 4], w: [&[f16]; 4]) {
        (self.axpy4_f16)(y, a, w)
    }

    /// `y += a[0] w[0] + .. + a[3] w[3]` for bf16 rows.
    pub fn axpy4_bf16(&self, y: &mut [f32], a: [f32; 4], w: [&[bf16]; 4]) {
        (self.axpy4_bf16)(y, a, w)
    }

    /// `w . x` for a quantized row against an input quantized with [`QuantizedRow::quantize`].
    pub fn dot_gguf_q8(&self, kind: QuantKind, w: &[u8], x: &QuantizedRow) -> f32 {
        (self.dot_gguf_q8)(kind, w, x)
    }

    /// `y += a * w` for a Q8_0 row.
    pub fn axpy_q8_0(&self, y: &mut [f32], a: f32, w: &[u8]) {
        (self.axpy_q8_0)(y, a, w)
    }

    /// `w . x` for a quantized row in the split layout ([`split_row`](crate::cpu::split_row): scales
    /// first, then values) against an input quantized with [`QuantizedRow::quantize`].
    pub fn dot_split_q8(&self, kind: QuantKind, w: &[u8], x: &QuantizedRow) -> f32 {
        (self.dot_split_q8)(kind, w, x)
    }

    /// Two split rows against the same input (a neuron's gate and up): the input is read once.
    pub fn dot2_split_q8(&self, kind: QuantKind, w: [&[u8]; 2], x: &QuantizedRow) -> [f32; 2] {
        (self.dot2_split_q8)(kind, w, x)
    }

    /// `y += a * w` for a Q8_0 row in the split layout.
    pub fn axpy_split_q8_0(&self, y: &mut [f32], a: f32, w: &[u8]) {
        (self.axpy_split_q8_0)(y, a, w)
    }

    /// `y += a[0] w[0] + .. + a[3] w[3]` for four Q8_0 rows in the split layout (the accumulator
    /// is read and written once for the four).
    pub fn axpy4_split_q8_0(&self, y: &mut [f32], a: [f32; 4], w: [&[u8]; 4]) {
        (self.axpy4_split_q8_0)(y, a, w)
    }

    /// The dot kernel for storage element `E`.
    pub(crate) fn dot<E: RowElem>(&self) -> DotFn<E> {
        E::dot(self)
    }

    /// The axpy kernel for storage element `E`.
    pub(crate) fn axpy<E: RowElem>(&self) -> AxpyFn<E> {
        E::axpy(self)
    }

    /// The four-row dot kernel for storage element `E`.
    pub(crate) fn dot4<E: RowElem>(&self) -> Dot4Fn<E> {
        E::dot4(self)
    }

    /// The four-row axpy kernel for storage element `E`.
    pub(crate) fn axpy4<E: RowElem>(&self) -> Axpy4Fn<E> {
        E::axpy4(self)
    }
}

/// The packed product's driver: `out[((g - groups.start) * xs.len() + r) * 16 + l] = row (16 g + l) . xs[r]` for the groups in
/// `groups`, with the kernels of `k`. Inputs with fewer blocks than the matrix, groups past the
/// matrix or an `out` too short are cut to what fits (never read or written out of bounds).
pub(crate) fn gemm(
    k: &Kernels,
    p: &PackedRows,
    groups: Range<usize>,
    xs: &[QuantizedRow],
    out: &mut [f32],
) {
    let groups = packed::clamp_groups(p, groups, xs.len(), out);
    if groups.is_empty() {
        return;
    }
    if xs
        .iter()
        .any(|x| packed::input_blocks(p.kind(), x) < p.blocks())
    {
        // A short input row: the reference cuts each row to its own blocks.
        return packed::gemm_scalar(p, groups, xs, out);
    }
    (k.gemm_packed_q8)(p, groups, xs, out)
}

/// The column product's driver (the body of [`Kernels::column_matrix_q8`]):
/// `out = W[rows of chunks, active] . x[active]` for the rows in `chunks` (`out` holds
/// `chunks.len() * column_matrix::CHUNK` values). Quantized matrices take `xq` (the input quantized by
/// [`QuantizedRow::quantize`], whose nonzero values `active` lists); float matrices take `x`.
/// Arguments that do not fit (chunks past the matrix, a short `out` or input) are cut to what
/// fits: never read or written out of bounds.
pub(crate) fn column_product(
    k: &Kernels,
    m: &ColumnMatrix,
    chunks: Range<usize>,
    x: &[f32],
    xq: &QuantizedRow,
    active: &[u32],
    out: &mut [f32],
) {
    let end = chunks
        .end
        .min(m.chunks())
        .min(chunks.start + out.len() / column_matrix::CHUNK);
    let chunks = chunks.start.min(end)..end;
    let out = &mut out[..chunks.len() * column_matrix::CHUNK];
    let active = match active.iter().position(|&c| c as usize >= m.cols()) {
        Some(n) => &active[..n],
        None => active,
    };
    match &m.data {
        ColumnData::Quant { .. } => {
            if xq.values().len() < m.cols() || xq.blocks() < m.cols() / QK {
                return out.fill(0.0);
            }
            (k.column_matrix_q8)(m, chunks, xq, active, out)
        }
        ColumnData::F32(w) => float(k, w, m.pad(), chunks, x, active, out),
        ColumnData::F16(w) => float(k, w, m.pad(), chunks, x, active, out),
        ColumnData::BF16(w) => float(k, w, m.pad(), chunks, x, active, out),
    }
}

/// Float columns: four active columns per pass over the outputs (`axpy4`), the rest one by one.
fn float<E: RowElem>(
    k: &Kernels,
    w: &[E],
    pad: usize,
    chunks: Range<usize>,
    x: &[f32],
    active: &[u32],
    out: &mut [f32],
) {
    out.fill(0.0);
    let rows = chunks.start * column_matrix::CHUNK..chunks.end * column_matrix::CHUNK;
    let col = |c: u32| &w[c as usize * pad..][rows.clone()];
    let active = match active.iter().position(|&c| c as usize >= x.len()) {
        Some(n) => &active[..n],
        None => active,
    };
    let mut quads = active.chunks_exact(4);
    for q in quads.by_ref() {
        let a = [q[0], q[1], q[2], q[3]];
        k.axpy4::<E>()(out, a.map(|c| x[c as usize]), a.map(col));
    }
    for &c in quads.remainder() {
        k.axpy::<E>()(out, x[c as usize], col(c));
    }
}

/// Storage elements with kernels in every table.
pub(crate) trait RowElem: simd::Elem + Send + Sync + 'static {
    fn dot(k: &Kernels) -> DotFn<Self>;
    fn axpy(k: &Kernels) -> AxpyFn<Self>;
    fn axpy4(k: &Kernels) -> Axpy4Fn<Self>;
    fn dot4(k: &Kernels) -> Dot4Fn<Self>;
}

macro_rules! row_elem {
    ($t:ty, $dot:ident, $axpy:ident, $axpy4:ident, $dot4:ident) => {
        impl RowElem for $t {
            fn dot(k: &Kernels) -> DotFn<Self> {
                k.$dot
            }
            fn axpy(k: &Kernels) -> AxpyFn<Self> {
                k.$axpy
            }
            fn axpy4(k: &Kernels) -> Axpy4Fn<Self> {
                k.$axpy4
            }
            fn dot4(k: &Kernels) -> Dot4Fn<Self> {
                k.$dot4
            }
        }
    };
}
row_elem!(f32, dot_f32, axpy_f32, axpy4_f32, dot4_f32);
row_elem!(f16, dot_f16, axpy_f16, axpy4_f16, dot4_f16);
row_elem!(bf16, dot_bf16, axpy_bf16, axpy4_bf16, dot4_bf16);
