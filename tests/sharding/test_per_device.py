"""`sharding.shard_map` and the queries beside it (sharding/per_device.py): per-device code
under logical axes."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import sharding
from sharding import ShardingError


@pytest.fixture(scope="module")
def mesh():
  return sharding.make_mesh([("fsdp", 4), ("tensor", 2)])


RULES = sharding.Rules.preset("fsdp_tp")


def test_without_rules_the_function_runs_directly():
  seen = []

  def fn(x):
    seen.append(x.shape)
    return x * 2

  out = sharding.shard_map(fn, in_axes=(("batch", "heads"),),
                           out_axes=("batch", "heads"))(jnp.ones((8, 4)))
  assert seen == [(8, 4)] and float(out.sum()) == 64
  assert sharding.active_mesh() is None and sharding.active_axes("batch") == ()
  assert sharding.active_ways("batch") == 1


def test_under_rules_each_device_sees_its_block(mesh):
  shapes = []

  def per_device(x, y):
    shapes.append((x.shape, y.shape))
    # constrain is a no-op on blocks (it would fail inside shard_map otherwise).
    x = sharding.constrain(x, ("batch", "heads"))
    return x + jnp.sum(y), y * 3

  x = jnp.arange(8 * 4, dtype=jnp.float32).reshape(8, 4)
  y = jnp.ones((8,), jnp.float32)

  @jax.jit
  def run(x, y):
    with sharding.activation_rules(RULES, mesh):
      assert sharding.active_axes("batch") == ("fsdp",)
      assert sharding.active_axes("heads") == ("tensor",)
      assert sharding.active_ways("batch") == 4 and sharding.active_ways("embed") == 1
      assert sharding.active_mesh() is mesh
      return sharding.shard_map(
          per_device, in_axes=(("batch", "heads"), ("batch",)),
          out_axes=(("batch", "heads"), ("batch",)))(x, y)

  added, tripled = run(x, y)
  assert shapes == [((2, 2), (2,))]  # 8 rows over fsdp 4, 4 heads over tensor 2
  # y's block sums to 2 on every device; x's blocks come back in place.
  np.testing.assert_array_equal(added, np.asarray(x) + 2)
  assert added.sharding.spec == P("fsdp", "tensor")
  np.testing.assert_array_equal(tripled, np.full(8, 3.0))


def test_indivisible_dimensions_name_the_axis(mesh):
  @jax.jit
  def run(x):
    with sharding.activation_rules(RULES, mesh):
      return sharding.shard_map(lambda a: a, in_axes=(("batch", None),),
                                out_axes=("batch", None))(x)

  with pytest.raises(ShardingError, match=r"dimension 0 \(batch\) has size 6, not divisible"):
    run(jnp.ones((6, 2)))


def test_inputs_are_resharded_to_the_blocks(mesh):
  """An input laid out otherwise (replicated) still arrives as blocks."""
  x = jax.device_put(jnp.arange(16.0).reshape(8, 2), NamedSharding(mesh, P()))

  @jax.jit
  def run(x):
    with sharding.activation_rules(RULES, mesh):
      return sharding.shard_map(lambda a: a * jnp.float32(a.shape[0]),
                                in_axes=(("batch", None),), out_axes=("batch", None))(x)

  np.testing.assert_array_equal(run(x), np.arange(16.0).reshape(8, 2) * 2)


def _collective_shapes(compiled_text: str) -> list[str]:
  """The result shapes of every all-gather / all-reduce / all-to-all in compiled HLO."""
  return re.findall(r"= \(?([a-z0-9]+\[[0-9,]*\])[^=]*? (?:all-gather|all-reduce|all-to-all)\(",
                    compiled_text)


@pytest.mark.parametrize("preset, ici, per_device", [
    ("fsdp", "data:2,fsdp:4", True),    # embed over fsdp, batch over data x fsdp: per device
    ("fsdp_tp", "fsdp:4,tensor:2", False),  # vocab over tensor: left to XLA
    ("dp", "data:8", False),            # table replicated: left to XLA
])
def test_take_rows_equals_take_in_value_and_gradient(preset, ici, per_device):
  """sharding.take_rows == jnp.take (the rows and the table's gradient); where the rules let
  it run per device, no collective moves an array the size of the table."""
  vocab, embed = 96, 32
  table = jax.random.normal(jax.random.key(0), (vocab, embed))
  ids = jax.random.randint(jax.random.key(1), (16, 5), 0, vocab)
  cotangent = jax.random.normal(jax.random.key(2), (16, 5, embed))
  loss = lambda lookup: lambda t, i: jnp.sum(lookup(t, i) * cotangent)
  expected_rows = jnp.take(table, ids, axis=0)
  expected_grad = jax.grad(loss(lambda t, i: jnp.take(t, i, axis=0)))(table, ids)

  mesh = sharding.make_mesh(sharding.parse_axis_sizes(ici))
  rules = sharding.Rules.preset(preset)
  table_sharding = NamedSharding(mesh, rules.param_spec(("vocab", "embed"), mesh))
  ids_sharding = NamedSharding(mesh, rules.activation_spec(("batch", "length"), mesh))

  @jax.jit
  def run(t, i):
    with sharding.activation_rules(rules, mesh):
      return sharding.take_rows(t, i), jax.grad(loss(sharding.take_rows))(t, i)

  placed = (jax.device_put(table, table_sharding), jax.device_put(ids, ids_sharding))
  rows, grad = run(*placed)
  np.testing.assert_allclose(rows, expected_rows, rtol=1e-6)
  np.testing.assert_allclose(grad, expected_grad, rtol=1e-5, atol=1e-5)
  text = run.lower(*placed).compile().as_text()
  assert ("all-to-all" in text) == per_device
  if per_device:
    whole = [s for s in _collective_shapes(text) if s.endswith(f"[{vocab},{embed}]")]
    assert not whole, whole
