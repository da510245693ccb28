"""Collective operations of a compiled program, read from its HLO text (`compiled.as_text()`).

For each all-gather, all-reduce, reduce-scatter, all-to-all and collective-permute: the bytes
it carries per device, how often one step runs it, which mesh axes its replica groups span,
and whether a group crosses slices (DCN). The text differs by backend, and all of it is read:

  * TPU runs collectives asynchronously (`all-gather-start` ... `all-gather-done`: the start
    is counted) and writes a reduce-scatter as a fusion whose called computation
    (`%all-reduce-scatter...`) holds an all-reduce of the whole input;
  * CPU has no reduce-scatter and combines many gradients into one tuple-typed all-reduce;
  * replica groups come as explicit lists `{{0,2},{1,3}}`, iota lists `[4,2]<=[2,4]T(1,0)`,
    or mesh form `mesh['axis_0'=4,'axis_1'=2], device_ids=([2,4]T(1,0)) {'axis_0'}`.

XLA's own cost analysis counts the body of a while loop once; so would a plain count of
instructions. Here each computation is weighted by how often it runs: a `while` body by the
trip count read from its loop counter (start, step and bound: `toolkit.planning.hlo.loop_trips`),
so collectives inside the scanned layers count once per layer and per micro-batch, and those
of a windowed einsum's ring loop once per ring step pair.

Device ids in the groups are positions in the mesh's device array (`mesh.devices.flat`): jit
assigns devices in that order, and with `use_global_device_ids` the ids index that order.
Across slices (TPU multi-slice), libtpu compiles one program per slice (`num_partitions` is the
devices of one slice, ids index slice 0's devices in mesh order) and sends what crosses slices
as host transfers to the MegaScale runtime: `send(...)` with
`_xla_megascale_transfer_type="ALL_REDUCE"` (or ALL_GATHER, ONE_TO_ONE...). Those are read as
collectives over the mesh axes that change slice.
"""
from __future__ import annotations

import collections
import dataclasses
import math
import re
from collections.abc import Sequence

import numpy as np

from toolkit.planning import hlo

KINDS = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")

_OPCODES = {
    "all-gather": "all-gather", "all-gather-start": "all-gather",
    "all-reduce": "all-reduce", "all-reduce-start": "all-reduce",
    "reduce-scatter": "reduce-scatter", "reduce-scatter-start": "reduce-scatter",
    "all-to-all": "all-to-all", "ragged-all-to-all": "all-to-all",
    "collective-permute": "collective-permute",
    "collective-permute-start": "collective-permute",
}

_DTYPE_BYTES = {"pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2,
                "bf16": 2, "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8,
                "c64": 8, "c128": 16}
_ARRAY = re.compile(r"\b(pred|bf16|f8\w*|[suf]\d+|c64|c128)\[([\d,]*)\]")
_CALLS = re.compile(r"\b(calls|to_apply|body|condition)=%?([\w.\-]+)")
_CALL_LISTS = re.compile(r"\b(?:branch_computations|called_computations)=\{([^}]*)\}")
_CONSTANT = re.compile(r"=\s*[su](?:32|64)\[\]\S*\s+constant\((\d+)\)")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
# The HLO text reader's parts (toolkit.planning.scheduling imports them from here too).
_HEADER, _INSTRUCTION, _split_type = hlo.HEADER, hlo.INSTRUCTION, hlo.split_type
_ASYNC_ECHO_CALL = re.compile(r"\basync-(?:update|done)\(")


