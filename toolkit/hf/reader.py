"""Hugging Face weights straight into sharded parameters, slice by slice.

For every parameter, each device's slice (from its sharding) is read from the safetensors
files on its own: only the rows and columns that slice needs, layer by layer for stacked
parameters, converted to meshkit's layout and dtype, copied onto its device(s), then dropped.
So the host holds at most one slice plus one tensor's file pages at a time; the whole model
never sits in host memory (beyond what the devices themselves hold, which on a CPU-only
machine is host memory too).
"""
from __future__ import annotations

import itertools
import sys
import time
from collections.abc import Callable

import jax
import numpy as np
from jax.sharding import NamedSharding

from models import LlamaConfig
from toolkit.hf.folder import HFFolder, dtype
from toolkit.hf.tensors import TensorMap, normalize


def _log(message: str) -> None:
  if jax.process_index() == 0:
    print(message, file=sys.stderr, flush=True)


def read_block(folder: HFFolder, entry: TensorMap, index: tuple[slice, ...],
               param_dtype: np.dtype, n_layers: int) -> np.ndarray:
  """meshkit's block `index` of parameter `entry` (its stacked axes first: layers, experts),
  read one HF tensor at a time."""
  lead = len(entry.stack_shape(n_layers))
  ranges = [range(s.start, s.stop) for s in index[:lead]]
  block = np.empty(tuple(s.stop - s.start for s in index), param_dtype)
  for at in itertools.product(*ranges):
    name = entry.hf_name(*at)
    block[tuple(i - r.start for i, r in zip(at, ranges))] = entry.read(
        lambda hf_index, name=name: folder.read(name, hf_index), index[lead:])
  return block


def read_array(folder: HFFolder, entry: TensorMap, shape: tuple[int, ...],
               sharding: NamedSharding, param_dtype: np.dtype, n_layers: int) -> jax.Array:
  """One parameter as a global array in `sharding`, built from per-device slices. Devices
  that hold the same slice (replicated axes) share one read. Not `make_array_from_callback`:
  it collects every device's slice on the host before placing any (jax 0.10.2), i.e. this
  process's whole share of the parameter at once; here each slice is placed, then dropped."""
  by_index: dict[tuple, list[jax.Device]] = {}
  for device, index in sharding.addressable_devices_indices_map(shape).items():
    key = tuple((s.start, s.stop) for s in normalize(index, shape))
    by_index.setdefault(key, []).append(device)
  pieces = {}
  for key, devices in by_index.items():
    block = read_block(folder, entry, tuple(slice(*k) for k in key), param_dtype, n_layers)
    for device in devices:
      pieces[device] = jax.device_put(block, device)
    del block  # the devices hold their copies; the host's goes before the next read
  arrays = [pieces[device] for device in sharding.addressable_devices_indices_map(shape)]
  return jax.make_array_from_single_device_arrays(shape, sharding, arrays)


def read_params(folder: HFFolder, cfg: LlamaConfig, shardings: dict,
                progress: Callable[[str], None] = _log) -> dict:
  """All parameters of `cfg` from `folder`, each in its sharding from `shardings` (a nested
  dict like the parameter tree). Checks the folder first (`HFFolder.check`)."""
  table = folder.check(cfg)
  param_dtype = dtype(cfg.param_dtype)
  params: dict = {}
  start, last_report, done_bytes = time.perf_counter(), 0.0, 0
  total_bytes = sum(_shape_size(e, cfg) for e in table) * param_dtype.itemsize
  for number, entry in enumerate(table, 1):
    shape = entry.stack_shape(cfg.n_layers) + entry.layer_shape
    *parents, leaf = entry.path.split("/")
    node, sharding = params, shardings
    for part in parents:
      node, sharding = node.setdefault(part, {}), sharding[part]
    node[leaf] = read_array(folder, entry, shape, sharding[leaf], param_dtype, cfg.n_layers)
    done_bytes += int(np.prod(shape)) * param_dtype.itemsize
    now = time.perf_counter()
    if now - last_report > 2.0 or number == len(table):
      last_report = now
      progress(f"read {number}/{len(table)} parameters, {done_bytes / 2**20:,.1f} of "
               f"{total_bytes / 2**20:,.1f} MiB in {now - start:.1f} s")
  return params


def _shape_size(entry: TensorMap, cfg: LlamaConfig) -> int:
  return int(np.prod(entry.stack_shape(cfg.n_layers) + entry.layer_shape))
