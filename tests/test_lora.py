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

import runs
from oracles import rel_error
from tunix_core import hf
from tunix_core import model as model_lib
from tunix_core.hf import peft as peft_lib
from tunix_core.model import lora

HERE = os.path.dirname(os.path.abspath(__file__))
HF, LORA = (os.path.join(HERE, "fixtures", d) for d in ("hf", "lora"))


def _base(name):
  """The HF fixture an adapter fixture is for (`llama3_bf16`: `llama3`)."""
  return os.path.join(HF, name.removesuffix("_bf16"))


def _adapted(name):
  cfg = hf.read_config(_base(name))
  base = hf.load_params(_base(name), cfg)
  lcfg, adapters = peft_lib.read_adapter(os.path.join(LORA, name), cfg)
  return dataclasses.replace(cfg, lora_scale=lcfg.scale), base, lcfg, adapters


def _logits(params, cfg, name):
  return np.asarray(model_lib.logits(params, np.load(os.path.join(_base(name), "tokens.npy")),
                                     None, cfg))


# The fast tier keeps llama3 and its adapters as peft saves them from a bf16 model.
@pytest.mark.parametrize("name", [pytest.param(n, marks=() if n.startswith("llama3") else
                                               pytest.mark.slow) for n in sorted(os.listdir(LORA))])
def test_adapted_logits_match_peft_on_the_committed_fixtures(name):
  pytest.importorskip("safetensors", reason="reads PEFT fixtures: needs the hf extra")
  cfg, base, lcfg, adapters = _adapted(name)
  want = np.load(os.path.join(LORA, name, "logits.npy"))
  got = _logits(lora.attach(base, adapters), cfg, name)
  assert rel_error(got, want) <= 1e-5
  assert rel_error(_logits(base, cfg, name), want) > 1e-2  # the adapters matter
  # Folded into the weights (--export_merged), the model is the same.
  assert rel_error(_logits(lora.merge(base, adapters, lcfg), cfg, name), want) <= 1e-5


@pytest.mark.slow
def test_a_bf16_adapter_saved_by_peft_starts_a_lora_run_at_ln2(tmp_path):
  """--lora_init of what peft saves from a bf16 model (`llama3_bf16`): the run's start
  (`run.source.lora_start`) reads it, and its first step's loss is ln 2 (the reference
  is the base with that adapter)."""
  pytest.importorskip("safetensors", reason="reads PEFT fixtures: needs the hf extra")
  from tunix_core import data as data_lib  # pylint: disable=g-import-not-at-top
  from tunix_core.run import source  # pylint: disable=g-import-not-at-top
  init = os.path.join(LORA, "llama3_bf16")
  lcfg = peft_lib.read_config(init)
  cfg = runs.config(tmp_path, hf_model_dir=_base("llama3_bf16"), lora_init=init,
                    lora_rank=lcfg.rank, lora_alpha=lcfg.alpha,
                    lora_targets=",".join(lcfg.targets))
  steps = runs.steps(cfg, jax.devices())
  frozen, adapters = source.lora_start(cfg, steps, jax.random.PRNGKey(0), "float32")
  vocab = steps.mcfg.vocab_size   # 160: the byte ids folded into it
  pairs = data_lib.take_pairs(runs.dataset(cfg.max_length, cfg.max_prompt_length),
                              np.arange(cfg.batch_size))
  pairs = {k: np.where(v >= 0, v % vocab, v) if k in ("tokens", "targets") else v
           for k, v in pairs.items()}
  _, metrics = steps.train_step(steps.init_state(jax.random.PRNGKey(0), adapters), frozen,
                                steps.put_batch(pairs))
  assert float(metrics["loss"]) == pytest.approx(np.log(2), abs=1e-6)
  assert float(metrics["rewards/margins"]) == 0.0


@pytest.mark.slow
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
  logits = jax.jit(model_lib.logits, static_argnums=3)
  np.testing.assert_array_equal(logits(lora.attach(base, adapters), tokens, None, cfg),
                                logits(base, tokens, None, cfg))
  assert lora.detach(lora.attach(base, adapters))[0].keys() == base.keys()
  with pytest.raises(ValueError, match="unknown LoRA targets"):
    lora.LoraConfig(4, 8, targets=("qkv",))
  with pytest.raises(ValueError, match="rank must be a positive int"):
    lora.LoraConfig(0, 8)


def test_peft_directories_round_trip_and_unsupported_adapters_are_named(tmp_path):
  pytest.importorskip("safetensors", reason="writes PEFT adapters: needs the hf extra")
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


