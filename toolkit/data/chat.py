"""Chat data for supervised fine-tuning: conversations from JSONL or Parquet files through the
model's own chat template and tokenizer, the loss on what the assistant says.

Files (`data.source="chat"`). `data.path` names the training conversations: files or globs,
comma-separated; `data.eval_path` the held-out ones the same way (else `data.eval_fraction`
of the training files' conversations is held out, the same ones whatever the seed). JSONL
holds one conversation per line, Parquet (`.parquet`, read with pyarrow) one per row, each in
either form
    {"messages": [{"role": "system" | "user" | "assistant" | ..., "content": "..."}, ...]}
    {"prompt": "...", "completion": "..."}
the second being a user turn and the assistant's answer (each side may also be a list of
messages, TRL's conversational prompt-completion form). Other keys of a message
(`reasoning_content`, `tool_calls`, ...) reach the template as they are. A line that is not
such a conversation is one error naming the file and the line ("train.jsonl line 7: ...").
`data.path="synthetic:NAME"` reads a built-in task instead (toolkit/data/instruct.py).

Tokens. `data.tokenizer` is a Hugging Face model folder (tokenizer.json, and
tokenizer_config.json or chat_template.jinja with the template), or "bytes" for byte-level
models, which need `data.chat_template` (the template itself, or a .jinja file); "" means the
folder of `train.init_from` when it holds a tokenizer.json, else bytes. A template given in
`data.chat_template` replaces the folder's. Rendering follows transformers exactly
(toolkit/data/chat_template.py).

Loss. `data.train_on="assistant"` (default) weighs the targets that are assistant tokens 1
and every other target 0 (the system and user turns, the template's headers); "all" weighs
every token of the conversation. A conversation of n tokens is one document of n - 1
(input, target) pairs, so the first assistant token is predicted from the generation prompt
before it.

Length. A conversation longer than `data.seq_len` + 1 tokens is cut to its first
`data.seq_len` + 1 (`data.overlong="truncate"`, the default; one that keeps no assistant token
is then dropped) or left out (`"drop"`); the start-up log counts them (`ChatData.notes`).

Rows. Each conversation is one document of the packer (toolkit/data/packing.py): several to
a row with `data.packing`, each attending only within itself, or one per row padded
(`ChatBatches`). Either way a row is the toolkit's LM batch: "inputs", "targets" int32
(batch, length) and "loss_weights" float32, plus "segment_ids" and "positions" when packed;
the loss is the weighted mean over the assistant's tokens, and so is the held-out loss.
"""
from __future__ import annotations

import dataclasses
import glob
import json
import os
from collections.abc import Iterator, Sequence

import numpy as np

from toolkit.data import instruct, packing, text
from toolkit.data.chat_template import BYTES, ChatTokenizer
from toolkit.errors import ConfigError

TRAIN_ON = ("assistant", "all")
OVERLONG = ("truncate", "drop")
Messages = list[dict]


@dataclasses.dataclass(frozen=True)
class Conversation:
  messages: Messages
  where: str  # "FILE line N" (JSONL), "FILE row N" (Parquet), "synthetic:NAME #N"


# --- files -> conversations ---------------------------------------------------------------

def message_list(value, where: str, field: str) -> Messages:
  if not isinstance(value, list) or not value:
    raise ConfigError(f"{where}: {field} must be a non-empty list of {{\"role\", \"content\"}} "
                      f"objects")
  for i, message in enumerate(value):
    if not isinstance(message, dict):
      raise ConfigError(f"{where}: {field}[{i}] is not an object; give {{\"role\": ..., "
                        f"\"content\": ...}}")
    for key in ("role", "content"):
      if not isinstance(message.get(key), str):
        got = "missing" if key not in message else f"a {type(message[key]).__name__}"
        raise ConfigError(f"{where}: {field}[{i}].{key} is {got}; give a string")
  return value


