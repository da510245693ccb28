"""Smoke tests: scripts/bench_attention.py and scripts/bench_train.py run end to end and their
numbers hang together (the timings themselves are measurements, not checked here)."""
import json
import os
import subprocess
import sys

import pytest

from tests.scripts.quick_bench import REPO


def _run(args, timeout_s):
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  proc = subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True,
                        text=True, timeout=timeout_s)
  assert proc.returncode == 0, proc.stderr[-3000:]
  return proc.stdout


def test_attention_benchmark_times_both_implementations(tmp_path):
  out = _run(["scripts/bench_attention.py", "--lengths=128,256", "--rounds=1", "--repeats=1",
              "--heads=2", "--head_dim=16", f"--json={tmp_path / 'a.json'}"], 300)
  result = json.loads((tmp_path / "a.json").read_text())
  assert [row["length"] for row in result["rows"]] == [128, 256]
  for row in result["rows"]:
    assert set(row["ms"]) == {"xla", "blockwise"} and min(row["ms"].values()) > 0
    assert row["ratio"] == pytest.approx(row["ms"]["blockwise"] / row["ms"]["xla"])
    assert row["score_bytes"] == 4 * 1 * 2 * row["length"] ** 2
  assert out.count("blockwise/xla") == 2


def test_train_benchmark_refuses_a_folder_that_is_no_checkout(tmp_path):
  proc = subprocess.run([sys.executable, "scripts/bench_train.py", f"--baseline={tmp_path}"],
                        cwd=REPO, capture_output=True, text=True, timeout=120)
  assert proc.returncode != 0 and "is not a meshkit checkout" in proc.stderr
  assert "Traceback" not in proc.stderr


@pytest.mark.slow
def test_train_benchmark_against_this_checkout(tmp_path):
  """This checkout as its own baseline: both sides run and are compared."""
  out = _run(["scripts/bench_train.py", f"--baseline={REPO}", "--devices=2", "--rounds=1",
              "--steps=6", "--log_every=2", f"--json={tmp_path / 't.json'}"], 900)
  result = json.loads((tmp_path / "t.json").read_text())
  assert result["devices"] == 2 and len(result["rounds"]["this"]) == 1
  assert result["ratio"] == pytest.approx(result["medians"]["this"]
                                          / result["medians"]["baseline"])
  assert "2 device(s): this" in out
