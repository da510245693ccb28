"""Compile targets: the devices of a named TPU topology, compile-only, on a machine without one.

  target = target_for("v5p-128")            # 64 compile-only TPU v5 devices (libtpu)
  target = target_for("v5e-16", slices=2)   # two 16-chip slices over DCN
  target = target_for("cpu:8")              # 8 simulated host devices (no libtpu needed)

The TPU names and their chips, topology, memory and bandwidths come from the one accelerator
table (`toolkit.accelerators`); libtpu turns `TpuType.topology_desc_kwargs()` into devices via
`jax.experimental.topologies.get_topology_desc`. JAX must run on CPU (`JAX_PLATFORMS=cpu`):
the TPU devices here only compile, eager work on them fails.

libtpu writes logs under /tmp/tpu_logs and takes a lock file in /tmp unless told otherwise;
`prepare_libtpu_environment` points its logs at a private temporary folder (removed at exit
unless TPU_LOG_DIR was set by the caller) and allows several processes to load it.
"""
from __future__ import annotations

import atexit
import contextlib
import dataclasses
import functools
import importlib.util
import os
import shutil
import sys
import tempfile
from collections.abc import Sequence

import jax

from toolkit import accelerators


class TargetError(ValueError):
  """The target cannot be built: unknown name, bad slice count, libtpu missing."""


@dataclasses.dataclass(frozen=True)
class Target:
  """The devices to compile for and what the table says about them (None for CPU)."""
  name: str                              # "v5p-128" or "cpu:8"
  slices: int
  devices: tuple[jax.Device, ...]
  tpu: accelerators.TpuType | None           # None for simulated host devices
  # A GPU cluster estimated on stand-in host devices (toolkit.cost; nothing compiles for it
  # here): its nodes are the slices.
  gpu: accelerators.GpuCluster | None = None
  # Set when `devices` stand in for the target's (host devices for toolkit.cost's estimates):
  # the platform whose attention kernels the estimate assumes.
  stand_in_for: str | None = None

  @property
  def is_tpu(self) -> bool:
    return self.tpu is not None

  @property
  def platform(self) -> str:
    """The platform the step would run on: tpu, gpu or cpu."""
    if self.stand_in_for:
      return self.stand_in_for
    return "tpu" if self.tpu else "gpu" if self.gpu else self.devices[0].platform

  @property
  def _chip(self):
    return self.tpu or (self.gpu.gpu if self.gpu else None)

  @property
  def chips(self) -> int:
    return len(self.devices)  # one JAX device per chip (megacore chips count once)

  @property
  def hbm_bytes_per_device(self) -> int | None:
    return self._chip.hbm_bytes_per_chip if self._chip else None

  @property
  def peak_flops_per_device(self) -> float | None:
    return self._chip.peak_bf16_flops_per_chip if self._chip else None

  @property
  def hbm_bytes_per_second(self) -> float | None:
    return self._chip.hbm_bytes_per_second_per_chip if self._chip else None

  @property
  def ici_bytes_per_second(self) -> float | None:
    return self._chip.ici_bytes_per_second_per_chip if self._chip else None

  @property
  def dcn_bytes_per_second(self) -> float | None:
    return self._chip.dcn_bytes_per_second_per_chip if self._chip else None

  def describe(self) -> str:
    slices = f" x {self.slices} slices" if self.slices > 1 else ""
    if self.gpu:
      g = self.gpu
      return (f"{g.name}: {g.count} x {g.gpu.device_kind} in {g.nodes} node(s) of "
              f"{g.gpus_per_node}, {g.gpu.hbm_bytes_per_chip / 2**30:.4g} GiB HBM and "
              f"{g.gpu.peak_bf16_flops_per_chip / 1e12:g} TFLOP/s bf16 per GPU")
    if not self.tpu:
      return f"{self.name}{slices}: {len(self.devices)} simulated host devices"
    t = self.tpu
    return (f"{t.name}{slices}: {len(self.devices)} chips ({t.device_kind}, topology "
            f"{t.topology} per slice, {t.hosts} host(s) per slice), "
            f"{t.hbm_bytes_per_chip / 2**30:g} GiB HBM and "
            f"{t.peak_bf16_flops_per_chip / 1e12:g} TFLOP/s bf16 per chip")

  def slice_ids(self) -> list[int] | None:
    """Slice of each device (None for one slice)."""
    if self.slices == 1:
      return None
    return [int(getattr(d, "slice_index", 0) or 0) for d in self.devices]


