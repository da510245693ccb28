"""The local checkpoint tier of a run of several processes (tiers.py opens it; one process uses
an Orbax folder instead): each process writes the shards its own devices hold into its own
folder, `<train.local_checkpoint_dir>/process_<i>` on its host, and beside them a copy of the
previous process's shards, moved onto its devices by one collective before the write. A host
that is lost, or replaced by one with an empty disk, then costs no step: its shards are on the
next process's host.

A step restores when the shards of every process are on some host: its own copy, else the copy
on the next process's host. Each array is assembled from the own copies; the shards of a process
that lacks its own travel back from the next process with the reverse collective. The state's
fingerprints (integrity.py) are checked as for the persistent tier, and a checksum over each
copy's bytes tells a damaged copy from a good one. Each process keeps its last `keep` steps.
A step written by another number of processes, or missing a process's shards on both hosts that
held them (a host and its successor lost), is set aside into `process_<i>/damaged_checkpoints`
with one warning, and the workdir's checkpoints serve.

Why not Orbax here (the persistent tier and the one-process local tier are Orbax's): Orbax
0.12.8's emergency managers (`experimental.emergency`: the replicator and the p2p manager)
restore a process's shards from another data-parallel replica that holds the same ones, over
slices or a replica axis; a state sharded over every device (fsdp) has no such replica, so
here each shard is copied to a peer on purpose, and the copies, which are another process's
host arrays, are written as plain files.
"""
from __future__ import annotations

import json
import os
import shutil
import time
import zlib

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from toolkit.training.checkpoints import integrity, storage
from toolkit.training.checkpoints.checkpoint import DamagedCheckpoint, SaveTiming

_OWN, _PEER = "own", "peer"   # a step folder's two copies: this process's shards, the previous's


