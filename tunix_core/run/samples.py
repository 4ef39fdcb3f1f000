"""Samples during training (`--sample_every`): completions of a fixed set of prompts,
appended to `{output_dir}/samples.jsonl` as `{"step", "prompt", "completion"}` rows.

The prompts are the lines of `--sample_prompts` (one prompt per line), else the first
`MAX_PROMPTS` prompts of `--eval_data` (a conversational prompt is sampled through the
run's chat template as it is). Generation (`tunix_core.model.generate`, greedy) is its
own jitted function on the run's params as they are placed, so the train step is never
retraced. A fresh run also samples before its first step (step 0: the model it starts
from), and every sample goes to the run's TensorBoard and W&B sinks as a table.
"""

import json

import jax

from tunix_core import generate
from tunix_core.data import build as data_build
from tunix_core.data import sources
from tunix_core.model import generate as generate_lib
from tunix_core.storage import paths

MAX_PROMPTS = 4


def read_prompts(cfg) -> list:
  """The prompts to sample: strings, or message lists of conversational data."""
  if cfg.sample_prompts:
    return [l for l in paths.read_text(cfg.sample_prompts).splitlines() if l.strip()]
  prompts = []
  for where, _, raw, _ in sources.records(cfg.eval_data):
    pair = data_build.parse_record(where, raw)
    if pair is not None:
      prompts.append(pair["prompt"])
    if len(prompts) == MAX_PROMPTS:
      break
  return prompts


class Sampler:
  """Writes the completions of `prompts` under `params` at a step. Every process calls
  it (the params may span them); the first process writes."""

  def __init__(self, cfg, mcfg, tok, prompts: list, log, start: int = 0, writer=None):
    self.path = paths.join(cfg.output_dir, "samples.jsonl")
    self.mcfg, self.tok, self.log, self.writer = mcfg, tok, log, writer
    self.chat = getattr(tok, "chat_template", None) is not None
    # Without a chat template only plain-text prompts can be sampled.
    self.prompts = prompts if self.chat else [p for p in prompts if isinstance(p, str)]
    self.sampling = generate_lib.Sampling(cfg.sample_max_new_tokens,
                                          eos_ids=generate.eos_ids(cfg.hf_model_dir, tok))
    rows = paths.read_text(self.path).splitlines() if paths.isfile(self.path) else []
    # On a resume, rows past the restored step came from the run it replaces.
    self.rows = [r for r in rows if r.strip() and json.loads(r)["step"] <= start]

  def __call__(self, step: int, params) -> None:
    done = generate.complete(params, self.mcfg, self.tok, self.prompts, self.sampling,
                             chat=self.chat)
    rows = [{"step": step, "prompt": p, "completion": d["text"]}
            for p, d in zip(self.prompts, done)]
    self.rows += [json.dumps(r) for r in rows]
    if jax.process_index() == 0:
      paths.write_text(self.path, "\n".join(self.rows) + "\n")
    if self.writer is not None:
      # A conversational prompt shows as its last message.
      self.writer.samples(step, [dict(r, prompt=r["prompt"] if isinstance(r["prompt"], str)
                                      else r["prompt"][-1]["content"]) for r in rows])
    self.log(f"samples @ {step}: {json.dumps(done[0]['text'])[:100]}")
