"""Fault injection: damaged checkpoints, a NaN step, a torn metrics line, a failed write.

Each fault must end as the README's checkpoint section promises, with nothing good lost:
where it makes sense the run is compared with an uninterrupted one.
"""

import dataclasses
import os
import re
import subprocess
import sys

import jax.numpy as jnp
import pytest

import runs
from tunix_core import data as data_lib
from tunix_core.checkpoints import store as checkpoint
from tunix_core.run import loop as train
from tunix_core.training import health
from tunix_core.training import objective

REPO = runs.REPO
TRAIN = runs.TRAIN
QUIET = runs.QUIET
_config, _losses = runs.config, runs.losses

pytestmark = pytest.mark.slow  # every test here runs the trainer end to end


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
def test_damaged_latest_step_falls_back_or_fails(tmp_path, damage):
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
  train.train(_config(tmp_path / "straight", steps=6), **QUIET)
  assert _losses(out) == _losses(tmp_path / "straight")  # bit-identical


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


def test_nan_step_stops_the_run_before_it_is_saved(tmp_path, monkeypatch):
  _poison_step_3(monkeypatch)
  out = tmp_path / "run"
  with pytest.raises(health.NonFiniteStep, match=r"^step 3 produced non-finite loss;"):
    train.train(_config(out, save_every=2), **QUIET)
  assert _steps(out) == [2]  # nothing from step 3 on was checkpointed
  monkeypatch.undo()
  train.train(_config(out, steps=4), **QUIET)  # the intact step 2 resumes (and verifies)
  train.train(_config(tmp_path / "straight", steps=4), **QUIET)
  assert _losses(out) == _losses(tmp_path / "straight")


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


def test_torn_metrics_line_is_dropped_on_resume(tmp_path):
  out = tmp_path / "run"
  train.train(_config(out, steps=4, save_every=4), **QUIET)
  with open(out / "metrics.jsonl", "a") as f:
    f.write('"not a row"\n{"step": 5, "loss": 0.69')  # a foreign row, then a torn one
  lines = []
  train.train(_config(out), log=lines.append)
  assert any(l.startswith("warning:") and "dropped 2 " in l for l in lines)
  train.train(_config(tmp_path / "straight"), **QUIET)
  assert _losses(out) == _losses(tmp_path / "straight")


def test_failed_checkpoint_write_ends_with_one_line(tmp_path):
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
  train.train(_config(tmp_path / "straight", steps=4), **QUIET)
  assert _losses(out) == _losses(tmp_path / "straight")


def _watchdog_run(out, extra, env_extra, timeout):
  """trainer.py on 8 CPU devices; `(status, stderr)` once it ends (within `timeout`)."""
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8",
             JAX_PLATFORMS="cpu", **env_extra)
  proc = subprocess.run(
      [sys.executable, os.path.join(REPO, "trainer.py"), f"--output_dir={out}",
       f"--train_data={TRAIN}", "--max_length=40", "--max_prompt_length=20", "--batch_size=8",
       "--log_every=1", *extra], env=env, capture_output=True, text=True, timeout=timeout)
  return proc.returncode, proc.stdout, proc.stderr


def test_a_step_that_never_finishes_ends_the_run_and_a_restart_resumes(tmp_path):
  """A loop blocked for good before step 5 (the test hook) ends within --step_timeout
  with one line and the watchdog's status 5, every thread's stack in trainer.log; the
  checkpoints of steps 2 and 4 are intact and a restart resumes from step 4."""
  out = tmp_path / "run"
  flags = ["--steps=6", "--save_every=2", "--step_timeout=10"]
  status, _, err = _watchdog_run(out, flags, {"TUNIX_TEST_HANG_AT_STEP": "5"}, 240)
  assert status == 5, err[-3000:]
  lines = [l for l in err.splitlines() if l.startswith("trainer.py: error:")]
  assert len(lines) == 1 and "train step 4 has not finished after 1" in lines[0], err
  assert "--step_timeout=10" in lines[0] and "exiting with status 5" in lines[0]
  log = (out / "trainer.log").read_text()
  assert "still running after" in log and "Thread MainThread" in log and "_test_fault" in log
  assert _steps(str(out)) == [2, 4]
  status, stdout, err = _watchdog_run(out, flags, {}, 240)
  assert status == 0 and "resumed from step 4" in stdout, err[-3000:]
  assert sorted(_losses(out)) == [1, 2, 3, 4, 5, 6]


def test_a_storage_server_that_never_answers_ends_the_run(tmp_path):
  """The output directory on a server that accepts connections and never answers: the
  run ends within --step_timeout x 4 (start-up's deadline) + 60 s with one line naming
  what was stuck, and the watchdog's status."""
  import socket  # pylint: disable=g-import-not-at-top
  import threading  # pylint: disable=g-import-not-at-top
  import gcs as gcs_lib  # pylint: disable=g-import-not-at-top
  pytest.importorskip("gcsfs", reason="gs:// paths: needs the gcs extra")
  listener = socket.socket()
  listener.bind(("127.0.0.1", 0))
  listener.listen(64)
  held, stop = [], threading.Event()

  def accept():   # connections accepted, never read from nor answered
    listener.settimeout(0.2)
    while not stop.is_set():
      try:
        held.append(listener.accept()[0])
      except OSError:
        pass

  threading.Thread(target=accept, daemon=True).start()
  url = f"http://127.0.0.1:{listener.getsockname()[1]}"
  try:
    status, _, err = _watchdog_run("gs://silent/run", ["--steps=2", "--step_timeout=3"],
                                   gcs_lib.env(url), 3 * 4 + 60)
  finally:
    stop.set()
    for conn in held:
      conn.close()
    listener.close()
  assert status == 5, err[-3000:]
  lines = [l for l in err.splitlines() if l.startswith("trainer.py: error:")]
  # start-up's deadline, 4 x 3 s
  assert len(lines) == 1 and re.search(r"has not finished after 1[2-9] s", lines[0]), err
