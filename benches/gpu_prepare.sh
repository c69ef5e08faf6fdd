#!/usr/bin/env bash
# Run on the development machine: builds the abi3 wheel of ferrox and fetches
# the wheels of the dependencies a GPU machine's image may lack, into .whl/
# (ignored by git). Then, on a machine with an NVIDIA GPU and the repository:
#   bash benches/gpu_check.sh .whl
set -euo pipefail
cd "$(dirname "$0")/.."
out=.whl
mkdir -p "$out"
rm -f "$out"/ferrox-*.whl
python3 -m maturin build --release --out "$out"
# Binary dependencies for CPython 3.12 on x86-64 Linux, without their own
# dependencies (the GPU image carries torch, transformers, numpy, ...).
python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux_2_27_x86_64 -d "$out" \
  msgspec gguf pyzmq uvicorn starlette httptools openai
ls -la "$out"
