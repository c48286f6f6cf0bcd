//! CPU kernels: row kernels per SIMD level, the persistent pool, and the sparse FFN tier.
//!
//! **Unstable.** These are the engine's building blocks, public so the adapters, benchmarks and
//! fuzzers can reach them; their types and signatures follow the engine's needs and may change in
//! any release. The FFN blocks at the crate root are the API to build on.
//!
//! The only module (with its children) that contains `unsafe`: SIMD intrinsics behind run-time
//! detection, and the pool's hand-off of borrowed jobs to worker threads.

mod attention;
mod bandwidth;
mod blocks;
mod bundles;
mod column_blocks;
mod column_matrix;
mod dense_pass;
mod float_rows;
mod heap;
mod kernels;
#[cfg(target_arch = "aarch64")]
mod neon;
mod packed;
mod pool;
mod quant;
mod simd;
mod sparse;
mod split;
#[cfg(target_arch = "x86_64")]
mod x86;

pub use attention::{attend, KvRows};
pub use bandwidth::{read_bandwidth, ReadBandwidth};
pub use blocks::{dequantize_blocks, dot_row, BlockKind};
pub(crate) use bundles::{BundleData, BundleLayout, BundleView};
pub use column_blocks::{ActiveChannels, ColumnBlocks, SLAB_ROWS, UNIT_ROWS};
pub use column_matrix::{ActiveColumns, ColumnMatrix, ColumnStorage, CHUNK};
pub(crate) use dense_pass::{DensePass, NeuronRow};
pub use float_rows::FloatRows;
pub(crate) use kernels::{column_product, gemm};
pub use kernels::{Kernels, SimdLevel, SIMD_LEVEL_ENV};

/// Asks the CPU to start loading `s` into cache (a hint: never faults, no effect elsewhere).
/// Small rows at a fixed stride (hidden 576: 360-byte Q4_1 rows 1332 bytes apart) are otherwise
/// latency-bound: the hardware prefetcher does not follow them in time.
#[inline(always)]
pub(crate) fn prefetch<T>(s: &[T]) {
    #[cfg(target_arch = "x86_64")]
    prefetch_with::<{ std::arch::x86_64::_MM_HINT_T0 }, T>(s);
    #[cfg(not(target_arch = "x86_64"))]
    let _ = s;
}

/// Asks the CPU to start loading `s` into the L2 cache (a hint, as [`prefetch`]): for data
/// needed a few hundred cycles from now, without holding L1 fill buffers for that long.
#[inline(always)]
pub(crate) fn prefetch_l2<T>(s: &[T]) {
    #[cfg(target_arch = "x86_64")]
    prefetch_with::<{ std::arch::x86_64::_MM_HINT_T1 }, T>(s);
    #[cfg(not(target_arch = "x86_64"))]
    let _ = s;
}

/// One prefetch with locality hint `HINT` per 64-byte line of `s`.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn prefetch_with<const HINT: i32, T>(s: &[T]) {
    let p = s.as_ptr().cast::<i8>();
    let bytes = std::mem::size_of_val(s);
    let mut off = 0;
    while off < bytes {
        // SAFETY: prefetch is a hint; it never faults, even on invalid addresses, and this
        // address lies inside `s` anyway. SSE is part of the x86-64 baseline.
        unsafe { std::arch::x86_64::_mm_prefetch::<HINT>(p.add(off)) };
        off += 64;
    }
}

/// Writes back and drops every cache line of `s` from every cache level (`clflush`), so the
/// next read of `s` comes from DRAM; `false` where the target has no such instruction (the
/// caller must then evict by other means). For timing a product as decoding meets it without
/// reading a buffer the size of the last-level cache.
pub(crate) fn evict<T>(s: &[T]) -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        let p = s.as_ptr().cast::<u8>();
        let bytes = std::mem::size_of_val(s);
        let mut off = 0;
        while off < bytes {
            // SAFETY: `p + off` lies inside `s`, which is live and readable for the call;
            // `clflush` only writes the line back and invalidates it, it changes no value.
            // SSE2 is part of the x86-64 baseline.
            unsafe { std::arch::x86_64::_mm_clflush(p.add(off)) };
            off += 64;
        }
        // SAFETY: a fence has no memory-safety preconditions (SSE2 baseline).
        unsafe { std::arch::x86_64::_mm_mfence() };
        true
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = s;
        false
    }
}

/// [`evict`] on share `t` of `n` of `s` ([`share`]), for `n` threads to flush `s` together.
pub(crate) fn evict_share<T>(s: &[T], t: usize, n: usize) -> bool {
    evict(&s[share(s.len(), t, n)])
}

/// How many neurons ahead the row loops prefetch.
pub(crate) const PREFETCH_AHEAD: usize = 4;
pub use heap::release_freed_memory;
pub use packed::{PackedRows, PACK};
pub(crate) use pool::spin;
pub use pool::{share, Pool, SPIN_ENV};
pub use quant::{dequantize_row, quantize_row_q8_0, Inputs, QuantKind, QuantizedRow, QK, QK_K};
pub(crate) use sparse::{SparseJob, ThreadScratch};
pub use split::{dequantize_split_row, split_row};
