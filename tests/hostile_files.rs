//! Hostile GGUF-layout files, written byte by byte: lengths and counts far beyond the file
//! (allocation bombs), nesting without end, absurd dimensions, tensors misaligned, out of order,
//! overlapping or past the end, bad magic, version, types and values. Each must be a typed error
//! naming what is wrong, and reading it must never allocate more than a small, fixed amount
//! (measured with a counting allocator: the peak of live bytes during the read).
//!
//! One test in this binary on purpose: the counting allocator is process-wide.

use std::alloc::{GlobalAlloc, Layout, System};
use std::io::Cursor;
use std::sync::atomic::{AtomicUsize, Ordering};

use powerinfer::format::{parse_gpuidx, read_gguf};
use powerinfer::ErrorKind;

struct Peak;
static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

impl Peak {
    fn grow(n: usize) {
        let live = LIVE.fetch_add(n, Ordering::Relaxed) + n;
        PEAK.fetch_max(live, Ordering::Relaxed);
    }
}

// SAFETY: forwards to the system allocator unchanged, only counting.
unsafe impl GlobalAlloc for Peak {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        Peak::grow(l.size());
        // SAFETY: same contract as the caller's.
        unsafe { System.alloc(l) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        LIVE.fetch_sub(l.size(), Ordering::Relaxed);
        // SAFETY: same contract as the caller's.
        unsafe { System.dealloc(p, l) }
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, new: usize) -> *mut u8 {
        if new > l.size() {
            Peak::grow(new - l.size());
        } else {
            LIVE.fetch_sub(l.size() - new, Ordering::Relaxed);
        }
        // SAFETY: same contract as the caller's.
        unsafe { System.realloc(p, l, new) }
    }
}

#[global_allocator]
static A: Peak = Peak;

/// A GGUF v3 file, field by field.
#[derive(Default, Clone)]
struct File {
    b: Vec<u8>,
}

impl File {
    fn header(version: u32, tensors: u64, kvs: u64) -> Self {
        let mut f = File::default();
        f.b.extend(b"GGUF");
        f.u32(version).u64(tensors).u64(kvs);
        f
    }
    fn u32(&mut self, v: u32) -> &mut Self {
        self.b.extend(v.to_le_bytes());
        self
    }
    fn u64(&mut self, v: u64) -> &mut Self {
        self.b.extend(v.to_le_bytes());
        self
    }
    fn str(&mut self, s: &str) -> &mut Self {
        self.u64(s.len() as u64);
        self.b.extend(s.as_bytes());
        self
    }
    /// A `u32` metadata pair.
    fn kv_u32(&mut self, k: &str, v: u32) -> &mut Self {
        self.str(k).u32(4).u32(v)
    }
    /// A tensor's index entry.
    fn tensor(&mut self, name: &str, dims: &[u64], ty: u32, offset: u64) -> &mut Self {
        self.str(name).u32(dims.len() as u32);
        for &d in dims {
            self.u64(d);
        }
        self.u32(ty).u64(offset)
    }
    /// Pads to 32 and appends `n` data bytes.
    fn data(&mut self, n: usize) -> &mut Self {
        while !self.b.len().is_multiple_of(32) {
            self.b.push(0);
        }
        self.b.extend(std::iter::repeat_n(0x3c, n));
        self
    }
    fn bytes(&self) -> Vec<u8> {
        self.b.clone()
    }
}

/// Reads `bytes`; returns the error and the peak of bytes allocated meanwhile.
fn read(bytes: &[u8]) -> (powerinfer::Error, usize) {
    let base = LIVE.load(Ordering::Relaxed);
    PEAK.store(base, Ordering::Relaxed);
    let r = read_gguf(&mut Cursor::new(bytes), "hostile.gguf");
    let peak = PEAK.load(Ordering::Relaxed) - base;
    match r {
        Ok(_) => panic!("a hostile file was accepted"),
        Err(e) => (e, peak),
    }
}

