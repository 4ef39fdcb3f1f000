"""Which files of a Hugging Face directory hold which tensors, and reading them lazily:
names canonicalised (`model.` for the decoder, `lm_head.` and a classifier's `score.`
as they are), a single file or an index of shards, local or on object storage."""

import json

import numpy as np

from tunix_core.hf.config import HFError
from tunix_core.hf import ranged
from tunix_core.storage import paths

PREFIX = "model."
# Tensors of a multimodal checkpoint's other towers, which a text model leaves alone.
OTHER_TOWERS = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.",
                "model.multi_modal_projector.")


def canonical(name: str) -> str:
  """A tensor name with the prefixes checkpoints vary in reduced to `model.`."""
  for prefix in ("model.language_model.", "language_model.model.", "model."):
    if name.startswith(prefix):
      return PREFIX + name[len(prefix):]
  return name if name.startswith(("lm_head.", "score.")) else PREFIX + name


def read_tensor(model_dir: str, name: str) -> np.ndarray:
  """One whole tensor of an HF directory by its canonical name (e.g. `score.weight`)."""
  path, stored = tensor_files(model_dir)[name]
  with open_tensors(path) as f:
    return np.asarray(f.get_slice(stored)[:])


def tensor_files(model_dir: str) -> dict:
  """`{canonical name: (file path, stored name)}` of a single-file or index-sharded
  safetensors checkpoint, other towers of a multimodal one left out."""
  index = paths.join(model_dir, "model.safetensors.index.json")
  if paths.isfile(index):
    names = {name: paths.join(model_dir, file)
             for name, file in json.loads(paths.read_text(index))["weight_map"].items()}
  else:
    single = paths.join(model_dir, "model.safetensors")
    if not paths.isfile(single):
      raise HFError(f"{model_dir} has neither model.safetensors nor "
                    "model.safetensors.index.json")
    with open_tensors(single) as f:
      names = {name: single for name in f.keys()}
  return {canonical(name): (path, name) for name, path in names.items()
          if not name.startswith(OTHER_TOWERS)}


def open_tensors(path: str):
  """A safetensors file's lazily sliced tensors (a context manager with `keys()` and
  `get_slice(name)`): memory-mapped when local, read by byte ranges on object storage
  (`hf.ranged`); any dtype, bfloat16 included (as `ml_dtypes.bfloat16`)."""
  if paths.is_remote(path):
    return ranged.RangedFile(path)
  # ml_dtypes registers "bfloat16" with NumPy, which safe_open's numpy framework needs.
  import ml_dtypes  # noqa: F401  pylint: disable=g-import-not-at-top,unused-import
  from safetensors import safe_open  # pylint: disable=g-import-not-at-top
  return safe_open(path, framework="numpy")
