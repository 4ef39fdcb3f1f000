"""LoRA adapters (`tunix_core.model.lora`, `tunix_core.hf.peft`): the adapted forward
against `peft` on `transformers` (committed fixtures, `tests/make_lora_fixtures.py`),
PEFT's initialisation, merging, and PEFT directories in and out."""

import dataclasses
import json
import os
import shutil

import jax
import numpy as np
import pytest

from oracles import rel_error
from tunix_core import hf
from tunix_core import model as model_lib
from tunix_core.hf import peft as peft_lib
from tunix_core.model import lora

HERE = os.path.dirname(os.path.abspath(__file__))
HF, LORA = (os.path.join(HERE, "fixtures", d) for d in ("hf", "lora"))


def _adapted(name):
  cfg = hf.read_config(os.path.join(HF, name))
  base = hf.load_params(os.path.join(HF, name), cfg)
  lcfg, adapters = peft_lib.read_adapter(os.path.join(LORA, name), cfg)
  return dataclasses.replace(cfg, lora_scale=lcfg.scale), base, lcfg, adapters


def _logits(params, cfg, name):
  return np.asarray(model_lib.logits(params, np.load(os.path.join(HF, name, "tokens.npy")),
                                     None, cfg))


@pytest.mark.parametrize("name", sorted(os.listdir(LORA)))
def test_adapted_logits_match_peft_on_the_committed_fixtures(name):
  cfg, base, lcfg, adapters = _adapted(name)
  want = np.load(os.path.join(LORA, name, "logits.npy"))
  got = _logits(lora.attach(base, adapters), cfg, name)
  assert rel_error(got, want) <= 1e-5
  assert rel_error(_logits(base, cfg, name), want) > 1e-2  # the adapters matter
  # Folded into the weights (--export_merged), the model is the same.
  assert rel_error(_logits(lora.merge(base, adapters, lcfg), cfg, name), want) <= 1e-5


def test_fresh_adapters_are_peft_s_init_and_change_nothing():
  cfg = model_lib.preset("tiny")
  lcfg = lora.LoraConfig(rank=4, alpha=16)
  assert lcfg.scale == 4.0 and lora.LoraConfig(4, 16, rslora=True).scale == 8.0
  base = model_lib.init_params(jax.random.PRNGKey(0), cfg)
  adapters = lora.init_adapters(jax.random.PRNGKey(1), cfg, lcfg)
  assert sorted(adapters) == ["w_down", "w_gate", "w_up", "wk", "wo", "wq", "wv"]
  a, b = adapters["w_down"]["a"], adapters["w_down"]["b"]
  assert a.shape == (cfg.num_layers, cfg.mlp_dim, 4) and b.shape == (cfg.num_layers, 4, 128)
  bound = 1 / np.sqrt(cfg.mlp_dim)  # Kaiming-uniform with a = sqrt(5)
  assert 0.9 * bound < float(abs(a).max()) <= bound and not np.asarray(b).any()
  tokens = np.arange(24, dtype=np.int32).reshape(2, 12)
  np.testing.assert_array_equal(model_lib.logits(lora.attach(base, adapters), tokens, None, cfg),
                                model_lib.logits(base, tokens, None, cfg))
  assert lora.detach(lora.attach(base, adapters))[0].keys() == base.keys()
  with pytest.raises(ValueError, match="unknown LoRA targets"):
    lora.LoraConfig(4, 8, targets=("qkv",))
  with pytest.raises(ValueError, match="rank must be a positive int"):
    lora.LoraConfig(0, 8)


def test_peft_directories_round_trip_and_unsupported_adapters_are_named(tmp_path):
  cfg, _, lcfg, adapters = _adapted("qwen2")
  out = str(tmp_path / "out")
  peft_lib.write_adapter(out, adapters, cfg, lcfg, base_model="tests/fixtures/hf/qwen2")
  lcfg2, adapters2 = peft_lib.read_adapter(out, cfg)
  assert lcfg2 == lcfg
  for name in adapters:
    for k in "ab":
      np.testing.assert_array_equal(adapters2[name][k], adapters[name][k])
  written = json.load(open(os.path.join(out, peft_lib.CONFIG)))
  assert written["target_modules"] == ["q_proj", "v_proj", "down_proj"]
  bad = str(tmp_path / "dora")
  shutil.copytree(os.path.join(LORA, "qwen2"), bad)
  config = json.load(open(os.path.join(bad, peft_lib.CONFIG)))
  with open(os.path.join(bad, peft_lib.CONFIG), "w") as f:
    json.dump({**config, "use_dora": True}, f)
  with pytest.raises(hf.HFError, match="use_dora=True is not supported"):
    peft_lib.read_adapter(bad, cfg)
  with pytest.raises(hf.HFError, match="is not a PEFT adapter directory"):
    peft_lib.read_adapter(str(tmp_path), cfg)
  with pytest.raises(hf.HFError, match="needs"):  # an adapter for another base
    peft_lib.read_adapter(os.path.join(LORA, "qwen2"), hf.read_config(os.path.join(HF, "llama3")))
