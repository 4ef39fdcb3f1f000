"""Online DPO's sampling: the policy completes each prompt K times, the reward judges.

Each step, the batch's prompts (`--train_data`'s, their responses unused) are left-padded
to the longest prompt of the data and completed `K = --online_samples` times each by
`model.generate` (a KV cache, static shapes), jitted on the run's params as they are
placed (split under FSDP and TP: XLA gathers each weight where it is used) with the
`B K` rows split over the data-parallel devices. The ids come to every host; the primary
process decodes them, scores them with `--reward_fn` and broadcasts the scores; every
host then builds the same pair batch (`data.sampled_pairs`). With `--online_data_chosen`
each prompt's chosen response from the data is scored beside its samples, a candidate
for the chosen side only: where every sample misses, the pair is the data's answer
against the policy's worst sample (as SPIN pairs them, Chen et al. 2024). The sampling
key of step N is `fold_in(key(seed), N)`, so a resumed run samples exactly what a
straight one does.
"""

import time

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec as P

from tunix_core.data import sampled_pairs as pairs_lib
from tunix_core.model import generate as generate_lib
from tunix_core.online import reward_fn as reward_lib
from tunix_core.parallel import mesh as mesh_lib

# Folded into the seed's key, apart from the params' initialisation and the data order.
_SAMPLING_STREAM = 0x0D90


def longest_prompt(store) -> int:
  """Ids of the longest prompt of a token store (`data.store.PairStore`)."""
  return int(store.prompt_lengths().max())


