"""Tunix 0.1.7's DPO trainer with its log-probs served by `tunix_kernels` (the change a
Tunix user makes; docs/embedding.md).

Tunix's `DPOTrainer` computes both the policy's and the reference's sequence log-probs
in one module-level function, `tunix.sft.dpo.dpo_trainer.compute_logps`, which runs the
model to its `[2B, L, V]` logits and takes `log_softmax` of them. `install()` replaces
that function with one that runs the model to its last hidden states and hands them
and the head's weight to `tunix_kernels.next_token_logps` (the fused log-prob kernels:
no logits held). Nothing else of Tunix changes: its batches, loss, optimizer and step.

With `attention=True` it also replaces Tunix's Llama 3 attention block
(`_serve_llama3_attention`): without a cache, Tunix's attention holds every layer's
`[B, H, L, L]` float32 scores for the backward, the larger part of its step's memory.

What it depends on, pinned to Tunix 0.1.7: `compute_logps`'s signature and its
`(chosen, rejected)` result; Llama 3's `Attention.block`, `apply_rope` and the causal
padding mask its trainer builds; the Llama 3 and Qwen 2 models' `embedder`, `layers`,
`final_norm` and `lm_head` (or the tied `embedder.input_embedding`); Llama 3's layer call
`layer(x, positions, cache, mask)` and Qwen 2's `output_hidden_states` (its final
hidden states sown as an intermediate: the unused logits are then dead code to XLA).
"""

import jax.numpy as jnp

import tunix_kernels


def _tied(model) -> bool:
  config = model.config
  return bool(getattr(config, "weight_tying", False)
              or getattr(config, "use_tied_embedding", False))


def head_weight(model):
  """The LM head's `[D, V]` weight of Tunix's Llama 3 or Qwen 2 model."""
  if _tied(model):
    return model.embedder.input_embedding[...].T
  return model.lm_head.w[...]


def hidden_states(model, input_ids, positions, attention_mask):
  """`[B, L, D]`: the model's final norm output, its head not applied."""
  from flax import nnx  # pylint: disable=g-import-not-at-top
  if type(model).__name__ == "Qwen2":
    model(input_ids, positions=positions, cache=None, attention_mask=attention_mask,
          output_hidden_states=True)
    return nnx.pop(model, nnx.Intermediate)["all_hidden_states"].get_value()[0]
  x = model.embedder.encode(input_ids)
  for layer in model.layers:
    _, x = layer(x, positions, None, attention_mask)
  return model.final_norm(x)


def _serve_llama3_attention() -> None:
  """Tunix's Llama 3 attention block (when it runs without a cache: training and
  scoring) through `tunix_kernels.attention.attention`: the same projections and rope,
  then attention that never holds the `[B, H, L, L]` scores Tunix keeps for the
  backward. Tunix's mask is causal over the row and hides padding keys, which is
  `Visibility(valid=the keys any query may see)`; its last row lists them."""
  from tunix.models.llama3 import model as llama3  # pylint: disable=g-import-not-at-top
  from tunix_kernels import attention as kernels_attention  # pylint: disable=g-import-not-at-top
  tunix_block = llama3.Attention.block

  def block(self, x, segment_pos, cache, attn_mask):
    if cache is not None or attn_mask is None:  # decoding: Tunix's own
      return tunix_block(self, x, segment_pos, cache, attn_mask)
    rope = lambda y: llama3.apply_rope(y, segment_pos, head_dim=self.head_dim)
    q, k, v = rope(self.q_proj(x)), rope(self.k_proj(x)), self.v_proj(x)
    vis = kernels_attention.Visibility(positions=segment_pos.astype(jnp.int32),
                                       valid=attn_mask[:, -1, :].astype(jnp.int32))
    out = kernels_attention.attention(q, k, v.astype(q.dtype), vis, scale=self.scale)
    return None, self.o_proj(out)

  llama3.Attention.block = block


def install(attention: bool = False) -> None:
  """Serves `dpo_trainer.compute_logps` (Tunix's policy and reference log-probs) from
  the fused log-prob kernels; with `attention`, Tunix's Llama 3 attention from the
  attention kernels too."""
  from flax import nnx  # pylint: disable=g-import-not-at-top
  from tunix.sft.dpo import dpo_trainer  # pylint: disable=g-import-not-at-top
  if attention:
    _serve_llama3_attention()

  @nnx.jit(static_argnums=(4,))
  def compute_logps(model, input_ids, positions, attention_mask, logits_to_keep,
                    completion_mask, images=None):
    if images is not None:
      raise NotImplementedError("tunix_fused serves text models only")
    keep = logits_to_keep + 1  # the last prompt position predicts the first response id
    hidden = hidden_states(model, input_ids, positions, attention_mask)[:, -keep:]
    mask = jnp.pad(completion_mask, ((0, 0), (1, 0)))
    token_logps = tunix_kernels.next_token_logps(hidden, head_weight(model),
                                                 input_ids[:, -keep:], mask)
    logps = token_logps.sum(axis=-1)
    half = logps.shape[0] // 2
    return logps[:half], logps[half:]

  dpo_trainer.compute_logps = compute_logps


def main() -> int:
  """Checks the override where Tunix is installed: a small Tunix model's sequence
  log-probs from Tunix's own `compute_logps` and from the served one, on one batch."""
  import argparse  # pylint: disable=g-import-not-at-top
  import os  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top
  import optax  # pylint: disable=g-import-not-at-top
  from flax import nnx  # pylint: disable=g-import-not-at-top
  from tunix.sft.dpo import dpo_trainer  # pylint: disable=g-import-not-at-top
  sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
  import gpu  # pylint: disable=g-import-not-at-top
  import peer_tunix  # pylint: disable=g-import-not-at-top
  p = argparse.ArgumentParser(description=main.__doc__.splitlines()[0])
  p.add_argument("--model", choices=sorted(gpu.MODELS), default="tiny")
  p.add_argument("--tokens", type=int, default=64)
  p.add_argument("--param_dtype", choices=("bfloat16", "float32"), default="float32")
  p.add_argument("--attention", action="store_true", help="serve attention too")
  a = p.parse_args()
  config = gpu.MODELS[a.model]
  policy, name = peer_tunix.build_model(config, "none", a.param_dtype)
  trainer = dpo_trainer.DPOTrainer(policy, nnx.clone(policy), optax.sgd(0.0),
                                   dpo_trainer.DPOTrainingConfig(algorithm="dpo",
                                                                 eval_every_n_steps=10**9))
  batch = dpo_trainer.TrainingInput(**{k: jax.numpy.asarray(v) for k, v in
                                       peer_tunix.training_input(gpu.synthetic_pairs(
                                           2, a.tokens, config["vocab_size"]),
                                           a.tokens).items()})
  ex = trainer._prepare_inputs(batch)  # pylint: disable=protected-access
  args = (ex.input_ids, ex.positions, ex.attention_mask, ex.logits_to_keep,
          ex.completion_mask)
  want = dpo_trainer.compute_logps(policy, *args)
  install(attention=a.attention)
  got = dpo_trainer.compute_logps(policy, *args)
  diff = max(float(jnp.max(jnp.abs(g - w))) for g, w in zip(got, want))
  print(f"{name}, {a.param_dtype}: sequence log-probs {[float(x) for x in want[0]]}; "
        f"served by tunix_kernels, largest difference {diff:.3g}")
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
