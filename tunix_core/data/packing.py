"""The model rows a pair batch is computed in, and the LM head's slots: encoded on the
host (`pack`), decoded on the device (`head_hidden`, `unpack`).

The data stays `[B, 2, T]` (tokens, targets, masks) from the dataset to the loss; this
module decides where the model computes it. A `Spec` holds the static shapes of one
group (the `pairs` consecutive pairs one device computes at once, one micro-batch), in
one of four row layouts:

- **plain**: each response its own row (`2 pairs` rows), as long as the longest one in
  whole 128-token tiles (the TPU flash kernel's), at most the data's `max_length`.
- **shared** (`--prefix_sharing`): a pair is one sequence `prompt | chosen | rejected`.
  The rejected response's positions restart where the prompt ends and its tokens never
  see the chosen response (branch ids: 0 prompt, 1 chosen, 2 rejected;
  `tunix_kernels.attention.Visibility`). Attention is causal, so the prompt's hidden states
  are the same under both responses: computing them once is exact, and the backward
  sums both responses' gradients into them. A pair whose two rows do not start with the
  same prompt tokens is computed as two sequences (segments) of its row.
- **packed** (`--packing`, with or without sharing): the pairs of a group follow each
  other in one row, each its own segment (attention never crosses segments; positions
  restart per pair), so the row carries no padding but its tail. The XLA attention then
  scores each block of queries against a band as long as the longest sequence.

In every layout the LM head runs on the scored positions alone, gathered flat: slot i
of a group's `head_*` arrays reads the hidden state at row position `head_src[i]` (flat
over the group's rows), scores `head_targets[i]` and writes the log-prob at
`head_dst[i]` (flat over the group's `[pairs, 2, T]`); unused slots target
`IGNORE_INDEX` and write nowhere. The global batch packs into consecutive groups and
splits over the mesh as it is. Packing is a pure function of the batch, which the data
iterator's state determines: resumes stay exact.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

import tunix_kernels

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
  row holds one pair (or one response: the plain layout, `rows == 2 pairs`); `share`:
  prefix sharing."""

  pairs: int
  rows: int
  length: int
  head: int
  band: int | None
  share: bool

  @property
  def layout(self) -> str:
    """"plain", "shared", "packed" or "shared+packed"."""
    if self.band is not None:
      return "shared+packed" if self.share else "packed"
    return "shared" if self.share else "plain"


@dataclasses.dataclass(frozen=True)
class Sizes:
  """Per pair of some data (int arrays `[B]`): `tokens` of its sequence (prompt once
  when shared), `scored` positions, the `longest` of its two rows."""

  tokens: np.ndarray
  scored: np.ndarray
  longest: np.ndarray

  @staticmethod
  def join(sizes: list["Sizes"]) -> "Sizes":
    return Sizes(*(np.concatenate([getattr(s, f.name) for s in sizes])
                   for f in dataclasses.fields(Sizes)))


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


def pair_sizes(batch: dict, share: bool) -> Sizes:
  """The `Sizes` of each pair of a host batch `[B, 2, T]`."""
  lengths = [len(_pair(t, m, l, share)[0]) for t, m, l in
             zip(batch["tokens"], batch["attention_mask"], batch["loss_mask"])]
  B = len(lengths)
  return Sizes(np.array(lengths), batch["loss_mask"].reshape(B, -1).sum(-1),
               batch["attention_mask"].sum(-1).max(-1))


