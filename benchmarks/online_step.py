"""Online DPO's step on one device: sampling K completions of every prompt, scoring them,
then the DPO step on the best and worst, timed apart (medians over the steps after a
warm-up). Random weights of a model's shapes (`benchmarks/gpu.py`'s `MODELS`), prompts of
`gpu.synthetic_pairs`, a reward that rarely ties (the completion's length in words):

    python benchmarks/online_step.py --model smollm2-135m --new_tokens 256 --samples 4 \
        --prompts 8 --out results.jsonl

One JSON row: `step_s` (sampling + scoring + the train step), `sample_s`, `train_s`,
`sample_share`, the plan, the device.
"""

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpu  # pylint: disable=g-import-not-at-top,wrong-import-position


class _Prompts:
  """The prompts of `gpu.synthetic_pairs` as the sampler reads a token store's, and the
  JSONL rows (`path`, one per prompt) the reward reads."""

  def __init__(self, pairs, path: str):
    self.prompts = [np.asarray(p, np.int32) for p, _, _ in pairs]
    self.lines = np.arange(1, len(pairs) + 1)
    with open(path, "w", encoding="utf-8") as f:
      f.writelines(json.dumps({"prompt": f"prompt {i}", "chosen": "a", "rejected": "b"}) + "\n"
                   for i in self.lines)

  def runs(self, idx):
    return [(self.prompts[i], None, None) for i in idx]

  def prompt_lengths(self):
    return np.array([len(p) for p in self.prompts])

  def sizes(self, share):  # replaced by the online plan's sizes (`plan.data_sizes`)
    del share
    return None


class _Words:
  """Ids as words: enough for a reward that reads the text."""
  pad_id, eos_id, bos_id = 0, gpu.EOS, None

  def decode(self, ids):
    return " ".join(f"w{i}" for i in ids)


