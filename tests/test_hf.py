"""Hugging Face checkpoints: `tunix_core.hf` + `model.logits` against `transformers`.

The committed fixtures (`tests/make_hf_fixtures.py`) carry the logits `transformers` gave
for tiny random checkpoints, so parity is checked without torch; the live tests redo it
with `transformers` itself when torch is importable. Tolerances are relative to the
largest logit: at these (deliberately large) weights `transformers`' own float32 logits
are ~2e-6 of it away from its float64 ones.
"""

import dataclasses
import json
import os
import shutil

import jax
import numpy as np
import pytest

import oracles
from tunix_core import hf
from tunix_core import model as model_lib
from tunix_core.hf import tokenizer as hf_tokenizer

pytest.importorskip("safetensors")
FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "hf")
NAMES = ("llama3", "llama_tied", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text")


def _rel(got, want):
  return float(np.abs(np.asarray(got, np.float64) - want).max() / np.abs(want).max())


def _logits(model_dir, cfg=None, params=None, tokens_from=None):
  """Our float32 logits of a fixture's tokens for the checkpoint in `model_dir`."""
  cfg = cfg or hf.read_config(model_dir)
  params = params or hf.load_params(model_dir, cfg)
  tokens = np.load(os.path.join(tokens_from or model_dir, "tokens.npy"))
  return np.asarray(model_lib.logits(params, tokens, None, cfg))


@pytest.mark.parametrize("name", NAMES)
def test_logits_match_transformers_on_the_committed_fixtures(name):
  d = os.path.join(FIXTURES, name)
  want = np.load(os.path.join(d, "logits.npy"))
  assert _rel(_logits(d), want) <= 1e-5


@pytest.mark.slow  # a guard on the fixtures themselves, not on the code
@pytest.mark.parametrize("name,changes", [
    ("llama3", (dict(rope_type="default"), dict(rope_theta=5e4), dict(norm_eps=1e-1))),
    ("mistral", (dict(sliding_window=0),)), ("qwen2", (dict(qkv_bias=False),)),
    ("qwen3", (dict(qk_norm=False),)),
    ("gemma", (dict(norm_offset=0.0), dict(embed_scale=False), dict(mlp_activation="silu"))),
    ("gemma2", (dict(post_norms=False, params="drop_post_norms"), dict(attn_softcap=0.0),
                dict(final_softcap=0.0), dict(query_pre_attn_scalar=0.0),
                dict(layer_types=("full_attention",) * 3))),
    ("gemma3_text", (dict(rope_local_theta=0.0), dict(rope_type="default"),
                     dict(qk_norm=False, params="drop_qk_norms"),
                     dict(layer_types=("sliding_attention",) * 4)))])
def test_every_config_option_moves_the_logits(name, changes):
  # The fixtures would not catch a feature we ignore unless ignoring it changes the
  # logits by far more than the tolerance.
  d = os.path.join(FIXTURES, name)
  cfg = hf.read_config(d)
  params = hf.load_params(d, cfg)
  want = np.load(os.path.join(d, "logits.npy"))
  for change in changes:
    p = params
    drop = change.pop("params", None)
    if drop:  # the config without a feature has fewer weights
      names = {"drop_post_norms": ("post_attn_norm", "post_mlp_norm"),
               "drop_qk_norms": ("q_norm", "k_norm")}[drop]
      p = {**params, "layers": {k: v for k, v in params["layers"].items() if k not in names}}
    moved = np.abs(_logits(d, dataclasses.replace(cfg, **change), p) - want)
    assert moved.max() > 0.1, change


def test_both_config_dialects_read_the_same(tmp_path):
  # transformers 5 writes `rope_parameters` and `dtype`; 4.x wrote `rope_theta`,
  # `rope_scaling` and `torch_dtype`.
  d = os.path.join(FIXTURES, "llama3")
  with open(os.path.join(d, "config.json")) as f:
    config = json.load(f)
  rope = config.pop("rope_parameters")
  old = {**config, "rope_theta": rope.pop("rope_theta"), "rope_scaling": rope,
         "torch_dtype": config.pop("dtype")}
  (tmp_path / "config.json").write_text(json.dumps(old))
  assert hf.read_config(str(tmp_path)) == hf.read_config(d)
  nested = {**config, "rope_parameters": {"full_attention": {**rope, "rope_theta": 1e4}}}
  (tmp_path / "config.json").write_text(json.dumps(nested))
  assert hf.read_config(str(tmp_path)) == hf.read_config(d)


def test_config_errors_name_the_problem(tmp_path):
  with pytest.raises(hf.HFError, match="no config.json"):
    hf.read_config(str(tmp_path))
  base = json.load(open(os.path.join(FIXTURES, "llama_tied", "config.json")))
  for change, message in ((dict(model_type="gpt2"), "model_type 'gpt2' is not supported"),
                          (dict(rope_parameters=dict(rope_type="yarn", factor=2.0)),
                           "rope type 'yarn' is not supported"),
                          (dict(hidden_act="gelu"), "hidden_act='gelu'"),
                          (dict(sliding_window=4096), "sliding_window=4096"),
                          (dict(model_type="qwen2", use_sliding_window=True),
                           "use_sliding_window=True")):
    (tmp_path / "config.json").write_text(json.dumps({**base, **change}))
    with pytest.raises(hf.HFError, match=message):
      hf.read_config(str(tmp_path))


def test_gemma_layer_patterns_defaults_and_the_multimodal_wrapper(tmp_path):
  # Which layers slide comes from layer_types or, in older configs, from
  # sliding_window_pattern; a multimodal Gemma 3 reads as its text part, its vision tower
  # left out of the weights.
  from safetensors.numpy import load_file, save_file
  d = os.path.join(FIXTURES, "gemma3_text")
  cfg = hf.read_config(d)
  config = json.load(open(os.path.join(d, "config.json")))
  legacy = {k: v for k, v in config.items() if k not in ("layer_types", "rope_parameters")}
  legacy.update(sliding_window_pattern=2, rope_theta=1e6, rope_local_base_freq=1e4,
                rope_scaling=dict(rope_type="linear", factor=4.0))
  (tmp_path / "config.json").write_text(json.dumps(legacy))
  assert hf.read_config(str(tmp_path)) == cfg
  legacy["sliding_window_pattern"] = 4
  (tmp_path / "config.json").write_text(json.dumps(legacy))
  assert hf.read_config(str(tmp_path)).layer_types == (
      ("sliding_attention",) * 3 + ("full_attention",))
  wrapped = tmp_path / "mm"
  wrapped.mkdir()
  (wrapped / "config.json").write_text(json.dumps(
      {"model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"],
       "text_config": config, "vision_config": {"hidden_size": 8}}))
  tensors = {"model.language_model." + k[len("model."):]: v
             for k, v in load_file(os.path.join(d, "model.safetensors")).items()}
  tensors["model.vision_tower.patch.weight"] = np.zeros((8, 3), np.float32)
  save_file(tensors, str(wrapped / "model.safetensors"))
  assert hf.read_config(str(wrapped)) == cfg
  assert _rel(_logits(str(wrapped), tokens_from=d), np.load(os.path.join(d, "logits.npy"))) <= 1e-5
  gemma2 = json.load(open(os.path.join(FIXTURES, "gemma2", "config.json")))
  for key in ("layer_types", "attn_logit_softcapping", "final_logit_softcapping",
              "query_pre_attn_scalar", "sliding_window"):
    gemma2.pop(key)
  (tmp_path / "config.json").write_text(json.dumps(gemma2))
  defaults = hf.read_config(str(tmp_path))
  assert (defaults.attn_softcap, defaults.final_softcap, defaults.query_pre_attn_scalar,
          defaults.sliding_window, defaults.layer_types) == (
              50.0, 30.0, 256.0, 4096, ("sliding_attention", "full_attention") * 1 +
              ("sliding_attention",))
  for change, message in ((dict(hidden_activation="gelu_new"), "hidden_activation='gelu_new'"),
                          (dict(use_bidirectional_attention=True), "use_bidirectional")):
    (tmp_path / "config.json").write_text(json.dumps({**gemma2, **change}))
    with pytest.raises(hf.HFError, match=message):
      hf.read_config(str(tmp_path))


