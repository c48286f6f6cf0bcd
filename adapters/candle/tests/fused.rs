//! The fused decoder against the candle reference on random GGUF llamas of several shapes and
//! block types, and its own properties: prefill and decode give the same bits, the sequence can
//! be rewound, bad positions are typed errors.

mod common;

use candle_core::quantized::GgmlDType;
use common::{temp_dir, write_gguf_llama, write_gguf_llama_with_heads, GgufSpec};
use powerinfer::HybridOptions;
use powerinfer_candle::{
    load_gguf, read_config, ErrorKind, FfnMode, GgufFile, Llama, Neurons, Support,
};

fn load(path: &std::path::Path, mode: &FfnMode) -> Llama {
    load_gguf(&mut GgufFile::open(path).unwrap(), mode).unwrap()
}

fn spec(dtype: GgmlDType, heads: usize, kv_heads: usize, tied: bool, seed: u64) -> GgufSpec {
    GgufSpec {
        hidden: 64,
        inter: 96,
        heads,
        kv_heads,
        layers: 2,
        vocab: 80,
        dtype,
        tied,
        seed,
    }
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs()))
}

/// Prompt then greedy decode, logits of every step.
/// The bits of a tensor's values, flattened, for bit-for-bit comparisons.
fn bits(t: &candle_core::Tensor) -> Vec<u32> {
    let v = t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    v.iter().map(|v| v.to_bits()).collect()
}

fn run(m: &mut Llama, prompt: &[u32], steps: usize) -> Vec<Vec<f32>> {
    m.clear_kv_cache();
    let mut out = vec![m.forward_logits(prompt, 0).unwrap().to_vec()];
    for i in 0..steps {
        let last = out.last().unwrap();
        let next = last
            .iter()
            .enumerate()
            .fold(
                (0, f32::NEG_INFINITY),
                |b, (j, &v)| if v > b.1 { (j, v) } else { b },
            )
            .0 as u32;
        out.push(
            m.forward_logits(&[next], prompt.len() + i)
                .unwrap()
                .to_vec(),
        );
    }
    out
}

/// Every block type, GQA groups of 1, 2 and 4, tied and separate LM heads, 1 and 2 threads: the
/// fused decoder gives the reference's logits. Q4_1 products and attention are bit-identical to
/// candle's (the logits are equal); Q4_0 and Q8_0 blocks are summed in
/// another float order, which leaves the logits within 1e-6 of the reference's until a rounding
/// difference moves one 8-bit input quantization step: then a logit moves by up to about 1% of the
/// scale (measured: one of these 36 runs, 1.1e-2). So: Q4_1 within 1e-6, every run within 3e-2,
/// and at most one in eight runs above 1e-5.
#[test]
fn fused_matches_reference_on_random_models() {
    let dir = temp_dir("fused-ref");
    let (mut runs, mut moved, mut worst) = (0, 0, 0f32);
    for (k, dtype) in [GgmlDType::Q4_0, GgmlDType::Q4_1, GgmlDType::Q8_0]
        .into_iter()
        .enumerate()
    {
        for (heads, kv) in [(4, 4), (4, 2), (4, 1)] {
            for tied in [false, true] {
                let s = spec(dtype, heads, kv, tied, (k * 100 + heads * 10 + kv) as u64);
                let path = dir.join(format!("m-{k}-{kv}-{tied}.gguf"));
                write_gguf_llama(&path, &s);
                let mut reference = load(&path, &FfnMode::Dense);
                let want = run(&mut reference, &[1, 7, 3, 42, 9], 8);
                for threads in [1, 2] {
                    let mut fused = load(&path, &FfnMode::Fused { threads });
                    assert!(fused.is_fused());
                    let got = run(&mut fused, &[1, 7, 3, 42, 9], 8);
                    let d = got.iter().zip(&want).fold(0f32, |m, (g, w)| {
                        let scale = w.iter().fold(0f32, |m, v| m.max(v.abs()));
                        m.max(max_diff(g, w) / scale)
                    });
                    let case =
                        format!("{dtype:?} heads {heads}/{kv} tied {tied} threads {threads}");
                    if dtype == GgmlDType::Q4_1 {
                        assert!(d <= 1e-6, "{case}: {d}");
                    }
                    assert!(d <= 3e-2, "{case}: {d}");
                    runs += 1;
                    moved += usize::from(d > 1e-5);
                    worst = worst.max(d);
                }
            }
        }
    }
    eprintln!("{moved} of {runs} runs moved by a quantization step; worst {worst:e}");
    assert!(moved * 8 <= runs, "{moved} of {runs} runs above 1e-5");
}

