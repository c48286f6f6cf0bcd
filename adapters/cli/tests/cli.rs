//! The `powerinfer` binary: bad input exits non-zero with a clear message; a real run works.

use std::process::Command;

fn powerinfer(args: &[&str]) -> (bool, String, String) {
    powerinfer_env(args, &[])
}

fn powerinfer_env(args: &[&str], env: &[(&str, &str)]) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_powerinfer"))
        .args(args)
        .envs(env.iter().copied())
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn temp(name: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("powerinfer-cli-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn fails_with(args: &[&str], needle: &str) {
    let (ok, _, err) = powerinfer(args);
    assert!(!ok, "{args:?} should fail");
    assert!(
        err.contains(needle),
        "{args:?}: stderr does not mention `{needle}`:\n{err}"
    );
}

/// `generate` on `model` fails with the one message `error: MODEL: not a valid model file:
/// PROBLEM...`: the file named once, by one layer.
fn bad_file(model: &std::path::Path, problem: &str) {
    let path = model.to_str().unwrap();
    let (ok, _, err) = powerinfer(&["generate", "--prompt", "hi", "--model", path]);
    assert!(!ok, "{path} should fail");
    let line = err.lines().find(|l| l.starts_with("error:")).unwrap_or("");
    let expected = format!("error: {path}: not a valid model file: {problem}");
    assert!(
        line.starts_with(&expected),
        "expected `{expected}...`:\n{err}"
    );
    assert_eq!(
        err.matches(path).count(),
        1,
        "{path} named more than once:\n{err}"
    );
}

#[test]
fn bad_flags_and_files() {
    fails_with(&["generate", "--prompt", ""], "--prompt is empty");
    fails_with(
        &[
            "generate",
            "--prompt",
            "hi",
            "--model",
            "/nonexistent/model.gguf",
        ],
        "no such file",
    );
    // One vocabulary: the mode is `--sparse=MODE`, its target `--target`; the old flags are gone,
    // a flag that sets another mode's value and a mode without what it needs are refused by name.
    fails_with(
        &["generate", "--prompt", "hi", "--sparsity", "0.5"],
        "unexpected argument '--sparsity'",
    );
    fails_with(
        &["generate", "--prompt", "hi", "--sparse=threshold"],
        "[possible values: auto, input, gate-first, predictors]",
    );
    fails_with(
        &[
            "generate",
            "--prompt",
            "hi",
            "--sparse=input",
            "--threshold",
            "0.1",
        ],
        "use --sparse=gate-first",
    );
    for (flag, value) in [("--threshold", "0.1"), ("--target", "0.2")] {
        fails_with(
            &["generate", "--prompt", "hi", flag, value],
            "add --sparse=MODE",
        );
    }
    fails_with(
        &["eval", "--sparse=predictors"],
        "--sparse=predictors needs --powerinfer",
    );
    fails_with(
        &["bench", "--modes", "predictors"],
        "the `predictors` row needs --powerinfer",
    );
    fails_with(
        &["eval", "--sweep", "0.3"],
        "--sweep needs --sparse=predictors",
    );
    fails_with(
        &["generate", "--prompt", "hi", "--storage", "q3"],
        "--storage",
    );
    // Modes, peers and rules are closed sets: clap refuses a stranger and lists them.
    fails_with(
        &["bench", "--modes", "dense,fast"],
        "invalid value 'fast' for '--modes <MODES>'",
    );
    fails_with(&["bench", "--peer", "vllm"], "[possible values: llama.cpp]");
    // Checked before anything is measured.
    fails_with(&["bench", "--plot", "speed.jpg"], "ending in .png");
    fails_with(&["generate", "--target", "0.99"], "'0.99' for '--target");
    fails_with(
        &["eval", "--input-rules", "teal,gatefirst"],
        "[possible values: teal, wina, h, chess]",
    );
    let d = temp("files");
    let trunc = d.join("truncated.gguf");
    let src = powerinfer_data::smollm2(&mut |_| ()).unwrap();
    let bytes = std::fs::read(&src).unwrap();
    std::fs::write(&trunc, &bytes[..bytes.len() / 3]).unwrap();
    bad_file(&trunc, "truncated: ");
    let notgguf = d.join("notes.gguf");
    std::fs::write(&notgguf, b"hello, not a model").unwrap();
    bad_file(
        &notgguf,
        "not a GGUF file: magic \"hell\" ([68, 65, 6c, 6c]), expected \"GGUF\" or \"PWRI\"",
    );
    let cfg = d.join("model");
    std::fs::create_dir_all(&cfg).unwrap();
    std::fs::write(
        cfg.join("config.json"),
        r#"{"architectures": ["LlamaForCausalLM"], "hidden_size": 8, "intermediate_size": 16,
            "num_hidden_layers": 1, "num_attention_heads": 2, "vocab_size": 10,
            "max_position_embeddings": 32, "hidden_act": "swishy"}"#,
    )
    .unwrap();
    fails_with(
        &[
            "generate",
            "--prompt",
            "hi",
            "--model",
            cfg.to_str().unwrap(),
        ],
        "unknown activation `swishy`",
    );
    std::fs::remove_dir_all(&d).unwrap();
}

