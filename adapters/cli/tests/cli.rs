//! The `powerinfer` binary: bad input exits non-zero with a clear message; a real run works.

use std::process::Command;

fn powerinfer(args: &[&str]) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_powerinfer"))
        .args(args)
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
    fails_with(
        &["generate", "--prompt", "hi", "--sparsity", "1.5"],
        "--sparsity",
    );
    fails_with(
        &["generate", "--prompt", "hi", "--storage", "q3"],
        "--storage",
    );
    let d = temp("files");
    let trunc = d.join("truncated.gguf");
    let src = powerinfer_candle::fetch::smollm2(&mut |_| ()).unwrap();
    let bytes = std::fs::read(&src).unwrap();
    std::fs::write(&trunc, &bytes[..bytes.len() / 3]).unwrap();
    fails_with(
        &[
            "generate",
            "--prompt",
            "hi",
            "--model",
            trunc.to_str().unwrap(),
        ],
        "truncated",
    );
    let notgguf = d.join("notes.gguf");
    std::fs::write(&notgguf, b"hello, not a model").unwrap();
    fails_with(
        &[
            "generate",
            "--prompt",
            "hi",
            "--model",
            notgguf.to_str().unwrap(),
        ],
        "not a valid model file",
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
