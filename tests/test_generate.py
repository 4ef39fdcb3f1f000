"""Generation with the KV cache (`tunix_core.model.generate`) against the no-cache
forward: every greedy token is the argmax of `model.logits` on the sequence so far."""

import dataclasses
import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tunix_core import hf
from tunix_core import model as model_lib
from tunix_core.model import generate as gen

_TINY = model_lib.preset("tiny")
FAMILIES = {
    "llama": _TINY,
    # Gemma 2's soft-caps, post norms and a sliding window shorter than the sequence.
    "gemma2": dataclasses.replace(
        _TINY, final_softcap=5.0, attn_softcap=20.0, post_norms=True, norm_offset=1.0,
        tie_embeddings=True, embed_scale=True, query_pre_attn_scalar=16.0, sliding_window=4,
        layer_types=("sliding_attention", "full_attention")),
    "qwen3": dataclasses.replace(_TINY, qk_norm=True),
}


# The no-cache references, jitted: one compile each rather than one per eager op.
_logits = jax.jit(model_lib.logits, static_argnums=3)
_forward = jax.jit(model_lib.forward, static_argnums=3)
_extend = jax.jit(gen.extend, static_argnums=6)


def _prompts():
  """Two left-padded prompts of 7 and 4 tokens."""
  ids = np.array([[5, 9, 3, 7, 11, 2, 8], [0, 0, 0, 4, 6, 10, 12]], np.int32)
  mask = (np.arange(7)[None] >= np.array([[0], [3]])).astype(np.int32)
  return jnp.asarray(ids), jnp.asarray(mask)


@pytest.mark.parametrize("family", [pytest.param(f, marks=() if f == "gemma2" else
                                                  pytest.mark.slow) for f in FAMILIES])
def test_greedy_tokens_are_the_no_cache_forwards_argmax_at_every_step(family):
  cfg = FAMILIES[family]
  params = model_lib.init_params(jax.random.PRNGKey(1), cfg)
  ids, mask = _prompts()
  N = 6
  tokens, lengths = gen.generate(params, ids, mask, jax.random.PRNGKey(0), cfg=cfg,
                                 sampling=gen.Sampling(max_new_tokens=N))
  assert lengths.tolist() == [N, N]
  full = jnp.concatenate([ids, tokens], axis=1)
  full_mask = jnp.concatenate([mask, jnp.ones_like(tokens)], axis=1)
  logits = _logits(params, full, full_mask, cfg)
  # The token at slot P + i is predicted from slot P + i - 1.
  want = jnp.argmax(logits[:, ids.shape[1] - 1:-1], axis=-1)
  np.testing.assert_array_equal(np.asarray(tokens), np.asarray(want))
  # The prefill's hidden states equal the forward's on the real tokens.
  positions = model_lib.default_positions(mask)
  hidden, _ = _extend(params, ids, mask, positions, gen.init_cache(cfg, 2, 9), 0, cfg)
  want_hidden = _forward(params, ids, mask, cfg)
  np.testing.assert_allclose(np.asarray(hidden)[mask > 0],
                             np.asarray(want_hidden)[mask > 0], atol=2e-5)


@pytest.mark.slow  # samples several times: the greedy tests stay in the fast tier
def test_sampling_is_reproducible_and_filters_as_asked():
  cfg = FAMILIES["llama"]
  params = model_lib.init_params(jax.random.PRNGKey(2), cfg)
  ids, mask = _prompts()
  run = lambda key, **kw: np.asarray(gen.generate(
      params, ids, mask, jax.random.PRNGKey(key), cfg=cfg,
      sampling=gen.Sampling(max_new_tokens=8, **kw))[0])
  hot = dict(temperature=2.0)
  np.testing.assert_array_equal(run(3, **hot), run(3, **hot))
  assert (run(3, **hot) != run(4, **hot)).any()
  greedy = run(0)
  np.testing.assert_array_equal(run(5, temperature=1.0, top_k=1), greedy)
  np.testing.assert_array_equal(run(6, temperature=1.0, top_p=1e-6), greedy)


@pytest.mark.parametrize("top_k, top_p", [(0, 0.3), (0, 0.9), (7, 1.0), (7, 0.6), (0, 1.0)])
def test_top_k_and_top_p_keep_the_tokens_a_sort_keeps_with_their_probabilities(top_k, top_p):
  """`candidates` (lax.top_k, no sort) against a float64 NumPy sort of the whole
  vocabulary, filtered as `transformers` filters: top-k, then the smallest set whose
  renormalised probability reaches top_p."""
  rng = np.random.default_rng(top_k + int(top_p * 10))
  logits = rng.normal(0, 3, (4, 300)).astype(np.float32)
  s = gen.Sampling(temperature=0.7, top_k=top_k, top_p=top_p)
  got_logits, got_ids = map(np.asarray, gen.candidates(jnp.asarray(logits), s))
  for row in range(4):
    x = logits[row].astype(np.float64) / 0.7
    order = np.argsort(-x, kind="stable")
    kept = order[:top_k] if top_k else order
    p = np.exp(x[kept] - x[kept].max())
    p /= p.sum()
    kept = kept[(np.cumsum(p) - p) < top_p]
    want = np.zeros(300)
    want[kept] = np.exp(x[kept] - x[kept].max())
    want /= want.sum()
    got = np.zeros(300)
    finite = np.isfinite(got_logits[row])
    np.add.at(got, got_ids[row][finite], np.exp(got_logits[row][finite].astype(np.float64)
                                                - got_logits[row][finite].max()))
    got /= got.sum()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-9)