def parse_record(record, where: str) -> Messages:
  """The messages of one JSON object in either form (module docstring)."""
  if not isinstance(record, dict):
    raise ConfigError(f"{where}: not a JSON object; give {{\"messages\": [...]}} or "
                      f"{{\"prompt\": ..., \"completion\": ...}}")
  if "messages" in record:
    return message_list(record["messages"], where, "messages")
  if "prompt" in record and "completion" in record:
    sides = []
    for key, role in (("prompt", "user"), ("completion", "assistant")):
      value = record[key]
      sides += ([{"role": role, "content": value}] if isinstance(value, str)
                else message_list(value, where, key))
    return sides
  raise ConfigError(f"{where}: has neither \"messages\" nor \"prompt\" and \"completion\" "
                    f"(keys: {', '.join(sorted(record)) or 'none'})")


def _jsonl(path: str) -> Iterator[Conversation]:
  for where, line in text.jsonl_lines(path):
    try:
      record = json.loads(line)
    except json.JSONDecodeError as e:
      raise ConfigError(f"{where}: not valid JSON ({text.json_problem(line, e)})") from None
    yield Conversation(parse_record(record, where), where)


def parquet_records(path: str) -> Iterator[tuple[str, dict]]:
  """("PATH row N", the row as a dict) for each row of a Parquet file, read with pyarrow."""
  try:
    import pyarrow.parquet as pq  # pylint: disable=g-import-not-at-top
  except ImportError:
    raise ConfigError(f"{path}: Parquet files need pyarrow: pip install -e '.[text]'") from None
  try:
    parquet = pq.ParquetFile(path)
  except (OSError, ValueError) as e:  # pyarrow.ArrowInvalid is a ValueError
    raise ConfigError(f"{path} is not a readable Parquet file ({e})") from None
  row = 0
  for batch in parquet.iter_batches(batch_size=1024):
    for record in batch.to_pylist():
      row += 1
      yield f"{path} row {row}", record


def records(path: str) -> Iterator[tuple[str, dict]]:
  """(where, record) of every record in a JSONL or Parquet file (preference pairs, prompts)."""
  if path.endswith(".parquet"):
    yield from parquet_records(path)
    return
  for where, line in text.jsonl_lines(path):
    try:
      yield where, json.loads(line)
    except json.JSONDecodeError as e:
      raise ConfigError(f"{where}: not valid JSON ({text.json_problem(line, e)})") from None


def _parquet(path: str) -> Iterator[Conversation]:
  for where, record in parquet_records(path):
    yield Conversation(parse_record(record, where), where)


def data_files(spec: str, field: str) -> list[str]:
  files = []
  for item in filter(None, (s.strip() for s in spec.split(","))):
    found = sorted(glob.glob(item)) if glob.has_magic(item) else [item]
    if not found or not all(os.path.isfile(f) for f in found):
      raise ConfigError(f"{field}={spec!r}: {item!r} names no file; give JSONL or Parquet "
                        f"files (comma-separated, globs allowed)")
    files += found
  if not files:
    raise ConfigError(f"{field} is empty; give JSONL or Parquet files of conversations")
  return files


def read_conversations(spec: str, field: str = "data.path",
                       split: str = "train") -> list[Conversation]:
  """Every conversation of `spec` (files, or `synthetic:NAME`'s `split`), in file order."""
  task = instruct.parse(spec)
  if task is not None:
    return [Conversation(m, f"{spec} {split} #{i}")
            for i, m in enumerate(instruct.conversations(task[0], split, task[1]))]
  found: list[Conversation] = []
  for path in data_files(spec, field):
    found.extend((_parquet if path.endswith(".parquet") else _jsonl)(path))
  if not found:
    raise ConfigError(f"{field}={spec!r} holds no conversations")
  return found


# --- conversations -> documents ------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Documents:
  """The tokenized conversations of one split: document i is tokens[starts[i]:starts[i+1]],
  and `trained` likewise says which of those tokens the loss predicts."""
  name: str
  tokens: np.ndarray   # int32 (total,)
  trained: np.ndarray  # bool (total,)
  starts: np.ndarray   # int64 (count + 1,)
  truncated: int = 0   # cut to seq_len + 1 tokens (data.overlong="truncate")
  dropped: int = 0     # left out: longer, or truncated to no assistant token

  def __len__(self) -> int:
    return len(self.starts) - 1

  def document(self, index: int) -> dict[str, np.ndarray]:
    """Document `index`: "inputs", "targets" int32 and "loss_weights" float32 (n - 1,)."""
    start, end = self.starts[index], self.starts[index + 1]
    tokens = self.tokens[start:end]
    return {"inputs": tokens[:-1], "targets": tokens[1:],
            "loss_weights": self.trained[start + 1:end].astype(np.float32)}

  @property
  def positions(self) -> int:
    """(input, target) pairs over all documents: the real tokens of the rows they fill."""
    return int(self.starts[-1]) - len(self)


