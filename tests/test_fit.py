"""`--remat=auto` and `--grad_accum_steps=auto` (`training.fit`), and what a compile's
refusal for memory says (`training.executables.memory_refusal`)."""

import dataclasses
import json
import os
import re
import types

import jax
import jax.numpy as jnp
import pytest

import runs
import tunix_kernels
from tunix_kernels import aot_tpu
from tunix_kernels.logprobs import pallas as logprobs_pallas
from tunix_core.training import executables
from tunix_core.training import fit
from tunix_core.training import memory
from tunix_core.training import plan as plan_lib
from tunix_core.training.config import ConfigError

GiB = 1 << 30
HBM = ("RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO "
       "temporaries (27.01G) exceeds available HBM (15.75G).")
VMEM = ("INTERNAL: Mosaic failed to compile TPU kernel: RESOURCE_EXHAUSTED: E1001: "
        "CompileTimeScopedVmemOom: Scoped allocation with size 72.39M and limit 64.00M "
        "exceeded scoped vmem limit by 8.39M. at location: loc(\"attention_bwd\")")
HOST = "RESOURCE_EXHAUSTED: Out of memory while trying to allocate 1073741824 bytes."


def _plan(**kw):
  """The plan of 32 pairs on 8 CPU devices (4 a device) with the flags `kw`."""
  cfg = runs.config("/unused", **{"batch_size": 32, **kw})
  return plan_lib.make_plan(cfg, jax.devices())


def _choose(plan, sizes, limit, **kw):
  """`fit.choose` over a table `sizes[(remat, k)]` of each candidate's true bytes (an
  int, or None: refused with no figure); estimates exact unless `kw` says otherwise.
  Returns `(choice, compiled, beats, log lines)`."""
  compiled, beats, lines = [], [], []

  def measure(c):
    compiled.append(c)
    got = sizes[c]
    return got if got is not None else executables.Refused("refused", "hbm", None)

  estimate = kw.pop("estimate", lambda c: sizes[c] or limit * 2)
  chosen = fit.choose(plan, lambda *c: c, limit, measure, estimate=estimate,
                      log=lines.append, beat=beats.append, **kw)
  return chosen, compiled, beats, lines


def test_policies_before_micro_batches_and_only_the_taken_candidate_compiles():
  plan = _plan()
  assert fit.candidates(plan)[:5] == [("none", 1), ("dots", 1), ("attention", 1),
                                      ("full", 1), ("none", 2)]
  assert [k for _, k in fit.candidates(plan)][::4] == [1, 2, 4]  # divisors of 4
  sizes = {c: (100 - 10 * i) * GiB for i, c in enumerate(fit.candidates(plan))}
  limit = int(sizes[("dots", 2)] / fit.MARGIN) + GiB  # fits from (dots, 2) on
  chosen, compiled, beats, lines = _choose(plan, sizes, limit)
  assert chosen == ("dots", 2) and compiled == [("dots", 2)]
  assert beats == ["start-up: compiling the train step (remat dots, 2 micro-batch(es))"]
  [line] = lines
  assert line.startswith("fit: remat dots, 2 micro-batch(es) of 2 pair(s) per device: ")
  assert "1 compile(s)" in line


def test_an_estimate_too_low_falls_back_to_the_next_candidate_the_compile_allows():
  plan = _plan()
  sizes = {c: (100 - 10 * i) * GiB for i, c in enumerate(fit.candidates(plan))}
  # The model says half of what `attention` compiles to, the others exactly.
  low = lambda c: sizes[c] // 2 if c[0] == "attention" else sizes[c]
  for fits, want in ((("full", 1), [("attention", 1), ("full", 1)]),
                     (("full", 2), [("attention", 2), ("full", 2)])):
    limit = int(sizes[fits] / fit.MARGIN) + GiB
    chosen, compiled, beats, _ = _choose(plan, sizes, limit, estimate=low)
    assert chosen == fits and compiled == want and len(beats) == 2


