#!/usr/bin/env bash
# Build (once) and install llama-cpp-python for speclm's llama.cpp backend.
#
# The wheel is cached in $SPECLM_WHEEL_CACHE (default ~/.cache/speclm/wheels), so a second run,
# and CI after the first, installs it in seconds instead of compiling llama.cpp for minutes.
# Flags: the x86-64 SIMD levels are set explicitly instead of -march=native, because ggml's AMX
# kernels (which -march=native turns on for Sapphire Rapids and newer) crash in llama_decode on
# the Q4_1 default model; AVX-512 (with VNNI and BF16) stays on. Other machines: set CMAKE_ARGS.
set -euo pipefail
VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
CACHE="${SPECLM_WHEEL_CACHE:-$HOME/.cache/speclm/wheels}"
PYTHON="${PYTHON:-python}"
mkdir -p "$CACHE"
wheel=$(ls "$CACHE"/llama_cpp_python-"$VERSION"-*.whl 2>/dev/null | head -n 1 || true)
if [ -z "$wheel" ]; then
    if [ "$(uname -m)" = "x86_64" ] && [ -z "${CMAKE_ARGS:-}" ]; then
        flags="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON"
        if grep -q avx512f /proc/cpuinfo 2>/dev/null; then
            flags="$flags -DGGML_AVX512=ON"
            grep -q avx512_vnni /proc/cpuinfo && flags="$flags -DGGML_AVX512_VNNI=ON"
            grep -q avx512_bf16 /proc/cpuinfo && flags="$flags -DGGML_AVX512_BF16=ON"
            grep -q avx512vbmi /proc/cpuinfo && flags="$flags -DGGML_AVX512_VBMI=ON"
        fi
        export CMAKE_ARGS="$flags -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
    fi
    export CMAKE_ARGS="${CMAKE_ARGS:-} -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF"
    export CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}"
    echo "building llama-cpp-python $VERSION (one time, several minutes): CMAKE_ARGS=$CMAKE_ARGS" >&2
    "$PYTHON" -m pip wheel -q --no-deps --no-cache-dir "llama-cpp-python==$VERSION" -w "$CACHE"
    wheel=$(ls "$CACHE"/llama_cpp_python-"$VERSION"-*.whl | head -n 1)
fi
"$PYTHON" -m pip install -q "$wheel"
