"""The batched scoring pass (toolkit/evaluation/scoring.py): 200 requests of mixed lengths give,
sharded over 8 devices (fsdp 4 x tensor 2, logits reduced in small chunks of positions), what
one device gives with whole-length logits, and both what the model's full logits give one
request at a time; the requests take one forward pass per batch of each padded length."""
from __future__ import annotations

import collections
import math

import jax
import numpy as np
import pytest
from flax import nnx

import sharding
from models import Llama, LlamaConfig
from tests.tiny_runs import TOLERANCE
from toolkit.evaluation import scoring

CFG = LlamaConfig.preset("tiny")
MAX_LENGTH, BATCH = 32, 16


@pytest.fixture(scope="module")
def params():
  return nnx.to_pure_dict(nnx.state(Llama(CFG, rngs=nnx.Rngs(params=0)), nnx.Param))


def requests(count: int = 200, seed: int = 0):
  """Contexts of 1-40 tokens (some cut to max_length), continuations of 1-6."""
  rng = np.random.default_rng(seed)
  return [(rng.integers(0, CFG.vocab_size, int(rng.integers(1, 41))).tolist(),
           rng.integers(0, CFG.vocab_size, int(rng.integers(1, 7))).tolist())
          for _ in range(count)]


def scorer(params, ici: str, preset: str, devices: int) -> scoring.Scorer:
  mesh = sharding.make_mesh(sharding.parse_axis_sizes(ici, "mesh.ici"), [],
                            jax.devices()[:devices])
  return scoring.Scorer(CFG, params, mesh, sharding.Rules.preset(preset), MAX_LENGTH, BATCH)


def one_at_a_time(params, request) -> tuple[float, bool]:
  """The reference: the model's full float32 logits for the request alone, log-softmax in
  float64."""
  context, continuation = request
  whole = (context + continuation)[-(MAX_LENGTH + 1):]
  tokens = np.zeros((1, MAX_LENGTH), np.int32)  # one shape: padding after is never read
  tokens[0, :len(whole) - 1] = whole[:-1]
  logits = np.asarray(_logits(params, tokens), np.float64)[0, :len(whole) - 1]
  logprobs = logits - np.log(np.sum(np.exp(logits - logits.max(-1, keepdims=True)), -1,
                                    keepdims=True)) - logits.max(-1, keepdims=True)
  targets = np.asarray(whole[1:])
  span = slice(len(targets) - len(continuation), len(targets))
  picked = logprobs[np.arange(len(targets)), targets][span]
  return float(picked.sum()), bool(np.all(logits.argmax(-1)[span] == targets[span]))


@jax.jit
def _logits(params, tokens):
  return nnx.merge(nnx.graphdef(Llama(CFG, rngs=nnx.Rngs(0))), params)(tokens)


def test_sharded_chunked_equals_one_device_and_batches_each_length(params, monkeypatch):
  asked = requests()
  single = scorer(params, "data:1", "dp", 1)
  expected = single.score(asked)
  # 4 positions a chunk on the sharded pass (its logits reduced chunk by chunk).
  monkeypatch.setattr(scoring, "LOGITS_BYTES", 4 * 4 * BATCH * CFG.vocab_size)
  sharded = scorer(params, "fsdp:4,tensor:2", "fsdp_tp", 8)
  got = sharded.score(asked)
  np.testing.assert_allclose([g[0] for g in got], [e[0] for e in expected], **TOLERANCE)
  assert [g[1] for g in got] == [e[1] for e in expected]
  for i in (0, 1, 2, 57, 199):
    logprob, greedy = one_at_a_time(params, asked[i])
    np.testing.assert_allclose(got[i][0], logprob, rtol=1e-5)
    assert got[i][1] == greedy
  # One forward pass per BATCH requests of a padded length, not one per request.
  lengths = collections.Counter(
      scoring.padded_length(min(len(c) + len(x), MAX_LENGTH + 1) - 1, MAX_LENGTH)
      for c, x in asked)
  assert sharded.forward_calls == {n: math.ceil(k / BATCH) for n, k in lengths.items()}
  assert sum(sharded.forward_calls.values()) <= sum(math.ceil(k / BATCH)
                                                    for k in lengths.values()) < 200 / 10
  assert set(lengths) == {16, 24, 32}


def test_a_continuation_longer_than_max_length_is_one_clear_error(params):
  with pytest.raises(ValueError, match="max_length=32"):
    scorer(params, "data:1", "dp", 1).score([([1], [2] * 33)])
