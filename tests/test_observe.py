"""Watching a run (`tunix_core.run.observe`, `tunix_core.plot`): TensorBoard event files,
an offline W&B run and the PNG curves hold what `metrics.jsonl` holds; a profile of the
chosen steps is written. One run, its output on `gs://` (the loopback server of
`tests/gcs.py`), so the uploads of each are checked too."""

import glob
import json
import os
import struct

import numpy as np
import pytest

import runs
from tunix_core.plot import __main__ as plot_main
from tunix_core.run import loop as train
from tunix_core.storage import paths
from tunix_core.storage import staging


def _wandb_history(run_file: str) -> list[dict]:
  """The history rows of a W&B `.wandb` file: LevelDB-log framed `Record` protobufs (a
  7-byte ":W&B" header; 32 KiB blocks of records, each a 7-byte header (crc, length,
  type: full, first, middle, last) and its bytes)."""
  from wandb.proto import wandb_internal_pb2  # pylint: disable=g-import-not-at-top
  data = open(run_file, "rb").read()
  assert data[:4] == b":W&B"
  pos, parts, rows = 7, [], []
  while pos + 7 <= len(data):
    left = 32768 - pos % 32768
    _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
    if left < 7 or (kind == 0 and length == 0):
      pos += left
      continue
    parts.append(data[pos + 7:pos + 7 + length])
    pos += 7 + length
    if kind in (1, 4):  # a full record, or the last part of one
      record = wandb_internal_pb2.Record()
      record.ParseFromString(b"".join(parts))
      parts = []
      if record.WhichOneof("record_type") == "history":
        rows.append({i.key or "/".join(i.nested_key): json.loads(i.value_json)
                     for i in record.history.item})
  return rows


@pytest.mark.slow
def test_tensorboard_wandb_plots_and_profile_hold_the_metrics(tmp_path, gcs, monkeypatch):
  event_accumulator = pytest.importorskip(
      "tensorboard.backend.event_processing.event_accumulator")
  tensor_util = pytest.importorskip("tensorboard.util.tensor_util")
  pytest.importorskip("wandb")
  pytest.importorskip("matplotlib")
  monkeypatch.setenv("WANDB_MODE", "offline")
  monkeypatch.setenv("WANDB_SILENT", "true")
  out = gcs.bucket("observe") + "/run"
  # 64 of the 512 eval pairs: what is checked is where the eval rows land, and each of
  # the two evaluations (one inside the profiled steps) then takes 8 batches, not 64.
  eval_data = tmp_path / "eval.jsonl"
  with open(f"{runs.REPO}/data/eval.jsonl") as f:
    eval_data.write_text("".join(f.readlines()[:64]))
  cfg = runs.quickstart_config(out, steps=4, log_every=1, eval_every=2, save_every=0,
                               batch_size=8, wandb_project="tunix-tests", profile_steps="2:3",
                               sample_every=2, sample_max_new_tokens=3,
                               eval_data=str(eval_data))
  lines = []
  train.train(cfg, log=lines.append)
  assert f"TensorBoard: {out}/tensorboard" in lines
  rows = runs.rows(out)
  want = {}  # (tag, step) -> value, as metrics.jsonl has them
  for row in rows:
    want.update({(k, row["step"]): v for k, v in row.items() if k != "step"})
  assert ("eval/loss", 4) in want and ("grad_norm", 3) in want
  samples = [json.loads(l) for l in paths.read_text(paths.join(out, "samples.jsonl")).split("\n")
             if l]
  want_samples = {s: [[r["prompt"], r["completion"]] for r in samples if r["step"] == s]
                  for s in (0, 2, 4)}
  assert all(want_samples.values())

  with staging.local_copy(out) as local:
    acc = event_accumulator.EventAccumulator(os.path.join(local, "tensorboard"),
                                             size_guidance={"tensors": 0})
    acc.Reload()
    # tensorboard's writer stores scalars as v2 summaries: scalar tensors of the scalars
    # plugin, which TensorBoard draws as scalars.
    got = {(tag, e.step): float(tensor_util.make_ndarray(e.tensor_proto))
           for tag in acc.Tags()["tensors"] if tag != "samples" for e in acc.Tensors(tag)}
    assert set(got) == set(want)
    # Samples: a text-plugin table per sampling step, a header row, then prompt/completion.
    assert acc.SummaryMetadata("samples").plugin_data.plugin_name == "text"
    tables = {e.step: [[c.decode() for c in row]
                       for row in tensor_util.make_ndarray(e.tensor_proto)]
              for e in acc.Tensors("samples")}
    assert tables == {s: [["prompt", "completion"]] + rows for s, rows in want_samples.items()}
    for key, value in want.items():
      assert got[key] == pytest.approx(value, rel=1e-6), key  # stored as float32

    (run_file,) = glob.glob(os.path.join(local, "wandb", "wandb", "offline-run-*",
                                         "run-*.wandb"))
    history = {}
    for row in _wandb_history(run_file):
      history.update({(k, row["_step"]): v for k, v in row.items() if not k.startswith("_")})
    tables = {s: {} for s in want_samples}  # W&B's history keys of a table: samples/<field>
    for key, step in [k for k in history if k[0].startswith("samples/")]:
      tables[step][key.partition("/")[2]] = history.pop((key, step))
    assert history == want
    for s, rows in want_samples.items():  # the tables W&B stored, as files of the run
      assert tables[s]["_type"] == "table-file" and tables[s]["nrows"] == len(rows)
      stored = json.load(open(os.path.join(os.path.dirname(run_file), "files",
                                           tables[s]["path"]), encoding="utf-8"))
      assert stored["columns"] == ["step", "prompt", "completion"]
      assert stored["data"] == [[s] + r for r in rows]

    traces = [f for f in glob.glob(os.path.join(local, "profile", "**", "*"), recursive=True)
              if os.path.isfile(f)]
    assert traces and sum(os.path.getsize(f) for f in traces) > 1000

  assert plot_main.main([out]) == 0
  with staging.local_copy(paths.join(out, "plots")) as local:
    names = sorted(os.listdir(local))
    assert {"loss.png", "accuracy.png", "margin.png", "logps.png", "grad_norm.png",
            "tokens_per_sec.png"} <= set(names)
    from matplotlib import image  # pylint: disable=g-import-not-at-top
    loss = image.imread(os.path.join(local, "loss.png"))
    assert loss.shape[0] > 200 and loss.shape[1] > 400
    rgb = loss[..., :3]
    # A curve is drawn: pixels in matplotlib's first line colour (C0, #1f77b4).
    assert np.sum(np.all(np.abs(rgb - np.array([0x1f, 0x77, 0xb4]) / 255) < 0.05, -1)) > 100
