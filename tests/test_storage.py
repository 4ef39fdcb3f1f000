"""The path layer (`tunix_core.storage.paths`) and the HF reader on local disk and on a
real Cloud Storage server on loopback (`tests/gcs.py`)."""

import base64
import dataclasses
import hashlib
import itertools
import json
import os
import shutil
import subprocess
import sys
import threading
import time
import urllib.request

import jax
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import gcs as gcs_lib
import runs
from tunix_core import hf
from tunix_core.checkpoints import store as checkpoint
from tunix_core.hf import ranged
from tunix_core.parallel import fsdp
from tunix_core.storage import compose
from tunix_core.storage import paths
from tunix_core.storage import staging

HF = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "hf")


@pytest.mark.parametrize("where", ["local", "gcs"])
def test_paths_mean_the_same_on_disk_and_object_storage(tmp_path, gcs, where):
  root = str(tmp_path / "root") if where == "local" else gcs.bucket("paths") + "/root"
  f = paths.join(root, "a", "b.txt")
  assert not paths.exists(f) and paths.listdir(root) == []
  paths.makedirs(paths.join(root, "a"))
  paths.write_text(f, "one")
  paths.write_text(f, "two")  # replaced whole, never appended
  assert paths.read_text(f) == "two" and paths.isfile(f) and paths.isdir(paths.join(root, "a"))
  assert paths.getsize(f) == 3 and paths.listdir(root) == ["a"]
  with staging.staged_dir(paths.join(root, "staged")) as local:
    with open(os.path.join(local, "x.bin"), "wb") as out:
      out.write(b"\0" * 1000)
    os.makedirs(os.path.join(local, "sub"))
    with open(os.path.join(local, "sub", "y.txt"), "w") as out:
      out.write("y")
  paths.move(paths.join(root, "staged"), paths.join(root + "-moved", "staged"))
  assert not paths.exists(paths.join(root, "staged", "x.bin"))
  with staging.local_copy(paths.join(root + "-moved", "staged")) as local:
    assert sorted(os.listdir(local)) == ["sub", "x.bin"]
    assert open(os.path.join(local, "sub", "y.txt")).read() == "y"
  with paths.open_read(f) as fin:
    fin.seek(1)
    assert fin.read(2) == b"wo"
  paths.remove(paths.join(root, "a"))
  assert paths.listdir(root) == []
  if where == "gcs":  # nothing of ours was written anywhere but the bucket
    assert sorted(gcs_lib.objects(gcs, "gs://paths")) == [
        "root-moved/staged/sub/y.txt", "root-moved/staged/x.bin"]


def test_storage_errors_are_one_line_naming_the_path(gcs):
  with pytest.raises(paths.StorageError, match=r"^writing gs://no-such-bucket/x failed: .*"
                     ) as e:
    paths.write_text("gs://no-such-bucket/x", "data")
  assert "\n" not in str(e.value)
  with pytest.raises(FileNotFoundError):
    paths.read_bytes(gcs.bucket("errors") + "/missing")


