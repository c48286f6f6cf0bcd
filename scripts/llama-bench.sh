#!/usr/bin/env bash
# llama.cpp's `llama-bench` as a peer: built once from a pinned source into a cache dir, then run on
# a GGUF file with the same threads and prompt/decode lengths as `powerinfer bench`.
#
#   scripts/llama-bench.sh build                       # fetch + build (about 10 min on 2 cores)
#   scripts/llama-bench.sh run MODEL THREADS PROMPT DECODE RUNS
#       prints two JSON lines, prompt then decode (decode after a context of PROMPT tokens):
#       {"peer":"llama.cpp","threads":..,"n_prompt":..,"n_gen":..,"n_depth":..,"avg_ts":..,"samples_ts":[..]}
#   scripts/llama-bench.sh path                        # the llama-bench binary (builds if missing)
#
# Source and build: scripts/llama-common.sh (pinned llama-cpp-python sdist, which vendors llama.cpp;
# one cmake build tree shared with scripts/llama-peer.sh).
# Not part of the test run.
set -euo pipefail

# shellcheck source=scripts/llama-common.sh
. "$(dirname "${BASH_SOURCE[0]}")/llama-common.sh"
bin="$lcpp_build/bin/llama-bench"

build() {
    [ -x "$bin" ] && return 0
    lcpp_build llama-bench
}

case "${1:-}" in
build) build ;;
path) build; echo "$bin" ;;
run)
    [ $# -eq 6 ] || { echo "usage: $0 run MODEL THREADS PROMPT DECODE RUNS" >&2; exit 2; }
    build
    model=$2 threads=$3 prompt=$4 decode=$5 runs=$6
    # Prompt: one batch of PROMPT tokens. Decode: DECODE tokens one at a time after a context of
    # PROMPT tokens (`-d`), as `powerinfer bench` decodes after its prompt. RUNS repetitions each.
    { "$bin" -m "$model" -t "$threads" -p "$prompt" -n 0 -r "$runs" -o jsonl 2>/dev/null
      "$bin" -m "$model" -t "$threads" -p 0 -n "$decode" -d "$prompt" -r "$runs" -o jsonl 2>/dev/null; } |
        python3 -c '
import json, sys
for line in sys.stdin:
    line = line.strip()
    if not line.startswith("{"):
        continue
    r = json.loads(line)
    print(json.dumps({"peer": "llama.cpp", "threads": r["n_threads"], "n_prompt": r["n_prompt"],
                      "n_gen": r["n_gen"], "n_depth": r.get("n_depth", 0), "avg_ts": r["avg_ts"],
                      "samples_ts": r.get("samples_ts")}))
'
    ;;
*) echo "usage: $0 build | path | run MODEL THREADS PROMPT DECODE RUNS" >&2; exit 2 ;;
esac
