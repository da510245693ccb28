"""How batches reach the devices: which rows of a global batch this process holds, and the
iterator the training loop reads placed batches from, prepared ahead in a thread.

Every batches class (`text.Batches`, `grain_batches.GrainBatches`) makes one of these with its
`iterator(start_step, position, prefetch)`; `position()` is what a checkpoint saves to resume
the data exactly.
"""
from __future__ import annotations

import queue
import threading
from collections.abc import Callable

import jax
import numpy as np
from jax.sharding import NamedSharding

Batch = dict[str, jax.Array]
Position = dict
# The length of the step sources: Grain's sampler needs one; a run never gets near it.
MAX_STEPS = 2**40


def local_rows(sharding: NamedSharding, global_shape: tuple[int, ...]) -> np.ndarray:
  """The rows of a batch-sharded array that this process's devices hold, ascending.

  They need not be contiguous (say batch over data x fsdp with data the inner mesh axis): a
  process then holds several blocks, and `make_array_from_process_local_data` takes its rows
  as those blocks concatenated in global order, which is this order."""
  rows = set()
  for index in sharding.addressable_devices_indices_map(global_shape).values():
    rows.update(range(*index[0].indices(global_shape[0])))
  return np.array(sorted(rows), dtype=np.int64)


class BatchIterator:
  """Global batches in step order: `produce() -> (step, host rows, position after it)`, `depth`
  of them prepared ahead in a background thread (0: on demand), then `place(host rows)`.
  `close()` stops that thread, then calls `release()`: what the source holds (Grain's worker
  processes)."""

  def __init__(self, produce: Callable[[], tuple[int, object, Position]],
               place: Callable[[object], Batch], start_step: int, depth: int,
               release: Callable[[], None] | None = None):
    self._produce, self._place, self._next_step = produce, place, start_step
    self._release = release
    self._position: Position = {"step": start_step}
    self._stop = threading.Event()
    self._queue: queue.Queue = queue.Queue(maxsize=max(depth, 1))
    self._thread = None
    if depth > 0:
      self._thread = threading.Thread(target=self._fill, name="batch-prefetch", daemon=True)
      self._thread.start()

  def _fill(self) -> None:
    while not self._stop.is_set():
      try:
        item = ("batch", self._produce())
      except BaseException as e:  # pylint: disable=broad-except  # re-raised in the loop
        item = ("error", e)
      while not self._stop.is_set():
        try:
          self._queue.put(item, timeout=0.1)
          break
        except queue.Full:
          continue
      if item[0] == "error":
        return

  def __iter__(self):
    return self

  def __next__(self) -> Batch:
    if self._thread is None:
      step, host, position = self._produce()
    else:
      kind, value = self._queue.get()
      if kind == "error":
        raise value
      step, host, position = value
    if step != self._next_step:  # a pipeline that lost its place must not train silently
      raise RuntimeError(f"the input pipeline produced the batch of step {step} where step "
                         f"{self._next_step} was due")
    self._next_step += 1
    self._position = position
    # The copy is finished before the step is dispatched. On XLA's CPU backend, steps queued
    # behind unfinished work deadlocked in their all-reduce ("7 of 8 arrived" aborts); with
    # this and one step in flight (toolkit.training.loop) the 1,200-step ViT runs complete.
    return jax.block_until_ready(self._place(host))

  def position(self) -> Position:
    """The data position after the last batch handed out: saved in checkpoints."""
    return dict(self._position)

  def close(self) -> None:
    self._stop.set()
    if self._thread is not None:
      while self._thread.is_alive():
        try:
          self._queue.get(timeout=0.1)
        except queue.Empty:
          pass
      self._thread.join()
    if self._release is not None:
      self._release()
      self._release = None


def step_iterator(host_batch: Callable[[int], object], place: Callable[[object], Batch],
                  start_step: int, prefetch: int) -> BatchIterator:
  """The iterator of batches that are a pure function of the step (`host_batch(step)`, then
  `place`): from `start_step` on, the position after each batch nothing more than the step."""
  counter = iter(range(start_step, MAX_STEPS))

  def produce():
    step = next(counter)
    return step, host_batch(step), {"step": step + 1}
  return BatchIterator(produce, place, start_step, prefetch)
