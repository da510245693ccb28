"""Context parallelism (token positions split over a `sequence` mesh axis): the load-balanced
order (sharding.sequence), and attention with the positions split, against one device."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding

import sharding
from models import attention
from sharding import sequence
from tests.models.test_attention import _assert_same, _inputs, _value_and_grads


@pytest.mark.parametrize("ways", [2, 4, 8])
def test_balance_is_a_permutation_that_unbalance_undoes_bitwise(ways):
  x = np.random.default_rng(ways).normal(size=(3, 16 * ways, 5)).astype(np.float32)
  assert sorted(sequence.order(16 * ways, ways)) == list(range(16 * ways))
  np.testing.assert_array_equal(sequence.unbalance(sequence.balance(x, ways), ways), x)
  np.testing.assert_array_equal(sequence.balance(sequence.unbalance(x, ways), ways), x)
  np.testing.assert_array_equal(  # the same on device arrays
      np.asarray(sequence.unbalance(sequence.balance(jnp.asarray(x), ways), ways)), x)


def test_order_gives_device_i_chunks_i_and_the_mirror_one():
  np.testing.assert_array_equal(sequence.order(8, 2), [0, 1, 6, 7, 2, 3, 4, 5])
  np.testing.assert_array_equal(sequence.order(8, 4), [0, 7, 1, 6, 2, 5, 3, 4])


@pytest.mark.parametrize("ways", [2, 4, 8])
def test_every_device_sees_the_same_number_of_unmasked_pairs(ways):
  """Causal: query at position p sees p + 1 keys. Each device's block of the balanced order
  adds up to the same count; the plain order's blocks do not."""
  length = 32 * ways

  def per_device(positions):
    return [int(np.sum(block + 1)) for block in np.split(positions, ways)]

  balanced = per_device(sequence.order(length, ways))
  assert len(set(balanced)) == 1 and sum(balanced) == length * (length + 1) // 2
  plain = per_device(np.arange(length))
  assert plain[-1] > 2.5 * plain[0]  # ratio (2 x ways - 1) for long sequences


def test_layouts_it_cannot_balance_are_refused_in_one_line():
  with pytest.raises(sharding.ShardingError, match="needs an even split"):
    sequence.check(48, 3)
  with pytest.raises(sharding.ShardingError,
                     match=r"data.seq_len=36 is not divisible by 2 x 4.*use a multiple of 8"):
    sequence.check(36, 4)
  sequence.check(40, 4)
  sequence.check(37, 1)  # not split: anything goes


# (mesh, preset): the three layouts, then ring at CP 2 and 4 (8 is the first).
LAYOUTS = [
    ([("sequence", 8)], "fsdp_cp"),
    ([("data", 2), ("sequence", 4)], "fsdp_cp"),
    ([("fsdp", 2), ("sequence", 2), ("tensor", 2)], "fsdp_tp"),
]


def _split_attention(implementation, ici, preset, causal, q, k, v, weights):
  """attend() with the positions split as `ici` and `preset` say: inputs in the balanced
  order, placed as the activation rules place them; the results back in plain order."""
  mesh = sharding.make_mesh(ici)
  rules = sharding.Rules.preset(preset)
  ways = mesh.shape["sequence"]
  length = q.shape[1]
  positions = sequence.balance(jnp.broadcast_to(jnp.arange(length), q.shape[:2]), ways)
  place = lambda x, axes: jax.device_put(
      sequence.balance(x, ways), NamedSharding(mesh, rules.activation_spec(axes, mesh)))
  placed = [place(q, ("batch", "length", "heads", None)),
            place(k, ("batch", "length", "kv_heads", None)),
            place(v, ("batch", "length", "kv_heads", None)),
            place(weights, ("batch", "length", "heads", None))]

  def split(q, k, v):
    with sharding.activation_rules(rules, mesh):
      return attention.attend(q, k, v, causal, implementation, positions=positions)

  out, grads = _value_and_grads(split, *placed)
  return sequence.unbalance(out, ways), tuple(sequence.unbalance(g, ways) for g in grads)


@pytest.mark.parametrize("implementation", ["xla", "blockwise", "ring"])
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda l: "x".join(f"{a}{n}" for a, n in l[0]))
def test_split_attention_equals_one_device(layout, implementation, monkeypatch):
  """Causal, grouped-query heads; output and dq/dk/dv. blockwise with blocks of 8, so each
  device's 16 to 64 queries run several blocks and skip the hidden ones by position."""
  monkeypatch.setattr(attention, "BLOCK", 8)
  q, k, v, weights = _inputs(4, 64, 64, 4, 2, 8, seed=1)
  expected = _value_and_grads(lambda q, k, v: attention.xla(q, k, v, True), q, k, v, weights)
  _assert_same(_split_attention(implementation, *layout, True, q, k, v, weights), expected)


@pytest.mark.parametrize("ways", [2, 4])
@pytest.mark.parametrize("causal", [True, False])
def test_ring_attention_at_cp_2_and_4(ways, causal):
  q, k, v, weights = _inputs(4, 48, 48, 4, 4, 8, seed=ways)
  expected = _value_and_grads(lambda q, k, v: attention.xla(q, k, v, causal), q, k, v, weights)
  actual = _split_attention("ring", [("fsdp", 8 // ways), ("sequence", ways)], "fsdp_cp",
                            causal, q, k, v, weights)
  _assert_same(actual, expected)


def test_auto_masks_by_position_and_splash_is_refused_when_positions_are_split():
  mesh = sharding.make_mesh([("sequence", 8)])
  q, k, v, _ = _inputs(1, 64, 64, 2, 2, 8)
  with sharding.activation_rules(sharding.Rules.preset("fsdp_cp"), mesh):
    assert attention.resolve("auto", q.shape, k.shape, q.dtype, on="tpu") == "xla"
    assert attention.resolve("auto", (1, 4096, 2, 8), (1, 4096, 2, 8), q.dtype,
                             on="tpu") == "blockwise"
    with pytest.raises(ValueError, match="model.attention='splash' cannot run with the token "
                                         "positions split"):
      attention.attend(q, k, v, True, "splash")
