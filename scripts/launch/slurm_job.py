"""A SLURM batch script that runs `python -m toolkit.train` on GPU nodes, and its submission.

  python scripts/launch/slurm_job.py --nodes=2 --gpus-per-node=8 --time=04:00:00 \\
      --config=experiments/lm.py:size=1b --workdir=/shared/runs/lm -- --config.train.steps=1000
  python scripts/launch/slurm_job.py --nodes=2 --gpus-per-node=8 --time=04:00:00 \\
      --config=experiments/lm.py:size=1b --workdir=/shared/runs/lm --dry-run > lm.sbatch
  python scripts/launch/slurm_job.py --nodes=4 --gpus-per-node=8 --partition=h100 --nccl-debug=WARN \\
      --env=NCCL_SOCKET_IFNAME=ib0 --config=experiments/lm.py:size=1b \\
      --workdir=/shared/runs/lm --dry-run -- --config.mesh.dcn=data:4

Without --dry-run the script goes to `sbatch` on stdin. The body is one `srun` of the same
toolkit.train command in every task; `jax.distributed.initialize()` with no arguments finds
the cluster from SLURM's variables (SLURM_PROCID, SLURM_NTASKS, SLURM_STEP_NODELIST; the
coordinator is the first node, on a port derived from the job id), so nothing here assigns
ranks.

Tasks: one per GPU by default (`--ntasks-per-node` = GPUs per node). JAX then gives each
process the GPU numbered SLURM_LOCALID, so every task must see all of its node's GPUs: the
script asks for `--gpus-per-node`, never `--gpus-per-task` or a GPU binding, which would
leave each task one GPU numbered 0. With --per-node, one task per node drives all its GPUs:
JAX's SLURM detection would still limit each process to GPU SLURM_LOCALID (= 0), so the
script sets JAX_LOCAL_DEVICE_IDS to all of them. `srun --kill-on-bad-exit=1` stops every
task when one fails, instead of leaving the others blocked in a collective.

Restarts, as `toolkit.supervise` does them on one machine (docs/pods.md): when the srun fails
the script runs it again in the same allocation after --restart-delay-s, up to
--max-restarts times (default 3), and the training command resumes from its newest
checkpoint; exit 0 (finished, or stopped by SIGTERM at the time limit after saving), 130
(Ctrl-C twice) and 2 (a command-line mistake) end it. A node that fails ends the allocation:
`#SBATCH --requeue` lets SLURM queue the job again on other nodes (where the cluster allows
requeues), which resumes the same way; `--open-mode=append` keeps the log of every run.

Environment of every task (docs/gpu.md), before the `--env` settings, which win:
- JAX_PLATFORMS=cuda,cpu: the GPUs, or one error line from the command on a node that lacks
  JAX's CUDA plugin, where JAX alone would skip `cuda` and train on the CPU
  (toolkit/command_line.py's check_platform).
- XLA_CLIENT_MEM_FRACTION=0.9 (--mem-fraction): the share of each GPU's memory JAX reserves
  at start-up. JAX's default, 0.75, keeps a quarter of it from the training step; 0.9 still
  leaves room for what CUDA, cuBLAS and NCCL allocate themselves. The script unsets the older
  name XLA_PYTHON_CLIENT_MEM_FRACTION, which sbatch would pass on from the submitting shell:
  with both set, JAX's CUDA plugin fails to load (a ValueError in jaxlib's
  generate_pjrt_gpu_plugin_options) and JAX falls back to the CPU. An --env of either name
  replaces both lines.
- NCCL_DEBUG only with --nccl-debug (WARN: a line for each failed NCCL call; INFO: also the
  rings, trees and network NCCL chose, to check it found InfiniBand). The cluster's network
  settings (NCCL_SOCKET_IFNAME, NCCL_IB_HCA, ...) come from its admins, through --env.
- XLA_FLAGS from GPU_XLA_FLAGS below, when it holds any (none yet).

--workdir is a gs://bucket/path URL or one directory every node can write (a shared file system). A bad
flag prints one `error:` line and exits 2; a failed sbatch exits 1.
"""
from __future__ import annotations

import argparse
import pathlib
import re
import shlex
import shutil
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[2]
from toolkit import workdir

USAGE_EXIT = 2
# Exit statuses of toolkit.train that end the job: finished or stopped after saving (0), a
# command-line mistake (2), Ctrl-C twice (130). Any other is restarted.
FINAL_STATUSES = {0: "finished, or stopped after saving", 2: "a command-line mistake",
                  130: "Ctrl-C twice"}
DEFAULT_MEM_FRACTION = 0.9
# The XLA flags every GPU task gets (exported as XLA_FLAGS; --env=XLA_FLAGS=... replaces them).
# Empty on purpose: the collective-overlap presets (latency-hiding scheduler, pipelined
# collectives, combine thresholds) belong here or in the runtime once chosen and measured.
GPU_XLA_FLAGS: tuple[str, ...] = ()
# JAX reads the first; the second is its deprecated name, and with both set JAX's CUDA plugin
# fails to load.
MEM_FRACTION_VARIABLES = ("XLA_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_MEM_FRACTION")
NCCL_DEBUG_LEVELS = ("VERSION", "WARN", "INFO", "TRACE")