@pytest.mark.parametrize("where", ["local", "gcs"])
def test_the_hf_fingerprint_sees_any_changed_byte_without_reading_again(tmp_path, where,
                                                                        request, monkeypatch):
  """A same-shape checkpoint whose middle tensor changed (beyond the first and last MiB
  of a 7 MiB file) changes the fingerprint; an unchanged one is not read again (locally
  the cached digest; on `gs://` the store's checksums, never the bytes)."""
  save = pytest.importorskip("safetensors.numpy", reason="needs the hf extra").save
  from tunix_core.run import source  # pylint: disable=g-import-not-at-top
  from tunix_core.storage import digest  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(digest, "CACHE", str(tmp_path / "digests.json"))
  root = (request.getfixturevalue("gcs").bucket("fingerprint") if where == "gcs"
          else str(tmp_path / "models"))
  tensors = {"a": np.zeros(3 << 18, np.float32), "b": np.zeros(1 << 18, np.float32),
             "c": np.zeros(3 << 18, np.float32)}

  def model(name):
    d = paths.join(root, name)
    paths.makedirs(d)
    paths.write_text(paths.join(d, "config.json"), "{}")
    paths.write_bytes(paths.join(d, "model.safetensors"), save(tensors))
    return d

  base = model("base")
  before = source.fingerprint(base)
  assert source.fingerprint(model("copy")) == before   # the bytes, not where or when
  tensors["b"][1000] = 1.0   # byte 3.0 MiB + 4 kB of a 7 MiB file
  tuned = model("tuned")
  size = lambda d: paths.getsize(paths.join(d, "model.safetensors"))
  assert size(tuned) == size(base)
  after = source.fingerprint(tuned)
  assert after != before
  monkeypatch.setattr(digest, "_sha256", lambda path: pytest.fail(f"{path} read again"))
  assert source.fingerprint(tuned) == after


def test_gcs_digests_are_the_bytes_checksums_never_an_etag_or_generation(gcs, monkeypatch):
  """Two objects with the same bytes but other ETags and generations (as a copy or a
  re-upload gets on Cloud Storage; the emulator's ETags follow the content, so the
  metadata lookup is stubbed to give each lookup its own) have one digest: the bytes'
  CRC32C and MD5 as GCS spells them. One changed byte changes it."""
  crc32c = pytest.importorskip("google_crc32c", reason="gcsfs's CRC32C")
  from tunix_core.storage import digest  # pylint: disable=g-import-not-at-top
  bucket = gcs.bucket("digests")
  data = bytes(range(256)) * 64
  changed = data[:5000] + bytes([data[5000] ^ 1]) + data[5001:]
  for name, body in (("a", data), ("copy", data), ("changed", changed)):
    gcs_lib.upload_bytes(gcs, body, f"{bucket}/{name}")
  lookups, real = itertools.count(1), digest._object_info  # pylint: disable=protected-access

  def info(path):
    n = next(lookups)
    return {**real(path), "etag": f"CN{n}EAE=", "ETag": f'"{n}"', "generation": str(1000 + n),
            "metageneration": str(n)}

  monkeypatch.setattr(digest, "_object_info", info)
  b64 = lambda raw: base64.b64encode(raw).decode()
  want = (f"store:crc32c={b64(crc32c.value(data).to_bytes(4, 'big'))},"
          f"md5Hash={b64(hashlib.md5(data).digest())}")
  assert digest.content_digest(f"{bucket}/a") == want
  assert digest.content_digest(f"{bucket}/copy") == want
  assert digest.content_digest(f"{bucket}/changed") != want


def test_a_checkpoint_fingerprinted_with_etags_still_resumes(gcs):
  """A checkpoint saved by an earlier version holds an HF fingerprint of the objects' CRC32C,
  MD5 and ETag (spelled out here as that code computed it): resuming against the same
  objects passes `resume.source_mismatch` as `run.loop` calls it, against a changed byte
  it does not."""
  from tunix_core.checkpoints import resume  # pylint: disable=g-import-not-at-top
  from tunix_core.run import source  # pylint: disable=g-import-not-at-top
  model, weights = gcs.bucket("legacy") + "/model", bytes(range(256)) * 16
  gcs_lib.upload_bytes(gcs, b"{}", model + "/config.json")
  gcs_lib.upload_bytes(gcs, weights, model + "/model.safetensors")
  with urllib.request.urlopen(f"{gcs.url}/storage/v1/b/legacy/o/model%2Fmodel.safetensors",
                              timeout=30) as r:
    meta = json.load(r)
  old = hashlib.sha256(
      b"config.json:2:{}" + f"model.safetensors:{len(weights)}:store:crc32c={meta['crc32c']},"
      f"md5Hash={meta['md5Hash']},etag={meta['etag']}".encode()).hexdigest()[:32]
  saved = {"hf_model_dir": model, "hf_fingerprint": old}
  now = lambda: {"hf_model_dir": model, "hf_fingerprint": source.fingerprint(model)}
  legacy = lambda: source.fingerprint(model, legacy=True)
  assert now()["hf_fingerprint"] != old  # today's leaves the ETag out
  assert "hf_fingerprint" in resume.source_mismatch(saved, now())
  assert resume.source_mismatch(saved, now(), legacy) is None
  gcs_lib.upload_bytes(gcs, weights[:-1] + b"\0", model + "/model.safetensors")
  assert "hf_fingerprint" in resume.source_mismatch(saved, now(), legacy)


