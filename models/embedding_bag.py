"""Embedding bags for recommendation models: a table of rows, looked up by bags of ids (multi-hot
features) and pooled into one vector per example, on any mesh without ever moving a table.

  pooled = embedding_bag.lookup(table, ids, lengths, weights, pooling="sum", name="item")

- `table` (rows, dim), logical axes ("table_rows", "table_embed").
- `ids` (batch, max_bag) int, padded; `lengths` (batch,) real ids per bag; `weights` (batch,
  max_bag) per id, or None for 1. Ids at or past a bag's length, and ids outside
  [0, rows), add nothing.
- `sum` pools sum(w x row); `mean` divides that by the bag's length (0 for an empty bag).

Ids from the wild go through `hash_ids` first (Knuth's multiplicative hash, stated there).
Many tables of one width, replicated or row-wise, are looked up all at once with
`lookup_stacked`: one gather from their rows stacked, and one pair of collectives for all of
them, as TorchRec's table-batched embeddings do, where a lookup per table launches its own.

Placement follows the active rules (sharding.activation_rules) for the table's two axes:
- **replicated**: each device pools its batch block's bags from its own copy;
- **row-wise**, "table_rows" over mesh axes R: the ids are all-gathered over the R axes that
  also split the batch; each device pools the ids that fall in its rows (the rest add zero);
  a reduce-scatter over those axes (and a sum over R axes that do not split the batch) hands
  each device its batch block. The gradient scatters into each device's own rows only;
- **column-wise**, "table_embed" over mesh axes C that split the batch: the ids are
  all-gathered over C, each device pools its columns, and an all-to-all hands every device
  its batch block with all columns.
Only ids, pooled rows and their gradients cross the network. A table whose parameter rules
differ from its activation rules would be resharded at every step, and one split both ways
has no lookup here: both are a ShardingError naming the table.
"""
from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp

import sharding
from sharding import rules as rules_lib

TABLE = ("table_rows", "table_embed")
BAG = ("batch", None)
POOLINGS = ("sum", "mean")
# Knuth's multiplicative hash constant (2^32 / golden ratio, odd: a bijection of uint32).
HASH_MULTIPLIER = 2654435761


def hash_ids(ids: jax.Array, rows) -> jax.Array:
  """Any integer ids into [0, rows): ((id mod 2^32) x 2654435761 mod 2^32) mod rows, int32.
  Equal ids always land on the same row; distinct ids collide as a random hash's would.
  `rows` is an int, or an array that broadcasts against `ids` (a row count per table)."""
  hashed = ids.astype(jnp.uint32) * jnp.uint32(HASH_MULTIPLIER)
  return (hashed % jnp.asarray(rows, jnp.uint32)).astype(jnp.int32)


def lookup_stacked(tables: Sequence[jax.Array], ids: jax.Array, lengths: jax.Array, *,
                   pooling: str = "sum", names: Sequence[str] | None = None) -> jax.Array:
  """(batch, T, dim): every table's bags at once, for T tables of one width placed alike,
  equal to T calls of `lookup`. `ids` (batch, T, max_bag) are rows of their own table,
  `lengths` (batch, T). Tables that are replicated or row-wise are looked up as TorchRec's
  table-batched embeddings are: their (local) rows stacked, one gather for every bag, and for
  row-wise tables one all-gather of the ids and one reduce-scatter of the pooled rows in all,
  not one per table. Column-wise tables take one `lookup` each."""
  if pooling not in POOLINGS:
    raise ValueError(f"pooling={pooling!r} is unknown; choose one of {', '.join(POOLINGS)}")
  names = list(names or (f"table{t}" for t in range(len(tables))))
  rows_axes, cols_axes = sharding.active_axes(TABLE[0]), sharding.active_axes(TABLE[1])
  if cols_axes:
    return jnp.stack([lookup(table, ids[:, t], lengths[:, t], pooling=pooling, name=names[t])
                      for t, table in enumerate(tables)], axis=1)
  _check_stored_as_computed(names[0])
  rows = jnp.asarray([t.shape[0] for t in tables], jnp.int32)[None, :, None]
  inside = ((ids >= 0) & (ids < rows)
            & (jnp.arange(ids.shape[2])[None, None, :] < lengths[:, :, None]))
  weights = inside.astype(tables[0].dtype)
  ids = jnp.where(inside, ids, 0)
  batch_axes = sharding.active_axes("batch")
  gather = tuple(a for a in batch_axes if a in rows_axes)
  per_device = functools.partial(_stacked_per_device, rows_axes=rows_axes, gather=gather)
  bags = ("batch", None, None)
  pooled = sharding.shard_map(per_device, in_axes=((TABLE,) * len(tables), bags, bags),
                              out_axes=bags)(tuple(tables), ids, weights)
  if pooling == "mean":
    return pooled / jnp.maximum(lengths, 1).astype(pooled.dtype)[:, :, None]
  return pooled


def _stacked_per_device(blocks, ids, weights, *, rows_axes: Sequence[str],
                        gather: tuple[str, ...]):
  """This device's rows of every table, stacked, pooled for every bag of its `gather` group
  (each device's own bags when the tables are replicated), summed back over the rows' axes."""
  if gather:
    ids = jax.lax.all_gather(ids, gather, axis=0, tiled=True)
    weights = jax.lax.all_gather(weights, gather, axis=0, tiled=True)
  local_rows = [b.shape[0] for b in blocks]
  starts = jnp.asarray([sum(local_rows[:i]) for i in range(len(blocks))], jnp.int32)
  local = ids
  if rows_axes:
    local = ids - jax.lax.axis_index(tuple(rows_axes)) * jnp.asarray(local_rows)[None, :, None]
    mine = (local >= 0) & (local < jnp.asarray(local_rows)[None, :, None])
    local, weights = jnp.where(mine, local, 0), jnp.where(mine, weights, 0)
  stacked = jnp.concatenate(blocks, axis=0)
  pooled = jnp.einsum("btk,btkd->btd", weights,
                      jnp.take(stacked, local + starts[None, :, None], axis=0))
  if gather:
    pooled = jax.lax.psum_scatter(pooled, gather, scatter_dimension=0, tiled=True)
  rest = tuple(a for a in rows_axes if a not in gather)
  return jax.lax.psum(pooled, rest) if rest else pooled


