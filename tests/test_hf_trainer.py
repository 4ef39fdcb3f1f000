"""The trainer on a Hugging Face directory: conversational pairs through the chat
template, a Gemma-2-style model (soft-caps, pre/post norms, sliding layers) as initial
policy and reference, exact resume with the reference reloaded, export (at the end and
from any saved step) and the one-line errors.

The model is random (written with `hf.save_params`, its vocabulary matching the committed
BPE tokenizer); what is checked is the plumbing against independent facts: step 1's
loss is ln 2 (policy == reference), the export equals the trained params bit for bit, a
resumed run equals an uninterrupted one.
"""

import dataclasses
import json
import math
import os
import shutil

import jax
import numpy as np
import pytest

from tunix_core import data as data_lib
from tunix_core import hf
from tunix_core import model as model_lib
from tunix_core.checkpoints import export
from tunix_core.run import loop as train
from tunix_core.training import config as config_lib

pytest.importorskip("safetensors")
pytest.importorskip("tokenizers")
pytest.importorskip("jinja2")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOKENIZER = os.path.join(REPO, "tests", "fixtures", "hf", "tokenizer")
QUIET = dict(log=lambda *_: None)
CFG = model_lib.ModelConfig(
    vocab_size=320, d_model=32, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=16,
    mlp_dim=64, norm_offset=1.0, embed_scale=True, mlp_activation="gelu_tanh",
    post_norms=True, query_pre_attn_scalar=16.0, attn_softcap=20.0, final_softcap=15.0,
    sliding_window=8, layer_types=("sliding_attention", "full_attention"),
    tie_embeddings=True, norm_eps=1e-6)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
  d = str(tmp_path_factory.mktemp("hf") / "model")
  hf.save_params(model_lib.init_params(jax.random.PRNGKey(3), CFG), CFG, d, dtype="float32")
  for name in ("tokenizer.json", "tokenizer_config.json"):
    shutil.copy(os.path.join(TOKENIZER, name), d)
  return d


@pytest.fixture(scope="module")
def chat_data(tmp_path_factory):
  """The shipped pairs as TRL conversational records."""
  path = tmp_path_factory.mktemp("data") / "chat.jsonl"
  with open(os.path.join(REPO, "data", "train.jsonl")) as f:
    pairs = [json.loads(line) for line in f][:64]
  with open(path, "w") as f:
    for p in pairs:
      f.write(json.dumps({"prompt": [{"role": "user", "content": p["prompt"]}],
                          "chosen": [{"role": "assistant", "content": p["chosen"]}],
                          "rejected": [{"role": "assistant", "content": p["rejected"]}]})
              + "\n")
  return str(path)


def _config(out, model_dir, data, **kw):
  base = dict(output_dir=str(out), train_data=data, hf_model_dir=model_dir, max_length=64,
              max_prompt_length=40, batch_size=8, steps=4, log_every=1, learning_rate=3e-3,
              lr_schedule="constant")  # a run resumed with more steps equals a straight one
  return config_lib.TrainConfig(**{**base, **kw})


def _losses(out):
  with open(os.path.join(out, "metrics.jsonl")) as f:
    return {r["step"]: r["loss"] for r in map(json.loads, f) if "loss" in r}


@pytest.mark.slow
def test_train_export_resume_on_an_hf_directory(model_dir, chat_data, tmp_path):
  devices = jax.devices()[:2]
  full = train.train(_config(tmp_path / "full", model_dir, chat_data,
                             export_hf_dir=str(tmp_path / "exported")), devices=devices, **QUIET)
  losses = _losses(tmp_path / "full")
  assert losses[1] == pytest.approx(math.log(2), abs=1e-5)  # policy == reference
  assert losses[4] < losses[1]
  # The export is the final policy, bit for bit, in the source's family.
  exported = str(tmp_path / "exported")
  assert hf.read_config(exported) == CFG
  again = hf.load_params(exported, CFG)
  jax.tree.map(np.testing.assert_array_equal, again, full["state"]["params"])
  assert os.path.isfile(os.path.join(exported, "tokenizer.json"))
  _check_in_transformers(exported, again)
  # Stopped after step 2 and resumed: the reference is reloaded from the directory and
  # the run continues exactly.
  cut = tmp_path / "cut"
  train.train(_config(cut, model_dir, chat_data, steps=2, save_every=2), devices=devices,
              **QUIET)
  resumed = train.train(_config(cut, model_dir, chat_data, save_every=2), devices=devices,
                        **QUIET)
  assert _losses(cut) == pytest.approx(losses, abs=1e-6)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6),
               resumed["state"]["params"], full["state"]["params"])
  # Any saved step exports through the CLI's function, verified, on one device.
  step = export.export_step(str(cut), str(tmp_path / "step4"), dtype="float32", **QUIET)
  assert step == 4
  jax.tree.map(np.testing.assert_array_equal, hf.load_params(str(tmp_path / "step4"), CFG),
               resumed["state"]["params"])