def _copy(name, tmp_path):
  d = tmp_path / name
  shutil.copytree(os.path.join(FIXTURES, name), d)
  return str(d)


def test_missing_extra_and_misshaped_tensors_are_named(tmp_path):
  from safetensors.numpy import load_file, save_file
  d = _copy("llama3", tmp_path)
  cfg = hf.read_config(d)
  path = os.path.join(d, "model.safetensors")
  tensors = load_file(path)
  for edit, message in (
      (lambda t: t.pop("model.layers.1.mlp.up_proj.weight"), "missing.*layers.1.mlp.up_proj"),
      (lambda t: t.update(extra=np.zeros(3, np.float32)), "unexpected.*extra"),
      (lambda t: t.update({"model.norm.weight": np.zeros(47, np.float32)}),
       r"model.norm.weight has shape \(47,\), expected \(48,\)")):
    edited = dict(tensors)
    edit(edited)
    save_file(edited, path)
    with pytest.raises(hf.HFError, match=message):
      hf.load_params(d, cfg)


@pytest.mark.parametrize("name", NAMES)
def test_save_round_trip_is_exact_and_sharded_equals_single_file(name, tmp_path):
  d = os.path.join(FIXTURES, name)
  cfg = hf.read_config(d)
  params = hf.load_params(d, cfg)
  single, sharded = str(tmp_path / "single"), str(tmp_path / "sharded")
  hf.save_params(params, cfg, single, src_dir=d, dtype="float32")
  hf.save_params(params, cfg, sharded, dtype="float32", shard_bytes=20_000)
  assert os.path.exists(os.path.join(sharded, "model.safetensors.index.json"))
  assert len([f for f in os.listdir(sharded) if f.endswith(".safetensors")]) > 2
  for out in (single, sharded):
    assert hf.read_config(out) == cfg
    again = hf.load_params(out, cfg)
    jax.tree.map(np.testing.assert_array_equal, again, params)


