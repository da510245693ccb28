"""Synthetic instruction tasks whose answers can be checked exactly: chat data that needs no
download, for the fine-tuning result of experiments/sft.py and the tests.

`data.path="synthetic:NAME"` (data.source="chat") reads task NAME: TRAIN conversations to
train on (`synthetic:NAME:COUNT`: COUNT of them) and a held-out split of HELD_OUT more, each a
user turn with the instruction and an assistant turn with its one right answer. The held-out
instructions never occur in the training split, so a model that answers them has learnt the
task, not the examples.

  repeat    "repeat kqzvd" -> "kqzvd": five random lowercase letters, as they are
  upper     "upper kqzvd" -> "KQZVD": the same in capitals
  reverse   "reverse kqzvd" -> "dvzqk": the same, reversed
  add       "add 47 85" -> "132": two numbers below 100, their sum
"""
from __future__ import annotations

import functools
from collections.abc import Callable

import numpy as np

from toolkit.errors import ConfigError

PREFIX = "synthetic:"
TRAIN, HELD_OUT = 8192, 256
Messages = list[dict[str, str]]


WORD_LETTERS = 5


def _word(rng: np.random.Generator) -> str:
  letters = rng.integers(ord("a"), ord("z") + 1, size=WORD_LETTERS)
  return bytes(letters.astype(np.uint8)).decode("ascii")


def _reverse(rng: np.random.Generator) -> tuple[str, str]:
  word = _word(rng)
  return f"reverse {word}", word[::-1]


def _repeat(rng: np.random.Generator) -> tuple[str, str]:
  word = _word(rng)
  return f"repeat {word}", word


def _upper(rng: np.random.Generator) -> tuple[str, str]:
  word = _word(rng)
  return f"upper {word}", word.upper()


def _add(rng: np.random.Generator) -> tuple[str, str]:
  a, b = (int(x) for x in rng.integers(0, 100, size=2))
  return f"add {a} {b}", str(a + b)


TASKS: dict[str, Callable[[np.random.Generator], tuple[str, str]]] = {
    "reverse": _reverse, "repeat": _repeat, "upper": _upper, "add": _add}


def parse(path: str) -> tuple[str, int] | None:
  """(task, training conversations) of a `synthetic:NAME[:COUNT]` data path, None for a file
  path; ConfigError for an unknown NAME or a bad COUNT."""
  if not path.startswith(PREFIX):
    return None
  name, _, count = path[len(PREFIX):].partition(":")
  if name not in TASKS:
    raise ConfigError(f"data.path={path!r}: no synthetic task {name!r}; choose one of "
                      f"{', '.join(PREFIX + t for t in TASKS)}")
  if count and not (count.isdigit() and 1 <= int(count) <= TRAIN):
    raise ConfigError(f"data.path={path!r}: {count!r} is not a count of training "
                      f"conversations in [1, {TRAIN}]; give e.g. {PREFIX}{name}:512")
  return name, int(count) if count else TRAIN


@functools.cache
def _instructions(name: str) -> tuple[tuple[tuple[str, str], ...], tuple[tuple[str, str], ...]]:
  """(training, held-out) (instruction, answer) pairs of task `name`: distinct instructions
  from one seeded stream, the first HELD_OUT held out."""
  rng = np.random.default_rng([sorted(TASKS).index(name), 2026])
  seen: dict[str, str] = {}
  # `add` has 10,000 distinct instructions: its training split repeats some once they run out.
  limit = 50 * (TRAIN + HELD_OUT)
  draws = 0
  while len(seen) < TRAIN + HELD_OUT and draws < limit:
    instruction, answer = TASKS[name](rng)
    seen.setdefault(instruction, answer)
    draws += 1
  pairs = list(seen.items())
  held_out, train = pairs[:HELD_OUT], pairs[HELD_OUT:]
  train = [train[i % len(train)] for i in range(TRAIN)]
  return tuple(train), tuple(held_out)


def conversations(name: str, split: str, count: int = TRAIN) -> list[Messages]:
  """The conversations of task `name`'s "train" split (its first `count`) or "held_out"."""
  train, held_out = _instructions(name)
  pairs = train[:count] if split == "train" else held_out
  return [[{"role": "user", "content": instruction}, {"role": "assistant", "content": answer}]
          for instruction, answer in pairs]


def prompt_and_answer(messages: Messages) -> tuple[Messages, str]:
  """A conversation split into what the model is given (every turn before the last) and the
  last assistant turn's content, which an exact-match score compares the output with."""
  if not messages or messages[-1].get("role") != "assistant":
    raise ValueError("the conversation does not end with an assistant turn")
  return messages[:-1], messages[-1]["content"]