def test_ranged_reads_equal_numpy_and_the_hf_reader_reads_gcs(tmp_path, gcs):
  from safetensors.numpy import save_file  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(0)
  tensors = {"f32": rng.standard_normal((6, 5, 3)).astype(np.float32),
             "bf16": rng.standard_normal((7, 4)).astype(ml_dtypes.bfloat16),
             "i32": np.arange(5, dtype=np.int32)}
  save_file(tensors, str(tmp_path / "t.safetensors"))
  remote = gcs.bucket("ranged") + "/t.safetensors"
  gcs_lib.upload(gcs, str(tmp_path / "t.safetensors"), remote)
  with ranged.RangedFile(remote) as f:
    assert sorted(f.keys()) == sorted(tensors)
    for name, want in tensors.items():
      s = f.get_slice(name)
      assert s.get_shape() == list(want.shape)
      np.testing.assert_array_equal(s[()], want)
      np.testing.assert_array_equal(s[2:4], want[2:4])
      if want.ndim > 1:
        np.testing.assert_array_equal(s[1:5, 1:3], want[1:5, 1:3])
  # A whole HF directory read from the bucket, each device's block by range.
  model_dir = gcs.bucket("ranged") + "/llama3"
  gcs_lib.upload(gcs, os.path.join(HF, "llama3"), model_dir)
  cfg = hf.read_config(model_dir)
  assert cfg == hf.read_config(os.path.join(HF, "llama3"))
  mesh = jax.make_mesh((8,), ("data",))
  specs = jax.tree.map(lambda x: P(*([None] * (x.ndim - 1) + ["data"])) if x.shape[-1] % 8 == 0
                       else P(), hf.load_params(os.path.join(HF, "llama3"), cfg))
  shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), specs,
                           is_leaf=lambda x: isinstance(x, P))
  got = hf.load_params(model_dir, cfg, shardings=shardings)
  want = hf.load_params(os.path.join(HF, "llama3"), cfg)
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(got), jax.device_get(want))
  # As FSDP splits them (the largest dimension: for most projections the file's
  # columns), each device fetches only its own rows of the file: 8 devices fetch the
  # file about once, not a whole tensor each (a host with half the devices: about half).
  fsdp_shardings = jax.tree.map(lambda s: NamedSharding(mesh, s),
                                fsdp.logical_specs(want, 8), is_leaf=lambda x: isinstance(x, P))
  before = ranged.RangedFile.fetched
  got = hf.load_params(model_dir, cfg, shardings=fsdp_shardings)
  fetched = ranged.RangedFile.fetched - before
  jax.tree.map(lambda g, s: (g.sharding.is_equivalent_to(s, g.ndim) or
                             pytest.fail(f"{g.sharding} is not {s}")), got, fsdp_shardings)
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(got), jax.device_get(want))
  size = os.path.getsize(os.path.join(HF, "llama3", "model.safetensors"))
  assert fetched <= 1.1 * size, (fetched, size)


def _trainer(args, env_extra=None, cwd=None, timeout=600):
  """Runs trainer.py with `args` on 8 CPU devices; returns the CompletedProcess."""
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8",
             JAX_PLATFORMS="cpu", **(env_extra or {}))
  return subprocess.run([sys.executable, os.path.join(runs.REPO, "trainer.py"), *args],
                        env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)


