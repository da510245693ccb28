"""Pre-tokenized text shards: the format `scripts/data/prepare_text.py` writes and the training
pipeline reads.

A shard folder holds flat little-endian token arrays in nanoGPT's style (`train_00000.bin`,
`val_00000.bin`, ... no header) and one `meta.json` describing them:

  {"format": "meshkit-tokens-v1", "dtype": "uint16", "vocab_size": 257, "eot_id": 256,
   "tokenizer": "bytes" | "<path of tokenizer.json>",
   "splits": {"train": [{"file": "train_00000.bin", "tokens": 123}, ...], "val": [...]}}

Every document is followed by the end-of-document token `eot_id`, so the concatenated stream
can be cut into fixed-length windows anywhere (`TokenWindows`: the documents run on into each
other and the model sees the boundary token), or split back into its documents at those ids
(`TokenDocuments`, for `data.packing`: each document attends only within itself).
Byte-level tokenization is built in: ids 0-255 are bytes, 256 ends a document.
Any Hugging Face `tokenizer.json` works through the `tokenizers` library.

The shard folder may be a Cloud Storage URL (gs://bucket/path). Its meta.json is read from
there; the token files of each split read are copied once into a local cache folder
(`workdir.cache_folder`: $XDG_CACHE_HOME/meshkit/tokens/...) and memory-mapped from that copy,
reused while each file's size matches meta.json. Every host keeps a whole copy; for data larger than
a host's disk, mount the bucket (gcsfuse) and give the local path instead.
"""
from __future__ import annotations

import json
import os
from collections.abc import Sequence

import numpy as np

from toolkit import workdir
from toolkit.errors import ConfigError

FORMAT = "meshkit-tokens-v1"
META = "meta.json"
BYTE_EOT = 256
_EOT_CANDIDATES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "[SEP]")


class Tokenizer:
  """Byte-level (`path == "bytes"`) or a Hugging Face tokenizer.json. `eot_id` is None only
  when `require_eot` is False (generation, which ends at the model's EOS ids instead) and the
  tokenizer has none of the usual end-of-document tokens."""

  def __init__(self, path: str = "bytes", eot_token: str = "", require_eot: bool = True):
    self.path = path
    if path == "bytes":
      self._hf = None
      self.vocab_size, self.eot_id = 257, BYTE_EOT
      return
    try:
      import tokenizers  # pylint: disable=g-import-not-at-top
    except ImportError:
      raise ConfigError(f"--tokenizer={path!r} needs the `tokenizers` library: "
                        f"pip install -e '.[text]'") from None
    if not os.path.isfile(path):
      raise ConfigError(f"--tokenizer={path!r} is not a file; give a tokenizer.json or 'bytes'")
    try:
      self._hf = tokenizers.Tokenizer.from_file(path)
    except Exception as e:  # pylint: disable=broad-except  # the library raises plain Exception
      raise ConfigError(f"--tokenizer={path!r} is not a valid tokenizer.json ({e})") from None
    self.vocab_size = self._hf.get_vocab_size(with_added_tokens=True)
    names = (eot_token,) if eot_token else _EOT_CANDIDATES
    ids = [self._hf.token_to_id(name) for name in names]
    found = [i for i in ids if i is not None]
    if not found and not require_eot:
      self.eot_id = None
      return
    if not found:
      raise ConfigError(f"--tokenizer={path!r} has no end-of-document token "
                        f"{' or '.join(names)}; name one with --eot_token")
    self.eot_id = found[0]

  @property
  def dtype(self) -> np.dtype:
    return np.dtype(np.uint16 if self.vocab_size <= 2**16 else np.uint32)

  def encode(self, text: str) -> np.ndarray:
    """Token ids of `text`, without the end-of-document token."""
    if self._hf is None:
      return np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.int64)
    return np.asarray(self._hf.encode(text, add_special_tokens=False).ids, np.int64)

  def decode(self, ids: Sequence[int], skip_special: bool = False) -> str:
    """Text of `ids`; `skip_special` leaves out special tokens (BOS, EOS, ...)."""
    if self._hf is None:
      return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")
    return self._hf.decode([int(i) for i in ids], skip_special_tokens=skip_special)


def read_meta(directory: str, field: str = "data.path") -> dict:
  """meta.json of a shard folder (local or gs://), checked; errors name the file and the fix."""
  path = workdir.join(directory, META)
  if workdir.is_url(directory) and (
      why := workdir.problem(directory, field, reach=True)) is not None:
    raise ConfigError(why)
  if not workdir.isdir(directory):
    raise ConfigError(f"{field}={directory!r} is not a directory; give a folder written by "
                      f"scripts/data/prepare_text.py")
  if not workdir.isfile(path):
    raise ConfigError(f"{path} is missing: {field} must be a folder written by "
                      f"scripts/data/prepare_text.py")
  try:
    meta = json.loads(workdir.read_text(path))
  except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
    raise ConfigError(f"{path} is not valid JSON ({e}); rewrite the shards with "
                      f"scripts/data/prepare_text.py") from None
  if not isinstance(meta, dict) or meta.get("format") != FORMAT:
    raise ConfigError(f"{path}: format is not {FORMAT!r}; rewrite the shards with "
                      f"scripts/data/prepare_text.py")
  return meta


