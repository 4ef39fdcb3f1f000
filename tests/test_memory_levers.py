"""Memory levers of a large run: 8-bit moments (`training.moments8`) against float64
NumPy, and the optimizer state in host memory (`--offload_optimizer`) against the same
run on the devices, through a save, a resume and a re-cut for another layout."""

import shutil

import jax
import ml_dtypes
import numpy as np
import pytest

import runs
from tunix_core.run import loop as train
from tunix_core.training import moments8
from tunix_core.training import optim

E4M3 = np.array(sorted({float(v) for v in np.arange(256, dtype=np.uint8).view(
    ml_dtypes.float8_e4m3fn).astype(np.float64) if np.isfinite(v)}))


def _encode(x, seed, root=False):
  return moments8.encode(jax.numpy.asarray(x, jax.numpy.float32),
                         optim._noise(x.shape, jax.numpy.uint32(seed)), root)


def test_float8_moments_round_between_neighbours_and_unbiased():
  """Each element decodes to one of the two e4m3 grid values around `x / scale` (times
  its row's scale, the row's absmax / 448), and over 200 draws to `x` on average; the
  root of a second moment is never rounded to zero. A 1-D piece is scaled in rows of
  128."""
  rng = np.random.default_rng(0)
  x = rng.normal(size=(3, 200)) * np.exp(rng.normal(size=(3, 200)) * 2)
  scale = np.abs(x).max(axis=1, keepdims=True) / 448.0  # a scale per row
  y = x / scale
  lo = np.sign(y) * E4M3[np.searchsorted(E4M3, np.abs(y), side="right") - 1]
  hi = np.sign(y) * E4M3[np.minimum(np.searchsorted(E4M3, np.abs(y), side="left"),
                                    len(E4M3) - 1)]
  total = np.zeros_like(x)
  for seed in range(200):
    m = _encode(x, seed)
    assert m.codes.dtype == np.uint8 and m.codes.shape == x.shape and m.scales.shape == (3,)
    got = np.asarray(moments8.decode(m), np.float64)
    on = np.isclose(got, lo * scale, rtol=1e-6, atol=0) | np.isclose(got, hi * scale,
                                                                     rtol=1e-6, atol=0)
    assert on.all(), (x[~on][:3], got[~on][:3])
    total += got
  # e4m3's grid step at y: 2**(exponent - 3), 2**-9 among the subnormals; 200 draws of
  # an unbiased rounding average within a few hundredths of it.
  step = 2.0 ** (np.maximum(np.floor(np.log2(np.abs(y) + 1e-300)), -6) - 3) * scale
  np.testing.assert_array_less(np.abs(total / 200 - x), 0.15 * step + 1e-6 * np.abs(x))
  v = x ** 4 * 1e-6  # a second moment whose root spans more than e4m3's range
  got = np.asarray(moments8.decode(_encode(v, 1, root=True), root=True), np.float64)
  r = np.sqrt(v)
  rscale = r.max(axis=1, keepdims=True) / 448.0
  normal, least = r / rscale >= 2.0 ** -6, r / rscale < 2.0 ** -9
  assert normal.sum() > 200 and least.sum() > 20  # both regimes are exercised
  # A root within one e4m3 step (1/8 of it) of its own: the moment within 27%.
  np.testing.assert_allclose(got[normal], v[normal], rtol=0.27, atol=0)
  # Below the least step a root is kept at that step, never 0.
  np.testing.assert_allclose(got[least], (2.0 ** -9 * np.broadcast_to(rscale, r.shape)[least]) ** 2, rtol=1e-5)
  piece = _encode(np.arange(1, 385, dtype=np.float64), 3)
  assert piece.scales.shape == (3,)
  np.testing.assert_allclose(piece.scales, np.array([128, 256, 384]) / 448.0, rtol=1e-6)
  # A row whose largest entry is so small that absmax / 448 would be subnormal (flushed
  # to zero on TPU, where 0/0 codes gave NaN losses) keeps scale 1 and decodes to zeros.
  tiny = np.array([[1e-37, 0.0, -3e-38] + [0.0] * 5])
  m = _encode(tiny, 4)
  assert float(m.scales[0]) == 1.0
  np.testing.assert_array_equal(np.asarray(moments8.decode(m)), np.zeros_like(tiny))
  v[0, 0] = 0.0
  assert float(moments8.decode(_encode(v, 1, root=True), root=True)[0, 0]) == 0.0


@pytest.mark.slow
def test_offloaded_optimizer_state_trains_saves_and_resumes(tmp_path):
  """ZeRO-1 on 4 devices: with `--offload_optimizer` the state lives in pinned host
  memory and the losses equal the run on the devices bit for bit. FSDP with 8-bit
  moments in host memory, its step 6 deleted, resumes at step 3 exactly, and resumes as
  ZeRO-1 on 2 devices in device memory (the moments re-cut through float32) close to
  the straight run."""
  devices = jax.devices()[:4]
  cfg = lambda name, **kw: runs.config(tmp_path / name, save_every=3,
                                       compilation_cache_dir="", **kw)
  train.train(cfg("device"), devices=devices, **runs.QUIET)
  out = train.train(cfg("host", offload_optimizer=True), devices=devices, **runs.QUIET)
  kinds = {x.sharding.memory_kind for x in jax.tree.leaves(out["state"]["opt_state"])}
  assert kinds == {"pinned_host"}
  assert runs.losses(tmp_path / "host") == runs.losses(tmp_path / "device")

  eight = cfg("eight", offload_optimizer=True, optimizer_dtype="float8", fsdp=True)
  train.train(eight, devices=devices, **runs.QUIET)
  straight = runs.losses(tmp_path / "eight")
  shutil.rmtree(tmp_path / "eight" / "checkpoints" / "6")
  train.train(eight, devices=devices, **runs.QUIET)  # resumed at 3: rows 4-6 again
  assert runs.losses(tmp_path / "eight") == straight
  shutil.rmtree(tmp_path / "eight" / "checkpoints" / "6")
  train.train(cfg("eight", optimizer_dtype="float8"), devices=devices[:2], **runs.QUIET)
  recut = runs.losses(tmp_path / "eight")
  assert recut[4] == straight[4]  # the params restored as saved
  for s in (5, 6):  # after updates in another summation order and other rows: close
    assert abs(recut[s] - straight[s]) <= 2e-3, (s, recut[s], straight[s])
