"""Runs a benchmark script's `--quick` mode on 8 simulated CPU devices, for the smoke tests."""
import json
import os
import pathlib
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[2]


def run_quick(script: str, json_path: pathlib.Path, timeout_s: float) -> tuple[str, dict]:
  """Runs `scripts/bench/<script> --quick --json=<json_path>`; returns (stdout, the JSON results).
  Fails the test with the script's stderr tail when it exits non-zero."""
  env = dict(os.environ)  # the suite's: 8 CPU devices, its cache (tests/conftest.py)
  proc = subprocess.run(
      [sys.executable, str(REPO / "scripts" / "bench" / script), "--quick", f"--json={json_path}"],
      cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout_s)
  assert proc.returncode == 0, proc.stderr[-3000:]
  return proc.stdout, json.loads(json_path.read_text())
