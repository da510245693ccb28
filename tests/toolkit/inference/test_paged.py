"""The paged KV cache in the engine and the batcher: the paged step equals the contiguous cache
(tokens and logits, sharded and not, requests of very different lengths sharing the pool and
one step), prefix caching returns what a cold run returns and leaks no page, chunked prefill
changes no token and keeps the running requests decoding, a cancelled request frees its place
at once, and a step's decode rows follow the running requests."""
import functools

import jax
import numpy as np
import pytest
from flax import nnx

import sharding
from models import Llama, LlamaConfig
from tests.models.test_llama_cache import CACHE_TOLERANCE
from toolkit.inference import engine as engine_lib
from toolkit.inference.pages import PagePool
from toolkit.inference.sampling import SamplingParams

CFG = LlamaConfig.preset("tiny")
# Every batcher here has a pool of POOL pages: the pool's size is part of each compiled step's
# shapes, so one size lets the tests share their compiles.
CACHE_LENGTH, PAGE, POOL = 64, 4, 64


@pytest.fixture(scope="module")
def params():
  return nnx.to_pure_dict(nnx.state(Llama(CFG, rngs=nnx.Rngs(params=0)), nnx.Param))


@pytest.fixture(scope="module")
def engine(params):
  """One unsharded engine for the batcher tests: its compiled shapes are shared between them."""
  return make_engine(params)


def make_engine(params, ici="data:1", preset="dp", devices=1):
  mesh = sharding.make_mesh(sharding.parse_axis_sizes(ici, "mesh.ici"), [],
                            jax.devices()[:devices])
  return engine_lib.Engine(CFG, params, mesh, sharding.Rules.preset(preset), CACHE_LENGTH,
                           page_size=PAGE)


@functools.cache
def _contiguous_steps():
  model = Llama(CFG, rngs=nnx.Rngs(params=0))  # the `params` fixture's model
  return (jax.jit(lambda tokens, lengths: model.prefill(tokens, lengths)),
          jax.jit(lambda token, position, cache: model.decode(token, position, cache)))


def contiguous_greedy(prompt, count):
  """Greedy tokens and the logits that chose them, through models/llama.py's contiguous cache
  (prefill, then decode one token at a time), the request alone."""
  prefill, decode = _contiguous_steps()
  padded = np.zeros((1, CACHE_LENGTH), np.int32)
  padded[0, :len(prompt)] = prompt
  logits, cache = prefill(padded, np.array([len(prompt)], np.int32))  # a full-length cache
  tokens, chosen = [int(np.argmax(logits[0]))], [np.asarray(logits[0])]
  for i in range(count - 1):
    logits, cache = decode(np.array(tokens[-1:], np.int32),
                           np.array([len(prompt) + i], np.int32), cache)
    tokens.append(int(np.argmax(logits[0])))
    chosen.append(np.asarray(logits[0]))
  return tokens, np.stack(chosen)


