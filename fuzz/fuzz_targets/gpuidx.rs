//! Fuzz target: `powerinfer_fuzz_props::gpuidx` (the property is documented there).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| powerinfer_fuzz_props::gpuidx(data));
