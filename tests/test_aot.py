"""`--compile_only`: the train step compiled for a TPU slice ahead of time (needs
`libtpu`, skipped without it) or for the local devices, allocating nothing."""

import dataclasses
import os
import re
import shutil
import subprocess
import sys

import jax
import pytest

import runs
from tunix_kernels import tpu
from tunix_kernels import aot_tpu
from tunix_core import model as model_lib
from tunix_core.aot import comms
from tunix_core.aot import overlap
from tunix_core.aot import compile as aot
from tunix_core.aot import levers
from tunix_core.run import loop
from tunix_core.training import config as config_lib
from tunix_core.training import flops
from tunix_core.training import step as step_lib
from tunix_core.training import tpu_flags

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN = os.path.join(REPO, "data", "train.jsonl")
needs_libtpu = pytest.mark.skipif(not aot_tpu.has_libtpu(), reason="needs libtpu (.[tpu] extra)")


def _config(tmp_path, **kw):
  base = dict(output_dir=str(tmp_path), train_data=TRAIN, batch_size=8, max_length=64,
              max_prompt_length=32, compile_only=True)
  return config_lib.TrainConfig(**{**base, **kw})


def test_sizes_print_in_gib_or_mib_below_a_tenth_to_3_significant_figures():
  assert aot.gib(15907232768) == "14.8 GiB"   # 14.81 GiB
  assert aot.gib(16 << 30) == "16.0 GiB"
  assert aot.gib(int(0.1 * (1 << 30))) == "0.100 GiB"
  assert aot.gib(int(6.5 * (1 << 20))) == "6.50 MiB"
  assert aot.gib(int(92.16 * (1 << 20))) == "92.2 MiB"


def test_compute_dtype_auto_is_bfloat16_on_tpu_and_gpu_float32_on_cpu(tmp_path):
  cfg = _config(tmp_path)
  dtypes = {p: cfg.model_config(p).compute_dtype for p in ("tpu", "gpu", "cuda", "cpu")}
  assert dtypes == {"tpu": "bfloat16", "gpu": "bfloat16", "cuda": "bfloat16", "cpu": "float32"}
  assert _config(tmp_path, compute_dtype="float32").model_config("gpu").compute_dtype == "float32"


def test_slice_names_as_cloud_tpu_spells_them():
  assert aot_tpu.parse_topology("v5e-8") == ("v5e", "v5e:2x4", "default", (2, 2, 1), 1)
  assert aot_tpu.parse_topology("v5e-256")[1] == "v5e:16x16"
  assert aot_tpu.parse_topology("v6e-64")[1] == "v6e:8x8"
  assert aot_tpu.parse_topology("v5p-128") == ("v5p", "v5p:4x4x4", "megacore", (2, 2, 1), 1)
  assert aot_tpu.parse_topology("v4-8")[1:3] == ("v4:2x2x1", "megacore")  # 8 cores, 4 chips
  assert aot_tpu.parse_topology("2xv5e-256")[1:] == ("v5e:16x16", "default", (2, 2, 1), 2)
  assert aot_tpu.parse_topology("v5e-1")[1:4] == ("v5e:1x1", "default", (1, 1, 1))
  with pytest.raises(ValueError, match="expected a Cloud TPU slice name"):
    aot_tpu.parse_topology("v7-8")
  with pytest.raises(ValueError, match="counts TensorCores"):
    aot_tpu.parse_topology("v5p-6")
  with pytest.raises(config_lib.ConfigError, match="--target_topology: unknown TPU topology"):
    _config("/tmp/unused", target_topology="tpu-8").validate(8)


