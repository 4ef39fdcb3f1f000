"""The trainer's flags as documentation: the group headings and the Markdown flag table
generated from `TrainConfig`'s fields (`docs/training.md` holds exactly this)."""

import dataclasses

from tunix_core.training.config import CHOICES
from tunix_core.training.config import TrainConfig

# The headings of the flag groups (`metadata["group"]`), in the docs' order.
GROUPS = {"run": "Run and output", "data": "Data", "model": "Model", "lora": "LoRA",
          "optimizer": "Optimizer", "loss": "Loss", "online": "Online DPO",
          "parallel": "Parallelism and kernels",
          "aot": "Ahead-of-time compilation", "observe": "Watching a run"}


def flag_table() -> str:
  """The trainer's run flags as Markdown, one table per group (flag, default, help),
  generated from the fields: `docs/training.md` holds exactly this (a test checks it)."""
  out = []
  for group, title in GROUPS.items():
    out += [f"**{title}**", "", "| flag | default | what |", "|---|---|---|"]
    for f in dataclasses.fields(TrainConfig):
      if f.metadata["group"] != group:
        continue
      choices = CHOICES.get(f.name)
      extra = f" One of: {', '.join(choices)}." if choices else ""
      what = (f.metadata["help"] + extra).replace("|", "\\|")  # a literal bar in a cell
      out.append(f"| `--{f.name}` | `{f.default!r}` | {what} |")
    out.append("")
  return "\n".join(out)
