#!/usr/bin/env bash
# The kernels and the DPO step on one lent TPU chip (results: docs/results/tpu_v5e.md).
#
#   OUT=DIR bash benchmarks/on_chip.sh     # on the chip: about 9 minutes
#
# Parts can be skipped or narrowed for a rerun: LOGPROBS_ARGS (extra arguments of
# on_chip.py logprobs, e.g. --heads), LOGPROBS_LIMIT, SKIP_ATTENTION=1, STEP_CASES
# ("model tokens [flags]" separated by ';'), STEP_LIMIT (seconds per case; a case's
# first step compiles for about 90 s on a v5e).
#
# The chip's machine has JAX and libtpu but not our run-time dependencies: wheels carried
# in .whl-tpu/ (optax, chex, absl-py, etils, toolz) go into /tmp/site, after the
# machine's own JAX on the path; our two packages join them by their import names. Each
# part appends to $OUT as soon as it has a result, so a cut-off run returns what it
# measured: log-prob kernels (benchmarks/on_chip.py), attention, then our DPO step
# (benchmarks/gpu.py ours, SmolLM2's shapes as the GPU script runs them; 2,048 tokens
# needs --remat=full to fit 16 GiB).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/tunix-chip}"
site=/tmp/site
mkdir -p "$OUT" "$site"
shopt -s nullglob
wheels=(.whl-tpu/*.whl)
if (( ${#wheels[@]} )); then
  PIP_CONFIG_FILE=/dev/null python3 -m pip install --isolated -q --no-index --no-deps \
      --no-compile --no-cache-dir --upgrade --target "$site" "${wheels[@]}" \
      > "$OUT/setup.log" 2>&1 || echo "wheel install failed: $OUT/setup.log"
fi
ln -sfn "$PWD/kernels" "$site/tunix_kernels"
ln -sfn "$PWD/tunix_core" "$site/tunix_core"
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$site" PYTHONUNBUFFERED=1
export XLA_PYTHON_CLIENT_PREALLOCATE=false
start=$SECONDS
part() {  # part NAME LIMIT CMD...: one process, its output into $OUT/NAME.txt
  local name=$1 limit=$2; shift 2
  local seen; seen=$(stat -c %s "$OUT/$name.txt" 2>/dev/null || echo 0)
  echo "== $name ($(( SECONDS - start )) s in)"
  timeout "$limit" "$@" >> "$OUT/$name.txt" 2>&1 || echo "   $name: status $? ($OUT/$name.txt)"
  # What this call added (the step's cases share one file), without the log's warnings.
  tail -c +$(( seen + 1 )) "$OUT/$name.txt" | grep -v "^WARNING" | tail -n 40
}
part logprobs "${LOGPROBS_LIMIT:-270}" python3 benchmarks/on_chip.py logprobs ${LOGPROBS_ARGS:-} --out "$OUT/kernels.jsonl"
[[ -n "${SKIP_ATTENTION:-}" ]] || part attention 90 python3 benchmarks/on_chip.py attention --out "$OUT/kernels.jsonl"
IFS=';' read -ra cases <<< "${STEP_CASES:-smollm2-135m 1024;smollm2-135m 2048 --remat=full}"
for case in "${cases[@]}"; do
  read -r model tokens flags <<< "$case"
  part step "${STEP_LIMIT:-150}" python3 benchmarks/gpu.py ours --model "$model" --tokens "$tokens" \
      ${flags:-} --pairs 8 --steps 6 --warmup 2 --out "$OUT/step.jsonl"
done
python3 benchmarks/gpu.py table "$OUT/step.jsonl" > "$OUT/step_table.md" 2>> "$OUT/step.txt"
cat "$OUT/step_table.md"
echo "done in $(( SECONDS - start )) s"