def test_load_places_leaves_with_the_given_shardings():
  d = os.path.join(FIXTURES, "llama3")
  cfg = hf.read_config(d)
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("model",))
  specs = model_lib.param_specs(cfg, "model")
  shardings = jax.tree.map(lambda s: jax.sharding.NamedSharding(mesh, s), specs)
  placed = hf.load_params(d, cfg, shardings=shardings)
  assert placed["layers"]["wq"].sharding == shardings["layers"]["wq"]
  whole = hf.load_params(d, cfg)
  jax.tree.map(np.testing.assert_array_equal, placed, whole)
  # Every device reads its own block, cut on any axes (layers, in, out, transposed or
  # not): split every leaf over a 4 x 2 mesh wherever a dimension divides.
  mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(4, 2), ("a", "b"))

  def spec(x):
    axes, free = [], ["a", "b"]
    for dim in x.shape:
      axis = next((a for a in free if dim % mesh.shape[a] == 0), None)
      axes.append(axis)
      free = [a for a in free if a != axis]
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*axes))

  blocks = hf.load_params(d, cfg, shardings=jax.tree.map(spec, whole), dtype=np.float32)
  assert len(blocks["layers"]["wq"].sharding.device_set) == 8
  jax.tree.map(np.testing.assert_array_equal, blocks, whole)


@pytest.mark.slow  # imports torch (when installed)
@pytest.mark.parametrize("name", NAMES)
def test_live_transformers_parity_and_export_loads_in_transformers(name, tmp_path):
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  import tunix_kernels  # noqa: F401  (ours, not PyPI's `kernels`, even with transformers around)
  assert hasattr(tunix_kernels, "fused_logprobs")
  d = os.path.join(FIXTURES, name)
  cfg = hf.read_config(d)
  params = hf.load_params(d, cfg)
  # A changed policy, exported, must load in transformers and give our logits.
  params = jax.tree.map(lambda x: x * 1.01, params)
  out = str(tmp_path / "export")
  hf.save_params(params, cfg, out, src_dir=d, dtype="float32")
  tokens = np.load(os.path.join(d, "tokens.npy"))
  ours = _logits(out, cfg, params, tokens_from=d)
  for model_dir, want in ((d, None), (out, ours)):
    model = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
      theirs = model(torch.from_numpy(tokens).long()).logits.numpy()
    want = np.load(os.path.join(d, "logits.npy")) if want is None else want
    assert _rel(theirs, want) <= 1e-5


