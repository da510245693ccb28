"""Per-device code under the active activation rules: `jax.shard_map` with logical axes.

Most of a model is written for the whole array and left to the compiler to partition
(`sharding.constrain`). Some computations are clearer, or only possible, per device with the
collectives written out: a mixture-of-experts layer exchanging tokens between the devices that
hold the experts, a Pallas kernel (splash attention) that must see one device's block. These
functions let model code do that while naming only logical axes:

  experts = sharding.active_axes("experts")   # e.g. ("expert",), or () without rules
  out = sharding.shard_map(per_device, in_axes=(("batch", None), ("experts", None, "mlp")),
                           out_axes=("batch", None))(tokens, weights)

Contract of `shard_map(per_device, in_axes, out_axes)(*args)`:
  * inside `activation_rules(rules, mesh)`: `per_device` runs once per device on the blocks
    that the activation rules give each argument (its logical axes resolved as `constrain`
    would; None or a name the rules leave unsplit: the whole dimension) and its outputs are
    assembled the same way. Mesh axes an argument's rules leave out are whole on every device:
    `per_device` runs the same on every device along them. Inside `per_device` `constrain` is
    off (the blocks are already placed), and collectives take the mesh axes from
    `active_axes`, resolved before the call. A dimension the mesh axes do not divide is a
    ShardingError naming it, as in `constrain`.
  * outside `activation_rules` there is no mesh: `per_device` runs on the whole arrays and
    `active_axes` is (), so a per-device function whose collectives run over
    `active_axes(...)` and skip empty tuples is the unsharded computation as well.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec

from sharding import rules as rules_lib

LogicalAxes = Sequence[str | None]


def active_mesh() -> Mesh | None:
  """The mesh of the active `activation_rules`, or None outside them."""
  active = rules_lib.active()
  return None if active is None else active[1]


def active_axes(logical_name: str) -> tuple[str, ...]:
  """The mesh axes the active activation rules split `logical_name` over (those the mesh
  has, in order); () outside `activation_rules` or when it is not split."""
  active = rules_lib.active()
  if active is None:
    return ()
  rules, mesh = active
  entry = rules.activation_spec((logical_name,), mesh)
  if not entry or entry[0] is None:
    return ()
  return (entry[0],) if isinstance(entry[0], str) else tuple(entry[0])


def active_ways(logical_name: str) -> int:
  """How many blocks the active activation rules split `logical_name` into (1 outside)."""
  mesh = active_mesh()
  return 1 if mesh is None else math.prod(mesh.shape[a] for a in active_axes(logical_name))


def _is_axes(node) -> bool:
  return isinstance(node, tuple) and all(a is None or isinstance(a, str) for a in node)


def shard_map(per_device: Callable, in_axes, out_axes, *, check_vma: bool = True) -> Callable:
  """`per_device` applied to each device's blocks of its arguments; see the module docstring.

  Args:
    per_device: a function of arrays returning arrays (or pytrees of them).
    in_axes: per argument, a tuple of logical axis names (or None), one per dimension; a
      pytree of such tuples matching the arguments.
    out_axes: the same for the outputs.
    check_vma: `jax.shard_map`'s check of which mesh axes each value varies over (it gives
      collectives their efficient transposes). False for bodies whose primitives have no
      such rule, such as Pallas kernels (splash attention).
  """

  # functools.partial objects have no __name__; the function inside does.
  name = getattr(getattr(per_device, "func", per_device), "__name__", "per-device function")

  def mapped(*args):
    active = rules_lib.active()
    if active is None:
      return per_device(*args)
    rules, mesh = active
    spec = lambda axes, x=None: rules.activation_spec(
        axes, mesh, None if x is None else x.shape, what=f"{name} argument")
    in_specs = jax.tree.map(spec, tuple(in_axes), tuple(args), is_leaf=_is_axes)
    out_specs = jax.tree.map(spec, out_axes, is_leaf=_is_axes)

    def inner(*blocks):
      with rules_lib.no_rules():  # blocks are per-device arrays: no sharding constraints here
        return per_device(*blocks)

    return jax.shard_map(inner, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                         check_vma=check_vma)(*args)

  return mapped


def _axes_of(entry) -> tuple[str, ...]:
  return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def take_rows(table: jax.Array, ids: jax.Array) -> jax.Array:
  """`jnp.take(table, ids, axis=0)` for a (vocab, embed) table stored by the parameter rules
  and (batch, length) ids placed by the activation rules: (batch, length, embed).

  On CPU devices, where the rules store the table split over its embed dimension only (fsdp)
  and split the batch over those same mesh axes last (batch -> data, fsdp), each device looks
  its embed slice up for the ids of its fsdp group, and an all-to-all hands every device its
  own rows whole. The gradient is the mirror image: an all-to-all, then a scatter-add into the
  device's own slice of the table. No device holds a whole (vocab, embed) gradient and none is
  all-reduced; left to the partitioner, the table's gradient is built whole on every device
  and all-reduced (32 MB a step for a 32k x 256 float32 table).

  Anywhere else (the vocabulary or the positions split, other batch axes; TPUs and GPUs until
  the compiled memory figures in docs/compile.md are measured again with this path):
  `jnp.take` partitioned by XLA, the gradient's layout named with `constrain_grad` (XLA's
  partitioner would otherwise weigh moving the rows' batch split onto the table's embed split
  by replicating them, drop it, and warn)."""
  active = rules_lib.active()
  if active is None:
    return jnp.take(table, ids, axis=0)
  rules, mesh = active
  partitioned = lambda: jnp.take(rules_lib.constrain_grad(table, ("vocab", "embed")), ids,
                                 axis=0)
  table_spec = tuple(rules.param_spec(("vocab", "embed"), mesh)) + (None, None)
  ids_spec = tuple(rules.activation_spec(("batch", "length"), mesh)) + (None, None)
  embed_axes, batch_axes = _axes_of(table_spec[1]), _axes_of(ids_spec[0])
  if (mesh.devices.flat[0].platform != "cpu"
      or table_spec[0] is not None or ids_spec[1] is not None or not embed_axes
      or batch_axes[len(batch_axes) - len(embed_axes):] != embed_axes
      or ids.shape[0] % math.prod(mesh.shape[a] for a in batch_axes)):
    return partitioned()

  def per_device(table_block, ids_block):
    group_ids = jax.lax.all_gather(ids_block, embed_axes, axis=0, tiled=True)
    slices = jnp.take(table_block, group_ids, axis=0)  # (group rows, length, embed / ways)
    return jax.lax.all_to_all(slices, embed_axes, split_axis=0, concat_axis=2, tiled=True)

  return jax.shard_map(per_device, mesh=mesh,
                       in_specs=(PartitionSpec(None, table_spec[1]), PartitionSpec(ids_spec[0])),
                       out_specs=PartitionSpec(ids_spec[0]))(table, ids)
