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
            // Empty slots count as used at time 0 and the clock starts at 1, so they come first
            // even before the first tick.
            last_used: vec![0; slots],
            order: (0..slots as u32).map(|s| (0, s)).collect(),
            clock: 1,
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
        self.admit_at(neuron, self.clock)
    }

    /// Brings in a neuron expected, not yet used (a prefetch): as [`NeuronCache::admit`], but
    /// the slot counts as used `window - 1` calls ago, so it is protected through the next call
    /// only and, unless that call uses it, is the first filled slot to go after it. A wrong
    /// guess then never holds a slot for the whole window.
    pub fn admit_expected(&mut self, neuron: usize) -> Result<Option<CacheFill>> {
        let used = (self.clock + 1).saturating_sub(self.window).max(1);
        self.admit_at(neuron, used)
    }

    fn admit_at(&mut self, neuron: usize, used_at: u64) -> Result<Option<CacheFill>> {
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
        self.set_used_at(slot, used_at);
        Ok(Some(CacheFill {
            slot,
            neuron: neuron as u32,
            evicted,
        }))
    }

    fn set_used(&mut self, slot: usize) {
        self.set_used_at(slot, self.clock);
    }

    fn set_used_at(&mut self, slot: usize, at: u64) {
        self.order.remove(&(self.last_used[slot], slot as u32));
        self.last_used[slot] = at;
        self.order.insert((at, slot as u32));
    }
}

/// Which neurons of a layer a tier holds and where: the placed hot neurons at storage indices
/// `0..hot`, then the cache slots, with the cache's bookkeeping. The membership bits are read
/// without a lock by the split ([`Residency::holds`]); the rest changes between calls only.
/// Shared by the tiers, which keep only their memory.
#[derive(Debug)]
pub(crate) struct Residency {
    intermediate: usize,
    held: Vec<std::sync::atomic::AtomicU64>,
    state: std::sync::Mutex<State>,
}

#[derive(Debug)]
struct State {
    /// Storage index of each neuron of the layer (`NONE`: not held).
    local: Vec<u32>,
    /// The layer's neuron at each storage index (`NONE`: an empty slot).
    ids: Vec<u32>,
    hot: usize,
    cache: NeuronCache,
}

