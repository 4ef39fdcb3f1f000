"""`HFTokenizer`: a Hugging Face `tokenizer.json` behind the data pipeline's tokenizer
interface (`encode`, `decode`, `bos_id`, `eos_id`, `pad_id`, `vocab_size`), with the
model's special tokens and chat template.

`tokenizers` and `jinja2` are imported lazily (the `hf` extra). Chat templates render in
a jinja2 sandbox with the options and helpers `transformers` gives them (`trim_blocks`,
`lstrip_blocks`, `raise_exception`, `strftime_now`, a `tojson` that keeps non-ASCII).
"""

import datetime
import functools
import hashlib
import json

from tunix_core.storage import paths


class TokenizerError(ValueError):
  """A tokenizer directory that cannot be used as asked."""


def _token(value):
  """A special token from `tokenizer_config.json`: a string, an `AddedToken` dict
  (`{"content": ...}`), or None."""
  return value.get("content") if isinstance(value, dict) else value


def _chat_template(model_dir: str, config: dict):
  path = paths.join(model_dir, "chat_template.jinja")
  if paths.isfile(path):
    return paths.read_text(path)
  template = config.get("chat_template")
  if isinstance(template, list):  # named templates: the "default" one is the chat one
    template = {t["name"]: t["template"] for t in template}.get("default")
  return template


class HFTokenizer:
  """The tokenizer of an HF model directory (`tokenizer.json`, `tokenizer_config.json`,
  optionally `chat_template.jinja`).

  `encode(text)` adds no special tokens (like the byte tokenizer); `bos_id` may be None
  (Qwen has no BOS); `pad_id` falls back to `eos_id` when the model defines no pad
  token. `chat_template` is None for a model without one.
  """

  def __init__(self, model_dir: str):
    from tokenizers import Tokenizer  # pylint: disable=g-import-not-at-top
    path = paths.join(model_dir, "tokenizer.json")
    if not paths.isfile(path):
      raise TokenizerError(f"{model_dir} has no tokenizer.json")
    text = paths.read_text(path)
    self._tok = Tokenizer.from_str(text)
    self.fingerprint = "sha256:" + hashlib.sha256(text.encode()).hexdigest()  # token stores' key
    config_path = paths.join(model_dir, "tokenizer_config.json")
    config = {}
    if paths.isfile(config_path):
      config = json.loads(paths.read_text(config_path))
    self.special_tokens = {name: _token(config.get(name)) for name in
                           ("bos_token", "eos_token", "pad_token", "unk_token")}
    self.bos_id = self._id(self.special_tokens["bos_token"])
    self.eos_id = self._id(self.special_tokens["eos_token"])
    if self.eos_id is None:
      raise TokenizerError(f"{model_dir}: tokenizer_config.json names no eos_token")
    pad = self._id(self.special_tokens["pad_token"])
    self.pad_id = self.eos_id if pad is None else pad
    self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
    self.chat_template = _chat_template(model_dir, config)

  def _id(self, token):
    if token is None:
      return None
    found = self._tok.token_to_id(token)
    if found is None:
      raise TokenizerError(f"special token {token!r} is not in the vocabulary")
    return found

  def encode(self, text: str) -> list[int]:
    return self._tok.encode(text, add_special_tokens=False).ids

  def decode(self, ids) -> str:
    return self._tok.decode(list(ids), skip_special_tokens=True)

  def apply_chat_template(self, messages: list, add_generation_prompt: bool = False) -> str:
    """The chat template rendered for `messages` (`[{"role", "content"}]`), as text."""
    if self.chat_template is None:
      raise TokenizerError("this tokenizer has no chat template")
    return _compile(self.chat_template).render(
        messages=messages, add_generation_prompt=add_generation_prompt,
        **{k: v for k, v in self.special_tokens.items() if v is not None})


@functools.lru_cache(maxsize=8)  # a dataset renders one template thousands of times
def _compile(template: str):
  from jinja2.sandbox import ImmutableSandboxedEnvironment  # pylint: disable=g-import-not-at-top

  def raise_exception(message):
    raise TokenizerError(f"chat template: {message}")

  env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                      extensions=["jinja2.ext.loopcontrols"])
  env.filters["tojson"] = lambda x, indent=None, separators=None, sort_keys=False: json.dumps(
      x, ensure_ascii=False, indent=indent, separators=separators, sort_keys=sort_keys)
  env.globals["raise_exception"] = raise_exception
  env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
  return env.from_string(template)
