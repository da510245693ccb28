"""Checkpoints through Orbax's CheckpointManager: the state (async), the config, the data
position and the state's fingerprints (toolkit/training/checkpoints/integrity.py) saved beside it; restores
onto any mesh by giving the abstract state with its shardings as the target.

Reading a step that is not as written (missing or unreadable files, garbage metadata, a
fingerprint that does not match) raises `DamagedCheckpoint`; toolkit/training/checkpoints/resume.py decides
what a run does about it (and holds the resume order). Writing one that fails (no space,
read-only, permissions, I/O) raises `storage.StorageError` naming the folder and the cause,
after removing the partial folder.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import time
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from models import kind_of, lora

from toolkit import workdir as workdir_lib
from toolkit.errors import ConfigError
from toolkit.training.checkpoints import integrity, storage
from toolkit.training.state import State

# Model fields that change parameter shapes or dtypes: a checkpoint restores only if they match.
SHAPE_FIELDS = ("kind", "vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim",
                "mlp_dim", "tie_embeddings", "param_dtype", "image_size", "patch_size",
                "channels", "num_classes", "pool", "n_experts", "moe_every", "lora_rank",
                "lora_targets")
# JSON files of a step (those present are checked): Orbax itself skips a garbled
# _CHECKPOINT_METADATA or _sharding with a logged error, so the check is ours.
_JSON_FILES = ("_CHECKPOINT_METADATA", "state/_METADATA", "state/_sharding", "config/metadata",
               "data/metadata", "integrity/metadata", "base/metadata")


class DamagedCheckpoint(ConfigError):
  """A step that cannot be restored as it was written."""

  def __init__(self, directory: str, step: int, cause: str):
    self.directory, self.step, self.cause = directory, step, cause
    super().__init__(f"checkpoint {directory} step {step} cannot be restored: {cause}")


@dataclasses.dataclass
class SaveTiming:
  """One save: when it started, how long the loop was blocked, when its files were written."""
  step: int
  started: float
  blocking_seconds: float = 0.0
  written: float | None = None

  @property
  def seconds(self) -> float | None:
    return None if self.written is None else self.written - self.started


def _state_handler() -> ocp.PyTreeCheckpointHandler:
  """The handler for the state. In one process every array is written from one replica:
  replica-parallel writing (Orbax's default) splits a replicated shard among its replicas,
  which pays only when they sit on different hosts, and compiles a slice per shard shape at the
  first save (0.9 s of the CPU demo's first save, all of it blocking the loop)."""
  if jax.process_count() > 1:
    return ocp.PyTreeCheckpointHandler()
  scalars = ocp.type_handlers.ScalarHandler()
  types = ocp.type_handlers.create_type_handler_registry(
      (jax.Array, ocp.type_handlers.ArrayHandler(use_replica_parallel=False)),
      (np.ndarray, ocp.type_handlers.NumpyHandler()), (np.number, scalars), (int, scalars),
      (float, scalars))
  return ocp.PyTreeCheckpointHandler(type_handler_registry=types)


def _handler_registry() -> ocp.handlers.DefaultCheckpointHandlerRegistry:
  registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
  state = _state_handler()
  registry.add("state", ocp.args.PyTreeSave, state)
  registry.add("state", ocp.args.PyTreeRestore, state)
  for item in ("config", "data", "integrity", "base"):
    registry.add(item, ocp.args.JsonSave)
    registry.add(item, ocp.args.JsonRestore)
  return registry


def _drop_read_only_notice(record: logging.LogRecord) -> bool:
  return not record.getMessage().startswith("Given directory is read only")


# One writer thread for every manager in the process: Orbax's asynchronous-save signals are
# process-wide, and two managers saving from two threads at once time out on them or remove each
# other's temporary folders (a population sweep saves K trials' managers in turn).
_WRITER = storage.Writer("checkpoint writer")


class Checkpoints:
  """A CheckpointManager over `directory` with items state / config / data / integrity."""

  def __init__(self, directory: str, keep: int = 3, read_only: bool = False):
    self.directory = workdir_lib.absolute(directory)
    self.timings: list[SaveTiming] = []
    # Read-only: the options Orbax would otherwise reset with a warning each, and its notice
    # that the directory is read only (asked for) left out of the command's output.
    options = ocp.CheckpointManagerOptions(
        max_to_keep=None if read_only else keep, save_interval_steps=0 if read_only else 1,
        create=not read_only, read_only=read_only, enable_async_checkpointing=True,
        cleanup_tmp_directories=not read_only,
        async_options=ocp.options.AsyncOptions(post_finalization_callback=self._written))
    if read_only:
      logging.getLogger("absl").addFilter(_drop_read_only_notice)
    try:
      self.manager = ocp.CheckpointManager(self.directory, options=options,
                                           handler_registry=_handler_registry())
    except OSError as e:
      raise storage.StorageError(f"checkpoint folder {self.directory} cannot be used "
                                 f"({storage.cause(e)}); {storage.fix(e)}") from None
    self._writer, self._failures = _WRITER, storage.KeptFailure()
    if workdir_lib.is_url(self.directory) and not read_only and jax.process_index() == 0:
      storage.remove_partial(self.directory)  # steps a killed run left without their marker

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def all_steps(self) -> list[int]:
    return sorted(self.manager.all_steps())

  def reload(self) -> None:
    """Reads the listing again (after steps were moved away)."""
    self.manager.reload()

  # --- writing: the loop copies the state into host memory; a thread hands it to Orbax ------

  def save(self, step: int, state: State, config: dict, data_position: dict) -> None:
    """Copies `state` into host memory (a snapshot the next step's donated buffers cannot
    touch), starts its fingerprints on the devices, and queues the write on the writer thread;
    returns once the copy is made, all the loop waits for (the time is in `timings`). Raises
    StorageError when an earlier save failed."""
    timing = SaveTiming(step=step, started=time.perf_counter())
    self._writer.wait()  # one snapshot at a time: the previous one is in Orbax's hands
    self._failures.raise_if_any()
    fingerprints = integrity.start(state)
    snapshot = _host_snapshot(state)
    timing.blocking_seconds = time.perf_counter() - timing.started
    self.timings.append(timing)
    write = lambda: self._write(step, snapshot, fingerprints, config, data_position)
    if snapshot is state:  # no host memory to copy into: Orbax copies, on this thread
      write()
      timing.blocking_seconds = time.perf_counter() - timing.started
    else:
      self._writer.submit(lambda: self._failures.run(write))

  def _write(self, step: int, state: State, fingerprints: integrity.Pending, config: dict,
             data_position: dict) -> None:
    try:
      items = dict(state=ocp.args.PyTreeSave(state), config=ocp.args.JsonSave(config),
                   data=ocp.args.JsonSave(data_position))
      collected = integrity.collect(fingerprints)
      items["integrity"] = ocp.args.JsonSave(collected)
      if (base := base_record(config, collected)) is not None:
        items["base"] = ocp.args.JsonSave(base)
      self.manager.save(step, args=ocp.args.Composite(**items), force=True)
    except jax.errors.JaxRuntimeError:
      raise  # a peer or the distributed runtime failed, not the storage: the command reports it
    except Exception as e:  # pylint: disable=broad-except  # Orbax/TensorStore raise many kinds
      raise self._write_failed(e) from None

  def _written(self) -> None:
    """Orbax's post-finalization callback (its background thread): the oldest save not yet
    marked has written its files; only the rename that commits it follows."""
    for timing in self.timings:
      if timing.written is None:
        timing.written = time.perf_counter()
        return

  def wait(self) -> None:
    """Blocks until the last save is on disk; StorageError if a save failed."""
    self._writer.wait()
    self._failures.raise_if_any()
    try:
      self.manager.wait_until_finished()
    except jax.errors.JaxRuntimeError:
      raise  # as in _write: the runtime's failure, not the storage's
    except Exception as e:  # pylint: disable=broad-except
      raise self._write_failed(e) from None

  def close(self, timeout_s: float | None = None) -> None:
    """Waits for the last save, then closes; StorageError if a save failed. With `timeout_s`
    (after a failure elsewhere) both are bounded and their errors dropped."""
    if timeout_s is not None:
      waited = storage.call_bounded(self.wait, timeout_s, "the last save")
      if isinstance(waited, TimeoutError):
        return  # still writing: leave it; its temporary folder is removed at the next start
      storage.call_bounded(self.manager.close, timeout_s, "closing the checkpoint manager")
      # A store that stopped answering would hold the listing forever.
      storage.call_bounded(lambda: storage.remove_partial(self.directory), timeout_s,
                           "removing partial saves")
      return
    # A store that stops answering during the last save would hold the run until the hang
    # watchdog: the wait is bounded by the storage deadline (train.storage_timeout_s) plus
    # twice the longest save this run finished, as a large checkpoint takes its time.
    finished = [t.seconds for t in self.timings if t.seconds is not None]
    limit = workdir_lib.deadline() + 2 * max(finished, default=0.0)
    try:
      workdir_lib.bounded(self.wait, "the last checkpoint save", seconds=limit)
    except TimeoutError as e:  # left writing: its temporary folder is removed at the next start
      raise storage.StorageError(
          f"the last checkpoint could not be written to {self.directory} "
          f"({storage.cause(e)}); the checkpoints committed before it are intact; "
          f"{storage.fix(e)}, then rerun the same command to resume") from None
    except BaseException:
      storage.call_bounded(self.manager.close, 60, "closing the checkpoint manager")
      raise
    try:
      # Orbax removes the temporary folders of an earlier run's unfinished saves in a thread it
      # awaits only at the next save; a run that never saved must not exit before it is done.
      getattr(self.manager, "_maybe_await_cleanup_tmp_directory", lambda: None)()
    finally:
      storage.call_bounded(self.manager.close, 60, "closing the checkpoint manager")

  def _write_failed(self, error: BaseException) -> storage.StorageError:
    removed = storage.remove_partial(self.directory)
    try:
      self.manager.reload()
      intact = self.all_steps()
    except Exception:  # pylint: disable=broad-except  # the listing itself may fail
      intact = []
    kept = ("no complete checkpoint is there yet" if not intact else
            f"checkpoint step {intact[0]} is intact" if len(intact) == 1 else
            f"checkpoint steps {', '.join(map(str, intact))} are intact")
    left = f"; removed the partial {', '.join(removed)}" if removed else ""
    return storage.StorageError(
        f"a checkpoint could not be written to {self.directory} ({storage.cause(error)}); "
        f"{kept}{left}; {storage.fix(error)}, then rerun the same command to resume")

  # --- reading ---------------------------------------------------------------------------------

  def _read(self, step: int, what: str, **items) -> dict:
    """Restores `items` of `step`; DamagedCheckpoint for anything that goes wrong."""
    self.check_metadata(step)
    try:
      return self.manager.restore(step, args=ocp.args.Composite(**items))
    except Exception as e:  # pylint: disable=broad-except  # TensorStore raises bare Exception
      raise DamagedCheckpoint(self.directory, step, f"{what}: {storage.cause(e)}") from None

  def check_metadata(self, step: int) -> None:
    """DamagedCheckpoint when one of the step's JSON metadata files does not parse."""
    folder = epath.Path(self.directory) / str(step)
    for name in _JSON_FILES:
      path = folder / name
      try:
        if path.exists():
          json.loads(path.read_text())
      except (OSError, ValueError) as e:
        raise DamagedCheckpoint(self.directory, step, f"{name} is unreadable "
                                f"({storage.cause(e)})") from None

  def has_fingerprints(self, step: int) -> bool:
    """False for checkpoints written before fingerprints existed (they restore unverified)."""
    return (epath.Path(self.directory) / str(step) / "integrity").exists()

  def state_parts(self, step: int) -> set[str] | None:
    """The top-level entries of `step`'s state ("step", "params", "opt_state", "rng", and
    "reference" for a state with a frozen copy), from its fingerprints; None for a checkpoint
    written before fingerprints existed (and before frozen copies: it holds none)."""
    if not self.has_fingerprints(step):
      return None
    saved = self._read(step, "its fingerprints", integrity=ocp.args.JsonRestore())["integrity"]
    return {path.split("/")[0] for path in saved}

  def saved_config(self, step: int) -> dict:
    return self._read(step, "its config", config=ocp.args.JsonRestore())["config"]

  def restore(self, step: int, abstract_state: State, agree=None,
              partial: bool = False) -> tuple[State, dict]:
    """Restores `step` into the shardings carried by `abstract_state` and checks its
    fingerprints; returns (state, data position). `agree(damage or None, self, step)`, when
    given, runs on every process between reading and checking (which is a collective).
    `partial`: `abstract_state` names only some of the saved arrays (the others are not
    read)."""
    items = dict(state=_tree_restore(abstract_state, partial), data=ocp.args.JsonRestore())
    if self.has_fingerprints(step):
      items["integrity"] = ocp.args.JsonRestore()
    restored, damage = {}, None
    try:
      restored = self._read(step, "its state", **items)
    except DamagedCheckpoint as e:
      damage = e
    if agree is not None:
      agree(damage, self, step)
    elif damage is not None:
      raise damage
    if "integrity" in items:
      self._verify(step, restored["state"], restored["integrity"])
    return restored["state"], restored["data"]

  def base(self, step: int) -> dict | None:
    """The frozen base a LoRA checkpoint's adapters apply to (`base_record`), or None for a
    checkpoint without adapters."""
    if not (epath.Path(self.directory) / str(step) / "base").exists():
      return None
    return self._read(step, "its base record", base=ocp.args.JsonRestore())["base"]

  def restore_params(self, step: int, abstract_params) -> Any:
    """Restores only the parameters of `step` (no optimizer state is read), into the
    shardings `abstract_params` carry, and checks their fingerprints: what inference needs."""
    items = dict(state=_tree_restore({"params": abstract_params}, partial=True))
    if self.has_fingerprints(step):
      items["integrity"] = ocp.args.JsonRestore()
    restored = self._read(step, "its parameters", **items)
    params = restored["state"]["params"]
    if "integrity" in items:
      self._verify(step, params, restored["integrity"], prefix="params/")
    return params

  def _verify(self, step: int, tree, expected: dict, prefix: str = "") -> None:
    bad = integrity.mismatches(tree, expected, prefix)
    if bad:
      raise DamagedCheckpoint(self.directory, step, f"the fingerprint of {bad[0]} does not "
                              f"match the one saved with it" + (
                                  f" (and {len(bad) - 1} more arrays)" if len(bad) > 1 else ""))


def _host_snapshot(state: State) -> State:
  """`state` copied into pinned host memory with the same shardings, once the copy is made;
  `state` itself where the devices have no such memory, or with several processes."""
  device = next(iter(jax.tree.leaves(state)[0].sharding.device_set))
  if "pinned_host" not in {memory.kind for memory in device.addressable_memories()}:
    return state
  if jax.process_count() > 1:
    # Untested with several processes: a 4-process run stalled after its first save this way
    # (tests/toolkit/pod/test_multiprocess.py); there Orbax copies, in the loop, as before.
    return state
  snapshot = jax.device_put(state, jax.tree.map(
      lambda x: x.sharding.with_memory_kind("pinned_host"), state))
  return jax.block_until_ready(snapshot)


def _tree_restore(target, partial: bool = False) -> ocp.args.PyTreeRestore:
  return ocp.args.PyTreeRestore(item=target, partial_restore=partial,
                                restore_args=ocp.checkpoint_utils.construct_restore_args(target))


def base_record(config: dict, fingerprints: dict[str, int]) -> dict | None:
  """What names the frozen base of a state with LoRA adapters (None without adapters): where
  its weights came from (`train.init_from`, or "" for a base drawn from `seed`), and one
  fingerprint of all its arrays (`base_fingerprint`), which a base read again must match."""
  params = {path[len("params/"):]: value for path, value in fingerprints.items()
            if path.startswith("params/")}
  if not any(lora.is_adapter(path) for path in params):
    return None
  frozen = {path: value for path, value in params.items() if not lora.is_adapter(path)}
  return {"init_from": config.get("train", {}).get("init_from", ""),
          "seed": config.get("seed"), "arrays": len(frozen),
          "fingerprint": _combined(frozen)}


def base_fingerprint(params) -> str:
  """The fingerprint `base_record` gives the frozen (non-adapter) arrays of `params`."""
  return _combined({path: value for path, value in integrity.fingerprints(params).items()
                    if not lora.is_adapter(path)})


def _combined(fingerprints: dict[str, int]) -> str:
  text = "\n".join(f"{path} {value}" for path, value in sorted(fingerprints.items()))
  return hashlib.sha256(text.encode()).hexdigest()[:16]


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
  candidate = workdir_lib.join(path, "checkpoints")
  return candidate if workdir_lib.isdir(candidate) else path


def config_to_dict(config) -> dict:
  return json.loads(config.to_json_best_effort())


def open_latest(checkpoint_path: str, flag: str = "--checkpoint"
                ) -> tuple[Checkpoints, int]:
  """A read-only manager over a training workdir (or its checkpoints/ folder) and its latest
  step; ConfigError naming `flag` when there is none. The caller closes the manager."""
  if not checkpoint_path:
    raise ConfigError(f"{flag} is empty; give a training workdir or its checkpoints/ folder")
  if (why := workdir_lib.problem(checkpoint_path, flag, reach=True)) is not None:
    raise ConfigError(why)
  directory = checkpoints_dir(checkpoint_path)
  if not workdir_lib.isdir(directory):
    raise ConfigError(f"{flag}={checkpoint_path!r} does not exist; give the workdir of a "
                      f"training run")
  manager = Checkpoints(directory, read_only=True)
  step = manager.latest_step()
  if step is None:
    manager.close()
    raise ConfigError(f"{flag}={checkpoint_path!r} holds no checkpoint; train first "
                      f"(python -m toolkit.train ... --workdir={checkpoint_path})")
  return manager, step
