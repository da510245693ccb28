"""Byte-level LM batches placed as global arrays sharded along `batch`.

The text is CPython's own documentation (`pydoc_data.topics`, ~466 kB of English that ships
with every Python), so the demo needs no download. Which windows make up global batch number
`s` depends only on (seed, s) — never on the process count — and each process builds only
the rows its devices hold.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np
from jax.sharding import NamedSharding

from toolkit.data.feed import Batch, BatchIterator, Position, local_rows, step_iterator
from toolkit.errors import ConfigError


@functools.cache
def stdlib_docs_bytes() -> np.ndarray:
  """The CPython documentation topics as one uint8 array (deterministic order)."""
  from pydoc_data import topics  # pylint: disable=g-import-not-at-top
  text = "\n\n".join(topics.topics[key] for key in sorted(topics.topics))
  return np.frombuffer(text.encode("utf-8"), dtype=np.uint8)


def encode(text: str) -> np.ndarray:
  return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)


def jsonl_lines(path: str):
  """Yields (where, line) for each non-blank line of a JSONL file, `where` being "PATH line N"
  for error messages; a line that is not UTF-8 is a ConfigError naming it."""
  with open(path, "rb") as f:
    for number, raw in enumerate(f, 1):
      where = f"{path} line {number}"
      try:
        line = raw.decode("utf-8")
      except UnicodeDecodeError as e:
        raise ConfigError(f"{where} is not UTF-8 ({e.reason} at byte {e.start}); save the "
                          f"file as UTF-8") from None
      if line.strip():  # without its line break: a JSON error's column is then on this line
        yield where, line.rstrip("\r\n")


def json_problem(line: str, error) -> str:
  """Where a JSONL line's json.JSONDecodeError `error` is, for a message: its column, and that
  it is the line's end (a closing brace or quote left out) when it is."""
  end = " (the end of the line: a closing brace or quote missing?)" if error.pos >= len(
      line.rstrip()) else ""
  return f"{error.msg} at column {error.colno}{end}"


def utf8_problem(text: str) -> str | None:
  """Why `text` has no UTF-8 encoding, or None. Python strings can hold lone surrogates: an
  unpaired "\\ud800" escape in JSON, or (U+DC80..U+DCFF) a byte that was not UTF-8 on the
  command line."""
  try:
    text.encode("utf-8")
    return None
  except UnicodeEncodeError as e:
    code = ord(text[e.start])
    if 0xDC80 <= code <= 0xDCFF:
      return f"byte 0x{code - 0xDC00:02x} at character {e.start} is not UTF-8"
    return f"lone surrogate U+{code:04X} at character {e.start}"


def decode(tokens) -> str:
  return bytes(int(t) for t in tokens if 0 <= int(t) < 256).decode("utf-8", errors="replace")


@dataclasses.dataclass(frozen=True)
class TokenSource:
  """A token stream split into train and held-out parts."""
  train: np.ndarray
  held_out: np.ndarray
  vocab_size: int
  synthetic: bool = False

  @classmethod
  def from_config(cls, data_config, vocab_size: int) -> TokenSource:
    if data_config.source == "synthetic":
      return cls(np.zeros(0, np.int32), np.zeros(0, np.int32), vocab_size, synthetic=True)
    tokens = stdlib_docs_bytes()
    split = int(len(tokens) * (1 - data_config.eval_fraction))
    return cls(tokens[:split], tokens[split:], 256)

  def windows(self, tokens: np.ndarray, starts: np.ndarray, seq_len: int) -> np.ndarray:
    """(len(starts), seq_len + 1) int32 windows of `tokens`."""
    offsets = starts[:, None] + np.arange(seq_len + 1)[None, :]
    return tokens[offsets].astype(np.int32)


def _rows_for_step(seed: int, step: int, global_batch: int, limit: int) -> np.ndarray:
  rng = np.random.default_rng([seed, step])
  return rng.integers(0, limit, size=global_batch)


class Batches:
  """Training and eval batches for one run. `batch(step)` is a pure function of (seed, step)."""

  def __init__(self, source: TokenSource, seed: int, seq_len: int, global_batch_size: int,
               eval_batches: int, sharding: NamedSharding):
    self.source, self.seed, self.seq_len = source, seed, seq_len
    self.global_batch_size, self.eval_batches = global_batch_size, eval_batches
    self.sharding = sharding
    self.shape = (global_batch_size, seq_len)
    self.rows = local_rows(sharding, self.shape)

  def _windows(self, step: int, tokens: np.ndarray, salt: int) -> np.ndarray:
    if self.source.synthetic:
      rng = np.random.default_rng([self.seed, salt, step])
      full = rng.integers(0, self.source.vocab_size, size=(self.global_batch_size,
                                                           self.seq_len + 1))
      return full[self.rows].astype(np.int32)
    starts = _rows_for_step(self.seed + salt, step, self.global_batch_size,
                            len(tokens) - self.seq_len - 1)
    return self.source.windows(tokens, starts[self.rows], self.seq_len)

  def _place(self, windows: np.ndarray) -> Batch:
    make = lambda x: jax.make_array_from_process_local_data(self.sharding, x, self.shape)
    # A deliberate transfer, so allowed under the loop's transfer guard; with several
    # processes JAX places the rows shard by shard, which the guard would count as implicit.
    with jax.transfer_guard_host_to_device("allow"):
      return {"inputs": make(windows[:, :-1]), "targets": make(windows[:, 1:])}

  def batch(self, step: int) -> Batch:
    """The global batch for training step `step` (0-based)."""
    return self.place(self.host_batch(step))

  def host_batch(self, step: int) -> np.ndarray:
    """This process's rows of batch `step`, (rows, seq_len + 1) windows on the host; the
    iterator's prefetch thread prepares them ahead of the step."""
    return self._windows(step, self.source.train, salt=0)

  def place(self, windows: np.ndarray) -> Batch:
    return self._place(windows)

  def eval_batch(self, index: int) -> Batch:
    """Held-out batch `index`; the same windows at every evaluation."""
    return self._place(self._windows(index, self.source.held_out, salt=1))

  def iterator(self, start_step: int, position: Position | None = None,
               prefetch: int = 2) -> BatchIterator:
    """Batches from `start_step` on, `prefetch` of them prepared ahead in a thread. A batch is
    a pure function of the step, so the saved `position` holds nothing more than the step."""
    del position
    return step_iterator(self.host_batch, self.place, start_step, prefetch)

  def abstract(self) -> Batch:
    spec = jax.ShapeDtypeStruct(self.shape, np.int32, sharding=self.sharding)
    return {"inputs": spec, "targets": spec}