class HostShards:
  """The local tier of one process of a multi-process run (see the module docstring); the
  methods the loop and resume.py use of `checkpoint.Checkpoints`. `all_steps`, `saved_config`,
  `state_parts`, `restore` and `open` are collectives: every process calls them in turn."""

  def __init__(self, root: str, keep: int):
    self.index, self.count = jax.process_index(), jax.process_count()
    self.folder = os.path.join(root, f"process_{self.index}")
    self.directory = os.path.join(self.folder, "checkpoints")
    self.keep, self.timings = keep, []
    self.warnings: list[str] = []   # resume.py logs them
    self.note = ""                  # appended to the "restored step" line
    self._writer, self._failures = storage.Writer("local tier writer"), storage.KeptFailure()
    self._summaries: dict[int, dict | None] = {}
    try:
      os.makedirs(self.directory, exist_ok=True)
      for name in os.listdir(self.directory):
        if name.endswith(".partial"):   # a write that a crash interrupted
          shutil.rmtree(os.path.join(self.directory, name), ignore_errors=True)
    except OSError as e:
      raise storage.StorageError(f"local checkpoint folder {self.directory} cannot be used "
                                 f"({storage.cause(e)}); {storage.fix(e)}") from None

  # --- which steps restore ---------------------------------------------------------------------

  def _held(self) -> dict[str, list]:
    """Step -> [own copy held, peer copy held, processes that wrote it], on this host."""
    held = {}
    for name in os.listdir(self.directory):
      if not name.isdigit():
        continue
      copies = [os.path.exists(os.path.join(self.directory, name, f"{c}.json"))
                for c in (_OWN, _PEER)]
      held[name] = copies + [_processes(os.path.join(self.directory, name))]
    return held

  def _listing(self) -> tuple[list[int], dict[int, str]]:
    """(the steps whose every process's shards some host holds, {unusable step: why})."""
    everyone = allgather_json(self._held())
    complete, unusable = [], {}
    for name in sorted({s for held in everyone for s in held}, key=int):
      counts = {held[name][2] for held in everyone if name in held} - {None}
      if counts and counts != {self.count}:
        unusable[int(name)] = (f"written by {max(counts)} processes, this run has {self.count}")
        continue
      lost = [o for o in range(self.count)
              if not everyone[o].get(name, [False])[0]
              and not everyone[(o + 1) % self.count].get(name, [False, False])[1]]
      if lost:
        unusable[int(name)] = (f"the shards of process {lost[0]} are on no host (neither its "
                               f"own folder nor process {(lost[0] + 1) % self.count}'s holds "
                               f"them)" + (f", nor those of {len(lost) - 1} more" if
                                           len(lost) > 1 else ""))
      else:
        complete.append(int(name))
    return complete, unusable

  def open(self) -> "HostShards":
    """Sets aside the steps no restart can use (warnings for resume.py to log)."""
    _, unusable = self._listing()
    for step, why in unusable.items():
      where = self.set_aside(step)
      self.warnings.append(f"warning: local checkpoint step {step} cannot be used ({why}); "
                           f"moved it to {os.path.dirname(where)}")
    return self

  def all_steps(self) -> list[int]:
    return self._listing()[0]

  def reload(self) -> None:
    """Nothing is cached between listings (for the interface of checkpoint.Checkpoints)."""

  def set_aside(self, step: int) -> str:
    """Moves this process's folder of `step` (if any) into damaged_checkpoints/."""
    self._summaries.pop(step, None)
    if os.path.isdir(os.path.join(self.directory, str(step))):
      return storage.set_aside(self.directory, step)
    return os.path.join(self.folder, "damaged_checkpoints", str(step))

  # --- writing ---------------------------------------------------------------------------------

  def save(self, step: int, state, config: dict, data_position: dict) -> None:
    """Moves a copy of every shard to the next process (a collective), copies both into host
    memory and queues the write; returns once the copies are made (the time is in
    `timings`). Raises StorageError when an earlier save failed."""
    timing = SaveTiming(step=step, started=time.perf_counter())
    self._writer.wait()
    self._failures.raise_if_any()
    self._summaries.pop(step, None)
    paths, leaves = _flatten(state)
    fingerprints = integrity.start(state)
    _meet(f"local checkpoint step {step}")
    moved = jax.device_put(leaves, [_rotated(x.sharding) for x in leaves])
    own, peer = _host_shards(leaves), _host_shards(moved)
    previous = (self.index - 1) % self.count
    positions = allgather_json(data_position)
    arrays = [(path, x.shape, x.dtype) for path, x in zip(paths, leaves)]
    timing.blocking_seconds = time.perf_counter() - timing.started
    self.timings.append(timing)

    def write():
      common = {"step": step, "processes": self.count, "config": config,
                "fingerprints": integrity.collect(fingerprints)}
      self._commit(step, {
          _OWN: ({**common, "process": self.index, "position": data_position}, own),
          _PEER: ({**common, "process": previous, "position": positions[previous]}, peer)},
          arrays)
      timing.written = time.perf_counter()
    self._writer.submit(lambda: self._failures.run(write))

  def _commit(self, step: int, copies: dict, arrays: list) -> None:
    partial = os.path.join(self.directory, f"{step}.partial")
    final = os.path.join(self.directory, str(step))
    try:
      shutil.rmtree(partial, ignore_errors=True)
      os.makedirs(partial)
      for name, (meta, shards) in copies.items():
        _write_copy(os.path.join(partial, name), meta, arrays, shards)
      if os.path.isdir(final):  # a step trained again after a fallback
        shutil.rmtree(final)
      os.replace(partial, final)
      steps = sorted(int(n) for n in os.listdir(self.directory) if n.isdigit())
      for old in steps[:-self.keep]:
        shutil.rmtree(os.path.join(self.directory, str(old)), ignore_errors=True)
    except OSError as e:
      shutil.rmtree(partial, ignore_errors=True)
      raise storage.StorageError(
          f"a local checkpoint could not be written to {self.directory} ({storage.cause(e)}); "
          f"removed the partial step {step}; {storage.fix(e)}, then rerun the same command to "
          f"resume") from None

  def wait(self) -> None:
    self._writer.wait()
    self._failures.raise_if_any()

  def close(self, timeout_s: float | None = None) -> None:
    """Waits for the last write (at most `timeout_s`, its failure dropped, after a failure
    elsewhere); StorageError if a write failed."""
    if timeout_s is not None:
      self._writer.wait(timeout_s)
      return
    self.wait()

  # --- reading ---------------------------------------------------------------------------------

  def _read(self, step: int, copy: str) -> tuple[dict | None, dict, str | None]:
    """(metadata, path -> {index: host array}, None), or (None, {}, why it cannot be read)."""
    folder = os.path.join(self.directory, str(step))
    expected = self.index if copy == _OWN else (self.index - 1) % self.count
    try:
      meta, arrays = _read_copy(os.path.join(folder, copy))
    except FileNotFoundError:
      return None, {}, f"is not on process {self.index}'s host"
    except (OSError, ValueError, KeyError) as e:
      return None, {}, f"on process {self.index}'s host is damaged ({storage.cause(e)})"
    if meta.get("process") != expected or meta.get("step") != step:
      return None, {}, f"on process {self.index}'s host is another's"
    return meta, arrays, None

  def _summary(self, step: int) -> dict:
    """The config and fingerprints of `step`, from whichever process holds a copy."""
    if step not in self._summaries:
      mine = None
      for copy in (_OWN, _PEER):
        path = os.path.join(self.directory, str(step), f"{copy}.json")
        try:
          with open(path, encoding="utf-8") as f:
            meta = json.load(f)
          mine = {"config": meta["config"], "fingerprints": meta["fingerprints"]}
          break
        except (OSError, ValueError, KeyError):
          continue
      self._summaries[step] = next((s for s in allgather_json(mine) if s is not None), None)
    if self._summaries[step] is None:
      raise DamagedCheckpoint(self.directory, step, "no host holds its metadata")
    return self._summaries[step]

  def saved_config(self, step: int) -> dict:
    return self._summary(step)["config"]

  def state_parts(self, step: int) -> set[str]:
    return {path.split("/")[0] for path in self._summary(step)["fingerprints"]}

  def has_fingerprints(self, step: int) -> bool:
    del step
    return True

  def restore(self, step: int, abstract_state, agree=None, partial: bool = False):
    """(state, data position) of `step` in the shardings of `abstract_state` (see the module
    docstring); `agree` as for checkpoint.Checkpoints.restore."""
    del partial  # the arrays are read by path: those `abstract_state` names
    paths, abstract = _flatten(abstract_state)
    meta, own, why = self._read(step, _OWN)
    why = why or _layout_problem(own, paths, abstract, self.index)
    causes = allgather_json(why)
    lacking = [o for o, c in enumerate(causes) if c is not None]
    peer_meta, peer, peer_why = None, {}, None
    if (self.index - 1) % self.count in lacking:
      peer_meta, peer, peer_why = self._read(step, _PEER)
      peer_why = peer_why or _layout_problem(peer, paths, abstract, self.index - 1, rotated=True)
    peer_causes = allgather_json(peer_why) if lacking else [None] * self.count
    damage = None
    for o in lacking:
      if (held := peer_causes[(o + 1) % self.count]) is not None:
        damage = DamagedCheckpoint(self.directory, step, (
            f"the shards of process {o}: its own copy {causes[o]}, the copy {held}"))
        break
    if agree is not None:
      agree(damage, self, step)
    elif damage is not None:
      raise damage
    if lacking:
      _meet(f"local checkpoint step {step} from the peers' copies")
    leaves = [_assemble(x, own.get(path), peer.get(path), lacking) for path, x in
              zip(paths, abstract)]
    state = jax.tree.unflatten(jax.tree.structure(abstract_state), leaves)
    bad = integrity.mismatches(state, self._summary(step)["fingerprints"])
    if bad:
      raise DamagedCheckpoint(self.directory, step, f"the fingerprint of {bad[0]} does not "
                              f"match the one saved with it")
    positions = allgather_json({"own": (meta or {}).get("position"),
                                 "peer": (peer_meta or {}).get("position")})
    mine = positions[self.index]["own"]
    if mine is None:
      mine = positions[(self.index + 1) % self.count]["peer"]
    self.note = "".join(f" (process {o}'s shards from the copy on process "
                        f"{(o + 1) % self.count}'s host)" for o in lacking)
    return state, mine


