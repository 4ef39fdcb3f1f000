"""The communication of a compiled step, read from its HLO, and a roofline estimate of
its share of the step time.

`ops(hlo_text, mesh_shape)` walks the compiled module from its entry computation: each
all-gather, reduce-scatter, all-reduce, all-to-all and collective-permute (or its async
`-start`) counts the bytes one device sends over a ring of its replica group,
multiplied by the trip count of every `while` it sits in (the compiler's
`known_trip_count`, else the loop's condition: `counter < constant`), and names the mesh
axes its groups span. On a multi-slice TPU target the compiler hands what crosses slices
to its DCN runtime as `send`s marked `_xla_megascale_transfer_type` (ALL_REDUCE, ...):
those count as that collective over "slice". On TPU a reduce-scatter or all-gather whose
shards are not whole tiles is compiled as an all-reduce (`parallel.collectives.TILE`
pads ours so that none is) and is then counted as one. Per device,
for a group of n and a result of S bytes: all-gather S(n-1)/n, reduce-scatter S(n-1),
all-reduce 2S(n-1)/n, all-to-all S(n-1)/n, collective-permute S. `collectives` sums
them by axes.

`share(...)`: the time of those bytes (over ICI within a slice, over the data-centre
network where they cross "slice") against the step's FLOPs at the chip's peak, assuming
no overlap: an upper bound of the share. The FLOPs are the planned step's model FLOPs
(`training.flops.step_flops`, as MFU counts them), not the compiled cost analysis:
XLA's counts each loop body once (checked: a 16-trip scan of a matmul reports one
matmul), so for a layer scan it is about 1/num_layers of the work. Chip figures from the Cloud TPU documentation
(docs.cloud.google.com/tpu/docs/v4, v5e, v5p, v6e): bf16 peak, HBM bandwidth; ICI: half
the bidirectional ICI bandwidth per chip (v4: its pod's all-reduce bandwidth per chip);
DCN per chip: v5p's table (50 Gbps), v5e's and v6e's per-pod data-centre network
bandwidth over 256 chips (6.4 and 25.6 Tbps: 25 and 100 Gbps); v4 has no documented
figure and is taken as v5e's.
"""

import re

import numpy as np

from tunix_kernels import tpu

# chip -> (bf16 flop/s, HBM bytes/s, ICI collective bytes/s, DCN bytes/s per chip); the
# first two are the kernels' chip facts (`tunix_kernels.tpu.Chip`).
_LINKS = {"v4": (1.1e15 / 4096, 25e9 / 8), "v5e": (400e9 / 2, 25e9 / 8),
          "v5p": (1200e9 / 2, 50e9 / 8), "v6e": (800e9 / 2, 100e9 / 8)}
CHIP_RATES = {name: (chip.peak_flops, chip.hbm_bandwidth, *_LINKS[name])
              for name, chip in tpu.CHIPS.items()}

# The share of a step its collectives may take before `--compile_only` warns.
SHARE_LIMIT = 0.10

_COMPUTATION = re.compile(r"^(?:ENTRY )?%([\w.\-]+) .*\{\s*$")
_OP = re.compile(r"=\s*(\(.*?\)|[\w\[\],{}:()\-. ]+?)\s+([a-z\-]+)\(")
_SHAPE = re.compile(r"\b(pred|s8|u8|s16|u16|bf16|f16|s32|u32|f32|s64|u64|f64)\[([\d,]*)\]")
BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "bf16": 2, "f16": 2, "s32": 4,
          "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8}
# TPU's async collective fusion starts a collective in a fusion holding it and the
# custom call `AsyncCollectiveStart`, advances it in fusions named `CONTINUATION` and
# ends it in one holding `AsyncCollectiveDone`: each holds the whole collective, which
# runs once, counted at its start.
CONTINUATION = "async_collective_fusion"
_DONE = 'custom_call_target="AsyncCollectiveDone"'
FACTOR = {"all-gather": lambda n: (n - 1) / n, "reduce-scatter": lambda n: n - 1,
           "all-reduce": lambda n: 2 * (n - 1) / n, "all-to-all": lambda n: (n - 1) / n,
           "collective-permute": lambda n: 1.0}


