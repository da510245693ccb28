"""Compiler flags that overlap collectives with compute: one preset per platform, on by default.

XLA can run a collective (the fsdp all-gather of the next layer's weights, the gradients'
reduce-scatter) while the chip computes, if the collective is scheduled asynchronously: split
into a start and a done with compute in between. Some of that needs flags the compiler reads
from the environment before the backend starts:

  TPU  LIBTPU_INIT_ARGS   async collective fusion ("continuation fusion": the all-gather is
                          fused with the compute that overlaps it, in several steps) and async
                          all-gather / all-reduce / collective-permute; across slices also the
                          data-parallel all-reduce overlap over DCN
  GPU  XLA_FLAGS          the latency-hiding scheduler, pipelined all-gather / reduce-scatter /
                          all-reduce across the scanned layers (with while-loop double
                          buffering), and combine thresholds that merge a layer's small
                          collectives into one

The choice follows what the two public reference stacks ship, read rather than copied:
MaxText's benchmarks/xla_flags_library.py (CF_FOR_ALL_GATHER, its most used group, plus
ENABLE_ASYNC_COLLECTIVE_PERMUTE and, across slices, DATA_PARALLEL_OVERLAP; its GPU recipes
src/maxtext/configs/gpu/a3/*) and AXLearn's axlearn/common/compiler_options.py
(default_xla_options: async all-gather/collective-permute on v4/v5p, the same fusion flags on
v6e, the data-parallel flags for num_slices > 1) with its GPU flags in
axlearn/cloud/gcp/jobset_utils.py (global_gpu_xla_flags and the A3 combine thresholds).
Left out: flags about other things (VMEM limits, SparseCore offload, host offload, Triton
GEMMs), and all-reduce continuation fusion (MaxText's CF_FOR_ALL_REDUCE, used in few recipes).

Measured with libtpu 0.0.42.1 (the CPU LM step compiled for v5p-8): without these flags the
step's 12 fsdp all-gathers run synchronously and only one collective-permute is async; with
them each all-gather is an async start/done pair (the compile report's `async` line counts
them). Every flag name here is accepted by the installed libtpu and jaxlib
(tests/toolkit/test_xla_flags.py): an unknown name ends the process there ("Unknown flag in
XLA_FLAGS", "Unknown command line flag"), which is why `xla_enable_async_reduce_scatter`, a TPU
name some recipes use, is not here: libtpu 0.0.42 does not know it. libtpu reads its flags with
absl, so the TPU preset comes with a `--undefok=` of its names: a libtpu that lacks one skips it.
XLA_FLAGS has no such escape; the test is the guard when jaxlib moves.

A flag the user already set in the variable is never overridden: theirs stays, the preset's
is left out (and said so). The flags added here are remembered in MESHKIT_ADDED_<VARIABLE>, so a
process started from this one (a supervised run, a sweep trial) tells them from the user's,
and `runtime.xla_flags=none` there takes them out again.

  from toolkit import xla_flags
  xla_flags.apply("tpu")        # before libtpu loads; returns what it did, with .line()

The config field is `runtime.xla_flags`: "auto" (the default: the preset of the platform JAX
starts on) or "none".
"""
from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, MutableMapping

from toolkit.errors import ConfigError

SETTINGS = ("auto", "none")
VARIABLES = {"tpu": "LIBTPU_INIT_ARGS", "gpu": "XLA_FLAGS"}
_ADDED = "MESHKIT_ADDED_{}"


@dataclasses.dataclass(frozen=True)
class Flag:
  """One compiler flag of a preset: --name=value."""
  name: str
  value: str

  @property
  def token(self) -> str:
    return f"--{self.name}={self.value}"


