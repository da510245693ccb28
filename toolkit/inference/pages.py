"""The paged KV cache's bookkeeping on the host: which pages are free, which hold a cached
prompt prefix, and how many running requests read each one.

A `PagePool` owns page ids 0..pages-1 of one block of the device cache (models/paged.py: each
device that splits the batch holds its own block, and a request's pages all come from the
block of the device its rows run on). A page is in exactly one of three states:

  free       on the free list, content meaningless
  in use     referenced by >= 1 running request (`refs[page]` counts them)
  cached     referenced by none, but holding a full page of some prompt prefix that a later
             request may reuse; evicted least recently used when the free list runs dry

Prefix caching (vLLM's automatic prefix caching): page i of a prompt is keyed by a chain
hash of every token in pages 0..i, so equal keys mean equal prefixes, not only equal pages.
Keys are Python hashes of (parent key, the page's token ids); an entry also stores its parent
key and tokens, and a lookup compares them, so a hash collision is a miss, never a wrong hit.
Only full pages of prompt tokens are cached; a request registers its pages once they hold
their keys and values (after its prefill), and a key already cached is not registered twice.

`available()` (free + cached) is what admission may use; with no request running it is back
to `pages`: tests/toolkit/inference/test_pages.py checks that after 1,000 requests.
"""
from __future__ import annotations

import collections
import dataclasses
from collections.abc import Sequence


@dataclasses.dataclass(frozen=True)
class _Entry:
  key: int
  parent: int
  tokens: tuple[int, ...]


class PagePool:
  """Free list, reference counts and prefix cache for `pages` pages of `page_size` tokens.
  Not thread-safe: the batcher's thread owns it."""

  def __init__(self, pages: int, page_size: int, prefix_caching: bool = True):
    if pages < 1 or page_size < 1:
      raise ValueError(f"a page pool needs pages >= 1 and page_size >= 1, not {pages}, "
                       f"{page_size}")
    self.pages, self.page_size, self.prefix_caching = pages, page_size, prefix_caching
    self._free: collections.deque[int] = collections.deque(range(pages))
    self.refs = [0] * pages
    self._by_key: dict[int, int] = {}                 # chain key -> page
    self._entry: dict[int, _Entry] = {}               # page -> its cache entry
    # Cached pages no request reads, least recently used first: eviction takes from the front.
    self._idle: collections.OrderedDict[int, None] = collections.OrderedDict()
    self.hits = self.misses = self.evictions = 0

  # --- capacity -------------------------------------------------------------------------------
  def available(self) -> int:
    """Pages an admission may take: free ones plus cached ones no request reads."""
    return len(self._free) + len(self._idle)

  def in_use(self) -> int:
    return self.pages - self.available()

  def cached(self) -> int:
    """Pages holding a cached prefix, read by running requests or not."""
    return len(self._entry)

  def cached_idle(self) -> int:
    """Cached pages no running request reads (evictable)."""
    return len(self._idle)

  # --- prefixes -------------------------------------------------------------------------------
  @staticmethod
  def chain_keys(tokens: Sequence[int], page_size: int,
                 full_pages: int) -> list[tuple[int, int, tuple]]:
    """(key, parent key, page tokens) of the first `full_pages` pages of `tokens`."""
    keys, parent = [], 0
    for i in range(full_pages):
      page = tuple(int(t) for t in tokens[i * page_size:(i + 1) * page_size])
      key = hash((parent, page))
      keys.append((key, parent, page))
      parent = key
    return keys

  def lookup(self, tokens: Sequence[int]) -> list[int]:
    """The cached pages holding the longest prefix of `tokens` in whole pages, leaving at least
    one token uncached (the model must run it to predict the next one). Takes a reference on
    each: the caller owns them until `release`."""
    pages = self.match(tokens)
    for page in pages:
      self._take(page)
    self.hits += len(pages)
    return pages

  def match(self, tokens: Sequence[int]) -> list[int]:
    """The pages `lookup` would return, without taking them."""
    if not self.prefix_caching:
      return []
    pages = []
    for key, parent, page_tokens in self.chain_keys(tokens, self.page_size,
                                                    (len(tokens) - 1) // self.page_size):
      page = self._by_key.get(key)
      entry = self._entry.get(page) if page is not None else None
      if entry is None or entry.parent != parent or entry.tokens != page_tokens:
        break
      pages.append(page)
    return pages

  def register(self, tokens: Sequence[int], pages: Sequence[int]) -> None:
    """Offers the full prompt pages of a request (`pages[i]` holds tokens of page i) to the
    cache, once their keys and values are written. Keys already cached stay as they are."""
    if not self.prefix_caching:
      return
    full = min(len(pages), len(tokens) // self.page_size)
    for i, (key, parent, page_tokens) in enumerate(self.chain_keys(tokens, self.page_size, full)):
      page = pages[i]
      if page in self._entry:
        continue  # a cached page this request reused
      if key in self._by_key:
        self.misses += 1  # prefilled twice (the same prefix ran concurrently): keep the first
        continue
      self._by_key[key] = page
      self._entry[page] = _Entry(key, parent, page_tokens)

  # --- pages ----------------------------------------------------------------------------------
  def allocate(self, count: int) -> list[int]:
    """`count` pages for a request (reference 1 each): free ones first, then the least
    recently used cached ones, evicted. Raises ValueError when fewer are available."""
    if count > self.available():
      raise ValueError(f"{count} pages asked, {self.available()} available")
    pages = []
    for _ in range(count):
      if self._free:
        page = self._free.popleft()
      else:
        page, _ = self._idle.popitem(last=False)
        entry = self._entry.pop(page)
        del self._by_key[entry.key]
        self.evictions += 1
      self.refs[page] = 1
      pages.append(page)
    return pages

  def release(self, pages: Sequence[int]) -> None:
    """Drops one reference on each page: a page no request reads goes back to the free list,
    or, holding a cached prefix, to the most recently used end of the cache."""
    for page in pages:
      if self.refs[page] <= 0:
        raise ValueError(f"page {page} released more often than taken")
      self.refs[page] -= 1
      if self.refs[page]:
        continue
      if page in self._entry:
        self._idle[page] = None
      else:
        self._free.append(page)

  def _take(self, page: int) -> None:
    if self.refs[page] == 0:
      self._idle.pop(page, None)
    self.refs[page] += 1
