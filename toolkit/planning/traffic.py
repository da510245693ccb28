"""Memory traffic of a compiled step, read from its HLO text (`compiled.as_text()`): the bytes
each executed instruction reads from and writes to device memory, every loop counted by its
trip count. It is the step-time estimate's memory term (`estimate.step_seconds`): the work
outside the matmuls (norms, softmax, activations, the optimizer update, copies) runs at the
memory's bandwidth, not at the matmul peak.

What is counted, per device and step:
  * every instruction of the computations that run as control flow (the entry, while bodies
    and conditions, call and conditional targets), times how often its computation runs
    (`collectives._multiplicities`); a fusion counts at its boundary, its inside stays in
    registers and caches;
  * reads: each operand's bytes (once if it is named twice), except an operand a fusion only
    slices (a scanned layer's weights out of the stacked ones: the slice's bytes) and the
    buffer a dynamic-update-slice writes into in place (nothing);
  * writes: the output's bytes, or the update's for a dynamic-update-slice;
  * split in two: instructions that multiply matrices (a dot or convolution, inside a fusion
    or not, and custom calls such as the splash kernel), whose traffic streams under their
    FLOPs, and everything else, the memory term;
  * left out: collectives (priced by the interconnect), and what moves no data (parameters,
    tuples, get-tuple-element, constants, bitcasts, the loops and calls themselves).
"""
from __future__ import annotations

import dataclasses
import re

from toolkit.planning import collectives, hlo
# The HLO reader's own parts (one concern: the compiled program's computations and loops).
from toolkit.planning.collectives import (  # pylint: disable=protected-access
    _CALL_LISTS, _CALLS, _computations, _multiplicities)

_FREE = frozenset({"parameter", "get-tuple-element", "tuple", "constant", "bitcast", "while",
                   "call", "conditional", "after-all", "partition-id", "replica-id", "iota",
                   "opt-barrier", "copy-done", "send-done", "recv-done", "add-dependency"})
_MATMUL = frozenset({"dot", "convolution", "custom-call"})
_SLICES = frozenset({"dynamic-slice", "slice", "gather"})
_COLLECTIVE = re.compile(r"^(?:all-gather|all-reduce|reduce-scatter|all-to-all|ragged-all-to-all"
                         r"|collective-permute|collective-broadcast|async-|send|recv)")


@dataclasses.dataclass(frozen=True)
class Traffic:
  """Bytes per device per step."""
  memory_bytes: float      # read + written by the instructions outside the matmuls
  matmul_bytes: float      # read + written by the matmul instructions (under their FLOPs)
  instructions: int        # distinct instructions counted (either kind)


def _callees(instruction: hlo.Instruction) -> list[str]:
  names = [callee for _, callee in _CALLS.findall(instruction.rest)]
  for listed in _CALL_LISTS.findall(instruction.rest):
    names.extend(c.strip().lstrip("%") for c in listed.split(",") if c.strip())
  return names


def _control(computations, entry: str) -> set[str]:
  """The computations that run as control flow: the entry and what its loops, calls and
  conditionals run (not fusions' or reductions' bodies)."""
  control, todo = {entry}, [entry]
  while todo:
    for instruction in hlo.instructions(computations[todo.pop()].lines):
      if instruction.opcode not in ("while", "call", "conditional"):
        continue
      for callee in _callees(instruction):
        if callee in computations and callee not in control:
          control.add(callee)
          todo.append(callee)
  return control


