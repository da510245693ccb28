"""Where a run starts, in this order: the workdir's newest checkpoint that restores, else the
latest checkpoint of `train.resume_from` (another run's workdir), else the weights of
`train.init_from` with a fresh optimizer (init_from.py), else a fresh state.

A damaged newest checkpoint (checkpoint.DamagedCheckpoint: files missing or unreadable, garbage
metadata, fingerprints that do not match) costs the steps since the one before it, not the
run: once an older step restores, each damaged newer one is moved into
<workdir>/damaged_checkpoints/ (renamed, never deleted) with one warning line naming the step
and the cause. When none restores, the run stops with one error line listing each step's cause
and renames nothing. Checkpoints of `train.resume_from` are never skipped or moved: damage there
is an error, not a silent start from somewhere else. With a local checkpoint tier
(tiers.py) its steps newer than the workdir's newest go first; when none of them
restores, one warning line, and the workdir's checkpoints as above.
"""
from __future__ import annotations

import os
from collections.abc import Callable

import jax
import ml_collections
import numpy as np
from jax.experimental import multihost_utils

from toolkit import hf
from toolkit.errors import ConfigError
from toolkit.training import init_from, state as state_lib, step as step_lib
from toolkit.training.checkpoints import checkpoint
from toolkit.training.checkpoints import host_shards, storage, tiers
from toolkit.training.programs import Programs
from toolkit.training.setup import Setup


def restore_or_init(config: ml_collections.ConfigDict, setup: Setup,
                    own: checkpoint.Checkpoints, log: Callable[[str], None],
                    hf_folder: hf.HFFolder | None = None,
                    programs: Programs | None = None,
                    local: checkpoint.Checkpoints | None = None
                    ) -> tuple[state_lib.State, dict | None]:
  """(state, data position): see the module docstring; the position is None when the run
  starts at step 0. `hf_folder` is `init_from.source`'s answer (checked, or None); a fresh
  state's init program comes from `programs` when it holds it. `local`, the local tier
  (toolkit/training/checkpoints/tiers.py), goes first when it holds a step newer than `own`'s."""
  for line in getattr(local, "warnings", ()):
    log(line)
  if newer := tiers.newer_steps(local, own):
    try:
      state, position = restore_newest_good(local, setup, log, newer)
    except NothingRestores as e:
      # Set aside, so that the steps trained again can be saved there anew.
      where = [set_aside(local, step) for step in newer][-1]
      local.reload()
      log(f"warning: no step of the local tier newer than the workdir's restores ({e.causes}); "
          f"moved {'it' if len(newer) == 1 else 'them'} to {os.path.dirname(where)} and "
          f"resumed from the workdir's checkpoints")
    else:
      if (line := schedule_change(config, local, int(jax.device_get(state["step"])))):
        log(line)
      return state, position
  if own.all_steps():
    state, position = restore_newest_good(own, setup, log)
    if (line := schedule_change(config, own, int(jax.device_get(state["step"])))) is not None:
      log(line)
    return state, position
  if config.train.resume_from:
    return restore_other_run(config.train.resume_from, setup, log)
  if hf_folder is not None:
    log(f"initializing from {hf_folder.path} (train.init_from), fresh optimizer")
    return init_from.initial_state(hf_folder, setup, config.seed), None
  return state_lib.create(setup.spec.model, setup.optimizer, setup.layout, config.seed,
                          programs), None


def restore_newest_good(checkpoints: checkpoint.Checkpoints, setup: Setup,
                        log: Callable[[str], None], steps: list[int] | None = None
                        ) -> tuple[state_lib.State, dict]:
  """The newest step of `checkpoints` (of `steps`, when given) that restores; the damaged
  newer ones are set aside."""
  damaged: list[checkpoint.DamagedCheckpoint] = []
  for step in reversed(checkpoints.all_steps() if steps is None else steps):
    try:
      state, data_position = restore_step(checkpoints, step, setup, own=True)
    except checkpoint.DamagedCheckpoint as e:
      damaged.append(e)
      continue
    for bad in damaged:
      where = set_aside(checkpoints, bad.step)
      log(f"warning: checkpoint step {bad.step} is damaged ({bad.cause}); moved it to "
          f"{where} and resumed from step {step}")
    if damaged:
      checkpoints.reload()  # forget the steps just moved
    log(restored_line(checkpoints, step))
    return state, data_position
  raise NothingRestores(checkpoints.directory,
                        "; ".join(f"step {e.step}: {e.cause}" for e in damaged))


class NothingRestores(ConfigError):
  """No step of a checkpoint folder restores."""

  def __init__(self, directory: str, causes: str):
    super().__init__(f"no checkpoint in {directory} can be restored ({causes}); nothing was "
                     f"moved. They are damaged or were written by another config: move that "
                     f"folder away to start from scratch")
    self.causes = causes


def schedule_length(config: dict) -> int:
  """The learning-rate schedule's length in steps: optimizer.schedule_steps, else train.steps
  (a config as a dict; saved before schedule_steps existed: train.steps)."""
  return config.get("optimizer", {}).get("schedule_steps") or config["train"]["steps"]


