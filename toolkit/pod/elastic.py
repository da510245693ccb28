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

With `keep="per_device"` (`toolkit.supervise --elastic_batch=per_device`) a smaller job keeps
instead each device's rows and micro-batches, and the global batch shrinks with the devices
(16 rows on 8 devices -> 12 on 6): the steps stay as fast, but each trains on fewer examples
and, from the restored step on, other ones than the uninterrupted run's (the batch of step s
starts at example s x the global batch); the supervisor states that change in its restart line.
Growing back restores the command's own global batch.
"""
from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Sequence

from toolkit import workdir as workdir_lib

MICROBATCHES_FLAG = "--config.train.microbatches"
GLOBAL_BATCH_FLAG = "--config.data.global_batch_size"
BATCH_MODES = ("global", "per_device")  # what a smaller job keeps (module docstring)


class HostsError(ValueError):
  """The hosts file cannot be read, or no smaller job fits the hosts that remain."""


@dataclasses.dataclass(frozen=True)
class Size:
  """The shape of one attempt: processes, and the micro-batches its command sets (None: the
  command's own)."""
  processes: int
  microbatches: int | None = None
  global_batch: int | None = None  # rows a step, with keep="per_device" (None: the command's)


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


def with_size(train_args: Sequence[str], size: Size) -> list[str]:
  """`train_args` with the micro-batches and global batch `size` sets (None: unchanged)."""
  args = list(train_args)
  for flag, value in ((MICROBATCHES_FLAG, size.microbatches),
                      (GLOBAL_BATCH_FLAG, size.global_batch)):
    if value is not None:
      args = [*[a for a in args if not a.startswith(flag + "=")], f"{flag}={value}"]
  return args


def _rows_per_device(config, devices) -> int:
  """Rows of one micro-batch on each device, or raises the config's own error."""
  from toolkit.training import config as config_lib  # pylint: disable=g-import-not-at-top
  spec = config_lib.resolve(config, devices)
  return config.data.global_batch_size // config.train.microbatches // spec.batch_ways


def _check_parameters(config, devices) -> None:
  """Raises the training command's error when the parameters do not split over the mesh of
  `devices` (fsdp 3 and a 32-wide embedding), which config.resolve does not check."""
  import sharding  # pylint: disable=g-import-not-at-top
  # pylint: disable-next=g-import-not-at-top
  from toolkit.training import config as config_lib, state as state_lib
  spec = config_lib.resolve(config, devices)
  sharding.sharding_report(state_lib.param_entries(spec.model)[1], spec.rules, spec.mesh)


def fit(train_args: Sequence[str], hosts: int, processes: int, devices_per_process: int,
        keep: str = "global") -> Size:
  """The largest job of at most `hosts` processes (of the `processes` asked for) that trains
  the same global batches, each device holding at most the rows it held on the full job; with
  `keep="per_device"`, the largest whose devices each hold exactly those rows in the command's
  micro-batches, the global batch scaled with the devices."""
  if keep not in BATCH_MODES:
    raise HostsError(f"--elastic_batch={keep}: give one of {', '.join(BATCH_MODES)}")
  import jax  # pylint: disable=g-import-not-at-top
  devices = jax.devices("cpu")
  if len(devices) < processes * devices_per_process:
    raise HostsError(f"sizing a restart needs {processes * devices_per_process} CPU devices in "
                     f"the supervisor; it has {len(devices)}")
  config = job_config(train_args)
  full = _rows_per_device(config, devices[:processes * devices_per_process])
  batch = config.data.global_batch_size
  refusals = []
  for count in range(min(hosts, processes), 0, -1):
    job = devices[:count * devices_per_process]
    size = (_same_rows(config, job, count, processes, full, refusals) if keep == "per_device"
            else _same_batch(config, job, count, full, refusals))
    if size is not None:
      return size
  kept = ("each device's rows" if keep == "per_device"
          else f"the config with its global batch ({batch} rows)")
  raise HostsError(f"no job of at most {hosts} of the {processes} processes fits {kept} "
                   f"({refusals[0] if refusals else ''}); a mesh axis of size -1 (e.g. "
                   f"--config.mesh.ici=fsdp:-1) lets the mesh shrink")


def _same_batch(config, devices, count: int, full: int, refusals: list[str]) -> Size | None:
  """`count` processes on `devices` with the global batch whole, in the fewest micro-batches
  (at least the command's) that leave each device at most `full` rows."""
  asked, batch = config.train.microbatches, config.data.global_batch_size
  for microbatches in [m for m in range(asked, batch + 1) if batch % m == 0]:
    config.train.microbatches = microbatches
    try:
      if _rows_per_device(config, devices) > full:
        continue
    except ValueError as e:  # ConfigError, ShardingError: not with this many micro-batches
      refusals.append(f"{count} process(es): {_first_sentence(e)}")
      continue
    try:
      _check_parameters(config, devices)  # the same for every micro-batch count: once
    except ValueError as e:
      refusals.append(f"{count} process(es): {_first_sentence(e)}")
      return None
    finally:
      config.train.microbatches = asked
    return Size(count, None if microbatches == asked else microbatches)
  config.train.microbatches = asked
  return None


def _same_rows(config, devices, count: int, processes: int, full: int,
               refusals: list[str]) -> Size | None:
  """`count` processes on `devices` with `full` rows a device in the command's micro-batches:
  the global batch scaled by count / processes, when that is whole and the mesh splits it so."""
  batch = config.data.global_batch_size
  if batch * count % processes:
    refusals.append(f"{count} process(es): {batch} rows x {count} / {processes} is not whole")
    return None
  config.data.global_batch_size = batch * count // processes
  try:
    rows = _rows_per_device(config, devices)
    _check_parameters(config, devices)
  except ValueError as e:  # ConfigError, ShardingError
    refusals.append(f"{count} process(es): {_first_sentence(e)}")
    return None
  finally:
    smaller, config.data.global_batch_size = config.data.global_batch_size, batch
  if rows != full:
    refusals.append(f"{count} process(es): {rows} rows a device instead of {full}")
    return None
  return Size(count, global_batch=None if smaller == batch else smaller)


def _first_sentence(error: ValueError) -> str:
  """An error's cause without its advice (the fit's own message gives the fix)."""
  return str(error).split(". ")[0].split("; ")[0]