@pytest.mark.slow
@pytest.mark.parametrize("base,kw", [
    ("zero1", dict(reference="precomputed")),
    ("fsdp", dict(model_parallel=2, model="tiny_tp", max_grad_norm=0.05, remat="full_prefetch"))],
                         ids=["zero1-precomputed", "fsdp-tp-clipped-remat"])
def test_lora_steps_on_8_devices_equal_one_device_from_ln2(tmp_path, base, kw):
  """Adapters over a frozen base held replicated (ZeRO-1, the reference precomputed) or
  in FSDP pieces of a 2-way tensor-parallel split (adapters split as their projections,
  the global norm clipped over both axes, the layer stack's hand-written backward of
  `--remat=full_prefetch`, the reference in the step):
  5 steps on 8 devices equal 1 device; step 1 starts at ln 2 (fresh adapters leave the
  base as it is: the policy is the reference)."""
  cfg = runs.config(tmp_path, steps=5, batch_size=8, lora_rank=4, lora_alpha=8.0,
                    fsdp=base == "fsdp", learning_rate=1e-2, **kw)
  eight = runs.step_run(runs.steps(cfg, jax.devices()), cfg, num_steps=5)
  one_cfg = dataclasses.replace(cfg, fsdp=False, model_parallel=1)
  one = runs.step_run(runs.steps(one_cfg, jax.devices()[:1]), one_cfg, num_steps=5)
  assert abs(eight[0][0]["loss"] - np.log(2)) < 1e-6
  assert eight[0][-1]["loss"] < eight[0][0]["loss"] - 1e-3  # the adapters learn
  # Clipped Adam over a 2 x 4 split sums the gradients in another order than 1 device:
  # the final adapters differ by 1.00e-5 relative on jax 0.12 (8e-6 on 0.10), whatever
  # the remat policy; every loss agrees to 3e-7.
  runs.assert_agree(eight, one, tol=2e-5 if "model_parallel" in kw else 1e-5)
  assert sorted(eight[1]) == ["w_down", "w_gate", "w_up", "wk", "wo", "wq", "wv"]


@pytest.mark.slow
def test_lora_from_a_peft_adapter_trains_resumes_and_exports(tmp_path):
  """The trainer on an HF directory with --lora_init (an adapter with non-zero B): step
  1 is ln 2 (the reference is the base with that adapter, frozen); a run cut after step
  2 and resumed equals the uninterrupted one; the checkpoint holds no base weights; the
  export is a PEFT adapter of the final adapters and, merged, the base with them folded
  in; --sample_every's completions under the adapters equal the merged export's."""
  from tunix_core import generate  # pylint: disable=g-import-not-at-top
  from tunix_core.model import generate as generate_lib  # pylint: disable=g-import-not-at-top
  from tunix_core.run import loop  # pylint: disable=g-import-not-at-top
  from tunix_core.training import config as config_lib  # pylint: disable=g-import-not-at-top
  pytest.importorskip("tokenizers")
  cfg = dataclasses.replace(model_lib.preset("tiny"), vocab_size=320)
  model_dir, init_dir = str(tmp_path / "model"), str(tmp_path / "sft_adapter")
  base = model_lib.init_params(jax.random.PRNGKey(3), cfg)
  hf.save_params(base, cfg, model_dir, dtype="float32")
  for name in ("tokenizer.json", "tokenizer_config.json"):
    shutil.copy(os.path.join(HF, "tokenizer", name), model_dir)
  lcfg = lora.LoraConfig(rank=2, alpha=4.0, targets=("q_proj", "v_proj", "down_proj"))
  sft = jax.tree.map(lambda x: x + 0.05, lora.init_adapters(jax.random.PRNGKey(4), cfg, lcfg))
  peft_lib.write_adapter(init_dir, jax.device_get(sft), cfg, lcfg, base_model=model_dir)

  def run(out, steps, **kw):
    c = config_lib.TrainConfig(
        output_dir=str(out), train_data=runs.TRAIN, hf_model_dir=model_dir, max_length=64,
        max_prompt_length=32, batch_size=4, steps=steps, log_every=1, learning_rate=1e-2,
        lr_schedule="constant", lora_init=init_dir, **kw)
    return loop.train(c, devices=jax.devices()[:2], log=lambda *_: None)

  export_dir = str(tmp_path / "export")
  prompts = tmp_path / "prompts.txt"
  prompts.write_text("the quick brown\nhello\n")
  full = run(tmp_path / "full", 4, export_hf_dir=export_dir, export_merged=True,
             sample_every=4, sample_prompts=str(prompts), sample_max_new_tokens=6)
  losses = runs.losses(tmp_path / "full")
  assert losses[1] == pytest.approx(np.log(2), abs=1e-6) and losses[4] < losses[1] - 1e-3
  run(tmp_path / "cut", 2, save_every=2)
  run(tmp_path / "cut", 4, save_every=2)
  assert runs.losses(tmp_path / "cut") == pytest.approx(losses, abs=1e-6)
  # Checkpoints hold adapters (and their optimizer state), never the base.
  state_bytes = sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in
                    os.walk(tmp_path / "full" / "checkpoints" / "4") for f in fs)
  base_bytes = sum(x.nbytes for x in jax.tree.leaves(base))
  assert state_bytes < base_bytes / 4, (state_bytes, base_bytes)
  lcfg2, exported = peft_lib.read_adapter(export_dir, cfg)
  assert lcfg2 == lcfg
  final = jax.device_get(full["state"]["params"])
  jax.tree.map(np.testing.assert_array_equal, exported, final)
  # Any saved step of a LoRA run exports as a PEFT adapter (`python -m tunix_core.hf export`).
  from tunix_core.checkpoints import export  # pylint: disable=g-import-not-at-top
  assert export.export_step(str(tmp_path / "cut"), str(tmp_path / "step4"), log=print) == 4
  jax.tree.map(np.testing.assert_array_equal,
               peft_lib.read_adapter(str(tmp_path / "step4"), cfg)[1], final)
  merged = hf.load_params(os.path.join(export_dir, "merged"), cfg)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7),
               merged, lora.merge(base, final, lcfg))
  with open(tmp_path / "full" / "samples.jsonl", encoding="utf-8") as f:
    sampled = [json.loads(line) for line in f]
  assert [(r["step"], r["prompt"]) for r in sampled] == [
      (s, p) for s in (0, 4) for p in ("the quick brown", "hello")]
  tok = hf.HFTokenizer(model_dir)
  sampling = generate_lib.Sampling(6, eos_ids=generate.eos_ids(model_dir, tok))
  for rows, params in ((sampled[:2], lora.merge(base, sft, lcfg)), (sampled[2:], merged)):
    done = generate.complete(params, cfg, tok, ["the quick brown", "hello"], sampling,
                             chat=tok.chat_template is not None)
    assert [r["completion"] for r in rows] == [d["text"] for d in done]