# MaxText's CF_FOR_ALL_GATHER (continuation fusion for all-gathers) and AXLearn's v5p/v6e
# defaults; async all-reduce and collective-permute as MaxText's CF_FOR_ALL_REDUCE_AND_ALL_GATHER
# and ENABLE_ASYNC_COLLECTIVE_PERMUTE, AXLearn's v4/v5p defaults.
TPU = (
    Flag("xla_tpu_enable_async_collective_fusion", "true"),
    Flag("xla_tpu_enable_async_collective_fusion_fuse_all_gather", "true"),
    Flag("xla_tpu_enable_async_collective_fusion_multiple_steps", "true"),
    Flag("xla_tpu_overlap_compute_collective_tc", "true"),
    Flag("xla_enable_async_all_gather", "true"),
    Flag("xla_enable_async_all_reduce", "true"),
    Flag("xla_enable_async_collective_permute", "true"),
)
# Across slices: the gradients' DCN all-reduce overlapped with the next layer's gradient
# computation (MaxText's DATA_PARALLEL_OVERLAP; AXLearn sets both for num_slices > 1).
TPU_ACROSS_SLICES = (
    Flag("xla_tpu_enable_data_parallel_all_reduce_opt", "true"),
    Flag("xla_tpu_data_parallel_opt_different_sized_ops", "true"),
)
# The latency-hiding scheduler and pipelined collectives (AXLearn's global GPU flags; MaxText's
# A3 recipes, which spell the pipelining flags xla_gpu_pipeline_*=on on newer XLA); combine
# thresholds as MaxText's single-node A3 recipe (AXLearn's A3-mega: 128 MiB all-reduce too).
GPU = (
    Flag("xla_gpu_enable_latency_hiding_scheduler", "true"),
    Flag("xla_gpu_enable_pipelined_all_gather", "true"),
    Flag("xla_gpu_enable_pipelined_reduce_scatter", "true"),
    Flag("xla_gpu_enable_pipelined_all_reduce", "true"),
    Flag("xla_gpu_enable_while_loop_double_buffering", "true"),
    Flag("xla_gpu_all_gather_combine_threshold_bytes", str(128 * 2**20)),
    Flag("xla_gpu_reduce_scatter_combine_threshold_bytes", str(64 * 2**20)),
    Flag("xla_gpu_all_reduce_combine_threshold_bytes", str(128 * 2**20)),
)


def preset(platform: str, slices: int = 1) -> tuple[Flag, ...]:
  """The flags for `platform` ("tpu" or "gpu"; nothing for others) on `slices` slices."""
  if platform == "tpu":
    return TPU + (TPU_ACROSS_SLICES if slices > 1 else ())
  return GPU if platform == "gpu" else ()


def check_setting(value) -> str:
  """`runtime.xla_flags`, validated (ConfigError naming the choices)."""
  if value not in SETTINGS:
    raise ConfigError(f"runtime.xla_flags={value!r} is unknown; use 'auto' (the overlap flags "
                      f"of the platform JAX runs on) or 'none' (no flags added)")
  return value


def setting_of(config) -> str:
  """A config's runtime.xla_flags ("auto" in configs saved before the field existed)."""
  return config.get("runtime", {}).get("xla_flags", "auto")


def flag_name(token: str) -> str:
  """'--xla_foo=true' -> 'xla_foo' (also '-xla_foo', '--xla_foo')."""
  return token.lstrip("-").partition("=")[0]


@dataclasses.dataclass(frozen=True)
class Applied:
  """What `apply` did to one variable."""
  platform: str
  variable: str
  setting: str
  added: tuple[str, ...]    # preset tokens appended to the variable
  yours: tuple[str, ...]    # the user's tokens that set a preset flag: they win

  def line(self) -> str:
    """The start-up log's one line."""
    if self.setting == "none":
      return (f"overlap flags: none (runtime.xla_flags=none); {self.variable} holds only what "
              f"you set")
    text = (f"overlap flags for {self.platform.upper()} in {self.variable}: "
            f"{' '.join(self.added) or 'none added'}")
    if self.yours:
      text += f"; yours kept: {' '.join(self.yours)}"
    return text + " (turn off with --config.runtime.xla_flags=none)"


