"""One HTTP request's life on the event loop: its body read within limits, its generations
submitted to the batcher, their tokens and results brought back to the loop as events, and
the engine requests cancelled when the client goes away, a stop string ends a choice or time
runs out.

The batcher calls `on_token` and `on_done` on its own thread; they only append to a list and
hand the event to the loop (`call_soon_threadsafe`), so the thread that owns the devices never
waits on HTTP. Per-token events go to the loop only when someone reads them as they come
(streaming, stop strings); the token times are always kept, for the latency histograms.
"""
from __future__ import annotations

import asyncio
import functools
import queue
import time
from collections.abc import Sequence

import numpy as np
from aiohttp import web

from toolkit.inference import engine as engine_lib
from toolkit.inference.requests import parse_json
from toolkit.inference.sampling import RequestError, SamplingParams

MAX_BODY_BYTES = 1 << 20


class PastDeadline(Exception):
  """The request's time (--request_timeout) ran out before every choice ended."""


class BodyError(Exception):
  """A body that cannot be read or parsed: the status and what to fix."""

  def __init__(self, status: int, message: str):
    super().__init__(message)
    self.status, self.message = status, message


async def read_json(request: web.Request):
  """The request's JSON value (at most MAX_BODY_BYTES, nested at most 32 deep); BodyError
  413 or 400 otherwise."""
  try:
    raw = await request.read()
  except web.HTTPRequestEntityTooLarge:
    raise BodyError(413, f"the body is larger than {MAX_BODY_BYTES} bytes; send one request "
                         f"per call") from None
  except web.RequestPayloadError as e:  # e.g. a body that does not decode as its encoding
    reason = " ".join(str(e).split()).removeprefix("400, message: ")
    raise BodyError(400, f"the body could not be read ({reason})") from None
  try:
    return parse_json(raw)
  except RequestError as e:
    raise BodyError(400, f"the body {e}") from None


class Submissions:
  """The engine requests of one HTTP request (one per choice) and their events.

  `events()` yields (choice, token id) and (choice, Result) pairs in the order the batcher
  made them; a choice is done once its Result came or it was cancelled here."""

  def __init__(self, batcher: engine_lib.Batcher, prompts: Sequence[np.ndarray],
               params: Sequence[SamplingParams], live: bool):
    self.batcher, self.live = batcher, live
    self._loop = asyncio.get_running_loop()
    self._events: asyncio.Queue = asyncio.Queue()
    self.token_times: list[list[float]] = [[] for _ in prompts]
    self.results: list[engine_lib.Result | None] = [None] * len(prompts)
    self.cancelled = [False] * len(prompts)
    self.requests = [engine_lib.Request(
        np.asarray(prompt, np.int32), p, on_done=functools.partial(self._on_done, i),
        on_token=functools.partial(self._on_token, i)) for i, (prompt, p) in
        enumerate(zip(prompts, params))]

  # --- on the batcher's thread ---------------------------------------------------------------
  def _on_token(self, choice: int, token: int) -> None:
    self.token_times[choice].append(time.perf_counter())
    if self.live:
      self._loop.call_soon_threadsafe(self._events.put_nowait, (choice, token))

  def _on_done(self, choice: int, result: engine_lib.Result) -> None:
    self._loop.call_soon_threadsafe(self._events.put_nowait, (choice, result))

  # --- on the event loop ---------------------------------------------------------------------
  def submit(self) -> None:
    """Queues every choice; when one is refused (queue.Full, RequestError) cancels those
    already queued and re-raises."""
    for i, request in enumerate(self.requests):
      try:
        self.batcher.submit(request)
      except (queue.Full, RequestError):
        for earlier in range(i):
          self.cancel(earlier)
        raise

  def done(self, choice: int) -> bool:
    return self.results[choice] is not None or self.cancelled[choice]

  @property
  def all_done(self) -> bool:
    return all(self.done(i) for i in range(len(self.requests)))

  def cancel(self, choice: int) -> None:
    """Frees the choice's slot at the batcher's next step (nothing if it already ended)."""
    if not self.done(choice):
      self.cancelled[choice] = True
      self.batcher.cancel(self.requests[choice])

  def cancel_all(self) -> None:
    for choice in range(len(self.requests)):
      self.cancel(choice)

  async def events(self, deadline: float):
    """Yields the events of choices not yet done, a batch at a time (all that waited), until
    every choice is done. PastDeadline at `deadline` (time.monotonic())."""
    while not self.all_done:
      remaining = deadline - time.monotonic()
      try:
        if remaining <= 0:
          raise asyncio.TimeoutError
        batch = [await asyncio.wait_for(self._events.get(), remaining)]
      except asyncio.TimeoutError:
        raise PastDeadline from None
      while not self._events.empty():
        batch.append(self._events.get_nowait())
      kept = []
      for choice, event in batch:
        if self.done(choice):
          continue  # a token that came after this side cancelled the choice
        if isinstance(event, engine_lib.Result):
          self.results[choice] = event
        kept.append((choice, event))
      if kept:
        yield kept