@pytest.mark.parametrize("name", sorted(os.listdir(LORA)))
def test_our_exports_load_in_peft_and_transformers(tmp_path, name):
  """Live, where torch, transformers and peft are installed (CI skips it; the committed
  fixtures above hold the same parity without torch): the adapter directory our export
  writes (`peft.write_adapter`, B non-zero, rsLoRA on some projections) loads with
  `peft.PeftModel.from_pretrained` onto the fixture's base, and the merged export
  (`hf.save_params` of `lora.merge`) loads with `transformers` alone; both give our
  adapted logits within 1e-5 relative (torch in float64)."""
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  peft = pytest.importorskip("peft")
  cfg = hf.read_config(os.path.join(HF, name))
  base = hf.load_params(os.path.join(HF, name), cfg)
  lcfg = lora.LoraConfig(rank=3, alpha=5.0, rslora=True,
                         targets=("q_proj", "v_proj", "o_proj", "up_proj", "down_proj"))
  adapters = jax.tree.map(lambda x: x + 0.02, lora.init_adapters(jax.random.PRNGKey(5), cfg,
                                                                 lcfg))
  adapter_dir, merged_dir = str(tmp_path / "adapter"), str(tmp_path / "merged")
  peft_lib.write_adapter(adapter_dir, jax.device_get(adapters), cfg, lcfg,
                         base_model=os.path.join(HF, name))
  hf.save_params(lora.merge(base, adapters, lcfg), cfg, merged_dir,
                 src_dir=os.path.join(HF, name), dtype="float32")
  ours = _logits(lora.attach(base, adapters), dataclasses.replace(cfg, lora_scale=lcfg.scale),
                 name)
  tokens = torch.from_numpy(np.load(os.path.join(HF, name, "tokens.npy")).astype(np.int64))
  load = lambda d: transformers.AutoModelForCausalLM.from_pretrained(
      d, attn_implementation="eager", dtype=torch.float64).eval()
  adapted = peft.PeftModel.from_pretrained(load(os.path.join(HF, name)), adapter_dir).eval()
  with torch.no_grad():
    for model in (adapted, load(merged_dir)):
      assert rel_error(ours, model(tokens).logits.numpy()) <= 1e-5
  assert rel_error(_logits(base, cfg, name), ours) > 1e-3  # the adapters matter
