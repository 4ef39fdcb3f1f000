"""The model rows of a pair batch (`tunix_core.data.packing`: plain, shared, packed): the
rows and head slots worked out by hand; log-probs and gradients of every row layout
against the naive oracle (materialised logits on the pairs' own whole rows) for every
model family; losses of every type and train steps equal across layouts."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tunix_kernels
import runs
from oracles import rel_error
from tunix_core import data as data_lib
from tunix_core import model as model_lib
from tunix_core.data import packing
from tunix_core.training import objective

IGNORE = tunix_kernels.IGNORE_INDEX
MODES = [(False, False), (True, False), (True, True), (False, True)]
MODE_IDS = ["plain", "shared", "shared+packed", "packed"]


def _naive_logps(params, batch, mcfg):
  """The oracle: float32 `[B, 2, T]` log-probs of each pair's rows as they are (padding
  included), from materialised logits (`model.logits`); 0 where unscored."""
  B, _, T = batch["tokens"].shape
  rows = lambda x: x.reshape(2 * B, T)
  logp = jax.nn.log_softmax(model_lib.logits(params, rows(batch["tokens"]),
                                             rows(batch["attention_mask"]), mcfg), -1)
  targets = rows(batch["targets"])
  valid = targets != IGNORE
  picked = jnp.take_along_axis(logp, jnp.where(valid, targets, 0)[..., None], -1)[..., 0]
  return (picked * valid).reshape(B, 2, T)


def _pair_batch():
  """Two pairs, T = 8. Pair 0: prompt [5 6 7] left-padded by one, chosen [8 9], rejected
  [3]. Pair 1: rows with different prompts ([5 6] vs [5 4]): not shareable."""
  T = 8
  b = {k: np.zeros((2, 2, T), np.int32) for k in ("tokens", "attention_mask", "loss_mask")}
  b["targets"] = np.full((2, 2, T), IGNORE, np.int32)

  def row(i, c, tokens, left, prompt):
    n = len(tokens)
    b["tokens"][i, c, left:left + n] = tokens
    b["attention_mask"][i, c, left:left + n] = 1
    for t in range(left + prompt - 1, left + n - 1):  # targets: the next response token
      b["targets"][i, c, t], b["loss_mask"][i, c, t] = tokens[t - left + 1], 1

  row(0, 0, [5, 6, 7, 8, 9], 1, 3)
  row(0, 1, [5, 6, 7, 3], 1, 3)
  row(1, 0, [5, 6, 2], 0, 2)
  row(1, 1, [5, 4, 2, 2], 0, 2)
  return b


def test_shared_and_packed_rows_by_hand():
  b = _pair_batch()
  sizes = packing.pair_sizes(b, share=True)
  np.testing.assert_array_equal(sizes.tokens, [6, 7])    # 3 + 2 + 1; 3 + 4 (two sequences)
  np.testing.assert_array_equal(sizes.scored, [3, 3])
  np.testing.assert_array_equal(sizes.longest, [5, 4])
  spec = packing.make_spec(sizes, 2, share=True, pack=True)
  assert spec == packing.Spec(pairs=2, rows=1, length=128, head=16, band=7, share=True)
  p = packing.pack(b, spec)
  np.testing.assert_array_equal(p["row_tokens"][0, :13], [5, 6, 7, 8, 9, 3, 5, 6, 2, 5, 4, 2, 2])
  np.testing.assert_array_equal(p["row_positions"][0, :13], [0, 1, 2, 3, 4, 3, 0, 1, 2, 0, 1, 2, 3])
  np.testing.assert_array_equal(p["row_branches"][0, :13], [0, 0, 0, 1, 1, 2] + [0] * 7)
  np.testing.assert_array_equal(p["row_segments"][0], [1] * 6 + [2] * 3 + [3] * 4 + [0] * 115)
  # Head slots: chosen 8 9 read at prompt end (2) and 8 (3); rejected 3 read at the prompt
  # end again (2); pair 1's chosen 2 at its 6 (row 7), rejected 2 2 at 4 (10) and 2 (11).
  np.testing.assert_array_equal(p["head_src"][:6], [2, 3, 2, 7, 10, 11])
  np.testing.assert_array_equal(p["head_targets"][:6], [8, 9, 3, 2, 2, 2])
  T = 8
  np.testing.assert_array_equal(p["head_dst"][:6], [0 * T + 3, 0 * T + 4, 1 * T + 3,
                                                    2 * T + 1, 3 * T + 1, 3 * T + 2])
  assert (p["head_targets"][6:] == IGNORE).all() and (p["head_dst"][6:] == 2 * 2 * T).all()
  unpacked = packing.make_spec(packing.pair_sizes(b, True), 1, share=True, pack=False)
  assert (unpacked.rows, unpacked.length, unpacked.band) == (1, 16, None)
  # Plain: each response its own row, real tokens from the row's start, rows of whole
  # 128-token attention tiles unless the data's rows are shorter.
  plain = packing.make_spec(packing.pair_sizes(b, False), 2, share=False, pack=False)
  assert plain == packing.Spec(pairs=2, rows=4, length=128, head=16, band=None, share=False)
  assert packing.make_spec(packing.pair_sizes(b, False), 2, False, False, T).length == T
  p = packing.pack(b, plain)
  for r, toks in enumerate([[5, 6, 7, 8, 9], [5, 6, 7, 3], [5, 6, 2], [5, 4, 2, 2]]):
    np.testing.assert_array_equal(p["row_tokens"][r, :len(toks)], toks)
    np.testing.assert_array_equal(p["row_positions"][r, :len(toks)], np.arange(len(toks)))
    np.testing.assert_array_equal(p["row_segments"][r], [1] * len(toks) + [0] * (128 - len(toks)))
  assert (p["row_branches"] == 0).all()
  np.testing.assert_array_equal(p["head_src"][:6], [2, 3, 128 + 2, 256 + 1, 384 + 1, 384 + 2])
  np.testing.assert_array_equal(p["head_targets"][:6], [8, 9, 3, 2, 2, 2])
  np.testing.assert_array_equal(p["head_dst"][:6], [3, 4, T + 3, 2 * T + 1, 3 * T + 1,
                                                    3 * T + 2])
  with pytest.raises(ValueError, match=r"needs 6 tokens per row .* compiled for 4"):
    packing.pack(b, dataclasses.replace(spec, length=4))
  with pytest.raises(ValueError, match="not whole groups of 3"):
    packing.pack(b, dataclasses.replace(spec, pairs=3))


_TINY = model_lib.preset("tiny")
# The llama case in the fast tier; every Gemma 2 and 3 feature at once in one slow case
# (Mistral's window is Gemma 2's, Qwen3's q/k norms Gemma 3's): soft-caps, post-norms,
# tied and scaled embeddings, q/k norms, local layers with their own RoPE base.
FAMILIES = {
    "llama": _TINY,
    "gemma2+3": dataclasses.replace(_TINY, final_softcap=5.0, attn_softcap=20.0,
                                    post_norms=True, norm_offset=1.0, tie_embeddings=True,
                                    embed_scale=True, qk_norm=True, sliding_window=9,
                                    rope_local_theta=10000.0,
                                    layer_types=("sliding_attention", "full_attention")),
}


def _batch(n=8, length=48):
  ds = data_lib.load_dataset(runs.TRAIN, data_lib.ByteTokenizer(), length, length // 2)
  return data_lib.take_pairs(ds, np.arange(n))


@pytest.mark.parametrize("family", [pytest.param(f, marks=() if f == "llama" else
                                                  pytest.mark.slow) for f in FAMILIES])
def test_logprobs_and_gradients_of_every_layout_equal_the_naive_oracle(family):
  mcfg = FAMILIES[family]
  host = _batch()
  params = model_lib.init_params(jax.random.PRNGKey(0), mcfg)

  def total(params, batch, spec):
    logps = (_naive_logps(params, batch, mcfg) if spec is None else
             objective.sequence_logps(params, batch, mcfg, "xla", spec))
    weights = jnp.arange(logps.size).reshape(logps.shape) / logps.size
    return jnp.sum(logps * weights), logps

  grad = jax.jit(jax.value_and_grad(total, has_aux=True), static_argnums=2)
  (_, want), want_g = grad(params, jax.tree.map(jnp.asarray, host), None)
  assert float(jnp.abs(want).sum()) > 0
  for share, pack in MODES:
    spec = packing.make_spec(packing.pair_sizes(host, share), 4, share, pack)
    if pack:
      assert spec.band < spec.length  # the banded attention really runs
    (_, got), got_g = grad(params, jax.tree.map(jnp.asarray, packing.pack(host, spec)), spec)
    assert rel_error(got, want) < 1e-5, (share, pack)
    for g, w in zip(jax.tree.leaves(got_g), jax.tree.leaves(want_g)):
      assert rel_error(g, w) < 1e-5, (share, pack)


@pytest.mark.slow
def test_every_loss_type_and_its_gradient_equal_on_plain_and_packed_rows():
  mcfg = FAMILIES["llama"]
  host = _batch()
  spec = packing.make_spec(packing.pair_sizes(host, True), 8, True, True)
  plain = packing.make_spec(packing.pair_sizes(host, False), 8, False, False)
  params = model_lib.init_params(jax.random.PRNGKey(0), mcfg)
  ref = jax.tree.map(lambda x: x * 0.9, params)
  ref_logps = _naive_logps(ref, jax.tree.map(jnp.asarray, host), mcfg)
  # Every loss type at once (one compile): a weighted list of all of them.
  types = tunix_kernels.LOSS_TYPES
  cfg = runs.config("/tmp", loss_type=",".join(types), label_smoothing=0.1,
                    loss_weights=",".join(str(0.5 + i / 10) for i in range(len(types))))
  run = jax.jit(jax.value_and_grad(
      lambda p, b, rows: objective.dpo_objective(p, ref_logps, b, cfg.loss_spec(), mcfg, rows),
      has_aux=True), static_argnums=2)
  (want, want_m), want_g = run(params, jax.tree.map(jnp.asarray, packing.pack(host, plain)),
                               plain)
  (got, got_m), got_g = run(params, jax.tree.map(jnp.asarray, packing.pack(host, spec)), spec)
  for k in dict(want_m, loss=None):
    w, g = (want, got) if k == "loss" else (want_m[k], got_m[k])
    assert abs(float(g) - float(w)) < 1e-5 * max(1.0, abs(float(w))), k
  for g, w in zip(jax.tree.leaves(got_g), jax.tree.leaves(want_g)):
    assert rel_error(g, w) < 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("share,pack,kw", [
    (True, False, dict(loss_type="ipo", reference="precomputed")),
    (True, True, dict(grad_accum_steps=2)),
    (False, True, dict(grad_accum_steps=2, loss_type="hinge"))],
                         ids=["shared-ipo-precomputed", "shared+packed-accum",
                              "packed-accum-hinge"])
def test_train_steps_on_8_devices_equal_plain_rows(tmp_path, share, pack, kw):
  cfg = runs.config(tmp_path, steps=3, batch_size=16, prefix_sharing=share, packing=pack, **kw)
  plain = dataclasses.replace(cfg, prefix_sharing=False, packing=False)
  assert runs.steps(plain, jax.devices()).plan.rows.layout == "plain"
  runs.assert_agree(runs.step_run(runs.steps(cfg, jax.devices()), cfg),
                    runs.step_run(runs.steps(plain, jax.devices()), plain))


@pytest.mark.slow
def test_fsdp_4x2_tensor_parallel_packed_equals_unpacked_on_one_device(tmp_path):
  """FSDP x TP (vocabulary-parallel head on the flat slots) with both optimisations on,
  against the pairs' own rows on one device."""
  cfg = runs.config(tmp_path, steps=3, model="tiny_tp", fsdp=True, bucket_mb=25.0,
                    packing=True)
  cfg = dataclasses.replace(cfg, model_parallel=2)
  one = dataclasses.replace(cfg, fsdp=False, model_parallel=1, prefix_sharing=False,
                            packing=False)
  runs.assert_agree(runs.step_run(runs.steps(cfg, jax.devices()), cfg),
                    runs.step_run(runs.steps(one, jax.devices()[:1]), one))


@pytest.mark.slow
def test_quickstart_first_10_steps_equal_with_prefix_sharing_on_and_off(tmp_path):
  from tunix_core.run import loop as train  # pylint: disable=g-import-not-at-top
  got = {}
  for share in (True, False):
    out = tmp_path / str(share)
    cfg = runs.quickstart_config(out, steps=10, log_every=1, save_every=0, eval_every=10,
                      prefix_sharing=share)
    train.train(cfg, devices=jax.devices()[:1], **runs.QUIET)
    got[share] = runs.rows(out)
  assert len(got[True]) == len(got[False]) == 11  # 10 train rows and one eval row
  for on, off in zip(got[True], got[False]):
    for k, v in off.items():
      if k in ("tokens_per_sec", "mfu", "time") or not isinstance(v, float):
        continue
      assert abs(on[k] - v) <= 1e-5 * max(1.0, abs(v)), (on["step"], k, on[k], v)
