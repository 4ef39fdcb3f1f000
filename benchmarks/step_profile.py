"""Where the DPO step's time goes on a chip: a profile of the real step, per part.

    python benchmarks/step_profile.py --model smollm2-360m --remat=full [--out r.jsonl]
    python benchmarks/step_profile.py --model tiny --tokens 64 --pairs 2   # CPU dry run

The step is `benchmarks/gpu.py ours`'s (the trainer's step on `synthetic_pairs`, random
weights of the model's shapes). After `--warmup` steps, `--steps` more are timed by the
wall clock, then `--steps` more run under `jax.profiler`. Each device op of the profile
is attributed through the compiled HLO to the `jax.named_scope` its operation was traced
under (the model's `embedding`, `attention`, `mlp`, `norm`, the objective's `lm_head`
(the fused log-probs) and `loss`, the layer scan's own slicing and residuals
(`layers`), the step's `reference`, `grad_sync` and `optimizer` (with the non-finite
guard, fused into the update); the first of `PARTS` wins, so the reference forward is one part),
forward or backward
(an op under `transpose(...)` is the backward; a rematerialised forward counts as
forward), and summed per step. Control flow (`while`, `call`, `conditional`) is left
out: the ops of its body are counted themselves. The table's last rows set the ops'
total beside the step's wall time: what is left is the device idle or the host.
"""

import argparse
import collections
import glob
import os
import re
import statistics
import sys
import tempfile
import time

import gpu  # benchmarks/gpu.py: the models, the pairs, our step's plan

# Outermost first: an op under several of these scopes belongs to the first.
PARTS = ("reference", "grad_sync", "optimizer", "loss", "lm_head", "attention",
         "mlp", "norm", "embedding", "layers")
_CONTROL = {"while", "call", "conditional", "tuple", "get-tuple-element", "parameter",
            "constant", "bitcast"}
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+) = (.*)$")
_OPCODE = re.compile(r"(?:^|[\s}\])])([a-z][a-z0-9\-]*)\(")
_OP_NAME = re.compile(r'op_name="([^"]*)"')


def hlo_ops(hlo_text: str) -> dict:
  """`{instruction name: (opcode, op_name, shape)}` of every instruction of an HLO
  module's text (every computation: fusion bodies and loop bodies included)."""
  ops = {}
  for line in hlo_text.splitlines():
    m = _INSTRUCTION.match(line)
    if not m:
      continue
    rest = m.group(2)
    opcode = _OPCODE.search(rest.split(", metadata=")[0])
    op_name = _OP_NAME.search(rest)
    ops[m.group(1)] = (opcode.group(1) if opcode else "?", op_name.group(1) if op_name else "",
                       rest.split("{")[0].split(" ")[0][:80])
  return ops


def part_of(op_name: str) -> tuple[str, str]:
  """`(part, "forward" | "backward")` of an op traced under `op_name` (module docstring)."""
  for part in PARTS:
    # A scope is a path segment, maybe inside a transform's "jvp(...)"; "jit(name)" is a
    # function's name, not a scope.
    if re.search(rf"(^|/|(?<!jit)\(){part}($|[/)])", op_name):
      break
  else:
    part = "other"
  backward = "transpose(" in op_name and part != "reference"
  return part, "backward" if backward else "forward"


def op_times(trace_dir: str, ops: dict) -> tuple[collections.Counter, int, collections.Counter]:
  """Summed device time in seconds per `(part, direction)` of the step's ops in the
  newest profile under `trace_dir`, how many device ops were counted, and the seconds
  per HLO instruction (what `--top` lists)."""
  from jax.profiler import ProfileData  # pylint: disable=g-import-not-at-top
  path = max(glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True),
             key=os.path.getmtime)
  data = ProfileData.from_file(path)
  tpu = [p for p in data.planes  # a chip's ops: its plane's "XLA Ops" line
         if p.name.startswith("/device:") and any(l.name == "XLA Ops" for l in p.lines)]
  totals, count, per_op = collections.Counter(), 0, collections.Counter()
  for plane in tpu or [p for p in data.planes if p.name == "/host:CPU"]:
    for line in plane.lines:
      if tpu and line.name != "XLA Ops":  # a chip's other lines repeat these ops
        continue
      for event in line.events:
        # A chip names each op by its HLO text ("%fusion.3 = f32[..] fusion(..)").
        name = dict(event.stats).get("hlo_op", event.name.split(" = ")[0].lstrip("%"))
        if name not in ops or ops[name][0] in _CONTROL:
          continue
        totals[part_of(ops[name][1])] += event.duration_ns * 1e-9
        per_op[name] += event.duration_ns * 1e-9
        count += 1
  if not count:  # a profile laid out otherwise: say what it holds
    for plane in data.planes:
      print(f"profile plane {plane.name}: " + ", ".join(
          f"{line.name} ({[e.name for e in list(line.events)[:3]]})" for line in plane.lines),
            file=sys.stderr)
  return totals, count, per_op


