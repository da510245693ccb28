"""Parameters for inference: a checkpoint's step (the latest by default) restored straight
into the shardings that a config's mesh and rules give them, without the optimizer state.

Only the model and its shardings are built (the config validated, the mesh, the rules, the
abstract parameters): no optimizer, train step or data pipeline, which `training.build` would
also make."""
from __future__ import annotations

import ml_collections
import optax

from toolkit.errors import ConfigError
from toolkit.training.checkpoints import checkpoint
from toolkit.training import config as config_lib
from toolkit.training import state as state_lib
from toolkit.training.checkpoints.checkpoint import open_latest


def restore_params(config: ml_collections.ConfigDict, checkpoint_path: str, devices=None,
                   step: int | None = None):
  """The parameters of `checkpoint_path`'s step `step` (default: the latest), restored straight
  into the shardings that `config`'s mesh and rules give them. Returns (params, model config,
  mesh, rules, step)."""
  manager, latest = open_latest(checkpoint_path)
  try:
    if step is None:
      step = latest
    elif step not in manager.all_steps():
      raise ConfigError(f"step {step}: {manager.directory} holds steps "
                        f"{', '.join(map(str, manager.all_steps()))}; give one of them")
    spec = config_lib.resolve(config, devices)
    _refuse_split_cache(spec)
    checkpoint.check_compatible(manager.saved_config(step), spec.model,
                                f"{manager.directory} step {step}")
    # The parameters' abstract values and shardings; optax.identity() has no state, so the
    # layout holds nothing for an optimizer.
    layout = state_lib.layout(spec.model, optax.identity(), spec.rules, spec.mesh)
    # Parameters only: the optimizer moments (2x the parameters for AdamW) are never read.
    params = manager.restore_params(step, layout.abstract["params"])
  finally:
    manager.close()
  return params, spec.model, spec.mesh, spec.rules, step


def _refuse_split_cache(spec: config_lib.RunSpec) -> None:
  """Decoding reads a KV cache laid out like the activations: with token positions split over
  devices (context parallelism) every new token would gather the whole cache, and layers
  split into pipeline stages would run one token through every stage in turn. Refused."""
  for logical, what in (("length", "context parallelism"), ("layers", "pipeline stages")):
    axes = spec.rules.activation_spec((logical,), spec.mesh)
    axes = [a for e in axes if e for a in ((e,) if isinstance(e, str) else e)]
    language_model = spec.task in config_lib.LANGUAGE_MODEL_TASKS
    if language_model and any(spec.mesh.shape[a] > 1 for a in axes):
      split = "x".join(f"{a}={spec.mesh.shape[a]}" for a in axes)
      raise ConfigError(f"decoding with a KV cache split over {split} ({what}) is not "
                        f"supported; serve the checkpoint on a mesh without that axis, e.g. "
                        f"--config.mesh.ici=fsdp:-1 (checkpoints restore onto any mesh)")


def single_device_config(saved: dict) -> ml_collections.ConfigDict:
  """A training run's saved config, placed on one device with parameters replicated: for
  sampling a small model where no model parallelism is needed."""
  config = ml_collections.ConfigDict(saved)
  config.mesh.update(ici="data:1", dcn="")
  config.sharding.update(preset="dp", param_overrides="", activation_overrides="")
  config.data.global_batch_size = config.train.microbatches
  if "attention" in config.model:
    # Decoding keeps its own attention; the run's kernel may be another platform's (cudnn
    # from a GPU), which the config check would refuse on this machine.
    config.model.attention = "auto"
  return config