def _expected_tokenizer():
  with open(os.path.join(FIXTURES, "tokenizer", "expected.json"), encoding="utf-8") as f:
    return json.load(f)


def test_tokenizer_matches_what_transformers_recorded():
  pytest.importorskip("tokenizers")
  pytest.importorskip("jinja2")
  tok = hf.HFTokenizer(os.path.join(FIXTURES, "tokenizer"))
  want = _expected_tokenizer()
  oracles.assert_tokenizer_matches_recorded(tok, want)


def test_tokenizer_config_variants_and_errors(tmp_path):
  pytest.importorskip("tokenizers")
  d = tmp_path / "tok"
  shutil.copytree(os.path.join(FIXTURES, "tokenizer"), d)
  config = json.loads((d / "tokenizer_config.json").read_text())
  template = config.pop("chat_template")
  # A named-template list, then a chat_template.jinja file, render the same as a string.
  for variant in ("list", "file"):
    if variant == "list":
      config["chat_template"] = [{"name": "tool_use", "template": "x"},
                                 {"name": "default", "template": template}]
    else:
      config.pop("chat_template")
      (d / "chat_template.jinja").write_text(template)
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    got = hf.HFTokenizer(str(d)).apply_chat_template(_expected_tokenizer()["chats"][0])
    assert got == _expected_tokenizer()["chat"][0]
  (d / "chat_template.jinja").unlink()
  (d / "tokenizer_config.json").write_text(json.dumps(
      {**config, "pad_token": None, "eos_token": {"content": "<|im_end|>"}}))
  tok = hf.HFTokenizer(str(d))
  assert tok.pad_id == tok.eos_id == 2 and tok.chat_template is None
  with pytest.raises(hf_tokenizer.TokenizerError, match="no chat template"):
    tok.apply_chat_template([])
  (d / "tokenizer_config.json").write_text(json.dumps({**config, "eos_token": "<nope>"}))
  with pytest.raises(hf_tokenizer.TokenizerError, match="'<nope>' is not in the vocabulary"):
    hf.HFTokenizer(str(d))
  with pytest.raises(hf_tokenizer.TokenizerError, match="has no tokenizer.json"):
    hf.HFTokenizer(str(tmp_path))


@pytest.mark.slow  # imports transformers (when installed)
def test_live_tokenizer_equals_transformers():
  transformers = pytest.importorskip("transformers")
  d = os.path.join(FIXTURES, "tokenizer")
  ours, theirs = hf.HFTokenizer(d), transformers.AutoTokenizer.from_pretrained(d)
  want = _expected_tokenizer()
  for text in want["texts"] + ["a new sentence, never seen"]:
    assert ours.encode(text) == theirs.encode(text, add_special_tokens=False)
  for chat in want["chats"]:
    for g in (False, True):
      assert ours.apply_chat_template(chat, add_generation_prompt=g) == \
          theirs.apply_chat_template(chat, tokenize=False, add_generation_prompt=g)


def test_sliding_window_counts_real_tokens_so_padding_changes_nothing():
  d = os.path.join(FIXTURES, "mistral")
  cfg = hf.read_config(d)
  params = hf.load_params(d, cfg)
  tokens = np.load(os.path.join(d, "tokens.npy"))
  padded = np.concatenate([np.zeros((2, 5), np.int32), tokens], axis=1)
  mask = np.concatenate([np.zeros((2, 5), np.int32), np.ones_like(tokens)], axis=1)
  got = np.asarray(model_lib.logits(params, padded, mask, cfg))[:, 5:]
  assert _rel(got, np.load(os.path.join(d, "logits.npy"))) <= 1e-5
