#!/usr/bin/env bash
# Fetches, on a host with PyPI, the wheels benchmarks/gpu.sh installs on the GPU machine
# (Python 3.12, x86_64; it already holds torch, transformers, peft, tokenizers, jinja2,
# psutil, fsspec and huggingface-hub). Two folders, each under the device tool's 64 MiB
# per call with the working tree: .gpu_wheels/1 (pyarrow alone, ~53 MiB) is carried by
# a first call that only installs it (`bash benchmarks/gpu.sh --stage`), .gpu_wheels/2
# (the rest, ~15 MiB) by the measuring call; .gpu_site/ stays on the machine between them.
set -euo pipefail
cd "$(dirname "$0")/.."
get() {
  mkdir -p "$1"; local dir=$1; shift
  pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
      --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 --dest "$dir" "$@"
}
get .gpu_wheels/1 'pyarrow>=24'
get .gpu_wheels/2 'trl==1.16.*' 'datasets>=4.7' 'dill<0.4.2,>=0.3' 'multiprocess<0.70.20' \
    xxhash pandas python-dateutil six accelerate liger-kernel
du -sh .gpu_wheels/*
