"""Start-up: the persistent compilation cache (`run.compile_cache`), the train step's
executable kept whole (`training.executables`), the rule that decides which
multi-process job a trainer joins (`run.distributed`) and libtpu's host buffer sized to
the run (`run.host_buffer`)."""

import json
import os
import subprocess
import sys
import time
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import runs
from tunix_core.run import compile_cache
from tunix_core.run import distributed
from tunix_core.run import host_buffer
from tunix_core.training import executables
from tunix_core.training.config import ConfigError

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def lines(tmp_path):
  """What `compile_cache` says; the session's cache (conftest's) is back afterwards."""
  said = []
  yield said
  compile_cache.enable(compile_cache.AUTO, str(tmp_path), lambda _: None, max_bytes=0)
  jax.clear_caches()


def _f(x):
  return jnp.sin(x) * 3.0 + jnp.cos(x[::-1])


def _compile(x):
  """`_f` compiled afresh (no in-memory executable): the persistent cache is asked."""
  jax.clear_caches()
  with compile_cache.FirstCompile() as seen:
    y = jax.jit(_f)(x)
  return np.asarray(y), seen


def test_a_damaged_entry_is_one_line_and_compiled_again(tmp_path, lines):
  where = str(tmp_path / "cc")
  assert compile_cache.enable(where, "", lines.append, max_bytes=0) == where
  x = jnp.linspace(-2.0, 2.0, 16)
  want = np.sin(np.asarray(x, np.float64)) * 3 + np.cos(np.asarray(x, np.float64)[::-1])
  y, first = _compile(x)
  assert first.lookups == 1 and first.hits == 0 and first.writes == 1
  assert "stored for the next start" in first.describe("f")
  [entry] = [p for p in os.listdir(where) if p.startswith("jit__f-")]
  with open(os.path.join(where, entry), "r+b") as f:  # a write cut short by a kill
    f.truncate(os.path.getsize(f.name) // 2)
  y, damaged = _compile(x)
  np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-6)
  assert damaged.hits == 0 and damaged.writes == 1  # compiled and stored again
  assert [l for l in lines if "damaged" in l] == [l for l in lines if "compilation" in l]
  assert len(lines) == 1 and "removed, compiling again" in lines[0]
  y, again = _compile(x)
  np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-6)
  assert again.hits == 1 and len(lines) == 1
  assert again.describe("f").startswith(f"f: loaded from the compilation cache in ")


def test_an_unwritable_directory_is_one_line_and_an_uncached_run(tmp_path, lines):
  blocker = tmp_path / "file"
  blocker.write_text("")
  assert compile_cache.enable(str(blocker / "cc"), "", lines.append) is None
  assert len(lines) == 1 and lines[0].startswith(f"compilation cache: {blocker / 'cc'} is "
                                                 "not writable (")
  assert lines[0].endswith("; running uncached")
  y, seen = _compile(jnp.ones(4))
  assert seen.lookups == 0 and seen.describe("f").endswith("(no compilation cache)")
  np.testing.assert_allclose(y, np.sin(1.0) * 3 + np.cos(1.0), rtol=1e-6)
  assert compile_cache.enable("", "", lines.append) is None and "off" in lines[-1]


def test_auto_defers_to_the_environment_and_the_bound_drops_the_oldest(tmp_path,
                                                                       monkeypatch, lines):
  monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path / "env"))
  assert compile_cache.resolve_dir("auto", "gs://b/run") == str(tmp_path / "env")
  assert compile_cache.resolve_dir("/x", "gs://b/run") == "/x"  # a given flag wins
  monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR")
  assert compile_cache.resolve_dir("auto", "gs://b/run") == "gs://b/run/compilation_cache"
  where = tmp_path / "bounded"
  where.mkdir()
  for age, name in enumerate(["d", "c", "b", "a"]):  # "a" is the oldest
    (where / f"jit_{name}-0-cache").write_bytes(b"x" * 1000)
    os.utime(where / f"jit_{name}-0-cache", (1e9 - age * 100, 1e9 - age * 100))
  compile_cache.enable(str(where), "", lines.append, max_bytes=2500)
  assert sorted(os.listdir(where)) == ["jit_c-0-cache", "jit_d-0-cache"]