def computations(hlo: str) -> tuple[dict, str]:
  """`({name: [instruction lines]}, entry name)` of an HLO module's text."""
  out, entry, name = {}, None, None
  for line in hlo.splitlines():
    m = _COMPUTATION.match(line)
    if m:
      name = m.group(1)
      out[name] = []
      entry = name if line.startswith("ENTRY") else entry
    elif name is not None and line.strip() == "}":
      name = None
    elif name is not None:
      out[name].append(line)
  return out, entry


def _bytes(shape_text: str, op: str) -> int:
  """Bytes of a result shape (an async start's or a send's tuple: its largest member)."""
  sizes = []
  for dtype, dims in _SHAPE.findall(shape_text):
    count = 1
    for d in filter(None, dims.split(",")):
      count *= int(d)
    sizes.append(count * BYTES[dtype])
  if op.endswith("-start") and len(sizes) > 1:
    return max(sizes)
  return sum(sizes)


def _groups(line: str) -> list[list[int]] | None:
  """The device groups of a collective (flat indices into the mesh's devices, as the
  SPMD partitioner numbers them): explicit `{{0,1},{2,3}}`, iota `[G,S]<=[dims]T(perm)`,
  or a permute's `source_target_pairs`; None: one group of every device (groups written
  by mesh axes: `_named_axes`)."""
  m = re.search(r"(?:replica_groups|source_target_pairs)=\{((?:\{[\d,]*\},?)+)\}", line)
  if m:
    return [[int(i) for i in g.split(",") if i] for g in re.findall(r"\{([\d,]*)\}",
                                                                    m.group(1))]
  m = re.search(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", line)
  if m:
    dims = [int(d) for d in m.group(3).split(",")]
    ids = np.arange(int(np.prod(dims))).reshape(dims)
    if m.group(4):
      ids = ids.transpose([int(p) for p in m.group(4).split(",")])
    return ids.reshape(int(m.group(1)), int(m.group(2))).tolist()
  return None


def _named_axes(line: str) -> dict | None:
  """`{axis: size}` a collective spans when its groups are written by mesh axes (newer
  XLA: `replica_groups=mesh['slice'=2,'data'=4] {'data'}`), else None."""
  m = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", line)
  if m is None:
    return None
  sizes = {name: int(size) for name, size in re.findall(r"'([^']+)'=(\d+)", m.group(1))}
  return {name: sizes[name] for name in re.findall(r"'([^']+)'", m.group(2))}


def _axes(groups, mesh_shape: dict) -> tuple:
  """The mesh axes a collective's groups span (those along which a group's members
  differ)."""
  names, sizes = tuple(mesh_shape), tuple(mesh_shape.values())
  if groups is None:
    return tuple(n for n, s in zip(names, sizes) if s > 1)
  spanned = set()
  for group in groups:
    coords = np.array(np.unravel_index(group, sizes)).reshape(len(sizes), -1)
    spanned |= {names[a] for a in range(len(sizes)) if len(set(coords[a])) > 1}
  return tuple(n for n in names if n in spanned)


def _trip_count(condition: list[str]) -> int | None:
  """`N` of a loop condition `counter < N` (None when it is not that simple)."""
  constants = [int(c) for line in condition
               for c in re.findall(r"[su]32\[\][^=]*?constant\((\d+)\)", line)]
  return constants[0] if len(constants) == 1 and any("direction=LT" in l
                                                     for l in condition) else None


def trip_count(line: str, comps: dict) -> int | None:
  """Executions of a `while` instruction's body: the compiler's `known_trip_count`, else
  its condition's `counter < N`; None when neither can be read."""
  known = re.search(r'"known_trip_count":\{"n":"(\d+)"', line)
  cond = re.search(r"condition=%([\w.\-]+)", line)
  if known:
    return int(known.group(1))
  return _trip_count(comps.get(cond.group(1), [])) if cond else None


def collective(line: str, op: str, shape: str, mesh_shape: dict) -> tuple | None:
  """`(kind, mesh axes spanned, bytes one device sends)` of a collective instruction
  (`op` as written, `-start` included; `shape` its result), None when its groups have
  one member."""
  base = op.removesuffix("-start")
  named = _named_axes(line)
  if named is not None:
    n, axes = int(np.prod(list(named.values()))), tuple(a for a in mesh_shape if a in named)
  else:
    groups = _groups(line)
    n = int(np.prod(list(mesh_shape.values()))) if groups is None else max(map(len, groups))
    axes = _axes(groups, mesh_shape)
  return (base, axes, _bytes(shape, op) * FACTOR[base](n)) if n > 1 else None


def dcn_transfer(line: str, op: str, shape: str, mesh_shape: dict) -> tuple | None:
  """`(kind, ("slice",), bytes)` of a `send` a multi-slice TPU program hands to its
  data-centre network runtime, else None."""
  across = re.search(r'_xla_megascale_transfer_type="(\w+)"', line)
  kind = across.group(1).lower().replace("_", "-") if across else None
  n = mesh_shape.get("slice", 1)
  if op != "send" or kind not in FACTOR or n <= 1:
    return None
  return kind, ("slice",), _bytes(shape, "send-start") * FACTOR[kind](n)


def ops(hlo: str, mesh_shape: dict) -> list[dict]:
  """Every collective of a compiled module's text reached from its entry: `{"op",
  "axes" (the mesh axes it spans, `_axes`), "bytes" (one device sends, per execution),
  "times" (executions per step: the trip counts of the loops around it), "in_loop"}`.
  `mesh_shape`: the step's mesh, `{axis: size}` in order."""
  comps, entry = computations(hlo)
  ends = {name for name, lines in comps.items() if any(_DONE in l for l in lines)}
  out = []

  def walk(name: str, times: int, in_loop: bool, seen: tuple):
    if name not in comps or name in seen:
      return
    for line in comps[name]:
      m = _OP.search(line)
      if not m:
        continue
      shape, op = m.groups()
      base = op.removesuffix("-start")
      if base in FACTOR and not op.endswith("-done"):
        found = collective(line, op, shape, mesh_shape)
        if found is not None:
          out.append({"op": base, "axes": found[1], "times": times, "bytes": found[2],
                      "in_loop": in_loop})
      found = dcn_transfer(line, op, shape, mesh_shape)
      if found is not None:
        out.append({"op": found[0], "axes": found[1], "times": times, "in_loop": in_loop,
                    "bytes": found[2]})
      if op == "while":
        body = re.search(r"body=%([\w.\-]+)", line)
        trips = trip_count(line, comps) or 1
        if body:
          walk(body.group(1), times * trips, True, seen + (name,))
      else:
        for callee in re.findall(r"(?:calls|to_apply|branch_computations)=\{?%([\w.\-]+)",
                                 line):
          if not callee.startswith(CONTINUATION) and callee not in ends:
            walk(callee, times, in_loop, seen + (name,))

  walk(entry, 1, False, ())
  return out


def collectives(hlo: str, mesh_shape: dict) -> dict:
  """`{mesh axes spanned: bytes one device sends per step}` of a compiled module's text
  (`ops`, summed)."""
  totals: dict = {}
  for o in ops(hlo, mesh_shape):
    totals[o["axes"]] = totals.get(o["axes"], 0) + o["times"] * o["bytes"]
  return totals


def share(by_axes: dict, flops: float, chip: str) -> dict:
  """`{"compute_s", "ici_s", "dcn_s", "comm_s", "step_s", "share"}`: the roofline of one
  step per chip: `flops` (per chip) at the chip's bf16 peak against `collectives`' bytes
  by axes (those spanning "slice" at its data-centre network rate, the rest at its ICI
  rate), communication not overlapped (`share` is then an upper bound)."""
  peak, _, ici, dcn = CHIP_RATES[chip]
  compute = flops / peak
  dcn_s = sum(b for axes, b in by_axes.items() if "slice" in axes) / dcn
  ici_s = sum(b for axes, b in by_axes.items() if "slice" not in axes) / ici
  comm = ici_s + dcn_s
  return {"compute_s": compute, "ici_s": ici_s, "dcn_s": dcn_s, "comm_s": comm,
          "step_s": compute + comm, "share": comm / (compute + comm) if compute + comm else 0.0}
