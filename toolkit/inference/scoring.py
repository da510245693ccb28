"""Click scores for recommendation models (models/dlrm.py): a user's context and N candidate
items in, N click probabilities out, with the candidates of many concurrent requests scored
together (dynamic batching, as TorchServe and Triton batch).

  scorer = Scorer(graphdef, params, mesh, rules, max_batch=2048)
  batcher = ScoreBatcher(scorer, max_wait_s=0.0, max_queue=1024)
  threading.Thread(target=batcher.run, args=(stop,)).start()
  job = Job.of(dense, ids, lengths, on_done)   # (n, F) float32, (n, T, bag) int32, (n, T) int32
  batcher.submit(job)                          # on_done(job) runs on the batcher's thread

`Scorer` compiles the forward pass once per bucket (powers of two times the ways the mesh
splits the batch, up to `max_batch`) and pads each call to the smallest bucket that holds it.
`ScoreBatcher.run` takes the first waiting job, then keeps taking jobs until `max_batch`
candidates are gathered or `max_wait_s` has passed since the first, and scores them in one
call. With `max_wait_s=0` (the server's default) a call takes only the jobs already waiting:
under load they gather while the previous call runs, and a lone request never waits. A job
never splits: it waits for the next call if it does not fit this one.
"""
from __future__ import annotations

import dataclasses
import queue
import threading
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding

import sharding

MIN_BUCKET = 8  # the smallest call, per way the batch splits


@dataclasses.dataclass
class Job:
  """One request's candidates. `scores` (n,) or `error` is set before `on_done(job)` runs."""
  dense: np.ndarray
  ids: np.ndarray
  lengths: np.ndarray
  on_done: Callable[[Job], None]
  submitted: float = 0.0
  started: float = 0.0   # when its call began (perf_counter)
  scores: np.ndarray | None = None
  error: str | None = None

  def __len__(self) -> int:
    return len(self.ids)


class Scorer:
  """The model's click probabilities, one compiled program per bucket size."""

  def __init__(self, graphdef: nnx.GraphDef, params, mesh, rules: sharding.Rules,
               max_batch: int, batch_ways: int = 1):
    self.params, self.batch_ways = params, batch_ways
    self.buckets = _buckets(max_batch, batch_ways)
    self.max_batch = self.buckets[-1]
    self.batch_sharding = NamedSharding(mesh, rules.activation_spec(("batch",), mesh))
    self.traces = 0

    def probabilities(params, dense, ids, lengths):
      self.traces += 1
      with sharding.activation_rules(rules, mesh):
        logits = nnx.merge(graphdef, params)(dense, ids, lengths)
      return jax.nn.sigmoid(logits.astype(jnp.float32))

    self._score = jax.jit(probabilities, out_shardings=self.batch_sharding)

  def warmup(self, dense_width: int, tables: int, bag: int) -> int:
    """Compiles every bucket; returns how many."""
    for size in self.buckets:
      self(np.zeros((size, dense_width), np.float32), np.zeros((size, tables, bag), np.int32),
           np.zeros((size, tables), np.int32))
    return len(self.buckets)

  def __call__(self, dense: np.ndarray, ids: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """(n,) click probabilities of n <= max_batch candidates."""
    count = len(ids)
    size = next(b for b in self.buckets if b >= count)
    pad = ((0, size - count),)
    arrays = [np.pad(a, pad + ((0, 0),) * (a.ndim - 1)) for a in (dense, ids, lengths)]
    out = self._score(self.params, *(jax.device_put(a, self.batch_sharding) for a in arrays))
    return np.asarray(out)[:count]


def _buckets(max_batch: int, ways: int) -> tuple[int, ...]:
  """MIN_BUCKET * ways, doubling, up to the first size >= max_batch (a multiple of ways)."""
  sizes = [MIN_BUCKET * ways]
  while sizes[-1] < max_batch:
    sizes.append(min(sizes[-1] * 2, -(-max_batch // ways) * ways))
  return tuple(sizes)


class ScoreBatcher:
  """A queue of jobs and the loop that scores them in batches (one thread owns the devices)."""

  def __init__(self, scorer: Scorer, max_wait_s: float = 0.0, max_queue: int = 1024,
               max_batch: int | None = None):
    self.scorer, self.max_wait_s = scorer, max_wait_s
    self.max_batch = min(max_batch or scorer.max_batch, scorer.max_batch)  # a call's candidates
    self.queue: queue.Queue[Job] = queue.Queue(maxsize=max_queue)
    self.counters = {"jobs": 0, "candidates": 0, "calls": 0, "padded": 0, "errors": 0}
    self.consecutive_errors = 0
    self._held: Job | None = None  # a job that did not fit the last call

  def submit(self, job: Job) -> None:
    """Queues `job`; queue.Full when max_queue jobs wait. ValueError over max_batch."""
    if len(job) > self.max_batch:
      raise ValueError(f"{len(job)} candidates; at most {self.max_batch} a request "
                       f"(--max_batch)")
    job.submitted = time.perf_counter()
    self.queue.put_nowait(job)

  def run(self, stop: threading.Event) -> None:
    """Scores batches until `stop` is set."""
    while not stop.is_set():
      jobs = self._gather()
      if jobs:
        self._score(jobs)

  def _take(self, timeout: float) -> Job | None:
    if self._held is not None:
      job, self._held = self._held, None
      return job
    try:
      return self.queue.get(timeout=timeout) if timeout > 0 else self.queue.get_nowait()
    except queue.Empty:
      return None

  def _gather(self) -> list[Job]:
    first = self._take(0.05)
    if first is None:
      return []
    jobs, count = [first], len(first)
    deadline = time.perf_counter() + self.max_wait_s
    while count < self.max_batch:
      job = self._take(deadline - time.perf_counter())
      if job is None:
        break
      if count + len(job) > self.max_batch:
        self._held = job
        break
      jobs.append(job)
      count += len(job)
    return jobs

  def _score(self, jobs: list[Job]) -> None:
    started = time.perf_counter()
    try:
      scores = self.scorer(*(np.concatenate([getattr(j, name) for j in jobs])
                             for name in ("dense", "ids", "lengths")))
    except Exception as e:  # pylint: disable=broad-except
      # The jobs get the error and the loop goes on: /health reports a run of failures.
      self.counters["errors"] += 1
      self.consecutive_errors += 1
      for job in jobs:
        job.started, job.error = started, f"{type(e).__name__}: {e}"
        job.on_done(job)
      return
    self.consecutive_errors = 0
    count = sum(len(j) for j in jobs)
    self.counters.update(jobs=self.counters["jobs"] + len(jobs), calls=self.counters["calls"] + 1,
                         candidates=self.counters["candidates"] + count)
    self.counters["padded"] += next(b for b in self.scorer.buckets if b >= count) - count
    begin = 0
    for job in jobs:
      job.started, job.scores = started, scores[begin:begin + len(job)]
      begin += len(job)
      job.on_done(job)
