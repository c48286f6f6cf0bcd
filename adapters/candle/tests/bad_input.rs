//! Bad model files and prompts give typed errors naming what was wrong.

mod common;

use candle_core::quantized::{gguf_file, GgmlDType, QTensor};
use candle_core::{Device, Tensor};
use common::*;
use powerinfer_candle::{
    generate, load_safetensors, open, ErrorKind, FfnMode, GenerateOptions, GgufFile,
};
use powerinfer_data as fetch;

#[test]
fn truncated_gguf_names_the_cut() {
    let src = fetch::smollm2(&mut |_| ()).unwrap();
    let dir = temp_dir("truncated");
    let bytes = std::fs::read(&src).unwrap();
    for (name, len) in [
        ("half.gguf", bytes.len() / 2),
        ("header.gguf", 1000),
        ("empty.gguf", 0),
    ] {
        let p = dir.join(name);
        std::fs::write(&p, &bytes[..len]).unwrap();
        let e = GgufFile::open(&p).expect_err("must fail");
        assert!(matches!(e.kind(), ErrorKind::Format { .. }), "{name}: {e}");
        if name == "half.gguf" {
            assert!(e.to_string().contains("truncated"), "{e}");
        }
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn unsupported_gguf_architecture() {
    let dir = temp_dir("arch");
    let p = dir.join("gpt2.gguf");
    let mut f = std::fs::File::create(&p).unwrap();
    let t = QTensor::quantize(
        &Tensor::zeros((4, 32), candle_core::DType::F32, &Device::Cpu).unwrap(),
        GgmlDType::F32,
    )
    .unwrap();
    let arch = gguf_file::Value::String("gpt2".into());
    gguf_file::write(
        &mut f,
        &[("general.architecture", &arch)],
        &[("token_embd.weight", &t)],
    )
    .unwrap();
    drop(f);
    let e = open(&p, &FfnMode::Dense).expect_err("must fail");
    assert!(
        matches!(e.kind(), ErrorKind::UnsupportedArchitecture { arch } if arch == "gpt2"),
        "{e}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Metadata that would change the arithmetic in ways this crate does not implement is refused
/// by name, not run wrong.
#[test]
fn unsupported_gguf_keys_are_named() {
    let dir = temp_dir("keys");
    for (arch, key, value) in [
        (
            "llama",
            "llama.rope.scaling.type",
            gguf_file::Value::String("yarn".into()),
        ),
        (
            "gemma3",
            "gemma3.final_logit_softcapping",
            gguf_file::Value::F32(30.0),
        ),
        ("gemma2", "gemma2.block_count", gguf_file::Value::U32(2)),
    ] {
        let p = dir.join(format!("{arch}.gguf"));
        let mut f = std::fs::File::create(&p).unwrap();
        let t = QTensor::quantize(
            &Tensor::zeros((4, 32), candle_core::DType::F32, &Device::Cpu).unwrap(),
            GgmlDType::F32,
        )
        .unwrap();
        let a = gguf_file::Value::String(arch.into());
        gguf_file::write(
            &mut f,
            &[("general.architecture", &a), (key, &value)],
            &[("token_embd.weight", &t)],
        )
        .unwrap();
        drop(f);
        let e = open(&p, &FfnMode::Fused { threads: 1 }).expect_err("must fail");
        match e.kind() {
            ErrorKind::UnsupportedKey { key: k, .. } => assert_eq!(k, key),
            ErrorKind::UnsupportedArchitecture { arch: a } => assert_eq!(a, "gemma2"),
            _ => panic!("{arch}: {e}"),
        }
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn safetensors_missing_tensor_is_named() {
    let dir = temp_dir("missing");
    let mut t = tensors();
    t.remove("model.layers.1.mlp.up_proj.weight");
    write_model(&dir, &t, &config_json("silu", 256));
    for mode in [FfnMode::Dense, FfnMode::gate_first(0.0)] {
        let e = load_safetensors(&dir, &mode).expect_err("must fail");
        assert!(
            matches!(e.kind(), ErrorKind::MissingTensor { name } if name == "model.layers.1.mlp.up_proj.weight"),
            "{e}"
        );
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn unknown_activation_is_named() {
    let dir = temp_dir("act");
    write_model(&dir, &tensors(), &config_json("swishy", 256));
    let e = load_safetensors(&dir, &FfnMode::Dense).expect_err("must fail");
    assert!(
        matches!(e.kind(), ErrorKind::UnknownActivation { name } if name == "swishy"),
        "{e}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn empty_and_overlong_prompts() {
    let dir = temp_dir("prompt");
    write_model(&dir, &tensors(), &config_json("silu", 16));
    let mut m = load_safetensors(&dir, &FfnMode::Dense).unwrap();
    let opts = GenerateOptions::default();
    let e = generate(&mut m, &[], &opts, |_| Ok(())).expect_err("empty");
    assert!(
        matches!(e.kind(), ErrorKind::Prompt { .. }) && e.to_string().contains("empty"),
        "{e}"
    );
    let long: Vec<u32> = (0..20).collect();
    let e = generate(&mut m, &long, &opts, |_| Ok(())).expect_err("too long");
    assert!(
        matches!(e.kind(), ErrorKind::Prompt { .. }) && e.to_string().contains("context"),
        "{e}"
    );
    // Token ids outside the vocabulary.
    let e = m.forward(&[1, 999], 0).expect_err("bad id");
    assert!(e.to_string().contains("999"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Sizes beyond any model in `config.json` or GGUF metadata (what a hostile file declares to make
/// a loader allocate without bound) are typed errors naming the size, before anything of that
/// size is allocated; so are safetensors headers whose tensors overlap or lie past the file.
#[test]
fn absurd_sizes_and_overlapping_tensors_are_typed_errors() {
    let dir = temp_dir("absurd");
    for (key, value) in [
        ("num_hidden_layers", "1000000000"),
        ("hidden_size", "1099511627776"),
        ("intermediate_size", "1099511627776"),
        ("vocab_size", "1099511627776"),
        ("num_attention_heads", "1000000"),
    ] {
        let config = config_json("silu", 256);
        let start = config.find(&format!("\"{key}\"")).unwrap();
        let end = start + config[start..].find(',').unwrap();
        let config = format!("{}\"{key}\": {value}{}", &config[..start], &config[end..]);
        write_model(&dir, &tensors(), &config);
        let e = load_safetensors(&dir, &FfnMode::Dense).expect_err(key);
        assert!(
            e.to_string().contains("beyond any model") && e.to_string().contains(value),
            "{key}: {e}"
        );
    }
    // GGUF metadata: 2^25 layers in a one-layer file.
    let path = dir.join("layers.gguf");
    let spec = GgufSpec {
        hidden: 32,
        inter: 64,
        heads: 4,
        kv_heads: 2,
        layers: 1,
        vocab: 32,
        dtype: GgmlDType::Q8_0,
        tied: true,
        seed: 3,
    };
    write_gguf_llama(&path, &spec);
    let mut bytes = std::fs::read(&path).unwrap();
    let key = b"llama.block_count";
    let at = bytes.windows(key.len()).position(|w| w == key).unwrap() + key.len() + 4;
    bytes[at..at + 4].copy_from_slice(&(1u32 << 25).to_le_bytes());
    std::fs::write(&path, &bytes).unwrap();
    let e = open(&path, &FfnMode::Dense).expect_err("2^25 layers");
    assert!(
        e.to_string()
            .contains("33554432 layers is beyond any model"),
        "{e}"
    );

    // safetensors: two tensors over the same bytes, and one past the end of the file.
    for (name, offsets) in [
        ("overlap", [[0, 16], [8, 24]]),
        ("past", [[0, 16], [16, 4096]]),
    ] {
        let header = format!(
            r#"{{"a":{{"dtype":"F32","shape":[4],"data_offsets":[{},{}]}},"b":{{"dtype":"F32","shape":[4],"data_offsets":[{},{}]}}}}"#,
            offsets[0][0], offsets[0][1], offsets[1][0], offsets[1][1]
        );
        let mut b = (header.len() as u64).to_le_bytes().to_vec();
        b.extend(header.as_bytes());
        b.extend([0u8; 32]);
        write_model(&dir, &tensors(), &config_json("silu", 256));
        std::fs::write(dir.join("model.safetensors"), &b).unwrap();
        let e = load_safetensors(&dir, &FfnMode::Dense).expect_err(name);
        assert!(matches!(e.kind(), ErrorKind::Format { .. }), "{name}: {e}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// NaN and infinite weights: in a GGUF file's float tensors and in the scales of its Q8_0 and
/// Q4_1 blocks they are typed errors naming the tensor when it loads; where a loader cannot see
/// them (a safetensors checkpoint), the first forward returns a typed error instead of logits.
#[test]
fn nan_and_infinite_weights_are_typed_errors() {
    let dir = temp_dir("nan");
    for (dtype, tensor, at, bytes) in [
        (
            GgmlDType::Q8_0,
            "blk.0.attn_norm.weight",
            12usize,
            f32::NAN.to_le_bytes().to_vec(),
        ),
        (
            GgmlDType::Q8_0,
            "blk.0.attn_q.weight",
            34 * 5,
            vec![0x00, 0x7c],
        ), // f16 +inf scale
        (
            GgmlDType::Q4_1,
            "blk.1.ffn_up.weight",
            20 * 3 + 2,
            vec![0x00, 0x7e],
        ), // f16 NaN min
    ] {
        let path = dir.join("nan.gguf");
        let spec = GgufSpec {
            hidden: 32,
            inter: 64,
            heads: 4,
            kv_heads: 2,
            layers: 2,
            vocab: 32,
            dtype,
            tied: true,
            seed: 4,
        };
        write_gguf_llama(&path, &spec);
        let g = GgufFile::open(&path).unwrap();
        let start = g.content.tensor_data_offset + g.content.tensor_infos[tensor].offset;
        drop(g);
        let mut b = std::fs::read(&path).unwrap();
        let at = start as usize + at;
        b[at..at + bytes.len()].copy_from_slice(&bytes);
        std::fs::write(&path, &b).unwrap();
        for mode in [FfnMode::Dense, FfnMode::gate_first(0.0)] {
            let mut g = GgufFile::open(&path).unwrap();
            let e = powerinfer_candle::load_gguf(&mut g, &mode).expect_err(tensor);
            assert!(
                e.to_string()
                    .contains(&format!("tensor `{tensor}` has a NaN or infinity")),
                "{dtype:?} {tensor}: {e}"
            );
        }
    }
    let mut t = tensors();
    let norm = "model.layers.1.input_layernorm.weight";
    let mut v = t[norm].to_vec1::<f32>().unwrap();
    v[3] = f32::INFINITY;
    t.insert(norm.into(), Tensor::new(v, &Device::Cpu).unwrap());
    write_model(&dir, &t, &config_json("silu", 256));
    let mut m = load_safetensors(&dir, &FfnMode::Dense).unwrap();
    let e = m.forward(&[1, 2, 3], 0).expect_err("infinite norm weight");
    assert!(
        e.to_string()
            .contains("tensor `logits` has a NaN or infinity"),
        "{e}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}