@pytest.mark.slow
def test_fsdp_on_an_hf_directory_matches_zero1_and_exports(model_dir, chat_data, tmp_path):
  zero1 = train.train(_config(tmp_path / "z", model_dir, chat_data, steps=2),
                      devices=jax.devices()[:2], **QUIET)
  train.train(_config(tmp_path / "f", model_dir, chat_data, steps=2, fsdp=True,
                      export_hf_dir=str(tmp_path / "hf")), **QUIET)
  assert _losses(tmp_path / "f") == pytest.approx(_losses(tmp_path / "z"), abs=1e-5)
  # The export gathers the sharded params back into logical arrays.
  exported = hf.load_params(str(tmp_path / "hf"), CFG)
  for got, want in zip(jax.tree.leaves(exported), jax.tree.leaves(zero1["state"]["params"])):
    np.testing.assert_allclose(got, want, atol=3e-5)


def _check_in_transformers(model_dir, params):
  """The exported directory loads in `transformers` (when installed) and gives our
  logits within 1e-5 of the largest."""
  try:
    import torch  # pylint: disable=g-import-not-at-top
    import transformers  # pylint: disable=g-import-not-at-top
  except ImportError:
    return
  tokens = np.random.default_rng(0).integers(0, CFG.vocab_size, (2, 24)).astype(np.int32)
  ours = np.asarray(model_lib.logits(params, tokens, None, CFG), np.float64)
  model = transformers.AutoModelForCausalLM.from_pretrained(
      model_dir, dtype=torch.float32, attn_implementation="eager").eval()
  with torch.no_grad():
    theirs = model(torch.from_numpy(tokens).long()).logits.numpy()
  assert np.abs(theirs - ours).max() <= 1e-5 * np.abs(ours).max()


@pytest.mark.slow
def test_bfloat16_params_and_reference_train_and_export_as_bfloat16(model_dir, chat_data,
                                                                     tmp_path):
  out = train.train(_config(tmp_path / "run", model_dir, chat_data, steps=2,
                            param_dtype="bfloat16", ref_dtype="bfloat16",
                            export_hf_dir=str(tmp_path / "hf")),
                    devices=jax.devices()[:2], **QUIET)
  params = out["state"]["params"]
  assert {x.dtype for x in jax.tree.leaves(params)} == {np.dtype("bfloat16")}
  assert _losses(tmp_path / "run")[1] == pytest.approx(math.log(2), abs=1e-3)
  assert json.load(open(tmp_path / "hf" / "config.json"))["torch_dtype"] == "bfloat16"
  exported = hf.load_params(str(tmp_path / "hf"), dataclasses.replace(CFG, param_dtype="bfloat16"))
  jax.tree.map(np.testing.assert_array_equal, exported, params)


@pytest.mark.slow
def test_resuming_against_other_weights_fails_naming_the_fingerprint(model_dir, chat_data,
                                                                     tmp_path):
  out = tmp_path / "run"
  train.train(_config(out, model_dir, chat_data, steps=1, save_every=1),
              devices=jax.devices()[:1], **QUIET)
  other = str(tmp_path / "other")
  shutil.copytree(model_dir, other)
  params = hf.load_params(other, CFG)   # one middle tensor changed, same shapes
  params["layers"]["w_up"] = params["layers"]["w_up"].at[CFG.num_layers // 2].add(0.01)
  hf.save_params(params, CFG, other, dtype="float32")
  with pytest.raises(config_lib.ConfigError, match="hf_fingerprint"):
    train.train(_config(out, other, chat_data, steps=2), devices=jax.devices()[:1], **QUIET)


def test_bad_inputs_fail_with_one_clear_line(model_dir, chat_data, tmp_path):
  one = dict(devices=jax.devices()[:1], **QUIET)
  with pytest.raises(config_lib.ConfigError, match="no config.json"):
    train.train(_config(tmp_path / "a", str(tmp_path), chat_data), **one)
  with pytest.raises(data_lib.DataError, match="chat template"):
    train.train(_config(tmp_path / "b", model_dir, chat_data, chat_template="none"), **one)
  small = str(tmp_path / "small")
  shutil.copytree(model_dir, small)
  config = json.load(open(os.path.join(small, "config.json")))
  config["model_type"] = "gpt_neox"
  json.dump(config, open(os.path.join(small, "config.json"), "w"))
  with pytest.raises(hf.HFError, match="model_type 'gpt_neox' is not supported"):
    train.train(_config(tmp_path / "c", small, chat_data), **one)
  # A model whose vocabulary is smaller than the ids its tokenizer produces.
  cfg = model_lib.ModelConfig(**{**CFG.__dict__, "vocab_size": 200})
  hf.save_params(model_lib.init_params(jax.random.PRNGKey(0), cfg), cfg, small,
                 dtype="float32")
  with pytest.raises(data_lib.DataError, match="vocabulary size 200"):
    train.train(_config(tmp_path / "d", small, chat_data), **one)
