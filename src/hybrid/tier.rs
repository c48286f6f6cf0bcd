//! The tier seam: a fast tier (a GPU, or the reference tier that stands in for one in tests)
//! computes the active neurons it holds while the CPU pool computes the rest.
//!
//! Protocol per call, driven by [`crate::HybridFfn`]: the active set is split by what the tier
//! holds ([`FastTier::holds`]); [`FastTier::launch`] starts the tier on its share and returns at
//! once (for a GPU: the input is copied up and the kernels are queued); the CPU pool computes the
//! other share; [`FastTier::finish`] waits and adds the tier's partial output. The block merges in
//! a fixed order (bias, fast tier, CPU threads in order), so results are deterministic.

use crate::active::ActiveSet;
use crate::error::Result;
use crate::ffn::NeuronBundles;

/// One call's work for a fast tier. Everything is borrowed for the duration of
/// [`FastTier::launch`] only: a tier copies what it needs (as a GPU copies to device memory).
#[derive(Debug, Clone, Copy)]
pub struct TierCall<'a> {
    /// `rows * hidden` f32 inputs, row-major.
    pub x: &'a [f32],
    /// Rows in the batch.
    pub rows: usize,
    /// The tier's share: sorted neuron indices of the layer, every one [`FastTier::holds`].
    pub neurons: &'a [u32],
    /// Which neurons each row uses ([`ActiveSet::contains`]); a listed neuron contributes only
    /// to the rows whose set has it.
    pub set: &'a ActiveSet,
    /// A predictor's threshold applied while computing (see
    /// [`crate::Predictor::inline_threshold`]); `None` keeps every listed neuron.
    pub rule: Option<f32>,
}

/// What a tier has done since it was built (or since [`FastTier::take_counters`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TierCounters {
    /// Calls launched.
    pub calls: u64,
    /// Neurons computed, summed over calls.
    pub neurons: u64,
    /// Cached (not placed) neurons that contributed to a call: cache hits.
    pub hits: u64,
    /// Cold neurons that contributed to a call but were not held: cache misses, computed on
    /// the CPU.
    pub misses: u64,
    /// Neurons copied into the tier's cache.
    pub fills: u64,
    /// Cached neurons dropped to make room.
    pub evictions: u64,
    /// Bytes copied into the cache.
    pub bytes_copied: u64,
    /// Of `fills`, the neurons filled ahead of their call by [`FastTier::prefetch`] (the rest
    /// were filled after the call that missed them).
    pub prefetched: u64,
}

impl std::ops::AddAssign for TierCounters {
    fn add_assign(&mut self, o: TierCounters) {
        self.calls += o.calls;
        self.neurons += o.neurons;
        self.hits += o.hits;
        self.misses += o.misses;
        self.fills += o.fills;
        self.evictions += o.evictions;
        self.bytes_copied += o.bytes_copied;
        self.prefetched += o.prefetched;
    }
}

/// A place other than the CPU pool where a layer's neurons are computed: a GPU holding the hot
/// neurons' weights in its memory, or [`crate::tier::ReferenceTier`].
///
/// Implementations hold a fixed set of neurons (the placement's hot set) plus, optionally, a
/// cache of cold neurons that changes between calls through [`FastTier::observe`]. A
/// `HybridFfn` calls `launch` and `finish` in pairs, from one thread at a time.
pub trait FastTier: Send + Sync + std::fmt::Debug {
    /// A short name for messages and reports (`"reference"`, `"cuda:0"`).
    fn name(&self) -> &str;

    /// Whether neuron `neuron` of the layer can be computed here in the next call.
    fn holds(&self, neuron: usize) -> bool;

    /// Bytes of the tier's memory this layer takes (weights, cache slots and buffers).
    fn bytes(&self) -> u64;

    /// The largest batch it takes in one call; larger batches (long prompts) run on the CPU.
    fn max_rows(&self) -> usize {
        usize::MAX
    }

    /// Starts computing `call`'s partial output. Returns before the work is done where the tier
    /// can (a GPU queues it); every `launch` is followed by one [`FastTier::finish`].
    fn launch(&self, call: &TierCall<'_>) -> Result<()>;

    /// Waits for the launched work and adds its partial output (`rows * hidden`) into `out`,
    /// all of it or, on an error, none. Returns how many of its neurons contributed (nonzero
    /// in some row).
    fn finish(&self, out: &mut [f32]) -> Result<usize>;

    /// After a call: the neurons the CPU computed and used (nonzero in some row) for want of
    /// them here (`missed`), so a caching tier can fill them from `src` (the layer's weights in
    /// RAM) for the next calls. The tier knows which of its own neurons contributed. The
    /// default does nothing (no cache).
    fn observe(&self, src: &NeuronBundles, missed: &[u32]) -> Result<()> {
        let _ = (src, missed);
        Ok(())
    }

    /// Before a call: `neurons` (sorted, in range) are expected in a coming call, so a caching
    /// tier copies those it does not hold from `src` into its cache now (a GPU: on its copy
    /// stream, while other layers compute), where a slot is free or holds a neuron not used
    /// within the cache window. Returns how many it filled. The default does nothing (no
    /// cache).
    fn prefetch(&self, src: &NeuronBundles, neurons: &[u32]) -> Result<usize> {
        let _ = (src, neurons);
        Ok(0)
    }

    /// The counters, reset to zero.
    fn take_counters(&self) -> TierCounters;
}
