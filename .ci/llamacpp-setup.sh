#!/usr/bin/env bash
# llama.cpp for GGUF export and its smoke test: llama-cpp-python (compiled here, ~10-20 min on
# 2 cores) and its source distribution, which carries llama.cpp's own convert_hf_to_gguf.py.
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION=0.3.36
mkdir -p .ci-cache/llama-sdist
if ! ls .ci-cache/llama-sdist/llama_cpp_python-${VERSION}.tar.gz >/dev/null 2>&1; then
  .venv/bin/pip download -q --no-deps --no-binary :all: "llama-cpp-python==${VERSION}" -d .ci-cache/llama-sdist
fi
if ! .venv/bin/python -c "import llama_cpp" 2>/dev/null; then
  # GGML_NATIVE=OFF: a portable build, not one tuned to (and crashing off) the build machine's CPU.
  CMAKE_ARGS="-DGGML_NATIVE=OFF" .venv/bin/pip install -q "llama-cpp-python==${VERSION}"
fi
.venv/bin/python -c "import llama_cpp; print('llama-cpp-python', llama_cpp.__version__)"
