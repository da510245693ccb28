"""Prompts for reinforcement learning with verifiable rewards (GRPO, toolkit/post_training/
grpo.py): what the model is asked, and what its answer is checked against.

Records. JSONL files (one prompt per line) or Parquet (one per row), each
    {"prompt": "..." | [messages], "answer": <any JSON value>}
a string prompt one user turn, a list messages as in chat data (toolkit/data/chat.py); the
answer goes to the reward function as it is ("answer" may be left out when the reward needs
none). A record that is not such an object is one error naming the file and the line.
`synthetic:NAME[:COUNT]` reads a built-in task (toolkit/data/instruct.py): the prompt is the
instruction and the answer its one right answer.

Tokens. Each prompt is rendered by the chat template with the generation prompt and tokenized
(`ChatTokenizer.encode_prompt`): what the engine continues. A prompt longer than
`max_prompt_tokens` is left out and counted.

Order. `PromptOrder.indices(step)` gives the prompts of batch `step`: a pure function of
(seed, step), each epoch a new permutation of the training prompts.
"""
from __future__ import annotations

import dataclasses

import jax
import numpy as np
from jax.sharding import NamedSharding

from toolkit.data import chat, instruct, keys
from toolkit.data.chat_template import ChatTokenizer
from toolkit.errors import ConfigError

Messages = list[dict]
mask_key = keys.mask_key


@dataclasses.dataclass(frozen=True)
class Prompt:
  messages: Messages
  answer: object
  where: str  # "FILE line N", "FILE row N", "synthetic:NAME train #N"


def parse_record(record, where: str) -> Prompt:
  """The prompt of one JSON object (module docstring)."""
  if not isinstance(record, dict) or "prompt" not in record:
    keys = ", ".join(sorted(record)) if isinstance(record, dict) else "not an object"
    raise ConfigError(f"{where}: has no \"prompt\" ({keys}); give {{\"prompt\": ..., "
                      f"\"answer\": ...}}")
  value = record["prompt"]
  messages = ([{"role": "user", "content": value}] if isinstance(value, str)
              else chat.message_list(value, where, "prompt"))
  return Prompt(messages, record.get("answer"), where)


def read_prompts(spec: str, field: str = "data.path", split: str = "train") -> list[Prompt]:
  """Every prompt of `spec` (files, or `synthetic:NAME`'s `split`), in file order."""
  task = instruct.parse(spec)
  if task is not None:
    found = []
    for i, conversation in enumerate(instruct.conversations(task[0], split, task[1])):
      messages, answer = instruct.prompt_and_answer(conversation)
      found.append(Prompt(messages, answer, f"synthetic:{task[0]} {split} #{i}"))
    return found
  found = [parse_record(record, where) for path in chat.data_files(spec, field)
           for where, record in chat.records(path)]
  if not found:
    raise ConfigError(f"{field}={spec!r} holds no prompts")
  return found


@dataclasses.dataclass(frozen=True)
class Prompts:
  """Tokenized prompts of one split, with the records they come from."""
  name: str
  records: tuple[Prompt, ...]
  tokens: tuple[np.ndarray, ...]
  dropped: int = 0

  def __len__(self) -> int:
    return len(self.records)


def tokenize(records: list[Prompt], tokenizer: ChatTokenizer, max_prompt_tokens: int,
             name: str) -> Prompts:
  kept, tokens, dropped = [], [], 0
  for record in records:
    ids = tokenizer.encode_prompt(record.messages).astype(np.int32)
    if ids.size > max_prompt_tokens:
      dropped += 1
      continue
    kept.append(record)
    tokens.append(ids)
  if not kept:
    raise ConfigError(f"all {len(records)} prompts of {name} are longer than "
                      f"{max_prompt_tokens} tokens (data.seq_len - grpo.max_tokens); raise "
                      f"data.seq_len or lower grpo.max_tokens")
  return Prompts(name, tuple(kept), tuple(tokens), dropped)


@dataclasses.dataclass(frozen=True)
class PromptData:
  """A run's tokenized prompts, its tokenizer, and the lines the start-up log prints."""
  train: Prompts
  held_out: Prompts
  tokenizer: ChatTokenizer
  notes: tuple[str, ...]

  @classmethod
  def from_config(cls, data_config, max_prompt_tokens: int,
                  init_from: str = "") -> PromptData:
    d = data_config
    tokenizer = ChatTokenizer.load(chat.tokenizer_path(d, init_from), d.chat_template)
    train, held_out, source = chat.split_conversations(d, read_prompts, "prompt")
    splits = (tokenize(train, tokenizer, max_prompt_tokens, d.path),
              tokenize(held_out, tokenizer, max_prompt_tokens,
                       d.eval_path or f"{d.path} (held out)"))
    notes = (f"prompts: {len(splits[0]):,} training from {d.path}, {len(splits[1]):,} held "
             f"out ({source}), through {tokenizer.name}'s chat template; longer than "
             f"{max_prompt_tokens} tokens: {splits[0].dropped + splits[1].dropped} left out",)
    return cls(splits[0], splits[1], tokenizer, notes)

  def check_vocab(self, vocab_size: int) -> None:
    chat.ChatData.check_vocab(self, vocab_size)


def order(count: int, seed: int, per_batch: int, step: int) -> np.ndarray:
  """The prompts of batch `step`: positions step x per_batch ... of the epochs' permutations
  of `count` prompts (as preference pairs are ordered)."""
  position = step * per_batch + np.arange(per_batch)
  epochs, within = np.divmod(position, count)
  orders = {int(e): np.random.default_rng([seed, int(e)]).permutation(count)
            for e in np.unique(epochs)}
  return np.asarray([orders[int(e)][i] for e, i in zip(epochs, within)])


class PromptSource:
  """A run on prompts before any rollout: the shapes the GRPO step compiles for (here and
  ahead of time, toolkit.compile) — `rows` completions (prompts x generations) of `seq_len`
  positions: "inputs", "targets", the completion mask (`mask_key`), and per row "advantages"
  and "rewards". The batches themselves are sampled from the model being trained
  (toolkit/post_training/grpo_task.py RolloutBatches, which `toolkit.train` puts in its place)."""

  eval_batches = 0
  sampled = True  # loop.run needs `batches` to sample them
  needs = ("data.source='prompts' samples its batches from the model being trained: run it with "
           "python -m toolkit.train, or toolkit.post_training.grpo_task.run(config, workdir)")

  def __init__(self, rows: int, seq_len: int, loss: str, mesh, rules):
    place = lambda axes: NamedSharding(mesh, rules.activation_spec(axes, mesh))
    rows_2d, rows_1d = place(("batch", None)), place(("batch",))
    struct = lambda shape, dtype, sharding: jax.ShapeDtypeStruct(shape, dtype,
                                                                 sharding=sharding)
    self._abstract = {"inputs": struct((rows, seq_len), np.int32, rows_2d),
                      "targets": struct((rows, seq_len), np.int32, rows_2d),
                      mask_key(loss): struct((rows, seq_len), np.float32, rows_2d),
                      "advantages": struct((rows,), np.float32, rows_1d),
                      "rewards": struct((rows,), np.float32, rows_1d)}

  def abstract(self) -> dict[str, jax.ShapeDtypeStruct]:
    return dict(self._abstract)

  def iterator(self, start_step: int, position=None, prefetch: int = 0):
    raise ConfigError(self.needs)
