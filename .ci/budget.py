"""One line for a tier of proof: its wall time against its budget (docs/testing.md). Over the
budget, a warning line names the five slowest tests of the pytest logs given (their
--durations lists), so creep shows on the landing that caused it.

  python .ci/budget.py NAME SECONDS BUDGET_SECONDS [PYTEST_LOG ...]
"""
from __future__ import annotations

import re
import sys

# pytest's --durations lines: "12.34s call     tests/x.py::test_y[param]"
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)s\s+(call|setup|teardown)\s+(\S+)", re.M)


def slowest(texts: list[str], count: int = 5) -> list[tuple[float, str]]:
  """The `count` longest (seconds, "test (phase)") of the --durations lists in `texts`."""
  found = [(float(m.group(1)), f"{m.group(3)} ({m.group(2)})")
           for text in texts for m in _DURATION.finditer(text)]
  return sorted(found, reverse=True)[:count]


def report(name: str, seconds: float, budget: float, texts: list[str]) -> list[str]:
  lines = [f"{name}: {seconds:.0f} s ({seconds / 60:.1f} min) of its {budget:.0f} s "
           f"({budget / 60:.0f} min) budget"]
  if seconds > budget:
    top = "; ".join(f"{test} {s:.0f} s" for s, test in slowest(texts))
    lines.append(f"warning: {name} is {seconds - budget:.0f} s over its budget; its five "
                 f"slowest tests: {top or 'none listed'}")
  return lines


def main(argv: list[str]) -> int:
  if len(argv) < 3:
    print(__doc__.strip().splitlines()[-1].strip(), file=sys.stderr)
    return 2
  name, seconds, budget, *logs = argv
  texts = []
  for log in logs:
    with open(log, encoding="utf-8", errors="replace") as f:
      texts.append(f.read())
  print("\n".join(report(name, float(seconds), float(budget), texts)))
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
