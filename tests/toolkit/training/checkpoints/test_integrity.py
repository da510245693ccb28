"""Fingerprints: equal to a NumPy computation of the documented formula, sharded or not, and
changed by any change to one element."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from toolkit.training.checkpoints import integrity

_BITS = {1: np.uint8, 2: np.uint16, 4: np.uint32}


def reference(x: np.ndarray) -> int:
  """The formula in toolkit/training/checkpoints/integrity.py's docstring, in NumPy integers: the sum of
  bits[i] * ((i * 0x9E3779B1) | 1) mod 2**32 over flat indices i."""
  bits = x.reshape(-1).view(_BITS[x.dtype.itemsize]).astype(np.uint64)
  index = np.arange(bits.size, dtype=np.uint64)
  weights = ((index * 0x9E3779B1) % 2**32) | 1
  return int(np.sum((bits * weights) % 2**32) % 2**32)


def arrays():
  rng = np.random.default_rng(0)
  return {"f32": rng.standard_normal((16, 24)).astype(np.float32),
          "bf16": rng.standard_normal((8, 4, 6)).astype(jnp.bfloat16),
          "i32": rng.integers(-2**31, 2**31 - 1, (40,), dtype=np.int32),
          "u8": rng.integers(0, 256, (8, 3), dtype=np.uint8),
          "scalar": np.float32(3.5)}


@pytest.mark.parametrize("sharded", [False, True], ids=["one_device", "sharded_8"])
def test_fingerprint_equals_the_formula(sharded):
  tree = arrays()
  if sharded:
    mesh = jax.make_mesh((4, 2), ("a", "b"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    specs = {"f32": PartitionSpec("a", "b"), "bf16": PartitionSpec("a", None, "b"),
             "i32": PartitionSpec(("a", "b")), "u8": PartitionSpec("a"), "scalar": PartitionSpec()}
    tree = {k: jax.device_put(v, NamedSharding(mesh, specs[k])) for k, v in tree.items()}
    assert len(tree["f32"].sharding.device_set) == 8
  else:
    tree = {k: jnp.asarray(v) for k, v in tree.items()}
  assert integrity.fingerprints(tree) == {k: reference(np.asarray(v)) for k, v in arrays().items()}


def test_any_change_to_one_element_changes_it():
  x = arrays()["f32"]
  expected = integrity.fingerprints({"x": jnp.asarray(x)})
  raw = x.reshape(-1).view(np.uint32)
  rng = np.random.default_rng(1)
  for position, bit in zip(rng.integers(0, raw.size, 20), rng.integers(0, 32, 20)):
    flipped = raw.copy()
    flipped[position] ^= np.uint32(1) << np.uint32(bit)
    damaged = {"x": jnp.asarray(flipped.view(np.float32).reshape(x.shape))}
    assert integrity.mismatches(damaged, expected) == ["x"], (position, bit)
  # Two elements swapped: the weights depend on the index.
  swapped = x.copy()
  swapped[0, 0], swapped[0, 1] = x[0, 1], x[0, 0]
  assert integrity.mismatches({"x": jnp.asarray(swapped)}, expected) == ["x"]
  assert integrity.mismatches({"x": jnp.asarray(x)}, expected) == []


def test_paths_and_prefix():
  tree = {"params": {"embed": jnp.ones((4, 2))}, "opt_state": [(jnp.zeros(3),)]}
  saved = integrity.fingerprints(tree)
  assert set(saved) == {"params/embed", "opt_state/0/0"}
  assert integrity.mismatches(tree["params"], saved, prefix="params/") == []
  assert integrity.mismatches({"embed": jnp.zeros((4, 2))}, saved, prefix="params/") == [
      "params/embed"]