# --- arrays: the shards of this process, moved between processes, assembled -----------------

def _flatten(tree) -> tuple[list[str], list]:
  flat = jax.tree_util.tree_flatten_with_path(tree)[0]
  return [integrity._path(path) for path, _ in flat], [x for _, x in flat]  # pylint: disable=protected-access


def _by_process() -> list[list]:
  """Every process's devices (by id), in process order."""
  by_process: dict[int, list] = {}
  for device in sorted(jax.devices(), key=lambda d: d.id):
    by_process.setdefault(device.process_index, []).append(device)
  return [by_process[p] for p in sorted(by_process)]


def _next(device, by_process: list[list]):
  """The device in `device`'s place on the next process."""
  place = by_process[device.process_index].index(device)
  return by_process[(device.process_index + 1) % len(by_process)][place]


def _meet(what: str) -> None:
  """Every process passes a barrier before a collective that moves copies. The devices in their
  rotated order are a new group, and Gloo (the collectives of CPU processes) gives a new group
  30 s to assemble, hard-coded in XLA: on jaxlib 0.10.2 a process 40 s late stopped the other
  with "Gloo context initialization failed", the error that stopped the first local save of a
  2-process pod under CI's load. The barrier is a collective over the group every step uses, which waits as
  long as it takes (the hang watchdog bounds it), and it returns once each device has run what
  was queued before it."""
  multihost_utils.sync_global_devices(what)


