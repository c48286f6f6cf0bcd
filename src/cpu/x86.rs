//! x86-64 tiers: AVX2 + FMA + F16C (8 lanes) and AVX-512F (16 lanes).
//!
//! Only [`super::Kernels`] constructs tables from these, after run-time feature detection.

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

use half::{bf16, f16};

use super::simd::Simd;

/// AVX2 + FMA + F16C. Constructed only after detecting all three.
#[derive(Clone, Copy)]
pub(crate) struct Avx2;

impl Simd for Avx2 {
    type V = __m256;
    const LANES: usize = 8;
    #[inline(always)]
    unsafe fn zero() -> __m256 {
        // SAFETY: avx is part of this tier's detected features.
        unsafe { _mm256_setzero_ps() }
    }
    #[inline(always)]
    unsafe fn splat(v: f32) -> __m256 {
        // SAFETY: avx detected.
        unsafe { _mm256_set1_ps(v) }
    }
    #[inline(always)]
    unsafe fn load(p: *const f32) -> __m256 {
        // SAFETY: caller guarantees 8 readable f32 at `p`; unaligned load.
        unsafe { _mm256_loadu_ps(p) }
    }
    #[inline(always)]
    unsafe fn load_f16(p: *const f16) -> __m256 {
        // SAFETY: caller guarantees 8 readable f16 (16 bytes) at `p`; f16c detected.
        unsafe { _mm256_cvtph_ps(_mm_loadu_si128(p.cast())) }
    }
    #[inline(always)]
    unsafe fn load_bf16(p: *const bf16) -> __m256 {
        // SAFETY: caller guarantees 8 readable bf16 at `p`; bf16 -> f32 is a 16-bit left shift.
        unsafe {
            _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(
                _mm_loadu_si128(p.cast()),
            )))
        }
    }
    #[inline(always)]
    unsafe fn store(p: *mut f32, v: __m256) {
        // SAFETY: caller guarantees 8 writable f32 at `p`.
        unsafe { _mm256_storeu_ps(p, v) }
    }
    #[inline(always)]
    unsafe fn fma(a: __m256, b: __m256, c: __m256) -> __m256 {
        // SAFETY: fma detected.
        unsafe { _mm256_fmadd_ps(a, b, c) }
    }
    #[inline(always)]
    unsafe fn add(a: __m256, b: __m256) -> __m256 {
        // SAFETY: avx detected.
        unsafe { _mm256_add_ps(a, b) }
    }
    #[inline(always)]
    unsafe fn hsum(v: __m256) -> f32 {
        // SAFETY: avx/sse3 detected (implied by avx2).
        unsafe {
            let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
            let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
            let s = _mm_add_ss(s, _mm_shuffle_ps::<0b01>(s, s));
            _mm_cvtss_f32(s)
        }
    }
}

/// AVX-512F (with F16C conversions in 512-bit form, which AVX-512F includes).
#[derive(Clone, Copy)]
pub(crate) struct Avx512;

impl Simd for Avx512 {
    type V = __m512;
    const LANES: usize = 16;
    #[inline(always)]
    unsafe fn zero() -> __m512 {
        // SAFETY: avx512f detected.
        unsafe { _mm512_setzero_ps() }
    }
    #[inline(always)]
    unsafe fn splat(v: f32) -> __m512 {
        // SAFETY: avx512f detected.
        unsafe { _mm512_set1_ps(v) }
    }
    #[inline(always)]
    unsafe fn load(p: *const f32) -> __m512 {
        // SAFETY: caller guarantees 16 readable f32 at `p`.
        unsafe { _mm512_loadu_ps(p) }
    }
    #[inline(always)]
    unsafe fn load_f16(p: *const f16) -> __m512 {
        // SAFETY: caller guarantees 16 readable f16 (32 bytes) at `p`.
        unsafe { _mm512_cvtph_ps(_mm256_loadu_si256(p.cast())) }
    }
    #[inline(always)]
    unsafe fn load_bf16(p: *const bf16) -> __m512 {
        // SAFETY: caller guarantees 16 readable bf16 at `p`.
        unsafe {
            _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(
                _mm256_loadu_si256(p.cast()),
            )))
        }
    }
    #[inline(always)]
    unsafe fn store(p: *mut f32, v: __m512) {
        // SAFETY: caller guarantees 16 writable f32 at `p`.
        unsafe { _mm512_storeu_ps(p, v) }
    }
    #[inline(always)]
    unsafe fn fma(a: __m512, b: __m512, c: __m512) -> __m512 {
        // SAFETY: avx512f detected.
        unsafe { _mm512_fmadd_ps(a, b, c) }
    }
    #[inline(always)]
    unsafe fn add(a: __m512, b: __m512) -> __m512 {
        // SAFETY: avx512f detected.
        unsafe { _mm512_add_ps(a, b) }
    }
    #[inline(always)]
    unsafe fn hsum(v: __m512) -> f32 {
        // SAFETY: avx512f detected.
        unsafe { _mm512_reduce_add_ps(v) }
    }
}
