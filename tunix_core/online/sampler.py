"""Online DPO's sampling: the policy completes each prompt K times, the reward judges.

Each step, the batch's prompts (`--train_data`'s, their responses unused) are left-padded
to the longest prompt of the data and completed `K = --online_samples` times each by
`model.generate` (a KV cache, static shapes), jitted on the run's params as they are
placed (split under FSDP and TP: XLA gathers each weight where it is used) with the
`B K` rows split over the data-parallel devices. The ids come to every host; the primary
process scores them with `--reward_fn` as TRL calls one (`reward_fn`: the data's own
prompt, string or messages, each completion's text and ids up to its first EOS, the
row's other columns) and `--reward_model` (`reward_model`), weighted by
`--reward_weights`, and broadcasts the float32 scores, or a reward's error, which
then ends every process alike; every host builds the same pair batch
(`data.sampled_pairs`). With `--online_data_chosen` each prompt's chosen response from
the data, up to its first EOS (a chat template's ids after its end of turn are in no
sample), is scored beside its samples, a candidate for the chosen side only: where
every sample misses, the pair is the data's answer against the policy's worst sample
(as SPIN pairs them, Chen et al. 2024). The sampling key of step N is
`fold_in(key(seed), N)`, so a resumed run samples exactly what a straight one does.
"""

import time

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec as P

from tunix_core import generate
from tunix_core.data import build as data_build
from tunix_core.data import sampled_pairs as pairs_lib
from tunix_core.model import generate as generate_lib
from tunix_core.online import reward_fn as reward_lib
from tunix_core.online import reward_model as reward_model_lib
from tunix_core.parallel import mesh as mesh_lib

# Folded into the seed's key, apart from the params' initialisation and the data order.
_SAMPLING_STREAM = 0x0D90
# Bytes of a reward's error message the primary process sends the others.
_ERROR_BYTES = 512


def longest_prompt(store) -> int:
  """Ids of the longest prompt of a token store (`data.store.PairStore`)."""
  return int(store.prompt_lengths().max())


def _agree(error: str | None) -> None:
  """Raises the primary process's error (None: none) as a `RewardError` on every process
  alike (the others pass None); every process makes the same collective calls."""
  failed = np.asarray([error is not None], np.int32)
  if jax.process_count() > 1:
    failed = np.asarray(multihost_utils.broadcast_one_to_all(failed))
  if failed[0]:
    text = np.frombuffer((error or "").encode()[:_ERROR_BYTES].ljust(_ERROR_BYTES, b"\0"),
                         np.uint8)
    if jax.process_count() > 1:
      text = np.asarray(multihost_utils.broadcast_one_to_all(text))
    raise reward_lib.RewardError(bytes(text).rstrip(b"\0").decode(errors="replace"))


def _broadcast_scores(scores_NxC, error: str | None):
  """The primary process's float32 scores `[n, C]` (the others pass zeros of that shape),
  or its reward's error on every process (`_agree`)."""
  _agree(error)
  scores_NxC = np.asarray(scores_NxC, np.float32)
  if jax.process_count() > 1:
    scores_NxC = np.asarray(multihost_utils.broadcast_one_to_all(scores_NxC))
  return scores_NxC


def _one_line(what: str, e: Exception) -> str:
  return f"{what}: {type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}"