class _Fused:
  """What a fusion's computation does with its parameters, memoized per computation."""

  def __init__(self, computations):
    self._computations = computations
    self._memo: dict[str, tuple] = {}

  def matmul(self, name: str) -> bool:
    return self._read(name)[0]

  def collective(self, name: str) -> bool:
    return self._read(name)[1]

  def sliced(self, name: str) -> dict[int, int]:
    """parameter number -> bytes read, for parameters used only through slices."""
    return self._read(name)[2]

  def in_place(self, name: str) -> tuple[int, int] | None:
    """(the parameter a root dynamic-update-slice writes into, the update's bytes), if the
    root is one."""
    return self._read(name)[3]

  def _read(self, name: str, depth: int = 0):
    if name in self._memo:
      return self._memo[name]
    if name not in self._computations or depth > 50:
      return False, False, {}, None
    instructions = hlo.instructions(self._computations[name].lines)
    matmul = collective = False
    for i in instructions:
      matmul |= i.opcode in _MATMUL
      collective |= bool(_COLLECTIVE.match(i.opcode))
      for callee in _callees(i):
        inner = self._read(callee, depth + 1)
        matmul, collective = matmul or inner[0], collective or inner[1]
    numbers = {i.name: int(re.match(r"\s*(\d+)", i.rest).group(1))
               for i in instructions if i.opcode == "parameter"}
    users: dict[str, list[hlo.Instruction]] = {}
    for i in instructions:
      for operand in i.operands:
        users.setdefault(operand, []).append(i)
    sliced = {}
    for param, number in numbers.items():
      uses = users.get(param, [])
      if uses and all(u.opcode in _SLICES and u.operands[0] == param for u in uses):
        sliced[number] = sum(collectives.array_bytes(u.type_text) for u in uses)
    root = _root(self._computations[name].lines, instructions)
    in_place = None
    if root is not None and root.opcode == "dynamic-update-slice" and len(root.operands) > 1:
      update = next((i for i in instructions if i.name == root.operands[1]), None)
      if root.operands[0] in numbers and update is not None:
        in_place = (numbers[root.operands[0]], collectives.array_bytes(update.type_text))
    self._memo[name] = (matmul, collective, sliced, in_place)
    return self._memo[name]


def _root(lines, instructions: list[hlo.Instruction]) -> hlo.Instruction | None:
  by_name = {i.name: i for i in instructions}
  for line in lines:
    if line.lstrip().startswith("ROOT"):
      match = hlo.INSTRUCTION.match(line)
      root = by_name.get(match.group(1)) if match else None
      while root is not None and root.opcode == "bitcast" and root.operands:
        root = by_name.get(root.operands[0])
      return root
  return None


def _bytes(i: hlo.Instruction, types: dict[str, str], fused: _Fused) -> tuple[int, bool]:
  """(bytes read + written, whether it multiplies matrices) of one instruction."""
  # An operand named twice is read once.
  operand_bytes = [0 if o in i.operands[:k] else collectives.array_bytes(types.get(o, ""))
                   for k, o in enumerate(i.operands)]
  written = collectives.array_bytes(i.type_text)
  if i.opcode == "fusion":
    callee = next(iter(_callees(i)), "")
    sliced, in_place = fused.sliced(callee), fused.in_place(callee)
    for number, read in sliced.items():
      if number < len(operand_bytes):
        operand_bytes[number] = min(operand_bytes[number], read)
    if in_place is not None and in_place[0] < len(operand_bytes):
      operand_bytes[in_place[0]] = 0     # written in place: only the update moves
      written = in_place[1]
    return sum(operand_bytes) + written, fused.matmul(callee)
  if i.opcode == "dynamic-update-slice" and operand_bytes:
    update = operand_bytes[1] if len(operand_bytes) > 1 else 0
    return 2 * update, False
  if i.opcode in _SLICES:
    return 2 * written, False
  return sum(operand_bytes) + written, i.opcode in _MATMUL


def memory_traffic(hlo_text: str) -> Traffic:
  """The step's memory traffic per device (see the module docstring)."""
  computations, entry = _computations(hlo_text)
  if entry is None:
    return Traffic(0.0, 0.0, 0)
  runs = _multiplicities(computations, entry)
  fused = _Fused(computations)
  memory = matmul = 0.0
  counted = 0
  for name in _control(computations, entry):
    instructions = hlo.instructions(computations[name].lines)
    types = {i.name: i.type_text for i in instructions}
    for i in instructions:
      if i.opcode in _FREE or _COLLECTIVE.match(i.opcode):
        continue
      if i.opcode == "fusion" and fused.collective(next(iter(_callees(i)), "")):
        continue   # a TPU async collective fusion: the interconnect's
      moved, multiplies = _bytes(i, types, fused)
      counted += 1
      if multiplies:
        matmul += moved * runs.get(name, 1)
      else:
        memory += moved * runs.get(name, 1)
  return Traffic(memory, matmul, counted)
