"""Float64 NumPy oracles and inputs shared by the kernel tests.

Written from the formulas, independently of `tunix_kernels` (only `IGNORE_INDEX` is shared).
"""

import jax
import numpy as np

from tunix_kernels import IGNORE_INDEX


def numpy_logprobs(h, w, t, ignore_index=IGNORE_INDEX, softcap=None):
  """Float64 log_softmax(cap(h @ w))[t] (0 where ignored), the (capped) logits and their
  log-sum-exp; `cap(z) = softcap * tanh(z / softcap)`, the identity for None."""
  logits = np.asarray(h, np.float64) @ np.asarray(w, np.float64)
  if softcap is not None:
    logits = softcap * np.tanh(logits / softcap)
  m = logits.max(-1, keepdims=True)
  lse = m[..., 0] + np.log(np.exp(logits - m).sum(-1))
  ignored = t == ignore_index
  safe = np.where(ignored, 0, t)
  picked = np.take_along_axis(logits, safe[..., None], -1)[..., 0] - lse
  return np.where(ignored, 0.0, picked), logits, lse


def numpy_logprob_grads(h, w, t, g, ignore_index=IGNORE_INDEX, softcap=None,
                        weight_grad=True, forward=None):
  """Float64 gradients `(d_hidden, d_weight)` of `numpy_logprobs` for a cotangent g
  (`d_weight` None without `weight_grad`: it needs every row, `d_hidden` only its own);
  `forward`: `numpy_logprobs`' result for the same inputs, when the caller has it."""
  h64, w64 = np.asarray(h, np.float64), np.asarray(w, np.float64)
  _, logits, lse = forward or numpy_logprobs(h64, w64, t, ignore_index, softcap)
  p = np.exp(logits - lse[..., None])
  ignored = t == ignore_index
  onehot = np.zeros_like(p)
  np.put_along_axis(onehot, np.where(ignored, 0, t)[..., None], 1.0, -1)
  dlogits = np.where(ignored, 0.0, g)[..., None] * (onehot - p)
  if softcap is not None:  # d(c tanh(z / c)) / dz = 1 - tanh(z / c)^2 = 1 - (capped / c)^2
    dlogits = dlogits * (1.0 - (logits / softcap) ** 2)
  dh = dlogits @ w64.T
  dw = (h64.reshape(-1, h64.shape[-1]).T @ dlogits.reshape(-1, w64.shape[1])
        if weight_grad else None)
  return dh, dw


