"""Input pipelines on Grain, and the prefetching iterator the training loop reads batches from.

Data order. Examples are put in a global order that depends only on the seed (Grain's
`MapDataset.shuffle`, reshuffled every epoch); global batch `s` is positions
[s * B, (s + 1) * B) of that order. A process reads only the rows of each batch that its
devices hold (`data.local_rows`), so which examples make up batch `s` depends only on
(seed, s): not on the process count, and not on the Grain worker count either, because the
Grain records are whole steps (a `DataLoader` over step numbers with an in-order
`IndexSampler`; its workers each prepare whole steps and hand them back in order).

Resume. Each batch comes with the Grain iterator's state after it; the loop saves the state of
the last batch it trained on in every checkpoint (`position()`), and `iterator()` restores it.
With a different worker count Grain refuses its state; the pipeline then restarts at the
checkpoint's step, which yields the same batches since they are a function of the step.

Prefetch. Grain pipelines prefetch in Grain: its read threads, or `data.worker_count` worker
processes that each prepare whole batches ahead. For the built-in token sources `BatchIterator`
prepares the next `data.prefetch` batches on the host in a thread. Either way the loop's
thread places each batch on the devices (`jax.make_array_from_process_local_data`) and waits
for the copy before dispatching the step.
"""
from __future__ import annotations

import math
import queue
import threading
from collections.abc import Callable

import grain
import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

import sharding
from toolkit import data as data_lib, images as images_lib, shards
from toolkit.config import ConfigError

Batch = dict[str, jax.Array]
Position = dict
# The step source's length: Grain's sampler needs one; a run never gets near it.
_MAX_STEPS = 2**40
_EVAL_CACHE_BYTES = 2**28


class BatchIterator:
  """Global batches in step order: `produce() -> (step, host rows, position after it)`, `depth`
  of them prepared ahead in a background thread (0: on demand), then `place(host rows)`."""

  def __init__(self, produce: Callable[[], tuple[int, object, Position]],
               place: Callable[[object], Batch], start_step: int, depth: int):
    self._produce, self._place, self._next_step = produce, place, start_step
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
    # this and one step in flight (toolkit.train) the 1,200-step ViT runs complete.
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


def step_iterator(batches: data_lib.Batches, start_step: int, depth: int) -> BatchIterator:
  """A prefetching iterator over `batches.batch(step)`, which is a pure function of the step."""
  counter = iter(range(start_step, _MAX_STEPS))

  def produce():
    step = next(counter)
    return step, batches.host_batch(step), {"step": step + 1}
  return BatchIterator(produce, batches.place, start_step, depth)


def iterator(batches, start_step: int, position: Position | None, depth: int) -> BatchIterator:
  """The loop's batches from `start_step` on, resuming a checkpoint's data `position`."""
  if isinstance(batches, GrainBatches):
    return batches.iterator(start_step, position)
  return step_iterator(batches, start_step, depth)


class _StepSource:
  """Grain record `i` is the local rows of global batch `offset + i`: a random-access source."""

  def __init__(self, examples: grain.MapDataset, global_batch_size: int, rows: np.ndarray,
               offset: int, name: str):
    self.examples, self.global_batch_size, self.rows = examples, global_batch_size, rows
    self.offset, self.name = offset, name

  def __len__(self) -> int:
    return _MAX_STEPS

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


def _order_seed(seed: int, salt: int) -> int:
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
    first = next(iter(self.shapes))
    self.rows = data_lib.local_rows(self.shardings[first], self.shapes[first])
    self.examples = grain.MapDataset.source(train_source).shuffle(
        seed=_order_seed(seed, 0)).repeat()
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
    make = lambda key: jax.make_array_from_process_local_data(
        self.shardings[key], np.asarray(element[key], self.dtypes[key]), self.shapes[key])
    with jax.transfer_guard_host_to_device("allow"):  # deliberate, as in data.Batches
      return {key: make(key) for key in self.shapes}

  def _loader(self, offset: int) -> grain.DataLoader:
    source = _StepSource(self.examples, self.global_batch_size, self.rows, offset,
                         repr(self.train_source))
    return grain.DataLoader(
        data_source=source,
        sampler=grain.samplers.IndexSampler(num_records=_MAX_STEPS,
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

  def iterator(self, start_step: int, position: Position | None = None) -> BatchIterator:
    """Batches from `start_step` on; `position` is a checkpoint's saved data position."""
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
    return BatchIterator(produce, self._place, start_step, depth=0)  # Grain prefetches

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


# --- from the config --------------------------------------------------------------------------

def from_config(config, spec) -> data_lib.Batches | GrainBatches:
  """The run's batches: `data.Batches` for the built-in text and synthetic tokens, Grain for
  token shards and images. Raises ConfigError naming a missing or bad input file."""
  d, mesh, rules = config.data, spec.mesh, spec.rules
  if spec.task == "lm" and d.source != "tokens":
    batch_sharding = NamedSharding(mesh, rules.activation_spec(("batch", None), mesh))
    return data_lib.Batches(data_lib.TokenSource.from_config(d, spec.model.vocab_size),
                            config.seed, d.seq_len, d.global_batch_size, d.eval_batches,
                            batch_sharding)
  common = dict(seed=config.seed, global_batch_size=d.global_batch_size, mesh=mesh, rules=rules,
                worker_count=d.worker_count, prefetch=d.prefetch)
  if spec.task == "lm":
    train = shards.TokenWindows(shards.TokenStream(d.path, "train"), d.seq_len)
    held_out = shards.TokenWindows(shards.TokenStream(d.path, "val"), d.seq_len)
    if train.stream.vocab_size > spec.model.vocab_size:
      padded = -(-train.stream.vocab_size // 128) * 128  # divisible by the usual mesh axes
      raise ConfigError(f"{d.path}: the shards' vocabulary has {train.stream.vocab_size} ids "
                        f"but model.vocab_size={spec.model.vocab_size}; set "
                        f"--config.model.vocab_size={padded} (or any size >= "
                        f"{train.stream.vocab_size} that the mesh divides)")
    row = ((d.seq_len,), np.int32)
    return GrainBatches(train, held_out, [TokensToModel()], [TokensToModel()],
                        {"inputs": row, "targets": row}, eval_batches=d.eval_batches,
                        pad_eval=False, **common)
  m = spec.model
  shape = images_lib.ImageShape(m.image_size, m.channels, m.num_classes)
  train, held_out = images_lib.load_splits(d, shape)
  normalize = images_lib.Normalize(d.mean, d.std)
  train_ops = [normalize, ImagesToModel()]
  if d.crop_padding or d.flip:
    train_ops.insert(0, images_lib.RandomCropFlip(d.crop_padding, d.flip,
                                                  _order_seed(config.seed, 2)))
  row_specs = {"images": ((m.image_size, m.image_size, m.channels), np.float32),
               "labels": ((), np.int32), "weights": ((), np.float32)}
  return GrainBatches(train, held_out, train_ops, [normalize, ImagesToModel()], row_specs,
                      eval_batches=None, pad_eval=True, **common)
