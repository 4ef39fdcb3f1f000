"""Prefix sharing and padding-free packing: the model rows a pair batch is computed in.

The data stays `[B, 2, T]` (tokens, targets, masks) from the dataset to the loss; this
module decides, on the host, where the model computes it (`pack` builds the rows that
`objective.sequence_logps` runs, `Spec` their static shapes):

- **Prefix sharing** (`--prefix_sharing`): a pair is one sequence `prompt | chosen |
  rejected`. The rejected response's positions restart where the prompt ends and its
  tokens never see the chosen response (branch ids: 0 prompt, 1 chosen, 2 rejected;
  `kernels.attention.Visibility`). Attention is causal, so the prompt's hidden states are
  the same under both responses: computing them once is exact, and the backward sums
  both responses' gradients into them. A pair whose two rows do not start with the same
  prompt tokens is computed as two sequences.
- **Packing** (`--packing`): the pairs of a group follow each other in one row, each its
  own segment (attention never crosses segments; positions restart per pair), so the
  row carries no padding but its tail. The XLA attention then scores each block of
  queries against a band as long as the longest sequence, not the whole row.

The LM head runs on the scored positions alone, gathered flat: slot i of a group's
`head_*` arrays reads the hidden state at row position `head_src[i]` (flat over the
group's rows), scores `head_targets[i]` and writes the log-prob at `head_dst[i]` (flat
over the group's `[pairs, 2, T]`); unused slots target `IGNORE_INDEX` and write nowhere.
A group is the `pairs` consecutive pairs one device computes at once (one micro-batch),
so the global batch packs into consecutive groups and splits over the mesh as it is.
Packing is a pure function of the batch, which the data iterator's state determines:
resumes stay exact.
"""

import dataclasses

import numpy as np

import kernels

# Row lengths and head sizes are rounded up to this (full tiles, fewer distinct shapes).
ROUND = 16
PACKED_ROUND = 128
ROW_KEYS = ("row_tokens", "row_positions", "row_segments", "row_branches")
HEAD_KEYS = ("head_src", "head_targets", "head_dst")


