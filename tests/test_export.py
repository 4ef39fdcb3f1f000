"""What a pod gathers to its writing host, on two processes: the export (each tensor in
pieces of a bounded size, `parallel.mesh.to_host`, never replicated over every device;
the files equal to one process's export of the same weights) and the precomputed
reference log-probs (received by the writer only; the table equal to one process's)."""

import glob
import json
import os
import socket
import subprocess
import sys

import jax
import numpy as np
import pytest

from tunix_core import hf

pytest.importorskip("safetensors", reason="the export: needs the hf extra")
TESTS = os.path.dirname(os.path.abspath(__file__))
FIXTURE = os.path.join(TESTS, "fixtures", "hf", "llama3")


def _launch(script: str, *args) -> None:
  """`tests/{script} 127.0.0.1:PORT PROCESS_ID *args` on 2 processes x 4 CPU devices."""
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4",
             JAX_PLATFORMS="cpu")
  procs = [subprocess.Popen(
      [sys.executable, os.path.join(TESTS, script), f"127.0.0.1:{port}", str(i),
       *map(str, args)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
      for i in range(2)]
  for p in procs:
    _, err = p.communicate(timeout=300)
    assert p.returncode == 0, err[-3000:]


@pytest.mark.slow  # two processes
def test_two_processes_gather_bounded_pieces_and_export_what_one_process_does(tmp_path):
  """`tests/export_process.py` on 2 processes x 4 CPU devices with a budget of 8 KiB of
  device bytes per gather round, below the 30 KiB of the largest tensor (the embedding,
  whose blocks lie on one process each): every array handed to `process_allgather` is
  a NumPy piece within the budget (gathering the tensor itself hands it a device array
  of the whole tensor, replicated on every device by the gather)."""
  budget = 8192
  _launch("export_process.py", tmp_path, budget)

  for i in range(2):
    with open(tmp_path / f"gathered_{i}.json") as f:
      seen = json.load(f)
    # What the export hands to the gather spans both processes, replicated nowhere; the
    # embeddings' blocks, on one process each, take 4 rounds of 4 KiB pieces each.
    assert all(t["processes"] == 2 and not t["replicated"] for t in seen["fetched"])
    assert any(t["lone"] for t in seen["fetched"])  # blocks only one process can send
    for piece in seen["export"] + seen["kept"]:
      assert piece["numpy"] and 2 * piece["nbytes"] <= budget, piece
    assert len(seen["export"]) >= 8 and len(seen["kept"]) >= len(seen["export"])

  one = tmp_path / "one"
  cfg = hf.read_config(FIXTURE)
  hf.save_params(hf.load_params(FIXTURE, cfg), cfg, str(one), src_dir=FIXTURE,
                 dtype="float32")
  two = tmp_path / "export"
  assert sorted(os.listdir(two)) == sorted(os.listdir(one))
  for name in os.listdir(one):
    assert (two / name).read_bytes() == (one / name).read_bytes(), name


@pytest.mark.slow  # two processes
def test_two_processes_precompute_the_reference_received_by_the_writer_only(tmp_path):
  """`tests/ref_cache_process.py`: the reference pass over 40 pairs (5 batches) on 2 x 4
  CPU devices with one cache directory: process 0 (the writer) receives every batch's
  log-probs, process 1 none of them though it takes part in every gather, and the table
  written equals one process's pass on 8 devices."""
  import ref_cache_process  # pylint: disable=g-import-not-at-top  (tests/, as runs)
  with open(ref_cache_process.runs.TRAIN) as f:
    pairs = [next(f) for _ in range(40)]
  for out in (tmp_path / "two", tmp_path / "one"):
    out.mkdir()
    (out / "pairs.jsonl").write_text("".join(pairs))
  _launch("ref_cache_process.py", tmp_path / "two")
  kept = [json.loads((tmp_path / "two" / f"kept_{i}.json").read_text()) for i in range(2)]
  assert len(kept[0]) == len(kept[1]) == 5
  assert all(kept[0]) and not any(kept[1])
  ref_cache_process.precompute(str(tmp_path / "one"), jax.devices())
  tables = [glob.glob(str(tmp_path / run / "cache" / "ref_logps_*.npy")) for run in ("two", "one")]
  assert [len(t) for t in tables] == [1, 1]
  assert os.path.basename(tables[0][0]) == os.path.basename(tables[1][0])  # the same key
  two, one = (np.load(t[0]) for t in tables)
  assert two.shape == one.shape and two.size > 40 and np.all(two <= 0)
  np.testing.assert_allclose(two, one, rtol=1e-5, atol=1e-5)
