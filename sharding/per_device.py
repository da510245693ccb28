"""Per-device code under the active activation rules: `jax.shard_map` with logical axes.

Most of a model is written for the whole array and left to the compiler to partition
(`sharding.constrain`). Some computations are clearer per device, with the collectives
written out: a mixture-of-experts layer exchanging tokens between the devices that hold the
experts. These two functions let model code do that while naming only logical axes:

  experts = sharding.active_axes("experts")   # e.g. ("expert",), or () without rules
  out = sharding.shard_map(per_device, in_axes=(("batch", None), ("experts", None, "mlp")),
                           out_axes=("batch", None))(tokens, weights)

Contract: inside `activation_rules(rules, mesh)`, `per_device` runs once per device on the
blocks that the activation rules give each argument (its logical axes resolved as
`constrain` would) and its outputs are assembled the same way; mesh axes an argument's rules
leave out are whole on every device. Inside `per_device` `constrain` is off (the blocks are
already placed), and collectives take the mesh axes from `active_axes`, resolved before the
call. Outside `activation_rules` there is no mesh: `shard_map` calls `per_device` on the whole
arrays and `active_axes` is (), so a per-device function whose collectives run over
`active_axes(...)` and skip empty tuples is the unsharded computation as well.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import jax

from sharding.rules import _ACTIVE

LogicalAxes = Sequence[str | None]


def active_axes(logical_name: str) -> tuple[str, ...]:
  """The mesh axes the active activation rules split `logical_name` over (those the mesh
  has, in order); () outside `activation_rules`."""
  active = _ACTIVE.value
  if active is None:
    return ()
  rules, mesh = active
  entry = rules.activation_spec((logical_name,), mesh)
  if not entry or entry[0] is None:
    return ()
  return (entry[0],) if isinstance(entry[0], str) else tuple(entry[0])


def _is_axes(node) -> bool:
  return isinstance(node, tuple) and all(a is None or isinstance(a, str) for a in node)


def shard_map(per_device: Callable, in_axes, out_axes) -> Callable:
  """`per_device` applied to each device's blocks of its arguments; see the module docstring.

  Args:
    per_device: a function of arrays returning arrays (or pytrees of them).
    in_axes: per argument, a tuple of logical axis names (or None), one per dimension; a
      pytree of such tuples matching the arguments.
    out_axes: the same for the outputs.
  """

  # functools.partial objects have no __name__; the function inside does.
  name = getattr(getattr(per_device, "func", per_device), "__name__", "per-device function")

  def mapped(*args):
    active = _ACTIVE.value
    if active is None:
      return per_device(*args)
    rules, mesh = active
    spec = lambda axes, x=None: rules.activation_spec(
        axes, mesh, None if x is None else x.shape, what=f"{name} argument")
    in_specs = jax.tree.map(spec, tuple(in_axes), tuple(args), is_leaf=_is_axes)
    out_specs = jax.tree.map(spec, out_axes, is_leaf=_is_axes)

    def inner(*blocks):
      with _ACTIVE(None):  # blocks are per-device arrays: no sharding constraints in here
        return per_device(*blocks)

    return jax.shard_map(inner, mesh=mesh, in_specs=in_specs, out_specs=out_specs)(*args)

  return mapped