def main() -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--model", choices=sorted(gpu.MODELS), default="smollm2-135m")
  p.add_argument("--prompt_tokens", type=int, default=256, help="prompts of 1/4 to 1/2 of this")
  p.add_argument("--new_tokens", type=int, default=256)
  p.add_argument("--samples", type=int, default=4)
  p.add_argument("--prompts", type=int, default=8)
  p.add_argument("--steps", type=int, default=6)
  p.add_argument("--warmup", type=int, default=2)
  p.add_argument("--remat", default="none")
  p.add_argument("--temperature", type=float, default=1.0, help="0: greedy (every K tie)")
  p.add_argument("--out", default="")
  p.add_argument("--top", type=int, default=0, help="then profile one more sampling and "
                 "print its N costliest device ops (benchmarks/step_profile.py's reader)")
  a = p.parse_args()

  import jax  # pylint: disable=g-import-not-at-top
  from tunix_core.online import sampler as sampler_lib  # pylint: disable=g-import-not-at-top
  from tunix_core.run import loop  # pylint: disable=g-import-not-at-top
  from tunix_core.training import config as config_lib  # pylint: disable=g-import-not-at-top
  from tunix_core.training import plan as plan_lib  # pylint: disable=g-import-not-at-top
  from tunix_core.training import step as step_lib  # pylint: disable=g-import-not-at-top

  config = gpu.MODELS[a.model]
  pairs = gpu.synthetic_pairs(a.prompts * (a.warmup + a.steps), a.prompt_tokens,
                              config["vocab_size"])
  model_dir = tempfile.mkdtemp()
  prompts = _Prompts(pairs, os.path.join(model_dir, "prompts.jsonl"))
  with open(os.path.join(model_dir, "config.json"), "w") as f:
    json.dump(config, f)
  longest = int(prompts.prompt_lengths().max())
  cfg = config_lib.TrainConfig(
      output_dir=tempfile.mkdtemp(), train_data=os.path.join(model_dir, "prompts.jsonl"),
      compile_only=True,  # no token store: `_Prompts` serves the prompts
      hf_model_dir=model_dir, batch_size=a.prompts, max_length=longest + a.new_tokens,
      max_prompt_length=longest, remat=a.remat, online_samples=a.samples,
      reward_fn="tunix_core.online.rewards:completion_length",
      online_max_new_tokens=a.new_tokens, online_temperature=a.temperature or 1.0)
  devices = jax.devices()[:1]
  plan = plan_lib.make_plan(cfg, devices, plan_lib.data_sizes(cfg, [prompts]))
  steps = step_lib.make_steps(plan, devices)
  state = steps.init_state(jax.random.PRNGKey(0))
  frozen = loop.frozen_copy(state["params"], plan.ref_dtype)
  sampler = sampler_lib.OnlineSampler(dataclasses.replace(cfg, compile_only=False), steps,
                                      prompts, _Words(), (gpu.EOS,))
  if not a.temperature:  # the sampler's cost without drawing random numbers
    sampler.sampling = sampler.greedy
  sample_s, train_s, metrics = [], [], {}
  for step in range(1, a.warmup + a.steps + 1):
    idx = np.arange((step - 1) * a.prompts, step * a.prompts)
    t0 = time.perf_counter()
    batch, metrics = sampler(step, steps.policy_params(state["params"], frozen), idx)
    t1 = time.perf_counter()
    state, m = steps.train_step(state, frozen, steps.put_batch(batch))
    jax.block_until_ready(m)
    t2 = time.perf_counter()
    sample_s.append(t1 - t0)
    train_s.append(t2 - t1)
    print(f"step {step}: sampling {t1 - t0:.3f} s, train step {t2 - t1:.3f} s", flush=True)
  med = lambda xs: statistics.median(xs[a.warmup:])
  row = dict(case=f"online {a.model} K={a.samples} x {a.prompts} prompts, {a.new_tokens} new"
             f", temperature {a.temperature}",
             step_s=med(sample_s) + med(train_s), sample_s=med(sample_s), train_s=med(train_s),
             sample_share=med(sample_s) / (med(sample_s) + med(train_s)),
             sample_length=float(metrics["online/sample_length"]), plan=plan.describe(),
             device=devices[0].device_kind, framework=f"jax {jax.__version__}")
  if a.out:
    gpu._append(a.out, row)  # pylint: disable=protected-access
  else:
    print(json.dumps(row), flush=True)
  if a.top:
    _profile(sampler, steps.policy_params(state["params"], frozen), prompts, a)
  return 0


def _profile(sampler, params, prompts, a) -> None:
  """One more sampling under `jax.profiler`; its costliest device ops, per sampling."""
  import jax  # pylint: disable=g-import-not-at-top
  import step_profile  # pylint: disable=g-import-not-at-top
  from tunix_core import generate  # pylint: disable=g-import-not-at-top
  from tunix_core.model import generate as generate_lib  # pylint: disable=g-import-not-at-top
  ids, mask = generate.left_pad([p for p in prompts.prompts[:a.prompts]
                                 for _ in range(a.samples)], 0, sampler.prompt_len)
  run = lambda: generate_lib.generate(params, ids, mask, jax.random.PRNGKey(0),
                                      cfg=sampler.steps.mcfg, sampling=sampler.sampling)
  jax.block_until_ready(run())
  hlo = generate_lib.generate.lower(params, ids, mask, jax.random.PRNGKey(0),
                                    cfg=sampler.steps.mcfg,
                                    sampling=sampler.sampling).compile().as_text()
  trace_dir = tempfile.mkdtemp()
  with jax.profiler.trace(trace_dir):
    jax.block_until_ready(run())
  ops = step_profile.hlo_ops(hlo)
  _, count, per_op = step_profile.op_times(trace_dir, ops)
  total = sum(per_op.values())
  print(f"sampling profile: {count} device ops, {1e3 * total:.1f} ms in all", flush=True)
  for name, seconds in per_op.most_common(a.top):
    opcode, op_name, shape = ops[name]
    print(f"{1e3 * seconds:8.2f} ms  {opcode:18s} {shape:40s} {op_name[-90:]}", flush=True)


if __name__ == "__main__":
  sys.exit(main())
