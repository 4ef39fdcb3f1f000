"""The attention kernels partitioned under plain `jax.jit` (`tunix_kernels.gspmd`).

The rule: rows (`b`) and key/value heads (`v`, with the query heads `(v g)` that read
them, `g = H / KV`) stay split over the mesh axes they arrive over; the sequence and the
head dimension are gathered (a query attends over its whole row). Each device then runs
the kernels on its rows and heads, building the visit lists of its own rows; no
collective is needed, forward or backward, and dq, dk, dv come back with the shardings
of q, k, v. Query heads split over more devices than there are KV heads stay whole.
"""

import functools

import jax

from tunix_kernels.attention import backward as attention_backward
from tunix_kernels.attention import pallas as attention_pallas
from tunix_kernels.attention import tiles as attention_tiles
from tunix_kernels import gspmd
from tunix_kernels.attention.tiles import TileDims

_SPLIT = {"b": "batch", "v": "heads"}


def _factors(d: TileDims):
  heads = "v" if d.groups == 1 else "(v g)"
  q, kv, vec = f"b {heads} t e", "b v t e", "b t"
  ins = (q, kv, kv) + (vec,) * 4 + ("w",)
  return ins, (q, f"b {heads} o t"), ({} if d.groups == 1 else {"g": d.groups})


def _forward_body(d: TileDims, axes, q, k, v, *vectors):
  del axes  # rows and heads are independent
  return attention_pallas.forward(d, q, k, v, attention_pallas.rows(*vectors, d.bq, d.bk))


def _backward_body(d: TileDims, axes, q, k, v, *rest):
  del axes
  vectors, (o, lse, do) = rest[:5], rest[5:]
  rows = attention_pallas.rows(*vectors, d.bq, d.bk)
  return attention_backward.backward(d, q, k, v, rows, o, lse, do)


def _forward_op(d: TileDims):
  ins, outs, sizes = _factors(d)
  return gspmd.partitioned(functools.partial(_forward_body, d), ins, outs, _SPLIT, **sizes)


def _backward_op(d: TileDims):
  ins, outs, sizes = _factors(d)
  q, lse = outs
  return gspmd.partitioned(functools.partial(_backward_body, d), ins + (q, lse, q),
                           ins[:3], _SPLIT, **sizes)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def flash_attention(d: TileDims, q_BxHxTxK, k_BxVxTxK, v_BxVxTxK, vectors):
  """`attention_pallas.flash_attention` partitioned over the operands' shardings, with
  the rows' `vectors` (segments, branches, positions, valid `[B, T]` int32, the window
  `[1]`) in place of the kernels' `Rows`; differentiable in q, k, v."""
  return _forward_op(d)(q_BxHxTxK, k_BxVxTxK, v_BxVxTxK, *vectors)[0]


def _fwd(d, q, k, v, vectors):
  o, lse = attention_tiles.residuals(*_forward_op(d)(q, k, v, *vectors))
  return o, (q, k, v, vectors, o, lse)


def _bwd(d, res, do):
  q, k, v, vectors, o, lse = res
  dq, dk, dv = _backward_op(d)(q, k, v, *vectors, o, lse, do)
  return dq, dk, dv, None


flash_attention.defvjp(_fwd, _bwd)