def tokenize(conversations: Sequence[Conversation], tokenizer: ChatTokenizer, seq_len: int,
             name: str, train_on: str = "assistant", overlong: str = "truncate") -> Documents:
  """The conversations as documents of at most `seq_len` positions (module docstring)."""
  tokens, trained, lengths = [], [], []
  truncated = dropped = 0
  for conversation in conversations:
    try:
      ids, mask = tokenizer.encode(conversation.messages, train_on)
    except ConfigError as e:
      raise ConfigError(f"{conversation.where}: {e}") from None
    if ids.size < 2:
      raise ConfigError(f"{conversation.where}: renders to {ids.size} token(s); a conversation "
                        f"needs at least 2 to predict one")
    if not mask[1:].any():
      raise ConfigError(f"{conversation.where}: has no assistant turn to train on; add one, or "
                        f"train on every token (data.train_on='all')")
    if ids.size > seq_len + 1:
      if overlong == "drop":
        dropped += 1
        continue
      ids, mask = ids[:seq_len + 1], mask[:seq_len + 1]
      if not mask[1:].any():
        dropped += 1
        continue
      truncated += 1
    tokens.append(ids)
    trained.append(mask)
    lengths.append(ids.size)
  if not lengths:
    raise ConfigError(f"all {len(conversations)} conversations of {name} are longer than "
                      f"data.seq_len={seq_len} + 1 tokens and were dropped (data.overlong="
                      f"{overlong!r}); raise data.seq_len or use data.overlong='truncate'")
  return Documents(name, np.concatenate(tokens), np.concatenate(trained),
                   np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
                   truncated, dropped)


class ChatDocuments:
  """A Grain data source: record i is document i as `Documents.document` gives it (variable
  length), for the packer (toolkit/data/packing.py)."""

  def __init__(self, documents: Documents):
    self.documents = documents

  def __len__(self) -> int:
    return len(self.documents)

  def __getitem__(self, index: int) -> dict[str, np.ndarray]:
    return self.documents.document(int(index))

  def __repr__(self) -> str:  # Grain keeps it in the iterator state
    return f"ChatDocuments({self.documents.name!r}, {len(self)})"


# --- a run's chat data -----------------------------------------------------------------------

def check_config(data_config) -> None:
  """The chat fields' values that need no file (toolkit.training.config.resolve calls it)."""
  d = data_config
  if d.train_on not in TRAIN_ON:
    raise ConfigError(f"data.train_on={d.train_on!r}; use one of {', '.join(TRAIN_ON)}")
  if d.overlong not in OVERLONG:
    raise ConfigError(f"data.overlong={d.overlong!r}; use one of {', '.join(OVERLONG)}")
  instruct.parse(d.path)  # a bad synthetic task: ConfigError


def tokenizer_path(data_config, init_from: str = "") -> str:
  """data.tokenizer, with "" resolved: `train.init_from`'s folder when it holds a
  tokenizer.json, else bytes."""
  if data_config.tokenizer:
    return data_config.tokenizer
  folder = init_from[len("hf:"):] if init_from.startswith("hf:") else ""
  return folder if folder and os.path.isfile(os.path.join(folder, "tokenizer.json")) else BYTES


