"""PEFT LoRA adapter directories in and out: `adapter_config.json` and
`adapter_model.safetensors`, with the key names and `[out, in]` layouts `peft` writes.

A key is `base_model.model.model.layers.{i}.{self_attn|mlp}.{target}.lora_A.weight`
(`[r, in]`) or `...lora_B.weight` (`[out, r]`); ours are stacked over layers and
transposed, `a [L, in, r]` and `b [L, r, out]` (`tunix_core.model.lora`). Adapters
`peft` can write but we cannot represent exactly (DoRA, biases, per-module ranks, extra
saved modules, regex targets) are a named `HFError`, never approximated.
"""

import json
import os

import numpy as np

from tunix_core.hf import files as hf_files
from tunix_core.hf.config import HFError
from tunix_core.model import lora as lora_lib
from tunix_core.model.config import ModelConfig
from tunix_core.storage import paths
from tunix_core.storage import staging

CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
_PREFIX = "base_model.model.model.layers"
# adapter_config.json fields whose non-default values we cannot represent.
_UNSUPPORTED = {"use_dora": False, "bias": "none", "modules_to_save": None,
                "fan_in_fan_out": False, "layers_to_transform": None, "rank_pattern": {},
                "alpha_pattern": {}, "lora_bias": False, "target_parameters": None,
                "trainable_token_indices": None, "layer_replication": None}


def _key(layer: int, target: str, which: str) -> str:
  return f"{_PREFIX}.{layer}.{lora_lib.MODULES[target]}.{target}.lora_{which}.weight"


def read_config(adapter_dir: str) -> lora_lib.LoraConfig:
  """The `LoraConfig` of a PEFT LoRA directory (`HFError` for one we cannot represent)."""
  path = paths.join(adapter_dir, CONFIG)
  if not paths.exists(path):
    raise HFError(f"{adapter_dir} is not a PEFT adapter directory: no {CONFIG}")
  config = json.loads(paths.read_text(path))
  if config.get("peft_type") != "LORA":
    raise HFError(f"{path}: peft_type {config.get('peft_type')!r} is not LORA")
  for field, default in _UNSUPPORTED.items():
    if config.get(field, default) not in (default, None, {}, False):
      raise HFError(f"{path}: {field}={config[field]!r} is not supported (LoRA adapters "
                    "on the attention and MLP projections only)")
  targets = config.get("target_modules")
  if not isinstance(targets, list):
    raise HFError(f"{path}: target_modules must be a list of module names, got {targets!r}")
  if set(targets) - set(lora_lib.TARGETS):
    raise HFError(f"{path}: target_modules {sorted(set(targets) - set(lora_lib.TARGETS))} "
                  f"are not projections we adapt; choose from {list(lora_lib.TARGETS)}")
  try:
    return lora_lib.LoraConfig(rank=int(config["r"]), alpha=float(config["lora_alpha"]),
                               targets=tuple(t for t in lora_lib.TARGETS if t in targets),
                               rslora=bool(config.get("use_rslora", False)))
  except (KeyError, ValueError) as e:
    raise HFError(f"{path}: {e}") from None


def read_adapter(adapter_dir: str, cfg: ModelConfig) -> tuple[lora_lib.LoraConfig, dict]:
  """`(LoraConfig, float32 adapters)` of a PEFT LoRA directory for a base of `cfg`."""
  lcfg = read_config(adapter_dir)
  # The HF weights' reader: any dtype peft saves (float32, bfloat16 from a bf16 model).
  with hf_files.open_tensors(paths.join(adapter_dir, WEIGHTS)) as f:
    tensors = {name: f.get_slice(name)[:] for name in f.keys()}
  shapes = lora_lib.adapter_shapes(cfg, lcfg)
  adapters = {}
  for target in lcfg.targets:
    name = lora_lib.TARGETS[target]
    stacked = {}
    for which, shape in zip("AB", shapes[name]):
      per_layer = []
      for i in range(cfg.num_layers):
        key = _key(i, target, which)
        if key not in tensors:
          raise HFError(f"{adapter_dir}: {WEIGHTS} has no {key}")
        per_layer.append(np.asarray(tensors.pop(key), np.float32).T)
        if per_layer[-1].shape != shape[1:]:
          raise HFError(f"{adapter_dir}: {key} is {per_layer[-1].T.shape}, the model needs "
                        f"{shape[1:][::-1]}")
      stacked[which.lower()] = np.stack(per_layer)
    adapters[name] = stacked
  if tensors:
    raise HFError(f"{adapter_dir}: {WEIGHTS} holds tensors we do not use, e.g. "
                  f"{sorted(tensors)[:3]}")
  return lcfg, adapters


def write_adapter(out_dir: str, adapters: dict, cfg: ModelConfig,
                  lcfg: lora_lib.LoraConfig, base_model: str | None = None) -> None:
  """Writes `adapters` as a PEFT LoRA directory `peft.PeftModel.from_pretrained` loads
  onto the base (`base_model`: its name or path, recorded in the config); `out_dir` may
  be remote (written locally, then uploaded)."""
  from safetensors.numpy import save_file  # pylint: disable=g-import-not-at-top
  tensors = {}
  for target in lcfg.targets:
    ab = adapters[lora_lib.TARGETS[target]]
    for which in "AB":
      stacked = np.asarray(ab[which.lower()], np.float32)
      for i in range(cfg.num_layers):
        tensors[_key(i, target, which)] = np.ascontiguousarray(stacked[i].T)
  config = dict(peft_type="LORA", task_type="CAUSAL_LM", r=lcfg.rank,
                lora_alpha=lcfg.alpha, target_modules=list(lcfg.targets), lora_dropout=0.0,
                use_rslora=lcfg.rslora, bias="none", fan_in_fan_out=False,
                init_lora_weights=True, inference_mode=True, modules_to_save=None,
                base_model_name_or_path=base_model)
  with staging.staged_dir(out_dir) as local:
    save_file(tensors, os.path.join(local, WEIGHTS), metadata={"format": "pt"})
    with open(os.path.join(local, CONFIG), "w") as f:
      json.dump(config, f, indent=2)