class TokenStream:
  """The token files of one split as one random-access stream (memory-mapped, lazily opened
  so the object pickles cheaply into Grain worker processes). `files` are the local files
  read (cached copies for a gs:// folder); `names` are the same files as the user named
  them."""

  def __init__(self, directory: str, split: str, field: str = "data.path"):
    meta = read_meta(directory, field)
    self.directory, self.split = directory, split
    self.dtype = np.dtype(meta["dtype"])
    self.vocab_size, self.eot_id = int(meta["vocab_size"]), int(meta["eot_id"])
    entries = meta["splits"].get(split) or []
    if not entries or sum(int(e["tokens"]) for e in entries) == 0:
      raise ConfigError(f"{workdir.join(directory, META)} lists no {split!r} tokens; the split "
                        f"is empty: give more text (or a larger --val_fraction for 'val')")
    # A gs:// folder's object names, listed once (a missing shard is named before any copy).
    listing = ({p.name for p in workdir.path(directory).iterdir()}
               if workdir.is_url(directory) else None)
    self.files, self.names, counts = [], [], []
    for entry in entries:
      name = workdir.join(directory, entry["file"])
      if not (os.path.isfile(name) if listing is None else entry["file"] in listing):
        raise ConfigError(f"shard {name} is missing (listed in {META}); rewrite the shards with "
                          f"scripts/data/prepare_text.py")
      expected = int(entry["tokens"]) * self.dtype.itemsize
      path = name if listing is None else self._copy(name, entry["file"], expected)
      if os.path.getsize(path) != expected:
        raise ConfigError(f"shard {name} is corrupt: {os.path.getsize(path)} bytes, {META} says "
                          f"{entry['tokens']} {self.dtype.name} tokens ({expected} bytes); "
                          f"rewrite the shards with scripts/data/prepare_text.py")
      self.files.append(path)
      self.names.append(name)
      counts.append(int(entry["tokens"]))
    self.starts = np.concatenate([[0], np.cumsum(counts)])
    self._maps: list[np.ndarray] | None = None

  def _copy(self, url: str, file: str, size: int) -> str:
    """The cached local copy of the shard `url` (`file` in the folder)."""
    local = os.path.join(workdir.cache_folder(self.directory, "tokens"), file)
    try:
      return workdir.cached_copy(url, local, size)
    except OSError as e:
      raise ConfigError(f"shard {url} cannot be copied into {os.path.dirname(local)} ({e}); "
                        f"check the bucket's permissions and this machine's free disk "
                        f"space") from None

  def __len__(self) -> int:
    return int(self.starts[-1])

  def __getstate__(self):
    return {**self.__dict__, "_maps": None}

  def _open(self) -> list[np.ndarray]:
    if self._maps is None:
      self._maps = [np.memmap(path, dtype=self.dtype, mode="r") for path in self.files]
    return self._maps

  def document_ends(self, chunk: int = 2**24) -> np.ndarray:
    """The stream index of every end-of-document id, ascending (int64): one pass over the
    split's tokens, `chunk` at a time."""
    found = []
    for start, tokens in zip(self.starts, self._open()):
      for offset in range(0, tokens.size, chunk):
        hits = np.flatnonzero(tokens[offset:offset + chunk] == self.eot_id)
        found.append(start + offset + hits)
    return np.concatenate(found).astype(np.int64) if found else np.zeros(0, np.int64)

  def read(self, start: int, count: int) -> np.ndarray:
    """Tokens [start, start + count) as int32, across file boundaries; checks each id is
    below the vocabulary so a corrupt file is named, not trained on."""
    maps, pieces, position = self._open(), [], start
    while position < start + count:
      index = int(np.searchsorted(self.starts, position, side="right")) - 1
      offset = position - self.starts[index]
      take = min(start + count - position, self.starts[index + 1] - position)
      piece = np.asarray(maps[index][offset:offset + take], dtype=np.int32)
      if piece.size and int(piece.max()) >= self.vocab_size:
        raise ConfigError(f"shard {self.names[index]} holds token id {int(piece.max())}, beyond "
                          f"its vocabulary of {self.vocab_size} ({META}); the file is corrupt: "
                          f"rewrite the shards with scripts/data/prepare_text.py")
      pieces.append(piece)
      position += take
    return np.concatenate(pieces)