def test_batch_coupled_losses_and_explicit_values_keep_their_micro_batches():
  assert {k for _, k in fit.candidates(_plan(loss_type="aot"))} == {1}
  assert {k for _, k in fit.candidates(_plan(loss_type="sigmoid,sft",
                                             loss_weights="1,1"))} == {1}
  assert fit.candidates(_plan(grad_accum_steps=2, remat="dots")) == [("dots", 2)]
  assert {p for p, _ in fit.candidates(_plan(remat="full"))} == {"full"}
  plan = _plan(grad_accum_steps=4, remat="none")  # used as given, nothing compiled
  assert _choose(plan, {}, 10 * GiB)[:2] == (("none", 4), [])
  assert _choose(_plan(), {}, None)[:2] == (("none", 1), [])  # no capacity known


def test_nothing_fits_in_one_line_naming_the_smallest_figure_and_what_would_change_it():
  plan = _plan(loss_type="aot")
  sizes = {c: (40 - i) * GiB for i, c in enumerate(fit.candidates(plan))}
  with pytest.raises(ConfigError) as e:
    _choose(plan, sizes, 16 * GiB, estimate=lambda c: 1)  # the model lies: all compile
  message = str(e.value)
  assert "\n" not in message
  assert "remat full with 1 micro-batch(es) (4 pair(s) per device), needs 37 GiB against" \
      in message
  assert "--max_length" in message and "--fsdp" in message


