#!/usr/bin/env bash
# The mistral.rs integration check (CI runs it after the workspace tests; see README.md):
#   1. the model (fetched if needed) and a small `powerinfer analyze` artifact, by the main CLI;
#   2. mistralrs-core 0.8.1 patched by patch/apply.sh (checksum-checked);
#   3. greedy output of unpatched mistral.rs (baseline/) = the patched build's dense MLP, on the
#      GGUF file and on its f32 HF conversion; on the f32 checkpoint the sparse FFN computing every
#      neuron and the input-sparse FFN keeping every input (row-major f32) give the same tokens
#      too (on the GGUF file every neuron's Q8_0 down rows drift after some tokens: at least 8
#      must match); on the GGUF file the input-sparse FFN keeping every input
#      gives the dense MLP's tokens exactly; the artifact's trained predictors generate text and
#      report their realized sparsity; the artifact's input rule runs through mistral.rs's bench;
#      on Qwen2.5-Coder-0.5B (qwen2 GGUF) the input-sparse FFN keeping every input gives the dense
#      MLP's tokens exactly, and every neuron at least the first 16;
#   4. the unit and loader tests of the patch (cargo test);
#   5. mistral.rs's OpenAI server answers /v1/chat/completions on loopback with the sparse FFN,
#      and sixteen different requests sent from eight clients at once get the answers they get
#      alone, or part from them only at a near-tie (the default sparse FFN batched 4 at a time;
#      the trained predictors one at a time);
#   6. mistral.rs's own CLI (mistralrs-cli 0.8.1, built with the patched core by this workspace)
#      serves one chat request with the feature on (`MISTRALRS_POWERINFER=input mistralrs serve`)
#      and gives the answer the dense MLP gives.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(cd "$here/../.." && pwd)
# One target dir for everything: the workspace's (where the README's `cargo test` just built the
# CLI), shared by the mistral.rs builds, so no crate is compiled twice.
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$root/target}"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
step() { echo; echo "=== $* ($(date -u +%H:%M:%S))"; }

step "model and a small artifact (powerinfer analyze)"
# The whole workspace's bins and examples: the same units (and features) `cargo test --release
# --workspace` built, so after it this compiles nothing.
cargo build --release -q --workspace --bins --examples --manifest-path "$root/Cargo.toml"
"$CARGO_TARGET_DIR/release/powerinfer" analyze --tokens 8192 --threshold-tokens 2048 --train-rows 2048 \
    --val-rows 512 --epochs 2 --rank 32 --ctx 256 --budget 16M --out "$work/smollm2.powerinfer" \
    2>"$work/analyze.log" | grep -v '^{' | tail -n 3
model="${POWERINFER_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/powerinfer}/models/SmolLM2-135M-Instruct.Q4_1.gguf"
"$CARGO_TARGET_DIR/release/examples/gguf_to_hf" "$model" "$work/smollm2-hf"

step "patch mistralrs-core"
"$here/patch/apply.sh"

step "build unpatched mistral.rs (baseline), the example and mistral.rs's own CLI"
(cd "$here/baseline" && cargo build --release --locked)
# The whole workspace at once: the example and `mistralrs` share one build of the patched core.
(cd "$here" && cargo build --release --locked --workspace)

bin="$CARGO_TARGET_DIR/release"
step "greedy, f32 HF checkpoint: unpatched mistral.rs = dense MLP = every neuron = every input"
"$bin/powerinfer-mistralrs-baseline" "$work/smollm2-hf" 48 > "$work/baseline-hf.jsonl"
"$bin/powerinfer-mistralrs" compare --model "$work/smollm2-hf" --max-tokens 48 \
    --baseline "$work/baseline-hf.jsonl" --strict --strict-input

step "greedy, GGUF: unpatched mistral.rs = dense MLP; every neuron; the artifact's predictors"
"$bin/powerinfer-mistralrs-baseline" "$model" 48 > "$work/baseline.jsonl"
"$bin/powerinfer-mistralrs" compare --model "$model" --max-tokens 48 \
    --baseline "$work/baseline.jsonl" --min-prefix 8 --strict-input \
    --powerinfer "predictors:$work/smollm2.powerinfer"

