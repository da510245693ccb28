"""Text files or JSONL -> pre-tokenized shard files (toolkit/data/shards.py's format) with a train
and a val split: what `python scripts/data/prepare_text.py` writes (its docstring has the
rules: documents, tokenizers, the val share, the files)."""
from __future__ import annotations

import json
import os
import time

from toolkit.data import shards
from toolkit.data import text as text_lib
from toolkit.errors import ConfigError


def read_documents(paths: list[str], text_key: str):
  """Yields each document's text; errors name the file (and line) and the fix."""
  for path in paths:
    if os.path.isdir(path):
      raise ConfigError(f"input {path} is a folder; give the text or .jsonl files in it, e.g. "
                        f"{os.path.join(path, '*.txt')}")
    if not os.path.isfile(path):
      raise ConfigError(f"input {path} does not exist; give text or .jsonl files")
    if not path.endswith(".jsonl"):
      try:
        with open(path, encoding="utf-8", newline="") as f:  # keep \r\n as written
          yield f.read()
      except UnicodeDecodeError as e:
        raise ConfigError(f"input {path} is not UTF-8 text ({e.reason} at byte {e.start})"
                          ) from None
      continue
    for where, line in text_lib.jsonl_lines(path):
      yield _jsonl_text(line, where, text_key)


def _jsonl_text(line: str, where: str, text_key: str) -> str:
  """The text of one JSONL line; errors name `where` and the fix."""
  try:
    record = json.loads(line)
  except json.JSONDecodeError as e:
    raise ConfigError(f"{where} is not JSON ({e.msg}); one JSON object per line") from None
  except RecursionError:
    raise ConfigError(f"{where} nests too deeply to be a document; one JSON object per line "
                      f"with a string field {text_key!r}") from None
  if not isinstance(record, dict) or not isinstance(record.get(text_key), str):
    raise ConfigError(f"{where} has no string field {text_key!r}; set --text_key to the field "
                      f"holding the text")
  if (problem := text_lib.utf8_problem(record[text_key])) is not None:
    raise ConfigError(f"{where}: field {text_key!r} is not valid UTF-8 text ({problem}: an "
                      f"unpaired \\ud800-\\udfff escape); fix or drop that line")
  return record[text_key]


def split_documents(documents: list[str], val_fraction: float) -> tuple[list[str], list[str]]:
  """(train, val): the last `val_fraction` of every document's text is held out, so even one
  file gives both splits and val holds that share of the tokens (to within a token per
  document). Each part ends with its own end-of-document token when written."""
  train, val = [], []
  for text in documents:
    cut = len(text) - round(len(text) * val_fraction)
    if text[:cut]:
      train.append(text[:cut])
    if text[cut:]:
      val.append(text[cut:])
  return train, val


def prepare(paths: list[str], out: str, tokenizer: shards.Tokenizer, val_fraction: float,
            shard_tokens: int, text_key: str = "text", log=print) -> dict:
  """Writes the shards and meta.json into `out`; returns meta.json's contents."""
  if not paths:
    raise ConfigError("no input files; give text or .jsonl files after the flags")
  if os.path.exists(out) and not os.path.isdir(out):
    raise ConfigError(f"--out={out!r} is a file; give a folder (created if missing)")
  documents = list(read_documents(paths, text_key))
  if not any(documents):
    raise ConfigError(f"the inputs ({', '.join(paths)}) hold no text"
                      + (f" ({len(documents)} empty documents)" if documents else "")
                      + "; give files with text in them")
  try:
    os.makedirs(out, exist_ok=True)
  except OSError as e:
    raise ConfigError(f"--out={out!r} cannot be created ({e.strerror}); choose another "
                      f"folder") from None
  started, seen = time.perf_counter(), {"parts": 0, "tokens": 0}
  train, val = split_documents(documents, val_fraction)
  parts = len(train) + len(val)

  def progress(_, tokens: int) -> None:
    seen["parts"] += 1
    seen["tokens"] += tokens
    if seen["parts"] % 1000 == 0 or seen["parts"] == parts:
      seconds = time.perf_counter() - started
      log(f"{seen['parts']}/{parts} document parts (train and val parts of {len(documents)} "
          f"documents), {seen['tokens']:,} tokens, "
          f"{seen['tokens'] / max(seconds, 1e-9):,.0f} tokens/s")

  splits = {"train": shards.write_split(out, "train", train, tokenizer, shard_tokens, progress),
            "val": shards.write_split(out, "val", val, tokenizer, shard_tokens, progress)}
  shards.write_meta(out, tokenizer, splits)
  meta = shards.read_meta(out, "--out")
  counts = {name: sum(e["tokens"] for e in entries) for name, entries in splits.items()}
  log(f"wrote {out}: train {counts['train']:,} tokens in {len(splits['train'])} shard(s), "
      f"val {counts['val']:,} tokens; vocabulary {tokenizer.vocab_size}, end-of-document id "
      f"{tokenizer.eot_id}, {tokenizer.dtype.name}")
  return meta
