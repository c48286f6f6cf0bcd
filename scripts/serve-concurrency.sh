#!/usr/bin/env bash
# Four greedy chat completions through `powerinfer-mistralrs serve` on loopback, sent one after
# another and then all at once, for a few rounds: wall time of each, and whether the concurrent
# answers equal the sequential ones.
#
#   scripts/serve-concurrency.sh [NEURONS] [ROUNDS]     (NEURONS: --powerinfer value, default all)
#
# Needs the example built by adapters/mistralrs/test.sh (in $CARGO_TARGET_DIR, else ./target),
# SmolLM2 in the cache (`powerinfer demo` fetches it), curl and python3.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
bin="${CARGO_TARGET_DIR:-$root/target}/release/powerinfer-mistralrs"
model="${POWERINFER_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/powerinfer}/models/SmolLM2-135M-Instruct.Q4_1.gguf"
neurons="${1:-all}"
rounds="${2:-3}"
port=18080
out=$(mktemp -d)
"$bin" serve --model "$model" --port "$port" --powerinfer "$neurons" > "$out/serve.log" 2>&1 &
server=$!
trap 'kill $server 2>/dev/null; rm -rf "$out"' EXIT
for _ in $(seq 1 120); do grep -q serving "$out/serve.log" && break; sleep 1; done
grep -q serving "$out/serve.log" || { cat "$out/serve.log"; exit 1; }
ask() {
    curl -sf -o "$out/$1.json" "http://127.0.0.1:$port/v1/chat/completions" \
        -H 'Content-Type: application/json' \
        -d "{\"model\":\"default\",\"messages\":[{\"role\":\"user\",\"content\":\"Write about the number $2.\"}],\"max_tokens\":48,\"temperature\":0}"
}
now() { date +%s.%N; }
ask warm 0
for r in $(seq 1 "$rounds"); do
    s=$(now); for i in 1 2 3 4; do ask "seq$r-$i" "$i"; done; e=$(now)
    echo "round $r: one after another $(echo "$e - $s" | bc) s"
    s=$(now); pids=""
    for i in 1 2 3 4; do ask "conc$r-$i" "$i" & pids="$pids $!"; done
    wait $pids; e=$(now)
    echo "round $r: all four at once   $(echo "$e - $s" | bc) s"
done
python3 - "$out" "$rounds" <<'PY'
import json, sys
out, rounds = sys.argv[1], int(sys.argv[2])
text = lambda k: json.load(open(f"{out}/{k}.json"))["choices"][0]["message"]["content"]
for r in range(1, rounds + 1):
    same = [text(f"seq{r}-{i}") == text(f"conc{r}-{i}") for i in range(1, 5)]
    steady = [text(f"seq{r}-{i}") == text(f"seq1-{i}") for i in range(1, 5)]
    print(f"round {r}: concurrent answer = sequential answer {same}; sequential = round 1 {steady}")
PY