class TokenWindows:
  """Fixed-length training windows of a token stream: window i is tokens
  [i * seq_len, i * seq_len + seq_len + 1) (inputs and shifted targets). A Grain data source."""

  def __init__(self, stream: TokenStream, seq_len: int):
    self.stream, self.seq_len = stream, seq_len
    self.count = (len(stream) - 1) // seq_len
    if self.count < 1:
      raise ConfigError(f"the {stream.split!r} split of {stream.directory} has {len(stream)} "
                        f"tokens, fewer than data.seq_len + 1 = {seq_len + 1}; give more text or "
                        f"a shorter data.seq_len")

  def __len__(self) -> int:
    return self.count

  def __getitem__(self, index: int) -> dict[str, np.ndarray]:
    return {"tokens": self.stream.read(int(index) * self.seq_len, self.seq_len + 1)}

  def __repr__(self) -> str:  # Grain keeps it in the iterator state
    return f"TokenWindows({self.stream.directory!r}, {self.stream.split!r}, {self.seq_len})"


class TokenDocuments:
  """The documents of a token stream as packing examples (toolkit/data/packing.py): a Grain
  data source.

  A document is the tokens after an end-of-document id up to and including the next one (the
  stream's end closes a last one without it). Its example reads the end-of-document id before
  it and its tokens but the last, and predicts its tokens: n (input, target) pairs for n
  tokens, the first token predicted from the end-of-document id as in the unpacked stream, so
  every token of the split is a target exactly once and no target crosses a document. A
  document longer than `seq_len` is cut into pieces of `seq_len` targets, each a document of
  its own in a row (its positions restart at 0), the next piece reading on from the last
  token of the one before. Index: 12 bytes per piece, found in one pass over the tokens."""

  def __init__(self, stream: TokenStream, seq_len: int):
    self.stream, self.seq_len = stream, seq_len
    ends = stream.document_ends() + 1                     # exclusive ends
    if not ends.size or ends[-1] < len(stream):
      ends = np.append(ends, len(stream))
    starts = np.concatenate([[0], ends[:-1]])
    pieces = -(-(ends - starts) // seq_len)
    document = np.repeat(np.arange(ends.size), pieces)
    index = np.arange(document.size) - np.repeat(np.cumsum(pieces) - pieces, pieces)
    self.starts = starts[document] + index * seq_len       # first target of each piece
    self.counts = np.minimum(seq_len, ends[document] - self.starts).astype(np.int32)
    self.documents = int(ends.size)

  def __len__(self) -> int:
    return int(self.starts.size)

  def __getitem__(self, index: int) -> dict[str, np.ndarray]:
    start, count = int(self.starts[index]), int(self.counts[index])
    if start:
      window = self.stream.read(start - 1, count + 1)
    else:  # the stream's first document: no end-of-document id before it
      window = np.concatenate([np.full(1, self.stream.eot_id, np.int32),
                               self.stream.read(0, count)])
    return {"inputs": window[:-1], "targets": window[1:],
            "loss_weights": np.ones(count, np.float32)}

  def __repr__(self) -> str:
    return f"TokenDocuments({self.stream.directory!r}, {self.stream.split!r}, {self.seq_len})"


def write_split(directory: str, split: str, documents, tokenizer: Tokenizer, shard_tokens: int,
                progress=None) -> list[dict]:
  """Encodes `documents` (an iterable of strings) into `split_NNNNN.bin` files of at most
  `shard_tokens` tokens each; returns their meta entries."""
  entries: list[dict] = []
  buffer: list[np.ndarray] = []
  buffered = 0

  def flush(final: bool) -> None:
    nonlocal buffer, buffered
    tokens = np.concatenate(buffer) if buffer else np.zeros(0, np.int64)
    while tokens.size >= shard_tokens or (final and tokens.size):
      chunk, tokens = tokens[:shard_tokens], tokens[shard_tokens:]
      name = f"{split}_{len(entries):05d}.bin"
      chunk.astype(tokenizer.dtype).tofile(os.path.join(directory, name))
      entries.append({"file": name, "tokens": int(chunk.size)})
    buffer, buffered = ([tokens] if tokens.size else []), int(tokens.size)

  for count, text in enumerate(documents, 1):
    ids = tokenizer.encode(text)
    buffer.append(np.append(ids, tokenizer.eot_id))
    buffered += ids.size + 1
    if buffered >= shard_tokens:
      flush(final=False)
    if progress is not None:
      progress(count, int(ids.size + 1))
  flush(final=True)
  return entries


def write_meta(directory: str, tokenizer: Tokenizer, splits: dict[str, list[dict]]) -> str:
  path = os.path.join(directory, META)
  with open(path, "w") as f:
    json.dump({"format": FORMAT, "dtype": tokenizer.dtype.name,
               "vocab_size": tokenizer.vocab_size, "eot_id": tokenizer.eot_id,
               "tokenizer": tokenizer.path, "splits": splits}, f, indent=2)
  return path
