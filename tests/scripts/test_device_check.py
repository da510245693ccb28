"""scripts/dev/device_check.py's dry path on the suite's 8 CPU devices: every row is measured for
real at tiny shapes, cudnn says it is not on this platform, and the numbers hang together
(the timings themselves are this machine's, not checked). In the slow half: it compiles five
programs (16-40 s here)."""
import json
import math

import pytest

from scripts.dev import device_check

pytestmark = pytest.mark.slow

CHECKS = ["demo step", "1b-shaped step", "attention xla", "attention blockwise",
          "attention cudnn", "decode (engine)", "estimate"]


@pytest.fixture(scope="module")
def result():
  return device_check.run(dry_run=True)


def test_every_row_is_measured(result):
  rows = {row["check"]: row for row in result["rows"]}
  assert list(rows) == CHECKS, [row["result"] for row in result["rows"]]
  assert result["dry_run"] and result["platform"] == "cpu" and result["devices"] == 8
  for check in CHECKS:
    if check != "attention cudnn":
      assert rows[check]["status"] == "ok", rows[check]
      assert rows[check]["time_s"] > 0, rows[check]
  assert rows["attention cudnn"]["status"] == "not on this platform"
  assert rows["attention cudnn"]["time_s"] is None  # never a made-up number


def test_the_numbers_hang_together(result):
  rows = {row["check"]: row for row in result["rows"]}
  demo, big = rows["demo step"], rows["1b-shaped step"]
  assert demo["tokens_per_second"] * demo["time_s"] == pytest.approx(8 * 64)
  assert big["tokens_per_second"] * big["time_s"] == pytest.approx(8 * 64)
  assert "fsdp 4 x tensor 2" in demo["setup"] and "fsdp 8" in big["setup"]
  assert "bfloat16" in big["setup"] and "remat full" in big["setup"]
  assert 0 < big["mfu"] < 1 and big["peak_flops_per_device"] > 0
  for name in ("xla", "blockwise"):
    attention = rows[f"attention {name}"]
    assert attention["equal"], attention
    assert attention["max_abs_error"] <= device_check.ATTENTION_TOLERANCE
  decode = rows["decode (engine)"]
  assert decode["tokens_per_second"] * decode["time_s"] == pytest.approx(4)
  estimate = rows["estimate"]
  assert estimate["measured_s"] == big["time_s"]
  assert math.isfinite(estimate["ratio"]) and estimate["ratio"] > 0
  assert estimate["ratio"] == pytest.approx(big["time_s"] / estimate["estimate"]["total_s"])


def test_the_table_shows_every_row_and_writes_json(result, tmp_path):
  table = device_check.format_table(result)
  lines = table.splitlines()
  assert lines[0].startswith("device check: 8 x cpu (cpu)") and "dry run" in lines[0]
  assert [line.split("  ")[0] for line in lines[2:]] == CHECKS
  assert "not on this platform: cuDNN runs on NVIDIA GPUs" in table
  path = tmp_path / "table.json"
  path.write_text(json.dumps(result, default=str))
  assert [row["check"] for row in json.loads(path.read_text())["rows"]] == CHECKS


def test_a_failing_row_is_one_line_of_the_table_and_the_rest_still_run(monkeypatch):
  def broken(*args):
    raise RuntimeError("out of memory\nsecond line")
  monkeypatch.setattr(device_check, "big_row", broken)
  monkeypatch.setattr(device_check, "demo_row", lambda *args: device_check._row("demo step", ""))
  monkeypatch.setattr(device_check, "attention_rows", lambda sizes: [])
  monkeypatch.setattr(device_check, "decode_row", lambda *args: device_check._row("decode", ""))
  rows = {row["check"]: row for row in device_check.run(dry_run=True)["rows"]}
  assert rows["1b-shaped step"]["status"] == "failed"
  assert rows["1b-shaped step"]["result"] == "RuntimeError: out of memory"
  assert rows["estimate"]["status"] == "skipped"
  assert "decode" in rows