step "qwen2 GGUF (Qwen2.5-Coder-0.5B Q4_K_M) through the patched quantized_qwen.rs"
# Every input kept gives the dense MLP's tokens exactly; every neuron (down rows in Q8_0) at
# least its first 16.
"$CARGO_TARGET_DIR/release/powerinfer" generate --model qwen2.5-coder-0.5b --prompt "Hi" \
    --max-tokens 1 > /dev/null
qwen="${POWERINFER_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/powerinfer}/models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
"$bin/powerinfer-mistralrs" compare --model "$qwen" --max-tokens 32 --min-prefix 16 --strict-input

step "the artifact's input rule through mistral.rs: decode speed against the dense MLP"
"$bin/powerinfer-mistralrs" bench --model "$model" --runs 3 --max-tokens 48 \
    --powerinfer "input:$work/smollm2.powerinfer"

step "tests of the patch"
(cd "$here" && POWERINFER_TEST_ARTIFACT="$work/smollm2.powerinfer" cargo test --release --locked)

step "OpenAI-compatible server on loopback: 4 requests at a time; the predictors 1"
# --check: sixteen greedy requests from eight clients must get the answers they get alone, or
# part from them only at a near-tie (src/load.rs). Batched 4 at a time with the default sparse
# FFN (`input`, every input kept); without the patch set's CPU attention fix the requests of a
# batch get each other's answers from their second token on. The trained predictors' rows share
# one pass over the union of their neurons, which orders the float sums by the batch, so they
# are served one at a time.
"$bin/powerinfer-mistralrs" serve --model "$model" --port 0 --check --concurrent-requests 4
"$bin/powerinfer-mistralrs" serve --model "$model" --port 0 --check --concurrent-requests 1 \
    --powerinfer "predictors:$work/smollm2.powerinfer"

step "mistral.rs's own server (\`mistralrs serve\` of mistralrs-cli 0.8.1) with the feature on"
# One greedy chat request through the OpenAI endpoint, with the feature (`input`, every input kept:
# the dense MLP's result) and without it: the answers must be equal and not empty, and the log
# must say the sparse FFN was on.
chat() { # chat PORT: the answer's text
    curl -sf "http://127.0.0.1:$1/v1/chat/completions" -H 'Content-Type: application/json' \
        -d '{"model":"default","messages":[{"role":"user","content":"Name three colours."}],"max_tokens":24,"temperature":0}' |
        python3 -c 'import json,sys; print(json.load(sys.stdin)["choices"][0]["message"]["content"])'
}
serve() { # serve LOG [ENV=V...]: starts `mistralrs serve` on a free port; prints the port
    local log=$1 port; shift
    port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
    env "$@" "$bin/mistralrs" serve -p "$port" --host 127.0.0.1 --cpu -m "$(dirname "$model")" --format gguf \
        -f "$(basename "$model")" > "$log" 2>&1 &
    echo "$!" > "$log.pid"
    for _ in $(seq 240); do
        curl -sf "http://127.0.0.1:$port/v1/models" > /dev/null 2>&1 && { echo "$port"; return; }
        kill -0 "$(cat "$log.pid")" 2>/dev/null || break
        sleep 0.5
    done
    echo "error: mistralrs serve did not come up; its log:" >&2; tail -n 30 "$log" >&2; exit 1
}
stop() { kill "$(cat "$1.pid")" 2>/dev/null || true; wait "$(cat "$1.pid")" 2>/dev/null || true; }
port=$(serve "$work/cli-sparse.log" MISTRALRS_POWERINFER=input RUST_LOG=info)
sparse=$(chat "$port"); stop "$work/cli-sparse.log"
grep -q "powerinfer: sparse FFN on" "$work/cli-sparse.log" || {
    echo "error: mistralrs serve did not turn the sparse FFN on; its log:" >&2
    tail -n 30 "$work/cli-sparse.log" >&2; exit 1; }
port=$(serve "$work/cli-dense.log" MISTRALRS_POWERINFER=)
dense=$(chat "$port"); stop "$work/cli-dense.log"
echo "with the feature: $sparse"
echo "dense MLP:        $dense"
[ -n "$sparse" ] && [ "$sparse" = "$dense" ] || {
    echo "error: mistralrs serve answered differently with the feature on" >&2; exit 1; }
