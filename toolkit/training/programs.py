"""Compiled programs kept beside JAX's compilation cache, keyed by what they are built from, so
that a restart skips tracing and lowering as well as compiling.

JAX's persistent cache (`--compilation_cache`, toolkit/runtime.py) keys a program by its lowered
module: a restart still traces the Python and lowers it to find the key. For `make demo`'s
model that is 0.45 s of the train step's 0.6 s warm compile. A `Programs` keys each program by
the run's config, the abstract arguments (shapes, dtypes, shardings), the devices, and a
fingerprint of everything else a trace depends on: the source of the `toolkit`, `models` and
`sharding` packages, the versions of Python, JAX, jaxlib, Flax and Optax, the backend, the CPU,
JAX's config values and the XLA/JAX/libtpu environment variables. A change to any of them is a
new key: the program is traced again (and JAX's cache may still skip the compile).

Entries are JAX's own serialized executables (`jax.experimental.serialize_executable`, what
MaxText's `compiled_trainstep_file` loads), one file each in `<cache>/meshkit_programs/`, those
used last kept (at most `KEEP` entries and `KEEP_BYTES`). Only a local cache folder is used, in
a one-process job; with the cache off (or on gs://) every program is traced and compiled as
usual. An entry that fails to load is
deleted and the program compiled again: the cache can only cost time, never change a result.

Only a program that JAX compiled during the call is stored (it reported a miss of its own
cache). One that JAX read from its cache is not, nor one it reused from memory (which may have
been read from the cache earlier in the process): on the CPU, serializing such an executable
again writes it without its kernels ("NOT_FOUND: Function ... not found" when it runs; measured
with JAX 0.10.2). So a program already in JAX's cache before its key here existed (after an
upgrade, or an edit that left its module as it was) is traced and read from JAX's cache on each
start, as without this cache, until JAX compiles it again.
"""
from __future__ import annotations

import functools
import hashlib
import importlib
import importlib.metadata
import logging
import os
import pickle
import platform
import sys
import tempfile
import threading
from collections.abc import Callable, Sequence

import jax
import ml_collections
from jax.experimental import serialize_executable

# Entries kept, by last use: at most this many, and at most this many bytes in all (a sweep's
# trials each add theirs). `make demo`'s train step is 1 MB.
KEEP = 64
KEEP_BYTES = 8 * 2**30
SUBFOLDER = "meshkit_programs"
_PACKAGES = ("toolkit", "models", "sharding")
_DISTRIBUTIONS = ("jax", "jaxlib", "flax", "optax", "numpy", "ml-collections")
_ENVIRONMENT_PREFIXES = ("XLA_", "JAX_", "LIBTPU", "TPU_")
# jax.config values that do not change a traced program.
_IRRELEVANT_CONFIG = ("cache", "log", "dump", "explain", "traceback")


class Programs:
  """`compile(name, jitted, *args)`: `jitted.lower(*args).compile()`, or the same program read
  back from the folder. `context` is what the programs depend on beyond their arguments (the
  run's config); `directory` None turns the cache off."""

  def __init__(self, directory: str | None, context: str):
    self.directory = directory
    self.context = context
    self.loaded: list[str] = []  # names of the programs read back rather than traced

  def compile(self, name: str, jitted, *args) -> jax.stages.Compiled:
    if self.directory is None:
      return jitted.lower(*args).compile()
    path = os.path.join(self.directory, f"{name}-{_key(name, self.context, args)}.pkl")
    if (compiled := _load(path)) is not None:
      self.loaded.append(name)
      return compiled
    before = _jax_cache_events()
    compiled = jitted.lower(*args).compile()
    after = _jax_cache_events()
    if after["misses"] > before["misses"] and after["hits"] == before["hits"]:
      _store(path, compiled)  # JAX compiled it just now (module docstring)
    return compiled

  def value(self, name: str, compute: Callable[[], float]) -> float:
    """`compute()` once per machine and software (`environment_fingerprint`), not per config:
    for a measurement of the machine, like its matmul peak."""
    if self.directory is None:
      return compute()
    path = os.path.join(self.directory, f"{name}-{_key(name, '', ())}.txt")
    try:
      with open(path) as f:
        return float(f.read())
    except (OSError, ValueError):
      pass
    result = compute()
    _write_atomically(path, repr(result).encode())
    return result


def for_run(config: ml_collections.ConfigDict, mesh) -> Programs:
  """The run's programs: in the compilation cache's folder when it is on and local, and the job
  is one process (a multi-process job traces as before and still hits JAX's cache)."""
  folder = jax.config.jax_compilation_cache_dir
  if not folder or "://" in folder or jax.process_count() > 1:
    return Programs(None, "")
  devices = [(d.id, d.process_index) for d in mesh.devices.flat]
  context = repr((config.to_json_best_effort(sort_keys=True), devices, dict(mesh.shape),
                  jax.process_index(), jax.process_count()))
  return Programs(os.path.join(folder, SUBFOLDER), context)


def _key(name: str, context: str, args: Sequence) -> str:
  parts = (name, context, repr(jax.tree.structure(args)),
           [_describe(leaf) for leaf in jax.tree.leaves(args)], environment_fingerprint())
  return hashlib.sha256(repr(parts).encode()).hexdigest()[:32]


_EVENTS = threading.local()  # JAX reports its cache's hits and misses in the compiling thread
_LISTENING = threading.Lock()
_listening = False


