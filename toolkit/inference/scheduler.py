"""Continuous batching over the paged KV cache: requests in, one engine step at a time, tokens
and results out through callbacks (toolkit/inference/engine.py runs the steps).

A request's life: queued (`submit`, thread-safe) -> admitted when a running place and the
pages for its prompt + max_tokens are free (its longest cached prompt prefix is reused, not
recomputed: toolkit/inference/pages.py) -> prefilled (whole, or `prefill_chunk` tokens per
step beside the decoding rows) -> decoded one token per step -> finished: "length", "stop",
"error" or "cancelled" (`cancel`, thread-safe), its pages released (its full prompt pages
stay in the prefix cache until evicted).

One step (`step`, on the thread that owns the devices):
  1. requests cancelled since the last step finish; their pages are freed;
  2. waiting requests are admitted in order while places and pages last (a request that does
     not fit yet waits at the head of the line: no overtaking);
  3. without chunking, every admitted prompt is prefilled whole in one call; then one call
     decodes every running request. With `prefill_chunk` = N, one call does both: each
     decoding row's next token, and up to N tokens of the oldest prompt being prefilled on
     each device block, so a long prompt never stalls the running requests for more than one
     N-token chunk per step.
The decode rows of a call are a power of two per device block, the least that holds the
running requests: with 4 requests running a step computes 4 rows, not `batch_size`.
"""
from __future__ import annotations

import collections
import dataclasses
import queue
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from toolkit.inference.pages import PagePool
from toolkit.inference.sampling import RequestError, SamplingParams


@dataclasses.dataclass
class Result:
  """A finished request. `tokens` excludes the prompt and any stop token."""
  tokens: list[int]
  finish_reason: str  # "length" | "stop" | "error" | "cancelled"
  prompt_tokens: int
  latency_s: float
  time_to_first_token_s: float
  tag: Any = None
  error: str | None = None


@dataclasses.dataclass(eq=False)
class Request:
  """One generation request and its callbacks, both called on the batcher's thread:

  * `on_token(token_id)` for each generated token as it is accepted, in order, never for a
    stop token, all before `on_done`;
  * `on_done(result)` exactly once, when the request ends ("length", "stop", "error", or
    "cancelled" after `Batcher.cancel`).
  """
  prompt: np.ndarray  # int32 token ids, at least one
  params: SamplingParams
  on_done: Callable[[Result], None] | None = None
  tag: Any = None
  submitted: float = dataclasses.field(default_factory=time.perf_counter)
  on_token: Callable[[int], None] | None = None
  # Set by Batcher.cancel from any thread; read by the batcher's thread at its next step.
  cancelled: threading.Event = dataclasses.field(default_factory=threading.Event, repr=False)


@dataclasses.dataclass
class RowWork:
  """One row of an engine step: `tokens` (the row's tokens this step: one when decoding) at
  positions start.., written into `pages` (the request's page ids, local to block `shard` of
  the pool), sampled with `params` as the request's token number `token_index`."""
  shard: int
  tokens: np.ndarray
  start: int
  pages: Sequence[int]
  params: SamplingParams
  token_index: int


@dataclasses.dataclass(eq=False)
class _Live:
  """An admitted request: its pages (local to pool `shard`), how many prompt tokens are in the
  cache (`done`; the first `cached` came from the prefix cache) and what it generated."""
  request: Request
  shard: int
  pages: list[int]
  done: int
  cached: int
  tokens: list[int] = dataclasses.field(default_factory=list)
  first_token_s: float = 0.0

  @property
  def prefilling(self) -> bool:
    return self.done < len(self.request.prompt)


def _next_power_of_two(n: int) -> int:
  return 1 << max(0, (n - 1).bit_length())


