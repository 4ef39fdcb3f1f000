"""The communication a compiled step leaves exposed: its schedule replayed against a
roofline of compute and links.

`comms.share` assumes nothing overlaps. The compiled module is scheduled (its text lists
each computation's instructions in execution order), so `exposed(hlo_text, mesh_shape,
chip)` replays it on one clock:

- compute: each dot and convolution (inside fusions too) takes its FLOPs (2 x output
  elements x the products it sums) at the chip's bf16 peak, each Pallas kernel the
  FLOPs of its `cost_estimate`; everything else is free (so hiding is not overstated by
  elementwise work);
- links: a collective occupies its link (ICI within a slice, the data-centre network
  where it crosses "slice") for `comms.collective`'s bytes at that link's rate (the
  rates of `comms.CHIP_RATES`); collectives in flight together queue on the link in the
  order they start, so two in flight share one window of compute;
- an asynchronous collective starts at its start (`all-gather-start`, `async-start`,
  TPU's fusion holding `AsyncCollectiveStart`, a SparseCore offload's `call-start`, a
  multi-slice `send`) and the clock waits at its done for what is left of it; a
  synchronous one waits at once;
- loops run their body once per trip (`comms.trip_count`), so a collective started in
  one iteration can be hidden by the next; a loop holding no collective is its
  compute times its trips. A loop holding a collective whose trip count cannot be read
  is listed in "unknown" and its collectives are not counted (the estimate is then
  void, never a guess); conditionals run their costliest branch.

What the clock waited is exposed; the step ends when its last transfer does.
"""

import collections
import re

import numpy as np

from tunix_core.aot import comms

