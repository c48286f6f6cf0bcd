//! File readers: GGUF (and PowerInfer's `PWRI` variant) with the model loader on top,
//! `.gpuidx`, the `.powerinfer` artifact, safetensors with `config.json`.

use std::io::Cursor;

use candle_core::Device;
use powerinfer::format::{parse_gpuidx, read_gguf};
use powerinfer::{Artifact, HybridOptions, Neurons};
use powerinfer_candle::{load_gguf, load_safetensors, FfnMode, GgufFile, Llama};

use crate::bytes::{scratch_path, Bytes};

/// The dense or the sparse model, by a bit of the input, on one thread (the fuzzer's
/// processes run side by side).
fn mode(bit: bool) -> FfnMode {
    if bit {
        FfnMode::Dense
    } else {
        FfnMode::Hybrid {
            storage: None,
            predictor: Neurons::GateFirst(0.02),
            options: HybridOptions {
                threads: 1,
                ..Default::default()
            },
            powerinfer_linears: true,
        }
    }
}

/// A model that loaded runs a token, or says why not.
fn run(mut m: Llama) {
    let _ = m.forward(&[0], 0);
    let _ = m.forward(&[1, 2], 1);
}

/// A GGUF-layout file: the engine's reader either refuses it with a typed error or every
/// tensor lies inside the bytes (aligned, in order) and candle reads it with the declared
/// number of elements (or a typed error); then the candle adapter's loader builds the model
/// from it, dense or sparse, or refuses, and a model that loads runs.
pub fn gguf(data: &[u8]) {
    let Ok((_, content)) = read_gguf(&mut Cursor::new(data), "fuzz.gguf") else {
        return;
    };
    let mut end = 0u64;
    let mut infos: Vec<_> = content.tensor_infos.iter().collect();
    infos.sort_by_key(|(_, i)| i.offset);
    for (name, info) in infos {
        let elems = info.shape.elem_count() as u64;
        let bytes =
            elems / info.ggml_dtype.block_size() as u64 * info.ggml_dtype.type_size() as u64;
        assert!(info.offset >= end, "`{name}` overlaps the tensor before it");
        end = info.offset + bytes;
        assert!(
            content.tensor_data_offset + end <= data.len() as u64,
            "`{name}` ends past the file and was accepted"
        );
        if let Ok(q) = content.tensor(&mut Cursor::new(data), name, &Device::Cpu) {
            assert_eq!(q.shape().elem_count(), info.shape.elem_count(), "`{name}`");
        }
    }
    let path = scratch_path("model.gguf");
    std::fs::write(&path, data).expect("write the scratch file");
    if let Ok(mut g) = GgufFile::open(&path) {
        if let Ok(m) = load_gguf(&mut g, &mode(data.len().is_multiple_of(2))) {
            run(m);
        }
    }
}

/// A `.gpuidx` file for a model of 1-4 layers of 1-96 neurons (the first four bytes): either
/// one placement per layer, each a sorted set of neurons in range, or a typed error.
pub fn gpuidx(data: &[u8]) {
    let mut b = Bytes::new(data);
    let layers = 1 + b.below(4);
    let n = 1 + b.below(96);
    if let Ok(p) = parse_gpuidx(b.rest(), "fuzz.gpuidx", layers, n) {
        assert_eq!(p.len(), layers);
        for l in &p {
            let hot = l.hot();
            assert!(hot.windows(2).all(|w| w[0] < w[1]), "{hot:?}");
            assert!(hot.iter().all(|&i| (i as usize) < n), "{hot:?}");
        }
    }
}

/// A `.powerinfer` artifact: a typed error, or one whose every layer gives its spec, predictor
/// and placement, and which saves and loads back equal.
pub fn artifact(data: &[u8]) {
    let path = scratch_path("a.powerinfer");
    std::fs::write(&path, data).expect("write the scratch file");
    let Ok(a) = Artifact::load(&path) else {
        return;
    };
    for l in 0..a.layers.len() {
        a.spec(l).expect("a loaded artifact's spec");
        a.predictor(l, None).expect("a loaded artifact's predictor");
        a.placement(l).expect("a loaded artifact's placement");
    }
    let again = scratch_path("b.powerinfer");
    a.save(&again).expect("a loaded artifact saves");
    assert_eq!(Artifact::load(&again).expect("and loads back"), a);
}

/// A safetensors checkpoint: the first two bytes give the length of `config.json`, which
/// follows; the rest is `model.safetensors`. The loader builds the model (dense or sparse) or
/// returns a typed error, and a model that loads runs.
pub fn safetensors(data: &[u8]) {
    let mut b = Bytes::new(data);
    let len = b.u16() as usize;
    let rest = b.rest();
    let (config, weights) = rest.split_at(len.min(rest.len()));
    let dir = scratch_path("checkpoint");
    std::fs::create_dir_all(&dir).expect("scratch dir");
    std::fs::write(dir.join("config.json"), config).expect("write config.json");
    std::fs::write(dir.join("model.safetensors"), weights).expect("write the weights");
    if let Ok(m) = load_safetensors(&dir, &mode(data.len().is_multiple_of(2))) {
        run(m);
    }
}