/// `eval --input-rules` with a fixed split and input sparsity on the attention projections:
/// one JSON line per attention fraction, the bytes each part skipped. (The greedy split runs on
/// the real model in the candle adapter's tests; here it would only add minutes.)
#[test]
fn eval_input_rules_with_attention() {
    let (ok, out, err) = powerinfer(&[
        "eval",
        "--tokens",
        "128",
        "--ctx",
        "64",
        "--calibration-tokens",
        "512",
        "--input-rules",
        "teal",
        "--input-sweep",
        "0.2",
        "--input-split",
        "1.5",
        "--input-attention",
        "0.2",
        "--output",
        "jsonl",
    ]);
    assert!(ok, "{err}");
    // jsonl: stdout is JSON lines only, one per result; the table went to stderr.
    let lines: Vec<serde_json::Value> = out
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).expect(l))
        .collect();
    assert_eq!(lines.len(), 2, "{out}");
    assert!(err.contains("teal"), "the table on stderr: {err}");
    for (j, att) in lines.iter().zip([0.0, 0.2]) {
        assert_eq!(j["split"], "down1.5x");
        assert_eq!(j["attention"].as_f64(), Some(att));
        let ffn = j["ffn_bytes_skipped"].as_f64().unwrap();
        assert!(ffn > 0.1 && ffn < 0.2, "{out}");
        let a = j["attention_bytes_skipped"].as_f64().unwrap();
        assert!(if att == 0.0 { a < 0.05 } else { a > 0.1 }, "{out}");
        assert!(j["ppl_sparse"].as_f64().unwrap() > 1.0);
    }
    fails_with(
        &["eval", "--input-rules", "teal", "--input-split", "down"],
        "a split is",
    );
}

