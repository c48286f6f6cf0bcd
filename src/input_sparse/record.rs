//! [`Recorder`]: calibration scores gathered while a layer runs, off until asked for.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

/// Scores of type `T` that a layer adds to on every forward call between [`Recorder::start`]
/// and [`Recorder::take`]; while off, a call pays one relaxed load.
#[derive(Debug, Default)]
pub(crate) struct Recorder<T> {
    on: AtomicBool,
    scores: Mutex<Option<T>>,
}

impl<T: Default> Recorder<T> {
    /// Starts recording into fresh scores (dropping any not taken).
    pub(crate) fn start(&self) {
        *self.scores.lock().unwrap_or_else(|e| e.into_inner()) = Some(T::default());
        self.on.store(true, Ordering::Relaxed);
    }

    /// Stops recording and returns the scores.
    pub(crate) fn take(&self) -> Option<T> {
        self.on.store(false, Ordering::Relaxed);
        self.scores.lock().unwrap_or_else(|e| e.into_inner()).take()
    }

    /// Whether the layer is recording.
    pub(crate) fn is_on(&self) -> bool {
        self.on.load(Ordering::Relaxed)
    }

    /// Runs `add` on the scores while recording.
    pub(crate) fn add(&self, add: impl FnOnce(&mut T)) {
        if !self.is_on() {
            return;
        }
        if let Some(s) = self
            .scores
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .as_mut()
        {
            add(s);
        }
    }
}