def _jax_cache_events() -> dict[str, int]:
  """How many programs this thread has found ("hits") and not found ("misses") in JAX's
  persistent cache so far."""
  global _listening
  with _LISTENING:
    if not _listening:
      jax.monitoring.register_event_listener(_count_event)
      _listening = True
  return dict(getattr(_EVENTS, "counts", {"hits": 0, "misses": 0}))


def _count_event(event: str, **kwargs) -> None:
  del kwargs
  kind = {"/jax/compilation_cache/cache_hits": "hits",
          "/jax/compilation_cache/cache_misses": "misses"}.get(event)
  if kind is not None:
    counts = _EVENTS.__dict__.setdefault("counts", {"hits": 0, "misses": 0})
    counts[kind] += 1


def _describe(x) -> str:
  """A leaf of the arguments as its shape, dtype and sharding (arrays or abstract arrays)."""
  sharding = getattr(x, "sharding", None)
  return f"{getattr(x, 'shape', ())} {getattr(x, 'dtype', type(x).__name__)} {sharding!r}"


def environment_fingerprint() -> str:
  """What a traced program depends on besides its config and arguments (module docstring).
  JAX's config values and the environment variables are read at every call (a process may
  change them); the sources and versions once."""
  environment = sorted((k, v) for k, v in os.environ.items()
                       if k.startswith(_ENVIRONMENT_PREFIXES))
  config_values = sorted((k, repr(v)) for k, v in jax.config.values.items()
                         if not any(word in k for word in _IRRELEVANT_CONFIG))
  return hashlib.sha256(repr((_installation(), environment, config_values)).encode()).hexdigest()


@functools.cache
def _installation() -> tuple:
  """The sources of the packages, the versions, the backend and the host."""
  sources = [source_digest(os.path.dirname(importlib.import_module(package).__file__))
             for package in _PACKAGES]
  versions = []
  for distribution in _DISTRIBUTIONS:
    try:
      versions.append((distribution, importlib.metadata.version(distribution)))
    except importlib.metadata.PackageNotFoundError:
      versions.append((distribution, None))
  device = jax.devices()[0]
  return (sources, sys.version, platform.machine(), _cpu_model(), os.cpu_count(), versions,
          device.platform, device.device_kind, device.client.platform_version)


def source_digest(root: str) -> str:
  """A digest of every Python file under `root`: names and contents."""
  digest = hashlib.sha256()
  for folder, subfolders, files in os.walk(root):
    subfolders.sort()
    for file in sorted(f for f in files if f.endswith(".py")):
      path = os.path.join(folder, file)
      digest.update(os.path.relpath(path, root).encode() + b"\0")
      with open(path, "rb") as f:
        digest.update(f.read() + b"\0")
  return digest.hexdigest()


def _cpu_model() -> str:
  """The host CPU's model name: a CPU program is compiled for the host's instruction set."""
  try:
    with open("/proc/cpuinfo") as f:
      return next((line.split(":", 1)[1].strip() for line in f
                   if line.startswith("model name")), platform.processor())
  except OSError:
    return platform.processor()


def _load(path: str) -> jax.stages.Compiled | None:
  try:
    with open(path, "rb") as f:
      payload, in_tree, out_tree, device_ids = pickle.load(f)
  except FileNotFoundError:
    return None
  except Exception as e:  # pylint: disable=broad-except
    return _discard(path, e)
  try:
    by_id = {d.id: d for d in jax.devices()}
    compiled = serialize_executable.deserialize_and_load(
        payload, in_tree, out_tree, execution_devices=[by_id[i] for i in device_ids])
  except Exception as e:  # pylint: disable=broad-except
    return _discard(path, e)
  try:
    os.utime(path)  # last use, for `_evict`
  except OSError:
    pass
  return compiled


def _discard(path: str, error: Exception) -> None:
  logging.info("program cache entry %s does not load (%s); compiling again", path, error)
  try:
    os.remove(path)
  except OSError:
    pass
  return None


def _store(path: str, compiled: jax.stages.Compiled) -> None:
  """Writes the entry (whole or not at all); a program that cannot be serialized, or a folder
  that cannot be written, only means the next run traces again."""
  try:
    payload, in_tree, out_tree = serialize_executable.serialize(compiled)
    device_ids = [d.id for d in compiled.runtime_executable().local_devices()]
    blob = pickle.dumps((payload, in_tree, out_tree, device_ids))
  except Exception as e:  # pylint: disable=broad-except
    logging.info("program %s is not cached (%s)", path, e)
    return
  _write_atomically(path, blob)
  _evict(os.path.dirname(path))


def _write_atomically(path: str, blob: bytes) -> None:
  """Another process reading `path` meanwhile sees the old entry or the new one, never part."""
  temporary = None
  try:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=os.path.dirname(path), delete=False,
                                     suffix=".tmp") as f:
      temporary = f.name
      f.write(blob)
    os.replace(temporary, path)
  except OSError as e:
    logging.info("program cache entry %s not written (%s)", path, e)
    if temporary is not None and os.path.exists(temporary):
      os.remove(temporary)


def _evict(folder: str) -> None:
  """Keeps the entries used last: at most `KEEP`, of at most `KEEP_BYTES` in all (the newest
  one always)."""
  try:
    entries = sorted((e for e in os.scandir(folder) if e.name.endswith((".pkl", ".txt"))),
                     key=lambda e: e.stat().st_mtime, reverse=True)
    total = 0
    for count, entry in enumerate(entries):
      total += entry.stat().st_size
      if count > 0 and (count >= KEEP or total > KEEP_BYTES):
        os.remove(entry.path)
  except OSError:
    pass
