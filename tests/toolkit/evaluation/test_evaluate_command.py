"""`python -m toolkit.evaluate` mistakes, each one `error:` line (exit 1, no traceback): a
checkpoint without a tokenizer, a task file that is not there, a task whose data needs the
Hub (unreachable here), a task name the harness does not know; and lm-eval missing."""
from __future__ import annotations

import os
import sys

import pytest

from tests import extras, preloaded
from tests.toolkit.test_cli import side_by_side, the_error_line
from toolkit.errors import ConfigError
from toolkit.evaluation import harness

extras.require("lm_eval")
TASKS = os.path.join(os.path.dirname(__file__), "..", "..", "..", "experiments", "eval_tasks")
CHOICE = os.path.abspath(os.path.join(TASKS, "arithmetic_choice.yaml"))
TIMEOUT_S = 300
# A local task whose data lives on the Hub (as hellaswag's does).
REMOTE_TASK = """task: remote_example
dataset_path: meshkit-tests/not-downloadable
test_split: test
output_type: multiple_choice
doc_to_text: "{{question}}"
doc_to_choice: "{{choices}}"
doc_to_target: "{{answer}}"
"""


def evaluate(*args: str, offline: bool = True):
  env = {k: v for k, v in os.environ.items() if k not in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE")}
  if offline:
    env.update(HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1")
  else:  # a Hub that takes no connection (nothing listens on the discard port)
    env["HF_ENDPOINT"] = "http://127.0.0.1:9"
  return preloaded.run("toolkit.evaluate", args, env=env, timeout=TIMEOUT_S, fresh=not offline)


def test_mistakes_are_one_error_line(tmp_path):
  (tmp_path / "remote.yaml").write_text(REMOTE_TASK)
  checkpoint = f"--checkpoint={tmp_path / 'run'}"  # each mistake is found before it is read
  cases = {
      "no tokenizer": (["--config=experiments/lm.py:tiny,data=synthetic", checkpoint,
                        f"--tasks={CHOICE}"], ["data.source='synthetic'", "--tokenizer="]),
      "missing file": (["--config=experiments/lm.py:tiny", checkpoint,
                        f"--tasks={tmp_path / 'missing.yaml'}"], ["missing.yaml", "not a file"]),
      "hub data": (["--config=experiments/lm.py:tiny", checkpoint,
                    f"--tasks={tmp_path / 'remote.yaml'}"],
                   ["'remote_example'", "Hugging Face Hub", "cannot be reached", "local task"]),
  }
  results = side_by_side(lambda name: (name, evaluate(*cases[name][0])), cases)
  for name, (_, fragments) in cases.items():
    line = the_error_line(results[name])
    print(line)  # shown with -rA: the lines users see
    assert results[name].returncode == 1, line
    for fragment in fragments:
      assert fragment in line, (name, line)


@pytest.mark.slow  # 8 s quiet, more under load: the harness's index of its ~15,000 task
# files, built in two processes (the default suite's checks of one-line errors are above)
def test_unknown_names_and_hub_tasks_are_one_error_line(tmp_path):
  checkpoint = f"--checkpoint={tmp_path / 'run'}"
  cases = {"typo": (["--tasks=hellaswagg"], ["'hellaswagg'", "did you mean", "hellaswag"]),
           "hub": (["--tasks=hellaswag"], ["'hellaswag'", "Hugging Face Hub", "local task"])}
  results = side_by_side(lambda name: (name, evaluate(
      "--config=experiments/lm.py:tiny", checkpoint, *cases[name][0])), cases)
  for name, (_, fragments) in cases.items():
    line = the_error_line(results[name])
    print(line)  # shown with -rA: the lines users see
    for fragment in fragments:
      assert fragment in line, (name, line)


def test_without_lm_eval_the_error_says_how_to_install_it(monkeypatch):
  monkeypatch.setitem(sys.modules, "lm_eval", None)  # `import lm_eval` raises ImportError
  with pytest.raises(ConfigError, match=r"pip install -e '\.\[eval\]'"):
    harness.require()


def test_a_hub_task_without_the_hub_fails_fast_in_one_line(tmp_path):
  """Not set offline, a task whose data is on an unreachable Hub printed 22 retry warnings
  over ~30 s before its line: the Hub's endpoint is probed once (5 s at most), and the
  libraries go offline when it takes no connection."""
  (tmp_path / "remote.yaml").write_text(REMOTE_TASK)
  result = evaluate("--config=experiments/lm.py:tiny", f"--checkpoint={tmp_path / 'run'}",
                    f"--tasks={tmp_path / 'remote.yaml'}", offline=False)
  line = the_error_line(result)  # nothing else on stderr: no retry warnings
  assert "task 'remote_example' needs its data from the Hugging Face Hub" in line, line
  assert "http://127.0.0.1:9 took no connection within 5 s" in line, line
