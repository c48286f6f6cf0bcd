//! Fuzz target: `powerinfer_fuzz_props::forward` (the property is documented there).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| powerinfer_fuzz_props::forward(data));
