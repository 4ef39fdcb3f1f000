"""`python -m tunix_core.plot RUN_DIR [--out DIR]`: a run's curves as PNG files (loss,
reward accuracy and margin, chosen/rejected log-probs, gradient norm, tokens/s), from
its `metrics.jsonl`; RUN_DIR and DIR may be local or `gs://`. Default DIR:
`RUN_DIR/plots`. Needs matplotlib (`pip install 'tunix-core[plot]'`)."""

import argparse
import sys

from tunix_core.plot import curves
from tunix_core.storage import paths


def main(argv=None) -> int:
  p = argparse.ArgumentParser(prog="python -m tunix_core.plot",
                              description=__doc__.splitlines()[0])
  p.add_argument("run_dir", help="a run's --output_dir (holds metrics.jsonl)")
  p.add_argument("--out", default=None, help="where the PNGs go (default RUN_DIR/plots)")
  a = p.parse_args(argv)
  try:
    rows = curves.read_rows(a.run_dir)
  except FileNotFoundError:
    print(f"plot: error: {a.run_dir} has no metrics.jsonl", file=sys.stderr)
    return 1
  except paths.StorageError as e:
    print(f"plot: error: {e}", file=sys.stderr)
    return 1
  try:
    written = curves.draw(rows, a.out or paths.join(a.run_dir, "plots"))
  except ImportError:
    print("plot: error: needs matplotlib: pip install 'tunix-core[plot]'", file=sys.stderr)
    return 1
  for path in written:
    print(path)
  return 0


if __name__ == "__main__":
  sys.exit(main())
