#!/usr/bin/env bash
# Builds and tests the `cuda` feature, on any machine: without a GPU the GPU tests print one
# `skipped ...: no CUDA device` line each and pass, and the CLI falls back to the CPU with one
# message. With POWERINFER_REQUIRE_GPU=1 a missing GPU or driver fails instead. Part of the
# README's test command (and so of CI).
#
#   scripts/cuda-test.sh
#
# Uses scripts/cuda-toolchain.sh (a pinned CUDA 13.0 nvcc from NVIDIA's PyPI wheels, and stub
# libraries to link against when no driver is installed) and the same CARGO_TARGET_DIR as the
# workspace build, so only the crates whose features change are built again.
set -euo pipefail
cd "$(dirname "$0")/.."
eval "$(scripts/cuda-toolchain.sh --env)"
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$PWD/target}"

# One build of the candle stack with CUDA serves the engine's tests and the CLI: both packages
# in one selection, so cargo unifies their features once (built apart, the CLI's dependencies
# and the tests' dev-dependencies set different features below candle, and candle with its CUDA
# kernels was built twice). The CLI's `cli` test target is built, not run, for the binary.
sel=(-p powerinfer -p powerinfer-cli --features powerinfer/cuda,powerinfer-cli/cuda --lib
  --test cuda --test tiers --test layout)
cargo test --release "${sel[@]}" --test cli --no-run
# The engine's CUDA tier: device layouts (unit tests), the tier against the CPU tier (skipped
# without a GPU), the tier seam and the layout rules with the feature on; the CLI's unit tests.
cargo test --release "${sel[@]}"

# The CLI built with CUDA: on a machine without a GPU a tier row says why it ran on the CPU.
out="$("$CARGO_TARGET_DIR/release/powerinfer" bench --modes gate-first --threshold 0.02 --threads 2 \
  --prompt-tokens 8 --decode-tokens 2 --runs 1 --vram-budget 25% 2>&1)"
if nvidia-smi >/dev/null 2>&1; then
  grep -q 'tier 25% (cuda:0): budget' <<<"$out" || { echo "$out"; exit 1; }
elif [[ "${POWERINFER_REQUIRE_GPU:-}" == 1 ]]; then
  echo "cuda-test: POWERINFER_REQUIRE_GPU=1 and no GPU (nvidia-smi failed)" >&2
  exit 1
else
  grep -qF 'on the CPU: fast tier `cuda:0`: no CUDA device' <<<"$out" || { echo "$out"; exit 1; }
  echo "cuda-test: no GPU here: the CUDA tests were skipped and the CLI fell back to the CPU"
fi
echo "cuda-test: ok"
