"""`python -m toolkit.train` / `meshkit-train`: train per an experiment file, into a workdir.

  python -m toolkit.train --config=experiments/lm.py:cpu --workdir=runs/lm_cpu

The flags live here and nowhere else; the work is `toolkit.training.run(config, workdir)`
(toolkit/training/loop.py), which tests and notebooks call directly.
"""
from __future__ import annotations

import os
import signal
import sys

import jax

import sharding
from toolkit import command_line, runtime, xla_flags
from toolkit.errors import ConfigError
from toolkit.evaluation import periodic
from toolkit.inference import text as text_lib
from toolkit.pod import distributed
from toolkit.training import loop, startup, stop_signal
from toolkit.training.checkpoints import storage


def cli() -> None:
  """`python -m toolkit.train` / `meshkit-train`: flags are defined here and nowhere else.

  On a TPU pod or GPU cluster every worker runs the same command; `toolkit.pod.distributed` joins
  them into one job (flags, else SLURM / Open MPI / Cloud TPU, else one process).

  Exit status: 0 when training finished or stopped on SIGTERM/SIGINT with a checkpoint;
  2 for a command-line mistake; 1 for a config, workdir or checkpoint mistake, a full or
  read-only disk, a non-finite loss, or a peer process that failed or never started; 75 when
  the hang watchdog ended a process (docs/pods.md); 130 after a second SIGINT/SIGTERM, or
  Ctrl-C or SIGTERM before the loop. Each prints one `error:` line on stderr
  (docs/faults.md). When JAX's runtime itself ends a process (process 0 died, or a peer
  stopped sending heartbeats) it exits on SIGABRT.
  """
  from absl import app, flags  # pylint: disable=g-import-not-at-top
  from ml_collections import config_flags  # pylint: disable=g-import-not-at-top
  config_flag = config_flags.DEFINE_config_file(
      "config", None, "Required. Experiment file and variant, e.g. experiments/lm.py:tiny. "
      "Override single fields with --config.FIELD=VALUE (after --config).", lock_config=True)
  workdir_flag = flags.DEFINE_string(
      "workdir", None, "Required. Directory for checkpoints, metrics and plots; a run resumes "
      "from its latest checkpoint.")
  coordinator_flag = flags.DEFINE_string(
      "coordinator_address", None, "HOST:PORT of process 0, for several processes outside "
      "SLURM, Open MPI and Cloud TPU (which are detected). Same on every process.")
  num_processes_flag = flags.DEFINE_integer(
      "num_processes", None, "Processes in the job (with --coordinator_address).", lower_bound=1)
  process_id_flag = flags.DEFINE_integer(
      "process_id", None, "This process's index, 0..num_processes-1 (with "
      "--coordinator_address).", lower_bound=0)
  initialization_timeout_flag = flags.DEFINE_integer(
      "initialization_timeout", distributed.DEFAULT_INITIALIZATION_TIMEOUT_S,
      "Seconds for every process of a multi-process job to connect; then it fails.",
      lower_bound=1)
  heartbeat_timeout_flag = flags.DEFINE_integer(
      "heartbeat_timeout", distributed.DEFAULT_HEARTBEAT_TIMEOUT_S,
      "Seconds without a heartbeat after which a process counts as dead and the job stops.",
      lower_bound=1)
  plan_flag = flags.DEFINE_string(
      "plan", None, "A plan file from `python -m toolkit.compile ... --plan`: its mesh, rules "
      "preset, remat and micro-batch fields are set on top of --config.")
  cache_flag = command_line.define_runtime_flags()

  def main(argv) -> None:
    del argv  # checked in parse_flags
    command_line.quiet_logging()
    config = config_flag.value
    if plan_flag.value:
      from toolkit.planning import plan as plan_lib  # pylint: disable=g-import-not-at-top
      try:
        config = plan_lib.apply_plan(config, plan_flag.value,
                                     command_line.override_fields(sys.argv),
                                     command_line.config_argument(sys.argv))
      except ConfigError as e:
        command_line.fail(e, command_line.USAGE_EXIT)
    command_line.check_platform_plugin()
    runtime.start(cache_flag.value, mesh=config.mesh, xla_flags=xla_flags.setting_of(config))
    try:
      processes = distributed.initialize(
          coordinator_flag.value, num_processes_flag.value, process_id_flag.value,
          initialization_timeout=initialization_timeout_flag.value,
          heartbeat_timeout=heartbeat_timeout_flag.value)
    except ConfigError as e:
      command_line.fail(e, command_line.USAGE_EXIT)
    except (RuntimeError, AssertionError):
      command_line.check_platform()  # one line when it is JAX_PLATFORMS that failed
      raise
    command_line.check_platform()  # an accelerator JAX_PLATFORMS names is the one in use
    if processes.process_count > 1:
      print(processes, flush=True)  # every process: one line each, to tell them apart
      first = processes.process_index == 0
      runtime.cache_off_for_cpu_processes(processes.process_count,
                                          print if first else lambda line: None)
    train(config, workdir_flag.value, processes.process_count)

  app.run(one_line_on_interrupt(main), flags_parser=lambda argv: command_line.parse_flags(
      argv, config_flag, required={"workdir": "a directory for checkpoints and metrics, e.g. "
                                               "--workdir=runs/lm"}))


def train(config, workdir: str, process_count: int) -> None:
  """`toolkit.training.run` with its failures as one `error:` line each."""
  try:
    batches = None
    if config.data.source == "prompts":  # GRPO: batches sampled from the model being trained
      from toolkit.post_training import grpo_task  # pylint: disable=g-import-not-at-top  # Grain
      batches = grpo_task.batches_for(config, startup.log)
    result = loop.run(config, workdir, sampler=text_lib.sample_after_training,
                      periodic=periodic.for_config(config),  # train.eval_tasks
                      batches=batches)
    if result.interrupted:  # Ctrl-C twice: saved; Orbax's threads need not be waited for
      sys.stdout.flush()
      os._exit(stop_signal.INTERRUPTED_EXIT)  # pylint: disable=protected-access
  except storage.StorageError as e:
    command_line.fail(e, now=True)
  except (ConfigError, sharding.ShardingError, loop.NonFiniteLoss) as e:
    command_line.fail(e)
  except jax.errors.JaxRuntimeError as e:
    if process_count == 1:
      raise
    distributed.abandon(e)


class _Terminated(KeyboardInterrupt):
  """SIGTERM outside the loop's own handling, raised as Ctrl-C is."""


def _raise_terminated(signum, frame) -> None:
  del signum, frame
  raise _Terminated()


def one_line_on_interrupt(main):
  """`main`, with Ctrl-C or SIGTERM outside the loop's own handling (start-up, compile, the
  final save and plots) as one line and status 130 instead of a KeyboardInterrupt traceback
  (Ctrl-C) or a silent death (SIGTERM's default). The loop installs its own handlers while it
  runs (toolkit/training/stop_signal.py), and JAX's runtime its own on a pod."""
  def interruptible(argv) -> None:
    if signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
      signal.signal(signal.SIGTERM, _raise_terminated)
    try:
      main(argv)
    except KeyboardInterrupt as e:
      name = "SIGTERM" if isinstance(e, _Terminated) else "SIGINT"
      command_line.fail(f"interrupted ({name}) outside the training loop: nothing more was "
                        "saved, committed checkpoints are intact; rerun the same command to "
                        "resume", stop_signal.INTERRUPTED_EXIT, now=True)
  return interruptible


if __name__ == "__main__":
  cli()
