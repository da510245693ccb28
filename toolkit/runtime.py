"""JAX's process-wide settings, chosen by the commands before JAX starts a backend.

- Platform: with libtpu installed (`make test` installs it, to compile for TPUs from a CPU)
  JAX's backend discovery loads libtpu even on a machine without TPU chips, and libtpu prints
  five lines of start-up noise, one an `E0000 ... INVALID_ARGUMENT` that reads like a crash.
  `use_cpu_without_accelerator` pins JAX to the CPU when no TPU chip and no GPU is visible and
  JAX_PLATFORMS is unset; TPU and GPU machines keep JAX's own discovery. An NVIDIA GPU without
  JAX's CUDA plugin (the plain `jax` wheel `make demo` installs) counts as no GPU: JAX could
  only fall back to the CPU, so the run says in one line how to install the plugin and goes on
  as on a CPU-only machine (docs/gpu.md).
- Simulated devices: on a CPU-only run, `simulate_cpu_devices` gives the mesh of a config the
  host devices it needs (8 for a mesh with a -1 size), unless XLA_FLAGS already says how many.
- Compilation cache: `enable_compilation_cache` turns on JAX's persistent cache in a folder, so
  a restart loads its compiled programs instead of compiling them again.

`start` does all three; every command calls it first (its flag: --compilation_cache), and a
Python session can too, before its first JAX array:

  from toolkit import runtime
  runtime.start(mesh=config.mesh)   # CPU-only machine: quiet, and the devices the mesh needs
"""
from __future__ import annotations

import importlib.util
import math
import os
from collections.abc import Callable

import sharding
from toolkit import xla_flags as xla_flags_lib

# Simulated CPU devices for a mesh with a -1 size: the device count the CPU configs are made
# for (experiments/*.py: cpu variants on 8 devices).
DEFAULT_CPU_DEVICES = 8
_DEVICE_COUNT_FLAG = "xla_force_host_platform_device_count"
# The modules that register JAX's "cuda" backend: the PJRT plugins of the jax-cuda12-pjrt and
# jax-cuda13-pjrt wheels (`jax[cuda12]` installs the first), which JAX imports from its
# `jax_plugins` namespace package (jax._src.xla_bridge.discover_pjrt_plugins).
CUDA_PLUGIN_MODULES = ("jax_plugins.xla_cuda12", "jax_plugins.xla_cuda13")
NO_CUDA_PLUGIN = ("an NVIDIA GPU is visible but JAX's CUDA plugin is not installed, so this run "
                  "continues on the CPU; for the GPU: pip install -e '.[cuda]' (jax[cuda12])")


def default_cache_dir() -> str:
  """Where compiled programs go unless --compilation_cache says otherwise: JAX's own
  JAX_COMPILATION_CACHE_DIR when it is set, else the user's cache folder ($XDG_CACHE_HOME or
  ~/.cache)/meshkit/jax_compilation_cache."""
  if os.environ.get("JAX_COMPILATION_CACHE_DIR"):
    return os.environ["JAX_COMPILATION_CACHE_DIR"]
  base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  return os.path.join(base, "meshkit", "jax_compilation_cache")


def accelerator_visible() -> bool:
  """Whether this machine shows a TPU chip or a GPU (JAX's own hardware probes)."""
  try:
    from jax._src import hardware_utils  # pylint: disable=g-import-not-at-top
    tpu_chips, _ = hardware_utils.num_available_tpu_chips_and_device_id()
    return (tpu_chips > 0 or hardware_utils.has_visible_nvidia_gpu()
            or hardware_utils.num_available_amd_gpus(stop_at=1) > 0)
  except Exception:  # pylint: disable=broad-except  # a JAX without these probes: let JAX choose
    return True


def cuda_plugin_installed() -> bool:
  """Whether JAX will find a CUDA backend to register: one of CUDA_PLUGIN_MODULES importable,
  or a "cuda" entry in PJRT_NAMES_AND_LIBRARY_PATHS (JAX's other way to load a plugin). Looks
  for the modules without importing them (that would load the CUDA libraries)."""
  for name in CUDA_PLUGIN_MODULES:
    try:
      if importlib.util.find_spec(name) is not None:
        return True
    except (ImportError, ValueError):  # no jax_plugins package at all
      pass
  entries = os.environ.get("PJRT_NAMES_AND_LIBRARY_PATHS", "").split(",")
  return any(entry.partition(":")[0].strip() == "cuda" for entry in entries)


def nvidia_gpu_without_cuda_plugin() -> bool:
  """Whether JAX would only warn "An NVIDIA GPU may be present on this machine, but a
  CUDA-enabled jaxlib is not installed" and fall back to the CPU: an NVIDIA GPU visible (JAX's
  probe), no TPU chip, and no CUDA plugin."""
  try:
    from jax._src import hardware_utils  # pylint: disable=g-import-not-at-top
    if not hardware_utils.has_visible_nvidia_gpu():
      return False
    tpu_chips, _ = hardware_utils.num_available_tpu_chips_and_device_id()
  except Exception:  # pylint: disable=broad-except  # a JAX without these probes: let JAX choose
    return False
  return tpu_chips == 0 and not cuda_plugin_installed()