def table(result: dict) -> str:
  """The profile's per-part milliseconds per step as Markdown."""
  step_ms, parts = 1e3 * result["step_s"], result["parts_ms"]
  lines = [f"{result['model']}, {result['tokens']} tokens, {result['pairs']} pairs, "
           f"{result['plan']}", "", "| part | forward (ms) | backward (ms) | share of step |",
           "|---|---|---|---|"]
  for part in PARTS + ("other",):
    fwd, bwd = parts.get(f"{part}/forward", 0.0), parts.get(f"{part}/backward", 0.0)
    if fwd or bwd:
      lines.append(f"| {part} | {fwd:.2f} | {bwd:.2f} | {(fwd + bwd) / step_ms:.1%} |")
  ops_ms = sum(parts.values())
  lines += [f"| device ops, all | {ops_ms:.2f} | | {ops_ms / step_ms:.1%} |",
            f"| step (wall, median) | {step_ms:.2f} | | 100% |"]
  return "\n".join(lines) + "\n"


def main() -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--model", choices=sorted(gpu.MODELS), default="smollm2-135m")
  p.add_argument("--tokens", type=int, default=1024)
  p.add_argument("--pairs", type=int, default=8)
  p.add_argument("--steps", type=int, default=5, help="timed, then profiled, steps")
  p.add_argument("--warmup", type=int, default=2)
  p.add_argument("--reference", default="step")
  p.add_argument("--remat", default="none")
  p.add_argument("--cache_dir", help="the trainer's --compilation_cache_dir")
  p.add_argument("--trace_dir", help="where the profile goes (default: a new temp dir)")
  p.add_argument("--out", help="JSONL the result appends to")
  p.add_argument("--top", type=int, default=30, help="list this many of the slowest HLO "
                 "instructions (ms per step, opcode, the scope they were traced under)")
  a = p.parse_args()

  import jax  # pylint: disable=g-import-not-at-top
  from tunix_core.run import compile_cache  # pylint: disable=g-import-not-at-top
  from tunix_core.run import loop as train_lib  # pylint: disable=g-import-not-at-top
  from tunix_core.training import step as step_lib  # pylint: disable=g-import-not-at-top
  if a.cache_dir is not None:
    compile_cache.enable(a.cache_dir, "", lambda line: print(line, file=sys.stderr))
  config = gpu.MODELS[a.model]
  pairs = gpu.synthetic_pairs(a.pairs, a.tokens, config["vocab_size"])
  devices = jax.devices()[:1]
  plan, host, _ = gpu.ours_plan(a, config, pairs, devices)
  steps = step_lib.make_steps(plan, devices)
  hlo = steps.train_step.lower(*steps.abstract_inputs()).compile().as_text()
  ops = hlo_ops(hlo)
  if a.out:  # beside the results: the compiled step, to read the listed ops in
    with open(os.path.join(os.path.dirname(os.path.abspath(a.out)),
                           f"hlo-{a.model}-{a.tokens}.txt"), "w") as f:
      f.write(hlo)
  state = steps.init_state(jax.random.PRNGKey(0))
  frozen = (train_lib.frozen_copy(state["params"], plan.ref_dtype)
            if plan.reference == "step" else None)
  batch = steps.put_batch(host)

  def run(n):
    nonlocal state
    ends = [time.perf_counter()]
    for _ in range(n):
      state, metrics = steps.train_step(state, frozen, batch)
      jax.block_until_ready(metrics)
      ends.append(time.perf_counter())
    return [b - e for e, b in zip(ends, ends[1:])]

  run(a.warmup)
  step_s = statistics.median(run(a.steps))
  trace_dir = a.trace_dir or tempfile.mkdtemp(prefix="step-profile-")
  with jax.profiler.trace(trace_dir):
    run(a.steps)
  totals, count, per_op = op_times(trace_dir, ops)
  result = dict(model=a.model, tokens=a.tokens, pairs=a.pairs, plan=plan.describe(),
                device=devices[0].device_kind, step_s=step_s, device_ops=count // a.steps,
                parts_ms={f"{part}/{way}": round(1e3 * s / a.steps, 3)
                          for (part, way), s in sorted(totals.items())},
                framework=f"jax {jax.__version__}", trace_dir=trace_dir,
                top_ops=[(round(1e3 * s / a.steps, 3), name, *ops[name])
                         for name, s in per_op.most_common(a.top)])
  print(table(result))
  for ms, name, opcode, op_name, shape in result["top_ops"]:
    print(f"{ms:9.3f} ms  {name}  {opcode} {shape}  {op_name}")
  if a.out:
    gpu._append(a.out, result)  # pylint: disable=protected-access  (gpu.py's own rows)
  return 0


if __name__ == "__main__":
  sys.exit(main())
