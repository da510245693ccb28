"""Checkpoints through Orbax's CheckpointManager: the state (async), the config and the data
position saved beside it, and restores onto any mesh by giving the abstract state with its
shardings as the target.

Resume order (`find_resume_point`): the workdir's latest checkpoint -> `train.resume_from`
-> `train.init_from` (weights only, `init_from.py`) -> scratch.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
from typing import Any

import orbax.checkpoint as ocp

from models import kind_of

from toolkit.errors import ConfigError
from toolkit.training.state import State

# Model fields that change parameter shapes or dtypes: a checkpoint restores only if they match.
SHAPE_FIELDS = ("kind", "vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim",
                "mlp_dim", "tie_embeddings", "param_dtype", "image_size", "patch_size",
                "channels", "num_classes", "pool", "n_experts", "moe_every")


def _drop_read_only_notice(record: logging.LogRecord) -> bool:
  return not record.getMessage().startswith("Given directory is read only")


class Checkpoints:
  """A CheckpointManager over `directory` with items state / config / data."""

  def __init__(self, directory: str, keep: int = 3, read_only: bool = False):
    self.directory = os.path.abspath(directory)
    # Read-only: the options Orbax would otherwise reset with a warning each, and its notice
    # that the directory is read only (asked for) left out of the command's output.
    options = ocp.CheckpointManagerOptions(
        max_to_keep=None if read_only else keep, save_interval_steps=0 if read_only else 1,
        create=not read_only, read_only=read_only, enable_async_checkpointing=True)
    if read_only:
      logging.getLogger("absl").addFilter(_drop_read_only_notice)
    self.manager = ocp.CheckpointManager(self.directory, options=options,
                                         item_names=("state", "config", "data"))

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def save(self, step: int, state: State, config: dict, data_position: dict) -> None:
    """Starts an async save; returns once the arrays are copied off the devices."""
    self.manager.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(state), config=ocp.args.JsonSave(config),
        data=ocp.args.JsonSave(data_position)), force=True)

  def saved_config(self, step: int) -> dict:
    restored = self.manager.restore(step, args=ocp.args.Composite(config=ocp.args.JsonRestore()))
    return restored["config"]

  def restore(self, step: int, abstract_state: State) -> tuple[State, dict]:
    """Restores `step` into the shardings carried by `abstract_state`; returns (state, data)."""
    try:
      restored = self.manager.restore(step, args=ocp.args.Composite(
          state=ocp.args.StandardRestore(abstract_state), data=ocp.args.JsonRestore()))
    except (ValueError, KeyError, FileNotFoundError) as e:
      first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
      raise ConfigError(f"checkpoint {self.directory} step {step} could not be restored "
                        f"({first}); check that it was written by this model and config") from None
    return restored["state"], restored["data"]

  def restore_params(self, step: int, abstract_params) -> Any:
    """Restores only the parameters of `step` (no optimizer state is read), into the
    shardings `abstract_params` carry: what inference needs. Use a manager for one kind of
    restore only (Orbax binds the item's handler on first use)."""
    target = {"params": abstract_params}
    try:
      restored = self.manager.restore(step, args=ocp.args.Composite(state=ocp.args.PyTreeRestore(
          item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target),
          partial_restore=True)))
    except (ValueError, KeyError, FileNotFoundError) as e:
      first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
      raise ConfigError(f"checkpoint {self.directory} step {step} could not be restored "
                        f"({first}); check that it was written by this model and config") from None
    return restored["state"]["params"]

  def wait(self) -> None:
    self.manager.wait_until_finished()

  def close(self) -> None:
    self.manager.wait_until_finished()
    self.manager.close()


def check_compatible(saved: dict, model_config: Any, where: str) -> None:
  """Refuses a checkpoint whose model differs in a field that changes parameter shapes."""
  current = {"kind": kind_of(model_config), **dataclasses.asdict(model_config)}
  # Saved before kinds, or mixtures of experts, existed: a dense Llama.
  saved_model = {"kind": "llama", "n_experts": 0, **saved.get("model", {})}
  for field in SHAPE_FIELDS:
    if field == "moe_every" and not current.get("n_experts"):
      continue  # a dense model has no MoE layers to place
    if field in saved_model and field in current and saved_model[field] != current[field]:
      raise ConfigError(
          f"checkpoint {where} holds a different model: model.{field}={saved_model[field]!r} "
          f"there, {current[field]!r} here; use a fresh --workdir or "
          f"--config.model.{field}={saved_model[field]!r}")


def checkpoints_dir(path: str) -> str:
  """A workdir's checkpoints/ folder, or `path` itself when it already is one."""
  candidate = os.path.join(path, "checkpoints")
  return candidate if os.path.isdir(candidate) else path


def find_resume_point(own: Checkpoints, resume_from: str) -> tuple[Checkpoints | None, int | None]:
  """(manager, step) to restore from, or (None, None) to start from scratch."""
  step = own.latest_step()
  if step is not None:
    return own, step
  if resume_from:
    other = Checkpoints(checkpoints_dir(resume_from), read_only=True)
    step = other.latest_step()
    if step is None:
      raise ConfigError(f"train.resume_from={resume_from!r} holds no checkpoint; point it at a "
                        f"workdir (or its checkpoints/ folder) of an earlier run")
    return other, step
  return None, None


def config_to_dict(config) -> dict:
  return json.loads(config.to_json_best_effort())


def open_latest(checkpoint_path: str, flag: str = "--checkpoint"
                ) -> tuple[Checkpoints, int]:
  """A read-only manager over a training workdir (or its checkpoints/ folder) and its latest
  step; ConfigError naming `flag` when there is none. The caller closes the manager."""
  if not checkpoint_path:
    raise ConfigError(f"{flag} is empty; give a training workdir or its checkpoints/ folder")
  directory = checkpoints_dir(checkpoint_path)
  if not os.path.isdir(directory):
    raise ConfigError(f"{flag}={checkpoint_path!r} does not exist; give the workdir of a "
                      f"training run")
  manager = Checkpoints(directory, read_only=True)
  step = manager.latest_step()
  if step is None:
    manager.close()
    raise ConfigError(f"{flag}={checkpoint_path!r} holds no checkpoint; train first "
                      f"(python -m toolkit.train ... --workdir={checkpoint_path})")
  return manager, step
