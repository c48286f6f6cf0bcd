//! The fused decoder's decode step allocates nothing once warmed up (one test in this binary: the
//! counting allocator is process-wide).

mod common;

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

use candle_core::quantized::GgmlDType;
use common::{temp_dir, write_gguf_llama, GgufSpec};
use powerinfer::HybridOptions;
use powerinfer_candle::{load_gguf, FfnMode, GgufFile, Neurons};

struct Counting;
static ALLOCS: AtomicUsize = AtomicUsize::new(0);

// SAFETY: forwards to the system allocator unchanged, only counting.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        ALLOCS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: same contract as the caller's.
        unsafe { System.alloc(l) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        // SAFETY: same contract as the caller's.
        unsafe { System.dealloc(p, l) }
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, new: usize) -> *mut u8 {
        ALLOCS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: same contract as the caller's.
        unsafe { System.realloc(p, l, new) }
    }
}

#[global_allocator]
static A: Counting = Counting;

#[test]
fn fused_decode_allocates_nothing() {
    let dir = temp_dir("fused-alloc");
    let path = dir.join("m.gguf");
    let spec = GgufSpec {
        hidden: 64,
        inter: 96,
        heads: 4,
        kv_heads: 2,
        layers: 2,
        vocab: 80,
        dtype: GgmlDType::Q4_1,
        tied: true,
        seed: 3,
    };
    write_gguf_llama(&path, &spec);
    let hybrid = |p| FfnMode::Hybrid {
        storage: None,
        predictor: p,
        options: HybridOptions {
            threads: 2,
            ..Default::default()
        },
        powerinfer_linears: true,
    };
    let modes = [
        FfnMode::Fused { threads: 2 },
        hybrid(Neurons::All),
        hybrid(Neurons::GateFirst(0.01)),
    ];
    for mode in modes {
        let mut m = load_gguf(&mut GgufFile::open(&path).unwrap(), &mode).unwrap();
        assert!(m.is_fused());
        m.reserve_kv_cache(64);
        // Warm-up: the prompt (batch buffers) and a few tokens (single-row buffers).
        let mut next = 1u32;
        m.forward_logits(&[1, 2, 3, 4, 5], 0).unwrap();
        for i in 0..3 {
            let l = m.forward_logits(&[next], 5 + i).unwrap();
            next = (l
                .iter()
                .position(|&v| v == l.iter().fold(f32::MIN, |a, &b| a.max(b))))
            .unwrap_or(0) as u32;
        }
        let before = ALLOCS.load(Ordering::SeqCst);
        for i in 0..40 {
            let l = m.forward_logits(&[next], 8 + i).unwrap();
            next = (l[0].to_bits() % 80) as u32;
        }
        let n = ALLOCS.load(Ordering::SeqCst) - before;
        assert_eq!(n, 0, "{n} heap allocations in 40 decode steps ({mode:?})");
    }
}
