"""Hugging Face checkpoints in and out: `config.json` to `ModelConfig`, safetensors to the
params pytree and back.

`model_type`s "llama" (Llama 2, 3, 3.x), "mistral", "qwen2", "qwen3", "gemma", "gemma2",
"gemma3_text" and the text part of "gemma3" (`tunix_core.hf.config` reads their configs);
anything else is a named `HFError`, never a silent approximation. `safetensors`,
`tokenizers` and `jinja2` are imported lazily (the `hf` extra), `gguf` too.

Layouts: HF `Linear` weights are `[out, in]`; ours are `[in, out]` with layers stacked on
a leading `[L]` axis, so every projection is transposed on the way in and out. Norm
weights are stored as the checkpoint has them (Gemma's centred on 0, `norm_offset=1`).
"""

import collections
import contextlib
import functools
import json
import os

import numpy as np

from tunix_core import model as model_lib
from tunix_core.hf import config as hf_config
from tunix_core.hf import files as hf_files
from tunix_core.storage import paths
from tunix_core.storage import staging

HFError = hf_config.HFError
PREFIX = hf_files.PREFIX
# Our per-layer leaf -> (HF name under `model.layers.{i}.`, transposed).
LAYER_TENSORS = {
    "attn_norm": ("input_layernorm.weight", False),
    "wq": ("self_attn.q_proj.weight", True),
    "wk": ("self_attn.k_proj.weight", True),
    "wv": ("self_attn.v_proj.weight", True),
    "wo": ("self_attn.o_proj.weight", True),
    "mlp_norm": ("post_attention_layernorm.weight", False),
    "w_gate": ("mlp.gate_proj.weight", True),
    "w_up": ("mlp.up_proj.weight", True),
    "w_down": ("mlp.down_proj.weight", True),
}
# Present only when the config asks for them.
BIAS_TENSORS = {"bq": ("self_attn.q_proj.bias", False), "bk": ("self_attn.k_proj.bias", False),
                "bv": ("self_attn.v_proj.bias", False)}
QK_NORM_TENSORS = {"q_norm": ("self_attn.q_norm.weight", False),
                   "k_norm": ("self_attn.k_norm.weight", False)}
# Gemma 2 / 3 norm both sides of each block; their `post_attention_layernorm` is the
# attention's output norm, and the MLP's input norm is `pre_feedforward_layernorm`.
POST_NORM_TENSORS = {"post_attn_norm": ("post_attention_layernorm.weight", False),
                     "mlp_norm": ("pre_feedforward_layernorm.weight", False),
                     "post_mlp_norm": ("post_feedforward_layernorm.weight", False)}
SHARD_BYTES = 5 << 30  # `save_params` splits files above this, as `transformers` does
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja", "generation_config.json", "tokenizer.model")


def _leaf_shapes(cfg) -> dict:
  import jax  # pylint: disable=g-import-not-at-top
  shapes = jax.eval_shape(lambda: model_lib.init_params(jax.random.PRNGKey(0), cfg))
  return {tuple(k.key for k in path): leaf.shape
          for path, leaf in jax.tree_util.tree_flatten_with_path(shapes)[0]}


def expected_tensors(cfg: model_lib.ModelConfig, shapes: dict | None = None) -> dict:
  """`{HF tensor name: (our leaf path, layer index or None, transposed, HF shape)}`;
  `shapes` is `_leaf_shapes(cfg)` when the caller has it."""
  shapes = shapes or _leaf_shapes(cfg)
  out = {PREFIX + "embed_tokens.weight": (("embed",), None, False, shapes[("embed",)]),
         PREFIX + "norm.weight": (("final_norm",), None, False, shapes[("final_norm",)])}
  if not cfg.tie_embeddings:
    out["lm_head.weight"] = (("lm_head",), None, True, shapes[("lm_head",)][::-1])
  layer_tensors = {**LAYER_TENSORS, **(BIAS_TENSORS if cfg.qkv_bias else {}),
                   **(QK_NORM_TENSORS if cfg.qk_norm else {}),
                   **(POST_NORM_TENSORS if cfg.post_norms else {})}
  for leaf, (name, transposed) in layer_tensors.items():
    per_layer = shapes[("layers", leaf)][1:]
    for i in range(cfg.num_layers):
      out[f"{PREFIX}layers.{i}.{name}"] = (("layers", leaf), i, transposed,
                                          per_layer[::-1] if transposed else per_layer)
  return out