/// The fused decoder is batch-invariant: a prompt run as one batch gives, at every position, the
/// bits that running it one token at a time gives (candle's reference is not: its matmuls sum in
/// another order per batch size).
#[test]
fn fused_prefill_equals_token_by_token() {
    let dir = temp_dir("fused-batch");
    let path = dir.join("m.gguf");
    write_gguf_llama(&path, &spec(GgmlDType::Q4_1, 4, 2, true, 5));
    for mode in [
        FfnMode::Fused { threads: 2 },
        FfnMode::Hybrid {
            storage: None,
            predictor: Neurons::All,
            options: HybridOptions {
                threads: 2,
                ..Default::default()
            },
            powerinfer_linears: true,
        },
    ] {
        let mut m = load(&path, &mode);
        assert!(m.is_fused());
        let tokens = [1u32, 5, 9, 11, 2, 70, 33];
        let all = m.forward_all(&tokens, 0).unwrap();
        m.clear_kv_cache();
        for (p, &t) in tokens.iter().enumerate() {
            let one: Vec<u32> = m
                .forward_logits(&[t], p)
                .unwrap()
                .iter()
                .map(|v| v.to_bits())
                .collect();
            assert_eq!(one, bits(&all.get(p).unwrap()), "position {p}");
        }
    }
}

/// `forward_all_each` hands out `forward_all`'s logits bit for bit, in blocks of 1, 2, 3 and 7
/// rows and one block larger than the window, on the fused decoder and on candle's path; every
/// row comes once, in order.
#[test]
fn logits_in_blocks_equal_the_whole_window() {
    let dir = temp_dir("fused-blocks");
    let path = dir.join("m.gguf");
    write_gguf_llama(&path, &spec(GgmlDType::Q4_1, 4, 2, true, 8));
    for mode in [FfnMode::Fused { threads: 2 }, FfnMode::Dense] {
        let mut m = load(&path, &mode);
        let tokens = [1u32, 5, 9, 11, 2, 70, 33];
        m.clear_kv_cache();
        let all = bits(&m.forward_all(&tokens, 0).unwrap());
        for block in [1, 2, 3, 7, 100] {
            m.clear_kv_cache();
            let (mut got, mut next) = (Vec::new(), 0);
            m.forward_all_each(&tokens, 0, block, |first, logits| {
                assert_eq!(first, next, "{mode:?}: blocks of {block} in order");
                assert!(
                    logits.len() <= block * 80,
                    "{mode:?}: a block of at most {block} rows"
                );
                next += logits.len() / 80;
                got.extend(logits.iter().map(|v| v.to_bits()));
                Ok(())
            })
            .unwrap();
            assert_eq!(got, all, "{mode:?}, blocks of {block}");
        }
    }
}