def libtpu_missing_reason() -> str | None:
  """Why TPU targets cannot be compiled here, or None when libtpu is installed."""
  if os.environ.get("TPU_LIBRARY_PATH") and os.path.isfile(os.environ["TPU_LIBRARY_PATH"]):
    return None
  if importlib.util.find_spec("libtpu") is None:
    return ("libtpu is not installed; install it with pip install 'jax[tpu]==0.10.2' (pins "
            "libtpu 0.0.42.*) or pip install -e '.[tpu]', or compile for --topology=cpu:N")
  return None


_LOG_DIR: list[str] = []


def prepare_libtpu_environment() -> str:
  """Sends libtpu's logs to a private folder and lets several processes load it; returns the
  log folder. Call before libtpu loads (the first `get_topology_desc`)."""
  os.environ["ALLOW_MULTIPLE_LIBTPU_LOAD"] = "1"   # no lock file in /tmp
  if os.environ.get("TPU_LOG_DIR"):
    return os.environ["TPU_LOG_DIR"]
  if not _LOG_DIR:
    folder = tempfile.mkdtemp(prefix="meshkit-libtpu-")
    _LOG_DIR.append(folder)
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
  os.environ["TPU_LOG_DIR"] = _LOG_DIR[0]
  return _LOG_DIR[0]


@contextlib.contextmanager
def _stderr_to(path: str):
  """Redirects file descriptor 2 (C++ libraries write there) into `path`."""
  sys.stderr.flush()
  saved = os.dup(2)
  with open(path, "ab") as sink:
    os.dup2(sink.fileno(), 2)
    try:
      yield
    finally:
      sys.stderr.flush()
      os.dup2(saved, 2)
      os.close(saved)


@functools.cache
def _tpu_devices(name: str, slices: int) -> tuple[jax.Device, ...]:
  from jax.experimental import topologies  # pylint: disable=g-import-not-at-top
  tpu = accelerators.accelerator(name)
  log_dir = prepare_libtpu_environment()
  # On first load libtpu looks for a TPU VM's metadata server and prints warnings about the
  # missing accelerator type and worker hostnames: true here and harmless for compiling.
  with _stderr_to(os.path.join(log_dir, "libtpu_init.log")):
    description = topologies.get_topology_desc(**tpu.topology_desc_kwargs(num_slices=slices))
  return tuple(description.devices)


def parse_name(name: str) -> tuple[str, int | None]:
  """'cpu:8' -> ('cpu', 8); 'v5p-128' -> ('v5p-128', None)."""
  text = str(name).strip()
  if text.lower().startswith("cpu"):
    _, sep, count = text.partition(":")
    if not sep or not count.strip().isdigit() or int(count) < 1:
      raise TargetError(f"--topology={text!r}: write cpu:N with N >= 1 simulated host devices, "
                        f"e.g. cpu:8")
    return "cpu", int(count)
  return text, None


def target_for(name: str, slices: int = 1, cpu_devices: Sequence[jax.Device] | None = None
               ) -> Target:
  """The target named `name` (a Cloud TPU type from the table, or cpu:N), `slices` of it.

  For cpu:N the devices are the first N x slices of `cpu_devices` (default: JAX's CPU
  devices); the process must have been started with that many (`jax_num_cpu_devices`).
  """
  if slices < 1:
    raise TargetError(f"--slices={slices}; give the number of slices, >= 1")
  kind, count = parse_name(name)
  if accelerators.is_gpu_name(kind):
    raise TargetError(f"--topology={name}: no GPU compiler runs on this machine, so a GPU "
                      f"cluster cannot be compiled for here; python -m toolkit.cost estimates "
                      f"it from the analytic model, and on a GPU machine toolkit.train runs it")
  if kind == "cpu":
    available = list(cpu_devices if cpu_devices is not None else jax.devices("cpu"))
    needed = count * slices
    if len(available) < needed:
      raise TargetError(
          f"--topology={name} with --slices={slices} needs {needed} host devices but JAX has "
          f"{len(available)}; start the process with jax_num_cpu_devices={needed} (the "
          f"toolkit.compile command line sets it)")
    return Target(name=f"cpu:{count}", slices=slices, devices=tuple(available[:needed]),
                  tpu=None)
  try:
    tpu = accelerators.accelerator(kind)
  except ValueError as e:
    raise TargetError(f"--topology: {e}; or cpu:N for N simulated host devices") from None
  reason = libtpu_missing_reason()
  if reason:
    raise TargetError(f"--topology={name}: {reason}")
  if "cpu" != (jax.config.jax_platforms or os.environ.get("JAX_PLATFORMS") or ""):
    raise TargetError("compiling for a TPU topology needs JAX on CPU; set JAX_PLATFORMS=cpu "
                      "before JAX starts (the toolkit.compile command line does)")
  return Target(name=tpu.name, slices=slices, devices=_tpu_devices(tpu.name, slices), tpu=tpu)
