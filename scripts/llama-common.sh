# Shared by scripts/llama-bench.sh and scripts/llama-peer.sh (sourced, not run): one pinned llama.cpp
# source and one cmake build tree in the cache dir, from which each script builds the targets it needs.
#
#   lcpp_build TARGET...     fetch + configure (once) and build the named cmake targets
#   $lcpp_cache              ${POWERINFER_CACHE:-~/.cache/powerinfer}/llama.cpp-$LCPP_PY_VERSION
#   $lcpp_src, $lcpp_build   the extracted source tree and the cmake build tree inside it
#
# Source: the `llama-cpp-python` sdist on PyPI vendors llama.cpp (vendor/llama.cpp); cmake comes
# from PyPI too. Both are pinned (version + sha256 for the sdist). The build is a plain CPU build
# for this machine (GGML_NATIVE: the SIMD the CPU has, as a llama.cpp user would build it), static
# libraries (BUILD_SHARED_LIBS=OFF), no curl, tests, examples or server.

LCPP_PY_VERSION=0.3.36
LCPP_SHA256=832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e
CMAKE_VERSION=3.31.6

lcpp_cache="${POWERINFER_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/powerinfer}/llama.cpp-$LCPP_PY_VERSION"
lcpp_src="$lcpp_cache/src"
lcpp_build="$lcpp_cache/build"
lcpp_cmake="$lcpp_cache/cmake/bin/cmake"

# Fetch the sdist (sha256-checked), extract vendor/llama.cpp, install cmake. Each step once.
lcpp_fetch() {
    mkdir -p "$lcpp_cache"
    local sdist="$lcpp_cache/llama_cpp_python-$LCPP_PY_VERSION.tar.gz"
    if [ ! -f "$sdist" ]; then
        pip download --quiet --no-deps --no-binary llama-cpp-python \
            "llama-cpp-python==$LCPP_PY_VERSION" -d "$lcpp_cache" >&2
    fi
    local got
    got=$(sha256sum "$sdist" | cut -d' ' -f1)
    if [ "$got" != "$LCPP_SHA256" ]; then
        echo "$(basename "$0"): $sdist has sha256 $got, expected $LCPP_SHA256" >&2
        exit 1
    fi
    if [ ! -d "$lcpp_src" ]; then
        rm -rf "$lcpp_cache/src.tmp" && mkdir -p "$lcpp_cache/src.tmp"
        tar xzf "$sdist" -C "$lcpp_cache/src.tmp" --strip-components=3 \
            "llama_cpp_python-$LCPP_PY_VERSION/vendor/llama.cpp"
        mv "$lcpp_cache/src.tmp" "$lcpp_src"
    fi
    if [ ! -x "$lcpp_cmake" ]; then
        pip install --quiet --no-deps --target "$lcpp_cache/cmake-py" "cmake==$CMAKE_VERSION" >&2
        mkdir -p "$lcpp_cache/cmake/bin"
        printf '#!/bin/sh\nPYTHONPATH="%s" exec python3 -m cmake "$@"\n' "$lcpp_cache/cmake-py" \
            > "$lcpp_cmake"
        chmod +x "$lcpp_cmake"
    fi
}

# The compiler flags the tree is built with (also used for programs linked against its libraries).
# AMX: ggml's AMX kernels segfault in KVM guests that list the AMX flags without granting the
# tile state (seen on our 2-core Sapphire Rapids guests: SIGSEGV in ggml_backend_amx_mul_mat);
# build without them there, as a user of such a machine would have to.
lcpp_cflags() {
    if grep -q amx_tile /proc/cpuinfo 2>/dev/null; then
        echo "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
    fi
}

# Configure (cmake is idempotent on an existing tree) and build the given targets.
lcpp_build() {
    lcpp_fetch
    local flags
    flags=$(lcpp_cflags)
    "$lcpp_cmake" -S "$lcpp_src" -B "$lcpp_build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
        -DCMAKE_C_FLAGS="$flags" -DCMAKE_CXX_FLAGS="$flags" \
        -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
        -DLLAMA_BUILD_SERVER=OFF -DBUILD_SHARED_LIBS=OFF >&2
    "$lcpp_cmake" --build "$lcpp_build" --target "$@" -j "$(nproc)" >&2
}