def make_spec(sizes: Sizes, pairs: int, share: bool, pack: bool,
              max_length: int | None = None) -> Spec:
  """The smallest static shapes every group of `pairs` pairs of data of these `sizes`
  fits in: the head (and a packed row) holds the `pairs` largest pairs. Neither `share`
  nor `pack`: the plain layout, whose rows are whole attention tiles but never longer
  than the data's `max_length` (the rounding stops there)."""
  top = lambda x: int(np.sort(x)[-pairs:].sum())
  head = _round(top(sizes.scored))
  if pack:
    # A packed row is a whole number of attention tiles (the TPU flash kernel's).
    length = -(-top(sizes.tokens) // PACKED_ROUND) * PACKED_ROUND
    return Spec(pairs, 1, length, head, int(sizes.tokens.max()), share)
  if share:
    return Spec(pairs, pairs, _round(int(sizes.tokens.max())), head, None, True)
  # Whole attention tiles (the TPU flash kernel's), but never past the data's rows.
  length = -(-int(sizes.longest.max()) // PACKED_ROUND) * PACKED_ROUND
  return Spec(pairs, 2 * pairs, min(length, max_length or length), head, None, False)


def _sequences(batch: dict, i: int, spec: Spec):
  """The sequences pair `i` of a group puts in its rows: `[(row, tokens, positions,
  segments, branches, where_2xT)]`, `where_2xT` indexing into that row's sequence."""
  if spec.layout != "plain":
    toks, pos, branch, seg, where = _pair(batch["tokens"][i], batch["attention_mask"][i],
                                          batch["loss_mask"][i], spec.share)
    return [(0 if spec.rows == 1 else i, toks, pos, seg, branch, where)]
  out = []
  for c in range(2):
    real = np.flatnonzero(batch["attention_mask"][i, c])
    where = np.full(batch["tokens"].shape[1:], -1, np.int64)
    where[c, real] = np.arange(len(real))
    ones = np.ones(len(real), np.int32)
    out.append((2 * i + c, batch["tokens"][i, c, real], np.arange(len(real), dtype=np.int32),
                ones, 0 * ones, where))
  return out


def _pack_group(batch: dict, spec: Spec, blank: bool = False) -> dict:
  """The rows and head slots of one group (`batch` arrays `[spec.pairs, 2, T]`);
  `blank`: all padding (a group another host computes)."""
  G, L, N = spec.rows, spec.length, spec.head
  T = batch["tokens"].shape[-1]
  rows = {k: np.zeros((G, L), np.int32) for k in ROW_KEYS}
  head = {"head_src": np.zeros(N, np.int32),
          "head_targets": np.full(N, tunix_kernels.IGNORE_INDEX, np.int32),
          "head_dst": np.full(N, spec.pairs * 2 * T, np.int32)}
  fill, segments, slot = np.zeros(G, np.int64), np.zeros(G, np.int32), 0
  for i in range(0 if blank else spec.pairs):
    for r, toks, pos, seg, branch, where in _sequences(batch, i, spec):
      start, end = fill[r], fill[r] + len(toks)
      c, t = np.nonzero(batch["loss_mask"][i] * (where >= 0))
      if end > L or slot + len(t) > N:
        raise ValueError(f"a group of pairs needs {end} tokens per row and {slot + len(t)} "
                         f"LM-head slots but the step was compiled for {L} and {N} (the "
                         f"step plan measured the data it was given; pass every split)")
      for key, x in zip(ROW_KEYS, (toks, pos, seg + segments[r], branch)):
        rows[key][r, start:end] = x
      head["head_src"][slot:slot + len(t)] = r * L + start + where[c, t]
      head["head_targets"][slot:slot + len(t)] = batch["targets"][i, c, t]
      head["head_dst"][slot:slot + len(t)] = (i * 2 + c) * T + t
      fill[r], segments[r], slot = end, segments[r] + seg.max(initial=0), slot + len(t)
  return rows | head


def pack(batch: dict, spec: Spec, only=None) -> dict:
  """`batch` (host arrays `[B, 2, T]`) plus its groups' rows `[B / pairs * rows, length]`
  (`ROW_KEYS`) and head slots `[B / pairs * head]` (`HEAD_KEYS`), group after group;
  `only` (pair positions): the groups holding none of them are left blank. ValueError
  if `B` is not whole groups or a group does not fit `spec`."""
  B = batch["tokens"].shape[0]
  if B % spec.pairs:
    raise ValueError(f"a batch of {B} pairs is not whole groups of {spec.pairs}")
  needed = np.ones(B, bool) if only is None else np.isin(np.arange(B), only)
  groups = [_pack_group({k: v[g:g + spec.pairs] for k, v in batch.items()}, spec,
                        blank=not needed[g:g + spec.pairs].any())
            for g in range(0, B, spec.pairs)]
  return dict(batch, **{k: np.concatenate([g[k] for g in groups])
                        for k in ROW_KEYS + HEAD_KEYS})


def head_hidden(hidden_RxLxD: jax.Array, batch: dict, spec: Spec) -> tuple:
  """On the device: `(hidden [n, head, D], targets [n, head])` of the `n` groups' head
  slots, from the model's output on the batch's rows. Differentiable in `hidden`."""
  n = hidden_RxLxD.shape[0] // spec.rows
  hidden_NxGLxD = hidden_RxLxD.reshape(n, spec.rows * spec.length, -1)
  per_group = lambda x: x.reshape(n, spec.head)
  hidden_NxSxD = jnp.take_along_axis(hidden_NxGLxD, per_group(batch["head_src"])[..., None],
                                     axis=1)
  return hidden_NxSxD, per_group(batch["head_targets"])


def unpack(logps_NxS: jax.Array, batch: dict, spec: Spec) -> jax.Array:
  """On the device: the head slots' log-probs `[n, head]` back at their places in the
  batch's `[B, 2, T]` (0 where unscored). Differentiable in `logps`."""
  B, _, T = batch["loss_mask"].shape
  n = logps_NxS.shape[0]
  dst_NxS = batch["head_dst"].reshape(n, spec.head)
  # Unused slots write past the end: dropped.
  logps_NxP2T = jnp.zeros((n, B // n * 2 * T), logps_NxS.dtype).at[
      jnp.arange(n)[:, None], dst_NxS].set(logps_NxS, mode="drop")
  return logps_NxP2T.reshape(B, 2, T)
