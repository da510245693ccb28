"""The scheduler's admission by pages (toolkit/inference/scheduler.py) against a stand-in
engine that runs no model: how many requests a fixed cache budget holds paged against
contiguous, waiting in order, the rows per device block. No JAX compiles: milliseconds."""
import pathlib

import numpy as np
import pytest

from toolkit.inference.scheduler import Batcher, Request
from toolkit.inference.sampling import RequestError, SamplingParams

# docs/inference.md: the random-length workload (prompts of 32-512 tokens, 32-256 new tokens),
# a cache of --cache_length=2304 (a 2,048-token prompt and 256 new tokens fit) and the memory
# of 16 such requests. The contiguous cache holds 16 of them; the paged one (pages of 16)
# holds CAPACITY_PAGED.
CACHE_LENGTH, SLOTS, CAPACITY_PAGED = 2304, 16, 83


class FakeEngine:
  """What the Batcher asks of an engine, on one device; every step samples token 1."""
  batch_ways = 1

  def __init__(self, cache_length: int, page_size: int):
    self.cache_length, self.page_size = cache_length, page_size
    self.pages_per_row = -(-cache_length // page_size)
    self.groups = []

  def check_batch_size(self, batch_size):
    assert batch_size >= 1

  def check_request(self, prompt, params):
    if len(prompt) + params.max_tokens > self.cache_length:
      raise RequestError("too long")

  def new_cache(self, pages):
    return None

  def prompt_bucket(self, length):
    return min(self.cache_length, max(16, 1 << (length - 1).bit_length()))

  def step(self, cache, groups):
    self.groups.append([(len(items), chunk, rows) for items, chunk, rows in groups])
    count = sum(len(items) for items, _, _ in groups)
    return cache, np.ones(count, np.int32), None, np.arange(count)


def random_length_workload(count: int, seed: int = 0):
  rng = np.random.default_rng(seed)
  return [Request(np.ones(int(rng.integers(32, 513)), np.int32),
                  SamplingParams(max_tokens=int(rng.integers(32, 257)))) for _ in range(count)]


def _running_after_admission(page_size: int) -> int:
  engine = FakeEngine(CACHE_LENGTH, page_size)
  batcher = Batcher(engine, batch_size=512, cache_pages=SLOTS * CACHE_LENGTH // page_size)
  for request in random_length_workload(300):
    batcher.submit(request)
  batcher.step()
  return batcher.active


def test_a_paged_cache_holds_over_three_times_the_requests_of_a_contiguous_one():
  # One page of cache_length per request is the contiguous cache's layout.
  contiguous, paged = _running_after_admission(CACHE_LENGTH), _running_after_admission(16)
  assert contiguous == SLOTS
  assert paged == CAPACITY_PAGED and paged >= 3 * contiguous
  docs = " ".join((pathlib.Path(__file__).parents[3] / "docs/inference.md").read_text().split())
  assert (f"holds {CAPACITY_PAGED} requests at once in pages of 16 against the contiguous "
          f"cache's {SLOTS}: {paged / contiguous:.1f}x") in docs


def test_requests_wait_in_order_for_pages_and_take_them_when_freed():
  engine = FakeEngine(64, 4)
  batcher = Batcher(engine, batch_size=8, cache_pages=16)  # room for 64 positions
  sizes = [(40, 8), (60, 4), (2, 2)]  # 12, 16 and 1 pages
  done = []
  for prompt, new in sizes:
    batcher.submit(Request(np.ones(prompt, np.int32), SamplingParams(max_tokens=new),
                           lambda r: done.append(r.prompt_tokens)))
  batcher.step()
  # The second needs 16 pages, 4 are free: it waits, and the small third does not overtake it.
  assert batcher.active == 1 and batcher.page_stats()["in_use"] == 12
  while batcher.step():
    pass
  assert done == [40, 60, 2] and batcher.page_stats()["available"] == 16


def test_chunked_prefill_runs_one_prompt_chunk_beside_the_decoding_rows():
  engine = FakeEngine(256, 16)
  batcher = Batcher(engine, batch_size=16, prefill_chunk=32)
  for prompt in (5, 100, 70):
    batcher.submit(Request(np.ones(prompt, np.int32), SamplingParams(max_tokens=50)))
  for _ in range(6):
    batcher.step()
  # (rows, tokens per row, rows per device) of each step's groups: the oldest prompt's chunk
  # first (5 tokens, bucket 16), then the 100-token prompt in chunks of 32 beside 1 decoding
  # row, then the 70-token one beside 2.
  assert engine.groups == [[(1, 16, 1)], [(1, 1, 1), (1, 32, 1)], [(1, 1, 1), (1, 32, 1)],
                           [(1, 1, 1), (1, 32, 1)], [(1, 1, 1), (1, 16, 1)],
                           [(2, 1, 2), (1, 32, 1)]]
  with pytest.raises(RequestError, match=r"cache_pages=3 must be a multiple of 1 \(the ways the "
                     r"mesh splits the batch\) with at least 16 pages per way"):
    Batcher(engine, batch_size=1, cache_pages=3)
  with pytest.raises(RequestError, match="prefill_chunk=-1 must be >= 0"):
    Batcher(engine, batch_size=1, prefill_chunk=-1)
