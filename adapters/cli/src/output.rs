//! What `bench` and `eval` print on stdout (`--output`, llama-bench's `-o` convention): the
//! table for people (`table`, the default), or only JSON for programs: one object per result
//! line (`jsonl`) or one array of them at the end (`json`). JSON never mixes with the table;
//! with `json` and `jsonl` the table's lines go to stderr, beside the progress messages.
//!
//! The format is chosen once per process, by the command, before it prints anything: every
//! function that writes a result line calls [`say!`] or [`record`] without passing a writer
//! around.

use std::sync::Mutex;

use clap::ValueEnum;

/// `--output`: how `bench` and `eval` print their results.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, ValueEnum)]
pub enum OutputFormat {
    /// Human-readable tables on stdout.
    #[default]
    Table,
    /// One JSON array of every result on stdout, at the end; the tables on stderr.
    Json,
    /// One JSON object per result, a line each, on stdout; the tables on stderr.
    Jsonl,
}

struct State {
    format: OutputFormat,
    records: Vec<serde_json::Value>,
}

static STATE: Mutex<State> = Mutex::new(State {
    format: OutputFormat::Table,
    records: Vec::new(),
});

fn state() -> std::sync::MutexGuard<'static, State> {
    STATE.lock().unwrap_or_else(|e| e.into_inner())
}

/// Sets the format for the rest of the process (and drops any record not yet printed).
pub(crate) fn set(format: OutputFormat) {
    let mut s = state();
    s.format = format;
    s.records.clear();
}

/// One line of the human-readable report: stdout with `table`, stderr otherwise.
pub(crate) fn line(text: std::fmt::Arguments<'_>) {
    match state().format {
        OutputFormat::Table => println!("{text}"),
        OutputFormat::Json | OutputFormat::Jsonl => eprintln!("{text}"),
    }
}

/// One result: a line of its own with `jsonl`, an element of the array [`finish`] prints with
/// `json`, nothing with `table` (the table says it).
pub(crate) fn record(value: serde_json::Value) {
    let mut s = state();
    match s.format {
        OutputFormat::Table => {}
        OutputFormat::Jsonl => println!("{value}"),
        OutputFormat::Json => s.records.push(value),
    }
}

/// Prints what `json` collected (an array, possibly empty); nothing for the other formats.
pub(crate) fn finish() {
    let mut s = state();
    if s.format == OutputFormat::Json {
        let all = serde_json::Value::Array(std::mem::take(&mut s.records));
        println!("{all:#}");
    }
}

/// `println!` for a report line: see [`line`].
macro_rules! say {
    ($($t:tt)*) => {
        $crate::output::line(format_args!($($t)*))
    };
}
pub(crate) use say;
