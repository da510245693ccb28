"""Input pipelines on Grain: token shards and images, in an order that resumes exactly.

Data order. Examples are put in a global order that depends only on the seed (Grain's
`MapDataset.shuffle`, reshuffled every epoch); global batch `s` is positions
[s * B, (s + 1) * B) of that order. A process reads only the rows of each batch that its
devices hold (`feed.local_rows`), so which examples make up batch `s` depends only on
(seed, s): not on the process count, and not on the Grain worker count either, because the
Grain records are whole steps (a `DataLoader` over step numbers with an in-order
`IndexSampler`; its workers each prepare whole steps and hand them back in order).

Resume. Each batch comes with the Grain iterator's state after it; the loop saves the state of
the last batch it trained on in every checkpoint (`position()`), and `iterator()` restores it.
With a different worker count Grain refuses its state; the pipeline then restarts at the
checkpoint's step, which yields the same batches since they are a function of the step.

Prefetch. Grain pipelines prefetch in Grain: its read threads, or `data.worker_count` worker
processes that each prepare whole batches ahead (the built-in token sources of `text.py`
prepare the next `data.prefetch` batches in a thread instead). Either way the loop's
thread places each batch on the devices (`jax.make_array_from_process_local_data`) and waits
for the copy before dispatching the step.
"""
from __future__ import annotations

import math

import grain
import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

import sharding
from toolkit.data.feed import MAX_STEPS, Batch, BatchIterator, Position, local_rows
from toolkit.errors import ConfigError

_EVAL_CACHE_BYTES = 2**28


class _StepSource:
  """Grain record `i` is the local rows of global batch `offset + i`: a random-access source."""

  def __init__(self, examples: grain.MapDataset, global_batch_size: int, rows: np.ndarray,
               offset: int, name: str):
    self.examples, self.global_batch_size, self.rows = examples, global_batch_size, rows
    self.offset, self.name = offset, name

  def __len__(self) -> int:
    return MAX_STEPS

  def __getitem__(self, index: int) -> dict[str, np.ndarray]:
    step = self.offset + int(index)
    positions = step * self.global_batch_size + self.rows
    records = [self.examples[int(p)] for p in positions]
    out = {key: np.stack([np.asarray(r[key]) for r in records]) for key in records[0]}
    return {**out, "position": positions, "step": np.int64(step)}

  def __repr__(self) -> str:  # Grain compares it when restoring a state
    return (f"StepSource({self.name}, batch={self.global_batch_size}, rows={len(self.rows)}, "
            f"offset={self.offset})")


class TokensToModel(grain.transforms.Map):
  """(rows, seq_len + 1) windows -> inputs and next-token targets."""

  def map(self, element: dict) -> dict:
    tokens = element["tokens"]
    return {"step": element["step"], "inputs": tokens[:, :-1], "targets": tokens[:, 1:]}


class ImagesToModel(grain.transforms.Map):
  """Examples -> model inputs; "weights" is 1 for real rows, 0 for eval padding (training
  batches carry all ones, so train and eval batches share one shape and one compile)."""

  def map(self, element: dict) -> dict:
    labels = element["label"].astype(np.int32)
    return {"step": element["step"], "images": element["image"], "labels": labels,
            "weights": element.get("weight", np.ones(labels.shape, np.float32))}


def _close_loader(loader_iter: grain.DataLoaderIterator) -> None:
  """Stops and joins the Grain worker processes, unlinking the shared memory of the batches
  they had prepared. Grain's DataLoaderIterator has no close() of its own (grain 0.2.18); the
  pipeline iterator it wraps does, and otherwise runs only at garbage collection or exit."""
  pipeline = getattr(loader_iter, "_iterator", None)
  if pipeline is not None and hasattr(pipeline, "close"):
    pipeline.close()


def order_seed(seed: int, salt: int) -> int:
  return int(np.random.SeedSequence([seed, salt]).generate_state(1)[0])


