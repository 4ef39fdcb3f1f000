#!/usr/bin/env bash
# The kernels, the DPO step and the trainer's start-up on one lent TPU chip (results:
# docs/results/tpu_v5e.md).
#
#   OUT=DIR bash benchmarks/on_chip.sh     # on the chip
#
# PARTS picks what runs (default "logprobs attention step"; also "chipopen", the time to
# open the chip under CHIPOPEN_ENVS, "quickstart", the shipped
# command as written, "recovery", benchmarks/restart.py on the quickstart: killed at step
# 120, restarted with and without the compilation cache (RECOVERY_ARGS: more trainer flags,
# e.g. --model=125m), and "aotcache", the quickstart
# with the cache that `--compile_only --target_topology=v5e-1` filled on a CPU host, carried
# as .aot_cache/). The kernels' parts check the default tiles against float64 NumPy on
# the host too (`on_chip.py --oracle`). Narrowing: LOGPROBS_ARGS (extra arguments of
# on_chip.py logprobs, e.g. --heads), LOGPROBS_LIMIT, ATTENTION_LIMIT, STEP_CASES ("model tokens [flags]" separated by ';'),
# STEP_LIMIT (seconds per run), STEP_RUNS ("restart": only a restart on the caches an
# earlier call on the same, still warm, machine filled). Each step case runs twice with
# its own compilation cache: cold (empty) and a restart by the same command, each timing
# process start to the end of step 1 by its own clock.
#
# "variants": the attention part again for the kernels of each earlier commit that
# benchmarks/kernel_variants.sh put under .kernel-variants/ (carried), into
# $OUT/kernels_REV.jsonl: before and after in one call.
#
# "tune": benchmarks/tune_tiles.py for TUNE_OPS (default "attention logprobs"), its
# arguments in TUNE_ATTENTION_ARGS / TUNE_LOGPROBS_ARGS (e.g. --merge --seq_lens 8192),
# TUNE_LIMIT seconds each; the tables land in the package copy under /tmp/site that the
# later parts import (the carried tree is read-only) and in $OUT as tuned_OP_CHIP.json.
#
# "matmul": what the chip sustains on bf16 products of the step's shapes. "profile": the
# step's time per part (benchmarks/step_profile.py) for PROFILE_CASES (default STEP_CASES),
# with the step part's compilation caches.
#
# "online": online DPO's step (benchmarks/online_step.py; ONLINE_ARGS, ONLINE_LIMIT): K=4
# samples of 256 new ids for 8 prompts with SmolLM2-135M's shapes, then the DPO step.
#
# "recipe": configs/smollm2_dpo.flags end to end from the real GGUF (RECIPE_GGUF), below.
#
# "tunix": Tunix 0.1.7's DPOTrainer step (benchmarks/peer_tunix.py) on the same pairs and
# sizes, appended to the step part's $OUT/step.jsonl so that one `gpu.py table` (printed,
# and written to $OUT/step_table.md) sets both side by side. TUNIX_CASES ("model tokens
# [flags]" separated by ';'; default the four cases of issue 55's table: bf16 params, block
# remat where no remat does not fit), TUNIX_LIMIT (seconds per case; Tunix's first step
# compiles for 85-122 s). Each case keeps its own compilation cache in /tmp/compile-cache,
# not emptied: a second call on the same machine loads Tunix's step from it.
#
# The chip's machine has JAX and libtpu but not our run-time dependencies: the wheels of
# ../shared/offline-tpu/wheels.txt carried in .whl-tpu/ (with wheels.txt) install with
# the machine's own index into /tmp/site, after the machine's own JAX on the path; our two
# packages join them by their import names. Each part appends to $OUT as soon as it has a
# result, so a cut-off run returns what it measured.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/tunix-chip}"
PARTS="${PARTS:-logprobs attention step}"  # and "tunix" (above)
site=/tmp/site
mkdir -p "$OUT" "$site"
if [[ -f .whl-tpu/wheels.txt ]]; then
  PIP_CONFIG_FILE=/dev/null python3 -m pip install --isolated -q --no-deps --no-compile \
      --no-cache-dir --upgrade --target "$site" --index-url file:///opt/pypi/simple \
      --find-links .whl-tpu -r .whl-tpu/wheels.txt tensorstore pandas pyarrow sentencepiece \
      pillow \
      > "$OUT/setup.log" 2>&1 || echo "wheel install failed: $OUT/setup.log"
