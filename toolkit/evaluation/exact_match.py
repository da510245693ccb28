"""Held-out exact match of a chat model: each held-out conversation's last assistant turn is
generated greedily through the KV-cache engine from the turns before it, rendered with the
generation prompt, and compared with the data's answer as text
(`python scripts/dev/chat_exact_match.py` prints it).
"""
from __future__ import annotations

import dataclasses

import jax
import numpy as np

from toolkit import hf, training
from toolkit.data import chat, instruct
from toolkit.inference import engine as engine_lib, text
from toolkit.inference.sampling import SamplingParams
from toolkit.training import init_from, state as state_lib

# Requests decoded together: every one of a round gets the same max_tokens and no stop token,
# so a round prefills and decodes one shape each (two compiles in all); the answer is the
# output up to the template's end-of-turn token.
BATCH_SIZE = 64


@dataclasses.dataclass(frozen=True)
class Score:
  correct: int
  total: int
  outputs: list[tuple[str, str]]  # (generated, expected)

  @property
  def accuracy(self) -> float:
    return self.correct / self.total

  def format(self, show: int = 3) -> str:
    lines = [f"exact match: {self.accuracy:.1%} ({self.correct} of {self.total})"]
    lines += [f"  {got!r} (expected {want!r})" for got, want in self.outputs[:show]]
    return "\n".join(lines)


def score(config, params, model_cfg, batch_size: int = BATCH_SIZE) -> Score:
  """Exact match of `params` (a `model_cfg` LM) on `config`'s held-out conversations, on this
  process's first device."""
  d = config.data
  chat.check_config(d)
  tokenizer = chat.ChatTokenizer.load(chat.tokenizer_path(d, config.train.get("init_from", "")),
                                      d.chat_template)
  _, conversations, _ = chat.split_conversations(d)
  prompts, answers = zip(*(instruct.prompt_and_answer(c.messages) for c in conversations))
  ids = [tokenizer.encode_prompt(p) for p in prompts]
  stop = tokenizer.end_of_turn()
  # Room for the longest answer and its end of turn, within the cache.
  longest = max(len(tokenizer.token_ids(a)[0]) for a in answers) + 1
  window = max(len(i) for i in ids) + longest
  engine = text.one_device_engine(model_cfg, params, window)
  results = engine_lib.generate(engine, ids, [SamplingParams(max_tokens=longest)] * len(ids),
                                min(batch_size, len(ids)))
  outputs = []
  for result, answer in zip(results, answers):
    tokens = np.asarray(result.tokens, np.int64)
    end = np.flatnonzero(tokens == stop)
    outputs.append((tokenizer.decode(tokens[:end[0]] if end.size else tokens), answer))
  return Score(sum(got == want for got, want in outputs), len(outputs), outputs)


def initial_params(config, devices):
  """(params, model config) the config starts from, as training starts: train.init_from's
  folder (with LoRA, its adapters fresh beside it), else fresh weights from the seed."""
  setup = training.build(config, devices)
  folder = init_from.parse(config.train.get("init_from", ""))
  if folder is None:
    state = state_lib.create(setup.spec.model, setup.optimizer, setup.layout, config.seed)
  else:
    state = init_from.initial_state(hf.HFFolder(folder, init_from.FIELD), setup, config.seed)
  return jax.device_get(state["params"]), setup.spec.model