class OnlineSampler:
  """Samples, scores and pairs each step's prompts (module docstring).

  `cfg`: the run's `TrainConfig` (its `online_*` settings, `--reward_fn`, `--seed`);
  `steps`: its `training.step.StepFunctions` (the mesh, the plan); `tok`: its tokenizer;
  `eos_ids`: the ids that end a sample."""

  def __init__(self, cfg, steps, train_set, tok, eos_ids: tuple):
    self.cfg, self.steps, self.train_set, self.tok = cfg, steps, train_set, tok
    self.K, self.eos_ids = cfg.online_samples, tuple(eos_ids)
    # `(flag, callable)` of each reward; the model is read where it scores: process 0.
    self.rewards = [(f"--reward_fn={cfg.reward_fn}", reward_lib.load(cfg.reward_fn))
                    ] if cfg.reward_fn else []
    error = None
    if cfg.reward_model and jax.process_index() == 0:
      name = f"--reward_model={cfg.reward_model}"
      try:
        self.rewards.append((name, reward_model_lib.RewardModel(cfg.reward_model,
                                                                steps.mcfg.compute_dtype)))
      except Exception as e:  # noqa: BLE001 - any failure ends every process alike
        error = _one_line(f"{name} cannot be loaded", e)
    if cfg.reward_model:
      _agree(error)
    self.weights = ([float(w) for w in cfg.reward_weights.split(",")] if cfg.reward_weights
                    else [1.0] * (bool(cfg.reward_fn) + bool(cfg.reward_model)))
    self.prompt_len = longest_prompt(train_set)
    self.sampling = generate_lib.Sampling(
        cfg.online_max_new_tokens, temperature=cfg.online_temperature,
        top_k=cfg.online_top_k, top_p=cfg.online_top_p, eos_ids=self.eos_ids)
    self.greedy = generate_lib.Sampling(cfg.online_max_new_tokens, eos_ids=self.eos_ids)
    self.rows = NamedSharding(steps.mesh, P(steps.batch_axes))
    self.key = jax.random.fold_in(jax.random.PRNGKey(cfg.seed), _SAMPLING_STREAM)
    self.records = {}  # data path -> {line: the JSONL row}, read at first use
    self.last_end = None  # when the previous step's sampling ended

  def _rows(self, path: str, store, idx) -> list[dict]:
    """The JSONL rows (every column) the pairs `idx` of `store` came from."""
    if path not in self.records:
      self.records[path] = data_build.read_rows(path, store.lines)
    return [self.records[path][int(store.lines[i])] for i in idx]

  def _generate(self, params, prompts: list, repeat: int, key, sampling, length: int):
    """`(samples [n, repeat, N], lengths [n, repeat])` on host of `repeat` completions
    of each prompt, left-padded to `length` ids (a static shape: one compile)."""
    ids, mask = generate.left_pad([p for p in prompts for _ in range(repeat)],
                                  self.tok.pad_id, length)
    put = lambda a: jax.make_array_from_callback(a.shape, self.rows, lambda i: a[i])
    tokens, lengths = generate_lib.generate(params, put(ids), put(mask), key,
                                            cfg=self.steps.mcfg, sampling=sampling)
    tokens, lengths = mesh_lib.to_host(tokens), mesh_lib.to_host(lengths)
    return (tokens.reshape(len(prompts), repeat, -1), lengths.reshape(len(prompts), repeat))

  def _with_data_chosen(self, runs, samples, lengths):
    """The samples `[n, K, N]` and lengths `[n, K]` with each prompt's chosen response
    from the data, up to its first EOS, appended as candidate K (it fits:
    `training.plan.data_sizes`)."""
    n, _, N = samples.shape
    chosen_nx1xN = np.full((n, 1, N), self.tok.pad_id, samples.dtype)
    lengths_nx1 = np.zeros((n, 1), lengths.dtype)
    for b, (_, chosen, _) in enumerate(runs):
      ids = generate.until_eos(chosen, self.eos_ids)
      chosen_nx1xN[b, 0, :len(ids)], lengths_nx1[b, 0] = ids, len(ids)
    return (np.concatenate([samples, chosen_nx1xN], 1),
            np.concatenate([lengths, lengths_nx1], 1))

  def _scores(self, rows: list[dict], samples, lengths, at: str,
              penalize: bool = True) -> np.ndarray:
    """The reward of every candidate `[n, C]` float32 (`lengths`' shape: the K samples,
    and the data's chosen response after them with `--online_data_chosen`), computed by
    the primary process and broadcast; with `penalize`, the first `K` (samples) cut
    before their EOS lose `--online_missing_eos_penalty`."""
    n, c = lengths.shape
    scores, error = np.zeros((n, c)), None
    if jax.process_index() == 0:
      try:
        scores = self._primary_scores(rows, samples, lengths, at, penalize)
      except reward_lib.RewardError as e:
        error = str(e)
      except Exception as e:  # noqa: BLE001 - the inputs are the user's data
        error = _one_line(f"rewards at {at}", e)
    return _broadcast_scores(scores, error)

  def _primary_scores(self, rows, samples, lengths, at, penalize) -> np.ndarray:
    n, c = lengths.shape
    ids = [generate.until_eos(s[:m], self.eos_ids)
           for s, m in zip(samples.reshape(n * c, -1), lengths.reshape(-1))]
    texts = [generate.completion_text(self.tok, x, self.eos_ids) for x in ids]
    chat = [not isinstance(r["prompt"], str) for r in rows for _ in range(c)]
    inputs = {k: [r.get(k) for r in rows for _ in range(c)]
              for k in dict.fromkeys(k for r in rows for k in r if k != "prompt")}
    inputs.update(prompts=[r["prompt"] for r in rows for _ in range(c)],  # a column's too
                  completions=[[{"role": "assistant", "content": t}] if m else t
                               for t, m in zip(texts, chat)], completion_ids=ids)
    scores = sum(w * reward_lib.score(fn, name, at, **inputs)
                 for w, (name, fn) in zip(self.weights, self.rewards)).reshape(n, c)
    if not penalize:
      return scores
    ended = np.array([bool(x) and x[-1] in self.eos_ids for x in ids]).reshape(n, c)
    penalty = np.where(ended, 0.0, self.cfg.online_missing_eos_penalty)
    penalty[:, self.K:] = 0.0  # the data's answer is not a sample
    return scores - penalty

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
                                      jax.random.fold_in(self.key, step), self.sampling,
                                      self.prompt_len)
    candidates, candidate_lengths = (self._with_data_chosen(runs, samples, lengths)
                                     if self.cfg.online_data_chosen else (samples, lengths))
    rows = self._rows(self.cfg.train_data, self.train_set, idx)
    scores = self._scores(rows, candidates, candidate_lengths, f"step {step}")
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
    """`eval/reward` (mean) and `eval/exact_match` (the share of prompts whose greedy
    answer equals their chosen response, both up to their first EOS: ids, ending
    included) of greedy completions of every prompt of `eval_set`, in batches of
    `--batch_size` times K (or 1) prompts."""
    n, size = len(eval_set), self.cfg.batch_size * max(self.K, 1)
    length = max(self.prompt_len, longest_prompt(eval_set))  # no eval prompt is cut
    rewards, exact = [], []
    for first in range(0, n, size):
      idx = np.arange(first, min(first + size, n))
      runs = eval_set.runs(np.concatenate([idx, np.full(size - len(idx), idx[0])]))
      prompts = [p for p, _, _ in runs]
      samples, lengths = self._generate(params, prompts, 1, self.key, self.greedy, length)
      samples, lengths, runs = samples[:len(idx)], lengths[:len(idx)], runs[:len(idx)]
      rows = self._rows(self.cfg.eval_data, eval_set, idx)
      rewards.append(self._scores(rows, samples, lengths, "evaluation", penalize=False)[:, 0])
      exact += [generate.until_eos(s[0, :m[0]], self.eos_ids)
                == generate.until_eos(c, self.eos_ids)
                for s, m, (_, c, _) in zip(samples, lengths, runs)]
    return {"eval/reward": float(np.concatenate(rewards).mean()),
            "eval/exact_match": float(np.mean(exact))}
