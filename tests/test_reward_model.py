"""`--reward_model=HF_DIR`: a classifier's scores against `transformers`'
`AutoModelForSequenceClassification` (fixtures of `make_reward_fixtures.py`), a causal LM
refused in one line, and an online run judged by a reward model and a reward function
together."""

import dataclasses
import json
import os
import shutil

import jax
import numpy as np
import pytest

import runs
from tunix_core.run import loop as train
from tunix_core.training.config import ConfigError

pytest.importorskip("safetensors", reason="Hugging Face files: the hf extra")
pytest.importorskip("tokenizers", reason="Hugging Face files: the hf extra")
from tunix_core import hf  # pylint: disable=g-import-not-at-top,wrong-import-position
from tunix_core import model as model_lib  # pylint: disable=g-import-not-at-top,wrong-import-position
from tunix_core.online import reward_model  # pylint: disable=g-import-not-at-top,wrong-import-position

FIXTURES = os.path.join(runs.REPO, "tests", "fixtures", "reward")


@pytest.mark.parametrize("family", ["llama", pytest.param("qwen2", marks=pytest.mark.slow)])
def test_scores_equal_transformers_sequence_classification(family):
  d = os.path.join(FIXTURES, family)
  rm = reward_model.RewardModel(d, "float32")
  tokens, lengths = np.load(os.path.join(d, "tokens.npy")), np.load(os.path.join(d, "lengths.npy"))
  got = rm.score_ids([row[:n].tolist() for row, n in zip(tokens, lengths)])
  np.testing.assert_allclose(got, np.load(os.path.join(d, "scores.npy")), rtol=1e-4, atol=1e-4)
  # A row alone scores as in the batch: its padding never moves the pooled token.
  np.testing.assert_allclose(rm.score_ids([tokens[1, :lengths[1]].tolist()]), got[1:2],
                             rtol=1e-5, atol=1e-5)


def test_a_causal_lm_is_refused_in_one_line():
  with pytest.raises(ConfigError, match=r"hf/llama3 is a LlamaForCausalLM, not a "
                     r"\*ForSequenceClassification model"):
    reward_model.check(os.path.join(runs.REPO, "tests", "fixtures", "hf", "llama3"))


def _policy_dir(tmp_path) -> str:
  """The tiny preset's shapes with the fixture tokenizer's 320 ids, as an HF directory."""
  mcfg = dataclasses.replace(model_lib.preset("tiny"), vocab_size=320)
  d = tmp_path / "policy"
  hf.save_params(model_lib.init_params(jax.random.PRNGKey(3), mcfg), mcfg, str(d),
                 dtype="float32")
  for name in ("tokenizer.json", "tokenizer_config.json"):
    shutil.copy(os.path.join(FIXTURES, "llama", name), d)
  return str(d)


@pytest.mark.slow  # compiles the classifier
def test_the_sampler_scores_the_weighted_sum_of_the_function_and_the_model(tmp_path):
  """`--reward_weights=0.5,2`: each candidate's score is 0.5 x the function's plus 2 x the
  classifier's of the same prompt and completion text (plain data: BOS? + prompt + text)."""
  from tunix_core.data import build as data_build  # pylint: disable=g-import-not-at-top
  from tunix_core.online import sampler as sampler_lib  # pylint: disable=g-import-not-at-top
  import online_rewards  # pylint: disable=g-import-not-at-top
  d = os.path.join(FIXTURES, "llama")
  tok = hf.HFTokenizer(d)
  path = tmp_path / "pairs.jsonl"
  path.write_text("".join(json.dumps({"prompt": p, "chosen": "yes", "rejected": "no"}) + "\n"
                          for p in ("Hi? ", "2+2=")))
  store = data_build.build(str(path), tok, str(tmp_path / "store"), 32, 16)
  cfg = runs.config(tmp_path / "run", train_data=str(path), online_samples=2,
                    reward_fn="online_rewards:checksum", reward_model=d,
                    reward_weights="0.5,2")
  steps = type("Steps", (), dict(mesh=jax.make_mesh((1,), ("data",)), batch_axes="data",
                                 mcfg=dataclasses.replace(model_lib.preset("tiny"),
                                                          compute_dtype="float32")))
  sampler = sampler_lib.OnlineSampler(cfg, steps, store, tok, (tok.eos_id,))
  texts = [["yes", "no!"], ["4", "four"]]
  ids = [[tok.encode(t) + [tok.eos_id] for t in row] for row in texts]
  N = max(len(x) for row in ids for x in row)
  samples = np.zeros((2, 2, N), np.int32)
  for b in range(2):
    for k in range(2):
      samples[b, k, :len(ids[b][k])] = ids[b][k]
  lengths = np.array([[len(x) for x in row] for row in ids])
  rows = [json.loads(l) for l in path.read_text().splitlines()]
  got = sampler._scores(rows, samples, lengths, "step 1")  # pylint: disable=protected-access
  rm = reward_model.RewardModel(d, "float32")
  for b, prompt in enumerate(r["prompt"] for r in rows):
    want = (0.5 * np.asarray(online_rewards.checksum([prompt] * 2, texts[b]))
            + 2 * rm([prompt] * 2, texts[b]))
    np.testing.assert_allclose(got[b], want, rtol=1e-5)


@pytest.mark.slow
def test_an_online_run_judged_by_a_reward_model_and_a_function_trains(tmp_path):
  """Both rewards, weighted: 3 online steps on CPU from an HF directory score every
  sample and update; a weight count that does not match is one line."""
  cfg = runs.config(tmp_path / "run", hf_model_dir=_policy_dir(tmp_path), steps=3,
                    online_samples=2, online_max_new_tokens=6,
                    reward_fn="online_rewards:checksum",
                    reward_model=os.path.join(FIXTURES, "qwen2"), reward_weights="0.5,2")
  train.train(cfg, **runs.QUIET)
  rows = [r for r in runs.rows(tmp_path / "run") if "online/reward_mean" in r]
  assert len(rows) == 3 and all(np.isfinite(r["online/reward_mean"]) for r in rows)
  assert any("loss" in r and r["grad_norm"] > 0 for r in rows), rows
  with pytest.raises(ConfigError, match="--reward_weights has 1 weight"):
    train.train(dataclasses.replace(cfg, reward_weights="1"), **runs.QUIET)
