"""Smoke test: scripts/bench/bench_step.py --quick runs end to end and its numbers hang together."""
import pytest

from tests.scripts.quick_bench import run_quick


@pytest.mark.slow  # a benchmark, even --quick: 11 s
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



class _Device:
  def __init__(self, platform):
    self.platform = platform


def test_peak_fraction_is_per_device_flops_over_one_devices_peak():
  """A step of 8e12 FLOPs in 1 s on 8 devices: 1e12 FLOP/s per device. A TPU whose matmul
  measured 2e12 FLOP/s: 50 %. Eight simulated CPU devices whose shared-core matmul measured
  16e12 FLOP/s for the whole host: 2e12 each, 50 % again (not 8 x too high or too low)."""
  from scripts.bench import timing  # pylint: disable=g-import-not-at-top
  tpus, cpus = [_Device("tpu")] * 8, [_Device("cpu")] * 8
  assert timing.peak_fraction(8e12, 1.0, 2e12, tpus) == pytest.approx(0.5)
  assert timing.peak_fraction(8e12, 1.0, 16e12, cpus) == pytest.approx(0.5)
  assert timing.per_device_peak(16e12, cpus) == 2e12
