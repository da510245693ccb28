"""docs/cost.md's ranked table is what its command prints: the ranking is analytic (no
training, no timing), so every line must match on every machine."""
from __future__ import annotations

import os
import pathlib
import re

import pytest

from tests import preloaded

REPO = pathlib.Path(__file__).resolve().parents[4]
TIMEOUT_S = 300  # ~15 s here: 256 stand-in devices, ~3,000 candidate layouts


def _documented() -> tuple[list[str], list[str]]:
  text = (REPO / "docs" / "cost.md").read_text()
  command = re.search(r"```\n(python -m toolkit\.cost --config=experiments/lm\.py:size=7b "
                      r"[^`]*?)\n```", text).group(1)
  table = re.search(r"```text\n(#   target.*?)\n```", text, re.S).group(1)
  args = command.replace("\\\n", " ").split()[3:]
  return args, table.splitlines()


@pytest.mark.slow
def test_the_documented_7b_ranking(tmp_path):
  args, table = _documented()
  (tmp_path / "experiments").symlink_to(REPO / "experiments")
  result = preloaded.run("toolkit.cost", args, cwd=tmp_path, env=dict(os.environ),
                         timeout=TIMEOUT_S)
  assert result.returncode == 0, result.stdout + result.stderr
  printed = result.stdout.splitlines()
  start = printed.index(table[0])
  assert printed[start:start + len(table)] == table
  assert (tmp_path / "cost.png").stat().st_size > 10_000
  assert (tmp_path / "cost.json").exists()