def numpy_dpo_loss(pc, pr, rc, rr, cm, rm, *, beta, loss_type, label_smoothing=0.0,
                   loss_weights=None, discopop_tau=0.05, f_divergence_type="reverse_kl",
                   f_alpha_divergence_coef=0.5, simpo_gamma=0.5, cpo_alpha=1.0):
  """Float64 `(loss, metrics)` of TRL 1.16's DPO loss types (`_compute_loss` of its
  DPOTrainer), SimPO / CPO (its CPOTrainer) and ORPO (its ORPOTrainer) on per-token
  `[B, T]` log-probs with 0/1 masks, written from TRL's code; `loss_type` a comma list."""
  pc, pr, rc, rr, cm, rm = (np.asarray(x, np.float64) for x in (pc, pr, rc, rr, cm, rm))
  types = loss_type.split(",")
  if set(types) <= {"simpo", "cpo", "orpo"}:  # TRL's CPO/ORPO trainers have no reference
    rc, rr = np.zeros_like(rc), np.zeros_like(rr)
  chosen_logps, rejected_logps = (pc * cm).sum(-1), (pr * rm).sum(-1)
  ref_chosen, ref_rejected = (rc * cm).sum(-1), (rr * rm).sum(-1)
  len_c, len_r = np.maximum(cm.sum(-1), 1.0), np.maximum(rm.sum(-1), 1.0)
  cr, rj = chosen_logps - ref_chosen, rejected_logps - ref_rejected
  logsig = lambda x: -np.logaddexp(0.0, -x)
  sigmoid = lambda x: 1.0 / (1.0 + np.exp(-x))
  if f_divergence_type == "forward_kl":
    cs, rs = -np.exp(-cr), -np.exp(-rj)
  elif f_divergence_type == "js_divergence":
    cs, rs = logsig(cr), logsig(rj)
  elif f_divergence_type == "alpha_divergence" and abs(f_alpha_divergence_coef - 1) >= 1e-6:
    a = f_alpha_divergence_coef
    cs = np.exp(np.minimum((a - 1) * cr, 80.0)) / (a - 1)
    rs = np.exp(np.minimum((a - 1) * rj, 80.0)) / (a - 1)
  else:
    cs, rs = cr, rj
  d, eps = cs - rs, label_smoothing
  # TRL's SFT / CPO / ORPO NLL: cross-entropy averaged over all chosen completion tokens.
  nll = -(pc * cm).sum() / cm.sum()
  weights = loss_weights or [1.0] * len(types)
  total = 0.0
  for t, w in zip(types, weights):
    if t == "sigmoid":
      per = -(1 - eps) * logsig(beta * d) - eps * logsig(-beta * d)
    elif t == "hinge":
      per = np.maximum(0.0, 1 - beta * d)
    elif t == "ipo":
      per = (cs / len_c - rs / len_r - 1 / (2 * beta)) ** 2
    elif t == "exo_pair":
      per = (sigmoid(beta * d) * (logsig(beta * d) - np.log1p(-eps))
             + sigmoid(-beta * d) * (logsig(-beta * d) - np.log(eps)))
    elif t == "nca_pair":
      per = -logsig(beta * cs) - 0.5 * logsig(-beta * cs) - 0.5 * logsig(-beta * rs)
    elif t == "robust":
      per = (-(1 - eps) * logsig(beta * d) + eps * logsig(-beta * d)) / (1 - 2 * eps)
    elif t == "bco_pair":
      per = -logsig(beta * cs) - logsig(-beta * rs)
    elif t == "sppo_hard":
      per = (cs - 0.5 / beta) ** 2 + (rs + 0.5 / beta) ** 2
    elif t == "aot":
      delta = np.sort(chosen_logps - rejected_logps) - np.sort(ref_chosen - ref_rejected)
      per = -logsig(beta * delta) * (1 - eps) - logsig(-beta * delta) * eps
    elif t == "aot_unpaired":
      delta = np.sort(cr) - np.sort(rj)
      per = -logsig(beta * delta) * (1 - eps) - logsig(-beta * delta) * eps
    elif t == "apo_zero":
      per = (1 - sigmoid(beta * cr)) + sigmoid(beta * rj)
    elif t == "apo_down":
      per = sigmoid(beta * cr) + (1 - sigmoid(beta * d))
    elif t == "discopop":
      logits = beta * d
      mod = sigmoid(logits / discopop_tau)
      per = -logsig(logits) * (1 - mod) + np.exp(-logits) * mod
    elif t == "sft":
      per = np.full_like(d, nll)
    elif t == "sigmoid_norm":
      per = -logsig(beta * (cs / len_c - rs / len_r))
    elif t == "simpo":  # CPOTrainer, loss_type="simpo", cpo_alpha=0: average log-probs
      logits = (chosen_logps / len_c - rejected_logps / len_r) - simpo_gamma / beta
      per = -logsig(beta * logits) * (1 - eps) - logsig(-beta * logits) * eps
    elif t == "cpo":  # CPOTrainer, loss_type="sigmoid": summed log-probs, + alpha * NLL
      logits = chosen_logps - rejected_logps
      per = -logsig(beta * logits) * (1 - eps) - logsig(-beta * logits) * eps + cpo_alpha * nll
    elif t == "orpo":  # ORPOTrainer: average log-probs; loss = NLL - beta * logsig(odds)
      ac, ar = chosen_logps / len_c, rejected_logps / len_r
      log_odds = (ac - ar) - (np.log1p(-np.exp(ac)) - np.log1p(-np.exp(ar)))
      per = nll - beta * logsig(log_odds)
    else:
      raise ValueError(t)
    total += per.mean() * w
  chosen, rejected = beta * cr, beta * rj
  metrics = {"rewards/chosen": chosen.mean(), "rewards/rejected": rejected.mean(),
             "rewards/accuracies": (chosen > rejected).mean(),
             "rewards/margins": (chosen - rejected).mean(),
             "logps/chosen": chosen_logps.mean(), "logps/rejected": rejected_logps.mean()}
  return total, metrics


