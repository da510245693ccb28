"""Parameters for inference: a checkpoint's latest step restored straight into the shardings
that a config's mesh and rules give them, without the optimizer state."""
from __future__ import annotations

import os

import ml_collections

from toolkit.errors import ConfigError
from toolkit.training import checkpoint
from toolkit.training import setup as setup_lib


def open_latest(checkpoint_path: str, flag: str = "--checkpoint"
                ) -> tuple[checkpoint.Checkpoints, int]:
  """A read-only manager over a training workdir (or its checkpoints/ folder) and its latest
  step; ConfigError naming `flag` when there is none. The caller closes the manager."""
  if not checkpoint_path:
    raise ConfigError(f"{flag} is empty; give a training workdir or its checkpoints/ folder")
  directory = checkpoint.checkpoints_dir(checkpoint_path)
  if not os.path.isdir(directory):
    raise ConfigError(f"{flag}={checkpoint_path!r} does not exist; give the workdir of a "
                      f"training run")
  manager = checkpoint.Checkpoints(directory, read_only=True)
  step = manager.latest_step()
  if step is None:
    manager.close()
    raise ConfigError(f"{flag}={checkpoint_path!r} holds no checkpoint; train first "
                      f"(python -m toolkit.train ... --workdir={checkpoint_path})")
  return manager, step


def restore_params(config: ml_collections.ConfigDict, checkpoint_path: str, devices=None):
  """The parameters of `checkpoint_path`'s latest step, restored straight into the shardings
  that `config`'s mesh and rules give them. Returns (params, model config, mesh, rules, step)."""
  manager, step = open_latest(checkpoint_path)
  try:
    setup = setup_lib.build(config, devices)
    checkpoint.check_compatible(manager.saved_config(step), setup.spec.model,
                                f"{manager.directory} step {step}")
    # Parameters only: the optimizer moments (2x the parameters for AdamW) are never read.
    params = manager.restore_params(step, setup.layout.abstract["params"])
  finally:
    manager.close()
  return params, setup.spec.model, setup.spec.mesh, setup.spec.rules, step


def single_device_config(saved: dict) -> ml_collections.ConfigDict:
  """A training run's saved config, placed on one device with parameters replicated: for
  sampling a small model where no model parallelism is needed."""
  config = ml_collections.ConfigDict(saved)
  config.mesh.update(ici="data:1", dcn="")
  config.sharding.update(preset="dp", param_overrides="", activation_overrides="")
  config.data.global_batch_size = config.train.microbatches
  return config