/// One default sparse mode: `eval` and `generate --sparse` run the input rule `demo` and
/// `bench`'s `input` row run, unless `--sparse=gate-first` asks for exact |h| thresholding.
#[test]
fn eval_and_generate_default_to_the_input_rule() {
    let small = [
        "--tokens",
        "128",
        "--ctx",
        "64",
        "--calibration-tokens",
        "512",
    ];
    // `--output json`: stdout is one JSON array, here of one result.
    let json = |out: &str| -> serde_json::Value {
        let all: serde_json::Value = serde_json::from_str(out).expect(out);
        assert_eq!(all.as_array().map(Vec::len), Some(1), "{out}");
        all[0].clone()
    };
    // Every matrix by column, so the rule's skipped bytes show whatever this machine measures.
    let columns = [("POWERINFER_LAYOUTS", "columns")];
    let (ok, out, err) = powerinfer_env(
        &[&["eval", "--output", "json"][..], &small].concat(),
        &columns,
    );
    assert!(ok, "{err}");
    let j = json(&out);
    assert_eq!(j["mode"], "input", "{out}");
    assert!(j["rule"].as_str().unwrap().contains("rule at"), "{out}");
    let skipped = j["skipped"].as_f64().unwrap();
    assert!(skipped > 0.05 && skipped < 0.6, "{out}");
    assert!(j["ppl_sparse"].as_f64().unwrap() >= j["ppl_dense"].as_f64().unwrap() * 0.9);

    let (ok, out, err) = powerinfer(
        &[
            &[
                "eval",
                "--sparse=gate-first",
                "--threshold",
                "0.05",
                "--output",
                "json",
            ][..],
            &small,
        ]
        .concat(),
    );
    assert!(ok, "{err}");
    assert_eq!(json(&out)["mode"], "gate-first", "{out}");

    let (ok, _, err) = powerinfer(&[
        "generate",
        "--prompt",
        "The capital of France is",
        "--max-tokens",
        "4",
        "--sparse",
        "--calibration-tokens",
        "512",
    ]);
    assert!(ok, "{err}");
    assert!(err.contains("sparse: ") && err.contains("rule at"), "{err}");
    // `eval` above searched the target for these settings (or a run before it did): cached.
    assert!(err.contains("(chosen earlier, "), "{err}");
    let (ok, _, err) = powerinfer(&[
        "generate",
        "--prompt",
        "The capital of France is",
        "--max-tokens",
        "4",
        "--calibration-tokens",
        "512",
        "--sparse=input",
        "--target",
        "0.1",
    ]);
    assert!(ok, "{err}");
    assert!(err.contains("teal rule at 10% target"), "{err}");
    assert!(!err.contains("input rule target"), "{err}");
}

/// `demo` runs our dense decoder, the default sparse mode and candle's dense model, and measures
/// the other two against our dense decoder.
#[test]
fn demo_compares_with_our_dense_decoder() {
    let (ok, out, err) = powerinfer(&["demo", "--max-tokens", "6", "--calibration-tokens", "512"]);
    assert!(ok, "{err}");
    for label in [
        "--- our dense decoder (powerinfer, fused) ---",
        "--- input-sparse FFN (powerinfer, teal rule at",
        "--- dense (candle's model) ---",
    ] {
        assert!(out.contains(label), "no `{label}`:\n{out}");
    }
    let row = |name: &str| {
        out.lines()
            .find(|l| l.starts_with(&format!("{name:<6}: ")))
            .unwrap_or_else(|| panic!("no `{name}` row:\n{out}"))
            .to_string()
    };
    assert!(row("dense").contains("decode"), "{out}");
    assert!(
        row("sparse").contains("of the FFN weight bytes skipped"),
        "{out}"
    );
    assert!(row("candle").contains("nothing skipped"), "{out}");
    for name in ["sparse", "candle"] {
        let line = format!("agreement with dense: {name} ");
        assert!(out.contains(&line), "no `{line}`:\n{out}");
    }
}

#[test]
fn prompt_longer_than_context() {
    let long = "word ".repeat(9000);
    fails_with(
        &["generate", "--prompt", &long, "--max-tokens", "1"],
        "context",
    );
}

#[test]
fn generate_streams_real_text() {
    let (ok, out, err) = powerinfer(&[
        "generate",
        "--prompt",
        "The capital of France is",
        "--max-tokens",
        "8",
    ]);
    assert!(ok, "{err}");
    assert!(out.starts_with("The capital of France is"), "{out}");
    assert!(
        out.trim().len() > "The capital of France is".len(),
        "no tokens generated: {out}"
    );
    assert!(err.contains("tok/s"), "{err}");
}

/// Plain `generate` runs the fused decoder, the only one Gemma 3 runs on.
#[test]
fn generate_runs_gemma3_on_the_fused_decoder() {
    let (ok, out, err) = powerinfer(&[
        "generate",
        "--model",
        "gemma3-270m",
        "--prompt",
        "The capital of France is",
        "--max-tokens",
        "4",
    ]);
    assert!(ok, "{err}");
    assert!(out.trim().len() > "The capital of France is".len(), "{out}");
    assert!(err.contains("dense, fused decoder"), "{err}");
}

