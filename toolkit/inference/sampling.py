"""Per-request sampling settings and the batched sampler the decode step runs.

Every row of a batch carries its own settings (greedy, temperature, top-k, top-p) and seed.
The key for token `i` of a request is `fold_in(key(seed), i)`: it depends on the request alone,
never on which other requests share its batch or slot, so results are reproducible.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

MAX_STOP_TOKENS = 8  # stop tokens per request; checked on the host, so only a sanity bound
# Top-k and top-p choose among the CANDIDATES most likely tokens of a row (`lax.top_k`: a
# partial selection, not a sort of the vocabulary): top_k may not exceed it, and top-p keeps at
# most that many tokens, which is exact unless those hold less than top_p of the mass (a very
# flat distribution over a large vocabulary).
CANDIDATES = 256


class RequestError(ValueError):
  """A request the caller can fix (bad field, prompt too long); the message names the field."""


def _is_int(value) -> bool:
  return isinstance(value, int) and not isinstance(value, bool)  # JSON true is no count


@dataclasses.dataclass(frozen=True)
class SamplingParams:
  """How one request is continued. temperature 0 is greedy; top_k 0 and top_p 1 are off.

  Generation stops after `max_tokens` new tokens or at the first token in `stop_tokens`
  (which is not included in the output)."""
  max_tokens: int = 64
  temperature: float = 0.0
  top_k: int = 0
  top_p: float = 1.0
  seed: int = 0
  stop_tokens: tuple[int, ...] = ()

  def validate(self, vocab_size: int) -> SamplingParams:
    if not _is_int(self.max_tokens) or self.max_tokens < 1:
      raise RequestError(f"max_tokens={self.max_tokens!r} must be an integer >= 1")
    for name in ("temperature", "top_p"):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise RequestError(f"{name}={value!r} must be a finite number")
    if self.temperature < 0:
      raise RequestError(f"temperature={self.temperature} must be >= 0 (0 is greedy)")
    if not 0 < self.top_p <= 1:
      raise RequestError(f"top_p={self.top_p} must be in (0, 1] (1 turns it off)")
    if not _is_int(self.top_k) or not 0 <= self.top_k <= CANDIDATES:
      raise RequestError(f"top_k={self.top_k!r} must be an integer in [0, {CANDIDATES}] (0 "
                         f"turns it off)")
    if not _is_int(self.seed) or not 0 <= self.seed < 2**32:
      raise RequestError(f"seed={self.seed!r} must be an integer in [0, 2**32)")
    if len(self.stop_tokens) > MAX_STOP_TOKENS:
      raise RequestError(f"stop_tokens has {len(self.stop_tokens)} entries; give at most "
                         f"{MAX_STOP_TOKENS}")
    for token in self.stop_tokens:
      if not _is_int(token) or not 0 <= token < vocab_size:
        raise RequestError(f"stop_tokens entry {token!r} is not a token id in [0, {vocab_size})")
    return self

  @classmethod
  def from_dict(cls, fields: Mapping[str, Any], vocab_size: int,
                defaults: SamplingParams | None = None) -> SamplingParams:
    """Settings from a JSON object's fields, over `defaults`; unknown fields are an error."""
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(fields) - known)
    if unknown:
      raise RequestError(f"unknown field {unknown[0]!r}; sampling fields are "
                         f"{', '.join(sorted(known))}")
    values = dict(fields)
    if "stop_tokens" in values:
      stop = values["stop_tokens"]
      if isinstance(stop, int) and not isinstance(stop, bool):
        stop = [stop]
      if not isinstance(stop, list):
        raise RequestError(f"stop_tokens={stop!r} must be a list of token ids")
      values["stop_tokens"] = tuple(stop)
    return dataclasses.replace(defaults or cls(), **values).validate(vocab_size)


def row_arrays(params: list[SamplingParams]) -> dict[str, np.ndarray]:
  """The per-row settings the compiled sampler takes, one entry per row."""
  return {"temperature": np.array([p.temperature for p in params], np.float32),
          "top_k": np.array([p.top_k for p in params], np.int32),
          "top_p": np.array([p.top_p for p in params], np.float32),
          "seed": np.array([p.seed for p in params], np.uint32)}


def sample(logits: jax.Array, rows: dict[str, jax.Array], token_index: jax.Array) -> jax.Array:
  """Next token per row: logits (batch, vocab) float32, `rows` as from `row_arrays`,
  token_index (batch,) the index of the token being drawn within its request.

  Temperature first, then top-k, then top-p over what top-k kept (the smallest set of the most
  likely tokens holding at least top_p of the mass, the mass renormalized over the top k when
  top-k is on). Rows with neither draw from the whole vocabulary; rows with temperature 0
  take the argmax. When every row is greedy the draw is skipped (a `cond`): its top-k and
  random numbers over the whole vocabulary are work a greedy step does not need."""
  greedy = lambda: jnp.argmax(logits, axis=-1).astype(jnp.int32)
  return jax.lax.cond(jnp.any(rows["temperature"] > 0),
                      lambda: _draw(logits, rows, token_index), greedy)


def _draw(logits: jax.Array, rows: dict[str, jax.Array], token_index: jax.Array) -> jax.Array:
  vocab = logits.shape[-1]
  count = min(CANDIDATES, vocab)
  temperature = rows["temperature"]
  scaled = logits / jnp.maximum(temperature, 1e-6)[:, None]
  top_values, top_ids = jax.lax.top_k(scaled, count)             # descending, (batch, count)
  top_k = jnp.where(rows["top_k"] > 0, jnp.minimum(rows["top_k"], count), count)[:, None]
  in_top_k = jnp.arange(count)[None, :] < top_k
  kept_values = jnp.where(in_top_k, top_values, -jnp.inf)
  # Probabilities over the top k when top-k is on, else over the whole vocabulary.
  norm = jnp.where(rows["top_k"] > 0, jax.nn.logsumexp(kept_values, axis=-1),
                   jax.nn.logsumexp(scaled, axis=-1))[:, None]
  probs = jnp.exp(kept_values - norm)
  mass_before = jnp.cumsum(probs, axis=-1) - probs
  keep = in_top_k & (mass_before < rows["top_p"][:, None])  # rank 0 is always kept
  keys = jax.vmap(lambda seed, i: jax.random.fold_in(jax.random.key(seed), i))(
      rows["seed"], token_index)
  choice = jax.vmap(jax.random.categorical)(keys, jnp.where(keep, top_values, -jnp.inf))
  restricted = jnp.take_along_axis(top_ids, choice[:, None], axis=-1)[:, 0]
  free = jax.vmap(jax.random.categorical)(keys, scaled)
  drawn = jnp.where((rows["top_k"] > 0) | (rows["top_p"] < 1), restricted, free)
  return jnp.where(temperature > 0, drawn, jnp.argmax(logits, axis=-1)).astype(jnp.int32)