/// Perplexity on the fused decoder runs each window in steps of positions (a fraction of the
/// activation buffers): the same number, bit for bit, as scoring the window's logits whole,
/// for windows shorter than, equal to and longer than a step, and for llama.cpp's rule.
#[test]
fn perplexity_in_steps_equals_the_whole_window() {
    let dir = temp_dir("fused-ppl");
    let path = dir.join("m.gguf");
    write_gguf_llama(&path, &spec(GgmlDType::Q4_0, 4, 2, true, 9));
    let mut m = load(&path, &FfnMode::Fused { threads: 2 });
    let vocab = 80;
    let text: Vec<u32> = (0..400u32).map(|i| (i * 37 + i / 7) % 80).collect();
    // The reference: each window's logits whole, each row's log-softmax, the sum in f64.
    let whole = |m: &mut Llama, chunk: usize| -> f64 {
        let (mut nll, mut n) = (0f64, 0usize);
        for w in text.chunks(chunk).filter(|w| w.len() >= 2) {
            m.clear_kv_cache();
            let z = m.forward_all(w, 0).unwrap().flatten_all().unwrap();
            let z = z.to_vec1::<f32>().unwrap();
            for (i, row) in z.chunks_exact(vocab).enumerate().take(w.len() - 1) {
                let row = candle_core::Tensor::from_slice(row, vocab, &candle_core::Device::Cpu);
                let lp = candle_nn::ops::log_softmax(&row.unwrap(), candle_core::D::Minus1);
                let lp = lp.unwrap().get(w[i + 1] as usize).unwrap();
                nll -= lp.to_scalar::<f32>().unwrap() as f64;
                n += 1;
            }
        }
        (nll / n as f64).exp()
    };
    for chunk in [40, 64, 65, 200] {
        let got = m.perplexity(&text, chunk).unwrap();
        assert_eq!(
            got.to_bits(),
            whole(&mut m, chunk).to_bits(),
            "windows of {chunk}"
        );
    }
    // llama.cpp's rule scores the second half of each window: two windows of 150.
    let a = m.perplexity_llama_cpp(&text, 150, 2, Some(1)).unwrap();
    let mut refs = Vec::new();
    for c in 0..2 {
        let mut w = text[c * 150..(c + 1) * 150].to_vec();
        w[0] = 1;
        m.clear_kv_cache();
        let z = m.forward_all(&w, 0).unwrap().flatten_all().unwrap();
        refs.push((w, z.to_vec1::<f32>().unwrap()));
    }
    let mut sum = 0f64;
    for (w, z) in &refs {
        for (p, row) in z.chunks_exact(vocab).enumerate() {
            if p < 75 || p + 1 >= 150 {
                continue;
            }
            let mx = row.iter().fold(f32::NEG_INFINITY, |a, &v| a.max(v));
            let s: f64 = row.iter().map(|&v| (v - mx).exp() as f64).sum();
            sum += -((row[w[p + 1] as usize] - mx) as f64 - s.ln());
        }
    }
    assert_eq!(a.scored, 2 * 74);
    assert_eq!(a.ppl.to_bits(), (sum / a.scored as f64).exp().to_bits());
}

/// A position at or before the cached length rewinds; one past it is a typed error; tokens outside
/// the vocabulary or context are typed errors too.
#[test]
fn fused_positions_and_bad_tokens() {
    let dir = temp_dir("fused-pos");
    let path = dir.join("m.gguf");
    write_gguf_llama(&path, &spec(GgmlDType::Q8_0, 4, 2, false, 6));
    let mut m = load(&path, &FfnMode::Fused { threads: 1 });
    let a = m.forward_logits(&[1, 2, 3, 4], 0).unwrap().to_vec();
    m.forward_logits(&[5, 6], 4).unwrap();
    // Rewind to position 0 and replay: the same logits.
    let b = m.forward_logits(&[1, 2, 3, 4], 0).unwrap().to_vec();
    assert_eq!(a, b);
    // Rewind to 2: positions 2.. are recomputed from the cached 0..2.
    let c = m.forward_logits(&[3, 4], 2).unwrap().to_vec();
    assert_eq!(a, c);
    let gap = m.forward_logits(&[1], 9).unwrap_err();
    assert!(matches!(gap.kind(), ErrorKind::Prompt { .. }), "{gap}");
    assert!(matches!(
        m.forward_logits(&[80], 4).unwrap_err().kind(),
        ErrorKind::Prompt { .. }
    ));
    assert!(matches!(
        m.forward_logits(&[], 0).unwrap_err().kind(),
        ErrorKind::Prompt { .. }
    ));
    assert!(matches!(
        m.forward_logits(&[1], 512).unwrap_err().kind(),
        ErrorKind::Prompt { .. }
    ));
}

