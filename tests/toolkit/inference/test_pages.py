"""The paged cache's host bookkeeping (toolkit/inference/pages.py): free list, reference counts,
the prefix cache's chain keys and its least-recently-used eviction. Pure Python, no JAX."""
import random

import pytest

from toolkit.inference.pages import PagePool


def test_pages_are_allocated_released_and_never_lost():
  pool = PagePool(8, page_size=4)
  first = pool.allocate(3)
  second = pool.allocate(5)
  assert sorted(first + second) == list(range(8)) and pool.available() == 0
  with pytest.raises(ValueError, match="1 pages asked, 0 available"):
    pool.allocate(1)
  pool.release(first)
  assert pool.available() == 3
  with pytest.raises(ValueError, match="released more often than taken"):
    pool.release(first[:1])
  pool.release(second)
  assert pool.available() == 8 and pool.in_use() == 0


def test_a_cached_prefix_is_shared_counted_and_evicted_least_recently_used():
  pool = PagePool(6, page_size=4)
  a = list(range(100, 110))                     # 10 tokens: 2 full pages + 2 tokens
  pages_a = pool.allocate(3)
  pool.register(a, pages_a)
  assert pool.cached() == 2                     # only full pages of the prompt
  # Another request with the same first 9 tokens reuses both full pages while `a` still runs.
  b = a[:9] + [7, 7, 7]
  hit = pool.lookup(b)
  assert hit == pages_a[:2] and pool.refs[pages_a[0]] == 2
  pool.release(pages_a)
  pool.release(hit)
  # Nothing runs: the cached pages are idle but count as available, and hold their prefix.
  assert pool.available() == 6 and pool.cached_idle() == 2
  # A prompt of exactly two pages reuses only the first: its last token must run.
  assert pool.match(a[:8]) == pages_a[:1]
  # A different second page: the chain key differs even though page 0 matches.
  assert pool.match(a[:4] + [1, 2, 3, 4, 5]) == pages_a[:1]
  # Allocating everything evicts the cached pages, the least recently used first.
  pool.allocate(4)                              # the 4 free pages
  evicted = pool.allocate(1)
  assert evicted == [pages_a[0]] and pool.evictions == 1
  assert pool.match(a) == []                     # page 0 gone: the chain is broken


def test_prefix_caching_off_caches_nothing():
  pool = PagePool(4, page_size=2, prefix_caching=False)
  pages = pool.allocate(2)
  pool.register([1, 2, 3, 4], pages)
  pool.release(pages)
  assert pool.cached() == 0 and pool.lookup([1, 2, 3, 4, 5]) == [] and pool.available() == 4


def test_a_hash_collision_is_a_miss_not_a_wrong_hit(monkeypatch):
  # Every page hashes alike: the stored tokens tell the prefixes apart.
  monkeypatch.setattr(PagePool, "chain_keys", staticmethod(
      lambda tokens, size, full: [(42, 0, tuple(tokens[i * size:(i + 1) * size]))
                                  for i in range(full)]))
  pool = PagePool(4, page_size=2)
  pages = pool.allocate(2)
  pool.register([1, 2, 3, 4], pages)
  assert pool.cached() == 1  # the second page's key was taken: not cached twice
  assert pool.match([1, 2, 7]) == pages[:1]
  assert pool.match([9, 9, 3, 4, 5]) == []


def test_random_traffic_leaks_no_page():
  rng = random.Random(0)
  pool = PagePool(32, page_size=4)
  running = []
  for _ in range(2000):
    if running and (rng.random() < 0.5 or pool.available() < 8):
      tokens, pages = running.pop(rng.randrange(len(running)))
      pool.register(tokens, pages)
      pool.release(pages)
      continue
    tokens = [rng.randrange(3)] * 4 + [rng.randrange(50) for _ in range(rng.randrange(1, 20))]
    prefix = pool.lookup(tokens)
    need = -(-(len(tokens) + 4) // 4)
    running.append((tokens, prefix + pool.allocate(need - len(prefix))))
  for tokens, pages in running:
    pool.release(pages)
  assert pool.available() == 32 and pool.in_use() == 0 and pool.hits > 0
  assert sorted(pool.refs) == [0] * 32