_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = (.*?) ([a-z][a-z\-]*)\((.*)$")


class _Module(dict):
  """`{computation: [(name, shape, op, operands, line)]}` of a module's text, with its
  `entry` and `lines` (`{computation: [its lines]}`, as `comms.trip_count` reads them)."""
  entry: str
  lines: dict


def _parse(hlo: str) -> _Module:
  """The instructions of a module's text, computation by computation (`_Module`)."""
  comps, entry = comms.computations(hlo)
  out = _Module()
  out.entry, out.lines = entry, comps
  for comp, lines in comps.items():
    out[comp] = []
    for line in lines:
      m = _INSTRUCTION.match(line)
      if m:
        name, shape, op, rest = m.groups()
        depth, end = 1, 0
        for end, ch in enumerate(rest):
          depth += {"(": 1, ")": -1}.get(ch, 0)
          if depth == 0:
            break
        out[comp].append((name, shape, op, re.findall(r"%([\w.\-]+)", rest[:end]), line))
  return out


def _dims(shape: str) -> list[int]:
  """Dimensions of the first array in a shape's text."""
  m = re.search(r"\w+\[([\d,]*)\]", shape)
  return [int(d) for d in m.group(1).split(",") if d] if m else []


def _key(op: str, shape: str) -> tuple:
  """What pairs a collective's start with its done: its kind and its largest array (the
  result of a gather, reduce or permute; a start's tuple also holds its operand)."""
  arrays = re.findall(r"(\w+)\[([\d,]*)\]", shape)
  size = lambda a: comms.BYTES.get(a[0], 0) * np.prod([int(d) for d in a[1].split(",") if d])
  largest = max(arrays, key=size, default=("", ""))
  return (op.removesuffix("-start").removesuffix("-done"), f"{largest[0]}[{largest[1]}]")


def _is_collective(op: str) -> bool:
  """A collective (synchronous, or its start or done) or a cross-slice transfer's send or
  its done."""
  return (op.removesuffix("-start").removesuffix("-done") in comms.FACTOR
          or op in ("send", "send-done"))


def _callees(line: str, kind: str = "calls|to_apply|body|branch_computations|"
             "true_computation|false_computation") -> list[str]:
  """The computations an instruction names after `kind=`."""
  return [c for group in re.findall(rf"(?:{kind})=(\{{[^}}]*\}}|%[\w.\-]+)", line)
          for c in re.findall(r"%([\w.\-]+)", group)]


def _conv_flops(out_dims: list, shapes: dict, operands: list, line: str) -> float:
  """FLOPs of a convolution: 2 x input features x, per output feature and batch row,
  the (output position, kernel position) pairs that meet a real input element in every
  spatial dimension. (A batched matmul compiles to a convolution whose window slides
  over a padded batch of one: each output position pays one kernel position, not the
  window's size.)"""
  labels = re.search(r"dim_labels=(\w+)_(\w+)->(\w+)", line)
  lhs, kernel = (_dims(shapes.get(o, "")) for o in operands[:2])
  if not labels or len(kernel) != len(labels.group(2)) or len(lhs) != len(labels.group(1)):
    return 0.0
  lhs_labels, kernel_labels, out_labels = labels.groups()
  found = re.search(r"window=\{([^}]*)\}", line)
  window = dict(re.findall(r"(\w+)=([\dx_]+)", found.group(1))) if found else {}
  per_dim = lambda key, d: [int(v.split("_")[0]) for v in window[key].split("x")][d]
  flops = 2.0 * kernel[kernel_labels.index("i")]
  flops *= np.prod([n for n, l in zip(out_dims, out_labels) if not l.isdigit()])
  for d, label in enumerate(sorted(l for l in kernel_labels if l.isdigit())):
    stride = per_dim("stride", d) if "stride" in window else 1
    low = per_dim("pad", d) if "pad" in window else 0
    rhs_dilate = per_dim("rhs_dilate", d) if "rhs_dilate" in window else 1
    lhs_dilate = per_dim("lhs_dilate", d) if "lhs_dilate" in window else 1
    length = lhs[lhs_labels.index(label)]
    at = (np.arange(out_dims[out_labels.index(label)])[:, None] * stride - low
          + np.arange(kernel[kernel_labels.index(label)])[None, :] * rhs_dilate)
    flops *= np.sum((at >= 0) & (at % lhs_dilate == 0) & (at // lhs_dilate < length))
  return float(flops)


def _op_flops(instruction: tuple, shapes: dict, comps: dict, memo: dict) -> float:
  """FLOPs of one instruction: a dot, a convolution, a Pallas kernel (its
  `cost_estimate`), or what a fusion, call or loop (times its trips) it names holds;
  a conditional counts its costliest branch."""
  _, shape, op, operands, line = instruction
  out = float(np.prod(_dims(shape)))
  if op == "dot":
    contract = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", line)
    lhs = _dims(shapes.get(operands[0], ""))
    axes = [int(a) for a in contract.group(1).split(",") if a] if contract else []
    return 2 * out * float(np.prod([lhs[a] for a in axes if a < len(lhs)]))
  if op == "convolution":
    return _conv_flops(_dims(shape), shapes, operands, line)
  if op == "custom-call":
    found = re.search(r'"cost_estimate":\{"flops":"(\d+)"', line)
    return float(found.group(1)) if found else 0.0
  if op == "while":
    trips = comms.trip_count(line, comps.lines) or 1
    return trips * _flops(_callees(line, "body")[0], comps, memo)
  if op == "conditional":
    return max((_flops(c, comps, memo) for c in _callees(line)), default=0.0)
  if op in ("fusion", "call", "async-start"):
    return sum(_flops(c, comps, memo) for c in _callees(line, "calls|to_apply"))
  return 0.0


def _flops(comp: str, comps: dict, memo: dict) -> float:
  """FLOPs of one execution of a computation (`_op_flops` summed)."""
  if comp not in memo:
    memo[comp] = 0.0  # a computation never calls itself; this guards the walk anyway
    shapes = {name: shape for name, shape, *_ in comps.get(comp, [])}
    memo[comp] = sum(_op_flops(i, shapes, comps, memo) for i in comps.get(comp, []))
  return memo[comp]


class _Replay:
  """The clock, the links and the collectives in flight of one replayed step."""

  def __init__(self, comps: _Module, mesh_shape: dict, chip: str):
    self.comps, self.mesh_shape = comps, mesh_shape
    self.peak, _, ici, dcn = comms.CHIP_RATES[chip]
    self.rate = {"ici": ici, "dcn": dcn}
    self.clock = self.compute_s = self.waited_s = self.comm_s = self.bytes = 0.0
    self.link_free = {"ici": 0.0, "dcn": 0.0}
    self.flight = collections.defaultdict(collections.deque)  # key -> its transfers' ends
    self.unknown, self.memo, self.holds, self.asynchronous = [], {}, {}, 0
    self.calls = {}  # call-start -> its computation, till its call-done

  def holds_collective(self, comp: str) -> bool:
    """Whether a computation, or one it names, holds a collective or a transfer."""
    if comp not in self.holds:
      self.holds[comp] = False
      self.holds[comp] = any(
          _is_collective(op) or any(self.holds_collective(c) for c in _callees(line))
          for _, _, op, _, line in self.comps.get(comp, []))
    return self.holds[comp]

  def compute(self, flops: float):
    self.compute_s += flops / self.peak
    self.clock += flops / self.peak

  def start(self, key, op: str, shape: str, line: str):
    """Queues a collective on its link behind those in flight there."""
    found = (comms.dcn_transfer(line, op, shape, self.mesh_shape) if op == "send" else
             comms.collective(line, op, shape, self.mesh_shape))
    end = self.clock
    if found is not None:
      link = "dcn" if "slice" in found[1] else "ici"
      seconds = found[2] / self.rate[link]
      end = self.link_free[link] = max(self.clock, self.link_free[link]) + seconds
      self.comm_s += seconds
      self.bytes += found[2]
    self.flight[key].append(end)

  def done(self, key):
    """The clock waits for the oldest collective in flight under `key`."""
    if self.flight[key]:
      end = self.flight[key].popleft()
      self.waited_s += max(0.0, end - self.clock)
      self.clock = max(self.clock, end)

  def run(self, comp: str):
    """Replays one execution of a computation."""
    shapes = {name: shape for name, shape, *_ in self.comps.get(comp, [])}
    for instruction in self.comps.get(comp, []):
      name, shape, op, operands, line = instruction
      callees = _callees(line)
      if op == "call-done" and operands and operands[0] in self.calls:
        self.fused("async-done", self.calls.pop(operands[0]))
      elif not (_is_collective(op) or any(self.holds_collective(c) for c in callees)):
        self.compute(_op_flops(instruction, shapes, self.comps, self.memo))
      elif op == "while":
        trips = comms.trip_count(line, self.comps.lines)
        if trips is None:
          self.unknown.append(name)
        for _ in range(trips or 0):
          self.run(_callees(line, "body")[0])
      elif op == "conditional":
        self.run(max(callees, key=lambda c: _flops(c, self.comps, self.memo)))
      elif op == "call":
        self.run(callees[0])
      elif op == "call-start":  # an async call on another thread: SparseCore's offload
        self.calls[name] = callees[0]
        self.fused("async-start", callees[0])
      elif op in ("fusion", "async-start", "async-done"):
        self.fused(op, callees[0] if callees else "")
      elif op == "send":  # sends pair with their dones in order (a done holds no shape)
        self.start(("send",), op, shape, line)
        self.asynchronous += 1
      elif op == "send-done":
        self.done(("send",))
      elif op.endswith("-done"):
        self.done(_key(op, shape))
      elif op.endswith("-start"):
        self.start(_key(op, shape), op, shape, line)
        self.asynchronous += 1
      else:  # a synchronous collective: the clock waits for it at once
        self.start(("sync", name), op, shape, line)
        self.done(("sync", name))

  def fused(self, op: str, callee: str):
    """A fusion or async wrapper holding a collective: TPU's start, continuation or
    done of an async collective, XLA's `async-start`/`-done`, or one run in place.
    Starts and dones pair by `_key`, oldest first."""
    found, role = None, {"async-start": "start", "async-done": "done"}.get(op)
    for _, shape, inner, _, line in self.comps.get(callee, []):
      if inner.removesuffix("-start") in comms.FACTOR:
        found = (inner, shape, line)
      for marker, marked in (("AsyncCollectiveStart", "start"), ("AsyncCollectiveDone", "done")):
        role = marked if f'custom_call_target="{marker}"' in line else role
    self.compute(_flops(callee, self.comps, self.memo))
    if found is None or callee.startswith(comms.CONTINUATION):
      return
    key = _key(*found[:2])
    if role != "done":
      self.start(key, *found)
      self.asynchronous += role == "start"
    if role != "start":
      self.done(key)


def exposed(hlo: str, mesh_shape: dict, chip: str) -> dict:
  """The replay of a compiled module's schedule (module docstring). Returns per device
  `{"compute_s", "comm_s" (every collective's link time), "exposed_s" (what the clock
  waited), "step_s", "share" (exposed_s / step_s), "serial_share" (comm_s / (compute_s +
  comm_s): nothing overlapped), "bytes" (sent), "asynchronous" (collectives started
  asynchronously, loop trips counted), "unknown" (loops holding collectives
  whose trip count cannot be read: the figures leave them out)}`."""
  module = _parse(hlo)
  replay = _Replay(module, mesh_shape, chip)
  replay.run(module.entry)
  end = max(replay.link_free.values())  # the step ends with its last transfer
  replay.waited_s += max(0.0, end - replay.clock)
  step = max(replay.clock, end)
  total = replay.compute_s + replay.comm_s
  return {"compute_s": replay.compute_s, "comm_s": replay.comm_s,
          "exposed_s": replay.waited_s, "step_s": step,
          "share": replay.waited_s / step if step else 0.0,
          "serial_share": replay.comm_s / total if total else 0.0,
          "bytes": replay.bytes, "asynchronous": replay.asynchronous,
          "unknown": replay.unknown}


def describe(result: dict) -> str:
  """The line `--compile_only` prints for `exposed`'s result."""
  if result["unknown"]:
    return ("exposed communication: unknown (collectives in loops whose trip count "
            f"cannot be read: {', '.join(result['unknown'])})")
  return (f"exposed communication: {result['share']:.1%} of the step "
          f"({result['serial_share']:.1%} if nothing overlapped; "
          f"{result['exposed_s'] * 1e3:.3g} of {result['comm_s'] * 1e3:.3g} ms of "
          f"collectives not hidden by {result['compute_s'] * 1e3:.3g} ms of compute)")
