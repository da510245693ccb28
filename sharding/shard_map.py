"""Per-device code under logical axes: `jax.shard_map` for models that name no mesh axis.

Kernels that must see one device's block of an array (the Pallas splash-attention kernel;
later expert dispatch and ring attention) say how their inputs split in logical names, as
`constrain` does, and the active `activation_rules` turn those into mesh axes:

  out = logical_shard_map(kernel, in_axes=(("batch", "length", "heads", None),) * 3,
                          out_axes=("batch", "length", "heads", None))(q, k, v)

Contract of `logical_shard_map(fn, in_axes, out_axes)(*args)`:
  * inside `activation_rules(rules, mesh)`: `fn` runs once per device on its block of each
    argument, split along the mesh axes the rules give each logical name (None or a name the
    rules leave unsplit: the whole dimension); its outputs, blocks laid out by `out_axes`, are
    put back together. Mesh axes that no argument's axes use are replicated: `fn` runs the
    same on every device along them. Inside `fn`, `constrain` is a no-op (it sees blocks);
    ask for mesh axis names with `mesh_axes` before entering if `fn` needs collectives.
  * outside any rules (an unsharded call): `fn(*args)` directly.
A dimension the mesh axes do not divide is a ShardingError naming it, as in `constrain`.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import jax
from jax.sharding import Mesh

from sharding import rules as rules_lib

Axes = Sequence[str | None]


def active_mesh() -> Mesh | None:
  """The mesh of the active `activation_rules`, or None outside them."""
  active = rules_lib.active()
  return None if active is None else active[1]


def mesh_axes(logical: str) -> tuple[str, ...]:
  """The mesh axes the active rules split `logical` over (those the mesh has); () outside
  rules or when it is replicated."""
  active = rules_lib.active()
  if active is None:
    return ()
  rules, mesh = active
  return tuple(a for a in rules.activations[logical] if a in mesh.shape)


def logical_ways(logical: str) -> int:
  """How many blocks the active rules split `logical` into (1 outside rules)."""
  active = rules_lib.active()
  if active is None:
    return 1
  return math.prod(active[1].shape[a] for a in mesh_axes(logical))


def logical_shard_map(fn: Callable, in_axes: Sequence[Axes], out_axes: Axes | Sequence[Axes]
                      ) -> Callable:
  """`fn` on each device's block of its arguments, split by logical axes (module docstring).

  in_axes: one tuple of logical names (or None) per positional argument, one entry per
  dimension. out_axes: one such tuple for a single array output, or a tuple of them (a list
  for several outputs)."""

  def wrapped(*args):
    active = rules_lib.active()
    if active is None:
      return fn(*args)
    rules, mesh = active
    name = getattr(fn, "__name__", "logical_shard_map")
    if len(args) != len(in_axes):
      raise TypeError(f"{name}: {len(args)} arguments but {len(in_axes)} in_axes")
    in_specs = tuple(rules.activation_spec(axes, mesh, arg.shape, what=f"{name} input")
                     for axes, arg in zip(in_axes, args))
    several = bool(out_axes) and not isinstance(out_axes[0], (str, type(None)))
    outs = out_axes if several else (out_axes,)
    out_specs = tuple(rules.activation_spec(axes, mesh, what=f"{name} output") for axes in outs)

    def body(*blocks):
      with rules_lib.no_rules():  # blocks are local: nothing to constrain
        return fn(*blocks)

    mapped = jax.shard_map(body, mesh=mesh, in_specs=in_specs,
                           out_specs=out_specs if several else out_specs[0], check_vma=False)
    return mapped(*args)

  return wrapped
