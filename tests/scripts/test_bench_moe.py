"""Smoke test: scripts/bench/bench_moe.py --quick runs end to end and its numbers hang together."""
import pytest

from tests.scripts.quick_bench import run_quick


@pytest.mark.slow
def test_quick_moe_benchmark_runs_and_reports(tmp_path):
  stdout, result = run_quick("bench_moe.py", tmp_path / "bench.json", timeout_s=600)
  assert "time vs dense" in stdout
  assert result["devices"] == 8 and set(result["results"]) == {"dense", "moe dropless",
                                                                "moe capacity"}
  assert result["results"]["dense"]["step_time_vs_dense"] == 1.0
  for row in result["results"].values():
    assert len(row["round_step_s"]) == result["rounds"] == 2
    assert row["tokens_per_second"] * row["median_step_s"] == pytest.approx(16 * 32)
