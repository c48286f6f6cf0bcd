//! The byte budget of a fast tier's memory, shared by every layer that puts weights there.
//!
//! Every allocation in the tier reserves its bytes here first; a reservation that would take the
//! total over the limit is refused with a typed error, so the tier never holds more than the
//! budget, whatever order layers are built or dropped in.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use crate::error::{ErrorKind, Result};

/// A fast tier's byte budget (`--vram-budget`): a limit and the bytes reserved under it.
#[derive(Debug)]
pub struct TierBudget {
    limit: u64,
    used: AtomicU64,
}

/// Bytes reserved under a [`TierBudget`]; dropping it gives them back.
#[derive(Debug)]
pub struct Reservation {
    budget: Arc<TierBudget>,
    bytes: u64,
}

impl TierBudget {
    /// A budget of `limit` bytes. Zero is a `Budget` error: a tier with no memory is no tier
    /// (run everything on the CPU instead).
    pub fn new(limit: u64) -> Result<Arc<TierBudget>> {
        if limit == 0 {
            return Err(ErrorKind::Budget {
                budget: 0,
                reason: "a fast tier with a zero budget holds nothing; attach no tier".into(),
            }
            .into());
        }
        Ok(Arc::new(TierBudget {
            limit,
            used: AtomicU64::new(0),
        }))
    }

    /// The limit in bytes.
    pub fn limit(&self) -> u64 {
        self.limit
    }

    /// Bytes reserved now.
    pub fn used(&self) -> u64 {
        self.used.load(Ordering::Acquire)
    }

    /// Bytes still free.
    pub fn available(&self) -> u64 {
        self.limit - self.used()
    }

    /// Reserves `bytes` for `what` (named in the error), or refuses if the total would pass the
    /// limit. Safe to call from several threads: the check and the update are one atomic step.
    pub fn reserve(self: &Arc<Self>, bytes: u64, what: &str) -> Result<Reservation> {
        let mut used = self.used.load(Ordering::Acquire);
        loop {
            let total = used.checked_add(bytes).filter(|&t| t <= self.limit);
            let Some(total) = total else {
                return Err(ErrorKind::Budget {
                    budget: self.limit,
                    reason: format!(
                        "{what} needs {bytes} bytes, {} of {} are free",
                        self.limit - used,
                        self.limit
                    ),
                }
                .into());
            };
            match self
                .used
                .compare_exchange_weak(used, total, Ordering::AcqRel, Ordering::Acquire)
            {
                Ok(_) => {
                    return Ok(Reservation {
                        budget: Arc::clone(self),
                        bytes,
                    })
                }
                Err(now) => used = now,
            }
        }
    }
}

impl Reservation {
    /// The bytes held.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        self.budget.used.fetch_sub(self.bytes, Ordering::AcqRel);
    }
}
