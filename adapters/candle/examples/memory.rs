//! What loading a real model costs in memory, against what it must hold: the resident and peak
//! memory the load and a few decode steps add (`/proc/self/status`: `VmRSS`, `VmHWM`), next to
//! the bytes of the file, of the weights as the model holds them and of its KV cache: with the
//! sparse FFN, candle's dense model, or the fused dense decoder. A second copy of any weight
//! would show as resident memory well above that sum.
//!
//!     cargo run --release -p powerinfer-candle --example memory [sparse|dense|fused] [POSITIONS] [MODEL]
//!
//! `MODEL` is one of `powerinfer_data::Model`'s names (default `smollm2`), fetched on first use.
//!
//! A counting allocator also reports the live heap bytes after the load and at its peak.
//!
//! One model per process (freed memory is not always given back to the system, so a second
//! load in the same process would be measured on top of the first's leftovers).

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

use powerinfer::{HybridOptions, Neurons};

/// Counts live heap bytes and their peak, to tell what the heap holds from what the system
/// keeps resident.
struct Counting;
static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

// SAFETY: forwards to the system allocator unchanged, only counting.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        let live = LIVE.fetch_add(l.size(), Ordering::Relaxed) + l.size();
        PEAK.fetch_max(live, Ordering::Relaxed);
        // SAFETY: same contract as the caller's.
        unsafe { System.alloc(l) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        LIVE.fetch_sub(l.size(), Ordering::Relaxed);
        // SAFETY: same contract as the caller's.
        unsafe { System.dealloc(p, l) }
    }
}

#[global_allocator]
static A: Counting = Counting;
use powerinfer_candle::{load_gguf, FfnMode, GgufFile};

/// `VmRSS` and `VmHWM` of this process, bytes (Linux).
fn memory() -> (u64, u64) {
    let s = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let field = |name: &str| -> u64 {
        s.lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse::<u64>().ok())
            .map_or(0, |kb| kb * 1024)
    };
    (field("VmRSS:"), field("VmHWM:"))
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let kind = args.next().unwrap_or_else(|| "sparse".into());
    let positions: usize = args.next().map_or(Ok(2048), |p| p.parse())?;
    let which: powerinfer_data::Model = args.next().as_deref().unwrap_or("smollm2").parse()?;
    let path = powerinfer_data::model(which, &mut |m| eprintln!("{m}"))?;
    let mode = match kind.as_str() {
        "dense" => FfnMode::Dense,
        "fused" => FfnMode::Fused { threads: 1 },
        _ => FfnMode::Hybrid {
            storage: None,
            predictor: Neurons::GateFirst(0.02),
            options: HybridOptions::default(),
            powerinfer_linears: true,
        },
    };
    let file = std::fs::metadata(&path)?.len();
    let (before, _) = memory();
    let heap_before = LIVE.load(Ordering::Relaxed);
    PEAK.store(heap_before, Ordering::Relaxed);
    let mut g = GgufFile::open(&path)?;
    let header = LIVE.load(Ordering::Relaxed) - heap_before;
    let mut model = load_gguf(&mut g, &mode)?;
    drop(g);
    model.reserve_kv_cache(positions);
    // A prompt and a few decode steps: what generating adds on top of the load.
    let mut logits = model.forward_logits(&[1, 504, 3458, 282], 0)?.len();
    for pos in 4..12 {
        logits = model.forward_logits(&[504], pos)?.len();
    }
    let (after, peak) = memory();
    let (heap, heap_peak) = (
        LIVE.load(Ordering::Relaxed) - heap_before,
        PEAK.load(Ordering::Relaxed) - heap_before,
    );
    let b = model.decode_bytes();
    let weights = (b.attention + b.ffn_gate_up + b.ffn_down + b.lm_head) as u64;
    let kv = (b.kv_per_position * positions) as u64;
    let mb = |v: u64| v as f64 / 1e6;
    println!(
        "{kind} model, {} (fused decoder: {}), {positions} positions, {logits} logits",
        path.display(),
        model.is_fused()
    );
    println!("file                     {:8.1} MB", mb(file));
    println!(
        "weights as held          {:8.1} MB (projections, FFN, LM head)",
        mb(weights)
    );
    println!("KV cache                 {:8.1} MB", mb(kv));
    println!("weights + KV cache       {:8.1} MB", mb(weights + kv));
    println!(
        "resident after the load  {:8.1} MB ({:.2}x weights + KV cache)",
        mb(after - before),
        (after - before) as f64 / (weights + kv) as f64
    );
    println!(
        "peak during the load     {:8.1} MB ({:.2}x)",
        mb(peak - before),
        (peak - before) as f64 / (weights + kv) as f64
    );
    println!(
        "peak against the file    {:.2}x (file + KV cache: {:.1} MB)",
        (peak - before) as f64 / (file + kv) as f64,
        mb(file + kv)
    );
    println!(
        "heap: {:.1} MB held after, {:.1} MB at the peak, {:.1} MB for the file's header",
        mb(heap as u64),
        mb(heap_peak as u64),
        mb(header as u64)
    );
    Ok(())
}
