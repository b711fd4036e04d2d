#!/usr/bin/env bash
# Print the CMake flags speclm builds llama.cpp's CPU backend with (llama-cpp-python's wheel and the
# llama-server peer alike). The x86-64 SIMD levels are named explicitly instead of -march=native,
# because ggml's AMX kernels (which -march=native turns on for Sapphire Rapids and newer) crash in
# llama_decode on the Q4_1 default model; AVX-512 (with VNNI and BF16) stays on where the CPU has
# it. Other architectures: nothing (llama.cpp's own defaults).
set -euo pipefail
if [ "$(uname -m)" != "x86_64" ]; then
    exit 0
fi
flags="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON"
if grep -q avx512f /proc/cpuinfo 2>/dev/null; then
    flags="$flags -DGGML_AVX512=ON"
    grep -q avx512_vnni /proc/cpuinfo && flags="$flags -DGGML_AVX512_VNNI=ON"
    grep -q avx512_bf16 /proc/cpuinfo && flags="$flags -DGGML_AVX512_BF16=ON"
    grep -q avx512vbmi /proc/cpuinfo && flags="$flags -DGGML_AVX512_VBMI=ON"
fi
echo "$flags -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
