"""Smoke tests: scripts/bench/bench_attention.py and scripts/bench/bench_train.py run end to end and their
numbers hang together (the timings themselves are measurements, not checked here)."""
import json
import os
import subprocess
import sys

import pytest

from tests import preloaded
from tests.scripts.quick_bench import REPO


def _run(args, timeout_s):
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  proc = subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True,
                        text=True, timeout=timeout_s)
  assert proc.returncode == 0, proc.stderr[-3000:]
  return proc.stdout


def test_attention_benchmark_times_both_implementations(tmp_path):
  out = _run(["scripts/bench/bench_attention.py", "--lengths=128,256", "--rounds=1", "--repeats=1",
              "--heads=2", "--head_dim=16", f"--json={tmp_path / 'a.json'}"], 300)
  result = json.loads((tmp_path / "a.json").read_text())
  assert [row["length"] for row in result["rows"]] == [128, 256]
  for row in result["rows"]:
    assert set(row["ms"]) == {"xla", "blockwise"} and min(row["ms"].values()) > 0
    assert row["ratio"] == pytest.approx(row["ms"]["blockwise"] / row["ms"]["xla"])
    assert row["score_bytes"] == 4 * 1 * 2 * row["length"] ** 2
  assert out.count("blockwise/xla") == 2


def test_train_benchmark_refuses_a_folder_that_is_no_checkout(tmp_path):
  proc = subprocess.run([sys.executable, "scripts/bench/bench_train.py", f"--baseline={tmp_path}"],
                        cwd=REPO, capture_output=True, text=True, timeout=120)
  assert proc.returncode != 0 and "is not a meshkit checkout" in proc.stderr
  assert "Traceback" not in proc.stderr


def progress_rates() -> dict:
  """What scripts/bench/bench_train.py reads from the lines the training loop prints (tokens,
  images), and its two kinds of command line. Run in a process of its own (the script's absl
  flags would clash with another script's in the suite's)."""
  from scripts.bench import bench_train  # pylint: disable=g-import-not-at-top
  from toolkit.training import metrics  # pylint: disable=g-import-not-at-top
  scalars = {"loss": 1.0, "learning_rate": 1e-3, "grad_norm": 0.5, "data_wait_fraction": 0.01}
  lines = {unit: metrics.progress_line(20, 60, scalars, 0.25, 1000, 1e9, 1e12, unit=unit)
           for unit in bench_train.UNITS}
  return {"read": {unit: list(m.groups()) if (m := bench_train.RATE.match(line)) else line
                   for unit, line in lines.items()},
          "units": bench_train.UNITS,
          "benchmark": bench_train.command(60, 10, "w"),
          "demo": bench_train.command(60, 10, "w", "experiments/lm.py:cpu"),
          "placements": bench_train.command(60, 10, "w", "experiments/dlrm.py:cpu", (
              "sharding.param_overrides=", "sharding.activation_overrides="))}


def test_train_benchmark_reads_the_loops_progress_lines_and_builds_both_kinds_of_run():
  """The rate and its unit from the training loop's own progress lines, and the command lines:
  the benchmark model's overrides, or an experiment as it is."""
  got = preloaded.call("tests.scripts.test_bench_attention_and_train:progress_rates",
                       timeout=120)
  assert got["read"] == {"tok": ["4,000", "tok"], "img": ["4,000", "img"], "ex": ["4,000", "ex"]}
  assert got["units"] == {"tok": "tokens/s", "img": "images/s", "ex": "examples/s"}
  assert got["placements"][-2:] == ["--config.sharding.param_overrides=",
                                    "--config.sharding.activation_overrides="]
  assert "--config=experiments/lm.py" in got["benchmark"]
  assert "--config.model.vocab_size=32000" in got["benchmark"]
  assert "--config=experiments/lm.py:cpu" in got["demo"]
  assert "--config.train.steps=60" in got["demo"]
  assert not [a for a in got["demo"] if a.startswith(("--config.model.", "--config.data."))]


def test_train_benchmark_refuses_an_experiment_that_is_not_there(tmp_path):
  proc = subprocess.run([sys.executable, "scripts/bench/bench_train.py", f"--baseline={REPO}",
                         "--config=experiments/nope.py:cpu"], cwd=REPO, capture_output=True,
                        text=True, timeout=120)
  assert proc.returncode != 0 and "--config=experiments/nope.py:cpu: no experiment file" in proc.stderr
  assert "Traceback" not in proc.stderr


@pytest.mark.slow  # two runs of the tiny ViT, each a new interpreter: 14 s quiet
def test_train_benchmark_against_this_checkout(tmp_path):
  """This checkout as its own baseline with other settings (the tiny DLRM, examples/s, its
  tables replicated against row-wise): both sides run and are compared."""
  out = _run(["scripts/bench/bench_train.py", f"--baseline={REPO}", "--devices=2", "--rounds=1",
              "--config=experiments/dlrm.py:tiny", "--steps=6", "--log_every=2",
              "--baseline_overrides=sharding.param_overrides=,sharding.activation_overrides=",
              f"--json={tmp_path / 't.json'}"], 900)
  result = json.loads((tmp_path / "t.json").read_text())
  assert result["devices"] == 2 and len(result["rounds"]["this"]) == 1
  assert result["unit"] == "examples/s" and result["config"] == "experiments/dlrm.py:tiny"
  assert result["ratio"] == pytest.approx(result["medians"]["this"]
                                          / result["medians"]["baseline"])
  assert "experiments/dlrm.py:tiny, 2 device(s): this" in out