@dataclasses.dataclass(frozen=True)
class Collective:
  """One collective instruction of the program."""
  kind: str               # one of KINDS
  name: str               # the HLO instruction
  payload_bytes: int      # per device: the gathered output, the scattered input, else the operand
  group_size: int         # devices per replica group
  axes: tuple[str, ...]   # mesh axes the groups span
  partial: bool           # the groups cover only part of those axes (e.g. within a slice)
  slices_spanned: int     # distinct slices in a group (1: inside a slice, on ICI)
  count: int              # executions per step (trip counts of enclosing loops multiplied)
  result: str = ""        # the instruction's result type without layouts: "f32[8,32,2,8]", or
                          # a tuple "(f32[4], f32[2])" (combined or -start collectives)

  @property
  def moved_bytes(self) -> float:
    """Bytes one device sends per execution, for the usual ring algorithms."""
    n = self.group_size
    if n <= 1:
      return 0.0
    if self.kind == "all-reduce":
      return 2 * self.payload_bytes * (n - 1) / n
    if self.kind == "collective-permute":
      return float(self.payload_bytes)
    return self.payload_bytes * (n - 1) / n

  @property
  def dcn_bytes(self) -> float:
    """Of `moved_bytes`, what crosses slices: a hierarchical algorithm reduces inside each
    slice first, so 1/(devices per slice in the group) of the data crosses DCN."""
    s = self.slices_spanned
    if s <= 1:
      return 0.0
    per_slice = max(self.group_size // s, 1)
    factor = {"all-reduce": 2.0}.get(self.kind, 1.0)
    if self.kind == "collective-permute":
      return float(self.payload_bytes)
    return factor * self.payload_bytes * (s - 1) / s / per_slice

  @property
  def ici_bytes(self) -> float:
    return max(self.moved_bytes - self.dcn_bytes, 0.0)


@dataclasses.dataclass(frozen=True)
class Summary:
  """Collectives of one kind over one set of mesh axes, per step and per device."""
  kind: str
  axes: str               # "fsdp", "data+fsdp", "tensor (partial)", "-" for none
  dcn: bool
  ops: int                # distinct instructions
  executions: int         # per step
  payload_bytes: float    # per step: sum of payload x executions
  ici_bytes: float        # per step, moved over ICI (ring estimate)
  dcn_bytes: float        # per step, moved over DCN


def array_bytes(type_text: str) -> int:
  """Bytes of every array in an HLO type (a tuple type sums its elements)."""
  total = 0.0
  for dtype, dims in _ARRAY.findall(type_text):
    size = _DTYPE_BYTES.get(dtype, 1 if dtype.startswith("f8") else 4)
    total += size * math.prod(int(d) for d in dims.split(",") if d)
  return int(total)


def _tuple_elements(type_text: str) -> list[str]:
  """Top-level elements of a tuple type, or [type_text] for an array type."""
  if not type_text.startswith("("):
    return [type_text]
  elements, depth, start = [], 0, 1
  for i, char in enumerate(type_text):
    if char in "([{":
      depth += 1
    elif char in ")]}":
      depth -= 1
    elif char == "," and depth == 1:
      elements.append(type_text[start:i].strip())
      start = i + 1
  elements.append(type_text[start:-1].strip())
  return [e for e in elements if e]


def _iota(text: str) -> np.ndarray:
  """'[4,2]<=[2,4]T(1,0)' or '[2,4]T(1,0)' or '[8]' -> the device ids in that layout."""
  match = re.fullmatch(r"\[([\d,]+)\](?:<=\[([\d,]+)\])?(?:T\(([\d,]+)\))?", text.strip())
  if not match:
    raise ValueError(f"unreadable iota list {text!r}")
  shape = [int(d) for d in match.group(1).split(",")]
  source = [int(d) for d in match.group(2).split(",")] if match.group(2) else shape
  ids = np.arange(math.prod(source)).reshape(source)
  if match.group(3):
    ids = ids.transpose([int(d) for d in match.group(3).split(",")])
  return ids.reshape(shape)


def replica_groups(attributes: str, num_devices: int) -> list[list[int]]:
  """The replica groups of an instruction's attribute text, as lists of device ids."""
  if "source_target_pairs=" in attributes:
    match = re.search(r"source_target_pairs=\{(.*?)\}\}", attributes)
    pairs = re.findall(r"\{(\d+),(\d+)\}", match.group(0)) if match else []
    return [[int(a), int(b)] for a, b in pairs if a != b]
  match = re.search(r"replica_groups=mesh\[([^\]]*)\](?:,\s*device_ids=\(([^)]*\)?)\))?\s*"
                    r"(?:\{([^}]*)\})?", attributes)
  if match:
    axes = re.findall(r"'([^']+)'=(\d+)", match.group(1))
    names, sizes = [a for a, _ in axes], [int(s) for _, s in axes]
    ids = (_iota(match.group(2)).reshape(sizes) if match.group(2)
           else np.arange(math.prod(sizes)).reshape(sizes))
    chosen = re.findall(r"'([^']+)'", match.group(3) or "") or names
    picked = [names.index(a) for a in chosen]
    rest = [i for i in range(len(names)) if i not in picked]
    groups = ids.transpose(rest + picked).reshape(-1, math.prod(sizes[i] for i in picked))
    return groups.tolist()
  match = re.search(r"replica_groups=(\[[\d,]+\](?:<=\[[\d,]+\])?(?:T\([\d,]+\))?)", attributes)
  if match:
    return _iota(match.group(1)).tolist()
  match = re.search(r"replica_groups=\{(\{[\d,\s]*\}(?:,\s*\{[\d,\s]*\})*)?\}", attributes)
  if match and match.group(1):
    return [[int(i) for i in g.split(",") if i.strip()]
            for g in re.findall(r"\{([\d,\s]*)\}", match.group(1))]
  return [list(range(num_devices))]  # empty groups: every device in one group


@dataclasses.dataclass
class _Computation:
  name: str
  lines: list[str] = dataclasses.field(default_factory=list)
  calls: list[tuple[str, str]] = dataclasses.field(default_factory=list)  # (how, callee)


def _computations(hlo_text: str) -> tuple[dict[str, _Computation], str | None]:
  computations: dict[str, _Computation] = {}
  entry, current = None, None
  for line in hlo.logical_lines(hlo_text):
    header = _HEADER.match(line)
    if header and not line.startswith(" "):
      current = computations.setdefault(header.group(1), _Computation(header.group(1)))
      if line.startswith("ENTRY"):
        entry = current.name
      continue
    if line.startswith("}"):
      current = None
      continue
    if current is None:
      continue
    current.lines.append(line)
    if _ASYNC_ECHO_CALL.search(line):
      continue  # the computation an async-start runs: its done does not run it again
    for how, callee in _CALLS.findall(line):
      current.calls.append((how, callee))
    for listed in _CALL_LISTS.findall(line):
      current.calls.extend(("calls", c.strip().lstrip("%")) for c in listed.split(",") if c.strip())
  return computations, entry


def _trip_count(line: str, computations: dict[str, _Computation],
                caller: _Computation | None = None) -> int:
  """Iterations of the while loop on `line` (in computation `caller`): backend_config's known
  trip count, else from its loop counter (`hlo.loop_trips`), else the one integer constant its
  condition compares against; 1 if none of these is there."""
  known = _TRIP.search(line)
  if known:
    return int(known.group(1))
  names = dict(re.findall(r"\b(condition|body)=%?([\w.\-]+)", line))
  lines = lambda name: computations[name].lines if name in computations else []
  if names.get("condition") in computations:
    trips = hlo.loop_trips(line, lines(names["condition"]), lines(names.get("body")),
                           caller.lines if caller else [])
    if trips is not None:
      return trips
    constants = {int(c) for l in lines(names["condition"]) for c in _CONSTANT.findall(l)}
    if len(constants) == 1:
      return constants.pop()
  return 1


def _multiplicities(computations: dict[str, _Computation], entry: str | None) -> dict[str, int]:
  """How often each computation runs per execution of the entry computation."""
  callers: dict[str, list[tuple[str, int]]] = collections.defaultdict(list)
  for comp in computations.values():
    for line in comp.lines:
      if " while(" in line:
        trips = _trip_count(line, computations, comp)
        for how, callee in _CALLS.findall(line):
          if how in ("body", "condition"):
            callers[callee].append((comp.name, trips))
    seen_body = {c for h, c in comp.calls if h in ("body", "condition")}
    for how, callee in comp.calls:
      if how not in ("body", "condition") and callee not in seen_body:
        callers[callee].append((comp.name, 1))
  memo: dict[str, int] = {}

  def runs(name: str, depth: int = 0) -> int:
    if name == entry:
      return 1
    if name in memo:
      return memo[name]
    if depth > 200:  # a malformed call graph: count once rather than recurse forever
      return 1
    memo[name] = sum(runs(caller, depth + 1) * factor for caller, factor in callers.get(name, []))
    return memo[name]

  return {name: runs(name) for name in computations}


_ECHO = re.compile(r"^\s*%async-collective-done[\w.\-]*\s*=")


def async_echoes(computations: dict[str, _Computation]) -> set[str]:
  """Computations that repeat a collective libtpu's async collective fusion started: the
  `async-collective-done` fusion's and the continuations' (`async_collective_fusion...`) hold
  the same transfer again (its channel_id), which `parse` counts once, at its start
  (toolkit/planning/scheduling.py reads the async forms)."""
  echoes = {name for name in computations if name.startswith("async_collective_fusion")}
  for comp in computations.values():
    echoes.update(callee for line in comp.lines if _ECHO.match(line)
                  for how, callee in _CALLS.findall(line) if how == "calls")
  return echoes


def parse(hlo_text: str, mesh_axes: Sequence[tuple[str, int]],
          slice_ids: Sequence[int] | None = None) -> list[Collective]:
  """Every collective of `hlo_text`, on a mesh with these (axis, size) pairs in order.

  Args:
    hlo_text: `compiled.as_text()` of an SPMD-partitioned program.
    mesh_axes: the mesh's axes and sizes, in order (`mesh.shape.items()`).
    slice_ids: the slice of each device position in the mesh (`mesh.devices.flat`), or None
      for one slice.
  """
  names = [name for name, _ in mesh_axes]
  shape = [size for _, size in mesh_axes]
  num_devices = math.prod(shape)
  slice_array = None if slice_ids is None else np.asarray(slice_ids)
  num_slices = 1 if slice_array is None else len(set(slice_array.tolist()))
  # Ids of a per-slice program index slice 0's devices in mesh order.
  positions = np.arange(num_devices)
  partitions = re.search(r"num_partitions=(\d+)", hlo_text[:5000])
  if num_slices > 1 and partitions and int(partitions.group(1)) < num_devices:
    positions = np.flatnonzero(slice_array == slice_array[0])
  dcn_axes = _slice_axes(slice_array, names, shape)
  computations, entry = _computations(hlo_text)
  runs = _multiplicities(computations, entry)
  echoes = async_echoes(computations)
  found = []
  for comp in computations.values():
    if comp.name in echoes:
      continue  # the same transfer as its async start's (TPU async collective fusion)
    in_reduce_scatter_fusion = "reduce-scatter" in comp.name
    for line in comp.lines:
      match = _INSTRUCTION.match(line)
      if not match:
        continue
      type_text, rest = _split_type(match.group(2))
      opcode = re.match(r"([\w\-]+)\(", rest)
      if not opcode:
        continue
      count = max(runs.get(comp.name, 1), 0)
      megascale = _MEGASCALE.search(rest) if opcode.group(1) == "send" else None
      if megascale:
        kind = _MEGASCALE_KINDS.get(megascale.group(1), megascale.group(1).lower())
        payload = array_bytes(_tuple_elements(type_text)[0])
        if kind == "all-gather":
          payload *= num_slices  # the send carries this device's piece; report the gathered
        found.append(Collective(kind=kind, name=match.group(1), payload_bytes=payload,
                                group_size=num_slices, axes=dcn_axes, partial=False,
                                slices_spanned=num_slices, count=count,
                                result=_without_layouts(type_text)))
        continue
      if opcode.group(1) not in _OPCODES:
        continue
      kind = _OPCODES[opcode.group(1)]
      if kind == "all-reduce" and in_reduce_scatter_fusion:
        kind = "reduce-scatter"  # TPU: a fusion calling all-reduce-scatter; payload = input
      payload = _payload(opcode.group(1), type_text)
      groups = [[int(positions[i % len(positions)]) for i in group]
                for group in replica_groups(rest, len(positions))]
      axes, partial, slices = _span(groups, names, shape, slice_array)
      group_size = len(groups[0]) if groups else 1
      if kind == "collective-permute":
        group_size = 2 if groups else 1
      found.append(Collective(kind=kind, name=match.group(1), payload_bytes=payload,
                              group_size=group_size, axes=axes, partial=partial,
                              slices_spanned=slices, count=count,
                              result=_without_layouts(type_text)))
  return found


_MEGASCALE = re.compile(r'_xla_megascale_transfer_type="([A-Z_]+)"')
_MEGASCALE_KINDS = {"ALL_REDUCE": "all-reduce", "ALL_GATHER": "all-gather",
                    "REDUCE_SCATTER": "reduce-scatter", "ALL_TO_ALL": "all-to-all",
                    "ONE_TO_ONE": "collective-permute"}


def _slice_axes(slice_array: np.ndarray | None, names: list[str],
                shape: list[int]) -> tuple[str, ...]:
  """The mesh axes along which the slice changes (the DCN axes)."""
  if slice_array is None or len(slice_array) != math.prod(shape):
    return ()
  grid = slice_array.reshape(shape)
  return tuple(name for i, name in enumerate(names)
               if (np.diff(grid, axis=i) != 0).any())


def _without_layouts(type_text: str) -> str:
  """'(f32[8,4]{1,0}, s32[]{:T(128)})' -> '(f32[8,4], s32[])'."""
  return re.sub(r"\{[^{}]*\}", "", type_text)


def _payload(opcode: str, type_text: str) -> int:
  """Bytes per device that the collective is about, from its result type."""
  if opcode.endswith("-start"):
    elements = _tuple_elements(type_text)
    if opcode == "all-gather-start" and len(elements) >= 2:  # (operands..., outputs...)
      return sum(array_bytes(e) for e in elements[len(elements) // 2:])
    if opcode == "collective-permute-start" and len(elements) >= 2:
      return array_bytes(elements[0])
  return array_bytes(type_text)


def _span(groups: list[list[int]], names: list[str], shape: list[int],
          slice_ids: Sequence[int] | None) -> tuple[tuple[str, ...], bool, int]:
  """Mesh axes along which a group's devices differ; whether the groups cover those axes only
  in part; the most slices one group spans."""
  if not groups or not shape:
    return (), False, 1
  varying: set[int] = set()
  slices = 1
  for group in groups:
    coords = np.array(np.unravel_index(np.asarray(group) % math.prod(shape), shape)).T
    varying.update(int(i) for i in np.nonzero((coords != coords[0]).any(axis=0))[0])
    if slice_ids is not None:
      slices = max(slices, len({slice_ids[d % len(slice_ids)] for d in group}))
  axes = tuple(names[i] for i in sorted(varying))
  partial = len(groups[0]) < math.prod(shape[i] for i in varying) if varying else False
  return axes, partial, slices


def summarize(collectives: Sequence[Collective]) -> list[Summary]:
  """Totals per (kind, axes, crosses DCN), largest traffic first."""
  rows: dict[tuple, list[Collective]] = collections.defaultdict(list)
  for c in collectives:
    axes = "+".join(c.axes) or "-"
    rows[(c.kind, axes + (" (partial)" if c.partial else ""), c.slices_spanned > 1)].append(c)
  summaries = [Summary(kind=kind, axes=axes, dcn=dcn, ops=len(items),
                       executions=sum(c.count for c in items),
                       payload_bytes=float(sum(c.payload_bytes * c.count for c in items)),
                       ici_bytes=float(sum(c.ici_bytes * c.count for c in items)),
                       dcn_bytes=float(sum(c.dcn_bytes * c.count for c in items)))
               for (kind, axes, dcn), items in rows.items()]
  return sorted(summaries, key=lambda s: -(s.ici_bytes + s.dcn_bytes))