def _rotated(sharding) -> NamedSharding:
  """`sharding` with each device's shard on the device in its place on the next process:
  device_put into it is the collective that moves the copies (a replicated shard stays where
  a replica is: its copies are equal)."""
  if not isinstance(sharding, NamedSharding):
    raise TypeError(f"the local tier of a multi-process run needs NamedShardings, not "
                    f"{sharding!r}")
  by_process, mesh = _by_process(), sharding.mesh
  devices = np.vectorize(lambda d: _next(d, by_process), otypes=[object])(mesh.devices)
  return NamedSharding(Mesh(devices, mesh.axis_names, axis_types=mesh.axis_types),
                       sharding.spec, memory_kind=sharding.memory_kind)


def _key(index: tuple, shape: tuple) -> tuple:
  """A shard's index (a tuple of slices) as ((start, stop), ...), hashable and JSON-able."""
  return tuple((s.start or 0, dim if s.stop is None else s.stop) for s, dim in zip(index, shape))


def _host_shards(arrays: list) -> list[dict]:
  """Per array, {index: host copy} of the shards this process's devices hold (a replicated
  shard once), in one transfer."""
  shards = []
  for x in arrays:
    unique = {}
    for shard in x.addressable_shards:
      unique.setdefault(_key(shard.index, x.shape), shard.data)
    shards.append(unique)
  keys = [list(s) for s in shards]
  values = jax.device_get([list(s.values()) for s in shards])
  return [dict(zip(k, v)) for k, v in zip(keys, values)]


def _needed(x, sharding) -> set[tuple]:
  return {_key(index, x.shape)
          for index in sharding.addressable_devices_indices_map(x.shape).values()}


def _layout_problem(arrays: dict, paths: list[str], abstract: list, process: int,
                    rotated: bool = False) -> str | None:
  """Why the copy `arrays` (of process `process`) cannot give this layout's shards, or None."""
  if not arrays:
    return None
  for path, x in zip(paths, abstract):
    sharding = _rotated(x.sharding) if rotated else x.sharding
    held = arrays.get(path, {})
    first = next(iter(held.values()), None)
    if first is None or first.dtype != x.dtype or not _needed(x, sharding) <= set(held):
      return (f"of process {process % jax.process_count()} was written for another layout "
              f"({path} differs: another mesh, sharding or model)")
  return None


