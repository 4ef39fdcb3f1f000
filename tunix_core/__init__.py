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
gradient sync) are the modules of `tunix_core.parallel`, also as import paths.
"""

import sys

from tunix_core.parallel import collectives
from tunix_core.parallel import zero

sys.modules[f"{__name__}.collectives"] = collectives
sys.modules[f"{__name__}.zero"] = zero
