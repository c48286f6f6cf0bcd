//! Fuzz target: `powerinfer_fuzz_props::safetensors` (the property is documented there).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| powerinfer_fuzz_props::safetensors(data));