#[test]
fn hostile_files_are_typed_errors_before_any_large_allocation() {
    const HUGE: u64 = 1 << 60;
    // A valid file first: one F32 tensor of 8 values, so the cases below differ in one thing.
    let mut ok = File::header(3, 1, 1);
    ok.kv_u32("general.alignment", 32)
        .tensor("t", &[8], 0, 0)
        .data(32);
    let (_, content) = read_gguf(&mut Cursor::new(ok.bytes()), "valid.gguf").unwrap();
    assert_eq!(content.tensor_infos["t"].shape.elem_count(), 8);

    let mut cases: Vec<(&str, Vec<u8>, &str)> = Vec::new();
    let mut f = File::header(3, 0, 1);
    f.u64(HUGE).data(64);
    cases.push(("key length 2^60", f.bytes(), "metadata key 0"));
    let mut f = File::header(3, 0, 1);
    f.str("general.name").u32(8).u64(HUGE).data(64);
    cases.push(("string value 2^60", f.bytes(), "`general.name`"));
    let mut f = File::header(3, 0, 1);
    f.str("tokenizer.ggml.scores")
        .u32(9)
        .u32(6)
        .u64(HUGE)
        .data(64);
    cases.push((
        "array of 2^60 floats",
        f.bytes(),
        "1152921504606846976 elements",
    ));
    let mut f = File::header(3, 0, 1);
    f.str("tokens").u32(9).u32(8).u64(HUGE).data(64);
    cases.push(("array of 2^60 strings", f.bytes(), "elements"));
    let mut f = File::header(3, 0, 1);
    f.str("deep");
    f.u32(9);
    for _ in 0..10_000 {
        f.u32(9).u64(1);
    }
    f.u32(4).u64(1).u32(7);
    cases.push(("arrays nested 10000 deep", f.bytes(), "nests arrays deeper"));
    cases.push(("2^60 tensors", File::header(3, HUGE, 0).bytes(), "tensors"));
    cases.push((
        "2^60 metadata pairs",
        File::header(3, 0, HUGE).bytes(),
        "metadata pairs",
    ));
    let mut f = File::header(3, 1, 0);
    f.str("t").u32(1 << 31).data(64);
    cases.push(("2^31 dimensions", f.bytes(), "dimensions"));
    let mut f = File::header(3, 1, 0);
    f.tensor("t", &[1 << 40, 1 << 40], 0, 0).data(32);
    cases.push(("2^80 elements", f.bytes(), "too many"));
    let mut f = File::header(3, 1, 0);
    f.tensor("t", &[1 << 40], 0, 0).data(32);
    cases.push(("2^42 bytes of data in a small file", f.bytes(), "truncated"));
    let mut f = File::header(3, 1, 1);
    f.str("general.alignment").u32(0).b.push(0);
    f.tensor("t", &[8], 0, 0).data(32);
    cases.push(("alignment 0", f.bytes(), "alignment is 0"));
    let mut f = File::header(3, 1, 1);
    f.kv_u32("general.alignment", 24)
        .tensor("t", &[8], 0, 0)
        .data(32);
    cases.push(("alignment 24", f.bytes(), "power of two"));
    let mut f = File::header(3, 2, 0);
    f.tensor("a", &[16], 0, 0).tensor("b", &[8], 0, 32).data(96);
    cases.push(("overlapping tensors", f.bytes(), "inside or before"));
    let mut f = File::header(3, 2, 0);
    f.tensor("a", &[8], 0, 32).tensor("b", &[8], 0, 0).data(64);
    cases.push(("tensors out of order", f.bytes(), "inside or before"));
    let mut f = File::header(3, 1, 0);
    f.tensor("t", &[8], 0, 4).data(64);
    cases.push((
        "misaligned tensor",
        f.bytes(),
        "not a multiple of the alignment",
    ));
    let mut f = File::header(3, 1, 0);
    f.tensor("t", &[8], 99, 0).data(64);
    cases.push(("unknown tensor type", f.bytes(), "type 99"));
    let mut f = File::header(3, 1, 0);
    f.tensor("t", &[10, 2], 8, 0).data(64);
    cases.push(("Q8_0 rows of 10 values", f.bytes(), "whole"));
    let mut f = File::header(3, 0, 1);
    f.str("b").u32(7).b.push(7);
    f.data(64);
    cases.push(("bool 7", f.bytes(), "bool of value 7"));
    cases.push(("version 9", File::header(9, 0, 0).bytes(), "version 9"));
    let mut wrong = ok.bytes();
    wrong[..4].copy_from_slice(b"GGML");
    cases.push(("wrong magic", wrong, "magic"));
    let whole = ok.bytes();
    cases.push((
        "cut in the data",
        whole[..whole.len() - 1].to_vec(),
        "truncated",
    ));
    cases.push(("cut in the index", whole[..60].to_vec(), "truncated"));

    for (case, bytes, needle) in &cases {
        let (e, peak) = read(bytes);
        assert!(
            matches!(
                e.kind(),
                ErrorKind::Format { .. } | ErrorKind::Truncated { .. } | ErrorKind::BadMagic { .. }
            ),
            "{case}: {e:?}"
        );
        assert!(
            e.to_string()
                .to_lowercase()
                .contains(&needle.to_lowercase()),
            "{case}: `{e}` does not name `{needle}`"
        );
        // The walk buffers 8 KiB and keeps short keys; nothing near the declared sizes.
        assert!(peak < 64 << 10, "{case}: {peak} bytes allocated");
    }

    // The `.gpuidx` reader: the same bombs in its own bounds-checked reader.
    let mut f = File::header(3, 1, 0);
    f.tensor("blk.0.gpu_idx", &[1 << 50], 18, 0).data(32);
    let base = LIVE.load(Ordering::Relaxed);
    PEAK.store(base, Ordering::Relaxed);
    let e = parse_gpuidx(&f.bytes(), "hostile.gpuidx", 1, 8).unwrap_err();
    assert!(PEAK.load(Ordering::Relaxed) - base < 64 << 10, "{e}");
    let mut f = File::header(3, HUGE, 0);
    f.u64(0);
    assert!(parse_gpuidx(&f.bytes(), "hostile.gpuidx", 1, 8).is_err());
}
