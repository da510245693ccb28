"""Benchmark: time to the first training step, cold vs warm compilation cache.

  python scripts/bench/bench_cache.py                 # `make demo`'s command, 3 rounds
  python scripts/bench/bench_cache.py --rounds=1 --config=experiments/lm.py:tiny   # seconds

Each round runs the training command twice with a fresh workdir: first with an empty
compilation cache folder (cold: XLA compiles every program), then with the folder the first
run filled (warm: a restart whose checkpoint was removed and whose cache was kept). A run is
timed from its start to its first progress line (`step 1/...`, printed as soon as the first
step finishes) and then stopped. Reports both times per round, the median warm/cold ratio, and
the target (<= 0.3). Beside it, the same for the `compiled the step` line: start-up and
compiles only, without the step-0 eval and the first step, whose computing the cache cannot
shorten.
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

TARGET_RATIO = 0.3


def time_to_first_step(config: str, workdir: str, cache: str,
                       timeout_s: float) -> tuple[float, float]:
  """Seconds from starting `python -m toolkit.train` to its `compiled the step` line and to
  its `step 1/` line; stops the run."""
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
  started = time.perf_counter()
  process = subprocess.Popen(
      [sys.executable, "-m", "toolkit.train", f"--config={config}", f"--workdir={workdir}",
       f"--compilation_cache={cache}"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
      text=True, env=env)
  try:
    deadline, compiled = started + timeout_s, float("nan")
    while time.perf_counter() < deadline:
      line = process.stdout.readline()
      if not line:
        break
      if line.startswith("compiled the step"):
        compiled = time.perf_counter() - started
      if line.startswith("step 1/"):
        return compiled, time.perf_counter() - started
    raise RuntimeError(f"no first step within {timeout_s:.0f} s (exit {process.poll()})")
  finally:
    process.kill()
    process.wait()


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--config", default="experiments/lm.py:cpu")
  parser.add_argument("--rounds", type=int, default=3)
  parser.add_argument("--timeout_s", type=float, default=900.0)
  args = parser.parse_args()
  ratios, compile_ratios, colds, warms = [], [], [], []
  for round_index in range(args.rounds):
    root = tempfile.mkdtemp(prefix="bench_cache_")
    try:
      cache = os.path.join(root, "cache")
      cold_compiled, cold = time_to_first_step(args.config, os.path.join(root, "cold"), cache,
                                               args.timeout_s)
      warm_compiled, warm = time_to_first_step(args.config, os.path.join(root, "warm"), cache,
                                               args.timeout_s)
    finally:
      shutil.rmtree(root, ignore_errors=True)
    ratios.append(warm / cold)
    compile_ratios.append(warm_compiled / cold_compiled)
    colds.append(cold)
    warms.append(warm)
    print(f"round {round_index + 1}: first step cold {cold:.1f} s, warm {warm:.1f} s, warm/cold "
          f"{warm / cold:.2f} | compiled cold {cold_compiled:.1f} s, warm {warm_compiled:.1f} s, "
          f"warm/cold {warm_compiled / cold_compiled:.2f}", flush=True)
  median = statistics.median(ratios)
  print(f"median time to the first step: cold {statistics.median(colds):.1f} s, warm "
        f"{statistics.median(warms):.1f} s; median warm/cold {median:.2f} (target <= "
        f"{TARGET_RATIO}: {'met' if median <= TARGET_RATIO else 'missed'}); to the compiled step "
        f"{statistics.median(compile_ratios):.2f}")


if __name__ == "__main__":
  main()