#[test]
fn analyze_then_use_the_artifact() {
    let d = temp("analyze");
    let art = d.join("small.powerinfer");
    let a = art.to_str().unwrap();
    let (ok, out, err) = powerinfer(&[
        "analyze",
        "--tokens",
        "1536",
        "--threshold-tokens",
        "512",
        "--train-rows",
        "384",
        "--val-rows",
        "128",
        "--epochs",
        "1",
        "--rank",
        "8",
        "--ctx",
        "256",
        "--budget",
        "8M",
        "--attention-sparsity",
        "0.2",
        "--out",
        a,
    ]);
    assert!(ok, "{err}");
    assert!(out.contains("wrote") && out.contains("val recall"), "{out}");
    for pic in ["frequency", "heatmap", "placement"] {
        for ext in ["png", "svg"] {
            let p = d.join(format!("small.{pic}.{ext}"));
            assert!(
                std::fs::metadata(&p).is_ok_and(|m| m.len() > 100),
                "{p:?} missing"
            );
        }
    }
    let artifact = powerinfer::Artifact::load(&art).unwrap();
    assert_eq!(artifact.layers.len(), 30);
    assert!(artifact.meta.hot_bytes + artifact.meta.predictor_bytes <= 8 << 20);
    assert_eq!(artifact.meta.calibration.tokens, 1536);
    // Format 2: the input-sparse rule, calibrated on the threshold tokens, one entry per layer.
    let rule = artifact.meta.input_rule.as_ref().expect("an input rule");
    assert_eq!((rule.thresholds.len(), rule.tokens), (30, 512));
    assert!(rule.thresholds.iter().all(|t| t.gate > 0.0 && t.down > 0.0));
    // ... with the attention projections' thresholds (a GGUF model).
    let att = rule.attention.as_ref().expect("an attention rule");
    assert_eq!(att.thresholds.len(), 30);
    assert!(att.thresholds.iter().all(|t| t[0] > 0.0 && t[1] > 0.0));

    // The same artifact through the one vocabulary: `input:` installs its rule while loading,
    // `predictors:` its trained predictors; a bare path is neither.
    let model = powerinfer_data::smollm2(&mut |_| ()).unwrap();
    let mode = |s: String| powerinfer_candle::FfnMode::sparse(s.parse().unwrap(), 2);
    // Every matrix by column (not as measured on this machine), so the rule's skipped bytes show.
    let mut by_column = mode(format!("input:{a}"));
    if let powerinfer_candle::FfnMode::InputSparse { layouts, .. } = &mut by_column {
        *layouts = powerinfer_candle::Layouts::Columns;
    }
    let (mut m, tok) = powerinfer_candle::open(&model, &by_column).unwrap();
    let prompt = tok.encode("The capital of France is").unwrap();
    m.forward_logits(&prompt, 0).unwrap();
    let skipped = m.take_ffn_traffic().skipped();
    assert!(
        skipped > 0.05 && skipped < 0.6,
        "input rule skipped {skipped}"
    );
    let (mut m, _) = powerinfer_candle::open(&model, &mode(format!("predictors:{a}"))).unwrap();
    m.enable_ffn_stats();
    m.forward_logits(&prompt, 0).unwrap();
    let sparsity: Vec<f64> = m.take_ffn_sparsity().into_iter().flatten().collect();
    assert_eq!(sparsity.len(), 30);
    assert!(sparsity.iter().sum::<f64>() / 30.0 > 0.05, "{sparsity:?}");
    assert!(a.parse::<powerinfer::Sparsity>().is_err());

    // eval: dense, exact, trained (audited) and a one-point sweep with its picture.
    let (ok, out, err) = powerinfer(&[
        "eval",
        "--tokens",
        "200",
        "--ctx",
        "100",
        "--sparse=predictors",
        "--powerinfer",
        a,
        "--sweep",
        "0.3",
        "--output",
        "jsonl",
    ]);
    assert!(ok, "{err}");
    assert!(
        err.contains("trained predictors") && err.contains("recall") && err.contains("sweep  30%"),
        "{err}"
    );
    assert_eq!(out.lines().count(), 1, "one result, one JSON line: {out}");
    assert!(d.join("small.sweep.png").exists() && d.join("small.sweep.svg").exists());
    let json: serde_json::Value = serde_json::from_str(out.lines().last().unwrap()).unwrap();
    let recall = json["trained"]["recall"].as_array().unwrap();
    assert_eq!(recall.len(), 30);
    assert!(recall
        .iter()
        .all(|r| (0.0..=1.0).contains(&r.as_f64().unwrap())));

    // bench has a row for the trained predictors next to exact thresholding.
    // Every FFN matrix by column (not as measured), so the rule's skipped bytes show.
    let (ok, out, err) = powerinfer_env(
        &[
            "bench",
            "--prompt-tokens",
            "8",
            "--decode-tokens",
            "2",
            "--runs",
            "1",
            "--powerinfer",
            a,
            "--attention-sparsity",
            "0.2",
            "--output",
            "jsonl",
        ],
        &[("POWERINFER_LAYOUTS", "columns")],
    );
    assert!(ok, "{err}");
    assert!(out.contains("\"mode\":\"predictors\""), "{out}");
    assert!(
        out.lines().all(|l| l.starts_with('{')),
        "JSON lines only: {out}"
    );
    // ... and one for the artifact's input-sparse rule, with the FFN bytes it skipped.
    let input: serde_json::Value = out
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .find(|j| j["mode"] == "input")
        .expect("an input row");
    let skipped = input["ffn_bytes_skipped"].as_f64().unwrap();
    assert!(skipped > 0.05 && skipped < 0.6, "{out}");
    let attention = input["attention_bytes_skipped"].as_f64().unwrap();
    assert!(attention > 0.05 && attention < 0.4, "{out}");
    assert!(input["bytes_per_token"].as_f64().unwrap() > 0.0);

    // Tier rows: the artifact's counts place the hottest neurons, the rest of the budget caches.
    let (ok, out, err) = powerinfer(&[
        "bench",
        "--modes",
        "predictors",
        "--prompt-tokens",
        "8",
        "--decode-tokens",
        "4",
        "--runs",
        "1",
        "--powerinfer",
        a,
        "--vram-budget",
        "0%,50%",
        "--cache",
        "0.5",
        "--prefetch-depth",
        "1",
        "--target",
        "0.7",
        "--force-dense-layers",
        "0",
        "--output",
        "jsonl",
    ]);
    assert!(ok, "{err}");
    for mode in ["tier 0%", "tier 50%"] {
        assert!(out.contains(&format!("\"mode\":\"{mode}\"")), "{out}");
    }
    // The trained predictors guess the next layer's neurons, and some are copied in ahead
    // (into slots the last token left unused: at 70% sparsity there are some). The notes are
    // the table's, on stderr with `jsonl`.
    assert!(
        err.contains("tier 50% (reference:1): budget")
            && err.contains("cache slots")
            && err.contains("hit rate")
            && err.contains("neurons prefetched)")
            && !err.contains("(0 neurons prefetched)"),
        "{err}"
    );
    fails_with(&["bench", "--vram-budget", "150%"], "150");
    fails_with(
        &[
            "bench",
            "--modes",
            "sparse",
            "--prompt-tokens",
            "8",
            "--decode-tokens",
            "2",
            "--runs",
            "1",
            "--threshold",
            "0.02",
            "--vram-budget",
            "50%",
            "--force-dense-layers",
            "99",
        ],
        "layer 99 does not exist",
    );

    // A different model file (one byte changed) refuses the artifact.
    let src = powerinfer_data::smollm2(&mut |_| ()).unwrap();
    let mut bytes = std::fs::read(&src).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 1;
    let other = d.join("other.gguf");
    std::fs::write(&other, &bytes).unwrap();
    fails_with(
        &[
            "generate",
            "--prompt",
            "hi",
            "--sparse",
            "--model",
            other.to_str().unwrap(),
            "--powerinfer",
            a,
        ],
        "the artifact was made for",
    );
    fails_with(
        &[
            "bench",
            "--modes",
            "input",
            "--prompt-tokens",
            "8",
            "--decode-tokens",
            "2",
            "--runs",
            "1",
            "--model",
            other.to_str().unwrap(),
            "--powerinfer",
            a,
        ],
        "the artifact was made for",
    );
    // A truncated artifact is a clear error.
    let half = d.join("half.powerinfer");
    let full = std::fs::read(&art).unwrap();
    std::fs::write(&half, &full[..full.len() / 2]).unwrap();
    fails_with(
        &[
            "generate",
            "--prompt",
            "hi",
            "--sparse",
            "--powerinfer",
            half.to_str().unwrap(),
        ],
        "not a valid safetensors file",
    );
    fails_with(&["analyze", "--budget", "0"], "'0' for '--budget");
    fails_with(
        &["analyze", "--attention-sparsity", "1"],
        "--attention-sparsity",
    );
    fails_with(
        &["demo", "--attention-sparsity", "2"],
        "--attention-sparsity",
    );
    fails_with(&["analyze", "--recall", "1.5"], "target_recall");
    fails_with(
        &["eval", "--text", "/nonexistent/held-out.txt"],
        "reading /nonexistent/held-out.txt",
    );
    fails_with(&["analyze", "--budget", "12Q"], "'12Q' for '--budget");
    fails_with(&["eval", "--sweep", "0.2,0.99"], "for '--sweep");
    // A budget below the predictors' bytes is refused before any calibration pass.
    fails_with(
        &[
            "analyze",
            "--budget",
            "64K",
            "--tokens",
            "64",
            "--threshold-tokens",
            "32",
        ],
        "the predictors alone take",
    );
    fails_with(&["eval", "--input-sweep", "0.2,x"], "`x` is not a number");
    std::fs::remove_dir_all(&d).unwrap();
}

