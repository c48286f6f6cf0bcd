//! Placement: which neurons of each layer live in the fast tier (hot) and which on the CPU (cold),
//! and the planner that chooses them under a byte budget.
//!
//! Placement decides *where* a neuron is computed, never *whether*: cold neurons are still computed
//! (by the CPU tier) when the predictor selects them.

use crate::error::{Error, ErrorKind, Result};

/// The hot set of one layer, with an O(1) membership test.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LayerPlacement {
    intermediate: usize,
    hot: Vec<u32>,
    is_hot: Vec<u64>,
}

impl LayerPlacement {
    /// Hot neurons `hot` (any order) of a layer with `intermediate` neurons. Out-of-range or
    /// repeated indices are a typed error naming the index (and `layer`, when given).
    pub fn new(intermediate: usize, mut hot: Vec<u32>, layer: Option<usize>) -> Result<Self> {
        let mut is_hot = vec![0u64; intermediate.div_ceil(64)];
        for &i in &hot {
            let i = i as usize;
            if i >= intermediate {
                return Err(ErrorKind::NeuronOutOfRange {
                    layer,
                    neuron: i,
                    intermediate,
                }
                .into());
            }
            if is_hot[i / 64] >> (i % 64) & 1 == 1 {
                return Err(ErrorKind::DuplicateNeuron { layer, neuron: i }.into());
            }
            is_hot[i / 64] |= 1 << (i % 64);
        }
        hot.sort_unstable();
        Ok(LayerPlacement {
            intermediate,
            hot,
            is_hot,
        })
    }

    /// Every neuron on the CPU.
    pub fn all_cold(intermediate: usize) -> Self {
        LayerPlacement {
            intermediate,
            hot: Vec::new(),
            is_hot: vec![0; intermediate.div_ceil(64)],
        }
    }

    /// Every neuron in the fast tier.
    pub fn all_hot(intermediate: usize) -> Self {
        let hot: Vec<u32> = (0..intermediate as u32).collect();
        let mut is_hot = vec![u64::MAX; intermediate.div_ceil(64)];
        if !intermediate.is_multiple_of(64) {
            if let Some(last) = is_hot.last_mut() {
                *last = (1u64 << (intermediate % 64)) - 1;
            }
        }
        LayerPlacement {
            intermediate,
            hot,
            is_hot,
        }
    }

    /// Neurons in the layer.
    pub fn intermediate(&self) -> usize {
        self.intermediate
    }

    /// Sorted hot neuron indices.
    pub fn hot(&self) -> &[u32] {
        &self.hot
    }

    /// Whether neuron `i` is hot (false for out-of-range `i`).
    #[inline]
    pub fn is_hot(&self, i: usize) -> bool {
        self.is_hot
            .get(i / 64)
            .is_some_and(|w| (w >> (i % 64)) & 1 == 1)
    }

    /// Splits `active` (sorted or not) into `hot` and `cold`, keeping order. Reuses both buffers.
    pub fn split(&self, active: &[u32], hot: &mut Vec<u32>, cold: &mut Vec<u32>) {
        hot.clear();
        cold.clear();
        for &i in active {
            if self.is_hot(i as usize) {
                hot.push(i);
            } else {
                cold.push(i);
            }
        }
    }
}

/// Hot sets for every layer of a model, with the budget they were planned under.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Placement {
    /// One placement per layer.
    pub layers: Vec<LayerPlacement>,
    /// The byte budget of the fast tier.
    pub budget: u64,
    /// Bytes the hot neurons take (never above `budget`).
    pub used: u64,
}

/// Global greedy top-K on frequency: the hottest neurons of all layers go to the fast tier until
/// the byte budget is spent, each neuron costing its real size (`neuron_bytes[layer]`).
///
/// `frequencies[layer][neuron]` is how often the neuron was active (any non-negative scale).
/// Ties break by (layer, neuron) so the plan is deterministic. A neuron that does not fit is
/// skipped and smaller ones may still fill the rest. This is what PowerInfer's placement ILP
/// reduces to when every neuron of a layer has the same size and no per-layer constraint binds.
pub fn plan_placement(
    frequencies: &[Vec<f64>],
    neuron_bytes: &[u64],
    budget: u64,
) -> Result<Placement> {
    if frequencies.len() != neuron_bytes.len() {
        return Err(Error::count(
            "neuron_bytes entries (one per layer)",
            frequencies.len(),
            neuron_bytes.len(),
        ));
    }
    if budget == 0 {
        return Err(ErrorKind::Budget {
            budget,
            reason: "a zero budget places nothing; use LayerPlacement::all_cold".into(),
        }
        .into());
    }
    let mut all: Vec<(f64, u32, u32)> = Vec::new();
    for (l, f) in frequencies.iter().enumerate() {
        if neuron_bytes[l] == 0 {
            return Err(crate::error::Error::config(
                "neuron_bytes",
                format!("layer {l} has zero bytes per neuron"),
            ));
        }
        for (i, &v) in f.iter().enumerate() {
            if !v.is_finite() || v < 0.0 {
                return Err(crate::error::Error::non_finite(
                    &format!("frequencies[{l}] (must be finite and >= 0, got {v})"),
                    i,
                ));
            }
            all.push((v, l as u32, i as u32));
        }
    }
    let smallest = neuron_bytes.iter().copied().min().unwrap_or(0);
    if !frequencies.is_empty() && budget < smallest {
        return Err(ErrorKind::Budget {
            budget,
            reason: format!("smaller than one neuron ({smallest} bytes)"),
        }
        .into());
    }
    all.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)).then(a.2.cmp(&b.2)));
    let mut hot: Vec<Vec<u32>> = vec![Vec::new(); frequencies.len()];
    let mut used = 0u64;
    for (_, l, i) in all {
        let b = neuron_bytes[l as usize];
        if used + b <= budget {
            used += b;
            hot[l as usize].push(i);
        }
    }
    let layers = hot
        .into_iter()
        .enumerate()
        .map(|(l, h)| LayerPlacement::new(frequencies[l].len(), h, Some(l)))
        .collect::<Result<Vec<_>>>()?;
    Ok(Placement {
        layers,
        budget,
        used,
    })
}
