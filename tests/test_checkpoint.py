"""Checkpointing: exact resume, preemption, crashes mid-save, topology change, errors."""

import dataclasses
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time

import chex
import jax
import numpy as np
import pytest

import runs
from tunix_core import data as data_lib
from tunix_core.checkpoints import resume
from tunix_core.checkpoints import store as checkpoint
from tunix_core.run import loop as train
from tunix_core.training import config as config_lib

REPO = runs.REPO
TRAIN = runs.TRAIN
QUIET = runs.QUIET
_config, _rows, _losses = runs.config, runs.rows, runs.losses

pytestmark = pytest.mark.slow  # every test here runs the trainer end to end


def _flags(cfg):
  return [f"--{k}={v}" for k, v in dataclasses.asdict(cfg).items() if v != ""]


def _spawn(cfg, devices=8, extra=(), faults=(), **env):
  """trainer.py on `devices` CPU devices; with `faults` (`tests/fault_trainer.py`'s
  flags), that script instead."""
  env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
             JAX_PLATFORMS="cpu", **env)
  script = os.path.join(REPO, "tests", "fault_trainer.py") if faults else os.path.join(
      REPO, "trainer.py")
  return subprocess.Popen([sys.executable, script, *faults, *_flags(cfg), *extra], env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for_rows(out, n, proc, timeout=300):
  path = os.path.join(out, "metrics.jsonl")
  deadline = time.time() + timeout
  while time.time() < deadline:
    assert proc.poll() is None, proc.communicate()[1][-3000:]
    if os.path.exists(path) and len(open(path).readlines()) >= n:
      return
    time.sleep(0.2)
  raise TimeoutError(f"{path} never reached {n} rows")


@pytest.mark.parametrize("kw", [{}, pytest.param({"packing": True}, marks=pytest.mark.slow)],
                         ids=["prefix-sharing", "packing"])
def test_resume_is_exact(tmp_path, kw):
  straight = train.train(_config(tmp_path / "a", **kw), **QUIET)
  train.train(_config(tmp_path / "b", steps=3, save_every=3, **kw), **QUIET)
  resumed = train.train(_config(tmp_path / "b", save_every=3, **kw), **QUIET)
  assert _losses(tmp_path / "a") == _losses(tmp_path / "b")  # bit-identical, every step
  for x, y in zip(jax.tree.leaves(straight["state"]), jax.tree.leaves(resumed["state"])):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_sigterm_saves_the_reached_step_and_resume_continues(tmp_path):
  out = tmp_path / "run"
  proc = _spawn(_config(out, steps=500))
  _wait_for_rows(out, 3, proc)
  proc.send_signal(signal.SIGTERM)
  _, err = proc.communicate(timeout=300)
  assert proc.returncode == 42, err[-3000:]
  ckpt = checkpoint.Checkpointer(str(out / "checkpoints"))
  (reached,) = ckpt.steps()
  meta = ckpt.read_meta(reached)
  ckpt.close()
  assert reached >= 3 and meta["step"] == reached
  # The iterator position is exactly `reached` batches in: nothing skipped or repeated.
  ds = data_lib.load_dataset(TRAIN, data_lib.ByteTokenizer(), 40, 20)
  it = data_lib.BatchIterator(ds, 8, 0, data_key=data_lib.store_key(
      TRAIN, data_lib.ByteTokenizer(), 40, 20, False))  # the token store it trained on
  for _ in range(reached):
    it.next_indices()
  assert meta["data_state"] == it.get_state()
  train.train(_config(out, steps=reached + 2), **QUIET)
  train.train(_config(tmp_path / "straight", steps=reached + 2), **QUIET)
  got, want = _losses(out), _losses(tmp_path / "straight")
  assert sorted(got) == list(range(1, reached + 3))
  np.testing.assert_allclose([got[s] for s in sorted(got)], [want[s] for s in sorted(want)],
                             rtol=1e-6)


def test_sigkill_during_async_save_keeps_previous_checkpoint(tmp_path):
  """In bfloat16 params (their error term and moments in the state): killed mid-save,
  the run resumes from the last complete step bit-exactly, as a straight run."""
  out = tmp_path / "run"
  bf16 = dict(param_dtype="bfloat16")
  proc = _spawn(_config(out, steps=500, save_every=1, **bf16))  # a save is nearly always in flight
  _wait_for_rows(out, 5, proc)
  proc.kill()
  proc.wait()
  ckpt_dir = out / "checkpoints"
  ckpt = checkpoint.Checkpointer(str(ckpt_dir))
  complete = ckpt.steps()
  ckpt.close()
  assert complete, "no complete checkpoint survived"
  last = max(complete)
  result = train.train(_config(out, steps=last + 2, save_every=1, resume="required", **bf16),
                       **QUIET)
  assert int(result["state"]["step"]) == last + 2
  assert not [p for p in os.listdir(ckpt_dir) if "tmp" in p]  # leftovers cleaned up
  assert max(_losses(out)) == last + 2
  straight = train.train(_config(tmp_path / "straight", steps=last + 2, save_every=0, **bf16),
                         **QUIET)
  assert _losses(tmp_path / "straight") == _losses(out)  # bit-identical, every step
  for x, y in zip(jax.tree.leaves(straight["state"]), jax.tree.leaves(result["state"])):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize("num_devices", [4, 1])
def test_restore_on_fewer_devices(tmp_path, num_devices):
  cfg = _config(tmp_path, steps=2, save_every=2)
  saved = train.train(cfg, **QUIET)["state"]
  small = runs.steps(cfg, jax.devices()[:num_devices])
  ckpt = checkpoint.Checkpointer(str(tmp_path / "checkpoints"))
  restored = resume.restore_state(small, ckpt, 2, ckpt.read_meta(2))
  ckpt.close()
  chex.assert_trees_all_equal(jax.device_get(restored["params"]),
                              jax.device_get(saved["params"]))
  # Optimizer pieces re-cut for the new count hold the same values per parameter:
  # each leaf's [devices, piece] rows are its zero-padded flat values.
  def whole(pieces):
    return jax.tree.map(lambda x, p: np.asarray(x).reshape(-1)[:p.size].reshape(p.shape),
                        pieces, saved["params"])
  assert restored["opt_state"][0].mu["embed"].shape[0] == num_devices
  chex.assert_trees_all_equal(whole(restored["opt_state"][0].mu),
                              whole(saved["opt_state"][0].mu))
  chex.assert_trees_all_equal(whole(restored["opt_state"][0].nu),
                              whole(saved["opt_state"][0].nu))


def test_resume_on_one_device_matches_eight(tmp_path):
  train.train(_config(tmp_path / "a", steps=2, save_every=2), **QUIET)
  train.train(_config(tmp_path / "a", steps=4), devices=jax.devices()[:1], **QUIET)
  train.train(_config(tmp_path / "b", steps=4), **QUIET)
  a, b = _losses(tmp_path / "a"), _losses(tmp_path / "b")
  np.testing.assert_allclose([a[s] for s in range(1, 5)], [b[s] for s in range(1, 5)],
                             rtol=1e-5, atol=1e-5)


def test_config_mismatch_and_resume_modes(tmp_path):
  pairs = tmp_path / "train.jsonl"  # a copy, edited below
  shutil.copy(TRAIN, pairs)
  config = lambda **kw: _config(tmp_path, train_data=str(pairs), **kw)
  train.train(config(steps=2, save_every=2), **QUIET)
  with pytest.raises(config_lib.ConfigError, match="max_length=40 but this run has max_length=48"):
    train.train(config(steps=4, max_length=48), **QUIET)
  with pytest.raises(config_lib.ConfigError, match="compute_dtype='float32' but this run has "
                                              "compute_dtype='bfloat16'"):
    train.train(config(steps=4, compute_dtype="bfloat16"), **QUIET)
  # The schedule's shape is the run's (its horizon, --steps, is not: steps=4 resumes).
  with pytest.raises(config_lib.ConfigError, match="lr_schedule='constant' but this run has "
                                              "lr_schedule='cosine'"):
    train.train(config(steps=4, lr_schedule="cosine"), **QUIET)
  with pytest.raises(config_lib.ConfigError, match="--resume=never but .* already holds"):
    train.train(config(steps=4, resume="never"), **QUIET)
  # The data file edited in place: the saved position (epoch 0, pair 16) is in another
  # order, so the resume is refused, or with --allow_data_change restarts epoch 0.
  with open(pairs, "a", encoding="utf-8") as f:
    f.write(json.dumps({"prompt": "new", "chosen": "yes", "rejected": "no"}) + "\n")
  with pytest.raises(data_lib.DataError, match="--allow_data_change to restart epoch 0"):
    train.train(config(steps=4), **QUIET)
  # How the step computes the model is no part of it: a resume may rematerialise and
  # attend otherwise (another device count can make --remat=auto choose otherwise).
  train.train(config(steps=3, allow_data_change=True, remat="full", attention_impl="naive"),
              **QUIET)
  ckpt = checkpoint.Checkpointer(str(tmp_path / "checkpoints"))
  meta = ckpt.read_meta(3)
  ckpt.close()
  assert meta["data_state"] == {"epoch": 0, "position": 8, "data_key": data_lib.store_key(
      str(pairs), data_lib.ByteTokenizer(), 40, 20, False)}  # one batch into the new order
  with pytest.raises(checkpoint.CheckpointError, match="holds no complete checkpoint"):
    train.train(_config(tmp_path / "empty", resume="required"), **QUIET)
  not_a_dir = tmp_path / "file"
  not_a_dir.write_text("x")
  with pytest.raises(config_lib.ConfigError, match="cannot be created"):
    train.train(_config(not_a_dir / "out"), **QUIET)


def test_corrupt_latest_step_falls_back_or_fails(tmp_path):
  train.train(_config(tmp_path, steps=4, save_every=2), **QUIET)
  ckpt_dir = tmp_path / "checkpoints"
  meta_dir = ckpt_dir / "4" / "meta"
  for name in os.listdir(meta_dir):
    (meta_dir / name).write_text("{ not json")
  with pytest.raises(checkpoint.CheckpointError, match="step 4 .* is unreadable"):
    train.train(_config(tmp_path, steps=6, resume="required"), **QUIET)
  result = train.train(_config(tmp_path, steps=5), **QUIET)  # auto: falls back to step 2
  assert int(result["state"]["step"]) == 5
  assert sorted(_losses(tmp_path)) == [1, 2, 3, 4, 5]


def test_verify_checkpoint_detects_a_changed_array(tmp_path):
  train.train(_config(tmp_path, steps=2, save_every=2), **QUIET)
  train.train(_config(tmp_path, steps=3, verify_checkpoint=True), **QUIET)  # passes
  meta_dir = tmp_path / "checkpoints" / "3" / "meta"  # the run always saves its last step
  name = "metadata"  # Orbax's JSON file of the item
  meta = json.loads((meta_dir / name).read_text())
  key = sorted(meta["fingerprints"])[0]
  meta["fingerprints"][key] = "0" * 16
  (meta_dir / name).write_text(json.dumps(meta))
  with pytest.raises(checkpoint.CheckpointError, match="fails verification"):
    train.train(_config(tmp_path, steps=4, verify_checkpoint=True, resume="required"), **QUIET)


def test_offline_export_of_an_fsdp_run_keeps_each_device_at_an_eighth(tmp_path,
                                                                      monkeypatch, capsys):
  """`python -m tunix_core.hf export` (`export_step`) of an 8-device FSDP run: restored
  split as FSDP splits it, each device holds at most 1/8 of the params plus one layer's
  tensor while every tensor is fetched, and the export is the run's last params.
  `python -m tunix_core.generate --output_dir` decodes with the params split the same
  way, and completes as the gathered params do on one device."""
  pytest.importorskip("safetensors", reason="the export: needs the hf extra")
  import gc  # pylint: disable=g-import-not-at-top
  from tunix_core import hf  # pylint: disable=g-import-not-at-top
  from tunix_core.checkpoints import export  # pylint: disable=g-import-not-at-top
  from tunix_core.parallel import mesh as mesh_lib  # pylint: disable=g-import-not-at-top
  cfg = _config(tmp_path / "run", fsdp=True, steps=2, save_every=2)
  trained = jax.device_get(runs.steps(cfg, jax.devices()).logical_params(
      train.train(cfg, **QUIET)["state"]["params"]))
  gc.collect()

  def per_device() -> dict:
    """Bytes of the live buffers on each device (one buffer can back several arrays)."""
    buffers = {(s.device, s.data.unsafe_buffer_pointer()): s.data.nbytes
               for x in jax.live_arrays() for s in x.addressable_shards}
    held = {}
    for (device, _), n in buffers.items():
      held[device] = held.get(device, 0) + n
    return held

  before, peak = per_device(), {}
  to_host = mesh_lib.to_host

  def fetch(x):
    gc.collect()   # what is held, not garbage awaiting the collector
    for d, n in per_device().items():
      peak[d] = max(peak.get(d, 0), n - before.get(d, 0))
    return to_host(x)

  monkeypatch.setattr(mesh_lib, "to_host", fetch)
  export.export_step(str(tmp_path / "run"), str(tmp_path / "hf"), dtype="float32", **QUIET)
  leaves = jax.tree.leaves(trained)
  total = sum(x.nbytes for x in leaves)
  layer = max(x.nbytes // x.shape[0] for x in jax.tree.leaves(trained["layers"]))
  assert len(peak) == 8 and max(peak.values()) <= total / 8 + layer, (peak, total, layer)
  jax.tree.map(np.testing.assert_array_equal,
               hf.load_params(str(tmp_path / "hf"), cfg.model_config()), trained)

  from tunix_core import generate  # pylint: disable=g-import-not-at-top
  from tunix_core.generate import __main__ as generate_cli  # pylint: disable=g-import-not-at-top
  from tunix_core.model import generate as generate_lib  # pylint: disable=g-import-not-at-top
  held, decode = {}, generate_lib.generate

  def spy(params, *args, **kw):
    for x in jax.tree.leaves(params):
      for shard in getattr(x, "addressable_shards", ()):  # the gathered ones: NumPy
        held[shard.device] = held.get(shard.device, 0) + shard.data.nbytes
    return decode(params, *args, **kw)

  monkeypatch.setattr(generate_lib, "generate", spy)
  assert generate_cli.main(["--output_dir", str(tmp_path / "run"), "--prompt", "ab",
                            "--max_new_tokens", "6"]) == 0
  got = json.loads(capsys.readouterr().out.splitlines()[-1])
  assert len(held) == 8 and max(held.values()) <= total / 8 + layer, (held, total, layer)
  tok = data_lib.ByteTokenizer()
  (want,) = generate.complete(trained, cfg.model_config(), tok, ["ab"], generate_lib.Sampling(
      6, 0.0, 0, 1.0, (tok.eos_id,)), chat=False)
  assert got["completion_ids"] == want["completion_ids"] and len(want["completion_ids"])


def _free_port():
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora-merged-tp-across"])
def test_two_processes_killed_and_resumed_equal_one_process(tmp_path, gcs, lora):
  """The pod recipe on two processes (loopback) with no shared disk, checkpoints and the
  export on `gs://`: full fine-tuning on 2 x 4 devices, FSDP with a model axis of 2 on
  each host; LoRA with --export_merged on 2 x 1 device, a model axis of 2 across both
  hosts. The full run is killed (SIGKILL, both processes) before step 7 and the same
  command resumes it from the bucket to step 9. Both end with status 0, every step's
  loss on the curve of one process on as many devices that never stopped, and the
  export (LoRA: the PEFT adapter and merged/) equal to that process's. The full run
  starts from HF weights in the bucket, of which each process fetches only its devices'
  rows (at most 55% of the bytes, as the process reports them)."""
  pytest.importorskip("safetensors", reason="the export: needs the hf extra")
  import gcs as gcs_lib  # pylint: disable=g-import-not-at-top
  from tunix_core import hf  # pylint: disable=g-import-not-at-top
  from tunix_core import model as model_lib  # pylint: disable=g-import-not-at-top
  from tunix_core.hf import peft  # pylint: disable=g-import-not-at-top
  out = gcs.bucket("multihost") + ("/lora" if lora else "/mp")
  per_process = 1 if lora else 4
  layout = dict(fsdp=True, model_parallel=2,
                **(dict(model="tiny_tp", lora_rank=4, lora_alpha=8.0, export_merged=True)
                   if lora else dict(hf_model_dir=out + "/model")))
  if not lora:  # tiny_tp's shapes with a 320-token vocabulary, the tokenizer's
    mcfg = dataclasses.replace(model_lib.preset("tiny_tp"), vocab_size=320)
    model_dir = tmp_path / "model"
    hf.save_params(model_lib.init_params(jax.random.PRNGKey(3), mcfg), mcfg, str(model_dir),
                   dtype="float32")
    for name in ("tokenizer.json", "tokenizer_config.json"):
      shutil.copy(os.path.join(REPO, "tests", "fixtures", "hf", "tokenizer", name), model_dir)
    gcs_lib.upload(gcs, str(model_dir), out + "/model")
  steps = 3 if lora else 9
  cfg = _config(out, steps=steps, save_every=3, export_hf_dir=out + "/export", **layout)

  def launch(*faults):
    port = _free_port()
    procs = [_spawn(cfg, devices=per_process,
                    extra=[f"--coordinator_address=127.0.0.1:{port}", "--num_processes=2",
                           f"--process_id={i}"],
                    faults=[f"--record_pairs_dir={tmp_path}", *faults])
             for i in range(2)]
    return [(p,) + p.communicate(timeout=600) for p in procs]

  # Full: both processes are killed (SIGKILL) as step 7 starts, then the same command
  # resumes from the last checkpoint the bucket holds and runs to step 9.
  first = launch(*([] if lora else ["--kill_at=train step 7"]))
  ends = first if lora else launch()
  for i, (p, stdout, err) in enumerate(first):
    assert (p.returncode == 0) if lora else (p.returncode != 0), err[-3000:]
    if not lora:
      said = re.search(rf"process {i}: weights: this process fetched ([\d,]+) of the "
                       r"checkpoint's ([\d,]+) bytes", stdout)
      assert said, stdout[-3000:]
      fetched, total = (int(x.replace(",", "")) for x in said.groups())
      assert fetched <= 0.55 * total, (i, fetched, total)
  for p, _, err in ends:
    assert p.returncode == 0, err[-3000:]
  # Each process read only its devices' pairs of the token store (on the bucket): full,
  # two disjoint halves that together are each step's global batch (killed and resumed
  # steps alike); LoRA, whose model axis spans both hosts, the whole batch on each.
  read = [[json.loads(line) for line in open(tmp_path / f"process_{i}.jsonl")]
          for i in range(2)]
  assert [r["step"] for r in read[0]] == [r["step"] for r in read[1]]
  assert sorted(set(r["step"] for r in read[0])) == list(range(1, steps + 1))
  for a, b in zip(*read):
    assert a["batch"] == b["batch"]
    if lora:
      assert a["pairs"] == b["pairs"] == a["batch"]
    else:
      assert len(a["pairs"]) == len(b["pairs"]) == len(a["batch"]) // 2
      assert sorted(a["pairs"] + b["pairs"]) == sorted(a["batch"])
  straight = tmp_path / "straight"
  train.train(_config(straight, steps=steps, save_every=3,
                      export_hf_dir=str(straight / "export"), **layout),
              devices=jax.devices()[:2 * per_process], **QUIET)
  mcfg = cfg.model_config()
  close = lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
  got, want = out + "/export", str(straight / "export")
  if lora:
    jax.tree.map(close, peft.read_adapter(got, mcfg)[1], peft.read_adapter(want, mcfg)[1])
    got, want = got + "/merged", want + "/merged"
  jax.tree.map(close, hf.load_params(got, mcfg), hf.load_params(want, mcfg))
  # Every step of the killed and resumed 2-process run on the curve of one process
  # that never stopped.
  got, want = _losses(out), _losses(straight)
  assert sorted(got) == list(range(1, steps + 1))
  np.testing.assert_allclose([got[s] for s in range(1, steps + 1)],
                             [want[s] for s in range(1, steps + 1)], rtol=1e-5, atol=1e-5)