def test_the_decision_is_recorded_and_a_restart_compiles_only_it(tmp_path):
  plan = _plan()
  sizes = {c: (100 - 10 * i) * GiB for i, c in enumerate(fit.candidates(plan))}
  limit = int(sizes[("attention", 2)] / fit.MARGIN) + GiB
  record = fit.decision_path(plan, jax.devices(), limit, str(tmp_path))
  low = lambda c: sizes[c] // 2  # a model too low by half: two compiles to fall back
  first = _choose(plan, sizes, limit, estimate=low, record=record)
  assert first[0] == ("attention", 2) and len(first[1]) > 1
  assert json.loads(open(record).read()) == {"remat": "attention", "micro_batches": 2}
  again = _choose(plan, sizes, limit, estimate=low, record=record)
  assert again[:2] == (("attention", 2), [("attention", 2)])
  for other in (fit.decision_path(_plan(batch_size=64), jax.devices(), limit, str(tmp_path)),
                fit.decision_path(plan, jax.devices(), limit // 2, str(tmp_path))):
    assert other != record


def test_refusals_say_what_ran_out_and_only_memory_verdicts_are_refusals():
  hbm = executables.memory_refusal(RuntimeError(HBM), held=GiB)
  assert hbm.kind == "hbm" and hbm.needed == int(28.01 * GiB)
  assert "does not fit HBM: 28 GiB per device against 15.8 GiB of HBM" in str(hbm)
  vmem = executables.memory_refusal(RuntimeError(VMEM))
  assert vmem.kind == "vmem" and "HBM" not in str(vmem).split(";")[0]
  assert "the kernel attention_bwd does not fit VMEM" in str(vmem)
  assert "72.4 MiB of scoped VMEM against a limit of 64.0 MiB" in str(vmem)
  for other in (HOST, "INTERNAL: Mosaic failed: an index exceeds its bounds"):
    assert executables.memory_refusal(RuntimeError(other)) is None


@pytest.mark.parametrize("error, remembered", [(HOST, False), (HBM, True), (VMEM, True)])
def test_only_a_memory_verdict_is_remembered(tmp_path, error, remembered, monkeypatch):
  where = str(tmp_path)
  steps = runs.steps(runs.config(tmp_path), jax.devices()[:1])
  calls = []

  def compile_():
    calls.append(1)
    raise RuntimeError(error)

  steps.train_step = types.SimpleNamespace(
      lower=lambda *a: types.SimpleNamespace(compile=compile_))
  for _ in range(2):  # a restart: new executables for the same program
    monkeypatch.setattr(executables, "_compiled", type(executables._compiled)())  # pylint: disable=protected-access
    with pytest.raises(executables.Refused if remembered else RuntimeError):
      executables.compile_step(steps, where, lambda *_: None)
  kept = [n for n in os.listdir(where) if n.startswith("refused-")]
  assert bool(kept) == remembered and len(calls) == (1 if remembered else 2)


def test_the_model_counts_what_the_step_holds_exactly():
  steps = runs.steps(runs.config("/unused", batch_size=32), jax.devices())
  state, frozen, batch = steps.abstract_inputs()
  held = memory.shard_bytes((state, frozen, batch))
  # ZeRO-1 on 8 devices: params and the reference replicated, AdamW's two moments 1/8.
  params = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(steps.param_shapes))
  assert held >= 2 * params + 2 * params // 8
  assert memory.estimate(steps) > held


@pytest.mark.slow
def test_auto_micro_batches_on_cpu_equal_the_explicit_count(tmp_path):
  """With `--device_memory_gib` between the compiled bytes of one and two micro-batches,
  auto takes two, and trains as `--grad_accum_steps=2` does."""
  devices = jax.devices()
  cfg = runs.config(tmp_path, batch_size=32, remat="none")
  sizes = plan_lib.data_sizes(cfg, [runs.dataset(cfg.max_length, cfg.max_prompt_length)])
  need = {}
  for k in (1, 2):
    steps = runs.steps(dataclasses.replace(cfg, grad_accum_steps=k), devices)
    need[k] = fit.compiled_bytes(executables.compile_step(steps, None), devices)
  assert need[1] > need[2]
  limit = (need[1] + need[2]) / 2 / fit.MARGIN
  auto = dataclasses.replace(cfg, device_memory_gib=limit / GiB)
  plan = plan_lib.make_plan(auto, devices, sizes)
  lines = []
  chosen = fit.fit_steps(auto, plan, runs.steps(auto, devices), devices, sizes, lines.append)
  assert chosen.plan.micro_batches == 2, lines
  assert lines[-1].startswith("fit: remat none, 2 micro-batch(es)")
  got, _ = runs.step_run(chosen, cfg, num_steps=3)
  want, _ = runs.step_run(runs.steps(dataclasses.replace(cfg, grad_accum_steps=2),
                                     devices), cfg, num_steps=3)
  for g, w in zip(got, want):
    assert g["loss"] == pytest.approx(w["loss"], abs=1e-6)


@pytest.mark.slow
@pytest.mark.skipif(not aot_tpu.has_libtpu(), reason="needs libtpu (.[tpu] extra)")
def test_the_compilers_own_vmem_refusal_names_the_kernel():
  # Tiles past the 16 MiB default, called past the op's own check (which refuses them),
  # compiled ahead of time for v5e: what Mosaic says, read by `memory_refusal`.
  bs = tunix_kernels.LogprobsBlockSizes(512, 1024)

  def f(h, w, t):
    loss = lambda h, w: logprobs_pallas.logprobs_pallas(h, w, t, bs, None, False).sum()
    return jax.grad(loss, argnums=(0, 1))(h, w)

  shapes = (jax.ShapeDtypeStruct((8192, 2048), jnp.float32),
            jax.ShapeDtypeStruct((2048, 128256), jnp.float32),
            jax.ShapeDtypeStruct((8192,), jnp.int32))
  with pytest.raises(Exception) as info:
    aot_tpu.compile_for("v5e", f, *shapes)
  refusal = executables.memory_refusal(info.value)
  assert refusal is not None and refusal.kind == "vmem", str(info.value)[:500]
  assert re.search(r"the kernel fused_logprobs_\w+ does not fit VMEM: its tiles need "
                   r"[\d.]+ MiB of scoped VMEM against a limit of 16.0 MiB", str(refusal))