def _assemble(x, own: dict | None, peer: dict | None, lacking: list[int]) -> jax.Array:
  """The array `x` (abstract, with its sharding) from the own copies; for the processes in
  `lacking`, from the copies their next processes hold, moved back as one row per device (no
  replicas: a replicated shard moves like any other)."""
  def shard(copy, index):
    return copy[_key(index, x.shape)]
  if not lacking:
    return jax.make_array_from_callback(x.shape, x.sharding, lambda index: shard(own, index))
  me, by_process = jax.process_index(), _by_process()
  devices = [d for process in by_process for d in process]
  indices = x.sharding.devices_indices_map(x.shape)
  rows_shape = (len(devices), *x.sharding.shard_shape(x.shape))
  held = peer if (me - 1) % len(by_process) in lacking else None

  def row(index):  # row i of the rotated rows: device i's shard, held by the next process
    i = index[0].start
    if held is None:
      return np.zeros((1, *rows_shape[1:]), x.dtype)
    return shard(held, indices[devices[i]])[None]
  spec = PartitionSpec("devices")
  moved = jax.make_array_from_callback(rows_shape, NamedSharding(
      Mesh(np.array([_next(d, by_process) for d in devices]), ("devices",)), spec), row)
  back = jax.device_put(moved, NamedSharding(Mesh(np.array(devices), ("devices",)), spec))
  rows = {s.device: s.data for s in back.addressable_shards}
  local = [d for d in devices if d.process_index == me]
  return jax.make_array_from_single_device_arrays(x.shape, x.sharding, [
      rows[d].reshape(rows_shape[1:]) if me in lacking else
      jax.device_put(shard(own, indices[d]), d) for d in local])


# --- files: a copy is NAME.json (what) and NAME.bin (the bytes) -------------------------------

def _write_copy(base: str, meta: dict, arrays: list, shards: list[dict]) -> None:
  entries, offset, crc = [], 0, 0
  with open(base + ".bin", "wb") as f:
    for (path, shape, dtype), held in zip(arrays, shards):
      records = []
      for index, data in held.items():
        raw = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
        f.write(raw)
        crc = zlib.crc32(raw, crc)
        records.append({"index": index, "offset": offset, "bytes": raw.size})
        offset += raw.size
      entries.append({"path": path, "shape": list(shape), "dtype": jnp.dtype(dtype).name,
                      "shards": records})
  with open(base + ".json", "w", encoding="utf-8") as f:
    json.dump({**meta, "arrays": entries, "bytes": offset, "crc32": crc}, f)


def _read_copy(base: str) -> tuple[dict, dict]:
  with open(base + ".json", encoding="utf-8") as f:
    meta = json.load(f)
  data = np.fromfile(base + ".bin", dtype=np.uint8)
  if data.size != meta["bytes"] or zlib.crc32(data) != meta["crc32"]:
    raise ValueError(f"{os.path.basename(base)}.bin does not match its checksum")
  arrays = {}
  for entry in meta["arrays"]:
    dtype = jnp.dtype(entry["dtype"])
    arrays[entry["path"]] = {
        tuple(map(tuple, r["index"])): data[r["offset"]:r["offset"] + r["bytes"]].view(
            dtype).reshape([b - a for a, b in r["index"]]) for r in entry["shards"]}
  return meta, arrays


def _processes(folder: str) -> int | None:
  for copy in (_OWN, _PEER):
    try:
      with open(os.path.join(folder, f"{copy}.json"), encoding="utf-8") as f:
        return json.load(f)["processes"]
    except (OSError, ValueError, KeyError):
      continue
  return None


def allgather_json(value) -> list:
  """`value` (JSON) of every process, in process order."""
  data = np.frombuffer(json.dumps(value).encode(), np.uint8)
  sizes = np.asarray(multihost_utils.process_allgather(np.int32(data.size)))
  width = 1 << int(max(int(sizes.max()), 1) - 1).bit_length()  # few shapes, few compiles
  padded = np.zeros(width, np.uint8)
  padded[:data.size] = data
  rows = np.asarray(multihost_utils.process_allgather(padded))
  return [json.loads(bytes(row[:n])) for row, n in zip(rows, sizes)]
