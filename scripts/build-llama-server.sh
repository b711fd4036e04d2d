#!/usr/bin/env bash
# Build (once) llama.cpp's own C++ server, `llama-server`, for the benchmark's llama-server peer.
#
# The sources are the llama.cpp vendored in the llama-cpp-python sdist of the version speclm's
# llama.cpp backend uses, so the peer and the backend run the same kernels on the same GGUF.
# The binary is cached in $SPECLM_LLAMA_SERVER_CACHE (default ~/.cache/speclm/llama-server/VERSION);
# a second run prints its path at once. Prints the binary's path on stdout; progress on stderr.
# Flags: scripts/ggml-cpu-flags.sh, as for the wheel (or CMAKE_ARGS); no web UI, no HTTPS.
set -euo pipefail
VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
CACHE="${SPECLM_LLAMA_SERVER_CACHE:-$HOME/.cache/speclm/llama-server/$VERSION}"
PYTHON="${PYTHON:-python}"
binary="$CACHE/llama-server"
if [ -x "$binary" ]; then
    echo "$binary"
    exit 0
fi
for tool in cmake c++; do
    command -v "$tool" > /dev/null || { echo "build-llama-server: $tool is needed to build llama-server" >&2; exit 1; }
done
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
echo "build-llama-server: fetching the llama-cpp-python $VERSION sources" >&2
"$PYTHON" -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$work"
tar -xzf "$work"/llama_cpp_python-"$VERSION".tar.gz -C "$work"
src="$work/llama_cpp_python-$VERSION/vendor/llama.cpp"
flags="${CMAKE_ARGS:-$("$(dirname "$0")"/ggml-cpu-flags.sh)}"
generator=()
command -v ninja > /dev/null && generator=(-G Ninja)
echo "build-llama-server: building llama-server (one time, several minutes)" >&2
# shellcheck disable=SC2086
cmake -S "$src" -B "$work/build" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF \
    -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_COMMON=ON -DLLAMA_BUILD_TESTS=OFF \
    -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
    -DLLAMA_OPENSSL=OFF $flags > "$work/configure.log" 2>&1 \
    || { tail -n 30 "$work/configure.log" >&2; exit 1; }
cmake --build "$work/build" --target llama-server -j "${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}" \
    > "$work/build.log" 2>&1 || { tail -n 30 "$work/build.log" >&2; exit 1; }
mkdir -p "$CACHE"
cp "$work/build/bin/llama-server" "$binary.tmp"
mv "$binary.tmp" "$binary"
echo "$binary"