class GrainBatches:
  """Training batches from a Grain DataLoader; eval batches from the held-out source in order,
  the last one padded (weight 0) when `pad_eval`.

  `row_specs` gives each model input's per-row shape and dtype."""

  def __init__(self, train_source, held_out_source, train_ops: list, eval_ops: list,
               row_specs: dict[str, tuple[tuple[int, ...], np.dtype]], seed: int,
               global_batch_size: int, mesh: Mesh, rules: sharding.Rules, worker_count: int,
               prefetch: int, eval_batches: int | None, pad_eval: bool):
    self.train_source, self.held_out_source = train_source, held_out_source
    self.train_ops, self.eval_ops = train_ops, eval_ops
    self.seed, self.global_batch_size = seed, global_batch_size
    self.worker_count, self.prefetch, self.pad_eval = worker_count, prefetch, pad_eval
    self.shardings = {
        key: NamedSharding(mesh, rules.activation_spec(("batch",) + (None,) * len(shape), mesh))
        for key, (shape, _) in row_specs.items()}
    self.shapes = {key: (global_batch_size, *shape) for key, (shape, _) in row_specs.items()}
    self.dtypes = {key: np.dtype(dtype) for key, (_, dtype) in row_specs.items()}
    # On the CPU backend a jax.Array may alias the host array it is made from (no copy), so a
    # batch made straight from Grain's shared-memory rows would keep the segment alive as long
    # as the batch, and past a closed iterator into the resource tracker's "leaked
    # shared_memory objects" at exit. There the rows are copied out first (cheap next to the
    # step); an accelerator copies them to its memory anyway.
    self.copy_rows = mesh.devices.flat[0].platform == "cpu"
    first = next(iter(self.shapes))
    self.rows = local_rows(self.shardings[first], self.shapes[first])
    self.examples = grain.MapDataset.source(train_source).shuffle(
        seed=order_seed(seed, 0)).repeat()
    held = len(held_out_source)
    full = math.ceil(held / global_batch_size) if pad_eval else held // global_batch_size
    self.eval_batches = full if eval_batches is None else min(eval_batches, full)
    if self.eval_batches < 1:
      raise ConfigError(f"the held-out split ({held_out_source!r}) has {held} example(s), fewer "
                        f"than data.global_batch_size={global_batch_size}; hold out more data "
                        f"or use a smaller batch")
    self._eval_cache: dict[int, dict] = {}
    if worker_count > 0:
      # Grain's worker processes read absl flags; a caller that never parsed any (a test, a
      # notebook) would make them fail, so mark the defaults as parsed.
      from absl import flags  # pylint: disable=g-import-not-at-top
      if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()

  def abstract(self) -> dict[str, jax.ShapeDtypeStruct]:
    return {key: jax.ShapeDtypeStruct(self.shapes[key], self.dtypes[key],
                                      sharding=self.shardings[key]) for key in self.shapes}

  def _place(self, element: dict) -> Batch:
    host = np.array if self.copy_rows else np.asarray
    make = lambda key: jax.make_array_from_process_local_data(
        self.shardings[key], host(element[key], self.dtypes[key]), self.shapes[key])
    with jax.transfer_guard_host_to_device("allow"):  # deliberate, as in text.Batches
      return {key: make(key) for key in self.shapes}

  def _loader(self, offset: int) -> grain.DataLoader:
    source = _StepSource(self.examples, self.global_batch_size, self.rows, offset,
                         repr(self.train_source))
    return grain.DataLoader(
        data_source=source,
        sampler=grain.samplers.IndexSampler(num_records=MAX_STEPS,
                                            shard_options=grain.sharding.NoSharding(),
                                            shuffle=False, num_epochs=1, seed=0),
        operations=self.train_ops, worker_count=self.worker_count, worker_buffer_size=2,
        read_options=grain.ReadOptions(num_threads=2, prefetch_buffer_size=4))

  def local_batch(self, step: int) -> dict[str, np.ndarray]:
    """This process's rows of training batch `step`, on the host (no Grain iterator)."""
    element = _StepSource(self.examples, self.global_batch_size, self.rows, step, "")[0]
    for op in self.train_ops:
      element = op.map(element)
    return element

  def batch(self, step: int) -> Batch:
    """Training batch `step` by random access: the same as the iterator's batch `step`."""
    return self._place(self.local_batch(step))

  def iterator(self, start_step: int, position: Position | None = None,
               prefetch: int = 0) -> BatchIterator:
    """Batches from `start_step` on; `position` is a checkpoint's saved data position. Grain
    prefetches (threads or `worker_count` processes): `prefetch` is not used."""
    del prefetch
    saved = (position or {}).get("grain")
    offset = start_step
    loader_iter = None
    if saved and saved.get("worker_count") == self.worker_count:
      offset = int(saved["offset"])
      loader_iter = iter(self._loader(offset))
      loader_iter.set_state(saved["state"].encode())
    if loader_iter is None:
      loader_iter = iter(self._loader(offset))

    def produce():
      element = next(loader_iter)
      step = int(element.pop("step"))
      state = {"offset": offset, "worker_count": self.worker_count,
               "state": loader_iter.get_state().decode()}
      return step, element, {"step": step + 1, "grain": state}
    return BatchIterator(produce, self._place, start_step, depth=0,  # Grain prefetches
                         release=lambda: _close_loader(loader_iter))

  def local_eval_batch(self, index: int) -> dict[str, np.ndarray]:
    if index in self._eval_cache:
      return self._eval_cache[index]
    held = len(self.held_out_source)
    records, weights = [], []
    for position in index * self.global_batch_size + self.rows:
      records.append(self.held_out_source[int(position) % held])
      weights.append(np.float32(position < held))
    element = {key: np.stack([np.asarray(r[key]) for r in records]) for key in records[0]}
    element.update(step=np.int64(index), position=index * self.global_batch_size + self.rows)
    if self.pad_eval:
      element["weight"] = np.asarray(weights, np.float32)
    for op in self.eval_ops:
      element = op.map(element)
    if sum(v.nbytes for v in element.values()) * self.eval_batches < _EVAL_CACHE_BYTES:
      self._eval_cache[index] = element
    return element

  def eval_batch(self, index: int) -> Batch:
    """Held-out batch `index`: the same examples, un-augmented, at every evaluation."""
    return self._place(self.local_eval_batch(index))