def held_out_split(records: list, fraction: float, what: str = "conversation"
                   ) -> tuple[list, list]:
  """(training, held-out) records (conversations, or preference pairs): `fraction` of them (at
  least one) held out, picked by a fixed permutation, so every seed is scored on the same
  ones."""
  count = max(1, round(len(records) * fraction))
  if count >= len(records):
    raise ConfigError(f"data.path holds {len(records)} {what}(s): too few to hold out "
                      f"data.eval_fraction={fraction} of them and train on the rest; give "
                      f"held-out files in data.eval_path")
  held = set(np.random.default_rng(0).permutation(len(records))[:count].tolist())
  return ([c for i, c in enumerate(records) if i not in held],
          [c for i, c in enumerate(records) if i in held])


def split_conversations(data_config, read=None, what: str = "conversation"
                        ) -> tuple[list, list, str]:
  """(training, held-out) conversations of a config's `data` section, and where the held-out
  ones come from: data.eval_path, a synthetic task's own split, or data.eval_fraction. `read`
  (default `read_conversations`) reads other records the same way (preference pairs)."""
  d, read = data_config, read or read_conversations
  train = read(d.path, "data.path", "train")
  if d.eval_path:
    return train, read(d.eval_path, "data.eval_path", "held_out"), d.eval_path
  if instruct.parse(d.path) is not None:
    return train, read(d.path, "data.path", "held_out"), "the task's own"
  train, held_out = held_out_split(train, d.eval_fraction, what)
  return train, held_out, f"data.eval_fraction={d.eval_fraction} of data.path"


@dataclasses.dataclass(frozen=True)
class ChatData:
  """A run's tokenized conversations and the lines the start-up log prints about them."""
  train: Documents
  held_out: Documents
  tokenizer: ChatTokenizer
  notes: tuple[str, ...]

  @classmethod
  def from_config(cls, data_config, init_from: str = "") -> ChatData:
    """The conversations of a config's `data` section (module docstring), tokenized."""
    d = data_config
    check_config(d)
    tokenizer = ChatTokenizer.load(tokenizer_path(d, init_from), d.chat_template)
    train, held_out, source = split_conversations(d)
    settings = dict(seq_len=d.seq_len, train_on=d.train_on, overlong=d.overlong)
    splits = (tokenize(train, tokenizer, name=d.path, **settings),
              tokenize(held_out, tokenizer, name=d.eval_path or f"{d.path} (held out)",
                       **settings))
    trained = splits[0].trained.sum() / max(splits[0].trained.size, 1)
    notes = (
        f"chat data: {len(splits[0]):,} training conversations from {d.path}, "
        f"{len(splits[1]):,} held out ({source}); {splits[0].tokens.size:,} training tokens "
        f"({tokenizer.name}), {trained:.0%} of them trained on (data.train_on={d.train_on!r})",
        f"chat data: longer than data.seq_len + 1 = {d.seq_len + 1} tokens: "
        f"{splits[0].truncated + splits[0].dropped} training and "
        f"{splits[1].truncated + splits[1].dropped} held-out conversations "
        f"({splits[0].truncated + splits[1].truncated} truncated, "
        f"{splits[0].dropped + splits[1].dropped} dropped; data.overlong={d.overlong!r})")
    return cls(splits[0], splits[1], tokenizer, notes)

  def check_vocab(self, vocab_size: int) -> None:
    if self.tokenizer.vocab_size > vocab_size:
      raise ConfigError(f"data.tokenizer={self.tokenizer.name!r} has {self.tokenizer.vocab_size} "
                        f"ids but model.vocab_size={vocab_size}; give the model's own tokenizer "
                        f"or a model.vocab_size >= {self.tokenizer.vocab_size}")


class ChatBatches(packing.DocumentBatches):
  """The batches of a run on chat data: its documents packed several to a row (`packed`) or
  one per row (toolkit/data/packing.py); the start-up log also says what the conversations
  were (`ChatData.notes`)."""

  def __init__(self, data: ChatData, seq_len: int, seed: int, global_batch_size: int, mesh,
               rules, eval_batches: int, prefetch: int = 2, bins: int = 0,
               packed: bool = False):
    super().__init__(ChatDocuments(data.train), ChatDocuments(data.held_out), seq_len, seed,
                     global_batch_size, mesh, rules, eval_batches, prefetch, bins,
                     documents_per_row=None if packed else 1)
    self.data = data

  def describe(self) -> str:
    return "\n".join([*self.data.notes, super().describe()])
