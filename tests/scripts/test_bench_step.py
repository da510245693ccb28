"""Smoke test: scripts/bench_step.py --quick runs end to end and its numbers hang together."""
import pytest

from tests.scripts.quick_bench import run_quick


def test_quick_benchmark_runs_and_reports(tmp_path):
  stdout, result = run_quick("bench_step.py", tmp_path / "bench.json", timeout_s=300)
  assert "ratio toolkit/bare" in stdout
  assert result["devices"] == 8
  # The script itself asserts the agreement; check it really compared the same steps.
  losses = result["check_losses"]
  assert len(losses["bare"]) == len(losses["toolkit"]) == 3
  assert losses["toolkit"][2] != losses["toolkit"][0], "no nonzero update was checked"
  for name in ("toolkit", "bare"):
    row = result["results"][name]
    assert len(row["round_step_s"]) == result["rounds"] == 2
    assert row["median_step_s"] > 0
    assert row["tokens_per_second"] * row["median_step_s"] == pytest.approx(
        result["tokens_per_step"])
  assert result["ratio"] > 0

