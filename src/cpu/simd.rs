//! The row kernels written once over a small vector trait, instantiated per SIMD tier.
//!
//! `dot(w, x)` and `axpy(y, a, w)` read one weight row (f32, f16 or bf16) and work in f32. Each tier
//! supplies a [`Simd`] implementation; the generic bodies are `#[inline(always)]` so they compile
//! inside each tier's `#[target_feature]` wrapper with that tier's instructions.

use half::{bf16, f16};

/// The vector operations a tier provides. All methods are `unsafe`: they may only run on a CPU
/// with the tier's features, and pointer arguments must be valid for `LANES` elements.
pub(crate) trait Simd: Copy {
    type V: Copy;
    const LANES: usize;
    unsafe fn zero() -> Self::V;
    unsafe fn splat(v: f32) -> Self::V;
    unsafe fn load(p: *const f32) -> Self::V;
    unsafe fn load_f16(p: *const f16) -> Self::V;
    unsafe fn load_bf16(p: *const bf16) -> Self::V;
    unsafe fn store(p: *mut f32, v: Self::V);
    /// `a * b + c`.
    unsafe fn fma(a: Self::V, b: Self::V, c: Self::V) -> Self::V;
    unsafe fn add(a: Self::V, b: Self::V) -> Self::V;
    unsafe fn hsum(v: Self::V) -> f32;
}

/// A storage element the kernels can widen to f32.
pub(crate) trait Elem: Copy {
    /// # Safety
    /// `p` valid for `S::LANES` reads; CPU has `S`'s features.
    unsafe fn load<S: Simd>(p: *const Self) -> S::V;
    fn to_f32(self) -> f32;
}

impl Elem for f32 {
    #[inline(always)]
    unsafe fn load<S: Simd>(p: *const Self) -> S::V {
        // SAFETY: forwarded caller contract.
        unsafe { S::load(p) }
    }
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }
}

impl Elem for f16 {
    #[inline(always)]
    unsafe fn load<S: Simd>(p: *const Self) -> S::V {
        // SAFETY: forwarded caller contract.
        unsafe { S::load_f16(p) }
    }
    #[inline(always)]
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
}

impl Elem for bf16 {
    #[inline(always)]
    unsafe fn load<S: Simd>(p: *const Self) -> S::V {
        // SAFETY: forwarded caller contract.
        unsafe { S::load_bf16(p) }
    }
    #[inline(always)]
    fn to_f32(self) -> f32 {
        bf16::to_f32(self)
    }
}

/// `sum_i w[i] * x[i]` over `min(w.len(), x.len())` elements, four accumulators wide.
///
/// # Safety
/// The CPU must have `S`'s features.
#[inline(always)]
pub(crate) unsafe fn dot<S: Simd, E: Elem>(w: &[E], x: &[f32]) -> f32 {
    let n = w.len().min(x.len());
    let (wp, xp) = (w.as_ptr(), x.as_ptr());
    let l = S::LANES;
    let mut i = 0;
    // SAFETY: every pointer offset below stays under `n`, the length of both slices' common prefix;
    // the CPU features are the caller's contract.
    unsafe {
        let (mut a0, mut a1, mut a2, mut a3) = (S::zero(), S::zero(), S::zero(), S::zero());
        while i + 4 * l <= n {
            a0 = S::fma(E::load::<S>(wp.add(i)), S::load(xp.add(i)), a0);
            a1 = S::fma(E::load::<S>(wp.add(i + l)), S::load(xp.add(i + l)), a1);
            a2 = S::fma(
                E::load::<S>(wp.add(i + 2 * l)),
                S::load(xp.add(i + 2 * l)),
                a2,
            );
            a3 = S::fma(
                E::load::<S>(wp.add(i + 3 * l)),
                S::load(xp.add(i + 3 * l)),
                a3,
            );
            i += 4 * l;
        }
        while i + l <= n {
            a0 = S::fma(E::load::<S>(wp.add(i)), S::load(xp.add(i)), a0);
            i += l;
        }
        let mut s = S::hsum(S::add(S::add(a0, a1), S::add(a2, a3)));
        while i < n {
            s += w[i].to_f32() * x[i];
            i += 1;
        }
        s
    }
}

/// `y[i] += a * w[i]` over `min(y.len(), w.len())` elements.
///
/// # Safety
/// The CPU must have `S`'s features.
#[inline(always)]
pub(crate) unsafe fn axpy<S: Simd, E: Elem>(y: &mut [f32], a: f32, w: &[E]) {
    let n = y.len().min(w.len());
    let (yp, wp) = (y.as_mut_ptr(), w.as_ptr());
    let l = S::LANES;
    let mut i = 0;
    // SAFETY: offsets stay under `n`, within both slices; CPU features are the caller's contract.
    unsafe {
        let va = S::splat(a);
        while i + 2 * l <= n {
            let y0 = S::fma(va, E::load::<S>(wp.add(i)), S::load(yp.add(i)));
            let y1 = S::fma(va, E::load::<S>(wp.add(i + l)), S::load(yp.add(i + l)));
            S::store(yp.add(i), y0);
            S::store(yp.add(i + l), y1);
            i += 2 * l;
        }
        while i + l <= n {
            S::store(
                yp.add(i),
                S::fma(va, E::load::<S>(wp.add(i)), S::load(yp.add(i))),
            );
            i += l;
        }
    }
    while i < n {
        y[i] += a * w[i].to_f32();
        i += 1;
    }
}

/// The portable tier: one lane, plain Rust. Runs everywhere.
#[derive(Clone, Copy)]
pub(crate) struct Scalar;

impl Simd for Scalar {
    type V = f32;
    const LANES: usize = 1;
    #[inline(always)]
    unsafe fn zero() -> f32 {
        0.0
    }
    #[inline(always)]
    unsafe fn splat(v: f32) -> f32 {
        v
    }
    #[inline(always)]
    unsafe fn load(p: *const f32) -> f32 {
        // SAFETY: caller guarantees `p` is valid for one read.
        unsafe { *p }
    }
    #[inline(always)]
    unsafe fn load_f16(p: *const f16) -> f32 {
        // SAFETY: caller guarantees `p` is valid for one read.
        unsafe { (*p).to_f32() }
    }
    #[inline(always)]
    unsafe fn load_bf16(p: *const bf16) -> f32 {
        // SAFETY: caller guarantees `p` is valid for one read.
        unsafe { (*p).to_f32() }
    }
    #[inline(always)]
    unsafe fn store(p: *mut f32, v: f32) {
        // SAFETY: caller guarantees `p` is valid for one write.
        unsafe { *p = v }
    }
    #[inline(always)]
    unsafe fn fma(a: f32, b: f32, c: f32) -> f32 {
        a * b + c
    }
    #[inline(always)]
    unsafe fn add(a: f32, b: f32) -> f32 {
        a + b
    }
    #[inline(always)]
    unsafe fn hsum(v: f32) -> f32 {
        v
    }
}
