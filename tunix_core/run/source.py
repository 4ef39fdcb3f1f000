"""Where a run's model comes from and goes to: a built-in preset with the byte tokenizer,
or a Hugging Face directory (`--hf_model_dir`) with its tokenizer, chat template and
pretrained weights; and the final policy written back in HF format (`--export_hf_dir`).

The HF modules are imported only when a run uses them, so a preset run needs none of
the `hf` extra.
"""

import dataclasses
import functools
import hashlib
import json
import os

import jax
from jax.experimental import multihost_utils

from tunix_core import data as data_lib
from tunix_core import model as model_lib
from tunix_core.model import quant
from tunix_core.checkpoints import init_from
from tunix_core.parallel import mesh as mesh_lib
from tunix_core.storage import digest as content_digest
from tunix_core.storage import paths
from tunix_core.training.config import ConfigError

def tokenizer(cfg) -> data_lib.Tokenizer:
  """The run's tokenizer, with `--chat_template` applied."""
  if cfg.hf_model_dir:
    from tunix_core.hf import tokenizer as hf_tokenizer  # pylint: disable=g-import-not-at-top
    tok = hf_tokenizer.HFTokenizer(cfg.hf_model_dir)
  else:
    tok = data_lib.ByteTokenizer()
  return data_lib.with_chat_template(tok, cfg.chat_template)


def data_cache_dir(cfg) -> str:
  """Where the run's token stores and reference log-probs live (`--data_cache_dir`)."""
  return cfg.data_cache_dir or paths.join(cfg.output_dir, "data_cache")


def _pairs(cfg, path: str, tok, vocab_size: int, log, beat) -> data_lib.PairStore:
  """The token store of the JSONL `path` (`data.store`), found by its key or built:
  by process 0, then by any process that cannot see it (a disk of its own)."""
  key = data_lib.store_key(path, tok, cfg.max_length, cfg.max_prompt_length,
                           cfg.skip_bad_lines)
  where = paths.join(data_cache_dir(cfg), key)
  for builder in (True, False):
    if builder == (jax.process_index() == 0) and not data_lib.PairStore.complete(where):
      log(f"{path}: tokenizing into the token store {where}")
      data_lib.build_store(path, tok, where, cfg.max_length, cfg.max_prompt_length,
                           cfg.skip_bad_lines, log=log, beat=beat)
    if jax.process_count() > 1:
      if beat is not None:  # the builders beat per chunk; the others wait for them
        beat(f"waiting for the token store {where}", open_ended=True)
      multihost_utils.sync_global_devices(f"token store {key} {builder}")
      if beat is not None:
        beat(f"start-up: the token store {where}")
  pairs = data_lib.PairStore(where)
  data_lib.check_vocab(pairs, vocab_size)
  return pairs


def load_data(cfg, log, vocab_size: int | None = None, beat=None):
  """`(train_set, eval_set or None)` of the run: token stores (`data.store`) of its
  JSONL files, tokenized once with its tokenizer (ids checked against `vocab_size`,
  default the model's; `beat` names each chunk tokenized, `data.build`); logs their
  sizes."""
  tok = tokenizer(cfg)
  vocab_size = vocab_size or cfg.model_config().vocab_size
  train_set = _pairs(cfg, cfg.train_data, tok, vocab_size, log, beat)
  eval_set = _pairs(cfg, cfg.eval_data, tok, vocab_size, log, beat) if cfg.eval_data else None
  mismatches = train_set.num_prefix_mismatch + (eval_set.num_prefix_mismatch if eval_set
                                                else 0)
  log(f"data: {len(train_set)} train pairs ({train_set.num_dropped} dropped, "
      f"{train_set.num_skipped_lines} bad lines skipped)"
      + (f", {len(eval_set)} eval pairs" if eval_set else "")
      + (f"; {mismatches} responses tokenized apart from their prompt (the joint "
         "tokens did not start with the prompt's)" if mismatches else "")
      + f"; token stores in {data_cache_dir(cfg)}")
  return train_set, eval_set