def _pod_inputs(tmp_path, server, bucket: str) -> dict:
  """Uploads the shipped train pairs, the first 64 eval pairs (each evaluation of the
  runs then takes 8 batches, not 64) and a tiny HF model directory (with a tokenizer)
  to `bucket`; returns the path flags that read them from there."""
  from tunix_core import model as model_lib  # pylint: disable=g-import-not-at-top
  cfg = dataclasses.replace(model_lib.preset("tiny"), vocab_size=320)
  model_dir = tmp_path / "model"
  hf.save_params(model_lib.init_params(jax.random.PRNGKey(3), cfg), cfg, str(model_dir),
                 dtype="float32")
  for name in ("tokenizer.json", "tokenizer_config.json"):
    shutil.copy(os.path.join(HF, "tokenizer", name), model_dir)
  gcs_lib.upload(server, str(model_dir), f"{bucket}/model")
  gcs_lib.upload(server, runs.TRAIN, f"{bucket}/data/train.jsonl")
  with open(os.path.join(runs.REPO, "data", "eval.jsonl"), "rb") as f:
    gcs_lib.upload_bytes(server, b"".join(f.readlines()[:64]), f"{bucket}/data/eval.jsonl")
  return {"hf_model_dir": f"{bucket}/model", "train_data": f"{bucket}/data/train.jsonl",
          "eval_data": f"{bucket}/data/eval.jsonl"}


def _ckpt_steps(out):
  ckpt = checkpoint.Checkpointer(paths.join(out, "checkpoints"))
  try:
    return ckpt.steps(), {s: ckpt.read_meta(s)["fingerprints"] for s in ckpt.steps()}
  finally:
    ckpt.close()


def test_close_waits_for_orbaxs_removal_of_leftover_temporary_directories(tmp_path):
  """`Checkpointer.close` waits for Orbax's background removal of leftover temporary
  directories (else it can remove a step a resuming run is saving). Orbax has no public
  wait, so the private method is called: if Orbax renames it, this fails rather than
  the wait silently doing nothing."""
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  assert hasattr(ocp.CheckpointManager, "_maybe_await_cleanup_tmp_directory")
  leftover = tmp_path / "3.orbax-checkpoint-tmp-1765000000"
  (leftover / "state").mkdir(parents=True)
  checkpoint.Checkpointer(str(tmp_path)).close()
  assert not leftover.exists()


