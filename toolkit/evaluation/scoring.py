"""Log-likelihoods of many token sequences in few forward passes of the sharded model.

A request is (context tokens, continuation tokens). It is scored as the harness's Hugging Face
backend scores it (lm_eval/models/huggingface.py, `_loglikelihood_tokens`): the model reads
(context + continuation)[-(max_length + 1):][:-1], cut from the left when too long, and the
continuation is predicted at the last len(continuation) positions. The answer is the sum of
the continuation's log-probabilities (nats) and whether every one of its tokens is the most
likely token there (greedy).

Requests are sorted longest first and grouped by padded length (a power of two or 1.5 times one,
at least MIN_LENGTH, at most max_length: above MIN_LENGTH under a third of a row is padding, for
two programs per doubling of the length); each group is cut into batches of `batch_size` rows,
and each batch is one forward pass (rows right-padded: the model is causal, so padding never
changes a real position's logits). One program is compiled per padded length. Only (batch,
length) scores leave the devices: the logits are reduced where they are computed, in chunks of
positions small enough that a chunk's float32 logits stay under LOGITS_BYTES.
"""
from __future__ import annotations

import collections
import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import sharding
from models import LlamaConfig
from toolkit.errors import ConfigError
from toolkit.training import state as state_lib

MIN_LENGTH = 16
LOGITS_BYTES = 2**28  # one chunk's float32 logits, all rows: 256 MiB before sharding


def padded_length(length: int, max_length: int) -> int:
  """The padded length of a row of `length` tokens: the next of 16, 24, 32, 48, 64, 96, ...
  (2^k and 3 x 2^(k-1)), within [MIN_LENGTH, max_length]."""
  power = 1 << max(0, (length - 1).bit_length())  # the next power of two
  padded = power * 3 // 4 if power * 3 // 4 >= length else power
  return min(max_length, max(MIN_LENGTH, padded))


def for_scoring(model_cfg: LlamaConfig, mesh: Mesh) -> LlamaConfig:
  """`model_cfg` as scored and generated from: a mixture of experts routes dropless (capacity
  routing would make a request's score depend on the other rows of its batch and on the
  padding), exchanging tokens by a ring on CPU (XLA:CPU lacks ragged_all_to_all), as the
  KV-cache engine does."""
  on_cpu = mesh.devices.flat[0].platform == "cpu"
  return dataclasses.replace(model_cfg, moe_dispatch="dropless",
                             **({"expert_exchange": "ring"} if on_cpu else {}))


def token_scores(features: jax.Array, matrix: jax.Array, letters: str, targets: jax.Array,
                 chunk: int) -> tuple[jax.Array, jax.Array]:
  """(log-probability of each target (batch, length) float32, whether it is the argmax (batch,
  length) bool) from the final features (batch, length, embed) and the output matrix
  (`Llama.unembedding`), `chunk` positions at a time (chunk divides length)."""
  batch, length, _ = features.shape

  def one(xs):
    f, t = xs  # (batch, chunk, embed), (batch, chunk)
    logits = jnp.einsum(f"bce,{letters}->bcv", f, matrix, preferred_element_type=jnp.float32)
    logits = sharding.constrain(logits, ("batch", "length", "vocab"))
    target = jnp.take_along_axis(logits, t[..., None], axis=-1)[..., 0]
    return target - jax.nn.logsumexp(logits, axis=-1), jnp.argmax(logits, axis=-1) == t

  count = length // chunk
  split = lambda x: jnp.moveaxis(x.reshape(batch, count, chunk, *x.shape[2:]), 1, 0)
  logprobs, greedy = jax.lax.map(one, (split(features), split(targets)))
  join = lambda x: jnp.moveaxis(x, 0, 1).reshape(batch, length)
  return join(logprobs), join(greedy)


