//! The row kernels written once over a small vector trait, instantiated per SIMD level.
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

/// Four dot products of four rows against the same `x`: `x` is loaded once for all four.
///
/// # Safety
/// The CPU must have `S`'s features.
#[inline(always)]
pub(crate) unsafe fn dot4<S: Simd, E: Elem>(w: [&[E]; 4], x: &[f32]) -> [f32; 4] {
    let n = w.iter().fold(x.len(), |n, r| n.min(r.len()));
    let p = w.map(|r| r.as_ptr());
    let xp = x.as_ptr();
    let l = S::LANES;
    let mut i = 0;
    // SAFETY: offsets stay under `n`, within `x` and all four rows; CPU features are the caller's
    // contract.
    let mut out = unsafe {
        let mut a = [S::zero(), S::zero(), S::zero(), S::zero()];
        let mut b = [S::zero(), S::zero(), S::zero(), S::zero()];
        while i + 2 * l <= n {
            let x0 = S::load(xp.add(i));
            let x1 = S::load(xp.add(i + l));
            for k in 0..4 {
                a[k] = S::fma(E::load::<S>(p[k].add(i)), x0, a[k]);
                b[k] = S::fma(E::load::<S>(p[k].add(i + l)), x1, b[k]);
            }
            i += 2 * l;
        }
        while i + l <= n {
            let x0 = S::load(xp.add(i));
            for k in 0..4 {
                a[k] = S::fma(E::load::<S>(p[k].add(i)), x0, a[k]);
            }
            i += l;
        }
        [
            S::hsum(S::add(a[0], b[0])),
            S::hsum(S::add(a[1], b[1])),
            S::hsum(S::add(a[2], b[2])),
            S::hsum(S::add(a[3], b[3])),
        ]
    };
    while i < n {
        for k in 0..4 {
            out[k] += w[k][i].to_f32() * x[i];
        }
        i += 1;
    }
    out
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

/// `y[i] += a[0] * w0[i] + a[1] * w1[i] + a[2] * w2[i] + a[3] * w3[i]` over the common length:
/// four rows per pass, so the accumulator is loaded and stored once for four weight rows.
///
/// # Safety
/// The CPU must have `S`'s features.
#[inline(always)]
pub(crate) unsafe fn axpy4<S: Simd, E: Elem>(y: &mut [f32], a: [f32; 4], w: [&[E]; 4]) {
    let n = w.iter().fold(y.len(), |n, r| n.min(r.len()));
    let yp = y.as_mut_ptr();
    let p = w.map(|r| r.as_ptr());
    let l = S::LANES;
    let mut i = 0;
    // SAFETY: offsets stay under `n`, within `y` and all four rows; CPU features are the caller's
    // contract.
    unsafe {
        let va = a.map(|v| S::splat(v));
        while i + l <= n {
            let mut acc = S::load(yp.add(i));
            acc = S::fma(va[0], E::load::<S>(p[0].add(i)), acc);
            acc = S::fma(va[1], E::load::<S>(p[1].add(i)), acc);
            acc = S::fma(va[2], E::load::<S>(p[2].add(i)), acc);
            acc = S::fma(va[3], E::load::<S>(p[3].add(i)), acc);
            S::store(yp.add(i), acc);
            i += l;
        }
    }
    while i < n {
        y[i] += a[0] * w[0][i].to_f32()
            + a[1] * w[1][i].to_f32()
            + a[2] * w[2][i].to_f32()
            + a[3] * w[3][i].to_f32();
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