/// `synth` writes a llama file every command reads: `bench` decodes it with the dense decoder
/// and the default sparse mode, `generate` streams tokens from it; a bad shape or block type is
/// refused naming it.
#[test]
fn synth_writes_a_model_the_commands_run() {
    let d = temp("synth");
    let f = d.join("tiny.gguf");
    let path = f.to_str().unwrap();
    let tiny = [
        "--layers",
        "2",
        "--hidden",
        "256",
        "--intermediate",
        "512",
        "--heads",
        "4",
        "--kv-heads",
        "2",
        "--vocab",
        "400",
        "--seed",
        "3",
    ];
    let mut args = vec!["synth", "--out", path];
    args.extend(tiny);
    let (ok, out, err) = powerinfer(&args);
    assert!(ok, "{err}");
    assert!(out.contains("wrote") && out.contains("q4_k"), "{out}");
    let (ok, out, err) = powerinfer(&[
        "bench",
        "--model",
        path,
        "--modes",
        "dense,input",
        "--runs",
        "1",
        "--prompt-tokens",
        "8",
        "--decode-tokens",
        "4",
        "--threads",
        "1",
        "--output",
        "json",
    ]);
    assert!(ok, "{err}");
    let rows: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert!(rows.as_array().is_some_and(|r| r.len() >= 2), "{out}");
    let (ok, _, err) = powerinfer(&[
        "generate",
        "--model",
        path,
        "--prompt",
        "the fox",
        "--max-tokens",
        "4",
    ]);
    assert!(ok, "{err}");
    // A profile measured on it, then a model written with that profile.
    let prof = d.join("tiny.profile.json");
    let (ok, out, err) = powerinfer(&[
        "synth",
        "--measure",
        path,
        "--out",
        prof.to_str().unwrap(),
        "--tokens",
        "128",
    ]);
    assert!(ok && out.contains("2 layers over 128 tokens"), "{out}{err}");
    let skewed = d.join("skewed.gguf");
    let mut args = vec![
        "synth",
        "--out",
        skewed.to_str().unwrap(),
        "--profile",
        prof.to_str().unwrap(),
    ];
    args.extend(tiny);
    let (ok, _, err) = powerinfer(&args);
    assert!(ok, "{err}");
    let mut args = vec![
        "synth",
        "--out",
        skewed.to_str().unwrap(),
        "--profile",
        path,
    ];
    args.extend(tiny);
    fails_with(&args, "not a profile written by `synth --measure`");
    let mut bad = vec!["synth", "--out", path, "--hidden", "100"];
    bad.extend(&tiny[4..]);
    fails_with(&bad, "hidden 100");
    fails_with(
        &["synth", "--out", path, "--blocks", "q5_k"],
        "invalid value 'q5_k'",
    );
    std::fs::remove_dir_all(&d).unwrap();
}