def fail(message: str, exit_code: int = USAGE_EXIT) -> None:
  print(f"error: {' '.join(str(message).split())}", file=sys.stderr, flush=True)
  sys.exit(exit_code)


class _Parser(argparse.ArgumentParser):
  """argparse with every mistake as one `error:` line (no usage block), exit code 2."""

  def error(self, message):
    fail(f"{message} (see {self.prog} --help)")


def batch_script(args: argparse.Namespace, train_args: list[str]) -> str:
  tasks_per_node = 1 if args.per_node else args.gpus_per_node
  directives = [
      f"--job-name={args.job_name}",
      f"--nodes={args.nodes}",
      f"--ntasks-per-node={tasks_per_node}",
      f"--gpus-per-node={args.gpus_per_node}",
      f"--time={args.time}",
      f"--output={args.output}",
      "--open-mode=append",
      "--requeue",
  ]
  directives += [f"--partition={args.partition}"] if args.partition else []
  directives += [f"--account={args.account}"] if args.account else []
  directives += args.sbatch
  lines = ["#!/bin/bash"] + [f"#SBATCH {d}" for d in directives]
  if args.per_node:
    lines += [
        f"# One task per node drives all {args.gpus_per_node} GPUs; without this JAX's SLURM",
        "# detection gives each process only GPU SLURM_LOCALID (= 0).",
    ]
  else:
    lines += [
        "# One task per GPU: JAX's SLURM detection gives task SLURM_LOCALID that GPU of the",
        f"# {args.gpus_per_node} every task sees (so no --gpus-per-task / GPU binding here).",
    ]
  lines += ["set -euo pipefail", f"cd {shlex.quote(args.repo_dir)}"]
  lines += gpu_environment(args)
  env = list(args.env)
  if args.per_node:
    env.append(("JAX_LOCAL_DEVICE_IDS", ",".join(map(str, range(args.gpus_per_node)))))
  lines += [f"export {key}={shlex.quote(value)}" for key, value in env]
  srun = ["srun", "--kill-on-bad-exit=1", args.python, "-m", "toolkit.train",
          f"--config={args.config}", f"--workdir={args.workdir}", *train_args]
  lines += restart_loop(shlex.join(srun), args.max_restarts, args.restart_delay_s)
  return "\n".join(lines) + "\n"


def restart_loop(command: str, max_restarts: int, delay_s: int) -> list[str]:
  """`command` run again after a failure, up to `max_restarts` times (FINAL_STATUSES end it);
  one `[slurm_job]` line on stderr per restart and when it gives up."""
  final = "|".join(map(str, FINAL_STATUSES))
  return [
      "# Restarts (docs/pods.md): these exit statuses end the job: " + "; ".join(
          f"{code}, {text}" for code, text in FINAL_STATUSES.items()) + ".",
      "# Any other runs the command again, which resumes from the newest checkpoint.",
      "status=0",
      f"for attempt in $(seq 0 {max_restarts}); do",
      "  if (( attempt > 0 )); then",
      f"    echo \"[slurm_job] restart $attempt of {max_restarts} after exit status $status: "
      f"resuming from the newest checkpoint in {delay_s} s\" >&2",
      f"    sleep {delay_s}",
      "  fi",
      "  set +e",
      f"  {command}",
      "  status=$?",
      "  set -e",
      f"  case $status in {final}) exit \"$status\" ;; esac",
      "done",
      f"echo \"[slurm_job] exit status $status after {max_restarts} restart(s): giving up; "
      f"submit the same script again to resume\" >&2",
      "exit \"$status\"",
  ]


def gpu_environment(args: argparse.Namespace) -> list[str]:
  """The script's lines that set the NCCL/XLA environment of every task (the module docstring
  says why each); a variable the user's --env sets is left to it."""
  given = {key for key, _ in args.env}
  lines = []
  if "JAX_PLATFORMS" not in given:
    lines += ["# The GPUs, or JAX's error where its CUDA plugin is missing (not a run on the CPU).",
              "export JAX_PLATFORMS=cuda,cpu"]
  if not given & set(MEM_FRACTION_VARIABLES):
    lines += ["# The share of each GPU's memory JAX reserves. With the old name also set (sbatch",
              "# passes on the submitting shell's) JAX's CUDA plugin fails to load.",
              f"unset {MEM_FRACTION_VARIABLES[1]}",
              f"export {MEM_FRACTION_VARIABLES[0]}={args.mem_fraction:g}"]
  if args.nccl_debug and "NCCL_DEBUG" not in given:
    lines.append(f"export NCCL_DEBUG={args.nccl_debug}")
  if GPU_XLA_FLAGS and "XLA_FLAGS" not in given:
    lines.append(f"export XLA_FLAGS={shlex.quote(' '.join(GPU_XLA_FLAGS))}")
  return lines