def make_inputs(N, D, V, dtype, scale=1.0, seed=0):
  k = jax.random.split(jax.random.PRNGKey(seed), 4)
  h = (jax.random.normal(k[0], (N, D)) * scale).astype(dtype)
  w = (jax.random.normal(k[1], (D, V)) / np.sqrt(D)).astype(dtype)
  t = jax.random.randint(k[2], (N,), 0, V)
  t = t.at[::5].set(IGNORE_INDEX)
  g = jax.random.normal(k[3], (N,))
  return h, w, t, g


def rel_error(got, want):
  return np.abs(np.asarray(got, np.float64) - want).max() / max(np.abs(want).max(), 1e-30)


def assert_tokenizer_matches_recorded(tok, expected: dict) -> None:
  """`tok` (an `HFTokenizer`) encodes, decodes, renders chats and names special ids
  exactly as `transformers` did when `tests/make_hf_fixtures.py` recorded `expected`."""
  assert [tok.encode(t) for t in expected["texts"]] == expected["encode"]
  assert [tok.decode(tok.encode(t)) for t in expected["texts"]] == expected["decode"]
  assert [tok.apply_chat_template(c, add_generation_prompt=g)
          for c in expected["chats"] for g in (False, True)] == expected["chat"]
  assert (tok.bos_id, tok.eos_id, tok.pad_id, tok.vocab_size) == (
      expected["bos_id"], expected["eos_id"], expected["pad_id"], expected["vocab_size"])


def numpy_attention_mask(positions, valid, segments, branches, window):
  """`[B, T, T]` bool: query i sees key j (the `Visibility` rule written out)."""
  T = positions.shape[1]
  i, j = np.arange(T)[:, None], np.arange(T)[None, :]
  seen = (j <= i) & (valid[:, None, :] > 0) & (segments[:, :, None] == segments[:, None, :])
  seen &= (branches[:, None, :] == 0) | (branches[:, None, :] == branches[:, :, None])
  if window:
    seen &= positions[:, :, None] - positions[:, None, :] < window
  return seen


def numpy_attention(q, k, v, g, mask, scale, softcap=0.0):
  """Float64 grouped-query attention `q [B, T, H, K]`, `k, v [B, T, KV, K]` under `mask
  [B, T, T]` (a query that sees nothing returns 0), and the gradients `(dq, dk, dv)` for
  a cotangent `g` of the output."""
  q, k, v, g = (np.asarray(x, np.float64) for x in (q, k, v, g))
  G = q.shape[2] // k.shape[2]
  k, v = np.repeat(k, G, axis=2), np.repeat(v, G, axis=2)
  raw = np.einsum("bqhk,bshk->bhqs", q, k, optimize=True) * scale
  s = softcap * np.tanh(raw / softcap) if softcap else raw
  m = mask[:, None]
  s = np.where(m, s, -np.inf)
  top = np.max(s, axis=-1, keepdims=True)
  e = np.where(m, np.exp(s - np.where(np.isfinite(top), top, 0.0)), 0.0)
  total = e.sum(-1, keepdims=True)
  p = e / np.where(total > 0, total, 1.0)
  out = np.einsum("bhqs,bshk->bqhk", p, v, optimize=True)
  dp = np.einsum("bqhk,bshk->bhqs", g, v, optimize=True)
  ds = p * (dp - np.sum(p * dp, axis=-1, keepdims=True))
  if softcap:
    ds = ds * (1.0 - np.tanh(raw / softcap) ** 2)
  dq = np.einsum("bhqs,bshk->bqhk", ds, k, optimize=True) * scale
  dk = np.einsum("bhqs,bqhk->bshk", ds, q, optimize=True) * scale
  dv = np.einsum("bhqs,bqhk->bshk", p, g, optimize=True)
  B, T, KV, K = dk.shape[0], dk.shape[1], dk.shape[2] // G, dk.shape[3]
  fold = lambda x: x.reshape(B, T, KV, G, K).sum(3)
  return out, dq, fold(dk), fold(dv)
