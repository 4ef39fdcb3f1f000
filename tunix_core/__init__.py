"""The DPO trainer's library, one sub-package per concept (imports only downward):

- `model`: `ModelConfig`, presets and the decoder of every family;
- `hf`: Hugging Face `config.json`, safetensors, tokenizers and chat templates, GGUF;
- `parallel`: meshes, the bucketed collectives, the parameter layouts (ZeRO-1, FSDP,
  tensor parallel) behind one protocol;
- `data`: JSONL pairs, TRL-style encoding, the model rows a pair batch is computed in;
- `training`: the run config, the step plan, the objective and the jitted step;
- `checkpoints`: Orbax saves, verification, resume and export of saved steps;
- `run`: the training loop and what it drives (metrics, evaluation, the reference
  cache, preemption, logs);
- `aot`: a plan compiled for a TPU target ahead of time, and its memory report.

`tunix_core.collectives` and `tunix_core.zero` (the public names of the kernel library's
gradient sync) resolve to their modules in `tunix_core.parallel`.
"""

import importlib

_PUBLIC = {"collectives": "tunix_core.parallel.collectives",
           "zero": "tunix_core.parallel.zero"}


def __getattr__(name: str):
  # Lazy, so importing any sub-package does not import the parallel one.
  if name in _PUBLIC:
    return importlib.import_module(_PUBLIC[name])
  raise AttributeError(f"module 'tunix_core' has no attribute {name!r}")