def _env_pair(text: str) -> tuple[str, str]:
  key, sep, value = text.partition("=")
  if not sep or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
    raise argparse.ArgumentTypeError(f"{text!r} is not KEY=VALUE with KEY a shell variable name")
  return key, value


def _positive(text: str) -> int:
  if not text.isdigit() or int(text) < 1:
    raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer")
  return int(text)


def _count(text: str) -> int:
  if not text.isdigit():
    raise argparse.ArgumentTypeError(f"{text!r} is not a whole number >= 0")
  return int(text)


def _fraction(text: str) -> float:
  try:
    value = float(text)
  except ValueError:
    value = -1.0
  if not 0 < value <= 1:
    raise argparse.ArgumentTypeError(f"{text!r} is not a fraction in (0, 1], such as 0.9")
  return value


def _time(text: str) -> str:
  # sbatch --time: minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM or D-HH:MM:SS.
  if not re.fullmatch(r"\d+(-\d+)?(:\d+){0,2}", text):
    raise argparse.ArgumentTypeError(f"{text!r} is not a SLURM time such as 04:00:00 or 1-00:00:00")
  return text


def _directive_value(text: str) -> str:
  if "\n" in text:
    raise argparse.ArgumentTypeError(f"{text!r} spans lines; give one value")
  return text


def parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
  """(flags, train arguments after `--`)."""
  train_args: list[str] = []
  if "--" in argv:
    split = argv.index("--")
    argv, train_args = argv[:split], argv[split + 1:]
  parser = _Parser(prog="slurm_job.py", description=__doc__.split("\n\n")[0],
                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--nodes", type=_positive, required=True, help="nodes to allocate")
  parser.add_argument("--gpus-per-node", type=_positive, default=8, help="default 8")
  parser.add_argument("--per-node", action="store_true",
                      help="one task per node driving all its GPUs (default: one per GPU)")
  parser.add_argument("--time", type=_time, default="04:00:00", help="wall time limit")
  parser.add_argument("--job-name", type=_directive_value, default="meshkit")
  parser.add_argument("--output", type=_directive_value, default="%x-%j.out",
                      help="SLURM log file pattern (default %%x-%%j.out: name-jobid.out)")
  parser.add_argument("--partition", type=_directive_value)
  parser.add_argument("--account", type=_directive_value)
  parser.add_argument("--sbatch", type=_directive_value, action="append", default=[],
                      metavar="OPTION", help="another #SBATCH line, e.g. --sbatch=--exclusive "
                      "(repeatable)")
  parser.add_argument("--repo-dir", type=_directive_value, default=str(REPO),
                      help="meshkit checkout on the cluster's shared file system (default: "
                      "this one)")
  parser.add_argument("--python", default=".venv/bin/python",
                      help="Python with meshkit[cuda] installed, relative to --repo-dir or "
                      "absolute (default .venv/bin/python: the checkout's venv, which `make` "
                      "creates; install the cuda extra into it)")
  parser.add_argument("--config", required=True,
                      help="experiment file and variant, e.g. experiments/lm.py:size=1b")
  parser.add_argument("--workdir", required=True, type=workdir.argument,
                      help="gs://BUCKET/path, or a directory every node can write")
  parser.add_argument("--env", type=_env_pair, action="append", default=[], metavar="KEY=VALUE",
                      help="environment variable for the training processes (repeatable)")
  parser.add_argument("--mem-fraction", type=_fraction, default=DEFAULT_MEM_FRACTION,
                      help="share of each GPU's memory JAX takes at start-up "
                      f"(XLA_CLIENT_MEM_FRACTION; default {DEFAULT_MEM_FRACTION:g})")
  parser.add_argument("--nccl-debug", choices=NCCL_DEBUG_LEVELS, type=str.upper,
                      help="NCCL's log level (NCCL_DEBUG; default unset: NCCL prints nothing "
                      "of its own): WARN names each failed NCCL call, INFO also the network it "
                      "chose")
  parser.add_argument("--max-restarts", type=_count, default=3,
                      help="runs of the training command again after it fails, in the same "
                      "allocation (default 3); 0: none")
  parser.add_argument("--restart-delay-s", type=_count, default=10,
                      help="seconds between a failure and the restart (default 10)")
  parser.add_argument("--dry-run", action="store_true", help="print the script, submit nothing")
  return parser.parse_args(argv), train_args


def main(argv: list[str]) -> None:
  args, train_args = parse(argv)
  script = batch_script(args, train_args)
  if args.dry_run:
    sys.stdout.write(script)
    return
  if shutil.which("sbatch") is None:
    fail("sbatch is not on PATH; run this on the cluster's login node, or use --dry-run to "
         "print the script", 1)
  code = subprocess.run(["sbatch"], input=script, text=True).returncode
  if code:
    fail(f"sbatch exited with {code}", 1)


if __name__ == "__main__":
  main(sys.argv[1:])
