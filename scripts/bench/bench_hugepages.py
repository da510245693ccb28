"""Benchmark: CPU training with and without glibc's transparent huge pages (the Makefile's
GLIBC_TUNABLES=glibc.malloc.hugetlb=1).

  python scripts/bench/bench_hugepages.py             # `make demo`'s run for 100 steps, 3 rounds
  python scripts/bench/bench_hugepages.py --quick     # the tiny LM, 10 steps, 1 round: seconds

XLA:CPU maps a fresh buffer for a step's temporaries at every step, and the kernel then faults
it in 4 KiB at a time, zeroing each page: on 2 cores about a third of the CPU LM's CPU time was
the kernel's. With `glibc.malloc.hugetlb=1` malloc asks for transparent huge pages (2 MiB) on
the memory it maps, where the kernel's THP mode is `madvise` (most distributions'; see
/sys/kernel/mm/transparent_hugepage/enabled). Each round runs the training command twice in new
processes, without the setting and with it, each with an empty compilation cache and workdir;
the run's own accounting (its `goodput` line) gives the seconds spent in steps. Reports each
round, the medians and the median ratio with/without of the steps' seconds and of the whole run's,
and fails unless both runs end with the same held-out loss, to the bit.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

SETTING = "glibc.malloc.hugetlb=1"


def train(config: str, steps: int, folder: str, hugepages: bool,
          timeout_s: float) -> tuple[float, float, float]:
  """(wall seconds, seconds in steps, final held-out loss) of one run in a new process."""
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
  tunables = [t for t in env.get("GLIBC_TUNABLES", "").split(":")
              if t and not t.startswith("glibc.malloc.hugetlb")]
  env["GLIBC_TUNABLES"] = ":".join(tunables + ([SETTING] if hugepages else []))
  env["MESHKIT_HUGE_PAGES"] = "1" if hugepages else "0"  # else the command adds it itself
  workdir = os.path.join(folder, "run")
  started = time.perf_counter()
  command = [sys.executable, "-m", "toolkit.train", f"--config={config}", f"--workdir={workdir}",
             f"--compilation_cache={os.path.join(folder, 'cache')}",
             f"--config.train.steps={steps}", f"--config.train.eval_every={steps}",
             f"--config.train.checkpoint_every={steps}", "--config.train.sample_tokens=0"]
  try:
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout_s,
                            check=False)
  except subprocess.TimeoutExpired:
    raise SystemExit(f"error: the training run did not end within --timeout_s={timeout_s:.0f} "
                     f"s; give it more") from None
  wall = time.perf_counter() - started
  if result.returncode != 0:
    raise SystemExit(f"error: the training run exited {result.returncode}:\n"
                     f"{result.stderr[-2000:]}")
  found = re.search(r"goodput .* steps ([\d.]+) s", result.stdout)
  if not found:
    raise SystemExit(f"error: no goodput line in the run's output:\n{result.stdout[-2000:]}")
  with open(os.path.join(workdir, "metrics.jsonl"), encoding="utf-8") as f:
    evals = [r for r in map(json.loads, f) if r["kind"] == "eval" and r["step"] == steps]
  return wall, float(found.group(1)), evals[-1]["loss"]


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--config", default=None, help="default: experiments/lm.py:cpu, "
                      "with --quick experiments/lm.py:tiny")
  parser.add_argument("--steps", type=int, default=100)
  parser.add_argument("--rounds", type=int, default=3)
  parser.add_argument("--quick", action="store_true", help="the tiny LM, 10 steps, 1 round")
  parser.add_argument("--timeout_s", type=float, default=900.0)
  args = parser.parse_args()
  if args.quick:
    args.steps, args.rounds = 10, 1
  if args.config is None:
    args.config = "experiments/lm.py:" + ("tiny" if args.quick else "cpu")
  if args.steps < 1 or args.rounds < 1:
    parser.error("--steps and --rounds must be at least 1")
  rows = []
  print(f"{args.config}, {args.steps} steps a run; huge pages: {SETTING} in GLIBC_TUNABLES")
  print("round | without: wall s, steps s | with: wall s, steps s | same final loss")
  for i in range(args.rounds):
    runs = {}
    for hugepages in (False, True):
      with tempfile.TemporaryDirectory(prefix="bench-hugepages-") as folder:
        runs[hugepages] = train(args.config, args.steps, folder, hugepages, args.timeout_s)
    (wall0, steps0, loss0), (wall1, steps1, loss1) = runs[False], runs[True]
    rows.append(runs)
    print(f"{i + 1:5d} | {wall0:8.1f} {steps0:8.1f} | {wall1:8.1f} {steps1:8.1f} | "
          f"{loss0 == loss1} ({loss0!r})", flush=True)
    if loss0 != loss1:
      raise SystemExit(f"error: the final held-out losses differ: {loss0!r} without huge "
                       f"pages, {loss1!r} with them")
  median = lambda f: statistics.median(f(r) for r in rows)
  steps = [median(lambda r, h=h: r[h][1]) for h in (False, True)]
  walls = [median(lambda r, h=h: r[h][0]) for h in (False, True)]
  print(f"median: steps {steps[0]:.1f} s -> {steps[1]:.1f} s "
        f"(ratio {median(lambda r: r[True][1] / r[False][1]):.2f}), whole run "
        f"{walls[0]:.1f} s -> {walls[1]:.1f} s "
        f"(ratio {median(lambda r: r[True][0] / r[False][0]):.2f})")


if __name__ == "__main__":
  main()
