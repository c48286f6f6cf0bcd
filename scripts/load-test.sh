#!/usr/bin/env bash
# Load test of mistral.rs's OpenAI-compatible server on loopback, same machine, one server after
# another: unpatched mistral.rs 0.8.1 (dense), the patched crate's dense MLP, and the sparse FFN.
# Each gets sixteen different greedy prompts sent alone, then from 1, 4 and 16 concurrent clients
# (`powerinfer-mistralrs load`); one table: throughput, p50/p99 latency, answers that differ from
# their solo answers, failed requests.
#
#   scripts/load-test.sh [SPARSITY] [MODEL] [ROUNDS]
#
# SPARSITY: the `--powerinfer` value (default `input`); MODEL: a GGUF file (default SmolLM2
# Q4_1 in the cache); ROUNDS: requests per prompt and level (default 2, so 32 per level).
# Needs the builds of adapters/mistralrs/test.sh in $CARGO_TARGET_DIR (else ./target).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
bin="${CARGO_TARGET_DIR:-$root/target}/release"
sparsity="${1:-input}"
model="${2:-${POWERINFER_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/powerinfer}/models/SmolLM2-135M-Instruct.Q4_1.gguf}"
rounds="${3:-2}"
out=$(mktemp -d)
server=""
header=--header
trap '[ -n "$server" ] && kill $server 2>/dev/null; rm -rf "$out"' EXIT

# serve LABEL COMMAND..: starts the server, runs the load levels against it, stops it.
serve() {
    local label="$1"; shift
    "$@" > "$out/serve.log" 2>&1 &
    server=$!
    for _ in $(seq 1 300); do grep -q '^serving' "$out/serve.log" && break; sleep 1; done
    grep -q '^serving' "$out/serve.log" || { cat "$out/serve.log"; exit 1; }
    local url
    url=$(grep -o 'http://[0-9.:]*' "$out/serve.log" | head -1)
    "$bin/powerinfer-mistralrs" load --url "$url" --clients 1,4,16 --rounds "$rounds" \
        --max-tokens 32 --label "$label" $header
    header=""
    kill "$server"; wait "$server" 2>/dev/null || true
    server=""
}

echo "model: $model; sparse: $sparsity; $((16 * rounds)) greedy requests of up to 32 tokens per level"
serve "unpatched mistral.rs, dense" "$bin/powerinfer-mistralrs-baseline" --serve "$model" 0
serve "patched, dense MLP" "$bin/powerinfer-mistralrs" serve --model "$model" --port 0 --dense
serve "patched, sparse \`$sparsity\`" "$bin/powerinfer-mistralrs" serve --model "$model" --port 0 \
    --powerinfer "$sparsity"