class Batcher:
  """Continuous batching of up to `batch_size` running requests over a paged cache of
  `cache_pages` pages (default: batch_size x the pages of one cache_length request, the
  memory the contiguous cache had). `submit` and `cancel` are thread-safe; `step` runs on one
  thread, the one that owns the devices."""

  def __init__(self, engine, batch_size: int, max_queue: int = 0, cache_pages: int = 0,
               prefill_chunk: int = 0, prefix_caching: bool = True):
    pages = self.check_options(engine, batch_size, cache_pages, prefill_chunk)
    ways = engine.batch_ways
    self.engine, self.batch_size, self.cache_pages = engine, batch_size, pages
    self.prefill_chunk, self.prefix_caching = prefill_chunk, prefix_caching
    self.per_device = batch_size // ways
    self.pools = self._new_pools()
    self.cache = engine.new_cache(pages)
    self.live: list[_Live] = []
    self.queue: queue.Queue[Request] = queue.Queue(maxsize=max_queue)
    self._waiting: collections.deque[Request] = collections.deque()  # taken, not yet admitted
    self.counters = collections.Counter()
    self.started = time.perf_counter()
    # Steps that raised in a row, and the last one's error: /health reports a failing loop.
    self.consecutive_step_errors, self.last_step_error = 0, ""

  @staticmethod
  def check_options(engine, batch_size: int, cache_pages: int = 0, prefill_chunk: int = 0,
                    prefix_caching: bool = True) -> int:
    """Raises RequestError naming the option to fix; returns the pages the cache will have."""
    del prefix_caching  # any value works
    engine.check_batch_size(batch_size)
    ways = engine.batch_ways
    pages = cache_pages or batch_size * engine.pages_per_row
    if pages % ways or pages // ways < engine.pages_per_row:
      raise RequestError(
          f"cache_pages={pages} must be a multiple of {ways} (the ways the mesh splits the "
          f"batch) with at least {engine.pages_per_row} pages per way: one request of "
          f"cache_length {engine.cache_length} takes up to that many pages of "
          f"{engine.page_size}; raise cache_pages or lower cache_length")
    if prefill_chunk < 0:
      raise RequestError(f"prefill_chunk={prefill_chunk} must be >= 0 (0: whole prompts)")
    return pages

  def _new_pools(self) -> list[PagePool]:
    return [PagePool(self.cache_pages // self.engine.batch_ways, self.engine.page_size,
                     self.prefix_caching) for _ in range(self.engine.batch_ways)]

  # --- requests in ---------------------------------------------------------------------------
  def check(self, request: Request) -> None:
    """Raises RequestError for a request that can never run (call before `submit`)."""
    self.engine.check_request(request.prompt, request.params)

  def submit(self, request: Request) -> None:
    """Queues a checked request; raises queue.Full when max_queue requests already wait."""
    self.check(request)
    self.queue.put_nowait(request)
    self.counters["requests_submitted"] += 1

  def cancel(self, request: Request) -> None:
    """Thread-safe. A queued request is dropped when it would be admitted; a running one is
    finished at the next step with finish_reason "cancelled" (on_done once), its pages freed.
    Cancelling a finished request does nothing."""
    request.cancelled.set()

  @property
  def active(self) -> int:
    """Requests admitted and not finished (prefilling or decoding)."""
    return len(self.live)

  def page_stats(self) -> dict[str, int]:
    """Pages of the pool: total, in use by running requests, cached prefixes no one reads."""
    return {"total": self.cache_pages, "in_use": sum(p.in_use() for p in self.pools),
            "cached_idle": sum(p.cached_idle() for p in self.pools),
            "available": sum(p.available() for p in self.pools)}

  def _next(self, block_s: float) -> Request | None:
    if self._waiting:
      return self._waiting.popleft()
    try:
      return self.queue.get(timeout=block_s) if block_s > 0 else self.queue.get_nowait()
    except queue.Empty:
      return None

  def _admit(self, wait_s: float) -> None:
    while len(self.live) < self.batch_size:
      # Block only when nothing runs or waits: a condition wait, not a sleep.
      idle = not self.live and not self._waiting
      request = self._next(wait_s if idle else 0.0)
      if request is None:
        return
      if request.cancelled.is_set():
        self._answer(request, [], "cancelled", 0.0)
        continue
      if not self._place(request):
        self._waiting.appendleft(request)
        return

  def _place(self, request: Request) -> bool:
    """Admits `request` onto the pool block that holds most of its prefix (then the one with
    most room) if one has a place and its pages; False when none has yet."""
    prompt, size = request.prompt, self.engine.page_size
    need = -(-(len(prompt) + request.params.max_tokens) // size)
    running = collections.Counter(live.shard for live in self.live)
    choices = [(len(pool.match(prompt)), pool.available(), -running[shard], shard)
               for shard, pool in enumerate(self.pools) if running[shard] < self.per_device]
    for _, _, _, shard in sorted(choices, reverse=True):
      pool = self.pools[shard]
      prefix = pool.lookup(prompt)
      if pool.available() >= need - len(prefix):
        pages = prefix + pool.allocate(need - len(prefix))
        cached = len(prefix) * size
        self.live.append(_Live(request, shard, pages, done=cached, cached=cached))
        self.counters["prefix_cached_tokens"] += cached
        return True
      pool.release(prefix)
    return False

  # --- steps ---------------------------------------------------------------------------------
  def step(self, wait_s: float = 0.0) -> bool:
    """Finishes cancelled requests, admits waiting ones, then runs one engine step (two
    without chunking when prompts wait to be prefilled). With nothing running, waits up to
    `wait_s` for a request. Returns whether any request is running or waiting afterwards."""
    try:
      now = time.perf_counter()
      for live in [live for live in self.live if live.request.cancelled.is_set()]:
        self._finish(live, "cancelled", now)
      self._admit(wait_s)
      prefilling = [live for live in self.live if live.prefilling]
      if prefilling and not self.prefill_chunk:
        self._run(self._prefill_rows(prefilling, None), [])
      decoding = [live for live in self.live if not live.prefilling]
      if self.prefill_chunk:
        chunks = self._prefill_rows([live for live in self.live if live.prefilling],
                                    self.prefill_chunk)
        if chunks or decoding:
          self._run(chunks, decoding)
      elif decoding:
        self._run([], decoding)
    except Exception as e:  # pylint: disable=broad-except
      # Fail what is in flight, keep the batcher usable: a fresh cache, every page free.
      message = _describe(e)
      now = time.perf_counter()
      for live in list(self.live):
        self._finish(live, "error", now, error=message)
      self.pools = self._new_pools()
      self.cache = self.engine.new_cache(self.cache_pages)
      raise
    return bool(self.live or self._waiting or not self.queue.empty())

  def _prefill_rows(self, prefilling: list[_Live], chunk: int | None) -> list[tuple[_Live, int]]:
    """(request, tokens to prefill now): every prompt whole without chunking, else the
    oldest prefilling request of each pool block, `chunk` tokens at most."""
    if chunk is None:
      return [(live, len(live.request.prompt) - live.done) for live in prefilling]
    first: dict[int, _Live] = {}
    for live in prefilling:
      first.setdefault(live.shard, live)
    return [(live, min(chunk, len(live.request.prompt) - live.done)) for live in first.values()]

  def _run(self, chunks: list[tuple[_Live, int]], decoding: list[_Live]) -> None:
    """One engine call: prompt chunks (a group of their own) and decoding rows."""
    groups, rows = [], []
    if decoding:
      items = [RowWork(live.shard, np.asarray(live.tokens[-1:], np.int32),
                       len(live.request.prompt) + len(live.tokens) - 1, live.pages,
                       live.request.params, len(live.tokens)) for live in decoding]
      groups.append((items, 1, self._rows_per_device([live.shard for live in decoding])))
      rows.extend((live, 1) for live in decoding)
    if chunks:
      items = [RowWork(live.shard, live.request.prompt[live.done:live.done + n], live.done,
                       live.pages, live.request.params, 0) for live, n in chunks]
      length = self.engine.prompt_bucket(max(n for _, n in chunks))
      if self.prefill_chunk:
        length = min(length, self.prefill_chunk)
      groups.append((items, length, self._rows_per_device([live.shard for live, _ in chunks])))
      rows.extend(chunks)
    self.cache, next_tokens, _, order = self.engine.step(self.cache, groups)
    next_tokens = np.asarray(next_tokens)[order]
    now = time.perf_counter()
    if decoding:
      self.counters["decode_steps"] += 1
      self.counters["busy_slot_steps"] += len(decoding)
    if chunks:
      self.counters["prefill_calls"] += 1
    for (live, n), token in zip(rows, next_tokens):
      if live.prefilling:
        live.done += n
        self.counters["prefill_tokens"] += n
        if live.prefilling:
          continue  # a chunk of the prompt: the token sampled after it is not the answer
        self.pools[live.shard].register(live.request.prompt, live.pages)
        live.first_token_s = now - live.request.submitted
      self._accept(live, int(token), now)

  def _rows_per_device(self, shards: list[int]) -> int:
    """Rows per device block for rows on these blocks: a power of two (few compiled shapes),
    at most the running requests a block may hold."""
    busiest = max(collections.Counter(shards).values())
    return min(self.per_device, _next_power_of_two(busiest))

  def _accept(self, live: _Live, token: int, now: float) -> None:
    """Appends `token` to the request, or finishes the request."""
    params = live.request.params
    self.counters["tokens_generated"] += 1
    if token in params.stop_tokens:
      self._finish(live, "stop", now)
      return
    live.tokens.append(token)
    if live.request.on_token is not None:
      live.request.on_token(token)
    if len(live.tokens) >= params.max_tokens:
      self._finish(live, "length", now)

  def _finish(self, live: _Live, reason: str, now: float, error: str | None = None) -> None:
    self.live.remove(live)
    self.pools[live.shard].release(live.pages)
    self._answer(live.request, live.tokens, reason, live.first_token_s, error, now)

  def _answer(self, request: Request, tokens: list[int], reason: str, first_token_s: float,
              error: str | None = None, now: float | None = None) -> None:
    self.counters["requests_cancelled" if reason == "cancelled" else
                  "requests_failed" if error is not None else "requests_finished"] += 1
    latency = (now or time.perf_counter()) - request.submitted
    if request.on_done is not None:
      request.on_done(Result(tokens, reason, len(request.prompt), latency, first_token_s,
                             request.tag, error))

  # --- serving -------------------------------------------------------------------------------
  def warmup(self, log: Callable[[str], None] = lambda _: None) -> int:
    """Compiles every step shape this batcher can ask for, so that no request waits for a
    compile; returns how many shapes that was, and logs one line per group of shapes. The
    steps hold only idle rows, which write nothing."""
    engine = self.engine
    rows = [1 << i for i in range(self.per_device.bit_length()) if 1 << i <= self.per_device]
    if self.per_device not in rows:
      rows.append(self.per_device)
    lengths, length = [], engine.prompt_bucket(1)
    limit = min(self.prefill_chunk or engine.cache_length, engine.cache_length)
    while not lengths or lengths[-1] < limit:
      lengths.append(min(engine.prompt_bucket(length), limit))
      length *= 2
    if self.prefill_chunk:  # one call: decode rows (or none) beside one chunk row (or none)
      shapes = [(d, c) for d in [0] + rows for c in [0] + lengths if d or c]
      groups = lambda d, c: [g for g in (([], 1, d), ([], c, 1)) if g[2] and g[1]]
    else:  # decode calls, and prefill calls of any rows and length
      shapes = [(d, 0) for d in rows] + [(-k, c) for k in rows for c in lengths]
      groups = lambda d, c: [([], 1, d)] if d > 0 else [([], c, -d)]
    start = time.perf_counter()
    for i, (d, c) in enumerate(shapes):
      self.cache, first, _, _ = engine.step(self.cache, groups(d, c))
      if i + 1 == len(shapes) or (i + 1) % 8 == 0:
        np.asarray(first)  # wait for it
        log(f"warm-up {i + 1}/{len(shapes)} step shapes in {time.perf_counter() - start:.1f} s")
    return len(shapes)

  def run(self, stop: threading.Event, wait_s: float = 0.05,
          log: Callable[[str], None] = lambda line: print(line, file=sys.stderr, flush=True)
          ) -> None:
    """Steps until `stop` is set (the serving loop's thread). A step that raises has already
    answered its requests with the error; it is counted (`step_errors`), logged, and the loop
    goes on; `consecutive_step_errors` says how many failed with no work done in between
    (an idle step, with nothing to run, neither fails nor resets it)."""
    while not stop.is_set():
      worked = self.counters["decode_steps"] + self.counters["prefill_calls"]
      try:
        self.step(wait_s)
        if self.counters["decode_steps"] + self.counters["prefill_calls"] > worked:
          self.consecutive_step_errors = 0
      except Exception as e:  # pylint: disable=broad-except
        self.counters["step_errors"] += 1
        self.consecutive_step_errors += 1
        self.last_step_error = _describe(e)
        log(f"error: decode step failed ({self.consecutive_step_errors} in a row, "
            f"{self.counters['step_errors']} in all): {self.last_step_error}")


def _describe(error: Exception) -> str:
  text = str(error).strip()
  return f"{type(error).__name__}: {text.splitlines()[0] if text else ''}"


def generate(engine, prompts: Sequence[np.ndarray], params: Sequence[SamplingParams],
             batch_size: int, progress: Callable[[int, int, int], None] | None = None,
             **options) -> list[Result]:
  """Generates for every prompt (offline batch inference) with continuous batching of up to
  `batch_size` requests, or fewer when there are fewer prompts; `options` go to the Batcher
  (cache_pages, prefill_chunk, prefix_caching). Results are in prompt order.
  `progress(done, total, tokens)` is called after every step."""
  if not prompts:
    return []
  batch_size = min(batch_size, engine.prefill_rows(len(prompts), batch_size))
  batcher = Batcher(engine, batch_size, **options)
  results: list[Result | None] = [None] * len(prompts)
  done = [0]

  def on_done(result: Result) -> None:
    results[result.tag] = result
    done[0] += 1

  requests = [Request(np.asarray(p, np.int32), q, on_done, tag=i)
              for i, (p, q) in enumerate(zip(prompts, params))]
  for request in requests:
    batcher.check(request)
  for request in requests:
    batcher.queue.put(request)
  while batcher.step():
    if progress is not None:
      progress(done[0], len(prompts), batcher.counters["tokens_generated"])
  if progress is not None:
    progress(done[0], len(prompts), batcher.counters["tokens_generated"])
  return results  # type: ignore[return-value]
