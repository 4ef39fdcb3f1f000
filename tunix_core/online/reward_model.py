"""`--reward_model=HF_DIR`: a Hugging Face `*ForSequenceClassification` model as a reward.

The directory is what `save_pretrained` writes for a Llama, Mistral, Qwen2, Qwen3 or
Gemma family classifier (our decoder's families): the decoder under `model.`, the
`score` head `[labels, D]` (no bias) and the tokenizer. As `transformers` scores a
sequence, the head reads the final hidden state of its last token (the batch is
right-padded here and each row's length known, so padding never moves it), and as TRL
uses a reward model, the reward is label 0's logit. The text is TRL's too: a
conversational prompt and its completion rendered through the reward model's own chat
template (the whole conversation, no generation prompt), a plain one as the prompt's
text followed by the completion's, after BOS where the tokenizer has one.

The weights are read once, read-only, split over the local devices as FSDP splits them
outside the step (`parallel.fsdp.logical_specs`, as `tunix_core.generate` loads a
model); the scoring is one jitted forward per length bucket, never differentiated.
"""

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np

from tunix_core import model as model_lib
from tunix_core.parallel import fsdp
from tunix_core.storage import paths
from tunix_core.training.validation import ConfigError

SUFFIX = "ForSequenceClassification"
# Rows are padded to a multiple of this many ids: one compile per bucket, not per batch.
_BUCKET = 64


def check(model_dir: str) -> dict:
  """The `config.json` of `model_dir` if it is a sequence classifier, else a
  `ConfigError` in one line."""
  path = paths.join(model_dir, "config.json")
  if not paths.isfile(path):
    raise ConfigError(f"--reward_model={model_dir}: no config.json (not a Hugging Face "
                      "model directory)")
  config = json.loads(paths.read_text(path))
  arch = config.get("architectures") or []
  if not any(a.endswith(SUFFIX) for a in arch):
    what = ", ".join(arch) or "model of no architecture"
    raise ConfigError(f"--reward_model={model_dir} is a {what}, not a *{SUFFIX} model")
  return config


@functools.partial(jax.jit, static_argnames="cfg")
def _scores(params, score_DxL, ids_BxT, lengths_B, *, cfg):
  """Label logits `[B, labels]` float32 at each row's last real id."""
  mask_BxT = (jnp.arange(ids_BxT.shape[1]) < lengths_B[:, None]).astype(jnp.int32)
  hidden_BxTxD = model_lib.forward(params, ids_BxT, mask_BxT, cfg)
  last_B = jnp.maximum(lengths_B - 1, 0)  # an empty text reads its first slot
  last_BxD = jnp.take_along_axis(hidden_BxTxD, last_B[:, None, None], 1)[:, 0]
  return jnp.dot(last_BxD, score_DxL.astype(last_BxD.dtype),
                 preferred_element_type=jnp.float32)


class RewardModel:
  """A classifier's reward of prompts and completions (module docstring); `compute_dtype`
  as the run's (`--compute_dtype` resolved)."""

  def __init__(self, model_dir: str, compute_dtype: str):
    from tunix_core import hf  # pylint: disable=g-import-not-at-top
    check(model_dir)
    self.model_dir = model_dir
    # No LM head: the classifier's head is `score`, read apart.
    self.cfg = hf.read_config(model_dir, tie_embeddings=True, param_dtype="float32",
                              compute_dtype=compute_dtype)
    devices = jax.local_devices()
    mesh = jax.sharding.Mesh(np.array(devices), ("data",))
    shapes = jax.eval_shape(lambda: model_lib.init_params(jax.random.PRNGKey(0), self.cfg))
    shardings = jax.tree.map(lambda spec: jax.sharding.NamedSharding(mesh, spec),
                             fsdp.logical_specs(shapes, len(devices)))
    self.params = hf.load_params(model_dir, self.cfg, shardings=shardings,
                                 extra=("score.weight",))
    self.score_DxL = jnp.asarray(hf.read_tensor(model_dir, "score.weight").T, jnp.float32)
    self.tok = hf.HFTokenizer(model_dir)

  def ids(self, prompt, completion) -> list[int]:
    """The reward model's ids of one prompt and completion (messages or strings)."""
    if isinstance(prompt, str):
      bos = [] if self.tok.bos_id is None else [self.tok.bos_id]
      return bos + self.tok.encode(prompt + completion)
    return self.tok.encode(self.tok.apply_chat_template(prompt + completion,
                                                        add_generation_prompt=False))

  def score_ids(self, id_lists: list) -> np.ndarray:
    """Label 0's logit, float32 `[n]`, of each id list (right-padded into one batch)."""
    T = -(-max(map(len, id_lists)) // _BUCKET) * _BUCKET
    ids = np.full((len(id_lists), T), self.tok.pad_id, np.int32)
    for row, x in enumerate(id_lists):
      ids[row, :len(x)] = x
    lengths = np.array([len(x) for x in id_lists], np.int32)
    return np.asarray(_scores(self.params, self.score_DxL, ids, lengths, cfg=self.cfg))[:, 0]

  def __call__(self, prompts: list, completions: list, **_) -> np.ndarray:
    """The rewards of `completions` of `prompts` (TRL's reward-function call)."""
    return self.score_ids([self.ids(p, c) for p, c in zip(prompts, completions)])