@pytest.mark.slow
def test_compare_levers_reports_each_saving_and_the_combination_that_fits(tmp_path):
  """`--compare_levers` on the tiny preset over 8 CPU devices, with a device limit just
  under what its step needs: each lever's bytes as its own compile gives them, 8-bit
  moments saving 3/4 of the float32 moments' bytes (hand-computed: 8 bytes a param ->
  2 and a scale per row, ZeRO-1's 1/8 on each device), and the first prefix that fits."""
  cfg = _config(tmp_path, remat="none", grad_accum_steps="1")  # nothing for the fit to choose
  base = aot.fitted(cfg, None, jax.devices())
  cfg = dataclasses.replace(cfg, device_memory_gib=(base["need"] - (256 << 10)) / (1 << 30))
  lines = []
  assert aot.compile_only(cfg, "local", log=lines.append, then=levers.compare) == 1
  said = {l.split(":")[0][len("lever "):]: l for l in lines if l.startswith("lever ")}
  assert list(said) == ["--param_dtype=bfloat16", "--reference=precomputed",
                        "--optimizer_dtype=float8", "--offload_optimizer", "--fsdp"]
  for name, change in levers.LEVERS:
    alone = aot.fitted(dataclasses.replace(cfg, **change), None, jax.devices())
    assert f": {aot.gib(alone['need'])} per device" in said[name], said[name]
  num_params = sum(x.size for x in jax.tree.leaves(
      jax.eval_shape(lambda: model_lib.init_params(jax.random.PRNGKey(0),
                                                   cfg.model_config("cpu")))))
  saves = float(re.search(r"saves ([\d.]+) MiB", said["--optimizer_dtype=float8"]).group(1))
  moments = 8 * num_params / 8 / (1 << 20)  # MiB of float32 moments per device
  assert 0.70 * moments <= saves <= 0.75 * moments + 0.01, (saves, moments)
  assert lines[-1].startswith("levers: fits with --param_dtype=bfloat16: "), lines[-1]


@pytest.mark.slow
def test_local_compile_reports_memory_and_fits(tmp_path):
  lines = []
  assert aot.compile_only(_config(tmp_path), "local", log=lines.append) == 0
  lines = lines[[l.startswith("data: ") for l in lines].index(True) + 1:]  # after the data
  assert "8 x cpu" in lines[0].lower()
  assert lines[1].startswith("plan: shared rows, ")
  assert lines[2].startswith("per device: arguments")
  assert lines[3].startswith("total ") and " per device: fits (" in lines[3]
  # No checkpoints, token stores or metrics: nothing ran, the data went to a throwaway store.
  assert not os.listdir(tmp_path)


@pytest.mark.slow  # AOT TPU compiles live in the slow tier
@needs_libtpu
def test_tpu_slice_from_an_hf_config_alone_validated_for_the_target(tmp_path):
  # Only config.json: a step that compiles proves no weights were read.
  model_dir = tmp_path / "model"
  model_dir.mkdir()
  shutil.copy(os.path.join(REPO, "tests", "fixtures", "hf", "gemma2", "config.json"),
              model_dir)
  lines = []
  # No --train_data (reading it would need the tokenizer): the flags' worst case, and
  # --compute_dtype=auto resolves to bfloat16 for the TPU target.
  cfg = _config(tmp_path / "out", hf_model_dir=str(model_dir), train_data="")
  assert aot.compile_only(cfg, "v5e-8", log=lines.append) == 0
  assert "8 x TPU v5 lite" in lines[0] and "bfloat16 compute" in lines[1]
  assert "of 16.0 GiB HBM: fits" in lines[3]
  # Checked against the slice's 8 devices, not this host's.
  with pytest.raises(config_lib.ConfigError, match="not divisible by the 4 devices"):
    aot.compile_only(_config(tmp_path, batch_size=6), "v4-8", log=lines.append)
  # Any slice name the compiler knows, several slices included: a "slice" axis in front
  # of "data", whose cross-slice all-reduce the communication line reads from the HLO.
  lines.clear()
  assert aot.compile_only(cfg, "2xv5e-4", log=lines.append) == 0
  assert "8 x TPU v5 lite" in lines[0] and "fits" in lines[3]
  assert "FSDP, data across 2 slices" in lines[1] or "ZeRO-1, data across 2 slices" in lines[1]
  share = next(l for l in lines if l.startswith("communication share: "))
  assert re.search(r"communication share: \d+\.\d%", share) and " over slice" in share


