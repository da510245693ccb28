"""Row-wise Adagrad for embedding tables, the default of TorchRec and DLRM (FBGEMM's
EXACT_ROWWISE_ADAGRAD): one accumulator per row, to which each step adds the mean over the
row's width of its squared gradient, and the row moves by
learning_rate x gradient / (sqrt(accumulator) + eps).

  accumulator = rowwise_adagrad.init(table)
  table, accumulator = rowwise_adagrad.update(table, accumulator, ids, row_grads,
                                              learning_rate=0.05)

`ids` (n,) are the rows a batch looked up, repeats allowed; `row_grads` (n, dim) the gradient
of each lookup. Repeats are summed first, as the table's own gradient sums them; ids outside
[0, rows) are ignored. The update reads and writes only those rows, so its work grows with the
batch, not with the table, and every other row and accumulator is left bit for bit.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

EPS = 1e-8  # FBGEMM's default


def init(table: jax.Array) -> jax.Array:
  """The accumulators of `table`'s rows: zeros, float32, (rows,)."""
  return jnp.zeros(table.shape[:1], jnp.float32)


def update(table: jax.Array, accumulator: jax.Array, ids: jax.Array, row_grads: jax.Array, *,
           learning_rate: float | jax.Array, eps: float = EPS) -> tuple[jax.Array, jax.Array]:
  """(table, accumulator) after one step on the rows `ids` looked up; see the module docstring."""
  rows = table.shape[0]
  ids = ids.reshape(-1)
  ids = jnp.where((ids >= 0) & (ids < rows), ids, rows)  # the sentinel `rows` is dropped below
  unique, inverse = jnp.unique(ids, size=ids.shape[0], fill_value=rows, return_inverse=True)
  grads = jax.ops.segment_sum(row_grads.reshape(ids.shape[0], -1).astype(jnp.float32),
                              inverse.reshape(-1), num_segments=ids.shape[0])
  summed = accumulator.at[unique].get(mode="fill", fill_value=0) + jnp.mean(grads**2, axis=1)
  moved = table.at[unique].get(mode="fill", fill_value=0).astype(jnp.float32) - (
      learning_rate * grads / (jnp.sqrt(summed)[:, None] + eps))
  return (table.at[unique].set(moved.astype(table.dtype), mode="drop"),
          accumulator.at[unique].set(summed, mode="drop"))
