"""Fingerprints of the train state: computed on the devices when a checkpoint is saved, stored
beside it, and checked after a restore, so damage that still decodes (flipped bytes in an array
file restore without any error) is found before a run trains on it.

A fingerprint is one uint32 per array: the sum over its elements, read as unsigned integers of
their width, of bits[i] * w[i] mod 2**32, with odd weights w[i] = (i * 0x9E3779B1) | 1 for flat
index i. A change confined to one element always changes it (an odd weight is invertible mod
2**32); other damage goes unseen with probability about 2**-32. It is one pass over the array's
bytes where the array lives, sharded like it: each device sums its shard, then one scalar per
array is all-reduced.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from toolkit.training.programs import Programs

_UNSIGNED = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint32}
_GOLDEN = np.uint32(0x9E3779B1)  # 2**32 / golden ratio: spreads neighbouring indices


def fingerprint(x: jax.Array) -> jax.Array:
  """uint32 scalar fingerprint of `x` (any dtype; 64-bit ones as pairs of 32-bit words)."""
  bits = jax.lax.bitcast_convert_type(x, _UNSIGNED[x.dtype.itemsize]).astype(jnp.uint32)
  # The flat index from per-dimension iotas (elementwise, so each shard computes its own).
  index = jnp.zeros(bits.shape, jnp.uint32)
  stride = 1
  for dim in reversed(range(bits.ndim)):
    index = index + jax.lax.broadcasted_iota(jnp.uint32, bits.shape, dim) * np.uint32(stride)
    stride = (stride * bits.shape[dim]) % 2**32
  weights = (index * _GOLDEN) | np.uint32(1)
  return jnp.sum(bits * weights, dtype=jnp.uint32)


_COMPILED: dict = {}


def compile_for(tree, programs: Programs | None = None) -> None:
  """Compiles the fingerprint program for `tree`'s layout (arrays, or abstract arrays carrying
  shardings) ahead of the first save, so that save does not block the loop for a compile (or
  reads it back from `programs`)."""
  _compiled(tree, programs)


def _compiled(tree, programs: Programs | None = None):
  """The compiled fingerprints of all leaves, as one uint32 vector (one transfer to the host),
  one program per tree structure and sharding layout."""
  leaves, treedef = jax.tree.flatten(tree)
  key = (treedef, tuple((x.shape, x.dtype, x.sharding) for x in leaves))
  if key not in _COMPILED:
    mesh = next((x.sharding.mesh for x in leaves if isinstance(x.sharding, NamedSharding)), None)
    out = NamedSharding(mesh, PartitionSpec()) if mesh is not None else None
    abstract = [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding) for x in leaves]
    _COMPILED[key] = (programs or Programs(None, "")).compile(
        "fingerprints", jax.jit(lambda xs: jnp.stack([fingerprint(x) for x in xs]),
                                out_shardings=out), abstract)
  return _COMPILED[key]


@dataclasses.dataclass(frozen=True)
class Pending:
  """Fingerprints being computed on the devices: their paths, and the values to come."""
  paths: list[str]
  values: jax.Array


def start(tree) -> Pending:
  """Starts the fingerprints of `tree`'s arrays on the devices; returns at once."""
  paths = [_path(path) for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]
  return Pending(paths, _compiled(tree)(jax.tree.leaves(tree)))


def collect(pending: Pending) -> dict[str, int]:
  """Path ("params/embed", "opt_state/1/0/mu/embed", ...) -> fingerprint, once computed."""
  return dict(zip(pending.paths, (int(v) for v in np.asarray(jax.device_get(pending.values)))))


def fingerprints(tree) -> dict[str, int]:
  return collect(start(tree))


def mismatches(tree, expected: dict[str, int], prefix: str = "") -> list[str]:
  """Paths of `tree`'s arrays whose fingerprint differs from `expected` (saved ones), or that
  `expected` lacks; `prefix` places `tree` inside the saved state (e.g. "params/")."""
  actual = fingerprints(tree)
  return [prefix + path for path, value in actual.items()
          if expected.get(prefix + path) != value]


def _path(path) -> str:
  return "/".join(str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in path)
