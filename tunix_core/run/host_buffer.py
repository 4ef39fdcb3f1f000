"""libtpu's premapped host buffer, sized to what the run moves, before the chips open.

As it starts, libtpu pins a host buffer for copies between host and chip (4 GiB by
default). On a host without transparent huge pages, pinning it is most of the chips'
opening: 6-11 s on the lent v5e, against 1.3-1.6 s at 64-256 MiB. A smaller buffer
moves large arrays about 25x slower (docs/results/tpu_v5e.md), so it pays only where
little is moved: a run whose model state (params, Adam's two moments, the reference)
and one step's batch (`moved_bytes`) come to at most `SMALL_MOVED_BYTES` starts with
`SMALL_BUFFER_BYTES`, where even its whole state's copies cost a fraction of a second.
`TPU_PREMAPPED_BUFFER_SIZE` set by the user is kept, as is everything on a host without
TPU chips, or under `JAX_PLATFORMS` without `tpu`.
"""

import os

from tunix_core.run import distributed
from tunix_core.training import flops

ENV = "TPU_PREMAPPED_BUFFER_SIZE"
SMALL_BUFFER_BYTES = 256 << 20
SMALL_MOVED_BYTES = 64 << 20
# float32 params, Adam's two moments and a float32 reference: the most a param costs.
_BYTES_PER_PARAM = 16
# A step's batch: four int32 `[B, 2, T]` arrays (tokens, targets and the two masks).
_BYTES_PER_BATCH_TOKEN = 4 * 2 * 4


def moved_bytes(cfg) -> int | None:
  """Bytes of the run's model state (`_BYTES_PER_PARAM` per weight of the layers'
  matmuls and the embeddings) and one step's batch, at most; None for a model read
  from `--hf_model_dir` (its config may sit on object storage, not read before the
  start-up's own watched read; its models are larger anyway)."""
  if cfg.hf_model_dir:
    return None
  try:
    mcfg = cfg.model_config()
  except Exception:  # noqa: BLE001 - reported by the start-up's own read
    return None
  embeddings = mcfg.vocab_size * mcfg.d_model * (1 if mcfg.tie_embeddings else 2)
  return (_BYTES_PER_PARAM * (flops.layer_matmul_params(mcfg) + embeddings)
          + _BYTES_PER_BATCH_TOKEN * cfg.batch_size * cfg.max_length)


def _opens_tpu(environ) -> bool:
  platforms = environ.get("JAX_PLATFORMS", "")
  return "tpu" in platforms if platforms else distributed.has_tpu_chips()


def size_for(cfg, environ=os.environ) -> str | None:
  """Sets `ENV` in `environ` for a small run that will open a TPU (call it before the
  backend starts); returns the start-up line that says so, else None."""
  if ENV in environ or not _opens_tpu(environ):
    return None
  need = moved_bytes(cfg)
  if need is None or need > SMALL_MOVED_BYTES:
    return None
  environ[ENV] = str(SMALL_BUFFER_BYTES)
  return (f"libtpu's premapped host buffer: {SMALL_BUFFER_BYTES >> 20} MiB for a model "
          f"state and batch of {need / 2**20:.1f} MiB at most ({ENV}={SMALL_BUFFER_BYTES}; "
          "set it to keep libtpu's own)")
