#!/usr/bin/env bash
# Download, here, the cp312 manylinux wheels that the GPU check machine's image lacks
# (it has Python 3.12, torch 2.11 + CUDA 13, triton 3.6, transformers 5.17 and their
# dependencies, but no fastapi/uvicorn/pydantic/gguf/prometheus-client/pytest), into an
# ignored folder that travels with the working tree. scripts/gpu-check.sh installs from it
# with --no-index; nothing there is ever fetched from the network.
#
#   scripts/fetch-gpu-wheels.sh [DEST]        (default: wheelhouse-gpu/)
#
# pip resolves the full dependency closure for the target (Python 3.12, x86_64 Linux,
# binary wheels only), so packages the image already has (numpy, pyyaml, typing-extensions,
# ...) are fetched too; the install on the device takes only what is missing. torch and
# CUDA libraries are never part of the closure: none of these packages depends on them.
set -euo pipefail
DEST=${1:-wheelhouse-gpu}
mkdir -p "$DEST"
PACKAGES=(
  "fastapi>=0.115" "uvicorn>=0.30" "pydantic>=2.7" "prometheus-client>=0.20" "httpx>=0.27"
  "gguf>=0.17" "pyyaml>=6.0" "safetensors>=0.4"
  "pytest>=8.0" "pytest-timeout>=2.3"
)
python -m pip download --dest "$DEST" --python-version 3.12 --implementation cp --abi cp312 \
  --only-binary=:all: --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux_2_28_x86_64 --platform linux_x86_64 "${PACKAGES[@]}"
# The closure again, resolved from the folder alone (no index) for Python 3.12: proves the
# device's offline install will find every wheel it needs.
CHECK=$(mktemp -d)
python -m pip download --quiet --no-index --find-links "$DEST" --dest "$CHECK" --python-version 3.12 \
  --implementation cp --abi cp312 --only-binary=:all: --platform manylinux2014_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 --platform linux_x86_64 "${PACKAGES[@]}"
echo "offline closure for cp312: $(ls "$CHECK" | wc -l) wheels resolve from $DEST"
rm -rf "$CHECK"
if ls "$DEST" | grep -Eiq '^(torch|nvidia_|triton)'; then
  echo "error: a torch/CUDA/triton wheel entered $DEST" >&2
  exit 1
fi
du -sh "$DEST"
