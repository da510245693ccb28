"""The two tiers of proof, and the one rule that puts a test in the full tier.

- presubmit: `bash .ci/run`, on every landing. `make test`, then `make test-slow` (the slow
  tests that are not full-tier) beside the newest-deps job. Budget: 35 minutes, `make test` 10.
- full: `make test-full`, before an issue whose change touches a documented result's or
  command's code path ends. Every test. Its summary line goes in the closing note.

THE RULE. A test is full-tier (`@pytest.mark.full(CLAUSE, by=...)`) when, and only when, a
presubmit test already runs its code path, so that what only the full tier checks is a repeat
on other numbers:
- SEEDS: a documented result on its seeds after the first, with the checks across seeds (a
  mean). The result's seed-0 test, at the same floor, is presubmit; `by` names it.
- COMPILE: a TPU compile (a `tpu_aot` test or a documented `toolkit.compile`, `toolkit.cost` or
  `decode_cost.py` command) of a program whose code path another presubmit compile covers:
  the step, decode, LoRA, the mixture of experts, the pipeline each keep one presubmit
  compile; `by` names the one that covers it.
- COMMAND: a documented command run as pasted whose code path a presubmit test runs; `by` names
  that test.
Nothing else moves to the full tier. `tests/conftest.py` applies `check` at every collection,
so a full mark without its clause, or naming a test that does not exist or is full itself, is
one error before any test runs.
"""
from __future__ import annotations

import dataclasses
import pathlib
import re

import pytest

SEEDS, COMPILE, COMMAND = "seeds", "compile", "command"
CLAUSES = (SEEDS, COMPILE, COMMAND)
MARKER = "full"
COLLECTED = pytest.StashKey[list]()  # every test collected, before -m deselects (conftest)
REPO = pathlib.Path(__file__).resolve().parents[1]


def full(clause: str, by: str):
  """The full-tier mark: `clause` of the rule, `by` the presubmit test (a node id, its
  parameters optional) that runs the code path."""
  return pytest.mark.full(clause, by=by)


@dataclasses.dataclass(frozen=True)
class Problem:
  test: str
  why: str

  def __str__(self) -> str:
    return f"{self.test}: {self.why}"


def _test_exists(by: str) -> bool:
  """Whether the node id `by` (path::function[params]) names a test function in the tree."""
  path, _, name = by.partition("::")
  function = name.partition("[")[0]
  file = REPO / path
  return bool(function) and file.is_file() and re.search(
      rf"^def {re.escape(function)}\(", file.read_text(), re.M) is not None


def check(items) -> list[Problem]:
  """Every full-tier test among `items` (pytest items) against the rule; the problems."""
  problems = []
  ids = {item.nodeid: item for item in items}
  for item in items:
    marks = list(item.iter_markers(MARKER))
    if not marks:
      continue
    mark = marks[0]
    clause, by = (mark.args[0] if mark.args else None), mark.kwargs.get("by")
    if clause not in CLAUSES:
      problems.append(Problem(item.nodeid, f"full({clause!r}): the clause must be one of "
                                           f"{', '.join(CLAUSES)} (tests/tiers.py)"))
      continue
    if not by or not _test_exists(by):
      problems.append(Problem(item.nodeid, f"full({clause!r}, by={by!r}): `by` must name the "
                                           "presubmit test that runs its code path"))
      continue
    covering = [ids[i] for i in ids if i == by or i.startswith(by + "[")]
    if any(other.get_closest_marker(MARKER) for other in covering):
      problems.append(Problem(item.nodeid, f"by={by!r} is full-tier itself: a presubmit test "
                                           "must run the code path"))
    if clause == SEEDS and "seed" not in item.name:
      problems.append(Problem(item.nodeid, "a SEEDS test names its seeds"))
  return problems


def is_full(item) -> bool:
  return item.get_closest_marker(MARKER) is not None