impl Residency {
    /// `hot` (sorted, distinct, in range: a `LayerPlacement`'s) placed, `slots` empty slots.
    pub fn new(intermediate: usize, hot: &[u32], slots: usize) -> Result<Self> {
        use std::sync::atomic::AtomicU64;
        let mut local = vec![NONE; intermediate];
        let mut ids = hot.to_vec();
        ids.resize(hot.len() + slots, NONE);
        let held: Vec<AtomicU64> = (0..intermediate.div_ceil(64))
            .map(|_| AtomicU64::new(0))
            .collect();
        let r = Residency {
            intermediate,
            held,
            state: std::sync::Mutex::new(State {
                local: Vec::new(),
                ids,
                hot: hot.len(),
                cache: NeuronCache::new(intermediate, slots)?,
            }),
        };
        for (k, &i) in hot.iter().enumerate() {
            local[i as usize] = k as u32;
            r.set_held(i, true);
        }
        r.lock().local = local;
        Ok(r)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn set_held(&self, neuron: u32, on: bool) {
        use std::sync::atomic::Ordering;
        let bit = 1u64 << (neuron % 64);
        let w = &self.held[neuron as usize / 64];
        if on {
            w.fetch_or(bit, Ordering::Release);
        } else {
            w.fetch_and(!bit, Ordering::Release);
        }
    }

    /// Whether `neuron` is held (false out of range).
    #[inline]
    pub fn holds(&self, neuron: usize) -> bool {
        self.held
            .get(neuron / 64)
            .is_some_and(|w| w.load(std::sync::atomic::Ordering::Acquire) >> (neuron % 64) & 1 == 1)
    }

    /// Neurons held now, sorted.
    pub fn held(&self) -> Vec<u32> {
        let s = self.lock();
        (0..s.local.len() as u32)
            .filter(|&i| s.local[i as usize] != NONE)
            .collect()
    }

    /// Cache slots.
    pub fn slots(&self) -> usize {
        self.lock().cache.slots()
    }

    /// The layer's neuron count.
    pub fn intermediate(&self) -> usize {
        self.intermediate
    }

    /// See [`NeuronCache::set_window`].
    pub fn set_window(&self, window: u64) -> Result<()> {
        self.lock().cache.set_window(window)
    }

    /// Storage indices of `neurons` into `out`; a neuron not held is a `Tier` error of `tier`.
    pub fn map(&self, tier: &str, neurons: &[u32], out: &mut Vec<u32>) -> Result<()> {
        let s = self.lock();
        out.clear();
        for &i in neurons {
            match s.local.get(i as usize) {
                Some(&k) if k != NONE => out.push(k),
                _ => {
                    return Err(crate::error::Error::tier(
                        tier,
                        format!("asked for neuron {i}, which it does not hold"),
                    ))
                }
            }
        }
        Ok(())
    }

    /// After a call: the cached neurons among `used` (storage indices that contributed) are
    /// hits and become most recent; each of `missed` (neurons the CPU computed and used) is a
    /// miss and is admitted where a slot is free or evictable, `fill(storage index, neuron)`
    /// doing the copy before it counts as held. Counts into `c` (`neuron_bytes` per fill);
    /// returns whether anything was filled.
    pub fn observe(
        &self,
        used: &[u32],
        missed: &[u32],
        neuron_bytes: u64,
        c: &mut crate::hybrid::TierCounters,
        mut fill: impl FnMut(usize, u32) -> Result<()>,
    ) -> Result<bool> {
        let mut s = self.lock();
        if s.cache.slots() == 0 {
            return Ok(false);
        }
        s.cache.tick();
        let hot = s.hot;
        for &k in used.iter().filter(|&&k| k as usize >= hot) {
            let i = s.ids[k as usize];
            s.cache.touch(i as usize);
            c.hits += 1;
        }
        c.misses += missed.len() as u64;
        Ok(Self::admit(&mut s, self, missed, false, neuron_bytes, c, &mut fill)? > 0)
    }

    /// Before a call: each of `expected` not held is admitted where a slot is free or holds a
    /// neuron unused within the window (so the last call's neurons stay), as an expected neuron
    /// ([`NeuronCache::admit_expected`]), `fill` doing the copy as in [`Residency::observe`]. Counts fills into `c` (also as `prefetched`); returns how
    /// many it filled.
    pub fn prefetch(
        &self,
        expected: &[u32],
        neuron_bytes: u64,
        c: &mut crate::hybrid::TierCounters,
        mut fill: impl FnMut(usize, u32) -> Result<()>,
    ) -> Result<usize> {
        let mut s = self.lock();
        if s.cache.slots() == 0 {
            return Ok(0);
        }
        let n = Self::admit(&mut s, self, expected, true, neuron_bytes, c, &mut fill)?;
        c.prefetched += n as u64;
        Ok(n)
    }

    /// Admits `neurons` into the cache (as expected ones: [`NeuronCache::admit_expected`]),
    /// filling each admitted one; returns how many.
    fn admit(
        s: &mut State,
        r: &Residency,
        neurons: &[u32],
        expected: bool,
        neuron_bytes: u64,
        c: &mut crate::hybrid::TierCounters,
        fill: &mut impl FnMut(usize, u32) -> Result<()>,
    ) -> Result<usize> {
        let hot = s.hot;
        let mut filled = 0;
        for &i in neurons {
            // A placed hot neuron is held already (the cache knows only its own).
            if s.local.get(i as usize).is_some_and(|&k| k != NONE) {
                continue;
            }
            let f = if expected {
                s.cache.admit_expected(i as usize)?
            } else {
                s.cache.admit(i as usize)?
            };
            let Some(f) = f else {
                continue;
            };
            if let Some(e) = f.evicted {
                s.local[e as usize] = NONE;
                r.set_held(e, false);
                c.evictions += 1;
            }
            let k = hot + f.slot;
            fill(k, i)?;
            s.local[i as usize] = k as u32;
            s.ids[k] = i;
            r.set_held(i, true);
            c.fills += 1;
            c.bytes_copied += neuron_bytes;
            filled += 1;
        }
        Ok(filled)
    }
}
