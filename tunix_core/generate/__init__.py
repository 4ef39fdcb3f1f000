"""Text in, text out: prompts encoded as training encodes them (chat template or BOS +
text), left-padded, completed by `tunix_core.model.generate`, decoded. `python -m
tunix_core.generate` is the command line (`generate/__main__.py`).

Params are split over every local device as FSDP splits them outside the step (each
large array on its largest dimension, `parallel.fsdp.logical_specs`), whether read from
an HF directory (`load_sharded`: each device reads its block) or restored from a run
(`checkpoints.export.restore_step`); the jitted decoder then runs sharded (XLA gathers
each weight where it is used), so a model that needs all the local devices to hold it
decodes on them.
"""

import json

import jax
import numpy as np

from tunix_core import model as model_lib
from tunix_core.model import generate as generate_lib
from tunix_core.parallel import fsdp
from tunix_core.storage import paths


def load_sharded(model_dir: str, cfg: model_lib.ModelConfig) -> dict:
  """The params of an HF directory, split over every local device (module docstring)."""
  from tunix_core import hf  # pylint: disable=g-import-not-at-top
  devices = jax.local_devices()
  mesh = jax.sharding.Mesh(np.array(devices), ("data",))
  shapes = jax.eval_shape(lambda: model_lib.init_params(jax.random.PRNGKey(0), cfg))
  shardings = jax.tree.map(lambda spec: jax.sharding.NamedSharding(mesh, spec),
                           fsdp.logical_specs(shapes, len(devices)))
  return hf.load_params(model_dir, cfg, shardings=shardings)


def eos_ids(model_dir: str, tok) -> tuple:
  """The ids that end a completion: `eos_token_id` of `model_dir`'s
  `generation_config.json`, else of its `config.json` (an int or a list), else (and
  without a `model_dir`: a preset) the tokenizer's EOS."""
  for name in ("generation_config.json", "config.json") if model_dir else ():
    path = paths.join(model_dir, name)
    if paths.isfile(path):
      value = json.loads(paths.read_text(path)).get("eos_token_id")
      if value is not None:
        return tuple(value) if isinstance(value, list) else (int(value),)
  return (tok.eos_id,)


def prompt_ids(tok, prompt, chat: bool) -> list[int]:
  """`prompt` (a string, or a list of `{"role", "content"}` messages) as the model sees
  it before its answer: through the chat template with the generation prompt (`chat`; a
  string is one user turn), else BOS (when the tokenizer has one) and the text."""
  if chat:
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    return tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True))
  return ([] if tok.bos_id is None else [tok.bos_id]) + tok.encode(prompt)


def left_pad(id_lists: list, pad_id: int, length: int | None = None
             ) -> tuple[np.ndarray, np.ndarray]:
  """`(ids [n, P], mask [n, P])` int32: each id list left-padded to `P` (`length`, else
  the longest; a longer list keeps its last `P` ids), mask 1 on its ids."""
  P = length or max(map(len, id_lists))
  ids = np.full((len(id_lists), P), pad_id, np.int32)
  mask = np.zeros((len(id_lists), P), np.int32)
  for row, x in enumerate(id_lists):
    x = list(x)[-P:]
    ids[row, P - len(x):], mask[row, P - len(x):] = x, 1
  return ids, mask


def until_eos(ids, eos_ids) -> list[int]:
  """The ids up to and including the first of `eos_ids` (all of them if none): what a
  completion is, whatever follows (a sample's padding, a chat template's ids after its
  end-of-turn token), in every comparison and every reward input."""
  ids = [int(t) for t in ids]
  ends = [i for i, t in enumerate(ids) if t in eos_ids]
  return ids[:ends[0] + 1] if ends else ids


def completion_text(tok, ids, eos_ids) -> str:
  """A completion's text: its ids `until_eos`, without the EOS, decoded."""
  ids = until_eos(ids, eos_ids)
  return tok.decode(ids[:-1] if ids and ids[-1] in eos_ids else ids)


def complete(params, cfg, tok, prompts: list, sampling: generate_lib.Sampling, *,
             chat: bool, seed: int = 0) -> list[dict]:
  """One `{"prompt_ids", "completion_ids", "text"}` per prompt, generated in one batch;
  `completion_ids` end with their EOS when the sample had one (`until_eos`)."""
  ids = [prompt_ids(tok, p, chat) for p in prompts]
  batch, mask = left_pad(ids, tok.pad_id)
  tokens, lengths = jax.device_get(generate_lib.generate(
      params, batch, mask, jax.random.PRNGKey(seed), cfg=cfg, sampling=sampling))
  return [{"prompt_ids": x, "completion_ids": until_eos(row[:n], sampling.eos_ids),
           "text": completion_text(tok, row[:n], sampling.eos_ids)}
          for x, row, n in zip(ids, tokens, lengths)]
