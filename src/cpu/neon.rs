//! aarch64 NEON tier (4 lanes). f32 and bf16 loads are vectorised; f16 rows are widened with
//! `half` per element, because Rust's stable `std::arch` has no f16 vector type yet.
//!
//! Not compiled in this project's CI (x86-64 only); kept small and mechanical for that reason.

use std::arch::aarch64::*;

use half::{bf16, f16};

use super::simd::Simd;

/// NEON (mandatory on aarch64).
#[derive(Clone, Copy)]
pub(crate) struct Neon;

impl Simd for Neon {
    type V = float32x4_t;
    const LANES: usize = 4;
    #[inline(always)]
    unsafe fn zero() -> float32x4_t {
        // SAFETY: neon is mandatory on aarch64.
        unsafe { vdupq_n_f32(0.0) }
    }
    #[inline(always)]
    unsafe fn splat(v: f32) -> float32x4_t {
        // SAFETY: neon is mandatory on aarch64.
        unsafe { vdupq_n_f32(v) }
    }
    #[inline(always)]
    unsafe fn load(p: *const f32) -> float32x4_t {
        // SAFETY: caller guarantees 4 readable f32 at `p`.
        unsafe { vld1q_f32(p) }
    }
    #[inline(always)]
    unsafe fn load_f16(p: *const f16) -> float32x4_t {
        // SAFETY: caller guarantees 4 readable f16 at `p`.
        unsafe {
            let v = [
                (*p).to_f32(),
                (*p.add(1)).to_f32(),
                (*p.add(2)).to_f32(),
                (*p.add(3)).to_f32(),
            ];
            vld1q_f32(v.as_ptr())
        }
    }
    #[inline(always)]
    unsafe fn load_bf16(p: *const bf16) -> float32x4_t {
        // SAFETY: caller guarantees 4 readable bf16 at `p`; widening is a 16-bit left shift.
        unsafe { vreinterpretq_f32_u32(vshlq_n_u32::<16>(vmovl_u16(vld1_u16(p.cast())))) }
    }
    #[inline(always)]
    unsafe fn store(p: *mut f32, v: float32x4_t) {
        // SAFETY: caller guarantees 4 writable f32 at `p`.
        unsafe { vst1q_f32(p, v) }
    }
    #[inline(always)]
    unsafe fn fma(a: float32x4_t, b: float32x4_t, c: float32x4_t) -> float32x4_t {
        // SAFETY: neon is mandatory on aarch64.
        unsafe { vfmaq_f32(c, a, b) }
    }
    #[inline(always)]
    unsafe fn add(a: float32x4_t, b: float32x4_t) -> float32x4_t {
        // SAFETY: neon is mandatory on aarch64.
        unsafe { vaddq_f32(a, b) }
    }
    #[inline(always)]
    unsafe fn hsum(v: float32x4_t) -> f32 {
        // SAFETY: neon is mandatory on aarch64.
        unsafe { vaddvq_f32(v) }
    }
}