fi
# A copy, not a link: the tuner writes its tables into it (the carried tree is read-only).
rm -rf "$site/tunix_kernels" && cp -r "$PWD/kernels" "$site/tunix_kernels"
ln -sfn "$PWD/tunix_core" "$site/tunix_core"
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$site" PYTHONUNBUFFERED=1
export XLA_PYTHON_CLIENT_PREALLOCATE=false
has() { [[ " $PARTS " == *" $1 "* ]]; }
start=$SECONDS
part() {  # part NAME LIMIT CMD...: one process, its output into $OUT/NAME.txt
  local name=$1 limit=$2; shift 2
  local seen; seen=$(stat -c %s "$OUT/$name.txt" 2>/dev/null || echo 0)
  echo "== $name ($(( SECONDS - start )) s in)"
  timeout "$limit" "$@" >> "$OUT/$name.txt" 2>&1 || echo "   $name: status $? ($OUT/$name.txt)"
  # What this call added (the step's cases share one file), without the log's warnings.
  tail -c +$(( seen + 1 )) "$OUT/$name.txt" | grep -v "^WARNING\|Finished \|cache hit for" \
      | tail -n 40
}
if has tune; then  # tiles measured on this chip (benchmarks/tune_tiles.py), per TUNE_OPS:
  # each table written into the package copy the later parts import, and into $OUT
  for op in ${TUNE_OPS:-attention logprobs}; do
    args_var="TUNE_${op^^}_ARGS"
    part tune "${TUNE_LIMIT:-400}" python3 benchmarks/tune_tiles.py "$op" ${!args_var:-}
    for f in "$site/tunix_kernels/$op/tuned/"*.json; do
      [[ -f $f ]] && cp "$f" "$OUT/tuned_${op}_$(basename "$f")"
    done
  done
fi
has logprobs && part logprobs "${LOGPROBS_LIMIT:-330}" python3 benchmarks/on_chip.py logprobs \
    --oracle ${LOGPROBS_ARGS:-} --out "$OUT/kernels.jsonl"
has attention && part attention "${ATTENTION_LIMIT:-200}" python3 benchmarks/on_chip.py \
    attention --oracle --head_dims "${HEAD_DIMS:-64,128}" --out "$OUT/kernels.jsonl"