def test_rows_stop_at_an_eos_that_is_kept():
  cfg = FAMILIES["llama"]
  params = model_lib.init_params(jax.random.PRNGKey(1), cfg)
  ids, mask = _prompts()
  free, _ = gen.generate(params, ids, mask, jax.random.PRNGKey(0), cfg=cfg,
                         sampling=gen.Sampling(max_new_tokens=5))
  eos = int(free[0, 1])
  tokens, lengths = gen.generate(params, ids, mask, jax.random.PRNGKey(0), cfg=cfg,
                                 sampling=gen.Sampling(max_new_tokens=5, eos_ids=(eos,)))
  row0 = free[0].tolist()
  stop = row0.index(eos) + 1
  assert int(lengths[0]) == stop and tokens[0, :stop].tolist() == row0[:stop]
  assert tokens[0, stop:].tolist() == [0] * (5 - stop)
  row1 = free[1].tolist()
  want1 = row1.index(eos) + 1 if eos in row1 else 5
  assert int(lengths[1]) == want1 and tokens[1, :want1].tolist() == row1[:want1]


def test_bad_sampling_settings_are_one_clear_error():
  with pytest.raises(ValueError, match="max_new_tokens must be positive"):
    gen.Sampling(max_new_tokens=0)
  with pytest.raises(ValueError, match="0 < top_p <= 1"):
    gen.Sampling(top_p=0.0)


@pytest.mark.slow
def test_command_line_completes_from_an_hf_directory_and_stops_at_its_eos(tmp_path, capsys):
  """`python -m tunix_core.generate` (in process): its JSON line is `generate`'s greedy
  completion of the chat-templated prompt; an `eos_token_id` of generation_config.json
  ends it, included, as `transformers` returns it."""
  pytest.importorskip("tokenizers")
  from tunix_core.generate import __main__ as cli  # pylint: disable=g-import-not-at-top
  cfg = dataclasses.replace(FAMILIES["gemma2"], vocab_size=320)
  d = str(tmp_path / "model")
  params = model_lib.init_params(jax.random.PRNGKey(4), cfg)
  hf.save_params(params, cfg, d, dtype="float32")
  tokenizer = os.path.join(os.path.dirname(__file__), "fixtures", "hf", "tokenizer")
  for name in ("tokenizer.json", "tokenizer_config.json"):
    shutil.copy(os.path.join(tokenizer, name), d)

  def run():
    assert cli.main([f"--hf_model_dir={d}", "--prompt=What is the capital of France?",
                     "--max_new_tokens=6"]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])

  free = run()
  tok = hf.HFTokenizer(d)
  assert free["prompt_ids"] == tok.encode(tok.apply_chat_template(
      [{"role": "user", "content": "What is the capital of France?"}],
      add_generation_prompt=True))
  ids = jnp.asarray([free["prompt_ids"]], jnp.int32)
  tokens, _ = gen.generate(hf.load_params(d, hf.read_config(d)), ids, jnp.ones_like(ids),
                           jax.random.PRNGKey(0), cfg=hf.read_config(d),
                           sampling=gen.Sampling(max_new_tokens=6, eos_ids=(tok.eos_id,)))
  want = tokens[0].tolist()
  assert free["completion_ids"] == want[:len(free["completion_ids"])]
  stop = free["completion_ids"][2]
  with open(os.path.join(d, "generation_config.json"), "w") as f:
    json.dump({"eos_token_id": [319, stop]}, f)
  stopped = run()
  end = free["completion_ids"].index(stop) + 1
  assert stopped["completion_ids"] == free["completion_ids"][:end]
  assert stopped["text"] == tok.decode(free["completion_ids"][:end - 1])


HF_FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "hf")


# The fast tier keeps the sliding-window, soft-capped family; the slow one has them all.
@pytest.mark.parametrize("family", [
    pytest.param(d, marks=() if d == "gemma2" else pytest.mark.slow)
    for d in sorted(os.listdir(HF_FIXTURES))
    if os.path.isfile(os.path.join(HF_FIXTURES, d, "generate.npz"))])
def test_greedy_generation_equals_transformers_on_the_fixtures(family):
  """Token for token `transformers`' greedy `generate` (recorded by
  `tests/make_generate_fixtures.py`), a left-padded row included."""
  pytest.importorskip("safetensors", reason="reads HF fixtures: needs the hf extra")
  d = os.path.join(HF_FIXTURES, family)
  want = np.load(os.path.join(d, "generate.npz"))
  cfg = hf.read_config(d)
  tokens, lengths = gen.generate(
      hf.load_params(d, cfg), jnp.asarray(want["prompt"]), jnp.asarray(want["prompt_mask"]),
      jax.random.PRNGKey(0), cfg=cfg,
      sampling=gen.Sampling(max_new_tokens=want["greedy"].shape[1]))
  np.testing.assert_array_equal(np.asarray(tokens), want["greedy"])
