//! On a ReLU llama (synthetic, saved to safetensors), `GateFirst` at threshold 0 skips the
//! neurons whose gate is not positive and still generates exactly what the dense model does.

mod common;

use common::*;
use powerinfer::{HybridOptions, WeightDType};
use powerinfer_candle::{generate, load_safetensors, FfnMode, GenerateOptions, Neurons};

#[test]
fn gate_first_at_zero_equals_dense_on_relu_llama() {
    let dir = temp_dir("relu");
    write_model(&dir, &tensors(), &config_json("relu", 256));
    let mut dense = load_safetensors(&dir, &FfnMode::Dense).unwrap();
    let mode = FfnMode::Hybrid {
        storage: Some(WeightDType::F32),
        predictor: Neurons::GateFirst(0.0),
        options: HybridOptions {
            threads: 2,
            ..Default::default()
        },
        powerinfer_linears: false,
    };
    let mut sparse = load_safetensors(&dir, &mode).unwrap();
    let prompt = [3u32, 17, 42, 5, 9];
    let a: Vec<f32> = dense.forward(&prompt, 0).unwrap().to_vec1().unwrap();
    let b: Vec<f32> = sparse.forward(&prompt, 0).unwrap().to_vec1().unwrap();
    let scale = a.iter().fold(0f32, |m, v| m.max(v.abs()));
    let diff = a
        .iter()
        .zip(&b)
        .fold(0f32, |m, (x, y)| m.max((x - y).abs()));
    assert!(
        diff <= 1e-5 * scale.max(1.0),
        "logit diff {diff} (scale {scale})"
    );

    sparse.enable_ffn_stats();
    let opts = GenerateOptions {
        max_tokens: 24,
        ..Default::default()
    };
    let d = generate(&mut dense, &prompt, &opts, |_| Ok(())).unwrap();
    let s = generate(&mut sparse, &prompt, &opts, |_| Ok(())).unwrap();
    assert_eq!(d.tokens, s.tokens);
    // ReLU on random weights: about half the gates are not positive, so about half the neurons
    // were skipped, and the output is still exact.
    let realized: Vec<f64> = sparse.take_ffn_sparsity().into_iter().flatten().collect();
    assert!(realized.iter().all(|&r| r > 0.3 && r < 0.7), "{realized:?}");
    std::fs::remove_dir_all(&dir).unwrap();
}
