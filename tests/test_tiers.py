"""The tier rule (tests/tiers.py): every full-tier test fits one of its clauses and names the
presubmit test that runs its code path; a mark that does not is refused."""
from __future__ import annotations

import dataclasses
import re
import subprocess
import sys

import pytest

from tests import tiers

_SEED_0 = "tests/test_documented_results.py::test_dpo_prefers_the_right_word_on_three_seeds"
_STEP = "tests/toolkit/planning/test_compile.py::test_cpu_lm_compiles_and_fits_on_small_slices"


@dataclasses.dataclass
class _Item:
  """What tiers.check reads of a pytest item."""
  nodeid: str
  marks: tuple = ()

  @property
  def name(self) -> str:
    return self.nodeid.partition("::")[2]

  def iter_markers(self, name):
    return (m for m in self.marks if m.name == name)

  def get_closest_marker(self, name):
    return next(self.iter_markers(name), None)


def _full(*args, **kwargs):
  return pytest.mark.full(*args, **kwargs).mark


def _problems(*items):
  return [problem.why for problem in tiers.check(items)]


def test_a_full_mark_with_a_clause_and_a_presubmit_test_passes():
  assert not _problems(
      _Item(f"{_SEED_0}[seed_0]"),
      _Item(f"{_SEED_0}[seeds_1_2]", (_full(tiers.SEEDS, by=f"{_SEED_0}[seed_0]"),)),
      _Item(f"{_STEP}[v5p-8]"),
      _Item("tests/x.py::test_big_compile", (_full(tiers.COMPILE, by=_STEP),)))


@pytest.mark.parametrize("mark, fragment", [
    (_full(by=_STEP), "the clause must be one of seeds, compile, command"),
    (_full("slow", by=_STEP), "the clause must be one of"),
    (_full(tiers.COMPILE), "`by` must name the presubmit test"),
    (_full(tiers.COMPILE, by="tests/toolkit/planning/test_compile.py::test_no_such_test"),
     "`by` must name the presubmit test"),
    (_full(tiers.COMPILE, by="tests/no_such_file.py::test_x"), "`by` must name"),
])
def test_a_mark_outside_the_rule_is_refused(mark, fragment):
  problems = _problems(_Item("tests/x.py::test_y", (mark,)))
  assert len(problems) == 1 and fragment in problems[0], problems


def test_a_full_test_cannot_be_covered_by_another_full_test():
  covering = _Item(f"{_STEP}[v5p-8]", (_full(tiers.COMPILE, by=_STEP),))
  problems = _problems(covering, _Item("tests/x.py::test_y", (_full(tiers.COMPILE, by=_STEP),)))
  assert any("is full-tier itself" in p for p in problems), problems


def test_a_seeds_test_names_its_seeds():
  problems = _problems(_Item("tests/x.py::test_other_numbers",
                             (_full(tiers.SEEDS, by=f"{_SEED_0}[seed_0]"),)))
  assert problems == ["a SEEDS test names its seeds"]


def test_the_suite_holds_the_rule(request):
  """Every test this session collected, before -m deselected any (tests/conftest.py keeps
  them): the rule holds (collection would have stopped otherwise), and each clause is in use."""
  items = request.config.stash[tiers.COLLECTED]
  assert not tiers.check(items)
  if len(items) < 1000:
    pytest.skip(f"{len(items)} tests collected: the whole suite's collection checks its tiers")
  clauses = {item.get_closest_marker(tiers.MARKER).args[0] for item in items if tiers.is_full(item)}
  assert clauses == set(tiers.CLAUSES), clauses
  # No test the default suite runs is full-tier, and every full-tier test names a real test.
  for item in items:
    if tiers.is_full(item):
      by = item.get_closest_marker(tiers.MARKER).kwargs["by"]
      assert any(i.nodeid == by or i.nodeid.startswith(by + "[") for i in items), (item, by)
      assert re.fullmatch(r"tests/[\w/]+\.py::test_\w+(\[.+\])?", by), by


def _budget(*args) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, str(tiers.REPO / ".ci" / "budget.py"), *map(str, args)],
                        capture_output=True, text=True, timeout=60, check=False)


def test_a_tier_within_its_budget_is_one_line(tmp_path):
  done = _budget("make test", 532, 600)
  assert (done.returncode, done.stdout) == (
      0, "make test: 532 s (8.9 min) of its 600 s (10 min) budget\n"), done.stderr


def test_a_tier_over_its_budget_names_its_five_slowest_tests(tmp_path):
  logs = [tmp_path / "test.log", tmp_path / "slow.log"]
  logs[0].write_text("== slowest 15 durations ==\n12.50s call     tests/a.py::test_a\n"
                     "3.00s setup    tests/b.py::test_b[x]\n1.00s call     tests/c.py::test_c\n")
  logs[1].write_text("99.00s call     tests/d.py::test_d\n7.25s teardown tests/e.py::test_e\n"
                     "2.00s call     tests/f.py::test_f\n0.50s call     tests/g.py::test_g\n")
  done = _budget("presubmit (.ci/run)", 2200, 2100, *logs)
  lines = done.stdout.splitlines()
  assert done.returncode == 0 and len(lines) == 2, done.stdout + done.stderr
  assert lines[0] == "presubmit (.ci/run): 2200 s (36.7 min) of its 2100 s (35 min) budget"
  assert lines[1] == ("warning: presubmit (.ci/run) is 100 s over its budget; its five slowest "
                      "tests: tests/d.py::test_d (call) 99 s; tests/a.py::test_a (call) 12 s; "
                      "tests/e.py::test_e (teardown) 7 s; tests/b.py::test_b[x] (setup) 3 s; "
                      "tests/f.py::test_f (call) 2 s")


def test_the_budgets_are_the_documented_ones():
  """.ci/run's budgets are docs/testing.md's table's: 10 minutes for make test, 35 in all."""
  run = (tiers.REPO / ".ci" / "run").read_text()
  assert "MAKE_TEST_BUDGET_S=600 PRESUBMIT_BUDGET_S=2100" in run
  page = " ".join((tiers.REPO / "docs" / "testing.md").read_text().split())
  assert "| presubmit | `bash .ci/run`" in page and "35 min" in page and "10 min" in page