/// `Fused` needs Q4_0/Q4_1/Q8_0 projections: another block type is a typed error naming the
/// tensor; the hybrid mode falls back to candle's ops around its FFN instead.
#[test]
fn fused_needs_integer_blocks() {
    let dir = temp_dir("fused-f32");
    let path = dir.join("m.gguf");
    write_gguf_llama(&path, &spec(GgmlDType::F32, 4, 2, false, 7));
    let e = load_gguf(
        &mut GgufFile::open(&path).unwrap(),
        &FfnMode::Fused { threads: 1 },
    )
    .unwrap_err();
    assert!(e.to_string().contains("output.weight"), "{e}");
    // The header says so before any load, in the load's words.
    let s = Support::of(&path).unwrap();
    let why = s
        .fused
        .clone()
        .expect("an f32 file is not on the fused decoder");
    assert!(e.to_string().contains(&why), "{e} / {why}");
    assert_eq!(s.input_sparse, s.fused);
    assert_eq!(s.candle, None);
    let ok = dir.join("q.gguf");
    write_gguf_llama(&ok, &spec(GgmlDType::Q4_0, 4, 2, false, 7));
    let all = Support {
        fused: None,
        candle: None,
        input_sparse: None,
    };
    assert_eq!(Support::of(&ok).unwrap(), all);
    // The header's config, as the load reads it.
    let cfg = read_config(&ok).unwrap();
    assert_eq!((cfg.hidden, cfg.intermediate, cfg.layers), (64, 96, 2));
    // A safetensors checkpoint: candle's ops and the input-sparse FFN (f16 columns), not fused.
    let hf = dir.join("hf");
    std::fs::create_dir_all(&hf).unwrap();
    common::write_model(&hf, &common::tensors(), &common::config_json("silu", 64));
    let s = Support::of(&hf).unwrap();
    assert!(
        s.fused.is_some() && s.candle.is_none() && s.input_sparse.is_none(),
        "{s:?}"
    );
    assert!(Support::of(&dir.join("missing.gguf")).is_err());
    assert_eq!(read_config(&hf).unwrap().hidden, common::HIDDEN);
    let m = load(
        &path,
        &FfnMode::Hybrid {
            storage: None,
            predictor: Neurons::All,
            options: HybridOptions::default(),
            powerinfer_linears: true,
        },
    );
    assert!(!m.is_fused());
    let e = load_gguf(
        &mut GgufFile::open(&path).unwrap(),
        &FfnMode::Fused { threads: 0 },
    )
    .unwrap_err();
    assert!(e.to_string().contains("threads"), "{e}");
}

/// Head counts a model cannot run are a typed error when the file is opened, not a panic or a
/// silently wrong attention: query heads that do not share KV heads evenly, a hidden size the heads
/// do not divide, an odd head size (RoPE rotates pairs), no heads.
#[test]
fn uneven_heads_are_refused() {
    let dir = temp_dir("fused-heads");
    let s = spec(GgmlDType::Q8_0, 4, 2, true, 9);
    for (heads, kv) in [(4, 3), (5, 5), (64, 64), (0, 0)] {
        let path = dir.join(format!("m-{heads}-{kv}.gguf"));
        write_gguf_llama_with_heads(&path, &s, heads, kv);
        for mode in [FfnMode::Fused { threads: 1 }, FfnMode::Dense] {
            let e = load_gguf(&mut GgufFile::open(&path).unwrap(), &mode).unwrap_err();
            assert!(e.to_string().contains("heads"), "{heads}/{kv}: {e}");
        }
    }
}
