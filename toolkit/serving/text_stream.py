"""Text of a request's tokens as they come, with stop strings: what the OpenAI routes stream.

A token does not always end on a character: a byte-level model emits the bytes of one
character one token at a time, and a tokenizer's byte fallback does the same. The text decoded
so far then ends in U+FFFD (the replacement character for an unfinished sequence), which the
next token may turn into a real character; such a tail is held back until it settles or the
request ends. With stop strings, the last (longest stop string - 1) characters are held back
too: they may be the start of a stop string that the next token completes. Once a stop string
appears, the text ends just before it (the stop string itself is never shown) and the stream is
`stopped`: the caller cancels the request in the engine.

The pieces a stream returns, joined, are the request's whole text, streamed or not (the server
builds both from this class), and equal the codec's decode of the tokens whenever that decode
only ever appends to the text as tokens are added (byte-level text always does).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

REPLACEMENT = "\ufffd"


class TextStream:
  """Incremental text of one request. `add` takes new token ids and returns the text that is
  now safe to show; `finish` returns what was held back once the request has ended."""

  def __init__(self, decode: Callable[[list[int]], str], stop: Sequence[str] = ()):
    self._decode = decode
    self._stop = tuple(stop)
    self._hold = max((len(s) for s in self._stop), default=1) - 1
    self.tokens: list[int] = []  # every token added until a stop string appeared
    self._text = ""               # the decode of `tokens`, cut before a stop string if any
    self.shown = 0                # characters of `_text` already returned
    self.stopped = False          # a stop string appeared: no more text will come

  @property
  def text(self) -> str:
    """The text returned so far."""
    return self._text[:self.shown]

  def add(self, tokens: Sequence[int]) -> str:
    """Appends `tokens` (ignored once stopped); returns the new text safe to show."""
    if self.stopped or not tokens:
      return ""
    self.tokens.extend(int(t) for t in tokens)
    self._text = self._decode(self.tokens)
    # A stop string that ends in the new text starts at most (longest - 1) characters before
    # it: everything earlier was searched when it was shown.
    start = max(0, self.shown - self._hold)
    found = [i for i in (self._text.find(s, start) for s in self._stop) if i >= 0]
    if found:
      self._text = self._text[:min(found)]
      self.stopped = True
      return self._take(len(self._text))
    safe = len(self._text.rstrip(REPLACEMENT)) - self._hold
    return self._take(safe)

  def finish(self) -> str:
    """The held-back rest, once no more tokens will come."""
    return self._take(len(self._text))

  def _take(self, end: int) -> str:
    if end <= self.shown:
      return ""
    piece, self.shown = self._text[self.shown:end], end
    return piece
