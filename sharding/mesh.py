"""Device meshes from ordered (axis, size) pairs, inside a slice (ICI) and across slices (DCN).

A mesh spec is an ordered list such as ``[("data", 1), ("fsdp", -1), ("tensor", 2)]``. At most
one size per tier may be -1; it is filled so the sizes multiply to the devices of that tier
(devices per slice for ICI, the number of slices for DCN). The mesh axis of a name has size
``ici * dcn``, with the DCN part outermost so that neighbours along an axis share a slice.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh

from sharding.errors import ShardingError

# The mesh axes meshkit knows, in the order they are usually listed (outermost first).
# `population` splits the trials of a population sweep (toolkit.tuning.population) across devices;
# only sweeps add it, and the model's own axes then share the devices of one trial group.
MESH_AXES: tuple[str, ...] = ("population", "data", "stage", "fsdp", "sequence", "expert",
                              "tensor")

AxisSizes = Sequence[tuple[str, int]]


def parse_axis_sizes(text: str, field: str = "mesh.ici") -> list[tuple[str, int]]:
  """Parses ``"data:1,fsdp:-1,tensor:2"`` into ``[("data", 1), ("fsdp", -1), ("tensor", 2)]``."""
  pairs = []
  for item in (part.strip() for part in text.split(",")):
    if not item:
      continue
    name, sep, size = item.partition(":")
    name = name.strip()
    try:
      if not sep or not name:
        raise ValueError
      size_int = int(size)
    except ValueError:
      raise ShardingError(
          f"{field}={text!r}: entry {item!r} is not 'axis:size'; write e.g. 'fsdp:-1,tensor:2'"
      ) from None
    pairs.append((name, size_int))
  return pairs


def _fill_sizes(pairs: AxisSizes, total: int, field: str, what: str) -> list[tuple[str, int]]:
  """Checks names and sizes of one tier and fills its -1 so the sizes multiply to `total`."""
  names = [name for name, _ in pairs]
  for name in names:
    if name not in MESH_AXES:
      raise ShardingError(
          f"{field}: unknown mesh axis {name!r}; use one of {', '.join(MESH_AXES)}")
  duplicates = sorted({name for name in names if names.count(name) > 1})
  if duplicates:
    raise ShardingError(f"{field}: mesh axis {duplicates[0]!r} is listed twice; list each once")
  wildcards = [name for name, size in pairs if size == -1]
  if len(wildcards) > 1:
    raise ShardingError(
        f"{field}: axes {' and '.join(wildcards)} are both -1; at most one size per tier may be -1")
  for name, size in pairs:
    if size != -1 and size < 1:
      raise ShardingError(f"{field}: axis {name}={size}; sizes must be >= 1 (or -1 to fill)")
  known = math.prod(size for _, size in pairs if size != -1)
  if wildcards:
    if total % known:
      raise ShardingError(
          f"{field}: the fixed sizes multiply to {known}, which does not divide {total} {what}; "
          f"choose sizes whose product divides {total}")
    return [(name, total // known if size == -1 else size) for name, size in pairs]
  if known != total:
    layout = ",".join(f"{name}:{size}" for name, size in pairs)
    raise ShardingError(
        f"{field}: {layout} uses {known} {what} but there are {total}; "
        f"sizes must multiply to {total} (or set one size to -1)")
  return list(pairs)


def make_mesh(ici: AxisSizes, dcn: AxisSizes = (), devices: Sequence[jax.Device] | None = None,
              *, ici_field: str = "mesh.ici", dcn_field: str = "mesh.dcn") -> Mesh:
  """Builds a mesh whose axes are the ICI axes in order; DCN sizes multiply into them.

  Args:
    ici: ordered (axis, size) pairs inside one slice; their product is the devices per slice.
    dcn: (axis, size) pairs across slices, naming axes that also appear in `ici`; the product
      is the number of slices. Empty for one slice.
    devices: the devices to use (default: all of `jax.devices()`).
  """
  devices = list(jax.devices() if devices is None else devices)
  dcn_total = math.prod(size for _, size in dcn if size != -1) if dcn else 1
  dcn_pairs = _fill_sizes(dcn, _slice_count(devices, dcn_total), dcn_field, "slices") if dcn else []
  num_slices = math.prod(size for _, size in dcn_pairs) if dcn_pairs else 1
  if len(devices) % num_slices:
    raise ShardingError(
        f"{dcn_field}: {num_slices} slices do not divide {len(devices)} devices; "
        f"choose sizes whose product divides {len(devices)}")
  ici_pairs = _fill_sizes(ici, len(devices) // num_slices, ici_field, "devices per slice")
  names = [name for name, _ in ici_pairs]
  for name, _ in dcn_pairs:
    if name not in names:
      raise ShardingError(
          f"{dcn_field}: axis {name!r} is not in {ici_field}; list it there too (size 1 is fine)")
  dcn_sizes = dict(dcn_pairs)
  ici_shape = [size for _, size in ici_pairs]
  dcn_shape = [dcn_sizes.get(name, 1) for name in names]
  if num_slices == 1:
    device_array = mesh_utils.create_device_mesh(ici_shape, devices, allow_split_physical_axes=True)
  elif all(hasattr(d, "slice_index") for d in devices):
    # As for one slice: an axis may take part of a physical axis (fsdp=32 x tensor=2 on 4x4x4).
    device_array = mesh_utils.create_hybrid_device_mesh(ici_shape, dcn_shape, devices,
                                                        allow_split_physical_axes=True)
  else:
    device_array = _blocked_hybrid(ici_shape, dcn_shape, devices)
  return Mesh(device_array, tuple(names), axis_types=(AxisType.Auto,) * len(names))


def _slice_count(devices: Sequence[jax.Device], fixed_product: int) -> int:
  """The number of slices: from the devices when they know it, else what the spec fixes."""
  slice_ids = {getattr(d, "slice_index", None) for d in devices}
  if None not in slice_ids:
    return len(slice_ids)
  return fixed_product


def _blocked_hybrid(ici_shape: list[int], dcn_shape: list[int],
                    devices: Sequence[jax.Device]) -> np.ndarray:
  """A hybrid mesh for devices without slice ids (CPU/GPU): consecutive blocks act as slices."""
  rank = len(ici_shape)
  blocks = np.asarray(devices, dtype=object).reshape(dcn_shape + ici_shape)
  # Interleave (dcn_0, ..., ici_0, ...) into (dcn_0, ici_0, dcn_1, ici_1, ...): DCN outermost.
  order = [axis for pair in zip(range(rank), range(rank, 2 * rank)) for axis in pair]
  return blocks.transpose(order).reshape([d * i for d, i in zip(dcn_shape, ici_shape)])