class OnlineSampler:
  """Samples, scores and pairs each step's prompts (module docstring).

  `cfg`: the run's `TrainConfig` (its `online_*` settings, `--reward_fn`, `--seed`);
  `steps`: its `training.step.StepFunctions` (the mesh, the plan); `tok`: its tokenizer;
  `eos_ids`: the ids that end a sample."""

  def __init__(self, cfg, steps, train_set, tok, eos_ids: tuple):
    self.cfg, self.steps, self.train_set, self.tok = cfg, steps, train_set, tok
    self.K, self.spec = cfg.online_samples, cfg.reward_fn
    self.reward = reward_lib.load(cfg.reward_fn)
    self.prompt_len = longest_prompt(train_set)
    self.sampling = generate_lib.Sampling(
        cfg.online_max_new_tokens, temperature=cfg.online_temperature,
        top_p=cfg.online_top_p, eos_ids=eos_ids)
    self.greedy = generate_lib.Sampling(cfg.online_max_new_tokens, eos_ids=eos_ids)
    self.rows = NamedSharding(steps.mesh, P(steps.batch_axes))
    self.key = jax.random.fold_in(jax.random.PRNGKey(cfg.seed), _SAMPLING_STREAM)
    self.skip = {tok.pad_id, tok.eos_id, *eos_ids} | (
        set() if tok.bos_id is None else {tok.bos_id})
    self.last_end = None  # when the previous step's sampling ended

  def _text(self, ids) -> str:
    return self.tok.decode([int(t) for t in ids if int(t) not in self.skip])

  def _generate(self, params, prompts: list, repeat: int, key, sampling):
    """`(samples [n, repeat, N], lengths [n, repeat])` on host of `repeat` completions
    of each prompt."""
    n, L = len(prompts) * repeat, self.prompt_len
    ids_NxL = np.full((n, L), self.tok.pad_id, np.int32)
    mask_NxL = np.zeros((n, L), np.int32)
    for i, p in enumerate(np.repeat(np.arange(len(prompts)), repeat)):
      x = prompts[p][-L:]
      ids_NxL[i, L - len(x):], mask_NxL[i, L - len(x):] = x, 1
    put = lambda a: jax.make_array_from_callback(a.shape, self.rows, lambda i: a[i])
    tokens, lengths = generate_lib.generate(params, put(ids_NxL), put(mask_NxL), key,
                                            cfg=self.steps.mcfg, sampling=sampling)
    tokens, lengths = mesh_lib.to_host(tokens), mesh_lib.to_host(lengths)
    return (tokens.reshape(len(prompts), repeat, -1), lengths.reshape(len(prompts), repeat))

  def _with_data_chosen(self, runs, samples, lengths):
    """The samples `[n, K, N]` and lengths `[n, K]` with each prompt's chosen response
    from the data appended as candidate K (it fits: `training.plan.data_sizes`)."""
    n, _, N = samples.shape
    chosen_nx1xN = np.full((n, 1, N), self.tok.pad_id, samples.dtype)
    for b, (_, chosen, _) in enumerate(runs):
      chosen_nx1xN[b, 0, :len(chosen)] = chosen
    lengths_nx1 = np.array([[len(c)] for _, c, _ in runs], lengths.dtype)
    return (np.concatenate([samples, chosen_nx1xN], 1),
            np.concatenate([lengths, lengths_nx1], 1))

  def _scores(self, prompts: list, samples, lengths, at: str) -> np.ndarray:
    """The reward of every candidate `[n, C]` (`lengths`' shape: the K samples, and
    the data's chosen response after them with `--online_data_chosen`), computed by the
    primary process and broadcast (the others pass zeros that the broadcast replaces)."""
    n, k = lengths.shape
    scores = np.zeros(n * k)
    if jax.process_index() == 0:
      texts = [self._text(p) for p in prompts for _ in range(k)]
      done = [self._text(s[:m]) for s, m in zip(samples.reshape(n * k, -1), lengths.reshape(-1))]
      scores = reward_lib.score(self.reward, self.spec, texts, done, at)
    if jax.process_count() > 1:
      scores = np.asarray(multihost_utils.broadcast_one_to_all(scores.astype(np.float32)))
    return scores.reshape(n, k)

  def __call__(self, step: int, params, idx) -> tuple[dict, dict]:
    """`(pair batch, metrics)` of step `step` on the prompts of the pairs `idx` under
    the policy `params` (logical arrays, `StepFunctions.policy_params`). Metrics:
    `online/reward_mean`, `online/reward_max` (of the samples), `online/tie_rate` (the
    share of prompts with nothing to prefer), `online/sample_length` (mean sampled ids),
    `online/sample_share`: this step's sampling time over itself plus the time from the
    previous step's sampling to the end of its update (1 at a run's first step), and with
    `--online_data_chosen` `online/data_chosen`, the share of prompts whose chosen
    response is the data's."""
    jax.block_until_ready(params)  # the previous step's update: its time, not sampling's
    began = time.perf_counter()
    runs = self.train_set.runs(idx)
    prompts = [p for p, _, _ in runs]
    samples, lengths = self._generate(params, prompts, self.K,
                                      jax.random.fold_in(self.key, step), self.sampling)
    candidates, candidate_lengths = (self._with_data_chosen(runs, samples, lengths)
                                     if self.cfg.online_data_chosen else (samples, lengths))
    scores = self._scores(prompts, candidates, candidate_lengths, f"step {step}")
    batch = pairs_lib.build(prompts, candidates, candidate_lengths, scores,
                            self.tok.pad_id, self.cfg.max_length, samples=self.K)
    end = time.perf_counter()
    seconds, train = end - began, began - (self.last_end or began)
    self.last_end = end
    chosen, _, tied = pairs_lib.choose(scores, self.K)
    own = scores[:, :self.K]
    metrics = {"online/reward_mean": own.mean(), "online/reward_max": own.max(),
               "online/tie_rate": tied.mean(), "online/sample_length": lengths.mean(),
               "online/sample_share": seconds / (seconds + train)}
    if self.cfg.online_data_chosen:  # candidate K, after the samples that win its ties
      metrics["online/data_chosen"] = (chosen == self.K).mean()
    return batch, metrics

  def evaluate(self, params, eval_set) -> dict:
    """`eval/reward` (mean) and `eval/exact_match` (the share of prompts whose sample
    is exactly their chosen response, ids and ending included) of greedy completions of
    every prompt of `eval_set`, in batches of `--batch_size` times K (or 1) prompts."""
    n, size = len(eval_set), self.cfg.batch_size * max(self.K, 1)
    rewards, exact = [], []
    for first in range(0, n, size):
      idx = np.arange(first, min(first + size, n))
      runs = eval_set.runs(np.concatenate([idx, np.full(size - len(idx), idx[0])]))
      prompts = [p for p, _, _ in runs]
      samples, lengths = self._generate(params, prompts, 1, self.key, self.greedy)
      got = [s[0, :m[0]] for s, m in zip(samples, lengths)][:len(idx)]
      rewards.append(self._scores(prompts[:len(idx)], samples[:len(idx)],
                                  lengths[:len(idx)], "evaluation")[:, 0])
      exact += [np.array_equal(g, c) for g, (_, c, _) in zip(got, runs)]
    return {"eval/reward": float(np.concatenate(rewards).mean()),
            "eval/exact_match": float(np.mean(exact))}
