"""Online DPO's flags (`--online_samples` and what judges its samples): the base of
`training.config.TrainConfig`, which adds every other flag; `flag` makes a field a flag."""

import dataclasses


def flag(default, help_text: str, **metadata):
  """A config field that is also a trainer flag: its default and `--help` text."""
  return dataclasses.field(default=default, metadata=dict(help=help_text, **metadata))


@dataclasses.dataclass(frozen=True)
class OnlineConfig:
  """The `online` flag group (docs/training.md#online-dpo)."""

  online_samples: int = flag(0, "Online DPO: each step, sample K completions of every "
                             "prompt, score them (--reward_fn, --reward_model), train on "
                             "the best and worst (the data's responses unused but with "
                             "--online_data_chosen). 0: offline.", group="online")
  reward_fn: str = flag("", "MODULE:FUNCTION, a reward function as TRL calls one: "
                        "fn(prompts=, completions=, completion_ids=, **columns) -> list of "
                        "floats, message lists for conversational data, every other column "
                        "of the data's rows by name; a plain fn(prompts, completions) works "
                        "too (e.g. tunix_core.online.rewards:quickstart). Needed by "
                        "--online_samples; with --eval_every, eval rows also carry the "
                        "reward and exact match of greedy answers to the eval prompts.",
                        group="online")
  reward_model: str = flag("", "A Hugging Face *ForSequenceClassification directory (Llama, "
                           "Mistral, Qwen2/3, Gemma families) that scores each prompt and "
                           "completion, on the devices, read-only; with --reward_fn too, "
                           "the reward is their weighted sum (--reward_weights).",
                           group="online")
  reward_weights: str = flag("", "Comma-separated weights of --reward_fn and "
                             "--reward_model, in that order, as TRL's reward_weights "
                             "(default: 1 each).", group="online")
  online_data_chosen: bool = flag(False, "Online DPO: the data's chosen response joins each "
                                  "prompt's samples, scored too, as a candidate for chosen "
                                  "only (a sample as good wins); it must fit "
                                  "--online_max_new_tokens.", group="online")
  online_temperature: float = flag(1.0, "Sampling temperature of --online_samples.",
                                   group="online")
  online_top_k: int = flag(0, "Top-k sampling of --online_samples (0: off).", group="online")
  online_top_p: float = flag(1.0, "Nucleus (top-p) sampling of --online_samples.",
                             group="online")
  online_max_new_tokens: int = flag(64, "Ids each online sample may add (stopping at EOS); "
                                    "with the longest prompt it must fit --max_length.",
                                    group="online")
  online_missing_eos_penalty: float = flag(0.0, "Subtracted from the reward of a sample the "
                                           "length limit cut before its EOS (TRL's "
                                           "missing_eos_penalty). 0: none.", group="online")
