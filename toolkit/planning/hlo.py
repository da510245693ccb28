"""Reading XLA's HLO text (`compiled.as_text()`): its lines as whole instructions, an
instruction's type, opcode and operands, and how many times a while loop runs, worked out
from its loop counter.

`toolkit.planning.collectives` builds the program's computations and collectives from these.
Two things in libtpu's text need care:

  * an instruction may span lines: the splash kernel's custom call prints
    `frontend_attributes={kernel_metadata={` then a line of JSON then `}}, metadata=...`, and a
    reader that takes a line starting with `}` as the end of the computation loses the rest
    of the layer (its loops and collectives, across slices its gradient transfers);
  * a loop need not count 0, 1, 2, ...: XLA's TPU windowed einsum (a matmul whose weights or
    partial results go round the ring as collective-permutes) does two ring steps per
    iteration, `i < 8` stepping by 2 (4 trips on 16 devices), and a loop may start past 0.
"""
from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterator, Sequence

HEADER = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s*\(.*\)\s*->.*\{\s*$")
INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_INSTRUCTION_START = re.compile(r"^\s+(?:ROOT\s+)?%[\w.\-]+\s*=\s")


def split_type(rest: str) -> tuple[str, str]:
  """'(f32[2], s32[]) all-reduce(...)' -> ('(f32[2], s32[])', 'all-reduce(...)')."""
  if rest.startswith("("):
    depth = 0
    for i, char in enumerate(rest):
      depth += char == "("
      depth -= char == ")"
      if depth == 0:
        return rest[:i + 1], rest[i + 1:].lstrip()
  type_text, _, tail = rest.partition(" ")
  return type_text, tail


def logical_lines(hlo_text: str) -> Iterator[str]:
  """The lines of `hlo_text`, with an instruction that spans lines joined into one. An
  instruction goes on while its braces are still open, until the next instruction, a
  computation header, or a `}` on its own line."""
  pending, depth = None, 0
  for line in hlo_text.splitlines():
    boundary = HEADER.match(line) or line.strip() == "}" or _INSTRUCTION_START.match(line)
    if pending is not None and depth > 0 and not boundary:
      pending += " " + line
      depth += line.count("{") - line.count("}")
      continue
    if pending is not None:
      yield pending
      pending = None
    if HEADER.match(line) or line.strip() == "}":
      yield line
    else:
      pending, depth = line, line.count("{") - line.count("}")
  if pending is not None:
    yield pending


@dataclasses.dataclass(frozen=True)
class Instruction:
  """One HLO instruction: its name, result type, opcode, operand names and the text after the
  opcode's opening parenthesis (operands, then attributes)."""
  name: str
  type_text: str
  opcode: str
  operands: list[str]
  rest: str


def instructions(lines: Sequence[str]) -> list[Instruction]:
  """The instructions among a computation's (logical) lines, in order."""
  found = []
  for line in lines:
    match = INSTRUCTION.match(line)
    if not match:
      continue
    type_text, rest = split_type(match.group(2))
    opcode = re.match(r"([\w\-]+)\(", rest)
    if not opcode:
      continue
    depth, close = 0, len(rest)
    for i in range(opcode.end() - 1, len(rest)):
      depth += {"(": 1, ")": -1}.get(rest[i], 0)
      if depth == 0:
        close = i
        break
    operands = re.findall(r"%([\w.\-]+)", rest[opcode.end():close])
    found.append(Instruction(match.group(1), type_text, opcode.group(1), operands,
                             rest[opcode.end():]))
  return found


def _definitions(lines: Sequence[str]) -> dict[str, tuple[str, list[str], str]]:
  """name -> (opcode, operand names, the text after the opening parenthesis) of each
  instruction of a computation."""
  return {i.name: (i.opcode, i.operands, i.rest) for i in instructions(lines)}


def _value(name: str, defs: dict) -> tuple[str, int] | None:
  """("constant", N) or ("element", k: the loop state's tuple element k) for an instruction,
  through copies and conversions; None for anything else."""
  for _ in range(20):
    opcode, operands, rest = defs.get(name, ("", [], ""))
    if opcode == "constant":
      number = re.match(r"\s*(-?\d+)\)", rest)
      return ("constant", int(number.group(1))) if number else None
    if (opcode == "get-tuple-element" and operands
        and defs.get(operands[0], ("",))[0] == "parameter"):
      index = re.search(r"\bindex=(\d+)", rest)
      return ("element", int(index.group(1))) if index else None
    if opcode not in ("copy", "convert", "bitcast") or len(operands) != 1:
      return None
    name = operands[0]
  return None


def _root(defs: dict, lines: Sequence[str]) -> tuple[str, list[str], str]:
  root = next((line for line in lines if line.lstrip().startswith("ROOT")), "")
  match = INSTRUCTION.match(root)
  return defs.get(match.group(1) if match else "", ("", [], ""))


def _counter(condition: Sequence[str]) -> tuple[int, str, int] | None:
  """(loop-state element, direction, bound) of a condition `compare(element, constant)`, the
  direction as if the element stood on the left."""
  defs = _definitions(condition)
  opcode, operands, rest = _root(defs, condition)
  direction = re.search(r"direction=(\w+)", rest)
  if opcode != "compare" or len(operands) != 2 or not direction:
    return None
  sides = [_value(o, defs) for o in operands]
  direction = direction.group(1)
  if sides[1] and sides[1][0] == "element" and sides[0] and sides[0][0] == "constant":
    sides = sides[::-1]
    direction = {"LT": "GT", "GT": "LT", "LE": "GE", "GE": "LE"}.get(direction, direction)
  if not (sides[0] and sides[0][0] == "element" and sides[1] and sides[1][0] == "constant"):
    return None
  return sides[0][1], direction, sides[1][1]


def _step(body: Sequence[str], element: int) -> int | None:
  """The constant the body adds to loop-state `element` (negative when it subtracts)."""
  defs = _definitions(body)
  opcode, operands, _ = _root(defs, body)
  if opcode != "tuple" or element >= len(operands):
    return None
  name = operands[element]
  while defs.get(name, ("",))[0] == "copy":
    name = defs[name][1][0]
  opcode, operands, _ = defs.get(name, ("", [], ""))
  values = [_value(o, defs) for o in operands]
  steps = [v[1] for v in values if v and v[0] == "constant"]
  if (opcode not in ("add", "subtract") or ("element", element) not in values
      or len(steps) != 1 or (opcode == "subtract" and values[0] != ("element", element))):
    return None
  return steps[0] if opcode == "add" else -steps[0]


def loop_trips(line: str, condition: Sequence[str], body: Sequence[str],
               caller: Sequence[str]) -> int | None:
  """Trips of the while loop on `line` (an instruction of `caller`; the lines of each
  computation) whose condition compares one loop-state element with a constant (`i < N`)
  and whose body adds a constant to it, from the start the loop state gives it (a constant
  in `caller`, else 0). None when the loop is not of that form."""
  counter = _counter(condition)
  if counter is None:
    return None
  element, direction, limit = counter
  step = _step(body, element)
  if not step:
    return None
  start = 0
  loop_state = re.search(r"\bwhile\(%?([\w.\-]+)", line)
  if loop_state:
    defs = _definitions(caller)
    opcode, operands, _ = defs.get(loop_state.group(1), ("", [], ""))
    if opcode == "tuple" and element < len(operands):
      initial = _value(operands[element], defs)
      start = initial[1] if initial and initial[0] == "constant" else 0
  # Integer bounds: i <= N is i < N + 1, i >= N is i > N - 1.
  distance = {"LT": limit - start, "LE": limit + 1 - start, "GT": limit - start,
              "GE": limit - 1 - start, "NE": limit - start}.get(direction)
  if distance is None or (direction in ("LT", "LE") and step < 0) or (
      direction in ("GT", "GE") and step > 0) or (direction == "NE" and distance % step):
    return None
  return max(0, -(-distance // step))