def fingerprint(model_dir: str, legacy: bool = False) -> str:
  """A digest of an HF directory's `config.json` and weight files that changes whenever
  any of their bytes does (a same-shape fine-tune that changed one middle layer
  included), without reading the weights at every start: each safetensors file's
  content digest (`storage.digest`: the object store's checksums, or a local file's
  SHA-256 computed once and cached). `legacy`: as earlier versions computed it (with the
  objects' ETags), what checkpoints saved then hold."""
  digest = hashlib.sha256()
  names = [f for f in paths.listdir(model_dir)
           if f == "config.json" or f.endswith((".safetensors", ".safetensors.index.json"))]
  for name in names:
    path = paths.join(model_dir, name)
    digest.update(f"{name}:{paths.getsize(path)}:".encode())
    digest.update(content_digest.content_digest(path, legacy=legacy).encode()
                  if name.endswith(".safetensors") else paths.read_bytes(path))
  return digest.hexdigest()[:32]


def source(cfg) -> dict:
  """What the checkpoint metadata records of the initial policy (empty for a preset);
  resuming against a different `hf_fingerprint` is refused, and an `--init_from` run
  resumes from the very step it recorded (`pin_reference`)."""
  out = {}
  if cfg.init_from:
    spec = init_from.spec(cfg.init_from)
    out = {"init_from": spec, "init_from_digest": init_from.digest(spec)}
  if not cfg.hf_model_dir:
    return out
  where = cfg.hf_model_dir if paths.is_remote(cfg.hf_model_dir) else os.path.abspath(
      cfg.hf_model_dir)
  return dict(out, hf_model_dir=where, hf_fingerprint=fingerprint(cfg.hf_model_dir))


def pin_reference(cfg, meta: dict | None, src: dict) -> tuple:
  """`(cfg, source)` with `--init_from` pinned to one `RUN_DIR:STEP`, so that the weights
  read are those recorded: on a fresh start the step this start's `source` (`src`)
  resolved; on a resume from the checkpoint described by `meta`, the step its first
  start resolved (not the source's newest now), checked against the recorded digest: a
  `ConfigError` in one line when that step is gone or holds other params now."""
  recorded = src.get("init_from") if meta is None else meta.get("source", {}).get("init_from")
  if not cfg.init_from or not recorded:  # (a checkpoint older than the record: as given)
    return cfg, src
  if meta is not None:
    try:
      now = init_from.digest(recorded)
    except ConfigError as e:
      raise ConfigError(f"cannot resume from step {meta['step']}: its reference, "
                        f"--init_from={recorded}, is gone ({e})") from None
    saved = meta["source"].get("init_from_digest")
    if saved is not None and now != saved:
      raise ConfigError(f"cannot resume from step {meta['step']}: its reference, "
                        f"--init_from={recorded}, was saved again with other params")
  pinned = dataclasses.replace(cfg, init_from=recorded)
  return pinned, src if meta is None else source(pinned)


def initial_params(cfg, steps, dtype=None, log=None, beat=None) -> dict | None:
  """The params the run starts from in `steps`' layout (in `dtype`, default
  `--param_dtype`): another run's saved step (`--init_from`), else the pretrained
  weights of `--hf_model_dir`, else None for a preset (initialised from the seed). Each device reads
  its block of the logical arrays (`steps.logical_shardings()`: split under FSDP) from
  the files before they are cut into the run's layout. From object storage, `log` gets
  how many of the files' bytes this process fetched (a host reads its devices' rows);
  `beat` names each tensor as it is read."""
  quantize = _quantizer(steps)
  if cfg.init_from:
    params = init_from.load_params(cfg.init_from, steps.mcfg, steps.base_read_shardings(),
                                   dtype or model_lib.DTYPES[steps.mcfg.param_dtype])
    if quantize:
      params = dict(params, layers={k: quantize(("layers", k), v)
                                    for k, v in params["layers"].items()})
    return steps.place_base(params)
  if not cfg.hf_model_dir:
    return None
  from tunix_core import hf  # pylint: disable=g-import-not-at-top
  from tunix_core.hf import ranged  # pylint: disable=g-import-not-at-top
  before = ranged.RangedFile.fetched
  params = hf.load_params(cfg.hf_model_dir, steps.mcfg, dtype=dtype,
                          shardings=steps.base_read_shardings(), beat=beat,
                          transform=quantize)
  if log is not None and paths.is_remote(cfg.hf_model_dir):
    total = sum(paths.getsize(paths.join(cfg.hf_model_dir, f))
                for f in paths.listdir(cfg.hf_model_dir) if f.endswith(".safetensors"))
    fetched = ranged.RangedFile.fetched - before
    log(f"weights: this process fetched {fetched:,} of the checkpoint's {total:,} bytes "
        f"({fetched / max(total, 1):.0%})")
  return steps.place_base(params)