def apply(platform: str, setting: str = "auto", slices: int = 1,
          environ: MutableMapping[str, str] | None = None) -> Applied | None:
  """Sets the preset of `platform` in its variable (LIBTPU_INIT_ARGS, XLA_FLAGS) of `environ`
  (default os.environ), or takes a previous call's flags out for setting "none"; flags the user
  set keep their values. None for a platform without a preset. Call before the backend starts
  (for TPU compiles: before libtpu loads). Raises ConfigError for an unknown setting."""
  check_setting(setting)
  environ = os.environ if environ is None else environ
  if platform not in VARIABLES:
    return None
  variable, marker = VARIABLES[platform], _ADDED.format(VARIABLES[platform])
  ours = set(environ.get(marker, "").split())
  tokens = [t for t in environ.get(variable, "").split() if t not in ours]
  user = {flag_name(t): t for t in tokens}
  wanted = preset(platform, slices) if setting == "auto" else ()
  added = tuple(f.token for f in wanted if f.name not in user)
  yours = tuple(user[f.name] for f in wanted if f.name in user)
  ours_now = list(added)
  if added and platform == "tpu" and "undefok" not in user:
    # libtpu parses its flags with absl: a name it does not know (a newer or older libtpu)
    # is then skipped instead of ending the process. XLA_FLAGS has no such escape.
    ours_now.insert(0, f"--undefok={','.join(flag_name(t) for t in added)}")
  text = " ".join(tokens + ours_now)
  if text:
    environ[variable] = text
  else:
    environ.pop(variable, None)
  if ours_now:
    environ[marker] = " ".join(ours_now)
  else:
    environ.pop(marker, None)
  return Applied(platform, variable, setting, added, yours)


def in_effect(platform: str, environ: MutableMapping[str, str] | None = None) -> dict:
  """The platform's variable as it stands: the preset's flags and the user's (for reports)."""
  environ = os.environ if environ is None else environ
  variable = VARIABLES[platform]
  ours = set(environ.get(_ADDED.format(variable), "").split())
  tokens = environ.get(variable, "").split()
  return {"variable": variable,
          "preset": [t for t in tokens if t in ours and flag_name(t) != "undefok"],
          "yours": [t for t in tokens if t not in ours]}


def prepare_tpu_compile(topology: str, setting: str = "auto", slices: int = 1,
                        log: Callable[[str], None] = print) -> Applied | None:
  """toolkit.compile's part: for a Cloud TPU type, the TPU preset in LIBTPU_INIT_ARGS before
  libtpu loads (the first `target_for`), in one log line, so that the compile schedules its
  collectives as the run would. Nothing for other targets (cpu:N; target_for reports a name
  it does not know). Raises ConfigError for an unknown setting."""
  from toolkit import accelerators  # pylint: disable=g-import-not-at-top
  check_setting(setting)
  try:
    accelerators.accelerator(topology)
  except ValueError:
    return None
  applied = apply("tpu", setting, slices)
  log(applied.line())
  return applied


def platform_to_start() -> str | None:
  """The accelerator JAX will start on when it is not pinned to the CPU: "tpu" or "gpu" from
  JAX_PLATFORMS (or jax_platforms), else from JAX's hardware probes (a TPU chip, an NVIDIA
  GPU); None for others (the CPU, AMD GPUs: no preset)."""
  import jax  # pylint: disable=g-import-not-at-top
  chosen = (jax.config.jax_platforms or os.environ.get("JAX_PLATFORMS") or "").strip().lower()
  if chosen:
    return {"tpu": "tpu", "cuda": "gpu", "gpu": "gpu"}.get(chosen.split(",")[0].strip())
  try:
    from jax._src import hardware_utils  # pylint: disable=g-import-not-at-top
    if hardware_utils.num_available_tpu_chips_and_device_id()[0] > 0:
      return "tpu"
    return "gpu" if hardware_utils.has_visible_nvidia_gpu() else None
  except Exception:  # pylint: disable=broad-except  # a JAX without these probes: add nothing
    return None


def slices_of(mesh) -> int:
  """Slices a config's mesh section asks for: the product of mesh.dcn's sizes (a -1 there
  means across however many there are: counted as several)."""
  dcn = (mesh.get("dcn", "") or "") if mesh is not None else ""
  slices = 1
  for item in filter(None, (part.strip() for part in dcn.split(","))):
    size = item.partition(":")[2].strip()
    slices *= 2 if size == "-1" else int(size) if size.isdigit() else 1
  return slices


def start(setting: str = "auto", mesh=None, log: Callable[[str], None] = print
          ) -> Applied | None:
  """`runtime.start`'s part for a run on an accelerator: the preset of the platform JAX will
  start on, in one log line. An unknown setting adds nothing here; the config's validation
  (toolkit.training.config.resolve) reports it before any work."""
  platform = platform_to_start()
  if platform is None:
    return None
  try:
    applied = apply(platform, setting, slices_of(mesh))
  except ConfigError:
    return None
  if applied is not None:
    log(applied.line())
  return applied