def paged_greedy(engine, prompts, count, chunk=8, decode_rows=2):
  """The same through Engine.step: every request at once, pages from free lists shuffled so no
  request's pages are contiguous, each step one group of decoding rows (`decode_rows` per
  device block, idle ones included) beside one prompt chunk per device block."""
  ways, per_pool = engine.batch_ways, 48
  rng = np.random.default_rng(0)
  pools = [PagePool(per_pool, PAGE, prefix_caching=False) for _ in range(ways)]
  for pool in pools:
    pool.release([int(p) for p in rng.permutation(pool.allocate(per_pool))])
  cache = engine.new_cache(ways * per_pool)
  runs = [dict(shard=i % ways, prompt=p, done=0, tokens=[], logits=[],
               pages=pools[i % ways].allocate(-(-(len(p) + count) // PAGE)))
          for i, p in enumerate(prompts)]
  while any(len(r["tokens"]) < count for r in runs):
    decoding = [r for r in runs if r["done"] == len(r["prompt"]) and len(r["tokens"]) < count]
    chunks = {}
    for r in runs:
      if r["done"] < len(r["prompt"]):
        chunks.setdefault(r["shard"], r)
    work = lambda r, tokens, start: engine_lib.RowWork(r["shard"], np.asarray(tokens, np.int32),
                                                       start, r["pages"], SamplingParams(), 0)
    groups = [([work(r, r["tokens"][-1:], len(r["prompt"]) + len(r["tokens"]) - 1)
                for r in decoding], 1, decode_rows),
              ([work(r, r["prompt"][r["done"]:r["done"] + chunk], r["done"])
                for r in chunks.values()], chunk, 1)]
    cache, tokens, logits, order = engine.step(cache, groups)
    tokens, logits = np.asarray(tokens)[order], np.asarray(logits)[order]
    for r, token, row in zip(decoding + list(chunks.values()), tokens, logits):
      if r["done"] < len(r["prompt"]):
        r["done"] = min(len(r["prompt"]), r["done"] + chunk)
        if r["done"] < len(r["prompt"]):
          continue
      r["tokens"].append(int(token))
      r["logits"].append(row)
  return [r["tokens"] for r in runs], [np.stack(r["logits"]) for r in runs]


def test_paged_cache_equals_the_contiguous_cache_sharded_and_not(params, engine):
  prompts = [np.random.default_rng(i).integers(0, CFG.vocab_size, n).astype(np.int32)
             for i, n in enumerate([1, 40, 5, 23, 2, 31])]
  count = 8
  expected = [contiguous_greedy(p, count) for p in prompts]
  sharded = make_engine(params, "fsdp:4,tensor:2", "fsdp_tp", devices=8)
  # The pool is laid out by the rules: pages over fsdp (like the batch), kv_heads over tensor.
  assert sharded.cache_sharding.spec == jax.sharding.PartitionSpec(None, "tensor", "fsdp")
  for run, rows in ((engine, 8), (sharded, 2)):
    traced = set(run.traces)
    tokens, logits = paged_greedy(run, prompts, count, decode_rows=rows)
    assert tokens == [t for t, _ in expected]
    for (_, want), got in zip(expected, logits):
      np.testing.assert_allclose(got, want, **CACHE_TOLERANCE)
    # One compiled step: decode rows beside a prompt chunk, whatever the lengths.
    assert len(set(run.traces) - traced) <= 1


def _run_batcher(batcher, requests, limit=10_000):
  results = {}
  for i, (prompt, settings) in enumerate(requests):
    batcher.submit(engine_lib.Request(prompt, settings, lambda r: results.__setitem__(r.tag, r),
                                      tag=i))
  steps = 0
  while batcher.step():
    steps += 1
    assert steps < limit
  return [results[i] for i in range(len(requests))]


def test_prefix_cache_returns_what_a_cold_run_returns_and_frees_every_page(engine):
  shared = np.arange(50, 63, dtype=np.int32)  # 13 tokens: 3 full pages of 4
  prompts = [np.concatenate([shared, np.array(tail, np.int32)])
             for tail in ([1], [2, 3, 4, 5, 6], [7] * 9)] + [shared[:9]]
  settings = [SamplingParams(max_tokens=6), SamplingParams(max_tokens=5, temperature=1.0, seed=3),
              SamplingParams(max_tokens=4, top_k=5, temperature=0.7, seed=1),
              SamplingParams(max_tokens=6)]
  cold = engine_lib.generate(engine, prompts, settings, batch_size=4, cache_pages=POOL,
                             prefix_caching=False)
  batcher = engine_lib.Batcher(engine, batch_size=4, cache_pages=POOL)
  first = _run_batcher(batcher, [(prompts[0], settings[0])])  # caches the shared pages
  warm = first + _run_batcher(batcher, list(zip(prompts[1:], settings[1:])))
  assert [r.tokens for r in warm] == [r.tokens for r in cold]
  # Requests 1-2 reused the 3 shared pages (12 tokens), request 3 the first 2 (its 9 tokens
  # leave one to run).
  assert batcher.counters["prefix_cached_tokens"] == 12 + 12 + 8
  stats = batcher.page_stats()
  assert stats["in_use"] == 0 and stats["available"] == stats["total"] and stats["cached_idle"] > 0


def test_a_thousand_requests_leave_no_page_behind(engine):
  """Tiny requests (1-6 prompt tokens from a few shared openings, 1-2 new tokens) through the
  pool: pages are reused, cached prefixes hit and get evicted, and at the end every page is
  free or an idle cached prefix."""
  rng = np.random.default_rng(0)
  openings = [rng.integers(0, CFG.vocab_size, 4).astype(np.int32) for _ in range(3)]
  requests = []
  for i in range(1000):
    tail = rng.integers(0, CFG.vocab_size, int(rng.integers(0, 3))).astype(np.int32)
    prompt = np.concatenate([openings[i % 3][:int(rng.integers(1, 5))], tail])
    requests.append((prompt, SamplingParams(max_tokens=int(rng.integers(1, 3)))))
  batcher = engine_lib.Batcher(engine, batch_size=4, cache_pages=POOL)
  results = _run_batcher(batcher, requests)
  assert all(r.finish_reason == "length" for r in results)
  stats = batcher.page_stats()
  assert stats["in_use"] == 0 and stats["available"] == stats["total"] == POOL
  pool, = batcher.pools
  assert pool.hits > 100 and pool.evictions > 100 and sorted(pool.refs) == [0] * POOL


def test_chunked_prefill_changes_no_token_and_keeps_the_batch_decoding(engine):
  rng = np.random.default_rng(5)
  prompts = [rng.integers(0, CFG.vocab_size, n).astype(np.int32) for n in (3, 45, 20)]
  counts = (12, 8, 10)
  chunked = engine_lib.generate(engine, prompts, [SamplingParams(max_tokens=n) for n in counts],
                                batch_size=4, cache_pages=POOL, prefill_chunk=16)
  assert [r.tokens for r in chunked] == [contiguous_greedy(p, n)[0]
                                         for p, n in zip(prompts, counts)]
  # A running request gets a token at every step while a 45-token prompt is prefilled in
  # chunks of 16 beside it (3 steps): nothing stalls it.
  batcher = engine_lib.Batcher(engine, batch_size=4, cache_pages=POOL, prefill_chunk=16)
  streamed = []
  batcher.submit(engine_lib.Request(prompts[0], SamplingParams(max_tokens=12),
                                    on_token=streamed.append))
  batcher.step()
  batcher.submit(engine_lib.Request(prompts[1], SamplingParams(max_tokens=8)))
  for step in range(3):
    before = len(streamed)
    batcher.step()
    assert len(streamed) == before + 1, f"step {step}"
  assert batcher.counters["prefill_tokens"] == 3 + 45


def test_a_cancelled_request_frees_its_place_within_two_steps(engine):
  batcher = engine_lib.Batcher(engine, batch_size=2, cache_pages=POOL)
  results, streamed = [], []
  running = engine_lib.Request(np.arange(7, dtype=np.int32), SamplingParams(max_tokens=40),
                               results.append, on_token=streamed.append)
  waiting = engine_lib.Request(np.arange(3, dtype=np.int32), SamplingParams(max_tokens=5),
                               results.append)
  batcher.submit(running)
  while len(streamed) < 3:
    batcher.step()
  batcher.cancel(waiting)  # before it is ever submitted: answered when it would be admitted
  batcher.submit(waiting)
  batcher.cancel(running)
  steps = 0
  while len(results) < 2:
    batcher.step()
    steps += 1
  assert steps <= 2 and batcher.active == 0
  assert [r.finish_reason for r in results] == ["cancelled", "cancelled"]
  assert results[0].tokens == streamed and len(streamed) >= 3 and results[1].tokens == []
  assert batcher.counters["requests_cancelled"] == 2
  assert batcher.page_stats()["in_use"] == 0


def test_the_decode_batch_follows_the_running_requests(engine, monkeypatch):
  """With 8 places and 3 requests running, each step computes 4 decode rows, not 8."""
  shapes = []
  real_step = engine.step

  def recording(cache, groups):
    shapes.append(tuple((chunk, rows) for _, chunk, rows in groups))
    return real_step(cache, groups)

  monkeypatch.setattr(engine, "step", recording)
  prompts = [np.arange(n, dtype=np.int32) for n in (2, 3, 4)]
  settings = [SamplingParams(max_tokens=n) for n in (3, 6, 9)]
  batcher = engine_lib.Batcher(engine, batch_size=8, cache_pages=POOL)
  results = _run_batcher(batcher, list(zip(prompts, settings)))
  assert [len(r.tokens) for r in results] == [3, 6, 9]
  decode_rows = [rows for shape in shapes for chunk, rows in shape if chunk == 1]
  assert decode_rows[0] == 4 and decode_rows[-1] == 1 and max(decode_rows) == 4
