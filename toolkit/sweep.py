"""`python -m toolkit.sweep`: a hyperparameter sweep from an experiment's `get_sweep(arg)`
(toolkit/tuning/runner.py has the modes, the workdir layout and resuming).

  python -m toolkit.sweep --config=experiments/lm.py:cpu --workdir=runs/sweep
  python -m toolkit.sweep --config=experiments/lm.py:tiny --workdir=runs/sweep_tiny \\
      --max_concurrent=2 --mode=processes

--mode: auto (population when it can), population or processes; --max_concurrent=K bounds the
trials at a time (0: all).
"""
from __future__ import annotations

import os
import sys

import sharding
from toolkit import command_line, runtime
from toolkit.errors import ConfigError
from toolkit.tuning import runner


def cli() -> None:
  """`python -m toolkit.sweep`: exit 0 when every trial finished (done, stopped early or
  diverged), 2 for a command-line mistake, 1 for a sweep or config mistake (one `error:`
  line). Kill it at any point and run the same command again to resume."""
  from absl import app, flags  # pylint: disable=g-import-not-at-top
  config_flag = flags.DEFINE_string(
      "config", None, "Required. Experiment file with get_sweep(arg), and its argument: "
      "experiments/lm.py:cpu")
  workdir_flag = flags.DEFINE_string(
      "workdir", None, "Required. The sweep's directory (trials/, results); rerun to resume.")
  mode_flag = flags.DEFINE_enum(
      "mode", "auto", runner.MODES, "population: trials differing only in values train in one "
      "program; processes: one run per trial on its own devices; auto: population if it can.")
  concurrent_flag = flags.DEFINE_integer(
      "max_concurrent", 0, "Trials at a time: the population size, or runs at once in process "
      "mode (0: all trials / as many as the devices allow).", lower_bound=0)
  cache_flag = command_line.define_runtime_flags()

  def main(argv) -> None:
    del argv
    command_line.quiet_logging()
    runtime.start(cache_flag.value, cpu_devices=(
        runtime.DEFAULT_CPU_DEVICES, "the sweep's trials"))
    command_line.check_platform()
    try:
      runner.run(config_flag.value, workdir_flag.value, mode_flag.value, concurrent_flag.value)
    except (ConfigError, sharding.ShardingError) as e:
      command_line.fail(e)
    except KeyboardInterrupt:
      # Trials in other threads would keep the process alive; their checkpoints are complete
      # or absent (Orbax renames a finished save into place), so a rerun resumes cleanly.
      print("interrupted: rerun the same command to resume the sweep", file=sys.stderr,
            flush=True)
      os._exit(130)  # pylint: disable=protected-access

  app.run(main, flags_parser=lambda argv: command_line.parse_flags(
      argv, None, required={"config": "an experiment file with get_sweep, e.g. "
                                      "--config=experiments/lm.py:cpu",
                            "workdir": "a directory for the sweep, e.g. --workdir=runs/sweep"}))


if __name__ == "__main__":
  cli()
