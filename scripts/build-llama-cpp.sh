#!/usr/bin/env bash
# Build (once) and install llama-cpp-python for speclm's llama.cpp backend.
#
# The wheel is cached in $SPECLM_WHEEL_CACHE (default ~/.cache/speclm/wheels), so a second run,
# and CI after the first, installs it in seconds instead of compiling llama.cpp for minutes.
# Flags: scripts/ggml-cpu-flags.sh (explicit x86-64 SIMD levels, AMX kernels off); set CMAKE_ARGS
# to build with others.
set -euo pipefail
VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
CACHE="${SPECLM_WHEEL_CACHE:-$HOME/.cache/speclm/wheels}"
PYTHON="${PYTHON:-python}"
mkdir -p "$CACHE"
wheel=$(ls "$CACHE"/llama_cpp_python-"$VERSION"-*.whl 2>/dev/null | head -n 1 || true)
if [ -z "$wheel" ]; then
    if [ -z "${CMAKE_ARGS:-}" ]; then
        export CMAKE_ARGS="$("$(dirname "$0")"/ggml-cpu-flags.sh)"
    fi
    export CMAKE_ARGS="${CMAKE_ARGS:-} -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF"
    export CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}"
    echo "building llama-cpp-python $VERSION (one time, several minutes): CMAKE_ARGS=$CMAKE_ARGS" >&2
    "$PYTHON" -m pip wheel -q --no-deps --no-cache-dir "llama-cpp-python==$VERSION" -w "$CACHE"
    wheel=$(ls "$CACHE"/llama_cpp_python-"$VERSION"-*.whl | head -n 1)
fi
# --force-reinstall: a llama-cpp-python that pip built itself (say, by installing speclm's
# [test] or [llamacpp] extra first) has the same version and would otherwise stay, with
# -march=native's AMX kernels (see ggml-cpu-flags.sh); --no-deps keeps its dependencies as they are
"$PYTHON" -m pip install -q --force-reinstall --no-deps "$wheel"
"$PYTHON" -m pip install -q "$wheel"