#[test]
fn vram_budget_places_neurons_in_every_command() {
    let d = temp("hot");
    let f = d.join("tiny.gguf");
    let path = f.to_str().unwrap();
    let (ok, _, err) = powerinfer(&[
        "synth",
        "--out",
        path,
        "--layers",
        "2",
        "--hidden",
        "256",
        "--intermediate",
        "512",
        "--heads",
        "4",
        "--kv-heads",
        "2",
        "--vocab",
        "400",
        "--seed",
        "5",
    ]);
    assert!(ok, "{err}");
    let common = [
        "--model",
        path,
        "--threads",
        "1",
        "--runs",
        "1",
        "--prompt-tokens",
        "8",
        "--decode-tokens",
        "4",
    ];
    let mut args = vec!["bench", "--modes", "input", "--vram-budget", "50%,100%"];
    args.extend(common);
    args.extend(["--tier", "reference", "--output", "json"]);
    let (ok, out, err) = powerinfer(&args);
    assert!(ok, "{err}");
    let rows: serde_json::Value = serde_json::from_str(&out).unwrap();
    let modes: Vec<&str> = rows
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|r| r["mode"].as_str())
        .collect();
    for m in ["split 50%", "hybrid 50%", "split 100%", "hybrid 100%"] {
        assert!(modes.contains(&m), "{m} in {modes:?}");
    }
    // Half the bytes: one of the two layers whole, or part of every layer.
    assert!(
        err.contains("split 50% (layer split on reference:1)"),
        "{err}"
    );
    assert!(err.contains("1 of 2 layers with neurons there"), "{err}");
    assert!(err.contains("2 of 2 layers with neurons there"), "{err}");
    // No device: the rows are left out with the reason, the rest runs.
    if !cfg!(feature = "cuda") {
        let mut args = vec!["bench", "--modes", "input", "--vram-budget", "50%"];
        args.extend(common);
        args.extend(["--tier", "cuda"]);
        let (ok, out, err) = powerinfer(&args);
        assert!(
            ok && out.contains("no `split`/`hybrid` rows: device `cuda:0`"),
            "{out}{err}"
        );
    }
    let gen = |extra: &[&str]| {
        let mut args = vec![
            "generate",
            "--model",
            path,
            "--prompt",
            "the fox",
            "--max-tokens",
            "4",
        ];
        args.extend(extra);
        powerinfer(&args)
    };
    for placement in ["hybrid", "layer-split"] {
        let (ok, out, err) = gen(&[
            "--sparse",
            "--vram-budget",
            "50%",
            "--tier",
            "reference",
            "--placement",
            placement,
        ]);
        assert!(ok && out.starts_with("the fox"), "{out}{err}");
        assert!(
            err.contains(&format!("{placement} 50% on reference")),
            "{err}"
        );
    }
    let (ok, _, err) = gen(&["--vram-budget", "50%"]);
    assert!(!ok && err.contains("add --sparse"), "{err}");
    let (ok, _, err) = gen(&["--sparse", "--vram-budget", "half"]);
    assert!(!ok && err.contains("not `half`"), "{err}");
    let (ok, _, err) = gen(&[
        "--sparse=gate-first",
        "--target",
        "0.5",
        "--vram-budget",
        "50%",
        "--tier",
        "reference",
    ]);
    assert!(
        !ok && err.contains("has its own tier in `bench --modes gate-first"),
        "{err}"
    );
    std::fs::remove_dir_all(&d).unwrap();
}
