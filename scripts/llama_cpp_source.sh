#!/bin/sh
# Pack the part of llama.cpp's source that llama-bench needs (ggml core, CPU and CUDA backends, src, common, vendor,
# tools/llama-bench), about 2.3 MB as xz, small enough to travel to a GPU machine beside the checkout.
#
#   scripts/llama_cpp_source.sh LLAMA_CPP_DIR OUT.tar.xz
#
# LLAMA_CPP_DIR: llama.cpp's source, e.g. vendor/llama.cpp of the llama-cpp-python 0.3.36 sdist (`pip download
# --no-binary :all: --no-deps llama-cpp-python==0.3.36`). On the GPU machine:
#
#   tar -xJf OUT.tar.xz -C /tmp && cd /tmp/llama-cpp-bench
#   cmake -S . -B build -G Ninja -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DGGML_NATIVE=ON \
#     -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_CURL=OFF
#   cmake --build build --target llama-bench -j16      # about 4 minutes on 16 cores
#
# then `benchmarks/gpu_gguf_peers.py --llama-bench build/bin/llama-bench ...`.
set -eu
src=$1
out=$(realpath -m "$2")
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir "$work/llama-cpp-bench"
cd "$src"
tar -cf - LICENSE licenses CMakeLists.txt cmake include src common vendor tools/llama-bench ggml/CMakeLists.txt \
  ggml/cmake ggml/include ggml/src/*.c ggml/src/*.cpp ggml/src/*.h ggml/src/*.in ggml/src/CMakeLists.txt \
  ggml/src/ggml-cpu ggml/src/ggml-cuda | tar -xf - -C "$work/llama-cpp-bench"
# the tools folder builds every tool; keep llama-bench alone
printf 'find_package(Threads REQUIRED)\nllama_add_compile_flags()\nadd_subdirectory(llama-bench)\n' \
  > "$work/llama-cpp-bench/tools/CMakeLists.txt"
tar -cJf "$out" -C "$work" llama-cpp-bench
echo "wrote $out ($(du -h "$out" | cut -f1))"