def load_params(model_dir: str, cfg: model_lib.ModelConfig, *, dtype=None,
                shardings=None, beat=None, transform=None, extra=()) -> dict:
  """The params pytree of `cfg` from an HF directory's safetensors.

  Args:
    model_dir: directory with `model.safetensors` or `model.safetensors.index.json`.
    cfg: its `ModelConfig` (`read_config`).
    dtype: dtype of the returned leaves (default `cfg.param_dtype`).
    shardings: optional pytree of `jax.sharding.Sharding`s with the params' structure;
      each leaf is then placed with `jax.make_array_from_callback`, each device's
      block read from the files alone (sliced before it is read).
    beat: if given, called with each leaf's name before it is read (a watchdog's beat).
    transform: if given, `transform(leaf path, array)` replaces each leaf as soon as it
      is read, before the next one is (QLoRA quantizes the base so, `model.quant`).
    extra: tensor names the files may hold beside the decoder's, which the caller reads
      itself (a classifier's `score.weight`).

  Tensors are read from the memory-mapped files one stacked leaf (or, with `shardings`,
  one device's block of it) at a time, so the host holds at most that beyond the files'
  page cache. A missing, unexpected or
  mis-shaped tensor is an `HFError` naming it (a tied checkpoint that also stores
  `lm_head.weight` is accepted, the copy ignored).
  """
  import jax  # pylint: disable=g-import-not-at-top
  files = hf_files.tensor_files(model_dir)
  shapes = _leaf_shapes(cfg)
  wanted = expected_tensors(cfg, shapes)
  extra = sorted(set(files) - set(wanted) - set(extra)
                 - ({"lm_head.weight"} if cfg.tie_embeddings else set()))
  missing = sorted(set(wanted) - set(files))
  if missing or extra:
    raise HFError(f"{model_dir} does not match its config: missing {missing[:5]}, "
                  f"unexpected {extra[:5]}")
  dtype = np.dtype(model_lib.DTYPES[cfg.param_dtype] if dtype is None else dtype)
  by_leaf = {}
  for name, (leaf, layer, transposed, shape) in wanted.items():
    by_leaf.setdefault(leaf, []).append((layer or 0, name, transposed))
  params = {}
  with contextlib.ExitStack() as stack:
    handles = {}

    def tensor(name):
      """The lazily sliceable tensor `name`: only what is indexed is read."""
      path, stored = files[name]
      if path not in handles:
        handles[path] = stack.enter_context(hf_files.open_tensors(path))
      return handles[path].get_slice(stored)

    for name, (_, _, _, shape) in wanted.items():  # headers only
      if tuple(tensor(name).get_shape()) != tuple(shape):
        raise HFError(f"tensor {name} has shape {tuple(tensor(name).get_shape())}, "
                      f"expected {tuple(shape)}")
    for leaf, tensors in by_leaf.items():
      if beat:
        beat(f"reading the weights of {model_dir}: {'.'.join(map(str, leaf))}")
      tensors = [(name, transposed) for _, name, transposed in sorted(tensors)]
      stacked = wanted[tensors[0][0]][1] is not None
      read = functools.partial(_read_block, tensor, tensors, stacked, len(shapes[leaf]), dtype)
      node = params
      for key in leaf[:-1]:
        node = node.setdefault(key, {})
      if shardings is None:
        node[leaf[-1]] = jax.numpy.asarray(read(()))
      else:
        sharding = functools.reduce(lambda tree, key: tree[key], leaf, shardings)
        by_rows = _file_row_sharding(sharding, shapes[leaf]) if tensors[0][1] else None
        placed = by_rows or sharding
        array = jax.make_array_from_callback(shapes[leaf], placed,
                                             _once_per_block(read, placed, shapes[leaf]))
        # Read by the file's rows, then moved between devices to `sharding`.
        node[leaf[-1]] = array if by_rows is None else jax.jit(
            lambda x: x, out_shardings=sharding)(array)
      if transform is not None:
        node[leaf[-1]] = transform(leaf, node[leaf[-1]])
  return params


def _once_per_block(read, sharding, shape):
  """`read(index)` once per distinct block of one leaf: the devices of this process that
  hold the same block under `sharding` (replicas over a model axis) share one read of
  the files, kept only until the last of them has it."""
  key = lambda index: tuple((i.start, i.stop, i.step) if isinstance(i, slice) else i
                            for i in index)
  waiting = collections.Counter(
      key(index) for index in sharding.addressable_devices_indices_map(shape).values())
  blocks = {}

  def shared(index):
    k = key(index)
    if k not in blocks:
      blocks[k] = read(index)
    waiting[k] -= 1
    return blocks.pop(k) if waiting[k] <= 0 else blocks[k]
  return shared


def _file_row_sharding(sharding, shape):
  """For a transposed leaf (ours `[..., in, out]`, the file's `[out, in]`) that
  `sharding` splits on `in` (FSDP; `out` may be split too, by a model axis): every split
  of the two moved to `out`, so each device's block is a contiguous range of the file's
  rows (read by byte range) rather than a column range that crosses every row; None
  when it already is, or when `out` does not divide."""
  import jax  # pylint: disable=g-import-not-at-top
  spec = getattr(sharding, "spec", None)
  if spec is None or len(shape) < 2:
    return None
  spec = tuple(spec) + (None,) * (len(shape) - len(spec))
  if spec[-2] is None or any(axes is not None for axes in spec[:-2]):
    return None   # only splits of `in` and `out` move
  as_tuple = lambda axes: () if axes is None else (axes if isinstance(axes, tuple) else (axes,))
  axes = as_tuple(spec[-1]) + as_tuple(spec[-2])
  if shape[-1] % int(np.prod([sharding.mesh.shape[a] for a in axes])):
    return None
  return jax.sharding.NamedSharding(
      sharding.mesh, jax.sharding.PartitionSpec(*spec[:-2], None, axes))