def _quantizer(steps):
  """QLoRA (`--quantize_base`): `quantize(path, array)`, the leaf at `path` (its keys)
  quantized into the base's logical shardings where it is a layer projection, else as
  it is; None without."""
  kind = steps.plan.quantize_base
  if not kind:
    return None
  shardings = steps.base_logical_shardings()["layers"]

  def quantize(path, x):
    if tuple(path[:1]) != ("layers",) or path[-1] not in quant.PROJECTIONS:
      return x
    # One layer at a time: a float32 copy of the whole stacked leaf would not fit.
    return jax.jit(lambda w: jax.lax.map(lambda layer: quant.quantize(layer, kind), w),
                   out_shardings=shardings[path[-1]])(x)
  return quantize


def lora_start(cfg, steps, key, dtype, log=None, beat=None) -> tuple[dict, dict | None]:
  """`(frozen, adapters)` of a LoRA run: the step's frozen input (the base in `dtype`,
  from `--hf_model_dir` or the seed, and the `--lora_init` adapter as the reference's)
  and the adapters to start from (None: fresh ones, `steps.init_params`); `log`
  and `beat` as `initial_params`'."""
  base = initial_params(cfg, steps, dtype, log, beat) or steps.init_base(key, dtype)
  if not cfg.lora_init:
    return {"base": base}, None
  from tunix_core.hf import peft  # pylint: disable=g-import-not-at-top
  _, adapters = peft.read_adapter(cfg.lora_init, steps.mcfg)
  place = lambda: steps.place_params(jax.tree.map(
      lambda x: x.astype(model_lib.DTYPES[steps.mcfg.param_dtype]), adapters))
  return {"base": base, "ref_adapters": place()}, place()


def export(cfg, steps, params: dict, frozen, log) -> None:
  """Writes the policy to `--export_hf_dir`: an HF directory, with the tokenizer and
  config of `--hf_model_dir` when there is one; under LoRA a PEFT adapter directory for
  the base, and with `--export_merged` the merged model in `merged/`. A collective:
  every process calls it, and each tensor in turn is gathered to process 0, which
  writes (`parallel.mesh.to_host` with `keep` there only): the others hold their own
  blocks, process 0 at most one file's tensors, and every chip at most a bounded piece
  beyond the state it already holds."""
  from tunix_core import hf  # pylint: disable=g-import-not-at-top
  from tunix_core.hf import peft  # pylint: disable=g-import-not-at-top
  mcfg, lcfg, dtype = steps.mcfg, steps.plan.lora, cfg.export_param_dtype()
  writer = jax.process_index() == 0
  logical = steps.logical_params(params)
  if writer:
    paths.makedirs(cfg.export_hf_dir)
  fetch = functools.partial(mesh_lib.to_host, keep=writer)
  save = functools.partial(hf.save_params, cfg=mcfg, src_dir=cfg.hf_model_dir or None,
                           dtype=dtype, fetch=fetch)
  if lcfg is None:
    save(logical, out_dir=cfg.export_hf_dir)
  else:
    adapters = jax.tree.map(fetch, logical)   # small: rank x (in + out) each
    if writer:
      peft.write_adapter(cfg.export_hf_dir, adapters, mcfg, lcfg,
                         base_model=cfg.hf_model_dir or cfg.model)
    if cfg.export_merged:
      from tunix_core.model import lora  # pylint: disable=g-import-not-at-top
      base = steps.base_layout.logical(frozen["base"], steps.base_logical_shardings())
      # A quantized base merges as the model it computes with: dequantized.
      base = quant.dequantize_params(base, model_lib.DTYPES[dtype])
      save(lora.merge(base, logical, lcfg), out_dir=paths.join(cfg.export_hf_dir, "merged"))
  if writer:
    paths.write_text(paths.join(cfg.export_hf_dir, "tunix_export.json"),
                     json.dumps({"source": source(cfg), "steps": cfg.steps}, indent=2))
  merged = lcfg is not None and cfg.export_merged
  what = ("a PEFT LoRA adapter" + (", and merged/" if merged else "")
          if lcfg else "Hugging Face format")
  log(f"exported the policy to {cfg.export_hf_dir} ({what}, {dtype})")