@pytest.mark.slow  # 8 s: three compiles of a step
def test_a_restart_loads_the_whole_step_without_tracing_it(tmp_path, lines):
  """The step's serialized executable, keyed before tracing: a restart's new step
  functions load it (never traced, never compiled) and train bit-exactly as the jitted
  step; a damaged entry is one line and compiled again; another plan is another key."""
  where, cfg, devices = str(tmp_path / "store"), runs.config(tmp_path), jax.devices()[:1]
  os.makedirs(where)
  assert executables.store_dir(devices) is None  # used on TPU only (its docstring)
  first = runs.steps(cfg, devices)
  with compile_cache.FirstCompile() as compiled:
    executables.compile_step(first, where, lines.append)
  assert not compiled.loaded and compiled.compiles
  [entry] = [n for n in os.listdir(where) if n.startswith("step-")]
  want, _ = runs.step_run(first, cfg, num_steps=2)  # the jitted step

  def restart(traced=lambda *_: pytest.fail("traced")):
    """New step functions, as a restarted process makes them (tracing them fails)."""
    again = runs.steps(cfg, devices)
    jitted = again.train_step
    again.train_step = types.SimpleNamespace(lower=lambda *a: traced() or jitted.lower(*a))
    with compile_cache.FirstCompile() as seen:
      loaded = executables.compile_step(again, where, lines.append)
    again.train_step = executables.TrainStep(again, loaded)
    return again, seen

  again, seen = restart()
  assert seen.loaded == 1 and not seen.compiles and not lines
  assert "its whole executable, not traced" in seen.describe("step 1")
  assert runs.step_run(again, cfg, num_steps=2)[0] == want
  with open(os.path.join(where, entry), "r+b") as f:  # a write cut short by a kill
    f.truncate(os.path.getsize(f.name) // 2)
  again, seen = restart(traced=lambda: None)  # compiled again, and written again
  assert not seen.loaded and seen.compiles and len(lines) == 1
  assert lines[0].startswith("compilation cache: step executable ")
  assert lines[0].endswith("; compiling again")
  assert restart()[1].loaded == 1
  other = runs.steps(runs.config(tmp_path, learning_rate=1e-3), devices)
  assert executables.step_key(other) != executables.step_key(first)
  # The compiler's refusal for memory is kept: a restart does not compile it again.
  with open(os.path.join(where, f"refused-{executables.step_key(other)}-cache"), "w") as f:
    f.write(json.dumps({"message": "the train step does not fit HBM: 20 GiB per device "
                        "against 15.8 GiB of HBM (...)", "kind": "hbm", "needed": 20 << 30}))
  with pytest.raises(executables.Refused, match="does not fit .*remembered in .*refused-") as e:
    executables.compile_step(other, where, lines.append)
  assert e.value.kind == "hbm" and e.value.needed == 20 << 30


def test_a_small_run_opening_a_tpu_pins_a_small_host_buffer_and_nothing_else_does(
    monkeypatch):
  tiny, big = runs.config("/unused"), runs.config("/unused", model="125m")
  # The tiny preset: 2 layers of d 128 (q 4 x 32, k and v 2 x 32, MLP 384) and a 259 x
  # 128 embedding and head, 16 bytes a weight; a batch of 8 pairs of 2 rows of 40 ids in
  # four int32 arrays (runs.config: --max_length=40).
  assert host_buffer.moved_bytes(tiny) == 16 * (2 * (128 * 256 + 128 * 128 + 3 * 128 * 384)
                                                + 2 * 259 * 128) + 4 * 4 * 8 * 2 * 40
  env = {"JAX_PLATFORMS": "tpu"}
  assert "256 MiB for a model state and batch of" in host_buffer.size_for(tiny, env)
  assert env["TPU_PREMAPPED_BUFFER_SIZE"] == str(256 << 20)
  monkeypatch.setattr(distributed, "has_tpu_chips", lambda: True)
  assert host_buffer.size_for(tiny, {}) is not None  # no JAX_PLATFORMS: the chips decide
  for cfg, env, chips in (
      (big, {"JAX_PLATFORMS": "tpu"}, True),  # 110M params: copies would crawl
      (runs.config("/unused", batch_size=65536), {}, True),  # and its batches
      (tiny, {"JAX_PLATFORMS": "tpu", "TPU_PREMAPPED_BUFFER_SIZE": "1"}, True),
      (tiny, {"JAX_PLATFORMS": "cpu"}, True),
      (tiny, {}, False)):  # libtpu installed on a host without TPU chips
    monkeypatch.setattr(distributed, "has_tpu_chips", lambda chips=chips: chips)
    before = dict(env)
    assert host_buffer.size_for(cfg, env) is None and env == before, (cfg.batch_size, env)


@pytest.mark.parametrize("env, tpu, metadata, want", [
    ({}, False, None, (None, None)),
    ({"TPU_WORKER_HOSTNAMES": "localhost"}, False, None,
     (None, "TPU_WORKER_HOSTNAMES names one worker: one process")),
    ({"TPU_WORKER_HOSTNAMES": "a,b", "TPU_WORKER_ID": "1"}, False, None,
     (dict(coordinator_address="a:8476", num_processes=2, process_id=1), None)),
    ({"TPU_PROCESS_ADDRESSES": "10.0.0.1:8470,10.0.0.2:8470",
      "TPU_WORKER_HOSTNAMES": "localhost"}, False, None,
     (dict(coordinator_address="10.0.0.1:8476", num_processes=2, process_id=0), None)),
    ({"TPU_WORKER_HOSTNAMES": "a,b"}, True, None, ({}, None)),
    ({"MEGASCALE_COORDINATOR_ADDRESS": "a:8080"}, True, None, ({}, None)),
    ({}, True, None, (None, "no TPU job in the environment and none from the GCE "
                      "metadata server: one process")),
    ({}, True, 1, (None, "the metadata server names one TPU worker: one process")),
    ({}, True, 4, ({}, None)),
])
def test_one_process_unless_there_are_more_hosts(env, tpu, metadata, want):
  job = distributed.plan(None, None, None, env, tpu_host=tpu, metadata=lambda: metadata)
  assert (job.kwargs, job.notice) == want


def test_the_flags_win_and_go_together_and_a_worker_index_is_checked():
  job = distributed.plan("h:1", 2, 1, {"TPU_WORKER_HOSTNAMES": "a,b"}, tpu_host=True)
  assert job.kwargs == dict(coordinator_address="h:1", num_processes=2, process_id=1)
  with pytest.raises(ConfigError, match="go together"):
    distributed.plan("h:1", None, None, {})
  for index in ("2", "-1", "x"):
    with pytest.raises(ConfigError, match=rf"^TPU_WORKER_ID='{index}' is not a worker "
                       "index of the 2 in TPU_WORKER_HOSTNAMES$"):
      distributed.plan(None, None, None, {"TPU_WORKER_HOSTNAMES": "a,b",
                                          "TPU_WORKER_ID": index}, tpu_host=False)


def test_a_metadata_server_that_does_not_answer_is_no_job():
  import socket  # pylint: disable=g-import-not-at-top
  with socket.socket() as closed:  # a port nobody listens on: refused at once
    closed.bind(("127.0.0.1", 0))
    port = closed.getsockname()[1]
  start = time.perf_counter()
  assert distributed.ask_metadata(timeout=1.0, url=f"http://127.0.0.1:{port}/x") is None
  assert time.perf_counter() - start < 5


@pytest.mark.slow
def test_a_multi_host_job_without_its_coordinator_ends_in_one_line(tmp_path):
  # This process is worker 1: process 0 would start a coordinator on JAX's port here.
  env = dict(os.environ, JAX_PLATFORMS="cpu", TPU_WORKER_HOSTNAMES="a.invalid,b.invalid",
             TPU_WORKER_ID="1")
  start = time.perf_counter()
  proc = subprocess.run(
      [sys.executable, os.path.join(REPO, "trainer.py"), f"--output_dir={tmp_path}",
       "--train_data=data/train.jsonl", "--coordinator_timeout=5"], cwd=REPO, env=env,
      capture_output=True, text=True, timeout=120)
  assert proc.returncode == 1, proc.stderr[-2000:]
  assert time.perf_counter() - start < 60
  errors = [l for l in proc.stderr.splitlines() if l.startswith("trainer.py:")]
  assert errors == [
      "trainer.py: error: could not join the 2 workers of TPU_WORKER_HOSTNAMES within 5 s "
      "(its coordinator unreachable or a process missing); set the job by hand with "
      "--coordinator_address, --num_processes and --process_id, or raise "
      "--coordinator_timeout"]
