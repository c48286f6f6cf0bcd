//! Software prefetch of packed records into L2, shared by the x86-64 kernels of both files
//! (`x86.rs`: the 32-value blocks; `x86_more.rs`: the K-quants). A leaf: it uses nothing of
//! the kernels.

use std::arch::x86_64::*;

/// How far ahead of the record being read the kernels ask for the weights. Measured on one
/// thread (`powerinfer bench --modes dense`): against 2 KiB into L1, 16 KiB into L2 took
/// Qwen2.5-Coder-1.5B Q4_K_M (1 GB, from DRAM) from 8.9 to 13.2 tok/s, Qwen2.5-Coder-0.5B from
/// 26.2 to 30.7 and SmolLM2 (100 MB, from L3) from 103 to 128; 32 KiB was no better.
const PREFETCH_BYTES: usize = 16384;

/// Asks for the `rec` bytes `PREFETCH_BYTES` past `base` into L2, one hint per line (a hint
/// never faults, also past the end of the matrix). Records are read once, in address order.
#[inline(always)]
pub(super) unsafe fn prefetch_record(base: *const u8, rec: usize) {
    // SAFETY: the caller's contract, passed on.
    unsafe { prefetch_part(base, rec, 0, 1) }
}

/// Part `part` of `parts` of [`prefetch_record`]'s lines. The K-quant kernels spread a record's
/// hints (36-53 lines) over its sub-blocks: issued at once they fill the core's miss buffers
/// and stall the arithmetic behind them. Spread, Qwen2.5-Coder-1.5B's Q4_K products read
/// DRAM at 13 GB/s instead of 11.5 (1 thread, against 17.5 for a plain sum).
#[inline(always)]
pub(super) unsafe fn prefetch_part(base: *const u8, rec: usize, part: usize, parts: usize) {
    let ahead = base.wrapping_add(PREFETCH_BYTES);
    let lines = rec.div_ceil(64);
    for line in lines * part / parts..lines * (part + 1) / parts {
        // SAFETY: a prefetch is a hint and never faults, whatever the address; SSE is part of
        // the x86-64 baseline.
        unsafe { _mm_prefetch::<_MM_HINT_T1>(ahead.wrapping_add(64 * line).cast()) };
    }
}
