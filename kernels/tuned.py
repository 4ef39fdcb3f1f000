"""Tiles measured on a chip: one JSON table per kernel package and TPU generation
(`{package}/tuned/{chip}.json`, written by `benchmarks/tune_tiles.py`, shipped as package
data), read by the packages' `BlockSizes.get_default`.

A table is `{"chip", "date", "jax", ..., "entries": [{...}, ...]}`; each entry names the
problem it was measured on and the tiles that ran fastest, with every candidate's time.
"""

import functools
import json
import math
import os


@functools.cache
def load(directory: str, chip_name: str) -> tuple[dict, ...]:
  """The entries of `directory/{chip_name}.json`, () where no table is shipped."""
  path = os.path.join(directory, f"{chip_name}.json")
  if not os.path.exists(path):
    return ()
  with open(path, encoding="utf-8") as f:
    return tuple(json.load(f)["entries"])


def nearest(entries, field: str, value: int | None) -> dict | None:
  """The entry whose `field` is nearest `value` by ratio, within 2x of it (the larger of
  two equally near; the largest when `value` is None), or None: a problem far from every
  measured one is not extrapolated to."""
  if value:
    entries = [e for e in entries if abs(math.log2(e[field] / value)) <= 1]
  if not entries:
    return None
  if not value:
    return max(entries, key=lambda e: e[field])
  return min(entries, key=lambda e: (abs(math.log(e[field] / value)), -e[field]))


def lookup(directory: str, chip_name: str, field: str, value: int | None, **match
           ) -> dict | None:
  """The entry of `directory/{chip_name}.json` whose keys equal `match` and whose `field`
  is `nearest` to `value`, or None."""
  return nearest([e for e in load(directory, chip_name)
                  if all(e[k] == v for k, v in match.items())], field, value)