def _read_block(tensor, tensors, stacked: bool, ndim: int, dtype, index) -> np.ndarray:
  """Block `index` (a tuple of slices, as `make_array_from_callback` passes it) of one
  of our leaves, read from its HF tensors (`[(name, transposed)]`, in layer order when
  `stacked`): each HF tensor is sliced before it is read, so a device's block costs only
  its own bytes."""
  index = tuple(index) + (slice(None),) * (ndim - len(index))
  layers, index = (range(len(tensors))[index[0]], index[1:]) if stacked else ([0], index)
  blocks = []
  for i in layers:
    name, transposed = tensors[i]
    block = tensor(name)[index[::-1] if transposed else index]
    blocks.append(block.T if transposed else block)
  return (np.stack(blocks) if stacked else blocks[0]).astype(dtype, copy=False)


def save_params(params: dict, cfg: model_lib.ModelConfig, out_dir: str, *, src_dir=None,
                dtype="bfloat16", shard_bytes=SHARD_BYTES, fetch=None) -> None:
  """Writes `params` as an HF directory: safetensors with HF names and `[out, in]`
  layouts (`metadata={"format": "pt"}`), split with an index above `shard_bytes`;
  `config.json` (the source's, updated, when `src_dir` has one); and whichever tokenizer
  and generation files `src_dir` has. `dtype` is the stored dtype ("bfloat16",
  "float32"). A remote `out_dir` (`gs://...`) is written to a local temporary
  directory first, then uploaded.

  One file's tensors at a time are copied to the host (`fetch(array) -> np.ndarray`,
  default `jax.device_get`), so the host holds at most one file (`shard_bytes`, or the
  largest tensor), never the model. Params that span processes: every process calls
  this with `fetch=parallel.mesh.to_host` (a collective, one tensor at a time, in the
  same order everywhere; with `keep` on process 0 only, the others' fetch gives None)
  and only process 0 writes."""
  import jax  # pylint: disable=g-import-not-at-top
  from safetensors.numpy import save_file  # pylint: disable=g-import-not-at-top
  fetch = fetch or (lambda x: np.asarray(jax.device_get(x)))
  np_dtype = np.dtype(model_lib.DTYPES[dtype])
  tensors = expected_tensors(cfg)
  files, size = [[]], 0   # tensor names per file, split by their stored bytes
  for name, (*_, shape) in tensors.items():
    nbytes = int(np.prod(shape)) * np_dtype.itemsize
    if files[-1] and size + nbytes > shard_bytes:
      files.append([])
      size = 0
    files[-1].append(name)
    size += nbytes
  names = (["model.safetensors"] if len(files) == 1 else
           [f"model-{i + 1:05d}-of-{len(files):05d}.safetensors" for i in range(len(files))])

  def host(name):
    leaf, layer, transposed, _ = tensors[name]
    value = functools.reduce(lambda tree, key: tree[key], leaf, params)
    value = fetch(value[layer] if layer is not None else value)
    if value is None:   # not kept on this process: only the writer needs the tensor
      return None
    return np.ascontiguousarray((value.T if transposed else value).astype(np_dtype))

  writer = jax.process_index() == 0
  with (staging.staged_dir(out_dir) if writer else contextlib.nullcontext()) as local:
    total = 0
    for file, group in zip(names, files):
      values = {name: host(name) for name in group}   # every process: a collective each
      if writer:
        total += sum(v.nbytes for v in values.values())
        save_file(values, os.path.join(local, file), metadata={"format": "pt"})
      del values
    if not writer:
      return
    if len(files) > 1:
      index = dict(metadata=dict(total_size=total),
                   weight_map={name: file for file, group in zip(names, files)
                               for name in group})
      with open(os.path.join(local, "model.safetensors.index.json"), "w") as f:
        json.dump(index, f, indent=2)
    config = hf_config.hf_config(cfg, dtype)
    if src_dir and paths.isfile(paths.join(src_dir, "config.json")):
      config = hf_config.merged_config(
          json.loads(paths.read_text(paths.join(src_dir, "config.json"))), config)
    with open(os.path.join(local, "config.json"), "w") as f:
      json.dump(config, f, indent=2)
    for file in TOKENIZER_FILES:
      if src_dir and paths.isfile(paths.join(src_dir, file)):
        paths.copy_file(paths.join(src_dir, file), os.path.join(local, file))

