"""The communication of a compiled step, read from its HLO, and a roofline estimate of
its share of the step time.

`collectives(hlo_text)` walks the compiled module from its entry computation: each
all-gather, reduce-scatter, all-reduce, all-to-all and collective-permute (or its async
`-start`) counts the bytes one device sends over a ring of its replica group,
multiplied by the trip count of every `while` it sits in (read from the loop's
condition: `counter < constant`). Per device, for a group of n and a result of S bytes:
all-gather S(n-1)/n, reduce-scatter S(n-1), all-reduce 2S(n-1)/n, all-to-all S(n-1)/n,
collective-permute S.

`share(...)`: the time of those bytes at the chip's collective bandwidth against the
compiled flops at its peak (or its HBM traffic at its bandwidth, whichever is longer),
assuming no overlap: an upper bound of the share. Chip figures from the Cloud TPU
documentation (docs.cloud.google.com/tpu/docs/v4, v5e, v5p-training, v6e): bf16 peak,
HBM bandwidth, and the collective bandwidth taken as half the bidirectional ICI
bandwidth per chip (v4: its pod's all-reduce bandwidth per chip).
"""

import re

# chip -> (bf16 flop/s, HBM bytes/s, collective bytes/s per chip)
CHIP_RATES = {"v4": (275e12, 1200e9, 1.1e15 / 4096), "v5e": (197e12, 819e9, 400e9 / 2),
              "v5p": (459e12, 2765e9, 1200e9 / 2), "v6e": (918e12, 1638e9, 800e9 / 2)}

_COMPUTATION = re.compile(r"^(?:ENTRY )?%([\w.\-]+) .*\{\s*$")
_OP = re.compile(r"=\s*(\(.*?\)|[\w\[\],{}:()\-. ]+?)\s+([a-z\-]+)\(")
_SHAPE = re.compile(r"\b(pred|s8|u8|s16|u16|bf16|f16|s32|u32|f32|s64|u64|f64)\[([\d,]*)\]")
_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "bf16": 2, "f16": 2, "s32": 4,
          "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8}
_FACTOR = {"all-gather": lambda n: (n - 1) / n, "reduce-scatter": lambda n: n - 1,
           "all-reduce": lambda n: 2 * (n - 1) / n, "all-to-all": lambda n: (n - 1) / n,
           "collective-permute": lambda n: 1.0}


def _computations(hlo: str) -> tuple[dict, str]:
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
  """Bytes of a result shape (an async start's tuple: its largest member)."""
  sizes = []
  for dtype, dims in _SHAPE.findall(shape_text):
    count = 1
    for d in filter(None, dims.split(",")):
      count *= int(d)
    sizes.append(count * _BYTES[dtype])
  if op.endswith("-start") and len(sizes) > 1:
    return max(sizes)
  return sum(sizes)


def _group_size(line: str, num_devices: int) -> int:
  m = re.search(r"replica_groups=\{\{([\d,]*)\}", line)
  if m:
    return len(m.group(1).split(","))
  m = re.search(r"replica_groups=\[(\d+),(\d+)\]", line)
  if m:
    return int(m.group(2))
  return num_devices


def _trip_count(condition: list[str]) -> int:
  """`N` of a loop condition `counter < N` (1 when it is not that simple)."""
  constants = [int(c) for line in condition
               for c in re.findall(r"s32\[\][^=]*?constant\((\d+)\)", line)]
  return constants[0] if len(constants) == 1 and any("direction=LT" in l
                                                     for l in condition) else 1


def collectives(hlo: str, num_devices: int) -> dict:
  """`{group size: bytes one device sends per step}` of a compiled module's text."""
  comps, entry = _computations(hlo)
  totals: dict = {}

  def walk(name: str, times: int, seen: tuple):
    if name not in comps or name in seen:
      return
    for line in comps[name]:
      m = _OP.search(line)
      if not m:
        continue
      shape, op = m.groups()
      base = op.removesuffix("-start")
      if base in _FACTOR and not op.endswith("-done"):
        n = _group_size(line, num_devices)
        if n > 1:
          totals[n] = totals.get(n, 0) + times * _bytes(shape, op) * _FACTOR[base](n)
      if op == "while":
        body = re.search(r"body=%([\w.\-]+)", line)
        cond = re.search(r"condition=%([\w.\-]+)", line)
        trips = _trip_count(comps.get(cond.group(1), [])) if cond else 1
        if body:
          walk(body.group(1), times * trips, seen + (name,))
      else:
        for callee in re.findall(r"(?:calls|to_apply|branch_computations)=\{?%([\w.\-]+)",
                                 line):
          walk(callee, times, seen + (name,))

  walk(entry, 1, ())
  return totals


def share(comm_bytes: float, flops: float, hbm_bytes: float, chip: str) -> dict:
  """`{"compute_s", "comm_s", "step_s", "share"}`: the roofline of one step per chip,
  communication not overlapped (`share` is then an upper bound)."""
  peak, hbm, link = CHIP_RATES[chip]
  compute = max(flops / peak, hbm_bytes / hbm)
  comm = comm_bytes / link
  return {"compute_s": compute, "comm_s": comm, "step_s": compute + comm,
          "share": comm / (compute + comm) if compute + comm else 0.0}
