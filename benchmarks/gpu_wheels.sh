#!/usr/bin/env bash
# Fetches, on a host with PyPI, the wheels benchmarks/gpu.sh installs on the GPU machine
# (Python 3.12, x86_64). The machine's image already holds torch, transformers, peft,
# tokenizers, jinja2, psutil, fsspec, huggingface-hub, accelerate, pandas, xxhash and
# python-dateutil; its pyarrow's version is unknown and datasets needs >= 24, so pyarrow
# travels (~53 MiB). All of .gpu_wheels/ (~56 MiB) goes in one device call with the
# working tree, under the tool's 64 MiB.
set -euo pipefail
cd "$(dirname "$0")/.."
pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
    --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 --dest .gpu_wheels \
    'pyarrow>=24' 'trl==1.16.*' 'datasets>=4.7' 'dill<0.4.2,>=0.3' 'multiprocess<0.70.20' \
    liger-kernel
du -sh .gpu_wheels
