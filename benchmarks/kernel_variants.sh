#!/usr/bin/env bash
# The kernels of earlier commits, for `PARTS=variants` of benchmarks/on_chip.sh to time
# beside the tree's own in one call on a chip (the chip's checkout may lack the commits):
#
#   bash benchmarks/kernel_variants.sh be180ca cb6ffcd     # here, before the call
#
# writes .kernel-variants/REV/tunix_kernels (git-ignored: carry it with the wheels,
# carry [".whl-tpu", ".kernel-variants"]); an earlier variant of the same name is replaced.
set -euo pipefail
cd "$(dirname "$0")/.."
for rev in "$@"; do
  dir=.kernel-variants/$(git rev-parse --short "$rev")
  rm -rf "$dir" && mkdir -p "$dir"
  git archive "$rev" kernels | tar -x -C "$dir"
  mv "$dir/kernels" "$dir/tunix_kernels"
  echo "$dir"
done
