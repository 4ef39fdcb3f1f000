#!/usr/bin/env bash
# Our DPO step against TRL's DPOTrainer on a lent GPU, each case in its own process
# (benchmarks/gpu.py; how to run it: docs/results/gpu.md).
#
#   OUT=DIR bash benchmarks/gpu.sh            # the GPU run: at most ~5 minutes
#   OUT=DIR bash benchmarks/gpu.sh --dry_run  # tiny shapes on CPU (tests/test_gpu_bench.py)
#
# Every case appends its row to $OUT/results.jsonl as soon as it is measured, and
# $OUT/table.md is rewritten after each case, so a run cut off still returns what it
# measured. Wheels carried in .gpu_wheels/ (benchmarks/gpu_wheels.sh fetches them: trl,
# datasets and what they need, liger-kernel) are installed into .gpu_site/site-packages,
# which also holds our two packages by their import names (symlinks): the repository
# root is never on the path, where its kernels/ folder would shadow HF's `kernels`
# package. The folder's name matters: datasets fingerprints with dill, which pickles a
# module by value (pyarrow's fails) unless its path is under sys.prefix or holds
# "site-packages" (seen on the H200 on 2026-12-04). PYTHON runs our side, TRL_PYTHON
# (default: PYTHON) TRL's.
set -uo pipefail
cd "$(dirname "$0")/.."
mode="${1:-run}"
OUT="${OUT:-/tmp/tunix-gpu}"
PYTHON="${PYTHON:-python3}"
TRL_PYTHON="${TRL_PYTHON:-$PYTHON}"
site="$PWD/.gpu_site/site-packages"
mkdir -p "$OUT" "$site"
ln -sfn "$PWD/kernels" "$site/tunix_kernels"
ln -sfn "$PWD/tunix_core" "$site/tunix_core"
shopt -s nullglob
wheels=(.gpu_wheels/*.whl)
if (( ${#wheels[@]} )); then
  "$TRL_PYTHON" -m pip install --quiet --no-deps --no-index --upgrade --target "$site" \
      "${wheels[@]}" >> "$OUT/setup.log" 2>&1 || echo "wheel install failed: $OUT/setup.log"
fi
export PYTHONPATH="$site" XLA_PYTHON_CLIENT_PREALLOCATE=false TOKENIZERS_PARALLELISM=false

if [[ "$mode" == "--dry_run" ]]; then
  export JAX_PLATFORMS=cpu
  cases=("tiny 64 --remat=full") common=(--pairs 2 --steps 2 --warmup 1)
  deadline=600 limit=300 long=()
else
  # "model tokens [flags of ours]", most telling first: a cut-off run keeps the small
  # model at the shorter length. Where the default (no remat) does not fit the device
  # (compiled on CPU: 135 GiB for Llama-3.2-1B at 2,048), ours rematerialises, as TRL's
  # default gradient checkpointing does. Rows of 4,096 and 8,192 tokens per pair run
  # ours and plain TRL only.
  cases=("smollm2-135m 1024" "llama3.2-1b 2048 --remat=full" "smollm2-135m 4096 --remat=full"
         "smollm2-135m 8192 --remat=full" "smollm2-135m 2048" "llama3.2-1b 1024")
  common=(--pairs 8 --steps 6 --warmup 2) deadline=210 limit=120 long=(4096 8192)
fi
sides=(ours)
if "$TRL_PYTHON" -c "import torch, trl, datasets" 2>/dev/null; then
  sides+=(trl)
  "$TRL_PYTHON" -c "import torch, liger_kernel; assert torch.cuda.is_available()" \
      2>/dev/null && sides+=(trl+liger) || echo "TRL with Liger skipped: no liger_kernel or no GPU"
else
  echo "TRL side skipped: torch, trl or datasets not importable by $TRL_PYTHON"
fi
"$PYTHON" -c "import jax; print('ours on', jax.devices()[0].device_kind)"
"$TRL_PYTHON" -c "import torch; print('torch', torch.__version__, 'cuda' if torch.cuda.is_available() else 'cpu')" 2>/dev/null

start=$SECONDS
for case in "${cases[@]}"; do
  read -r model tokens flags <<< "$case"
  for side in "${sides[@]}"; do
    [[ "$side" == trl+liger && " ${long[*]} " == *" $tokens "* ]] && continue
    if (( SECONDS - start > deadline )); then
      echo "deadline: $model $tokens $side not run"; continue
    fi
    args=(--model "$model" --tokens "$tokens" "${common[@]}" --out "$OUT/results.jsonl")
    case "$side" in
      ours) cmd=("$PYTHON" benchmarks/gpu.py ours ${flags:-} "${args[@]}") ;;
      trl) cmd=("$TRL_PYTHON" benchmarks/gpu.py trl "${args[@]}") ;;
      trl+liger) cmd=("$TRL_PYTHON" benchmarks/gpu.py trl --liger "${args[@]}") ;;
    esac
    echo "== $model $tokens $side ($(( SECONDS - start )) s in)"
    timeout "$limit" "${cmd[@]}" >> "$OUT/log.txt" 2>&1
    status=$?
    if (( status == 124 )); then   # killed: the case wrote no row of its own
      printf '{"model": "%s", "tokens": %s, "pairs": %s, "side": "%s", "error": "timed out after %s s"}\n' \
          "$model" "$tokens" "${common[1]}" "$side" "$limit" >> "$OUT/results.jsonl"
    fi
    (( status )) && echo "   failed (status $status): see $OUT/log.txt"
    "$PYTHON" benchmarks/gpu.py table "$OUT/results.jsonl" > "$OUT/table.md" 2>> "$OUT/log.txt"
  done
done
if [[ "$mode" != "--dry_run" ]]; then
  # The attention off TPU (blockwise XLA) against the float64 oracle on this GPU, values
  # and gradients, and its compiled temporaries linear in the row (tests/test_attention.py;
  # float32 matmuls at full precision, as the oracle's 1e-5 needs).
  JAX_PLATFORMS=cuda JAX_DEFAULT_MATMUL_PRECISION=highest timeout 90 "$PYTHON" -m pytest -q \
      -p no:cacheprovider tests/test_attention.py -k "auto or t_by_t" \
      > "$OUT/attention_gpu.txt" 2>&1
  echo "attention on the GPU: $(tail -n 1 "$OUT/attention_gpu.txt")"
fi
cat "$OUT/table.md" 2>/dev/null
echo "done in $(( SECONDS - start )) s"
