"""Smoke test: scripts/bench_moe.py --quick runs end to end and its numbers hang together."""
import json
import os
import pathlib
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_quick_moe_benchmark_runs_and_reports(tmp_path):
  out = tmp_path / "bench.json"
  env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8",
         "JAX_PLATFORMS": "cpu"}
  proc = subprocess.run(
      [sys.executable, str(REPO / "scripts" / "bench_moe.py"), "--quick", f"--json={out}"],
      cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "time vs dense" in proc.stdout
  result = json.loads(out.read_text())
  assert result["devices"] == 8 and set(result["results"]) == {"dense", "moe dropless",
                                                                "moe capacity"}
  assert result["results"]["dense"]["step_time_vs_dense"] == 1.0
  for row in result["results"].values():
    assert len(row["round_step_s"]) == result["rounds"] == 2
    assert row["tokens_per_second"] * row["median_step_s"] == pytest.approx(16 * 32)
