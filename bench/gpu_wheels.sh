#!/usr/bin/env bash
# Download into .whl/ the wheels bench/gpu_check.py needs on the GPU machine and its image lacks
# (Python 3.12, x86-64 manylinux, no network there; torch, transformers, accelerate, peft,
# safetensors, tokenizers, pyarrow, pandas, pyyaml, numpy, fsspec, xxhash, huggingface-hub,
# aiohttp, requests are in the image). asrforge itself travels as source (PYTHONPATH=.).
#
# The list is what a --device cpu --quick run imports, less what the image has. datasets is
# 5.0.0, not the newest: it is the last that accepts the image's huggingface-hub 1.x and a
# pyarrow older than 24 (5.1 wants pyarrow >= 24). pydantic-core is pinned by pydantic.
# transformers travels too, at the version the suite runs, so the GPU runs the decoders CI tested
# (the image's is older); whisper-normalizer ships the English spelling map the scorer reads.
#
# Run from anywhere:  bench/gpu_wheels.sh      (PY=python3 by default; needs pip and the network)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
WHEELS=(
  datasets==5.0.0 dill==0.4.1 multiprocess==0.70.19
  pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
  typing-extensions==4.16.0
  soundfile==0.14.0 cffi==2.1.1 pycparser==3.12
  rapidfuzz==3.14.6
  whisper-normalizer==0.1.15
  transformers==5.24.0
)
rm -rf .whl
mkdir .whl
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
  -d .whl "${WHEELS[@]}"
n=$(ls .whl/*.whl | wc -l)
kib=$(du -sk .whl | cut -f1)
echo "$n wheels, $((kib / 1024)) MiB in .whl/"
if [ "$n" -ne "${#WHEELS[@]}" ]; then
  echo "expected ${#WHEELS[@]} wheels" >&2
  exit 1
fi
if [ "$kib" -ge $((50 * 1024)) ]; then
  echo "over 50 MiB: the device call carries at most 64 MiB with the tree" >&2
  exit 1
fi
