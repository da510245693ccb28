"""Elastic restarts: the hosts a job may use, and the largest job that trains on them.

A hosts file (`toolkit.supervise --hosts_file=PATH`) lists the job's hosts, one per line (blank
lines and `#` comments are ignored); in a local pod each line stands for one process. Whoever
manages the machines (an operator, a node-health check, a test) deletes a host's line when the
host is lost and puts it back when it returns. The supervisor reads the file at every restart,
and every second while the job runs on fewer hosts than it asked for.

`fit` sizes a restart on the hosts that remain: the most processes, at most as many as are
listed, whose devices the config's mesh and batch fit (`training.config.resolve` decides, as the
training command will), with the global batch kept whole. data.global_batch_size does not
change; train.microbatches grows until each device's share of a micro-batch is at most what it
was on the full job, so the step's activations fit where they fitted before. The batch of step s
is a function of the seed and s whatever the mesh (toolkit/data), so every global batch is the
uninterrupted run's, and the losses equal its losses to rounding (the reduction order changes
with the mesh).
"""
from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Sequence

from toolkit import workdir as workdir_lib

MICROBATCHES_FLAG = "--config.train.microbatches"


class HostsError(ValueError):
  """The hosts file cannot be read, or no smaller job fits the hosts that remain."""


@dataclasses.dataclass(frozen=True)
class Size:
  """The shape of one attempt: processes, and the micro-batches its command sets (None: the
  command's own)."""
  processes: int
  microbatches: int | None = None


def read_hosts(path: str) -> list[str]:
  """The hosts listed in `path`, in order."""
  try:
    text = workdir_lib.read_text(path)
  except FileNotFoundError:
    raise HostsError(f"--hosts_file={path}: no such file; list the job's hosts in it, one per "
                     f"line") from None
  except (OSError, UnicodeDecodeError) as e:
    raise HostsError(f"--hosts_file={path}: cannot be read ({e})") from None
  hosts = [line.split("#", 1)[0].strip() for line in text.splitlines()]
  return [host for host in hosts if host]


def job_config(train_args: Sequence[str]):
  """The config the training command builds from `train_args` (--config and its overrides)."""
  from absl import flags  # pylint: disable=g-import-not-at-top
  from ml_collections import config_flags  # pylint: disable=g-import-not-at-top
  ours, args = [], list(train_args)
  for i, arg in enumerate(args):
    if arg == "--config" or arg.startswith("--config."):
      ours.append(arg)
      if "=" not in arg and i + 1 < len(args):
        ours.append(args[i + 1])  # `--config FILE`: the value is the next argument
    elif arg.startswith("--config="):
      ours.append(arg)
  values = flags.FlagValues()
  argv = ["supervise", *ours]  # the override flags are defined from the arguments given
  config_flags.DEFINE_config_file("config", None, "", flag_values=values, lock_config=True,
                                  sys_argv=argv)
  with warnings.catch_warnings():
    # ml_collections loads the experiment file with importlib's deprecated load_module().
    warnings.filterwarnings("ignore", "the load_module", DeprecationWarning)
    values(argv)
  return values.config


def with_microbatches(train_args: Sequence[str], microbatches: int | None) -> list[str]:
  """`train_args` with train.microbatches set to `microbatches` (unchanged for None)."""
  if microbatches is None:
    return list(train_args)
  kept = [a for a in train_args if not a.startswith(MICROBATCHES_FLAG + "=")]
  return [*kept, f"{MICROBATCHES_FLAG}={microbatches}"]


def _rows_per_device(config, devices) -> int:
  """Rows of one micro-batch on each device, or raises the config's own error."""
  from toolkit.training import config as config_lib  # pylint: disable=g-import-not-at-top
  spec = config_lib.resolve(config, devices)
  return config.data.global_batch_size // config.train.microbatches // spec.batch_ways


def fit(train_args: Sequence[str], hosts: int, processes: int,
        devices_per_process: int) -> Size:
  """The largest job of at most `hosts` processes (of the `processes` asked for) that trains
  the same global batches, each device holding at most the rows it held on the full job."""
  import jax  # pylint: disable=g-import-not-at-top
  devices = jax.devices("cpu")
  if len(devices) < processes * devices_per_process:
    raise HostsError(f"sizing a restart needs {processes * devices_per_process} CPU devices in "
                     f"the supervisor; it has {len(devices)}")
  config = job_config(train_args)
  asked = config.train.microbatches
  full = _rows_per_device(config, devices[:processes * devices_per_process])
  batch = config.data.global_batch_size
  refusals = []
  for count in range(min(hosts, processes), 0, -1):
    for microbatches in [m for m in range(asked, batch + 1) if batch % m == 0]:
      config.train.microbatches = microbatches
      try:
        rows = _rows_per_device(config, devices[:count * devices_per_process])
      except ValueError as e:  # ConfigError, ShardingError: not with this many micro-batches
        refusals.append(f"{count} process(es): {str(e).split('. ')[0]}")
        continue
      if rows <= full:
        return Size(count, None if microbatches == asked else microbatches)
  raise HostsError(f"no job of at most {hosts} of the {processes} processes fits the config "
                   f"with its global batch ({batch} rows) ({refusals[0] if refusals else ''}); "
                   f"a mesh axis of size -1 (e.g. --config.mesh.ici=fsdp:-1) lets the mesh "
                   f"shrink")
