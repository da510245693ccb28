"""Row-wise Adagrad (toolkit/training/rowwise_adagrad.py) against a float64 NumPy reference
written from FBGEMM's formula, over several steps with repeated and out-of-range ids; the rows
no step looked up stay bit for bit; and the gradient a lookup gives, fed row by row, moves the
table as the table's own dense gradient would."""
import jax
import jax.numpy as jnp
import numpy as np

from models import embedding_bag
from toolkit.training import rowwise_adagrad

ROWS, DIM, LOOKUPS, LR = 40, 8, 12, 0.05


def _reference(table, accumulator, ids, row_grads, lr=LR, eps=rowwise_adagrad.EPS):
  """float64, one row at a time."""
  table, accumulator = table.astype(np.float64), accumulator.astype(np.float64)
  summed = {}
  for i, g in zip(ids, row_grads.astype(np.float64)):
    if 0 <= i < len(table):
      summed[int(i)] = summed.get(int(i), 0) + g
  for i, g in summed.items():
    accumulator[i] += np.mean(g * g)
    table[i] -= lr * g / (np.sqrt(accumulator[i]) + eps)
  return table, accumulator


def test_steps_equal_the_float64_reference_and_leave_other_rows_bitwise():
  rng = np.random.default_rng(0)
  table = rng.normal(size=(ROWS, DIM)).astype(np.float32)
  accumulator = np.asarray(rowwise_adagrad.init(jnp.asarray(table)))
  want_table, want_acc = table.astype(np.float64), accumulator.astype(np.float64)
  got_table, got_acc = jnp.asarray(table), jnp.asarray(accumulator)
  step = jax.jit(lambda t, a, i, g: rowwise_adagrad.update(t, a, i, g, learning_rate=LR))
  touched = set()
  for s in range(4):
    ids = rng.integers(0, ROWS // 2, size=LOOKUPS).astype(np.int32)  # rows >= 20 never
    ids[:3] = (ids[3], -1, ROWS + s)                                 # a repeat, two outside
    grads = rng.normal(size=(LOOKUPS, DIM)).astype(np.float32)
    want_table, want_acc = _reference(want_table, want_acc, ids, grads)
    got_table, got_acc = step(got_table, got_acc, ids, grads)
    touched |= {int(i) for i in ids if 0 <= i < ROWS}
  np.testing.assert_allclose(got_table, want_table, rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(got_acc, want_acc, rtol=1e-6, atol=1e-9)
  untouched = sorted(set(range(ROWS)) - touched)
  assert len(untouched) >= ROWS // 2
  np.testing.assert_array_equal(np.asarray(got_table)[untouched], table[untouched])
  np.testing.assert_array_equal(np.asarray(got_acc)[untouched], 0)


def test_the_gradient_of_each_lookup_moves_the_table_as_its_dense_gradient_does():
  """Fed the gradient with respect to each looked-up row, the update equals row-wise Adagrad
  applied to the table's own (dense) gradient on the rows it touches."""
  rng = np.random.default_rng(1)
  table = jnp.asarray(rng.normal(size=(ROWS, DIM)), jnp.float32)
  ids = jnp.asarray(rng.integers(0, ROWS, size=(6, 3)), jnp.int32)
  lengths = jnp.array([3, 2, 3, 0, 1, 3], jnp.int32)
  target = jnp.asarray(rng.normal(size=(6, DIM)), jnp.float32)
  loss = lambda t: jnp.sum((embedding_bag.reference(t, ids, lengths) - target) ** 2)
  dense = jax.grad(loss)(table)
  inside = np.arange(3)[None, :] < np.asarray(lengths)[:, None]
  # The gradient of each lookup: the pooled output's gradient, for each id inside its bag.
  pooled_grad = jax.grad(lambda p: jnp.sum((p - target) ** 2))(
      embedding_bag.reference(table, ids, lengths))
  row_grads = np.where(inside[..., None], np.asarray(pooled_grad)[:, None, :], 0)
  looked_up = np.where(inside, np.asarray(ids), -1)                 # padding: outside the table
  got, _ = rowwise_adagrad.update(table, rowwise_adagrad.init(table), looked_up.reshape(-1),
                                  row_grads.reshape(-1, DIM), learning_rate=LR)
  rows = sorted(set(looked_up[inside].tolist()))
  want = np.asarray(table, np.float64)
  g = np.asarray(dense, np.float64)[rows]
  want[rows] -= LR * g / (np.sqrt(np.mean(g * g, axis=1))[:, None] + rowwise_adagrad.EPS)
  np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
