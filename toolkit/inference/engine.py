"""Generation with a KV cache on a mesh: compiled prefill and decode, and a slot scheduler that
batches requests continuously.

Design (JetStream's prefill / insert / generate split, in one process):
  * The cache holds `batch_size` slots, (layers, batch, cache_length, kv_heads, head_dim) for
    keys and values, sharded by the activation rules like any activation.
  * `prefill` runs new prompts (right-padded to a power-of-two length bucket) through the
    model, writes their keys and values into free slots and samples each one's first token.
  * `decode` advances every slot by one token. Each row has its own position, so requests of
    different lengths share a step and a finished request's slot is refilled at the next step
    while the others keep going (continuous batching).
  * Both are jitted once per shape: decode per (batch size, cache length), prefill per
    (prefill rows bucket, prompt length bucket). `Engine.traces` counts the traces.
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

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding

import sharding
from models import LlamaConfig
from models.llama import CACHE_AXES, init_cache
from toolkit.inference import sampling
from toolkit.training import state as state_lib
from toolkit.inference.sampling import RequestError, SamplingParams

MIN_PROMPT_BUCKET = 16


def _next_power_of_two(n: int) -> int:
  return 1 << max(0, (n - 1).bit_length())


def decode_step(graphdef: nnx.GraphDef, rules: sharding.Rules, mesh: Mesh, params, cache,
                tokens, positions, rows, token_index):
  """One token for every cache slot: the model's decode and the sampler, under the rules.
  Returns (cache, next tokens (batch,), logits (batch, vocab)). The engine jits it with the
  cache donated; scripts/decode_cost.py compiles it ahead of time for a TPU topology."""
  with sharding.activation_rules(rules, mesh):
    logits, cache = nnx.merge(graphdef, params).decode(tokens, positions, cache)
    next_tokens = sampling.sample(logits, rows, token_index)
  return cache, next_tokens, logits


class Engine:
  """One model's parameters on a mesh with its compiled prefill and decode steps."""

  def __init__(self, model_cfg: LlamaConfig, params, mesh: Mesh, rules: sharding.Rules,
               cache_length: int):
    if not isinstance(model_cfg, LlamaConfig) or not model_cfg.causal:
      raise ValueError(f"the KV-cache engine generates with causal decoder LMs (LlamaConfig), "
                       f"not {type(model_cfg).__name__}; classifiers use toolkit.predict")
    if cache_length < 2:
      raise RequestError(f"cache_length={cache_length} must be >= 2 (prompt + new tokens)")
    # A mixture of experts generates dropless whatever it trained with: capacity routing would
    # make a token's output depend on the other prompts in the batch and on the padding. XLA:CPU
    # lacks ragged_all_to_all; the ring computes the same outputs.
    on_cpu = mesh.devices.flat[0].platform == "cpu"
    model_cfg = dataclasses.replace(model_cfg, moe_dispatch="dropless", **(
        {"expert_exchange": "ring"} if on_cpu else {}))
    self.model_cfg, self.mesh, self.rules, self.cache_length = model_cfg, mesh, rules, cache_length
    layout = state_lib.layout(model_cfg, optax.identity(), rules, mesh)
    self.graphdef, self.report = layout.graphdef, layout.report
    self.param_shardings = layout.shardings["params"]
    # Parameters that already sit in their shardings (restored) are not copied.
    self.params = jax.device_put(params, self.param_shardings)
    batch_axes = [a for e in rules.activation_spec(("batch",), mesh) if e
                  for a in ((e,) if isinstance(e, str) else e)]
    self.batch_ways = int(np.prod([mesh.shape[a] for a in batch_axes]))
    self.cache_sharding = NamedSharding(mesh, rules.activation_spec(("layers",) + CACHE_AXES, mesh))
    self.row_sharding = NamedSharding(mesh, rules.activation_spec(("batch",), mesh))
    self.traces: collections.Counter = collections.Counter()
    rows_out = (self.cache_sharding, self.row_sharding,
                NamedSharding(mesh, rules.activation_spec(("batch", "vocab"), mesh)))
    self._decode = jax.jit(self._decode_fn, donate_argnums=1, out_shardings=rows_out)
    self._prefill = jax.jit(self._prefill_fn, donate_argnums=1, out_shardings=rows_out)

  # --- the compiled steps --------------------------------------------------------------------
  def _decode_fn(self, params, cache, tokens, positions, rows, token_index):
    self.traces["decode", tokens.shape[0], cache["k"].shape[2]] += 1
    return decode_step(self.graphdef, self.rules, self.mesh, params, cache, tokens, positions,
                       rows, token_index)

  def _prefill_fn(self, params, cache, tokens, lengths, slots, rows):
    self.traces["prefill", tokens.shape[0], tokens.shape[1], cache["k"].shape[1]] += 1
    with sharding.activation_rules(self.rules, self.mesh):
      logits, kv = nnx.merge(self.graphdef, params).prefill(tokens, lengths)
      first = sampling.sample(logits, rows, jnp.zeros_like(lengths))
      # Padding rows carry slot == batch size: out of bounds, so mode="drop" skips them.
      cache = {name: sharding.constrain(
          cache[name].at[:, slots, :tokens.shape[1]].set(kv[name].astype(cache[name].dtype),
                                                         mode="drop"),
          ("layers",) + CACHE_AXES) for name in cache}
    return cache, first, logits

  # --- host-side calls -----------------------------------------------------------------------
  def new_cache(self, batch_size: int):
    self.check_batch_size(batch_size)
    make = jax.jit(lambda: init_cache(self.model_cfg, batch_size, self.cache_length),
                   out_shardings=self.cache_sharding)
    return make()

  def check_request(self, prompt: np.ndarray, params: SamplingParams) -> None:
    """Raises RequestError naming what to fix when a request cannot run on this engine."""
    vocab = self.model_cfg.vocab_size
    params.validate(vocab)
    if len(prompt) == 0:
      raise RequestError("the prompt is empty; give at least one token")
    if prompt.min() < 0 or prompt.max() >= vocab:
      raise RequestError(f"prompt token ids must be in [0, {vocab})")
    if len(prompt) + params.max_tokens > self.cache_length:
      raise RequestError(
          f"prompt ({len(prompt)} tokens) + max_tokens ({params.max_tokens}) exceeds the cache "
          f"length {self.cache_length}; shorten the prompt or lower max_tokens")

  def check_batch_size(self, batch_size: int) -> None:
    if batch_size < 1 or batch_size % self.batch_ways:
      raise RequestError(
          f"batch_size={batch_size} must be a positive multiple of {self.batch_ways}, the "
          f"number of ways the mesh splits the batch; use e.g. {self.batch_ways * 4}")

  def _rows(self, values: dict[str, np.ndarray]):
    return jax.device_put(values, self.row_sharding)

  def prefill_rows(self, count: int, batch_size: int) -> int:
    """Rows of the prefill call for `count` new prompts: a power of two times the batch
    ways (so few shapes get compiled), at most the batch size."""
    return min(batch_size, self.batch_ways * _next_power_of_two(-(-count // self.batch_ways)))

  def prompt_bucket(self, length: int) -> int:
    return min(self.cache_length, max(MIN_PROMPT_BUCKET, _next_power_of_two(length)))

  def prefill(self, cache, prompts: Sequence[np.ndarray], slots: Sequence[int],
              params: Sequence[SamplingParams], batch_size: int):
    """Writes `prompts` into cache `slots`; returns (cache, first tokens (len(prompts),),
    last-prompt-token logits (len(prompts), vocab), device arrays)."""
    count = len(prompts)
    rows = self.prefill_rows(count, batch_size)
    bucket = self.prompt_bucket(max(len(p) for p in prompts))
    tokens = np.zeros((rows, bucket), np.int32)
    lengths = np.ones(rows, np.int32)
    slot_ids = np.full(rows, batch_size, np.int32)
    for i, prompt in enumerate(prompts):
      tokens[i, :len(prompt)] = prompt
      lengths[i] = len(prompt)
      slot_ids[i] = slots[i]
    row_params = list(params) + [SamplingParams()] * (rows - count)
    cache, first, logits = self._prefill(self.params, cache, *self._rows(
        (tokens, lengths, slot_ids)), self._rows(sampling.row_arrays(row_params)))
    return cache, first, logits

  def decode(self, cache, tokens: np.ndarray, positions: np.ndarray, rows: dict,
             token_index: np.ndarray):
    """One step for every slot; returns (cache, next tokens (batch,), logits (batch, vocab))."""
    return self._decode(self.params, cache, *self._rows((tokens, positions)), self._rows(rows),
                        self._rows(token_index))


@dataclasses.dataclass
class Result:
  """A finished request. `tokens` excludes the prompt and any stop token."""
  tokens: list[int]
  finish_reason: str  # "length" | "stop" | "error"
  prompt_tokens: int
  latency_s: float
  time_to_first_token_s: float
  tag: Any = None
  error: str | None = None


@dataclasses.dataclass
class Request:
  prompt: np.ndarray  # int32 token ids, at least one
  params: SamplingParams
  on_done: Callable[[Result], None] | None = None
  tag: Any = None
  submitted: float = dataclasses.field(default_factory=time.perf_counter)


@dataclasses.dataclass
class _Active:
  request: Request
  tokens: list[int]
  first_token_s: float


class Batcher:
  """Continuous batching over `batch_size` cache slots. `submit` is thread-safe; `step` (one
  admission + one decode step) runs on one thread, the one that owns the devices."""

  def __init__(self, engine: Engine, batch_size: int, max_queue: int = 0):
    engine.check_batch_size(batch_size)
    self.engine, self.batch_size = engine, batch_size
    self.cache = engine.new_cache(batch_size)
    self.slots: list[_Active | None] = [None] * batch_size
    self.queue: queue.Queue[Request] = queue.Queue(maxsize=max_queue)
    self._tokens = np.zeros(batch_size, np.int32)
    self._positions = np.zeros(batch_size, np.int32)
    self._token_index = np.zeros(batch_size, np.int32)
    self._params = [SamplingParams()] * batch_size
    self.counters = collections.Counter()
    self.started = time.perf_counter()
    # Steps that raised in a row, and the last one's error: /health reports a failing loop.
    self.consecutive_step_errors, self.last_step_error = 0, ""

  # --- admission -----------------------------------------------------------------------------
  def check(self, request: Request) -> None:
    """Raises RequestError for a request that can never run (call before `submit`)."""
    self.engine.check_request(request.prompt, request.params)

  def submit(self, request: Request) -> None:
    """Queues a checked request; raises queue.Full when max_queue requests already wait."""
    self.check(request)
    self.queue.put_nowait(request)
    self.counters["requests_submitted"] += 1

  @property
  def active(self) -> int:
    return sum(slot is not None for slot in self.slots)

  def _admit(self, wait_s: float) -> None:
    free = [i for i, slot in enumerate(self.slots) if slot is None]
    taken: list[Request] = []
    while len(taken) < len(free):
      try:
        # Block only when nothing is running: a condition wait, not a sleep.
        block = wait_s > 0 and not taken and len(free) == self.batch_size
        taken.append(self.queue.get(timeout=wait_s) if block else self.queue.get_nowait())
      except queue.Empty:
        break
    if not taken:
      return
    slots = free[:len(taken)]
    try:
      self.cache, first, _ = self.engine.prefill(
          self.cache, [r.prompt for r in taken], slots, [r.params for r in taken],
          self.batch_size)
      first = np.asarray(first)
    except Exception as e:  # pylint: disable=broad-except
      # The taken requests hold no slot yet: answer them here, or they would wait forever.
      now = time.perf_counter()
      for request in taken:
        self.counters["requests_failed"] += 1
        if request.on_done is not None:
          request.on_done(Result([], "error", len(request.prompt), now - request.submitted, 0.0,
                                 request.tag, _describe(e)))
      raise
    now = time.perf_counter()
    self.counters["prefill_calls"] += 1
    for i, (slot, request) in enumerate(zip(slots, taken)):
      active = _Active(request, [], now - request.submitted)
      self.slots[slot] = active
      self._positions[slot] = len(request.prompt)
      self._token_index[slot] = 0
      self._params[slot] = request.params
      self._accept(slot, int(first[i]), now)

  # --- decoding ------------------------------------------------------------------------------
  def _accept(self, slot: int, token: int, now: float) -> None:
    """Appends `token` to the slot's request, or finishes the request."""
    active = self.slots[slot]
    params = active.request.params
    self.counters["tokens_generated"] += 1
    if token in params.stop_tokens:
      self._finish(slot, "stop", now)
      return
    active.tokens.append(token)
    if len(active.tokens) >= params.max_tokens:
      self._finish(slot, "length", now)
      return
    self._tokens[slot] = token
    self._token_index[slot] += 1

  def _finish(self, slot: int, reason: str, now: float, error: str | None = None) -> None:
    active = self.slots[slot]
    self.slots[slot] = None
    self._positions[slot] = 0
    self._tokens[slot] = 0
    self._params[slot] = SamplingParams()
    request = active.request
    self.counters["requests_finished" if error is None else "requests_failed"] += 1
    result = Result(tokens=active.tokens, finish_reason=reason, prompt_tokens=len(request.prompt),
                    latency_s=now - request.submitted,
                    time_to_first_token_s=active.first_token_s, tag=request.tag, error=error)
    if request.on_done is not None:
      request.on_done(result)

  def step(self, wait_s: float = 0.0) -> bool:
    """Admits waiting requests into free slots, then advances every busy slot one token.
    With nothing running, waits up to `wait_s` for a request. Returns whether any request is
    running or waiting afterwards."""
    try:
      self._admit(wait_s)
      if self.active:
        self.cache, next_tokens, _ = self.engine.decode(
            self.cache, self._tokens, self._positions, sampling.row_arrays(self._params),
            self._token_index)
        next_tokens = np.asarray(next_tokens)
        now = time.perf_counter()
        self.counters["decode_steps"] += 1
        self.counters["busy_slot_steps"] += self.active
        for slot, active in enumerate(self.slots):
          if active is not None:
            self._positions[slot] += 1
            self._accept(slot, int(next_tokens[slot]), now)
    except Exception as e:  # pylint: disable=broad-except
      # Fail what is in flight, keep the batcher usable: a fresh cache, all slots free.
      message = _describe(e)
      now = time.perf_counter()
      for slot, active in enumerate(self.slots):
        if active is not None:
          self._finish(slot, "error", now, error=message)
      self.cache = self.engine.new_cache(self.batch_size)
      raise
    return bool(self.active or not self.queue.empty())

  def warmup(self, log: Callable[[str], None] = lambda _: None) -> int:
    """Compiles decode and every (rows, prompt length) prefill bucket, so that no request
    waits for a compile; returns how many shapes that was, and logs one line per group of
    shapes (a row count's prompt lengths, then decode) as it goes. The prefills hold only
    padding rows, which write nothing; the decode step writes only to free slots."""
    engine, size = self.engine, self.batch_size
    rows = sorted({engine.prefill_rows(count, size) for count in range(1, size + 1)})
    lengths, length = [], MIN_PROMPT_BUCKET
    while not lengths or lengths[-1] < engine.cache_length:
      lengths.append(engine.prompt_bucket(length))
      length *= 2
    total, done = len(rows) * len(lengths) + 1, 0
    for n in rows:
      start = time.perf_counter()
      for bucket in lengths:
        self.cache, first, _ = engine._prefill(engine.params, self.cache, *engine._rows((
            np.zeros((n, bucket), np.int32), np.ones(n, np.int32), np.full(n, size, np.int32))),
            engine._rows(sampling.row_arrays([SamplingParams()] * n)))
      np.asarray(first)
      done += len(lengths)
      log(f"warm-up {done}/{total} shapes: prefill of {n} row(s) at {len(lengths)} prompt "
          f"lengths ({lengths[0]}-{lengths[-1]}) in {time.perf_counter() - start:.1f} s")
    start = time.perf_counter()
    zeros = np.zeros(size, np.int32)
    self.cache, first, _ = engine.decode(self.cache, zeros, zeros,
                                         sampling.row_arrays([SamplingParams()] * size), zeros)
    np.asarray(first)  # wait for it
    log(f"warm-up {total}/{total} shapes: decode of {size} slots in "
        f"{time.perf_counter() - start:.1f} s")
    return total

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


def generate(engine: Engine, prompts: Sequence[np.ndarray], params: Sequence[SamplingParams],
             batch_size: int, progress: Callable[[int, int, int], None] | None = None
             ) -> list[Result]:
  """Generates for every prompt (offline batch inference) with continuous batching over
  `batch_size` slots, or fewer when there are fewer prompts. Results are in prompt order.
  `progress(done, total, tokens)` is called after every step."""
  if not prompts:
    return []
  batch_size = min(batch_size, engine.prefill_rows(len(prompts), batch_size))
  batcher = Batcher(engine, batch_size)
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
