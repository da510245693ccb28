"""The compiled step's memory traffic (toolkit/planning/traffic.py), against bytes worked out by hand
from the programs' shapes: an elementwise update reads and writes its array once, a loop
counts once per trip, a scanned layer reads its own slice of the stacked weights (not the
stack) and writes its own row of the stacked outputs (not the buffer), matmuls are kept apart
from the memory term, and collectives are the interconnect's."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from tests.toolkit.planning.test_overlap import _HLO
from toolkit.planning import traffic

N = 1 << 20                 # float32 elements: 4 MiB
LAYERS, ROWS, WIDTH = 6, 256, 512


def _traffic(fn, *args) -> traffic.Traffic:
  return traffic.memory_traffic(jax.jit(fn).lower(*args).compile().as_text())


def test_an_elementwise_update_reads_and_writes_its_array_once():
  t = _traffic(lambda x: x * 2.0 + 1.0, jnp.ones(N))
  assert (t.memory_bytes, t.matmul_bytes) == (2 * 4 * N, 0)


def test_a_loop_counts_its_body_once_per_trip():
  def ten_updates(x):
    return jax.lax.scan(lambda c, _: (c * 1.5 + 1.0, None), x, None, length=10)[0]
  t = _traffic(ten_updates, jnp.ones(N))
  # The body's update 10 times; XLA may copy the carry in and out of the loop once each.
  assert 10 * 8 * N <= t.memory_bytes <= 12 * 8 * N, t


def test_a_scanned_layer_reads_its_slice_of_the_stacked_weights():
  def layers(x, ws):
    return jax.lax.scan(lambda x, w: (jnp.tanh(x @ w) + x, None), x, ws)[0]
  t = _traffic(layers, jnp.ones((ROWS, WIDTH)), jnp.ones((LAYERS, WIDTH, WIDTH)))
  # Each layer's matmul: x (ROWS x WIDTH) and its own w (WIDTH x WIDTH) in, ROWS x WIDTH out.
  assert t.matmul_bytes == LAYERS * 4 * (2 * ROWS * WIDTH + WIDTH * WIDTH)
  # The whole stack read every layer would be 3.5x that.
  assert t.matmul_bytes < LAYERS * 4 * (2 * ROWS * WIDTH + LAYERS * WIDTH * WIDTH) / 3


def test_a_scan_writes_one_row_of_its_stacked_outputs_per_trip():
  def rows(x):
    return jax.lax.scan(lambda c, _: (c + 1.0, jnp.sin(c)), x, None, length=LAYERS)[1]
  t = _traffic(rows, jnp.ones(N))
  # Per trip: the carry's update read and written, and the sine's row read and written into
  # the stack (XLA's copy of the carry adds 2 rows a trip, filling the stack once 6 rows);
  # rewriting the whole (LAYERS, N) stack each trip would add 2 x LAYERS rows a trip.
  row = 4 * N
  assert 4 * LAYERS * row <= t.memory_bytes <= (6 * LAYERS + 10) * row, (t, row)
  assert t.memory_bytes < (4 + 2 * LAYERS) * LAYERS * row


def test_collectives_and_what_moves_nothing_are_left_out():
  # Every instruction of this program is a collective (async or not), a parameter or a tuple:
  # the interconnect's time, not memory's.
  t = traffic.memory_traffic(_HLO)
  assert (t.memory_bytes, t.matmul_bytes, t.instructions) == (0, 0, 0)
  assert traffic.memory_traffic("not HLO") == traffic.Traffic(0.0, 0.0, 0)