def _round(n: int) -> int:
  return max(ROUND, -(-n // ROUND) * ROUND)


@dataclasses.dataclass(frozen=True)
class Spec:
  """Static shapes of a group: `rows` model rows of `length` tokens, `head` LM-head
  slots for `pairs` pairs; `band` (packing) bounds any sequence's length, None when a
  row holds one pair; `share`: prefix sharing."""

  pairs: int
  rows: int
  length: int
  head: int
  band: int | None
  share: bool


def _pair(tokens_2xT, mask_2xT, loss_2xT, share: bool):
  """One pair's sequence `(tokens, positions, branches, segments, where_2xT)`; the first
  four are 1-D over the pair's tokens (segments 1 or 1, 2), `where_2xT` maps each real
  row position to its index in them (-1 for padding)."""
  real = [np.flatnonzero(mask_2xT[c]) for c in range(2)]
  toks = [tokens_2xT[c, real[c]] for c in range(2)]
  n0, n1 = len(toks[0]), len(toks[1])
  # The prompt ends at the first scored position: its target is the first response token.
  ends = [int((np.cumsum(mask_2xT[c]) - 1)[np.argmax(loss_2xT[c])]) + 1
          if loss_2xT[c].any() else -1 for c in range(2)]
  p = ends[0]
  if share and p > 0 and ends[1] == p and np.array_equal(toks[0][:p], toks[1][:p]):
    seq = [np.concatenate(toks[:1] + [toks[1][p:]]),
           np.concatenate([np.arange(n0), np.arange(p, n1)]),
           np.concatenate([np.zeros(p), np.ones(n0 - p), np.full(n1 - p, 2)]),
           np.ones(n0 + n1 - p)]
    index = [np.arange(n0), np.concatenate([np.arange(p), n0 + np.arange(n1 - p)])]
  else:
    seq = [np.concatenate(toks), np.concatenate([np.arange(n0), np.arange(n1)]),
           np.zeros(n0 + n1), np.concatenate([np.ones(n0), np.full(n1, 2)])]
    index = [np.arange(n0), n0 + np.arange(n1)]
  where_2xT = np.full(tokens_2xT.shape, -1, np.int64)
  for c in range(2):
    where_2xT[c, real[c]] = index[c]
  return [x.astype(np.int32) for x in seq] + [where_2xT]


def pair_sizes(batch: dict, share: bool) -> tuple[np.ndarray, np.ndarray]:
  """`(tokens, scored)` int `[B]`: each pair's sequence length and scored positions."""
  lengths = [len(_pair(t, m, l, share)[0]) for t, m, l in
             zip(batch["tokens"], batch["attention_mask"], batch["loss_mask"])]
  return np.array(lengths), batch["loss_mask"].reshape(len(lengths), -1).sum(-1)


def make_spec(sizes: list[tuple[np.ndarray, np.ndarray]], pairs: int, share: bool,
              pack: bool) -> Spec:
  """The smallest static shapes every group of `pairs` pairs from data of these
  `pair_sizes` fits in: the head (and a packed row) holds the `pairs` largest pairs."""
  lengths = np.concatenate([s[0] for s in sizes])
  scored = np.concatenate([s[1] for s in sizes])
  top = lambda x: int(np.sort(x)[-pairs:].sum())
  if pack:
    # A packed row is a whole number of attention tiles: the TPU flash kernel's, and the
    # XLA path's query blocks.
    length = -(-top(lengths) // PACKED_ROUND) * PACKED_ROUND
    return Spec(pairs, 1, length, _round(top(scored)), int(lengths.max()), share)
  return Spec(pairs, pairs, _round(int(lengths.max())), _round(top(scored)), None, share)


def _pack_group(batch: dict, spec: Spec) -> dict:
  """The rows and head slots of one group (`batch` arrays `[spec.pairs, 2, T]`)."""
  G, L, N = spec.rows, spec.length, spec.head
  T = batch["tokens"].shape[-1]
  rows = {k: np.zeros((G, L), np.int32) for k in ROW_KEYS}
  head = {"head_src": np.zeros(N, np.int32),
          "head_targets": np.full(N, kernels.IGNORE_INDEX, np.int32),
          "head_dst": np.full(N, spec.pairs * 2 * T, np.int32)}
  fill, segments, slot = np.zeros(G, np.int64), np.zeros(G, np.int32), 0
  for i in range(spec.pairs):
    toks, pos, branch, seg, where = _pair(batch["tokens"][i], batch["attention_mask"][i],
                                          batch["loss_mask"][i], spec.share)
    r = 0 if G == 1 else i
    start, end = fill[r], fill[r] + len(toks)
    c, t = np.nonzero(batch["loss_mask"][i])
    if end > L or slot + len(t) > N:
      raise ValueError(f"a group of pairs needs {end} tokens per row and {slot + len(t)} "
                       f"LM-head slots but the step was compiled for {L} and {N} (the "
                       f"packing spec measured the data it was given; pass every split)")
    for key, x in zip(ROW_KEYS, (toks, pos, seg + segments[r], branch)):
      rows[key][r, start:end] = x
    head["head_src"][slot:slot + len(t)] = r * L + start + where[c, t]
    head["head_targets"][slot:slot + len(t)] = batch["targets"][i, c, t]
    head["head_dst"][slot:slot + len(t)] = (i * 2 + c) * T + t
    fill[r], segments[r], slot = end, segments[r] + seg.max(), slot + len(t)
  return rows | head


def pack(batch: dict, spec: Spec) -> dict:
  """`batch` (host arrays `[B, 2, T]`) plus its groups' rows `[B / pairs * rows, length]`
  (`ROW_KEYS`) and head slots `[B / pairs * head]` (`HEAD_KEYS`), group after group.
  ValueError if `B` is not whole groups or a group does not fit `spec`."""
  B = batch["tokens"].shape[0]
  if B % spec.pairs:
    raise ValueError(f"a batch of {B} pairs is not whole groups of {spec.pairs}")
  groups = [_pack_group({k: v[g:g + spec.pairs] for k, v in batch.items()}, spec)
            for g in range(0, B, spec.pairs)]
  return dict(batch, **{k: np.concatenate([g[k] for g in groups])
                        for k in ROW_KEYS + HEAD_KEYS})