@pytest.mark.slow
@needs_libtpu
def test_7b_does_not_fit_a_v5e_8_without_sharded_params(tmp_path):
  # The trainer's exit status and the compiler's own message, through the CLI.
  env = dict(os.environ, JAX_PLATFORMS="cpu", ALLOW_MULTIPLE_LIBTPU_LOAD="1")
  env.pop("XLA_FLAGS", None)
  proc = subprocess.run(
      [sys.executable, os.path.join(REPO, "trainer.py"), "--model=7b", "--compile_only",
       "--target_topology=v5e-8", "--batch_size=8", "--max_length=1024",
       "--max_prompt_length=512", "--compute_dtype=bfloat16", "--remat=full",
       "--reference=precomputed", f"--output_dir={tmp_path}"],
      env=env, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 1, proc.stdout + proc.stderr[-2000:]
  assert "exceeds available HBM" in proc.stdout, proc.stdout
  assert "6,738,415,616 params" in proc.stdout
  # No --train_data: planned for the flags' worst case.
  assert "plan: shared rows, 1 x 1536 tokens and 1040 LM-head slots per 1 pair(s)" in proc.stdout
  assert "reference: precomputed" in proc.stdout
  assert not os.path.exists(os.path.join(tmp_path, "metrics.jsonl"))
  assert "Traceback" not in proc.stdout + proc.stderr


@pytest.mark.slow
@needs_libtpu
def test_fit_is_judged_on_what_the_buffer_assignment_allocates(tmp_path, monkeypatch):
  """The fit check uses the HBM bytes the TPU compiler's buffer assignment allocates (its
  XLA dump: the arguments, outputs and one preallocated block of temporaries), never
  less than the buffers the caller holds through the step (arguments, outputs not
  donated)."""
  chip, devices = aot.target_devices("v5e-8")
  compiled, real = [], aot.compile_stats  # (plan, stats) of --compile_only's compiles

  def spy(plan, *args):
    compiled.append((plan, real(plan, *args)))
    return compiled[-1][1]

  monkeypatch.setattr(aot, "compile_stats", spy)
  lines = []
  assert aot.compile_only(_config(tmp_path, fsdp=True), "v5e-8", log=lines.append) == 0
  (plan, stats), = compiled  # one compile, of the flags' plan: what the fit is judged on
  assert plan == aot.plan_for(_config(tmp_path, fsdp=True), devices)
  assert stats["error"] is None and stats["hbm"] is not None
  held = stats["argument"] + stats["output"] - stats["alias"]
  assert 0 < held < stats["hbm"] == stats["need"]
  total = next(l for l in lines if l.startswith("total "))
  assert total.startswith(f"total {aot.gib(stats['hbm'])} per device of 16.0 GiB HBM: "
                          "fits (allocated by the compiler's buffer assignment; ")
  assert not os.listdir(tmp_path)  # the dump went to a temporary directory


class _Lowered(Exception):
  """Stops a run as it compiles its train step, carrying the step's lowered text."""


def test_compile_only_lowers_the_very_step_the_run_trains(tmp_path, monkeypatch):
  """The quickstart's flags: `--compile_only`'s program (abstract inputs, planned from
  --train_data) is the one the run compiles and trains (`executables.TrainStep` calls
  that executable), HLO text for HLO text."""
  cfg = runs.quickstart_config(tmp_path)

  class Capture(step_lib.StepFunctions):

    def __init__(self, *args, **kw):
      super().__init__(*args, **kw)
      jitted = self.train_step

      class Lowering:  # what the start-up lowers to compile the run's step

        def lower(self, *args):
          raise _Lowered(jitted.lower(*args).as_text())

      self.train_step = Lowering()

  monkeypatch.setattr(step_lib, "StepFunctions", Capture)
  with pytest.raises(_Lowered) as trained:
    loop.train(cfg, **runs.QUIET)
  monkeypatch.undo()
  _, lowered = aot.lower(aot.plan_for(dataclasses.replace(cfg, compile_only=True),
                                      jax.devices()), jax.devices())
  assert lowered.as_text() == str(trained.value)


@pytest.mark.slow
@needs_libtpu
def test_offload_remat_moves_activations_to_host_memory(tmp_path):
  """`--remat=offload` on a TPU target: less HBM than `--remat=none`, the difference in
  pinned host memory, which the compiled stats report. Pairs of 3,072 tokens, so the
  tiny model's activations outweigh its LM head's temporaries."""
  chip, devices = aot.target_devices("v5e-8")
  stats = {remat: aot.compile_stats(aot.plan_for(_config(
      tmp_path, train_data="", max_length=3072, max_prompt_length=1536,
      compute_dtype="bfloat16", remat=remat), devices), chip, devices)
      for remat in ("none", "offload")}
  assert stats["offload"]["need"] < stats["none"]["need"]
  assert stats["offload"]["host"] > 0 and stats["none"]["host"] == 0


HLO = """HloModule step

%cond (p: (s32[], bf16[8,16])) -> pred[] {
  %p = (s32[], bf16[8,16]) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %n = s32[] constant(3)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

%body (p: (s32[], bf16[8,16])) -> (s32[], bf16[8,16]) {
  %p = (s32[], bf16[8,16]) parameter(0)
  %x = bf16[2,16]{1,0} get-tuple-element(%p), index=1
  %g = bf16[8,16]{1,0} all-gather(%x), channel_id=1, replica_groups={{0,1,2,3},{4,5,6,7}}, dimensions={0}
  ROOT %t = (s32[], bf16[8,16]) tuple(%i, %g)
}

ENTRY %main (a: f32[10]) -> f32[10] {
  %a = f32[10]{0} parameter(0)
  %r = f32[10]{0} all-reduce(%a), channel_id=2, replica_groups=[1,8]<=[8], to_apply=%add
  %w = (s32[], bf16[8,16]) while(%init), condition=%cond, body=%body
  %s = f32[10]{0} reduce-scatter(%r), channel_id=3, replica_groups=[4,2]<=[2,4]T(1,0), dimensions={0}
  ROOT %m = f32[10]{0} all-reduce(%s), channel_id=4, replica_groups=mesh['slice'=2,'data'=4] {'slice'}, to_apply=%add
}
"""


def test_collective_bytes_are_read_from_the_hlo_with_loop_trip_counts():
  """Per device, a ring over a group of n: the all-gather of bf16[8, 16] (256 bytes) in
  groups of 4 inside a 3-trip loop sends 3 x 256 x 3/4 over "data" of a (slice 2, data 4)
  mesh; the all-reduce of f32[10] over all 8 sends 2 x 40 x 7/8 over both axes; the
  reduce-scatter to f32[10] over {0, 4}, {1, 5}, ... (an iota
  list, transposed) sends 40 x 1 across slices, and so does the all-reduce of f32[10]
  whose groups newer XLA writes by mesh axis (`mesh[...] {'slice'}`): 2 x 40 x 1/2."""
  mesh = {"slice": 2, "data": 4}
  got = comms.collectives(HLO, mesh)
  assert got == {("data",): 3 * 256 * 3 / 4, ("slice", "data"): 2 * 40 * 7 / 8,
                 ("slice",): 40.0 + 40.0}
  assert [(o["op"], o["in_loop"], o["times"]) for o in comms.ops(HLO, mesh)] == [
      ("all-reduce", False, 1), ("all-gather", True, 3), ("reduce-scatter", False, 1),
      ("all-reduce", False, 1)]
  # 1 s of compute; 2 GB at 200 GB/s of ICI, 25 MB at 3.125 GB/s across slices.
  roof = comms.share({("data",): 2e9, ("slice",): 25e6}, 197e12, "v5e")
  assert roof["compute_s"] == pytest.approx(1.0) and roof["ici_s"] == pytest.approx(0.01)
  assert roof["dcn_s"] == pytest.approx(0.008)
  assert roof["share"] == pytest.approx(0.018 / 1.018)


@pytest.mark.slow  # two TPU compiles
@needs_libtpu
@pytest.mark.parametrize("layout,sync", [("zero1", "all_to_all"), ("fsdp", "auto")])
def test_gradient_sync_compiles_to_reduce_scatters_and_all_gathers_on_tpu(tmp_path, layout,
                                                                           sync):
  """The tiny step compiled for a v5e-8: every bucket's reduce-scatter stays one, a
  reduce-scatter under `--sync_impl=auto` (xla on 8 chips; the TPU compiler turns one
  whose shards it cannot tile into an all-reduce, twice the bytes:
  `parallel.collectives.TILE`) or an all-to-all under all_to_all, and every all-gather
  stays one; the only all-reduce left is the metrics' mean, a few bytes."""
  chip, devices = aot.target_devices("v5e-8")
  steps, lowered = aot.lower(aot.plan_for(_config(tmp_path, fsdp=layout == "fsdp",
                                                  sync_impl=sync), devices), devices)
  assert steps.plan.sync_impl == {"auto": "xla"}.get(sync, sync)
  with jax.set_mesh(steps.mesh):
    text = lowered.compile().as_text()
  kinds = {}
  ops = comms.ops(text, dict(steps.mesh.shape))
  for op in ops:
    kinds.setdefault(op["op"], []).append(op["bytes"])
  scatter = "all-to-all" if sync == "all_to_all" else "reduce-scatter"
  assert kinds.get(scatter) and kinds.get("all-gather"), kinds
  assert len(kinds.get("all-reduce", [])) <= 1 and max(kinds.get("all-reduce", [0])) < 1024, kinds
  # The schedule's replay (`aot.overlap`) meets every collective `comms.ops` counts (it
  # unrolls the loops, `ops` multiplies by trip counts), pairs the asynchronous ones
  # (FSDP's backward gathers one: TPU's start and done fusions) and finds the plan's
  # matmuls: at least the model FLOPs, at most with the remat forward again and the
  # kernels' causal upper bounds.
  got = overlap.exposed(text, dict(steps.mesh.shape), "v5e")
  assert got["unknown"] == [] and got["asynchronous"] >= (layout == "fsdp")
  assert got["bytes"] == pytest.approx(sum(o["bytes"] * o["times"] for o in ops), rel=1e-9)
  assert 0 < got["exposed_s"] <= got["comm_s"]
  model_flops = flops.step_flops(steps.plan, "v5e") / len(devices)
  replayed = got["compute_s"] * comms.CHIP_RATES["v5e"][0]
  assert model_flops <= replayed <= 2 * model_flops, (replayed, model_flops)
  # Under the default --tpu_flags (every program of the step gets them); an unknown
  # option is one line from --compile_only.
  assert dict(steps.plan.compiler_options) == tpu_flags.parse(
      tpu_flags.OVERLAP + " " + tpu_flags.BY_CHIP["v5e"])  # on a v5e: the all-gather fusion
  if layout == "fsdp":
    with pytest.raises(config_lib.ConfigError, match="^--tpu_flags: the TPU compiler has "
                       "no option 'xla_no_such_option'$"):
      aot.compile_only(_config(tmp_path, tpu_flags="--xla_no_such_option=true"), "v5e-8",
                       log=lambda *_: None)


@pytest.mark.slow  # a 64-chip TPU compile
@needs_libtpu
def test_weights_gather_along_the_torus_on_a_3d_slice(tmp_path):
  """On a v5p-128 (4x4x4 chips) the tiny FSDP step gathers its weights in three stages
  of 4 (`parallel.mesh.gather_stages`), which the compiler keeps all-gathers (one gather
  over the 64 chips it makes an all-reduce); a 2-D v5e-16 gathers in one."""
  from tunix_core.parallel import mesh as mesh_lib  # pylint: disable=g-import-not-at-top
  assert mesh_lib.gather_stages(mesh_lib.make_mesh(aot.target_devices("v5e-16")[1])) is None
  chip, devices = aot.target_devices("v5p-128")
  steps, lowered = aot.lower(aot.plan_for(_config(tmp_path, fsdp=True, batch_size=64),
                                          devices), devices)
  assert mesh_lib.gather_stages(steps.mesh) == (4, 4, 4)
  # Off v5e, --tpu_flags=auto leaves out the all-gather fusion jax 0.12's compiler
  # refuses; on v5p the gathers run on the SparseCores (async `call-start`s).
  assert dict(steps.plan.compiler_options) == tpu_flags.parse(
      tpu_flags.OVERLAP + " " + tpu_flags.BY_CHIP["v5p"])
  # `--sync_impl=auto`: an all_to_all over these 64 chips and over 16, psum_scatter over
  # 256 (whose all_to_all the compiler takes too long over) and over 8.
  assert steps.plan.sync_impl == "all_to_all"
  for name, impl in (("v5e-256", "xla"), ("v5e-16", "all_to_all"), ("v5e-8", "xla")):
    chips = aot.target_devices(name)[1]
    assert aot.plan_for(_config(tmp_path, fsdp=True, batch_size=len(chips)),
                        chips).sync_impl == impl, name
  with jax.set_mesh(steps.mesh):
    lines = lowered.compile().as_text().splitlines()
  gathers = [l for l in lines if re.search(r"= \S+ all-gather\(", l)]
  assert gathers and all({len(g) for g in comms._groups(l)} == {4} for l in gathers)  # pylint: disable=protected-access
  assert [l for l in lines if " call-start(" in l
          and 'async_execution_thread="sparsecore"' in l]  # the gathers, offloaded
  # The gradients' sync is all-to-all (`--sync_impl=auto` on TPU: the compiler makes a
  # psum_scatter beyond a v5e-8 an all-reduce, docs/tpu.md); no weight is all-reduced.
  assert [l for l in lines if re.search(r"= \S+ all-to-all\(", l)]
  assert not [l for l in lines if re.search(r"= bf16\S* all-reduce\(", l)]


@needs_libtpu
@pytest.mark.parametrize("name", ["v4-32", "v5p-64", "2xv5p-16"])
def test_mesh_neighbours_are_ici_neighbours_on_3d_tori(name):
  """On v4 and v5p slices (3-D tori; the devices' coordinates from the compiler's
  topology), consecutive devices along the data axis, and within a model group, sit one
  link apart, in every slice; `jax.devices()`' own order does not."""
  from tunix_core.parallel import mesh as mesh_lib  # pylint: disable=g-import-not-at-top
  _, devices = aot_tpu.topology_devices(name)
  slices = mesh_lib.device_slices(devices)

  def hop(a, b) -> int:   # links between two chips of one slice (torus wraparound)
    assert getattr(a, "slice_index", 0) == getattr(b, "slice_index", 0)
    dims = [max(d.coords[i] for d in devices) + 1 for i in range(3)]
    return sum(min(abs(p - q), n - abs(p - q)) for p, q, n in zip(a.coords, b.coords, dims))

  data = mesh_lib.make_mesh(devices, 1, slices).devices.reshape(slices, -1)
  assert all(hop(row[i], row[i + 1]) == 1 for row in data for i in range(len(row) - 1))
  model = mesh_lib.make_mesh(devices, 4, slices).devices.reshape(-1, 4)
  assert all(hop(g[i], g[i + 1]) == 1 for g in model for i in range(3))
  plain = [devices[i:i + len(devices) // slices] for i in range(0, len(devices),
                                                                len(devices) // slices)]
  assert not all(hop(r[i], r[i + 1]) == 1 for r in plain for i in range(len(r) - 1))
