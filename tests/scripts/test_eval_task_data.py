"""The example local evaluation tasks' data (experiments/eval_tasks/*.jsonl) is
scripts/data/eval_task_data.py's output, and each multiple-choice question has its right answer
once among four distinct choices."""
from __future__ import annotations

import json
import pathlib

from scripts.data import eval_task_data

TASKS = pathlib.Path(__file__).resolve().parents[2] / "experiments" / "eval_tasks"


def test_the_files_are_the_scripts_output():
  files = eval_task_data.files()
  assert sorted(files) == sorted(p.name for p in TASKS.glob("*.jsonl"))
  for name, text in files.items():
    assert (TASKS / name).read_text(encoding="utf-8") == text, name
  for line in files["arithmetic_choice.jsonl"].splitlines():
    example = json.loads(line)
    a, op, b = example["question"].split()
    value = int(a) + int(b) if op == "+" else int(a) - int(b)
    assert len(set(example["choices"])) == 4
    assert example["choices"][example["answer"]] == str(value)
