#!/usr/bin/env bash
# The wheel folder that lets an offline CUDA host run Loomax (bench/gpu.sh): the packages
# Loomax needs beyond a JAX GPU image's own (jax, jaxlib, the CUDA plugin, equinox, optax,
# tensorstore, numpy, flax, torch, transformers, ...). Pure-Python wheels, ~1.2 MB in all.
# Usage: bench/gpu_wheels.sh [DIR (default .whl)] [PYTHON_VERSION (default 3.12)]
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${1:-.whl}
PYVER=${2:-3.12}
PYTHON=${PYTHON:-python3}
# haliax and its AQT dependency (haliax.quantization imports it; it needs flax, in the image),
# draccus and its two small dependencies, jmp (mixed precision)
PACKAGES=(
  "haliax==1.4.dev453" "aqtp==0.9.0"
  "draccus==0.11.6" "mergedeep==1.3.4" "toml==0.10.2"
  "jmp==0.0.4"
  "equinox==0.13.8" "optax==0.2.8"  # the versions CI tests with (images carry their own)
)
mkdir -p "$DIR"
"$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version "$PYVER" \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d "$DIR" "${PACKAGES[@]}"
ls -la "$DIR"
