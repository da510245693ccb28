"""What the benchmark scripts time, built and timed one way for all of them (bench_step.py,
bench_attention.py, bench_generate.py, device_check.py): the toolkit's train step as
`toolkit.training` builds it, attention's forward and backward per implementation, and the
serving engine's decode step. No flags here: each script's own flags choose the sizes.

Times are wall-clock seconds around calls that end in `jax.block_until_ready`, after untimed
warm-up calls (the first call of a compiled program also pays for loading it).
"""
from __future__ import annotations

import dataclasses
import math
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections

from toolkit import training as train
from toolkit.training import state as state_lib, step as step_lib


def progress(message: str) -> None:
  """A progress line on stderr (stdout keeps the report)."""
  print(message, file=sys.stderr, flush=True)


# --- the train step ----------------------------------------------------------------------------

@dataclasses.dataclass
class ToolkitStep:
  """The toolkit's train step for one config, compiled, with a fresh state and one batch."""
  setup: train.Setup
  compiled: Any            # (state, batch) -> (state, metrics); donates the state
  state: Any
  batch: Any
  compile_s: float


def toolkit_step(config: ml_collections.ConfigDict, devices=None) -> ToolkitStep:
  """The train step as the training loop builds it (`toolkit.training.build`, then
  `step.jit_step` with its shardings and donation; the eval step is not compiled), its state
  from `state.create` and batch 0 of the config's data."""
  setup = train.build(config, devices)
  abstract_batch = setup.batches.abstract()
  start = time.perf_counter()
  jitted, _ = step_lib.jit_step(setup.step, setup.layout, abstract_batch, setup.spec.mesh)
  compiled = jitted.lower(setup.layout.abstract, abstract_batch).compile()
  compile_s = time.perf_counter() - start
  state = state_lib.create(setup.spec.model, setup.optimizer, setup.layout, config.seed)
  return ToolkitStep(setup, compiled, state, setup.batches.batch(0), compile_s)


def run_steps(step_fn, state, batch, steps: int):
  """Runs `steps` steps back to back; returns the state and the mean seconds per step."""
  jax.block_until_ready(state)
  start = time.perf_counter()
  for _ in range(steps):
    state, out = step_fn(state, batch)
  jax.block_until_ready((state, out))
  return state, (time.perf_counter() - start) / steps


def time_step_rounds(step_fn, state, batch, warmup_steps: int, rounds: int,
                     steps_per_round: int, max_seconds: float = math.inf):
  """`warmup_steps` untimed steps, then up to `rounds` rounds of `steps_per_round` steps,
  fewer once the rounds so far took `max_seconds` (at least one). Returns the state and the
  mean seconds per step of each round."""
  state, _ = run_steps(step_fn, state, batch, warmup_steps)
  seconds, start = [], time.perf_counter()
  while len(seconds) < rounds and (not seconds or time.perf_counter() - start < max_seconds):
    state, per_step = run_steps(step_fn, state, batch, steps_per_round)
    seconds.append(per_step)
  return state, seconds


def per_device_peak(measured: float, devices) -> float:
  """One device's own matmul peak from `measured`, a matmul timed on one device: simulated CPU
  devices share the host's cores (which that matmul used all of), so each gets 1/n of it; an
  accelerator's matmul ran on its own chip."""
  return measured / len(devices) if devices[0].platform == "cpu" else measured


def peak_fraction(flops_per_step: float, step_s: float, measured_peak: float, devices) -> float:
  """Model FLOP/s per device over one device's peak (MFU against the measured matmul)."""
  return flops_per_step / len(devices) / step_s / per_device_peak(measured_peak, devices)


# --- attention ---------------------------------------------------------------------------------

def attention_inputs(batch: int, length: int, heads: int, kv_heads: int, head_dim: int,
                     dtype=jnp.float32):
  """Random q (batch, length, heads, head_dim) and k, v (batch, length, kv_heads, head_dim)."""
  keys = jax.random.split(jax.random.key(0), 3)
  shapes = ((batch, length, heads, head_dim),) + ((batch, length, kv_heads, head_dim),) * 2
  return tuple(jax.random.normal(key, shape, jnp.float32).astype(dtype)
               for key, shape in zip(keys, shapes))


def attention_steps(inputs, implementations, causal: bool = True) -> dict:
  """Per implementation (models.attention), one compiled forward + backward of q, k, v:
  (q, k, v) -> (output, its sum's gradients with respect to q, k and v)."""
  from models import attention  # pylint: disable=g-import-not-at-top
  steps = {}
  for name in implementations:
    def step(q, k, v, name=name):
      out, backward = jax.vjp(lambda q, k, v: attention.attend(q, k, v, causal, name), q, k, v)
      return out, backward(jnp.ones_like(out))
    steps[name] = jax.jit(step).lower(*inputs).compile()
  return steps


def time_alternating(calls: dict[str, Callable[[], Any]], rounds: int, repeats: int,
                     max_seconds: float = math.inf) -> dict[str, list[float]]:
  """Seconds per call of each callable, by round (the mean of `repeats` back-to-back calls),
  the callables taking turns within a round after one untimed call each; fewer rounds once
  the rounds so far took `max_seconds` (at least one)."""
  for call in calls.values():
    jax.block_until_ready(call())
  times = {name: [] for name in calls}
  start = time.perf_counter()
  for r in range(rounds):
    if r and time.perf_counter() - start >= max_seconds:
      break
    for name, call in calls.items():
      begin = time.perf_counter()
      for _ in range(repeats):
        jax.block_until_ready(call())
      times[name].append((time.perf_counter() - begin) / repeats)
  return times


# --- decoding ----------------------------------------------------------------------------------

def time_decode(engine, batch: int, prompt_length: int, steps: int, rounds: int, rng) -> float:
  """Median seconds per decode step of `engine` (toolkit.inference.engine.Engine) with every
  slot busy (the engine's step: rows laid out on the host, the paged cache read and written,
  the tokens back on the host), after a `prompt_length` prefill and an untimed round."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  from toolkit.inference.engine import RowWork  # pylint: disable=g-import-not-at-top
  from toolkit.inference.sampling import SamplingParams  # pylint: disable=g-import-not-at-top
  per_row, per_device = engine.pages_per_row, batch // engine.batch_ways
  cache = engine.new_cache(batch * per_row)
  # Row i runs on device block i // per_device, on its own pages of that block.
  pages = [range((i % per_device) * per_row, (i % per_device + 1) * per_row)
           for i in range(batch)]
  greedy = SamplingParams()
  prompts = [rng.integers(0, engine.model_cfg.vocab_size, prompt_length).astype(np.int32)
             for _ in range(batch)]
  rows = [RowWork(i // per_device, prompts[i], 0, pages[i], greedy, 0) for i in range(batch)]
  cache, first, _, order = engine.step(
      cache, [(rows, engine.prompt_bucket(prompt_length), per_device)])
  tokens = np.asarray(first)[order]
  seconds = []
  for r in range(rounds + 1):  # round 0 compiles and warms up
    start = time.perf_counter()
    for i in range(steps):
      rows = [RowWork(j // per_device, tokens[j:j + 1], prompt_length + i, pages[j], greedy,
                      i + 1) for j in range(batch)]
      cache, next_tokens, _, order = engine.step(cache, [(rows, 1, per_device)])
      tokens = np.asarray(next_tokens)[order]  # the per-step host round trip of serving
    if r:
      seconds.append((time.perf_counter() - start) / steps)
  return statistics.median(seconds)
