"""What a run does before its first step, apart from building its pieces (setup.py): check
and create the workdir, write config.json, log the devices, mesh, sharding and settings."""
from __future__ import annotations

import math
import os

import jax
import ml_collections

from toolkit import workdir as workdir_lib
from toolkit.accelerators import human_bytes
from toolkit.errors import ConfigError
from toolkit.training import watchdog as watchdog_lib
from toolkit.training.checkpoints import storage
from toolkit.training.setup import Setup


def log(message: str) -> None:
  """A line of the run's log, from process 0 only."""
  if jax.process_index() == 0:
    print(message, flush=True)


def prepare_workdir(workdir: str, checkpoint_size: int | None = None) -> None:
  """Creates the workdir and checks that it and its checkpoints/ folder can be written (without
  writing: a refused run leaves an existing workdir as it was); with `checkpoint_size` (bytes)
  warns when free space is below two checkpoints."""
  if (problem := workdir_lib.problem(workdir, reach=True)) is not None:
    raise ConfigError(problem)
  if workdir_lib.is_url(workdir):
    return  # an object store: no folders to create, no local disk to measure
  try:
    os.makedirs(workdir, exist_ok=True)
  except OSError as e:
    raise ConfigError(f"--workdir={workdir!r} cannot be created ({e.strerror}); choose a "
                      f"writable directory") from None
  storage.check_writable(workdir)
  if checkpoint_size is None:
    return
  checkpoints = workdir_lib.join(workdir, "checkpoints")
  storage.check_writable(checkpoints)
  if (warning := storage.free_space_warning(checkpoints, checkpoint_size)) is not None:
    log(f"warning: {warning}")


def write_config(config: ml_collections.ConfigDict, path: str) -> None:
  try:
    workdir_lib.write_text(path, config.to_json_best_effort(indent=2))
  except OSError as e:
    raise storage.StorageError(f"{path} cannot be written ({storage.cause(e)}); "
                               f"{storage.fix(e)}") from None


def checkpoint_bytes(setup: Setup) -> int:
  """Bytes of one checkpoint: the whole train state (parameters and optimizer moments)."""
  return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(setup.layout.abstract))


def log_setup(config: ml_collections.ConfigDict, setup: Setup) -> None:
  """The devices, the mesh and the sharding table; warns about replicated parameters."""
  mesh, report = setup.spec.mesh, setup.layout.report
  log(f"devices: {mesh.size} x {mesh.devices.flat[0].device_kind} in "
      f"{jax.process_count()} process(es); mesh {dict(mesh.shape)}; rules {setup.spec.rules.name}")
  log(report.format())
  if hasattr(setup.batches, "describe"):  # packed documents: how full the rows are
    log(setup.batches.describe())
  warning = report.check_replicated(config.sharding.max_replicated_fraction,
                                    config.sharding.replicated_action)
  if warning:
    log(f"warning: {warning}")
  if setup.layout.reference:
    log(f"reference: a frozen copy of the starting weights in the train state "
        f"({setup.task.name}.reference={config[setup.task.name].reference!r}), "
        f"{human_bytes(reference_bytes_per_device(setup))} per device (the parameters' size "
        f"again), read by a forward pass each step")
  log(watchdog_lib.describe(config))


def reference_bytes_per_device(setup: Setup) -> int:
  """Bytes of the state's frozen reference copy on its most loaded device (0 without one)."""
  if not setup.layout.reference:
    return 0
  return sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize
             for x in jax.tree.leaves(setup.layout.abstract["reference"]))
