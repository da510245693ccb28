"""Simulate a pod on one machine: N processes x M CPU devices, one job, one global mesh.

  python scripts/launch/local_pod.py --processes=2 --devices_per_process=4 -- \\
      --config=experiments/lm.py:tiny --workdir=/tmp/pod

Everything after `--` goes to `python -m toolkit.train` in every process, next to
--coordinator_address=127.0.0.1:<free port>, --num_processes and --process_id: the command a
worker of a real TPU pod or GPU cluster runs. Output lines carry `[p0]`, `[p1]`, ...; lines
from the launcher itself carry `[pod]`. Ctrl-C or SIGTERM stops every process after the same
step with a checkpoint (a second one kills them). Exit status: 0 if every process succeeded,
else the first failure's (128 + N for signal N); when one fails the others get --grace_s
seconds to stop on their own, then are terminated.
"""
from __future__ import annotations

import argparse
import sys


from toolkit.pod import local as pod


def main(argv: list[str]) -> int:
  parser = argparse.ArgumentParser(
      description=__doc__.split("\n\n")[0],
      usage="%(prog)s [--processes=N] [--devices_per_process=M] -- TRAIN_FLAGS...")
  parser.add_argument("--processes", type=int, default=2, help="processes to start (default 2)")
  parser.add_argument("--devices_per_process", type=int, default=4,
                      help="simulated CPU devices per process (default 4)")
  parser.add_argument("--grace_s", type=float, default=30.0,
                      help="after one process fails, seconds the others get to stop on their "
                           "own before they are terminated (default 30)")
  split = argv.index("--") if "--" in argv else len(argv)
  ours, train_args = argv[:split], argv[split + 1:]
  args = parser.parse_args(ours)
  if args.processes < 1 or args.devices_per_process < 1:
    parser.error("--processes and --devices_per_process must be >= 1")
  if not train_args:
    parser.error("give the training flags after --, e.g. -- --config=experiments/lm.py:tiny "
                 "--workdir=/tmp/pod")
  return pod.run(args.processes, args.devices_per_process, train_args, grace_s=args.grace_s)


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