def reference(table, ids, lengths, weights=None, pooling: str = "sum") -> jax.Array:
  """The lookup on one device, with `jnp.take`: what every placement must equal."""
  weights = _bag_weights(ids, lengths, weights, table.dtype)
  rows = jnp.take(table, ids, axis=0, mode="fill", fill_value=0)
  return _finish(jnp.einsum("bk,bkd->bd", weights, rows), lengths, pooling)


def lookup(table: jax.Array, ids: jax.Array, lengths: jax.Array,
           weights: jax.Array | None = None, *, pooling: str = "sum",
           name: str = "table") -> jax.Array:
  """(batch, dim) pooled rows of `table` for each bag, placed as the active rules say (see the
  module docstring); `name` names the table in errors."""
  if pooling not in POOLINGS:
    raise ValueError(f"embedding table {name}: pooling={pooling!r} is unknown; choose one of "
                     f"{', '.join(POOLINGS)}")
  _check_stored_as_computed(name)
  weights = _bag_weights(ids, lengths, weights, table.dtype)
  rows_axes, cols_axes = sharding.active_axes(TABLE[0]), sharding.active_axes(TABLE[1])
  batch_axes = sharding.active_axes("batch")
  if rows_axes and cols_axes:
    raise sharding.ShardingError(
        f"embedding table {name}: split over {rows_axes} by rows and {cols_axes} by columns; "
        f"choose row-wise (table_rows) or column-wise (table_embed)")
  if not set(cols_axes) <= set(batch_axes):
    raise sharding.ShardingError(
        f"embedding table {name}: column-wise over {cols_axes}, but the batch is split over "
        f"{batch_axes}; split table_embed only over mesh axes that split the batch")
  if rows_axes:
    gather = tuple(a for a in batch_axes if a in rows_axes)
    per_device = functools.partial(_rows_per_device, rows_axes=rows_axes, gather=gather)
  elif cols_axes:
    per_device = functools.partial(_columns_per_device, cols_axes=cols_axes)
  else:
    per_device = _pool  # each device pools its batch block from its own copy
  pooled = sharding.shard_map(per_device, in_axes=(TABLE, BAG, BAG),
                              out_axes=("batch", None))(table, ids, weights)
  return _finish(pooled, lengths, pooling)


def _bag_weights(ids, lengths, weights, dtype) -> jax.Array:
  """Each id's weight in its bag: its own (or 1) up to the bag's length, 0 past it."""
  inside = jnp.arange(ids.shape[1])[None, :] < lengths[:, None]
  given = jnp.ones(ids.shape, dtype) if weights is None else weights.astype(dtype)
  return jnp.where(inside, given, 0).astype(dtype)


def _finish(pooled, lengths, pooling: str) -> jax.Array:
  if pooling == "mean":
    return pooled / jnp.maximum(lengths, 1).astype(pooled.dtype)[:, None]
  return pooled


def _check_stored_as_computed(name: str) -> None:
  """The table enters the lookup as the parameter rules store it: otherwise XLA would move it
  (gather it whole) at every step."""
  active = rules_lib.active()
  if active is None:
    return
  rules, mesh = active
  stored, computed = rules.param_spec(TABLE, mesh), rules.activation_spec(TABLE, mesh)
  if tuple(stored) != tuple(computed):
    raise sharding.ShardingError(
        f"embedding table {name}: stored as {tuple(stored)} but looked up as "
        f"{tuple(computed)}, which would move the whole table every step; give table_rows "
        f"and table_embed the same mesh axes in the parameter and activation rules")


def _pool(table_block, ids, weights) -> jax.Array:
  rows = jnp.take(table_block, ids, axis=0, mode="fill", fill_value=0)
  return jnp.einsum("bk,bkd->bd", weights, rows)


def _rows_per_device(table_block, ids, weights, *, rows_axes: Sequence[str],
                     gather: tuple[str, ...]):
  """This device's rows' share of every bag of its `gather` group, summed back over R."""
  if gather:
    ids = jax.lax.all_gather(ids, gather, axis=0, tiled=True)
    weights = jax.lax.all_gather(weights, gather, axis=0, tiled=True)
  local_rows = table_block.shape[0]
  local = ids - jax.lax.axis_index(tuple(rows_axes)) * local_rows
  mine = (local >= 0) & (local < local_rows)
  pooled = _pool(table_block, jnp.where(mine, local, 0), jnp.where(mine, weights, 0))
  if gather:
    pooled = jax.lax.psum_scatter(pooled, gather, scatter_dimension=0, tiled=True)
  rest = tuple(a for a in rows_axes if a not in gather)
  return jax.lax.psum(pooled, rest) if rest else pooled


def _columns_per_device(table_block, ids, weights, *, cols_axes: tuple[str, ...]):
  """This device's columns of every bag of its column group, then each its own bags."""
  ids = jax.lax.all_gather(ids, cols_axes, axis=0, tiled=True)
  weights = jax.lax.all_gather(weights, cols_axes, axis=0, tiled=True)
  pooled = _pool(table_block, ids, weights)
  return jax.lax.all_to_all(pooled, cols_axes, split_axis=0, concat_axis=1, tiled=True)
