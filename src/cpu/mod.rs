//! CPU kernels: row kernels per SIMD tier, the persistent pool, and the sparse FFN tier.
//!
//! The only module (with its children) that contains `unsafe`: SIMD intrinsics behind run-time
//! detection, and the pool's hand-off of borrowed jobs to worker threads.

mod kernels;
#[cfg(target_arch = "aarch64")]
mod neon;
mod pool;
mod quant;
mod simd;
mod sparse;
#[cfg(target_arch = "x86_64")]
mod x86;

pub(crate) use kernels::RowElem;
pub use kernels::{CpuTier, Kernels, CPU_TIER_ENV};
pub use pool::{share, Pool};
pub use quant::{dequantize_row, quantize_row_q8_0, QuantKind, QuantizedRow, QK};
pub(crate) use sparse::{SparseJob, ThreadScratch};
