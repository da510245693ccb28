"""Which collectives of a compiled program can overlap compute: those scheduled asynchronously,
as a start and a done with other work between them, read from the HLO text
(`compiled.as_text()`) by kind, next to those that run in place.

Three forms, each counted as one start/done pair:
  * `all-gather-start` ... `all-gather-done` (also all-reduce, collective-permute);
  * `async-start` ... `async-done` wrapping a collective's computation (`calls=`), as XLA
    writes a reduce-scatter or an all-to-all it made asynchronous;
  * TPU async collective fusion (libtpu's "continuation fusion", what the overlap flags of
    toolkit/xla_flags.py turn on): fusions named `async-collective-start` /
    `async-collective-done` around the collective; the copies of the collective in the done's
    and the continuations' computations are the same transfer (`collectives.async_echoes`).

Counts are of instructions, each once: a pair inside the scanned layers' loop counts once, not
once per layer.
"""
from __future__ import annotations

import collections
import dataclasses
import re

from toolkit.planning import collectives
# The HLO reader's own parts (one concern: the compiled program's collectives).
from toolkit.planning.collectives import (  # pylint: disable=protected-access
    _CALLS, _INSTRUCTION, _OPCODES, _Computation, _computations, _split_type)


@dataclasses.dataclass(frozen=True)
class Scheduling:
  """Collective instructions of a program by kind (collectives.KINDS)."""
  pairs: dict[str, int]         # scheduled asynchronously: start/done pairs
  synchronous: dict[str, int]   # run in place, nothing overlapping them

  def as_dict(self) -> dict:
    return {"async_pairs": dict(self.pairs), "synchronous": dict(self.synchronous),
            "async_pair_count": sum(self.pairs.values()),
            "synchronous_count": sum(self.synchronous.values())}


def read(hlo_text: str) -> Scheduling:
  """The async start/done pairs and the synchronous collectives of `hlo_text`, by kind."""
  computations, _ = _computations(hlo_text)
  # Computations whose collective is counted at its async start (or its echo: a done's).
  started_inside = collectives.async_echoes(computations) | {
      callee for comp in computations.values() for name, opcode, line in _instructions(comp)
      if opcode == "async-start" or name.startswith("async-collective-start")
      for callee in _callees(line)}
  started, done, synchronous = (collections.Counter() for _ in range(3))
  for comp in computations.values():
    for name, opcode, line in _instructions(comp):
      if opcode.endswith("-start") and opcode[:-6] in _OPCODES:
        started[_OPCODES[opcode[:-6]]] += 1
      elif opcode.endswith("-done") and opcode[:-5] in _OPCODES:
        done[_OPCODES[opcode[:-5]]] += 1
      elif opcode in ("async-start", "async-done") or name.startswith("async-collective-"):
        kinds = [k for c in _callees(line) if (k := _kind_inside(c, computations))]
        if kinds:
          (started if opcode == "async-start" or "-start" in name else done)[kinds[0]] += 1
      elif opcode in _OPCODES and comp.name not in started_inside:
        synchronous[_kind(_OPCODES[opcode], comp.name)] += 1
  pairs = {kind: min(n, done[kind]) for kind, n in started.items() if min(n, done[kind])}
  return Scheduling(pairs=dict(sorted(pairs.items())),
                    synchronous=dict(sorted(synchronous.items())))


def _kind(kind: str, computation: str) -> str:
  """TPU writes a reduce-scatter as a fusion whose computation (`%all-reduce-scatter...`)
  holds an all-reduce (as `collectives.parse` reads it)."""
  return "reduce-scatter" if kind == "all-reduce" and "reduce-scatter" in computation else kind


def _kind_inside(name: str, computations: dict[str, _Computation], depth: int = 0) -> str | None:
  """The collective a computation (or one it calls) runs, or None."""
  comp = computations.get(name)
  if comp is None or depth > 3:
    return None
  for _, opcode, line in _instructions(comp):
    if (kind := _OPCODES.get(opcode.removesuffix("-start"))) is not None:
      return _kind(kind, name)
    for callee in _callees(line):
      if (kind := _kind_inside(callee, computations, depth + 1)) is not None:
        return kind
  return None


def _instructions(comp: _Computation):
  """(name, opcode, line) of each instruction of `comp`."""
  for line in comp.lines:
    match = _INSTRUCTION.match(line)
    if match and (opcode := re.match(r"([\w\-]+)\(", _split_type(match.group(2))[1])):
      yield match.group(1), opcode.group(1), line


def _callees(line: str) -> list[str]:
  """The computations an instruction calls (a fusion's, an async op's, a reduction's)."""
  return [callee for how, callee in _CALLS.findall(line) if how in ("calls", "to_apply")]