def schedule_change(config: ml_collections.ConfigDict, own: checkpoint.Checkpoints,
                    step: int) -> str | None:
  """A warning when this run's schedule is not the one the checkpoint at `step` trained on
  (train.steps changed, say): warmup and decay stretch and the learning rate jumps. None at
  step 0 (an imported model's checkpoint: no schedule has begun)."""
  if step == 0:
    return None
  try:
    saved = schedule_length(own.saved_config(step))
  except (checkpoint.DamagedCheckpoint, KeyError):
    return None  # restored, so readable; a config without train.steps has nothing to compare
  now = schedule_length(checkpoint.config_to_dict(config))
  if saved == now:
    return None
  # Step `step + 1` applies the schedule's value at count `step` (optax counts from 0).
  before, after = (float(step_lib.learning_rate_schedule(config.optimizer, n)(step))
                   for n in (saved, now))
  return (f"warning: the learning-rate schedule was {saved} steps long and is {now} now "
          f"(train.steps or optimizer.schedule_steps changed): warmup and decay stretch, and "
          f"step {step + 1} trains at lr {after:.2e} instead of {before:.2e}; to keep the "
          f"schedule the checkpoint trained on, add --config.optimizer.schedule_steps={saved}")


def restore_other_run(resume_from: str, setup: Setup, log: Callable[[str], None]
                      ) -> tuple[state_lib.State, dict]:
  """The latest checkpoint of another run's workdir (or checkpoints/ folder); any damage is
  an error naming train.resume_from."""
  other = checkpoint.Checkpoints(checkpoint.checkpoints_dir(resume_from), read_only=True)
  try:
    step = other.latest_step()
    if step is None:
      raise ConfigError(f"train.resume_from={resume_from!r} holds no checkpoint; point it at a "
                        f"workdir (or its checkpoints/ folder) of an earlier run")
    try:
      restored = restore_step(other, step, setup)
    except checkpoint.DamagedCheckpoint as e:
      raise ConfigError(f"train.resume_from={resume_from!r}: {e}; point it at another run (its "
                        f"older checkpoints are not used in its place)") from None
    log(restored_line(other, step))
    return restored
  finally:
    other.close(timeout_s=60)


def restore_step(checkpoints: checkpoint.Checkpoints, step: int, setup: Setup,
                 own: bool = False) -> tuple[state_lib.State, dict]:
  """Restores one step after checking that its model fits this config (a different model is a
  ConfigError, not damage); every process agrees on whether it restored.

  A frozen reference copy (state.py) the config holds and the checkpoint does not, or the
  other way round: the run's `own` checkpoints are refused (its reference would change
  mid-run); another run's (train.resume_from) restore without it, and a copy of the restored
  weights, where this run starts, becomes the reference."""
  where = f"{checkpoints.directory} step {step}"
  saved, parts, damage = {}, None, None
  try:
    saved = checkpoints.saved_config(step)
    parts = checkpoints.state_parts(step)
  except checkpoint.DamagedCheckpoint as e:
    damage = e
  _agree(damage, checkpoints, step)
  checkpoint.check_compatible(saved, setup.spec.model, where)
  abstract = setup.layout.abstract
  saved_copy = "reference" in (parts or ())
  if saved_copy == setup.layout.reference:
    return checkpoints.restore(step, abstract, agree=_agree)
  if own:
    raise ConfigError(_reference_changed(saved, setup, where, saved_copy))
  state, position = checkpoints.restore(
      step, {k: v for k, v in abstract.items() if k != "reference"}, agree=_agree,
      partial=saved_copy)
  if setup.layout.reference:
    state["reference"] = jax.jit(state_lib.frozen_copy,
                                 out_shardings=setup.layout.shardings["reference"])(
                                     state["params"])
  return state, position


def _reference_changed(saved: dict, setup: Setup, where: str, saved_copy: bool) -> str:
  task = setup.spec.task
  section = saved.get(task, {})
  written = [f"--config.{task}.reference={section.get('reference', 'auto')!r}"]
  if task == "grpo":  # "auto" keeps a copy for a KL penalty without adapters
    written.append(f"--config.grpo.beta={section.get('beta', 0.0)}")
  held = "holds a frozen reference copy" if saved_copy else "holds no frozen reference copy"
  return (f"checkpoint {where} {held} and this config's {task} settings "
          f"{'keep none' if saved_copy else 'keep one'}: the reference would change mid-run; "
          f"resume with the settings it was written with ({' '.join(written)}), or train into "
          f"a new --workdir (train.resume_from starts there from its weights)")


def restored_line(checkpoints: checkpoint.Checkpoints, step: int) -> str:
  verified = "" if checkpoints.has_fingerprints(step) else (
      " (written before fingerprints existed: not verified)")
  return f"restored step {step} from {checkpoints.directory}{verified}" + getattr(
      checkpoints, "note", "")


def _agree(damage: checkpoint.DamagedCheckpoint | None, checkpoints: checkpoint.Checkpoints,
           step: int) -> None:
  """Raises `damage`, or DamagedCheckpoint on every process when another process found some,
  so all of them go on to the same step (the restores that follow are collectives)."""
  if jax.process_count() > 1:
    failed = multihost_utils.process_allgather(np.int32(damage is not None))
    if damage is None and np.any(failed):
      damage = checkpoint.DamagedCheckpoint(checkpoints.directory, step,
                                            "another process could not read it")
  if damage is not None:
    raise damage


def set_aside(checkpoints: checkpoint.Checkpoints, step: int) -> str:
  """Process 0 moves the step folder away; every process waits for it. (The local tier of
  several processes: each process moves its own.)"""
  if isinstance(checkpoints, host_shards.HostShards):
    return checkpoints.set_aside(step)
  where = ""
  if jax.process_index() == 0:
    where = storage.set_aside(checkpoints.directory, step)
  if jax.process_count() > 1:
    multihost_utils.sync_global_devices(f"set aside checkpoint step {step}")
  return where
