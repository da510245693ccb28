"""Embedding bags (models/embedding_bag.py) on 8 devices against one device's `jnp.take`: every
placement (replicated, row-wise over axes that split the batch or not, column-wise), bags of
mixed sizes with per-id weights, sum and mean; the table's gradient too, with no collective
that moves a whole table; the hash; and each placement mistake as one error naming the table."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding

import sharding
from models import embedding_bag
from tests.tiny_runs import TOLERANCE

ROWS, DIM, BATCH, MAX_BAG = 64, 16, 16, 5

# (mesh, the table's placement as rules overrides, name)
PLACEMENTS = [
    ("data:2,fsdp:4", "", "replicated"),
    ("data:2,fsdp:4", "table_rows=fsdp", "rows over an axis of the batch's"),
    ("data:2,fsdp:4", "table_rows=data+fsdp", "rows over all the batch's axes"),
    ("data:4,tensor:2", "table_rows=tensor", "rows over an axis the batch is whole along"),
    ("data:2,tensor:2,fsdp:2", "table_rows=fsdp+tensor", "rows over both kinds of axes"),
    ("data:2,fsdp:4", "table_embed=fsdp", "columns over an axis of the batch's"),
    ("data:2,fsdp:4", "table_embed=fsdp+data", "columns over two axes in their own order"),
]


def _bags(seed: int = 0):
  """A table and bags of 0-5 ids (one id past the table's end) with weights."""
  rng = np.random.default_rng(seed)
  table = rng.normal(size=(ROWS, DIM)).astype(np.float32)
  ids = rng.integers(0, ROWS, size=(BATCH, MAX_BAG)).astype(np.int32)
  ids[3, 0] = ROWS + 7                               # outside the table: adds nothing
  lengths = rng.integers(0, MAX_BAG + 1, size=BATCH).astype(np.int32)
  lengths[:2] = (0, MAX_BAG)                         # an empty bag and a full one
  weights = rng.uniform(0.5, 2.0, size=(BATCH, MAX_BAG)).astype(np.float32)
  return table, ids, lengths, weights


def _on_mesh(ici: str, overrides: str, fn, tables: int = 0):
  """`fn(table, ids, lengths, weights)` jitted on the mesh under the rules, its table stored
  as the parameter rules say; returns (the jitted function, the table's sharding). With
  `tables`, `fn(tables, ids, lengths)` takes a tuple of that many tables stored alike."""
  mesh = sharding.make_mesh(sharding.parse_axis_sizes(ici, "mesh.ici"))
  rules = sharding.Rules.preset("dp", param_overrides=overrides,
                                activation_overrides=overrides)
  table_sharding = NamedSharding(mesh, rules.param_spec(embedding_bag.TABLE, mesh))

  def under_rules(*args):
    with sharding.activation_rules(rules, mesh):
      return fn(*args)

  shardings = ((table_sharding,) * tables, None, None) if tables else (
      table_sharding, None, None, None)
  return jax.jit(under_rules, in_shardings=shardings), table_sharding


def _loss(lookup, pooling):
  cotangent = jnp.asarray(np.random.default_rng(1).normal(size=(BATCH, DIM)), jnp.float32)
  return lambda table, ids, lengths, weights: jnp.sum(
      lookup(table, ids, lengths, weights, pooling=pooling) * cotangent)


@pytest.mark.parametrize("pooling", embedding_bag.POOLINGS)
@pytest.mark.parametrize("ici,overrides,name", PLACEMENTS, ids=[p[2] for p in PLACEMENTS])
def test_a_sharded_lookup_and_its_gradient_equal_one_devices_take(ici, overrides, name, pooling):
  del name
  args = _bags()
  want = jax.jit(embedding_bag.reference, static_argnames="pooling")(*args, pooling=pooling)
  want_grad = jax.jit(jax.grad(_loss(embedding_bag.reference, pooling)))(*args)
  lookup, _ = _on_mesh(ici, overrides, lambda *a: embedding_bag.lookup(*a, pooling=pooling))
  np.testing.assert_allclose(lookup(*args), want, **TOLERANCE)
  grad, table_sharding = _on_mesh(ici, overrides,
                                  jax.grad(_loss(embedding_bag.lookup, pooling)))
  got_grad = grad(*args)
  np.testing.assert_allclose(got_grad, want_grad, **TOLERANCE)
  assert got_grad.sharding.is_equivalent_to(table_sharding, 2)  # stays where the table is
  # The reference pools by hand: an empty bag is 0, the id past the table adds nothing.
  np.testing.assert_array_equal(want[0], np.zeros(DIM))


def _stacked_one(table, ids, lengths, weights, pooling):
  """lookup_stacked of one table (its per-id weights aside)."""
  del weights
  return embedding_bag.lookup_stacked((table,), ids[:, None], lengths[:, None],
                                      pooling=pooling)[:, 0]


@pytest.mark.parametrize("lookup", [embedding_bag.lookup, _stacked_one], ids=["one", "stacked"])
@pytest.mark.parametrize("ici,overrides,name", PLACEMENTS[1:], ids=[p[2] for p in PLACEMENTS[1:]])
def test_no_collective_moves_a_whole_table(ici, overrides, name, lookup):
  """Forward and backward of a split table: every collective's operand is smaller than the
  table (ids, pooled rows and their gradients cross the network, never the table)."""
  del name
  step, _ = _on_mesh(ici, overrides, jax.grad(_loss(lookup, "sum")))
  hlo = step.lower(*_bags()).compile().as_text()
  collectives = re.findall(r"= (\w+)\[([\d,]*)\][^=]*? (all-gather|all-reduce|all-to-all|"
                           r"reduce-scatter|collective-permute)\(", hlo)
  assert collectives, "the split table's lookup ran without any collective"
  for dtype, dims, op in collectives:
    elements = int(np.prod([int(d) for d in dims.split(",") if d])) if dims else 1
    assert elements < ROWS * DIM, (op, dtype, dims)


def test_sharded_mean_pooling_divides_by_the_bags_length():
  table = jnp.arange(ROWS * DIM, dtype=jnp.float32).reshape(ROWS, DIM)
  ids = jnp.array([[1, 2, 60, 0, 0]] * BATCH, jnp.int32)
  lengths = jnp.full((BATCH,), 3, jnp.int32)
  lookup, _ = _on_mesh("data:2,fsdp:4", "table_rows=fsdp",
                       lambda *a: embedding_bag.lookup(*a, pooling="mean"))
  got = lookup(table, ids, lengths, None)
  np.testing.assert_allclose(got[0], (table[1] + table[2] + table[60]) / 3, **TOLERANCE)


def test_ids_hash_into_range_by_the_stated_formula():
  ids = np.array([0, 1, 7, 2**31 - 1, -1, 123456789, 1], np.int64)
  got = np.asarray(embedding_bag.hash_ids(jnp.asarray(ids, jnp.int32), 1000))
  want = [(int(i) % 2**32) * 2654435761 % 2**32 % 1000 for i in ids]  # Python's exact ints
  np.testing.assert_array_equal(got, want)
  assert got[1] == got[-1] and got.dtype == np.int32


@pytest.mark.parametrize("ici,overrides,activation,message", [
    ("data:2,fsdp:4", "table_rows=fsdp,table_embed=data", None, "choose row-wise"),
    ("data:4,tensor:2", "table_embed=tensor", None, "only over mesh axes that split the batch"),
    ("data:2,fsdp:4", "table_rows=fsdp", "", "would move the whole table"),
])
def test_a_placement_without_a_lookup_names_the_table(ici, overrides, activation, message):
  mesh = sharding.make_mesh(sharding.parse_axis_sizes(ici, "mesh.ici"))
  rules = sharding.Rules.preset("dp", param_overrides=overrides, activation_overrides=(
      overrides if activation is None else activation))
  with sharding.activation_rules(rules, mesh), pytest.raises(sharding.ShardingError,
                                                              match=message) as raised:
    embedding_bag.lookup(*_bags(), name="user_id")
  assert "embedding table user_id" in str(raised.value)


def test_an_unknown_pooling_names_the_choices():
  with pytest.raises(ValueError, match="pooling='max' is unknown; choose one of sum, mean"):
    embedding_bag.lookup(*_bags(), pooling="max")


@pytest.mark.parametrize("pooling", embedding_bag.POOLINGS)
@pytest.mark.parametrize("ici,overrides,name", PLACEMENTS, ids=[p[2] for p in PLACEMENTS])
def test_the_stacked_lookup_equals_one_lookup_per_table(ici, overrides, name, pooling):
  """Tables of three sizes looked up at once (DLRM's lookup) on 8 devices, in every placement:
  each table's pooled bags and its gradient equal that table's own `jnp.take` on one device;
  ids past a table's end add nothing."""
  rng = np.random.default_rng(3)
  tables = tuple(rng.normal(size=(rows, DIM)).astype(np.float32) for rows in (64, 8, 24))
  ids = np.stack([_bags(seed)[1] % (rows + 2) for seed, rows in enumerate((64, 8, 24))], axis=1)
  lengths = rng.integers(0, MAX_BAG + 1, size=(BATCH, 3)).astype(np.int32)
  cotangent = jnp.asarray(rng.normal(size=(BATCH, 3, DIM)), jnp.float32)

  def stacked(tables, ids, lengths):
    return jnp.sum(embedding_bag.lookup_stacked(tables, ids, lengths, pooling=pooling)
                   * cotangent)

  def each(tables, ids, lengths):
    return jnp.sum(jnp.stack([embedding_bag.reference(t, ids[:, i], lengths[:, i],
                                                      pooling=pooling)
                              for i, t in enumerate(tables)], axis=1) * cotangent)

  want = jax.jit(jax.value_and_grad(each))(tables, ids, lengths)
  step, _ = _on_mesh(ici, overrides, jax.value_and_grad(stacked), tables=len(tables))
  got = step(tables, ids, lengths)
  np.testing.assert_allclose(got[0], want[0], **TOLERANCE)
  for g, w in zip(got[1], want[1]):
    np.testing.assert_allclose(g, w, **TOLERANCE)