@pytest.mark.slow
def test_a_run_on_gcs_trains_resumes_falls_back_and_exports(tmp_path, gcs):
  """Output, data, HF model and compilation cache all on `gs://`: a run killed (SIGKILL) after its step-4
  checkpoint resumes bit-exactly (metrics.jsonl keeps its rows up to the restored step,
  then one row per step); a damaged newest step (bytes flipped in an object) is moved
  aside and the run falls back past it; only --keep steps stay; the export lands on
  `gs://`; and nothing is written to local disk but the temporary directory."""
  bucket = gcs.bucket("pod")
  flags = dict(_pod_inputs(tmp_path, gcs, bucket), max_length=48, max_prompt_length=24,
               batch_size=8, log_every=1, save_every=2, keep=2, eval_every=4,
               learning_rate=1e-3, compilation_cache_dir=f"{bucket}/compile_cache")
  args = lambda out, **kw: [f"--{k}={v}" for k, v in {**flags, "output_dir": out, **kw}.items()]
  work, tmp, home = (tmp_path / d for d in ("work", "tmp", "home"))
  for d in (work, tmp, home):
    d.mkdir()
  # The measured-peak cache of CPU devices (none on TPU) goes to XDG_CACHE_HOME.
  local = dict(TMPDIR=str(tmp), HOME=str(home), XDG_CACHE_HOME=str(tmp / "cache"))

  straight = _trainer(args(f"{bucket}/straight", steps=8), local, work)
  assert straight.returncode == 0, straight.stderr[-3000:]
  run = f"{bucket}/run"
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8",
             JAX_PLATFORMS="cpu", **local)
  proc = subprocess.Popen([sys.executable, os.path.join(runs.REPO, "trainer.py"),
                           *args(run, steps=8)], env=env, cwd=work,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  deadline = time.time() + 300
  while "4/commit_success.txt" not in "".join(gcs_lib.objects(gcs, f"{run}/checkpoints")):
    assert proc.poll() is None and time.time() < deadline, proc.communicate()[1][-3000:]
    time.sleep(0.1)
  proc.kill()
  proc.wait()
  resumed = _trainer(args(run, steps=8), local, work)
  assert resumed.returncode == 0, resumed.stderr[-3000:]
  assert "resumed from step" in resumed.stdout
  # One compilation cache on object storage: the first run stores the step, a resume
  # (another process, another step number) loads it.
  assert (f"step 1: compiled in " in straight.stdout and
          f"(not in the compilation cache at {bucket}/compile_cache; stored for the next "
          "start)" in straight.stdout)
  assert (f"step 5: loaded from the compilation cache in " in resumed.stdout and
          f"({bucket}/compile_cache)" in resumed.stdout)
  assert "again at its first call" not in straight.stdout + resumed.stdout
  got, want = runs.rows(run), runs.rows(f"{bucket}/straight")
  assert [r["step"] for r in got] == [r["step"] for r in want]  # one row per logged step
  assert runs.losses(run) == runs.losses(f"{bucket}/straight")  # bit-identical
  steps, prints = _ckpt_steps(run)
  assert steps == [6, 8] and prints[8] == _ckpt_steps(f"{bucket}/straight")[1][8]

  # Damage step 8: flip bytes in its largest array object, then train on to step 10.
  objs = gcs_lib.objects(gcs, f"{run}/checkpoints/8/state")
  name = max((n for n in objs if "/d/" in f"/{n}"), key=objs.get)
  data = bytearray(gcs_lib.download(gcs, f"{run}/checkpoints/8/state/{name}"))
  data[len(data) // 2:len(data) // 2 + 64] = bytes(b ^ 0xFF for b in data[len(data) // 2:
                                                                        len(data) // 2 + 64])
  gcs_lib.upload_bytes(gcs, bytes(data), f"{run}/checkpoints/8/state/{name}")
  again = _trainer(args(run, steps=10, export_hf_dir=f"{bucket}/export"), local, work)
  assert again.returncode == 0, again.stderr[-3000:]
  assert "checkpoint step 8 " in again.stdout and "resumed from step 6 " in again.stdout
  assert any(n.startswith("8-") for n in paths.listdir(f"{run}/checkpoints.rejected"))
  assert _ckpt_steps(run)[0] == [8, 10]  # --keep=2
  exported = gcs_lib.objects(gcs, f"{bucket}/export")
  assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(exported)
  assert os.listdir(work) == [] and os.listdir(home) == []  # local disk: TMPDIR only


def _until(cond, proc, timeout=300):
  deadline = time.time() + timeout
  while not cond():
    assert proc.poll() is None and time.time() < deadline, proc.communicate()[1][-3000:]
    time.sleep(0.1)


def _committed(server, out) -> list[int]:
  names = gcs_lib.objects(server, f"{out}/checkpoints")
  return sorted(int(n.split("/")[0]) for n in names
                if n.count("/") == 1 and n.endswith("/commit_success.txt"))


def _one_error_line(proc, seconds: float, codes) -> str:
  """The trainer ended with a status in `codes` within `seconds`, with one error line."""
  out, err = proc.communicate(timeout=seconds)
  assert proc.returncode in codes, err[-3000:]
  errors = [l for l in err.splitlines() if l.startswith("trainer.py: error:")]
  assert len(errors) == 1 and len(err.splitlines()) <= 8, err
  return errors[0]


ERROR_SECONDS = 120


@pytest.mark.slow  # 1,000 rows through a proxy: a few seconds
def test_metrics_on_object_storage_are_appended_not_uploaded_again(gcs, monkeypatch):
  """`MetricsWriter` on `gs://`: 1,000 rows as `--log_every=1` writes them, synced as a
  save every 100 steps does, send at most twice the final file's bytes (counted by a
  proxy in front of the server: today's re-upload of the whole file sent 500x), and an
  upload that fails past the retries is tried again without ending the run. Every row
  lands, in order; the whole rewrite that keeps a composed object under Cloud Storage's
  1,024 components keeps every row too."""
  import gcsfs  # pylint: disable=g-import-not-at-top
  from tunix_core.run import metrics  # pylint: disable=g-import-not-at-top
  proxy = gcs_lib.Proxy(gcs)
  for k, v in gcs_lib.env(proxy.url).items():
    monkeypatch.setenv(k, v)
  gcsfs.GCSFileSystem.clear_instance_cache()   # its clients keep the server's address
  failing = iter([False, False, True])         # the third upload fails
  append = compose.append_bytes

  def flaky(path, data, size):
    if next(failing, False):
      raise paths.StorageError(f"appending to {path} failed: ConnectionError: injected")
    append(path, data, size)

  monkeypatch.setattr(compose, "append_bytes", flaky)
  out, logged = gcs.bucket("metrics") + "/run", []
  try:
    writer = metrics.MetricsWriter(out, log=logged.append)
    rows = [{"step": i, "loss": 0.6931 - i * 1e-4, "rewards/accuracies": 0.5,
             "rewards/margins": i * 1e-3, "tokens_per_sec": 1234.5, "mfu": 0.41}
            for i in range(1, 1001)]
    for row in rows:
      writer.write(row)
      if row["step"] % 100 == 0:
        writer.sync()
    writer.close()
    final = gcs_lib.download(gcs, out + "/metrics.jsonl")
    assert final.decode().splitlines() == [json.dumps(r) for r in rows]
    assert proxy.uploaded <= 2 * len(final), (proxy.uploaded, len(final))
    assert len(logged) == 1 and "injected; keeping the rows" in logged[0], logged
    assert sorted(gcs_lib.objects(gcs, out)) == ["metrics.jsonl"]  # no part left behind
    monkeypatch.setattr(metrics, "APPENDS_PER_REWRITE", 2)
    writer = metrics.MetricsWriter(out, resume_step=500, log=logged.append)
    for row in rows[500:505]:
      writer.write(row)
      writer.sync()   # one upload each: append, append, rewrite, append, append
    writer.close()
    assert gcs_lib.download(gcs, out + "/metrics.jsonl").decode().splitlines() == [
        json.dumps(r) for r in rows[:505]]
  finally:
    gcsfs.GCSFileSystem.clear_instance_cache()
    proxy.stop()


def test_a_compose_whose_reply_is_lost_appends_its_rows_once(gcs, monkeypatch):
  """`MetricsWriter` on `gs://` when composes go through but their replies are lost
  (raised after the real call): a dropped connection (tried again by the path layer), a
  412 (what the client's own resend of it gets, as the generation moved on) and an
  error past the path layer's retries (the upload tried again by the metrics thread,
  after another row came in). Every row is in the file once, in order, and no part is
  left."""
  import gcsfs  # pylint: disable=g-import-not-at-top
  from tunix_core.run import metrics  # pylint: disable=g-import-not-at-top
  real = gcsfs.GCSFileSystem.call
  lost = [ConnectionResetError("reply lost"), FileExistsError("412"), OSError("reply lost")]
  rows = [{"step": i, "loss": 0.5 + i} for i in range(1, 9)]

  def call(self, method, path, *args, **kwargs):
    out = real(self, method, path, *args, **kwargs)
    if path.endswith("/compose") and lost:
      error = lost.pop(0)
      if not lost:  # row 4 arrives while row 3's upload waits to be tried again
        threading.Timer(0.05, writer.write, [rows[3]]).start()
      raise error
    return out

  monkeypatch.setattr(gcsfs.GCSFileSystem, "call", call)
  out, logged = gcs.bucket("lost-replies") + "/run", []
  writer = metrics.MetricsWriter(out, log=logged.append)
  for row in rows[:3]:
    writer.write(row)
    writer.sync()  # one compose per row: rows 1, 2 and 3 lose their replies
  for row in rows[4:]:
    writer.write(row)
  writer.close()
  assert not lost
  assert gcs_lib.download(gcs, out + "/metrics.jsonl").decode().splitlines() == [
      json.dumps(r) for r in rows]
  assert len(logged) == 1 and "reply lost; keeping the rows" in logged[0], logged
  assert sorted(gcs_lib.objects(gcs, out)) == ["metrics.jsonl"]


@pytest.mark.slow
def test_storage_failures_end_in_one_line_and_keep_the_last_checkpoint():
  """A bucket that does not exist, objects that cannot be written (403 from a proxy in
  front of the server) and a server killed mid-run each end the trainer with one error
  line within `ERROR_SECONDS`; the newest complete checkpoint stays, and resumes."""
  server = gcs_lib.Server()
  proxy = gcs_lib.Proxy(server)
  server.bucket("pod")
  base = ["--train_data=" + runs.TRAIN, "--max_length=48", "--max_prompt_length=24",
          "--batch_size=8", "--log_every=1", "--save_every=2"]

  def spawn(url, out, *extra):
    env = dict(os.environ, **gcs_lib.env(url), JAX_PLATFORMS="cpu",
               XLA_FLAGS="--xla_force_host_platform_device_count=8")
    return subprocess.Popen([sys.executable, os.path.join(runs.REPO, "trainer.py"),
                             f"--output_dir={out}", *base, *extra], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

  try:
    # The missing bucket and the denied writes run side by side (the server outlives both).
    no_bucket = spawn(server.url, "gs://no-such-bucket/run", "--steps=2")
    denied = "gs://pod/denied"
    proc = spawn(proxy.url, denied, "--steps=500")
    _until(lambda: _committed(server, denied) == [2], proc)
    proxy.deny = "denied/checkpoints/4"  # step 2 may still be finishing its writes
    line = _one_error_line(proc, ERROR_SECONDS, [4])
    assert "writing checkpoint step 4 to gs://pod/denied/checkpoints failed" in line
    assert line.endswith("newest complete checkpoint: step 2 (library messages in "
                         + line.split("(library messages in ")[-1])
    assert _committed(server, denied) == [2]
    line = _one_error_line(no_bucket, ERROR_SECONDS, [1])
    # The first write under the output directory (the token store) names its path.
    assert "gs://no-such-bucket/run/" in line and "no such bucket" in line

    killed = "gs://pod/killed"
    proc = spawn(proxy.url, killed, "--steps=500")
    _until(lambda: 2 in _committed(server, killed), proc)
    proxy.kill()
    # Whichever write meets the dead server first names itself: a checkpoint's (status
    # 4, naming the newest complete step) or metrics.jsonl's (status 1). It used to hang
    # now and then at exit, in Orbax's threads of the failed save (`cli.train._exit_now`).
    line = _one_error_line(proc, ERROR_SECONDS, [1, 4])
    assert "gs://pod/killed" in line and "failed" in line
    # What was complete stays (a later step may have committed before the kill), and
    # the newest resumes.
    newest = max(_committed(server, killed))
    assert newest >= 2
    resumed = spawn(server.url, killed, f"--steps={newest + 1}", "--resume=required")
    out, err = resumed.communicate(timeout=300)
    assert resumed.returncode == 0 and f"resumed from step {newest}" in out, err[-3000:]
  finally:
    proxy.stop()
    server.stop()