def cpu_run_reason(log: Callable[[str], None] = print) -> str | None:
  """Pins JAX to the CPU where it has no accelerator to use; returns why the run is on the CPU
  (the words that open the simulated-devices line), or None to keep JAX's own discovery.

  JAX_PLATFORMS (or jax_platforms) given by the user wins. An NVIDIA GPU without the CUDA
  plugin logs NO_CUDA_PLUGIN, then is a CPU-only machine. The pin is also exported to the
  environment so that processes started from here (Grain workers, sweep trials) stay quiet.
  """
  import jax  # pylint: disable=g-import-not-at-top
  chosen = jax.config.jax_platforms or os.environ.get("JAX_PLATFORMS")
  if chosen:
    if chosen == "cpu" and not jax.config.jax_platforms:  # set after JAX read it, at import
      jax.config.update("jax_platforms", "cpu")
    return "no TPU or GPU here" if chosen == "cpu" else None
  if nvidia_gpu_without_cuda_plugin():
    log(NO_CUDA_PLUGIN)
    reason = "no CUDA plugin for the GPU"
  elif accelerator_visible():
    return None
  else:
    reason = "no TPU or GPU here"
  os.environ["JAX_PLATFORMS"] = "cpu"
  jax.config.update("jax_platforms", "cpu")
  return reason


def use_cpu_without_accelerator(log: Callable[[str], None] = print) -> bool:
  """Pins JAX to the CPU on a machine without a TPU or a GPU it can use (`cpu_run_reason`);
  True when JAX will run on the CPU."""
  return cpu_run_reason(log) is not None


def cpu_devices_for_mesh(ici: str, dcn: str = "") -> int | None:
  """Host devices a mesh spec needs on a CPU: the product of its sizes, and with a -1 size
  the least multiple of the fixed sizes that is at least DEFAULT_CPU_DEVICES. None when the
  spec does not parse (the config's validation reports that)."""
  try:
    sizes = [size for text in (ici, dcn) for _, size in sharding.parse_axis_sizes(text)]
  except sharding.ShardingError:
    return None
  fixed = math.prod(size for size in sizes if size != -1)
  if fixed < 1:
    return None
  if -1 not in sizes:
    return fixed
  return fixed * max(1, math.ceil(DEFAULT_CPU_DEVICES / fixed))


def simulate_cpu_devices(count: int | None, what: str,
                         log: Callable[[str], None] = print,
                         reason: str = "no TPU or GPU here") -> int | None:
  """Sets the CPU device count before JAX starts and says so in one line naming `what` needs
  them, after `reason` (why the run is on the CPU); returns the count set.

  Does nothing (returns None) when XLA_FLAGS or jax_num_cpu_devices already set a count, or
  for one device. Call only for a run on the CPU, before the first JAX array.
  """
  import jax  # pylint: disable=g-import-not-at-top
  if _DEVICE_COUNT_FLAG in os.environ.get("XLA_FLAGS", "") or jax.config.jax_num_cpu_devices > 0:
    return None
  if not count or count == 1:
    return None
  jax.config.update("jax_num_cpu_devices", count)
  log(f"{reason}: simulating {count} CPU devices for {what} (choose another count "
      f"with XLA_FLAGS=--{_DEVICE_COUNT_FLAG}=N)")
  return count


def enable_compilation_cache(path: str) -> None:
  """JAX's persistent compilation cache in `path` (created if missing), for every program:
  with JAX's default threshold (1 s of compiling) the state's init and the eval step, which
  compile in under a second each, were compiled again on every restart."""
  import jax  # pylint: disable=g-import-not-at-top
  os.makedirs(path, exist_ok=True)
  jax.config.update("jax_compilation_cache_dir", path)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)


def cache_off_for_cpu_processes(process_count: int, log: Callable[[str], None] = print) -> bool:
  """Turns JAX's persistent compilation cache off in a job of several processes on the CPU
  backend (a simulated pod); True when it did. JAX writes cache entries from process 0 only,
  and the other processes' programs have keys of their own, so on a restart process 0 read
  every program back while the others compiled theirs, ran ahead into the first collective and
  failed there at Gloo's 5 s timeout (measured: experiments/grpo.py:tiny on 2 processes, run a
  second time over the same cache). Call after the distributed runtime starts, before the
  first compile."""
  import jax  # pylint: disable=g-import-not-at-top
  platforms = jax.config.jax_platforms or os.environ.get("JAX_PLATFORMS", "")
  if (process_count < 2 or not jax.config.jax_enable_compilation_cache
      or not jax.config.jax_compilation_cache_dir or platforms.split(",")[0] != "cpu"):
    return False
  jax.config.update("jax_enable_compilation_cache", False)
  log("compilation cache off: with several CPU processes only process 0 would read its "
      "programs back, and run ahead of the others into their collectives")
  return True


def start(compilation_cache: str | None = None, mesh=None,
          cpu_devices: tuple[int, str] | None = None,
          log: Callable[[str], None] = print, xla_flags: str = "auto") -> None:
  """Process set-up before JAX starts: the CPU when there is no TPU or GPU that JAX can use
  (quiet start-up; `cpu_run_reason`), simulated CPU devices for `mesh` (a config's mesh
  section, fields ici and dcn) or `cpu_devices` (count, what needs them), and the compilation
  cache in the folder `compilation_cache` (none when it is None, "" or "off"). On a TPU or GPU:
  the overlap flags of `toolkit.xla_flags` (`xla_flags`: a config's runtime.xla_flags)."""
  reason = cpu_run_reason(log)
  if reason is not None:
    if mesh is not None:
      dcn = mesh.get("dcn", "") or ""
      what = f"mesh.ici={mesh.ici}" + (f", mesh.dcn={dcn}" if dcn else "")
      simulate_cpu_devices(cpu_devices_for_mesh(mesh.ici, dcn), what, log, reason)
    elif cpu_devices is not None:
      simulate_cpu_devices(*cpu_devices, log=log, reason=reason)
  else:  # a TPU or GPU: its overlap flags (config runtime.xla_flags), in one log line
    xla_flags_lib.start(xla_flags, mesh, log)
  if compilation_cache not in (None, "", "off"):
    enable_compilation_cache(compilation_cache)