class Scorer:
  """A model's parameters on a mesh and its compiled scoring pass. `forward_calls` counts the
  forward passes per padded length."""

  def __init__(self, model_cfg: LlamaConfig, params, mesh: Mesh, rules: sharding.Rules,
               max_length: int, batch_size: int):
    self.model_cfg = for_scoring(model_cfg, mesh)
    self.mesh, self.rules, self.max_length = mesh, rules, max_length
    layout = state_lib.layout(self.model_cfg, optax.identity(), rules, mesh)
    self.graphdef, self._param_shardings = layout.graphdef, layout.shardings["params"]
    self.params = self.place(params)
    batch_axes = [a for e in rules.activation_spec(("batch",), mesh) if e
                  for a in ((e,) if isinstance(e, str) else e)]
    ways = int(np.prod([mesh.shape[a] for a in batch_axes]))
    self.batch_size = -(-batch_size // ways) * ways  # whole rows on every batch shard
    self.rows = NamedSharding(mesh, rules.activation_spec(("batch", "length"), mesh))
    self.forward_calls: collections.Counter = collections.Counter()
    self._forward = jax.jit(self._forward_fn, out_shardings=NamedSharding(mesh, PartitionSpec()))

  def place(self, params):
    """`params` in the scorer's shardings (not copied when they are there already)."""
    return jax.device_put(params, self._param_shardings)

  def _forward_fn(self, params, tokens, targets):
    length = tokens.shape[1]
    vocab = self.model_cfg.vocab_size
    chunk = min(length, max(1, LOGITS_BYTES // (4 * self.batch_size * vocab)))
    chunk = 1 << (chunk.bit_length() - 1)  # a power of two, halved until it divides length
    while length % chunk:
      chunk //= 2
    with sharding.activation_rules(self.rules, self.mesh):
      model = nnx.merge(self.graphdef, params)
      matrix, letters = model.unembedding()
      return token_scores(model.features(tokens), matrix, letters, targets, chunk)

  def score(self, requests: Sequence[tuple[Sequence[int], Sequence[int]]]
            ) -> list[tuple[float, bool]]:
    """(sum of the continuation's log-probabilities in nats, greedy) per (context,
    continuation) request, in request order. Contexts may be empty only when the continuation
    has a token to condition on (the harness puts a prefix token there)."""
    rows = [self._row(i, context, continuation)
            for i, (context, continuation) in enumerate(requests)]
    order = sorted(range(len(rows)), key=lambda i: -len(rows[i][0]))
    batches: list[list[int]] = []
    for _, members in _groups(order, lambda i: padded_length(len(rows[i][0]) - 1,
                                                             self.max_length)):
      batches += [members[k:k + self.batch_size] for k in range(0, len(members), self.batch_size)]
    results: list[tuple[float, bool] | None] = [None] * len(rows)
    pending = None
    for batch in batches + [None]:
      # One batch on the devices while the next one's rows are laid out.
      launched = self._launch([rows[i][0] for i in batch]) if batch is not None else None
      if pending is not None:
        members, (logprobs, greedy) = pending
        logprobs, greedy = np.asarray(logprobs), np.asarray(greedy)
        for row, i in enumerate(members):
          inputs = len(rows[i][0]) - 1
          span = slice(inputs - rows[i][1], inputs)
          results[i] = (float(np.sum(logprobs[row, span], dtype=np.float64)),
                        bool(np.all(greedy[row, span])))
      pending = (batch, launched) if batch is not None else None
    return results  # type: ignore[return-value]

  def _row(self, index: int, context: Sequence[int], continuation: Sequence[int]):
    """(the tokens the row reads and predicts, continuation length)."""
    if not continuation:
      raise ValueError(f"request {index} has an empty continuation")
    if len(continuation) > self.max_length:
      raise ConfigError(f"a continuation of {len(continuation)} tokens is longer than the "
                        f"model's max_length={self.max_length}; raise --max_length")
    whole = [int(t) for t in (*context, *continuation)][-(self.max_length + 1):]
    if len(whole) < 2:
      raise ValueError(f"request {index} has no context to predict its first token from")
    vocab = self.model_cfg.vocab_size
    if min(whole) < 0 or max(whole) >= vocab:
      raise ConfigError(f"token ids must be in [0, {vocab}), the model's vocabulary; give the "
                        f"model's own tokenizer")
    return whole, len(continuation)

  def _launch(self, wholes: list[list[int]]):
    """Starts the forward pass of one batch (rows: tokens read + 1); returns its device
    outputs."""
    length = padded_length(max(len(w) for w in wholes) - 1, self.max_length)
    tokens = np.zeros((self.batch_size, length), np.int32)
    targets = np.zeros((self.batch_size, length), np.int32)
    for row, whole in enumerate(wholes):
      tokens[row, :len(whole) - 1] = whole[:-1]
      targets[row, :len(whole) - 1] = whole[1:]
    self.forward_calls[length] += 1
    put = lambda x: jax.device_put(x, self.rows)
    return self._forward(self.params, put(tokens), put(targets))


def _groups(order: list[int], key) -> list[tuple[int, list[int]]]:
  """Consecutive runs of `order` with the same key: (key, members)."""
  groups: list[tuple[int, list[int]]] = []
  for i in order:
    k = key(i)
    if groups and groups[-1][0] == k:
      groups[-1][1].append(i)
    else:
      groups.append((k, [i]))
  return groups
