"""The two-process scheduler of tests/conftest.py: the documented results' runs that share a
module fixture are named in one group, so the fixture's run (the demo: minutes) happens once."""

from __future__ import annotations

import ast
import pathlib

from tests import conftest

REPO = pathlib.Path(__file__).resolve().parent.parent


def _needs() -> dict[str, set[str]]:
  """Each function of the documented results' module: the module fixtures it needs, directly
  or through other fixtures."""
  tree = ast.parse((REPO / conftest.RUNS_APART).read_text())
  args = {node.name: {a.arg for a in node.args.args} for node in tree.body
          if isinstance(node, ast.FunctionDef)}
  shared = {node.name for node in tree.body if isinstance(node, ast.FunctionDef)
            and any("scope" in ast.unparse(d) and "module" in ast.unparse(d)
                    for d in node.decorator_list)}

  def closure(name: str, seen: frozenset = frozenset()) -> set[str]:
    found = set()
    for arg in args.get(name, ()):
      if arg in shared and arg not in seen:
        found |= {arg} | closure(arg, seen | {arg})
    return found

  return {name: closure(name) for name in args if name.startswith("test_")}


def test_runs_that_share_a_module_fixture_are_one_group():
  needs = _needs()
  assert set(conftest.SHARED_RUNS) <= set(needs), "SHARED_RUNS names a test that is gone"
  sharing = {name for name, fixtures in needs.items() if fixtures}
  assert sharing, "the pattern finds no test with a module fixture: it cannot fail"
  for name in sharing:
    assert name in conftest.SHARED_RUNS, (
        f"{name} needs {sorted(needs[name])}: add it to tests/conftest.py SHARED_RUNS")
  for fixture in set().union(*needs.values()):
    groups = {conftest.SHARED_RUNS[name] for name in sharing if fixture in needs[name]}
    assert len(groups) == 1, f"the tests needing {fixture} are in groups {groups}"
