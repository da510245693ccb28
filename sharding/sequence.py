"""The load-balanced order of token positions for context parallelism (a `sequence` mesh axis).

Split in plain order over CP devices, causal attention is lopsided: the device holding the last
positions attends to every key, the first to almost none. So each sequence is cut into 2 x CP
equal chunks and device i gets chunks i and 2 x CP - 1 - i: with 2 devices and 4 chunks,
device 0 holds chunks (0, 3), device 1 chunks (1, 2), and every device sees the same number of
unmasked (query, key) pairs. Tokens, targets and their positions move together (with packed
documents also their segment ids and loss weights), so a batch is the same set of (token,
target) pairs in another order; attention then masks by position (and segment), not by index
(`models.attention`), and the (weighted) mean loss does not change. Packed rows balance less
evenly: a document sees only its own keys, so the causal work per device depends on where the
documents end (each device still holds two mirrored chunks of the row).

  order(8, 2)         -> [0 1 6 7 2 3 4 5]   (the position at each index, per row)
  balance(x, ways)    x (batch, length, ...) in that order; `unbalance` undoes it
"""
from __future__ import annotations

import numpy as np

from sharding.errors import ShardingError


def check(length: int, ways: int, field: str = "data.seq_len") -> None:
  """Refuses a context-parallel layout the balanced order cannot make (ShardingError)."""
  if ways <= 1:
    return
  if ways % 2:
    raise ShardingError(
        f"the token positions are split {ways} ways (the sequence mesh axis); context "
        f"parallelism needs an even split so the causal work balances; use sequence:2, 4 or 8 "
        f"in mesh.ici")
  if length % (2 * ways):
    raise ShardingError(
        f"{field}={length} is not divisible by 2 x {ways} (twice the sequence mesh axis): the "
        f"load-balanced order cuts each sequence into {2 * ways} equal chunks; use a multiple "
        f"of {2 * ways}")


def order(length: int, ways: int) -> np.ndarray:
  """The position held at each index of a balanced sequence of `length` over `ways` devices."""
  check(length, ways, "length")
  if ways <= 1:
    return np.arange(length)
  chunks = np.arange(length).reshape(2 * ways, -1)
  pairs = [(i, 2 * ways - 1 - i) for i in range(ways)]
  return np.concatenate([chunks[c] for pair in pairs for c in pair])


def balance(x, ways: int, axis: int = 1):
  """`x` with its `axis` (token positions) put in the balanced order for `ways` devices."""
  return x if ways <= 1 else x.take(order(x.shape[axis], ways), axis=axis)


def unbalance(x, ways: int, axis: int = 1):
  """Inverse of `balance`."""
  return x if ways <= 1 else x.take(np.argsort(order(x.shape[axis], ways)), axis=axis)
