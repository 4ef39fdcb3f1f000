"""Hugging Face checkpoints in and out: `config.json` <-> `ModelConfig` (`hf.config`),
safetensors <-> the params pytree (`hf.weights`), tokenizers and chat templates
(`hf.tokenizer`), llama.cpp GGUF files (`hf.gguf`). `python -m tunix_core.hf` is the
command line (`hf/__main__.py`)."""

from tunix_core.hf.config import FAMILIES
from tunix_core.hf.config import HFError
from tunix_core.hf.config import read_config
from tunix_core.hf.files import read_tensor
from tunix_core.hf.tokenizer import HFTokenizer
from tunix_core.hf.tokenizer import TokenizerError
from tunix_core.hf.weights import expected_tensors
from tunix_core.hf.weights import load_params
from tunix_core.hf.weights import save_params
from tunix_core.hf.weights import SHARD_BYTES


def gguf_to_hf(gguf_path: str, out_dir: str, **kwargs) -> str:
  """A llama.cpp GGUF file as a complete HF directory, `out_dir` (`tunix_core.hf.gguf`;
  needs the `gguf` extra, imported only here)."""
  from tunix_core.hf import gguf  # pylint: disable=g-import-not-at-top
  return gguf.gguf_to_hf(gguf_path, out_dir, **kwargs)
