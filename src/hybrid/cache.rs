//! The bookkeeping of a fast tier's neuron cache: which cold neurons its spare slots hold, and
//! which one to drop when a new one comes in (least recently used).
//!
//! A cache slot holds one neuron's bundle. After each call, the cold neurons the CPU had to
//! compute are admitted (copied into a slot) so that the next tokens, which use many of the same
//! neurons, find them in the fast tier: the sliding window of recently used neurons of "LLM in a
//! Flash", bounded by the slots the budget leaves after the placed hot neurons. This type only
//! decides; the tier does the copies it reports.

use std::collections::BTreeSet;

use crate::error::{ErrorKind, Result};

const NONE: u32 = u32::MAX;

/// A fill the tier must do: copy `neuron` into `slot`, which held `evicted` before.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CacheFill {
    /// The slot to write.
    pub slot: usize,
    /// The neuron to copy there.
    pub neuron: u32,
    /// The neuron the slot held before, now gone from the cache.
    pub evicted: Option<u32>,
}

/// LRU bookkeeping of `slots` cache slots over a layer of `intermediate` neurons.
#[derive(Debug, Clone)]
pub struct NeuronCache {
    /// Neuron held by each slot (`NONE` when empty).
    slot_neuron: Vec<u32>,
    /// Slot of each neuron (`NONE` when not cached).
    neuron_slot: Vec<u32>,
    /// Last use of each slot (the clock then).
    last_used: Vec<u64>,
    /// (last use, slot) of every slot: the first entry is the one to evict.
    order: BTreeSet<(u64, u32)>,
    clock: u64,
    window: u64,
}

impl NeuronCache {
    /// An empty cache of `slots` slots for a layer of `intermediate` neurons, with a window of
    /// one call (see [`NeuronCache::with_window`]).
    pub fn new(intermediate: usize, slots: usize) -> Result<Self> {
        if intermediate >= NONE as usize || slots >= NONE as usize {
            return Err(crate::error::Error::config(
                "cache",
                format!("{intermediate} neurons or {slots} slots do not fit 32-bit indices"),
            ));
        }
        Ok(NeuronCache {
            slot_neuron: vec![NONE; slots],
            neuron_slot: vec![NONE; intermediate],
            last_used: vec![0; slots],
            order: (0..slots as u32).map(|s| (0, s)).collect(),
            clock: 0,
            window: 1,
        })
    }

    /// Keeps every neuron used in the last `window` calls (this one included): a fill never
    /// evicts one of them, so the cache is LLM in a Flash's sliding window of recent neurons,
    /// bounded by the slots. Zero is a `Config` error.
    pub fn with_window(mut self, window: u64) -> Result<Self> {
        self.set_window(window)?;
        Ok(self)
    }

    /// [`NeuronCache::with_window`] in place.
    pub fn set_window(&mut self, window: u64) -> Result<()> {
        if window == 0 {
            return Err(crate::error::Error::config(
                "cache window",
                "must be at least 1 call",
            ));
        }
        self.window = window;
        Ok(())
    }

    /// Number of slots.
    pub fn slots(&self) -> usize {
        self.slot_neuron.len()
    }

    /// Neurons cached now.
    pub fn len(&self) -> usize {
        self.slot_neuron.iter().filter(|&&n| n != NONE).count()
    }

    /// True when no neuron is cached.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The slot holding `neuron`, if cached (`None` also for out-of-range indices).
    pub fn slot(&self, neuron: usize) -> Option<usize> {
        match self.neuron_slot.get(neuron) {
            Some(&s) if s != NONE => Some(s as usize),
            _ => None,
        }
    }

    /// The neuron in `slot`, if any.
    pub fn neuron(&self, slot: usize) -> Option<u32> {
        self.slot_neuron.get(slot).copied().filter(|&n| n != NONE)
    }

    /// Starts a new call: uses and fills after this count as more recent than all before.
    pub fn tick(&mut self) {
        self.clock += 1;
    }

    /// Records a use of `neuron`: true (a hit, now most recently used) if it is cached.
    pub fn touch(&mut self, neuron: usize) -> bool {
        match self.slot(neuron) {
            Some(s) => {
                self.set_used(s);
                true
            }
            None => false,
        }
    }

    /// Brings `neuron` in: the fill to do, into an empty slot or else the least recently used
    /// one (ties go to the lowest slot). `None` when it is already cached, or when every slot
    /// holds a neuron used or filled within the window (by default: since the last
    /// [`NeuronCache::tick`], so a call never evicts what it uses itself).
    pub fn admit(&mut self, neuron: usize) -> Result<Option<CacheFill>> {
        if neuron >= self.neuron_slot.len() {
            return Err(ErrorKind::NeuronOutOfRange {
                layer: None,
                neuron,
                intermediate: self.neuron_slot.len(),
            }
            .into());
        }
        if self.slot(neuron).is_some() {
            return Ok(None);
        }
        let Some(&(used, slot)) = self.order.first() else {
            return Ok(None);
        };
        let slot = slot as usize;
        if used + self.window > self.clock && self.slot_neuron[slot] != NONE {
            return Ok(None);
        }
        let evicted = self.neuron(slot);
        if let Some(e) = evicted {
            self.neuron_slot[e as usize] = NONE;
        }
        self.slot_neuron[slot] = neuron as u32;
        self.neuron_slot[neuron] = slot as u32;
        self.set_used(slot);
        Ok(Some(CacheFill {
            slot,
            neuron: neuron as u32,
            evicted,
        }))
    }

    fn set_used(&mut self, slot: usize) {
        self.order.remove(&(self.last_used[slot], slot as u32));
        self.last_used[slot] = self.clock;
        self.order.insert((self.clock, slot as u32));
    }
}
