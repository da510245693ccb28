"""One table per run: every parameter's shape, logical axes, PartitionSpec and bytes per device."""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Sequence

import numpy as np
from jax.sharding import Mesh, PartitionSpec

from sharding.errors import ShardingError
from sharding.rules import Rules


@dataclasses.dataclass(frozen=True)
class Row:
  path: str
  shape: tuple[int, ...]
  dtype: str
  logical_axes: tuple[str | None, ...]
  spec: PartitionSpec
  total_bytes: int
  per_device_bytes: int

  @property
  def replicated(self) -> bool:
    return self.total_bytes == self.per_device_bytes


@dataclasses.dataclass(frozen=True)
class ShardingReport:
  rows: tuple[Row, ...]
  mesh_shape: dict[str, int]

  @property
  def total_bytes(self) -> int:
    return sum(r.total_bytes for r in self.rows)

  @property
  def per_device_bytes(self) -> int:
    return sum(r.per_device_bytes for r in self.rows)

  @property
  def replicated_bytes(self) -> int:
    return sum(r.total_bytes for r in self.rows if r.replicated)

  @property
  def replicated_fraction(self) -> float:
    return self.replicated_bytes / max(self.total_bytes, 1)

  def specs(self) -> dict[str, str]:
    """path -> PartitionSpec text; the golden dumps in tests compare this."""
    return {r.path: str(r.spec) for r in self.rows}

  def format(self) -> str:
    headers = ("parameter", "shape", "logical axes", "PartitionSpec", "bytes/device")
    body = [(r.path, "x".join(map(str, r.shape)) or "scalar",
             ",".join(a or "-" for a in r.logical_axes), _spec_text(r.spec),
             _human(r.per_device_bytes)) for r in self.rows]
    widths = [max(len(h), *(len(row[i]) for row in body)) if body else len(h)
              for i, h in enumerate(headers)]
    line = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()
    mesh = " ".join(f"{k}={v}" for k, v in self.mesh_shape.items())
    return "\n".join([
        f"sharding on mesh {mesh}", line(headers), line(["-" * w for w in widths]),
        *(line(row) for row in body),
        f"total {_human(self.total_bytes)} of parameters, {_human(self.per_device_bytes)} per "
        f"device; replicated {_human(self.replicated_bytes)} ({self.replicated_fraction:.1%})"])

  def check_replicated(self, max_fraction: float, action: str) -> str | None:
    """Returns a warning (action 'warn') or raises (action 'fail') above `max_fraction`."""
    if math.prod(self.mesh_shape.values()) == 1 or self.replicated_fraction <= max_fraction:
      return None
    message = (f"{self.replicated_fraction:.1%} of parameter bytes are replicated on every "
               f"device (limit sharding.max_replicated_fraction={max_fraction}); use a preset "
               f"that shards parameters (fsdp, fsdp_tp) or raise the limit")
    if action == "fail":
      raise ShardingError(message)
    return message


def sharding_report(params: Iterable[tuple[str, Sequence[int], object, Sequence[str | None]]],
                    rules: Rules, mesh: Mesh) -> ShardingReport:
  """Resolves each (path, shape, dtype, logical axes) by the parameter rules on `mesh`."""
  rows = []
  for path, shape, dtype, logical_axes in params:
    spec = rules.param_spec(logical_axes, mesh, shape, what=f"parameter {path}")
    total = math.prod(shape) * np.dtype(dtype).itemsize
    ways = math.prod(mesh.shape[a] for entry in spec if entry is not None
                     for a in ((entry,) if isinstance(entry, str) else entry))
    rows.append(Row(path, tuple(shape), str(np.dtype(dtype)), tuple(logical_axes), spec, total,
                    total // ways))
  return ShardingReport(tuple(rows), dict(mesh.shape))


def _spec_text(spec: PartitionSpec) -> str:
  return "P(" + ", ".join("None" if e is None else e if isinstance(e, str) else
                          "(" + ",".join(e) + ")" for e in spec) + ")"


def _human(n: int) -> str:
  for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
    if n < 1024 or unit == "TiB":
      return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
    n /= 1024
  raise AssertionError


__all__ = ["Row", "ShardingError", "ShardingReport", "sharding_report"]
