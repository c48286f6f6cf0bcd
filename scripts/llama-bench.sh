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
# Source: the `llama-cpp-python` sdist on PyPI vendors llama.cpp (vendor/llama.cpp); cmake comes
# from PyPI too. Both are pinned (version + sha256 for the sdist). The build is a plain CPU build
# for this machine (GGML_NATIVE: the SIMD the CPU has, as a llama.cpp user would build it).
# Not part of the test run.
set -euo pipefail

LCPP_PY_VERSION=0.3.36
LCPP_SHA256=832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e
CMAKE_VERSION=3.31.6

cache="${POWERINFER_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/powerinfer}/llama.cpp-$LCPP_PY_VERSION"
bin="$cache/build/bin/llama-bench"

build() {
    [ -x "$bin" ] && return 0
    mkdir -p "$cache"
    local sdist="$cache/llama_cpp_python-$LCPP_PY_VERSION.tar.gz"
    if [ ! -f "$sdist" ]; then
        pip download --quiet --no-deps --no-binary llama-cpp-python \
            "llama-cpp-python==$LCPP_PY_VERSION" -d "$cache" >&2
    fi
    local got
    got=$(sha256sum "$sdist" | cut -d' ' -f1)
    if [ "$got" != "$LCPP_SHA256" ]; then
        echo "llama-bench.sh: $sdist has sha256 $got, expected $LCPP_SHA256" >&2
        exit 1
    fi
    if [ ! -d "$cache/src" ]; then
        rm -rf "$cache/src.tmp" && mkdir -p "$cache/src.tmp"
        tar xzf "$sdist" -C "$cache/src.tmp" --strip-components=3 \
            "llama_cpp_python-$LCPP_PY_VERSION/vendor/llama.cpp"
        mv "$cache/src.tmp" "$cache/src"
    fi
    if [ ! -x "$cache/cmake/bin/cmake" ]; then
        pip install --quiet --no-deps --target "$cache/cmake-py" "cmake==$CMAKE_VERSION" >&2
        mkdir -p "$cache/cmake/bin"
        printf '#!/bin/sh\nPYTHONPATH="%s" exec python3 -m cmake "$@"\n' "$cache/cmake-py" \
            > "$cache/cmake/bin/cmake"
        chmod +x "$cache/cmake/bin/cmake"
    fi
    local cmake="$cache/cmake/bin/cmake"
    # AMX: ggml's AMX kernels segfault in KVM guests that list the AMX flags without granting the
    # tile state (seen on our 2-core Sapphire Rapids guests: SIGSEGV in ggml_backend_amx_mul_mat);
    # build without them there, as a user of such a machine would have to.
    local noamx=""
    if grep -q amx_tile /proc/cpuinfo 2>/dev/null; then
        noamx="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
    fi
    "$cmake" -S "$cache/src" -B "$cache/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
        -DCMAKE_C_FLAGS="$noamx" -DCMAKE_CXX_FLAGS="$noamx" \
        -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
        -DLLAMA_BUILD_SERVER=OFF -DBUILD_SHARED_LIBS=OFF >&2
    "$cmake" --build "$cache/build" --target llama-bench -j "$(nproc)" >&2
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
