#!/usr/bin/env bash
# Run on the development machine: builds ferrox as an abi3 wheel for an old
# manylinux tag (glibc 2.17, so that it installs on common GPU images; the
# linker is zig, from the `ziglang` package, installed here if missing), and
# fetches the wheels of the dependencies a GPU machine's image may lack, all
# into .whl/ (ignored by git: copy it along with the repository). Then, on a
# machine with an NVIDIA GPU:
#   bash benches/gpu_check.sh .whl
set -euo pipefail
cd "$(dirname "$0")/.."
out=.whl
tag=manylinux2014
mkdir -p "$out"
rm -f "$out"/*.whl
if ! python3 -m ziglang version >/dev/null 2>&1; then
  python3 -m pip install -q ziglang
fi
python3 -m maturin build --release --zig --compatibility "$tag" --out "$out"
wheel=$(ls "$out"/ferrox-*.whl)
case "$wheel" in
  *-manylinux_2_17_x86_64*|*-manylinux2014_x86_64*) ;;
  *) echo "error: $wheel does not carry the $tag (glibc 2.17) tag" >&2; exit 1 ;;
esac
# Binary dependencies for CPython 3.12 on x86-64 Linux, without their own
# dependencies (the GPU image carries torch, transformers, numpy, ...). The
# check script installs each one that fits the machine, and reports the rest.
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_31_x86_64 -d "$out" \
  msgspec gguf pyzmq uvicorn uvloop starlette httptools prometheus-client llguidance pillow
ls -la "$out"
du -sh "$out"