if has variants; then  # the same attention cases on earlier commits' kernels
  for dir in .kernel-variants/*/; do
    rev=$(basename "$dir")
    part variants 150 env PYTHONPATH="$PWD/$dir:$PYTHONPATH" python3 benchmarks/on_chip.py \
        attention --head_dims "${HEAD_DIMS:-64,128}" --out "$OUT/kernels_$rev.jsonl"
  done
fi
if has chipopen; then  # seconds to import jax and open the chip, under CHIPOPEN_ENVS
  # (';'-separated environments, each run twice back to back; "-" is none) and after an
  # idle pause; libtpu's own log lines on the way, and the kernel's huge-page settings.
  grep . /sys/kernel/mm/transparent_hugepage/{enabled,defrag} >> "$OUT/chipopen.txt" 2>&1
  IFS=';' read -ra envs <<< "${CHIPOPEN_ENVS:--;TPU_SKIP_MDS_QUERY=1;-;sleep}"
  for e in "${envs[@]}"; do
    [[ $e == sleep ]] && { sleep 20; e=-; }
    for run in 1 2; do
      rm -rf /tmp/tpu_logs
      part chipopen 60 env ${e/#-/} python3 -c "
import time; t0 = time.perf_counter(); import jax; t1 = time.perf_counter()
jax.devices(); t2 = time.perf_counter()
print('env ${e}: import jax %.2f s, open the chip %.2f s' % (t1 - t0, t2 - t1))"
      # libtpu's log: its first lines and what it says about metadata, memory and timing.
      grep -h -i -m 40 "metadata\|mds\|pin\|premap\|huge\|initializ\|took\|elapsed" \
          /tmp/tpu_logs/*INFO* 2>/dev/null | cut -c 1-220 >> "$OUT/chipopen_log.txt"
      echo "-- env $e run $run" >> "$OUT/chipopen_log.txt"
    done
  done
fi
has quickstart && part quickstart 240 python3 trainer.py --flagfile=configs/quickstart.flags
has recovery && rm -rf /tmp/recovery && part recovery 240 python3 benchmarks/restart.py --uncached \
    --out "$OUT/restart.jsonl" -- python3 trainer.py --flagfile=configs/quickstart.flags \
    --output_dir=/tmp/recovery --log_every=1 --eval_every=0 ${RECOVERY_ARGS:-}
if has aotcache; then
  rm -rf /tmp/aot_cache && cp -r .aot_cache /tmp/aot_cache
  part aotcache 120 python3 trainer.py --flagfile=configs/quickstart.flags \
      --output_dir=/tmp/aotrun --steps=3 --compilation_cache_dir=/tmp/aot_cache
fi
if has step; then
  IFS=';' read -ra cases <<< "${STEP_CASES:-smollm2-135m 1024;smollm2-135m 2048 --remat=full}"
  for case in "${cases[@]}"; do
    read -r model tokens flags <<< "$case"
    cache="/tmp/compile-cache/$model-$tokens${flags// /}"
    [[ "${STEP_RUNS:-cold restart}" == cold* ]] && rm -rf "$cache"
    for run in ${STEP_RUNS:-cold restart}; do
      part step "${STEP_LIMIT:-300}" python3 benchmarks/gpu.py ours --model "$model" \
          --tokens "$tokens" --pairs 8 --steps 6 --warmup 2 --cache_dir "$cache" \
          --out "$OUT/step.jsonl" ${flags:-}  # last: a case's own --pairs wins
    done
  done
  python3 benchmarks/gpu.py table "$OUT/step.jsonl" > "$OUT/step_table.md" 2>> "$OUT/step.txt"
  cat "$OUT/step_table.md"
fi
if has tunix; then  # Tunix's DPO step on the step part's cases, rows in the same file
  tunix_cases="smollm2-135m 1024;smollm2-360m 1024 --remat=block"
  tunix_cases+=";smollm2-135m 2048 --remat=block;qwen2.5-0.5b 1024 --remat=block"
  IFS=';' read -ra cases <<< "${TUNIX_CASES:-$tunix_cases}"
  for case in "${cases[@]}"; do
    read -r model tokens flags <<< "$case"
    part tunix "${TUNIX_LIMIT:-300}" python3 benchmarks/peer_tunix.py --model "$model" \
        --tokens "$tokens" --pairs 8 --steps 6 --warmup 2 \
        --cache_dir "/tmp/compile-cache/tunix-$model-$tokens${flags// /}" --out "$OUT/step.jsonl" \
        ${flags:-}
  done
  python3 benchmarks/gpu.py table "$OUT/step.jsonl" > "$OUT/step_table.md" 2>> "$OUT/tunix.txt"
  cat "$OUT/step_table.md"
fi
if has matmul; then  # what the chip sustains on the step's matmul shapes
  part matmul 120 python3 benchmarks/on_chip.py matmul --out "$OUT/kernels.jsonl"
fi
if has profile; then  # the step's time per part (benchmarks/step_profile.py), per case
  IFS=';' read -ra cases <<< "${PROFILE_CASES:-${STEP_CASES:-smollm2-135m 1024}}"
  for case in "${cases[@]}"; do
    read -r model tokens flags <<< "$case"
    part profile "${STEP_LIMIT:-300}" python3 benchmarks/step_profile.py --model "$model" \
        --tokens "$tokens" ${flags:-} --cache_dir "/tmp/compile-cache/$model-$tokens${flags// /}" \
        --trace_dir "/tmp/profile/$model-$tokens${flags// /}" --out "$OUT/profile.jsonl"
  done
fi
if has online; then  # online DPO's step: sampling and the train step (benchmarks/online_step.py)
  part online "${ONLINE_LIMIT:-420}" env JAX_COMPILATION_CACHE_DIR=/tmp/compile-cache/online \
      python3 benchmarks/online_step.py ${ONLINE_ARGS:---model smollm2-135m --new_tokens 256 \
      --samples 4 --prompts 8} --out "$OUT/online.jsonl"
fi
if has recipe; then  # configs/smollm2_dpo.flags on the chip, end to end, from the real
  # GGUF at RECIPE_GGUF (94 MiB: more than a call carries, so earlier calls on the same
  # warm machine leave its pieces in /tmp): converted, trained (evaluated, sampled,
  # exported), then the export's greedy answer. .whl-recipe/ carries gguf, tokenizers and
  # jinja2's wheels. RECIPE_ARGS: more trainer flags.
  PIP_CONFIG_FILE=/dev/null python3 -m pip install --isolated -q --no-deps --no-compile \
      --no-cache-dir --target "$site" .whl-recipe/*.whl >> "$OUT/setup.log" 2>&1
  run=/tmp/recipe-run
  part recipe 180 python3 -m tunix_core.hf from_gguf --gguf="$RECIPE_GGUF" \
      --out=/tmp/smollm2-135m-instruct
  part recipe "${RECIPE_LIMIT:-420}" python3 trainer.py --flagfile=configs/smollm2_dpo.flags \
      --output_dir=$run --export_hf_dir=$run/hf ${RECIPE_ARGS:-}
  cp $run/metrics.jsonl "$OUT/recipe_metrics.jsonl"; cp $run/samples.jsonl "$OUT/recipe_samples.jsonl"
  part recipe 180 python3 -m tunix_core.generate --hf_model_dir=$run/hf \
      --prompt="What is the capital of France?" --max_new_tokens=24
fi
echo "done in $(( SECONDS - start )) s"
