"""Checkpoint cost for the `125m` preset's train state on 8 simulated CPU devices.

    python benchmarks/checkpoint.py [--preset 125m] [--repeats 3]

1. Blocked time: how long `save()` holds up the training loop with asynchronous saving
   (the arrays are copied off the devices, then written in the background) vs a
   synchronous save of the same state (median of `--repeats` each).
2. Recovery time: from starting `trainer.py --resume=required` on a checkpoint to its
   first resumed step being logged (JAX start-up, data, restore, compile, one step).
"""

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8").strip()

import argparse  # noqa: E402
import json  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402

from tunix_core.checkpoints import store as checkpoint  # noqa: E402
from tunix_core.training import config as config_lib  # noqa: E402
from tunix_core.training import plan as plan_lib  # noqa: E402
from tunix_core.training import step as step_lib  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def timed_saves(state, directory, async_save, repeats):
  ckpt = checkpoint.Checkpointer(directory, keep=1, async_save=async_save)
  blocked, total = [], []
  for step in range(1, repeats + 1):
    t0 = time.perf_counter()
    ckpt.save(step, state, {"step": step})
    blocked.append(time.perf_counter() - t0)
    ckpt.wait()
    total.append(time.perf_counter() - t0)
  ckpt.close()
  return statistics.median(blocked), statistics.median(total)


def recovery_time(preset, workdir):
  flags = [f"--output_dir={workdir}", f"--train_data={REPO}/data/train.jsonl",
           f"--model={preset}", "--batch_size=8", "--max_length=64", "--max_prompt_length=32",
           "--log_every=1"]
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  subprocess.run([sys.executable, f"{REPO}/trainer.py", *flags, "--steps=1", "--save_every=1"],
                 env=env, check=True, capture_output=True)
  t0 = time.perf_counter()
  proc = subprocess.Popen([sys.executable, f"{REPO}/trainer.py", *flags, "--steps=2",
                           "--resume=required"], env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)
  for line in proc.stdout:
    if line.startswith("step 2/2"):
      elapsed = time.perf_counter() - t0
      break
  else:
    raise RuntimeError("the resumed run never logged step 2")
  proc.wait()
  return elapsed


def main():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--preset", default="125m")
  p.add_argument("--repeats", type=int, default=3)
  args = p.parse_args()

  cfg = config_lib.TrainConfig(output_dir="/tmp/unused", model=args.preset, batch_size=8,
                               compile_only=True)  # planned for the flags' worst case
  trainer = step_lib.make_steps(plan_lib.make_plan(cfg, jax.devices()), jax.devices())
  state = trainer.init_state(jax.random.PRNGKey(0))
  state = {"params": state["params"], "opt_state": state["opt_state"]}
  nbytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state))
  workdir = tempfile.mkdtemp()
  try:
    async_blocked, async_total = timed_saves(state, f"{workdir}/async", True, args.repeats)
    sync_blocked, _ = timed_saves(state, f"{workdir}/sync", False, args.repeats)
    recovery = recovery_time(args.preset, f"{workdir}/run")
  finally:
    shutil.rmtree(workdir, ignore_errors=True)
  print(f"{args.preset} state: {nbytes / 2**20:.0f} MiB (params + ZeRO AdamW state) on "
        f"{len(jax.devices())} devices, median of {args.repeats}")
  print(f"async save: loop blocked {async_blocked:.2f} s (write committed after "
        f"{async_total:.2f} s)")
  print(f"sync save:  loop blocked {sync_blocked:.2f} s")
  print(f"blocked ratio async / sync: {async_blocked / sync_blocked:.3f}")
  print(f"recovery: process start -> first resumed step logged: {recovery:.1f} s")
  print(json.dumps({"preset": args.preset, "state_bytes": nbytes,
                    "async_blocked_s": async_blocked, "async_total_s": async_total,
                    "sync_blocked_s": sync_blocked, "recovery_s": recovery}))


if __name__ == "__main__":
  main()
