"""Writes PEFT LoRA adapters for some of the tiny Hugging Face fixtures under
`tests/fixtures/lora/` and the logits `peft` gives for them, so CI can check LoRA parity
without torch.

    pip install torch==2.13.0 transformers peft safetensors   # CPU-only torch, Python 3.11
    python tests/make_lora_fixtures.py [NAME ...]   # default: all of them

Each directory holds what `PeftModel.save_pretrained` writes (`adapter_config.json`,
`adapter_model.safetensors`, float32; bfloat16 for `*_bf16`, whose adapters are rounded
to bfloat16 before the logits are computed) for the base model in
`tests/fixtures/hf/BASE` (the name before any `_bf16`),
`logits.npy` (float32 `[2, T, V]` of the adapted model on the base fixture's
`tokens.npy`, computed in float64: the fixtures' large weights make torch's own float32
logits differ from it by up to 7e-5) and `versions.json`. The adapters are random in
both A and B (PEFT's `init_lora_weights=False`), so they move the logits by far more
than the tolerance of the tests.
"""

import json
import os

import numpy as np
import peft
import torch
import transformers

HF = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "hf")
ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "lora")
FIXTURES = {  # base fixture -> LoraConfig keywords
    "llama3": dict(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj",
                                                       "gate_proj", "up_proj", "down_proj"]),
    "qwen2": dict(r=2, lora_alpha=5, target_modules=["q_proj", "v_proj", "down_proj"],
                  use_rslora=True),
    "gemma2": dict(r=3, lora_alpha=3, target_modules=["k_proj", "o_proj", "up_proj"]),
}
FIXTURES["llama3_bf16"] = FIXTURES["llama3"]   # as peft saves a bf16 model's adapters


def main(names):
  for name in names or FIXTURES:
    torch.manual_seed(0)
    base_name, bf16 = name.removesuffix("_bf16"), name.endswith("_bf16")
    base = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.join(HF, base_name), attn_implementation="eager", torch_dtype=torch.float64)
    config = peft.LoraConfig(task_type="CAUSAL_LM", lora_dropout=0.0,
                             init_lora_weights=False, **FIXTURES[name])
    model = peft.get_peft_model(base, config).double().eval()
    out_dir = os.path.join(ROOT, name)
    if bf16:  # only the adapters: the base stays exact
      for pname, param in model.named_parameters():
        if "lora_" in pname:
          param.data = param.data.to(torch.bfloat16)
      model.save_pretrained(out_dir)
      for pname, param in model.named_parameters():
        if "lora_" in pname:
          param.data = param.data.double()
    else:
      model.float().save_pretrained(out_dir)  # float32 tensors, as a training run writes
      model.double()
    tokens = np.load(os.path.join(HF, base_name, "tokens.npy"))
    with torch.no_grad():
      logits = model(torch.from_numpy(tokens).long()).logits.float().numpy()
    np.save(os.path.join(out_dir, "logits.npy"), logits)
    with open(os.path.join(out_dir, "versions.json"), "w") as f:
      json.dump(dict(torch=torch.__version__, transformers=transformers.__version__,
                     peft=peft.__version__), f)
    path = os.path.join(out_dir, "adapter_config.json")  # no machine's absolute path
    with open(path) as f:
      written = json.load(f)
    written["base_model_name_or_path"] = f"tests/fixtures/hf/{base_name}"
    with open(path, "w") as f:
      json.dump(written, f, indent=2, sort_keys=True)
    readme = os.path.join(out_dir, "README.md")
    if os.path.exists(readme):
      os.remove(readme)
    print(name, logits.shape, f"|logits| max {np.abs(logits).max():.2f}")


if __name__ == "__main__":
  import sys  # pylint: disable=g-import-not-at-top
  main(sys.argv[1:])
