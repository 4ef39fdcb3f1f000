"""Fault injection: damaged checkpoints, a NaN step, a torn metrics line, a failed write,
a reference pass killed, a step that never finishes, a storage server that never answers.

Each fault must end as the README's checkpoint section promises, with nothing good lost:
where it makes sense the run is compared with an uninterrupted one.
"""

import dataclasses
import functools
import glob
import os
import re
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import runs
from tunix_core import data as data_lib
from tunix_core import model as model_lib
from tunix_core.checkpoints import store as checkpoint
from tunix_core.run import loop as train
from tunix_core.run import ref_cache
from tunix_core.training import config as config_lib
from tunix_core.training import health
from tunix_core.training import objective
from tunix_core.training import plan as plan_lib
from tunix_core.training import step as step_lib

REPO = runs.REPO
TRAIN = runs.TRAIN
QUIET = runs.QUIET
_config, _losses = runs.config, runs.losses

pytestmark = pytest.mark.slow  # every test here runs the trainer end to end


@pytest.fixture(scope="module")
def straight_losses(tmp_path_factory):
  """`losses(steps)`: every step's loss of an uninterrupted run of `steps` steps, the
  curve a faulted run must end on; each length is trained once for the module."""
  done = {}

  def losses(steps):
    if steps not in done:
      out = tmp_path_factory.mktemp("straight")
      train.train(_config(out, steps=steps), **QUIET)
      done[steps] = _losses(out)
    return done[steps]
  return losses


def _steps(out):
  ckpt = checkpoint.Checkpointer(os.path.join(out, "checkpoints"))
  try:
    return ckpt.steps()
  finally:
    ckpt.close()


def _largest_array_file(step_dir):
  files = [os.path.join(d, f) for d, _, names in os.walk(os.path.join(step_dir, "state"))
           for f in names if f"{os.sep}d" in d]
  return max(files, key=os.path.getsize)


def _flip(path, offset=None, n=64):
  with open(path, "r+b") as f:
    data = bytearray(f.read())
    start = len(data) // 2 if offset is None else offset
    for i in range(start, min(start + n, len(data))):
      data[i] ^= 0xFF
    f.seek(0)
    f.write(data)


