"""The small trainer run the checkpoint and fault-injection tests share, and its output."""

import json
import os

from tunix_core import config as config_lib

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN = os.path.join(REPO, "data", "train.jsonl")
QUIET = dict(log=lambda *_: None)


def config(out, **overrides) -> config_lib.TrainConfig:
  """6 steps of 8 pairs of 40 tokens, a metrics row every step, small gradient buckets."""
  base = dict(output_dir=str(out), train_data=TRAIN, max_length=40, max_prompt_length=20,
              batch_size=8, steps=6, log_every=1, learning_rate=2e-3, bucket_mb=0.25)
  return config_lib.TrainConfig(**{**base, **overrides})


def rows(out) -> list[dict]:
  with open(os.path.join(out, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f]


def losses(out) -> dict:
  """`{step: loss}` of the train rows in `{out}/metrics.jsonl`."""
  return {r["step"]: r["loss"] for r in rows(out) if "loss" in r}
