"""A run's train and eval curves drawn from its `metrics.jsonl` (local or `gs://`), one
PNG per quantity, with matplotlib (the `plot` extra; Agg, no display needed).

Each figure plots its keys against the step: train rows as lines, the `eval/` rows of
the same keys as lines with markers. A figure whose keys the run never logged is left
out (e.g. `mfu` on a run without a known peak).
"""

import io

from tunix_core.run import metrics
from tunix_core.storage import paths

# File name -> (title, y label, metrics keys).
FIGURES = {
    "loss": ("DPO loss", "loss", ("loss",)),
    "accuracy": ("Reward accuracy", "fraction of pairs", ("rewards/accuracies",)),
    "margin": ("Reward margin", "beta x log-ratio margin", ("rewards/margins",)),
    "logps": ("Log-probs of the responses", "summed log-prob",
              ("logps/chosen", "logps/rejected")),
    "drift": ("Drift from the reference (eval)", "per-token log-ratio / log-prob",
              ("kl/chosen", "kl/rejected", "logps/chosen_per_token")),
    "grad_norm": ("Gradient norm (before clipping)", "global norm", ("grad_norm",)),
    "tokens_per_sec": ("Throughput", "tokens / s", ("tokens_per_sec",)),
}


def read_rows(run_dir: str) -> list[dict]:
  """The rows of `{run_dir}/metrics.jsonl` (torn or foreign lines skipped)."""
  lines = paths.read_text(paths.join(run_dir, "metrics.jsonl")).splitlines()
  return [row for row in map(metrics.parse_row, lines) if row is not None]


def series(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
  """`(steps, values)` of the rows that carry `key`."""
  points = [(r["step"], float(r[key])) for r in rows if isinstance(r.get(key), (int, float))]
  return [s for s, _ in points], [v for _, v in points]


def draw(rows: list[dict], out_dir: str) -> list[str]:
  """Writes one PNG per figure of `FIGURES` that has data to `out_dir` (local or remote);
  returns the paths written."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  from matplotlib import pyplot as plt  # pylint: disable=g-import-not-at-top
  written = []
  paths.makedirs(out_dir)
  for name, (title, ylabel, keys) in FIGURES.items():
    lines = [(key, series(rows, key)) for key in keys]
    lines += [(f"eval/{key}", series(rows, f"eval/{key}")) for key in keys]
    lines = [(label, xy) for label, xy in lines if xy[0]]
    if not lines:
      continue
    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    for label, (x, y) in lines:
      ax.plot(x, y, label=label, marker="o" if label.startswith("eval/") else None)
    ax.set(title=title, xlabel="step", ylabel=ylabel)
    ax.grid(alpha=0.3)
    ax.legend()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", bbox_inches="tight")
    plt.close(fig)
    path = paths.join(out_dir, f"{name}.png")
    paths.write_bytes(path, buffer.getvalue())
    written.append(path)
  return written