def _truncate(path):
  with open(path, "r+b") as f:
    f.truncate(os.path.getsize(path) // 2)


# Flipped bytes in an array are the object-storage test's damage (tests/test_storage.py).
@pytest.mark.parametrize("damage", ["truncate_array", "flip_meta"])
def test_damaged_latest_step_falls_back_or_fails(tmp_path, damage, straight_losses):
  out = tmp_path / "run"
  train.train(_config(out, steps=4, save_every=2), **QUIET)  # steps 2 and 4
  step_dir = out / "checkpoints" / "4"
  if damage == "truncate_array":
    _truncate(_largest_array_file(step_dir))
  else:
    _flip(step_dir / "meta" / "metadata", offset=0)
  with pytest.raises(checkpoint.CheckpointError,
                     match=r"checkpoint step 4 .*(fails verification: \d+ arrays differ, "
                           r"e\.g\. \[|is unreadable)"):
    train.train(_config(out, steps=6, resume="required"), **QUIET)
  lines = []
  train.train(_config(out, steps=6, save_every=2), log=lines.append)
  assert [l for l in lines if "moved aside" in l][0].startswith("checkpoint step 4 ")
  assert [l for l in lines if l.startswith("resumed from step")][0].startswith(
      "resumed from step 2 ")
  (rejected,) = os.listdir(f"{out}/checkpoints.rejected")
  assert rejected.startswith("4-")  # kept, never deleted
  assert _steps(out) == [4, 6] or _steps(out) == [2, 4, 6]  # step 4 was written again
  assert _losses(out) == straight_losses(6)  # bit-identical


def _poison_step_3(monkeypatch):
  """Makes the loss NaN in the train step that sees batch 3 (its first pair)."""
  ds = data_lib.load_dataset(TRAIN, data_lib.ByteTokenizer(), 40, 20)
  it = data_lib.BatchIterator(ds, 8, 0)
  for _ in range(3):
    idx = it.next_indices()
  marker = jnp.asarray(ds.tokens[idx[0], 0])
  original = objective.dpo_objective

  def poisoned(params, ref, batch, *args, **kwargs):
    loss, metrics = original(params, ref, batch, *args, **kwargs)
    hit = jnp.any(jnp.all(batch["tokens"][:, 0] == marker, axis=-1))
    return jnp.where(hit, jnp.nan, loss), metrics

  monkeypatch.setattr(objective, "dpo_objective", poisoned)


def test_nan_step_stops_the_run_before_it_is_saved(tmp_path, monkeypatch, straight_losses):
  _poison_step_3(monkeypatch)
  out = tmp_path / "run"
  with pytest.raises(health.NonFiniteStep, match=r"^step 3 produced non-finite loss;"):
    train.train(_config(out, save_every=2), **QUIET)
  assert _steps(out) == [2]  # nothing from step 3 on was checkpointed
  monkeypatch.undo()
  train.train(_config(out, steps=4), **QUIET)  # the intact step 2 resumes (and verifies)
  assert _losses(out) == straight_losses(4)


def test_skipped_nan_steps_are_counted_and_resume_exactly(tmp_path, monkeypatch):
  _poison_step_3(monkeypatch)
  straight = train.train(_config(tmp_path / "a", on_nonfinite="skip"), **QUIET)
  train.train(_config(tmp_path / "b", steps=4, save_every=4, on_nonfinite="skip"), **QUIET)
  resumed = train.train(_config(tmp_path / "b", on_nonfinite="skip"), **QUIET)
  a, b = _losses(tmp_path / "a"), _losses(tmp_path / "b")
  assert a[3] != a[3] and b[3] != b[3]  # NaN at step 3, in both
  assert {k: v for k, v in a.items() if k != 3} == {k: v for k, v in b.items() if k != 3}
  assert [int(x) for x in straight["state"]["nonfinite"]] == [1, 3, 1]
  assert [int(x) for x in resumed["state"]["nonfinite"]] == [1, 3, 1]


def test_torn_metrics_line_is_dropped_on_resume(tmp_path, straight_losses):
  out = tmp_path / "run"
  train.train(_config(out, steps=4, save_every=4), **QUIET)
  with open(out / "metrics.jsonl", "a") as f:
    f.write('"not a row"\n{"step": 5, "loss": 0.69')  # a foreign row, then a torn one
  lines = []
  train.train(_config(out), log=lines.append)
  assert any(l.startswith("warning:") and "dropped 2 " in l for l in lines)
  assert _losses(out) == straight_losses(6)


def test_failed_checkpoint_write_ends_with_one_line(tmp_path, straight_losses):
  out = tmp_path / "run"
  train.train(_config(out, steps=2, save_every=2), **QUIET)
  cfg = _config(out, steps=4, save_every=2)
  flags = [f"--{k}={v}" for k, v in dataclasses.asdict(cfg).items() if v != ""]

  # The child limits its own file size before it becomes the trainer (exec keeps both
  # settings): writes past 300 kB then fail with EFBIG instead of raising SIGXFSZ.
  launch = ("import os, resource, signal, sys; signal.signal(signal.SIGXFSZ, signal.SIG_IGN); "
            "resource.setrlimit(resource.RLIMIT_FSIZE, (300_000, 300_000)); "
            "os.execv(sys.executable, [sys.executable] + sys.argv[1:])")
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  proc = subprocess.run([sys.executable, "-c", launch, os.path.join(REPO, "trainer.py"),
                         *flags], env=env, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 4, proc.stderr[-3000:]
  errors = [l for l in proc.stderr.splitlines() if l.startswith("trainer.py: error:")]
  assert len(errors) == 1 and len(proc.stderr.splitlines()) <= 8, proc.stderr
  assert (f"writing checkpoint step 4 to {out}/checkpoints failed: File too large; "
          "newest complete checkpoint: step 2") in errors[0]
  assert os.path.exists(out / "trainer.log")
  assert _steps(out) == [2]  # the previous checkpoint is intact, step 4 not half-committed
  train.train(_config(out, steps=4), **QUIET)
  assert _losses(out) == straight_losses(4)


def _watchdog_run(out, extra, timeout, faults=(), data=TRAIN, env_extra=None, wait=True):
  """trainer.py (with `faults`, tests/fault_trainer.py's flags: that script) on 8 CPU
  devices; `(status, stdout, stderr)` once it ends within `timeout` (`wait=False`: the
  running process)."""
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8",
             JAX_PLATFORMS="cpu", **(env_extra or {}))
  script = os.path.join(REPO, "tests", "fault_trainer.py") if faults else os.path.join(
      REPO, "trainer.py")
  proc = subprocess.Popen(
      [sys.executable, script, *faults, f"--output_dir={out}", f"--train_data={data}",
       "--max_length=40", "--max_prompt_length=20", "--batch_size=8", "--log_every=1",
       *extra], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  if not wait:
    return proc
  stdout, stderr = proc.communicate(timeout=timeout)
  return proc.returncode, stdout, stderr


def _error_line(err: str) -> str:
  lines = [l for l in err.splitlines() if l.startswith("trainer.py: error:")]
  assert len(lines) == 1, err[-3000:]
  return lines[0]


def test_a_killed_reference_pass_resumes_and_a_blocked_step_is_named(tmp_path):
  """`--reference=precomputed` over 512 pairs (64 batches of 8). Killed (SIGKILL) as
  reference batch 40 starts, the pass leaves its complete chunks, back to back from the
  first pair; restarted, it resumes after the last of them, and the table it ends with
  equals an uninterrupted pass's. That run's loop, blocked for good as step 5 starts
  (`--hang_at`), ends within --step_timeout with one line naming step 5 and the
  watchdog's status 5, every thread's stack in trainer.log; the checkpoints of steps 2
  and 4 are intact and a restart resumes from step 4."""
  data = tmp_path / "pairs.jsonl"
  with open(TRAIN) as f:
    data.write_text("".join(f.readlines()[:512]))
  out = tmp_path / "run"
  flags = ["--steps=6", "--save_every=2", "--step_timeout=10", "--reference=precomputed"]
  run = functools.partial(_watchdog_run, out, flags, 240, data=data)
  status, _, err = run([f"--kill_at=reference log-probs: batch 40/64 of {data}"])
  assert status == -signal.SIGKILL, err[-3000:]
  (chunks,) = glob.glob(f"{out}/data_cache/ref_logps_*.chunks-0")
  spans = sorted(tuple(map(int, name[:-len(".npy")].split("-")))
                 for name in os.listdir(chunks))
  assert spans[0][0] == 0 and all(a[1] == b[0] for a, b in zip(spans, spans[1:])), spans
  kept = spans[-1][1]
  assert 0 < kept <= 39 * 8  # nothing of batch 40 on

  status, stdout, err = run(["--hang_at=train step 5"])
  assert status == 5, err[-3000:]
  assert f"reference log-probs: resuming after pair {kept:,} of 512 " in stdout, stdout
  line = _error_line(err)
  assert "train step 5 has not finished after 1" in line, line
  assert "--step_timeout=10" in line and "exiting with status 5" in line
  log = (out / "trainer.log").read_text()
  assert "still running after" in log and "Thread MainThread" in log
  assert "fault_trainer.py" in log and "in on_beat" in log
  assert _steps(str(out)) == [2, 4]
  status, stdout, err = run()
  assert status == 0 and "resumed from step 4" in stdout, err[-3000:]
  assert sorted(_losses(out)) == [1, 2, 3, 4, 5, 6]

  # The table of the killed and resumed pass, against one pass that never stopped, of
  # the same pairs through the same plan under the same (initial) reference params.
  (table,) = glob.glob(f"{out}/data_cache/ref_logps_*")
  (store,) = glob.glob(f"{out}/data_cache/pairs-*")
  cfg = config_lib.TrainConfig(output_dir=str(out), train_data=str(data), max_length=40,
                               max_prompt_length=20, batch_size=8, reference="precomputed")
  pairs = data_lib.PairStore(store)
  devices = jax.devices()
  steps = step_lib.make_steps(plan_lib.make_plan(cfg, devices, plan_lib.data_sizes(
      cfg, [pairs])), devices)
  ref = train.frozen_copy(steps.init_state(jax.random.PRNGKey(cfg.seed))["params"],
                          model_lib.DTYPES[steps.plan.ref_dtype])
  ref_cache.precompute_ref_logps(steps, ref, pairs, str(tmp_path / "straight"))
  straight = tmp_path / "straight" / os.path.basename(table)  # the same name: same key
  np.testing.assert_array_equal(np.load(table), np.load(straight))


def test_a_storage_server_that_never_answers_ends_the_run(tmp_path, gcs):
  """A storage server that accepts connections and never answers (a proxy in front of
  the emulator, silent), at start-up (from the run's first storage call) and mid-run
  (once step 2's checkpoint is committed): each run ends within --step_timeout + 60 s
  with one line naming the storage call stuck and the watchdog's status 5; at start-up
  within --step_timeout of that call, not start-up's longer deadline."""
  import gcs as gcs_lib  # pylint: disable=g-import-not-at-top
  pytest.importorskip("gcsfs", reason="gs:// paths: needs the gcs extra")
  at_start, mid_run = gcs_lib.Proxy(gcs), gcs_lib.Proxy(gcs)
  at_start.silent.set()
  bucket = gcs.bucket("faults")
  try:
    # Its first storage call: its compilation cache on the server (as by default, beside
    # the run; the tests' own cache is local).
    first = _watchdog_run(f"{bucket}/start", ["--steps=2", "--step_timeout=3",
                                              f"--compilation_cache_dir={bucket}/start/cc"],
                          None, env_extra=gcs_lib.env(at_start.url), wait=False)
    later = _watchdog_run(f"{bucket}/mid", ["--steps=500", "--save_every=2",
                                            "--step_timeout=10"], None,
                          env_extra=gcs_lib.env(mid_run.url), wait=False)
    _, err = first.communicate(timeout=3 + 60)
    assert first.returncode == 5, err[-3000:]
    line = _error_line(err)
    took = re.search(r"the storage call (\w+ )+gs://faults/start/\S+ \(during start-up: "
                     r".*\) has not finished after (\d+) s \(--step_timeout=3\)", line)
    assert took and 3 <= int(took[2]) < 3 * 4, line  # under start-up's deadline

    deadline = time.time() + 300
    while "2/commit_success.txt" not in gcs_lib.objects(gcs, f"{bucket}/mid/checkpoints"):
      assert later.poll() is None and time.time() < deadline, later.communicate()[1][-3000:]
      time.sleep(0.2)
    mid_run.silent.set()
    _, err = later.communicate(timeout=10 + 60)
    assert later.returncode == 5, err[-3000:]
    line = _error_line(err)
    assert "has not finished after" in line and "(--step_timeout=10)" in line, line
    assert "gs://faults/mid/" in line, line  # the stuck call (or the one in flight) named
  finally:
    for proxy in (at_start, mid_run):
      proxy.stop()
