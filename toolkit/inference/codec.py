"""Text <-> token ids for generation: byte-level (the default, for byte models such as the CPU
demo's) or a Hugging Face tokenizer.json through `tokenizers` (toolkit.data.shards.Tokenizer),
with the model's special tokens: BOS is put in front of every text prompt, and each EOS id
ends a request (as in transformers' `generate`). The ids come from the tokenizer's folder
(generation_config.json, else config.json), as Hugging Face keeps them."""
from __future__ import annotations

import dataclasses
import os

import numpy as np

from toolkit import hf
from toolkit.data.shards import Tokenizer
from toolkit.errors import ConfigError
from toolkit.inference.sampling import SamplingParams

BYTES = "bytes"
TOKENIZER_FILE = "tokenizer.json"


@dataclasses.dataclass(frozen=True)
class Codec:
  tokenizer: Tokenizer
  bos: int | None = None
  eos: tuple[int, ...] = ()

  @classmethod
  def load(cls, path: str = BYTES, flag: str = "--tokenizer") -> Codec:
    """'bytes' (or '') for byte-level text; else a tokenizer.json or the folder holding it."""
    if not path or path == BYTES:
      return cls(Tokenizer(BYTES))
    folder, file = (path, os.path.join(path, TOKENIZER_FILE)) if os.path.isdir(path) else (
        os.path.dirname(path) or ".", path)
    if not os.path.isfile(file):
      raise ConfigError(f"{flag}={path!r}: {file} does not exist; give a tokenizer.json, the "
                        f"Hugging Face folder holding one, or 'bytes'")
    return cls(Tokenizer(file, require_eot=False), *hf.special_tokens(folder))

  @property
  def byte_level(self) -> bool:
    return self.tokenizer.path == BYTES

  def check(self, vocab_size: int, flag: str = "--tokenizer") -> Codec:
    """Refuses a tokenizer whose ids do not fit the model's vocabulary."""
    if self.byte_level:
      return self
    biggest = max([self.tokenizer.vocab_size - 1, self.bos or 0, *self.eos])
    if biggest >= vocab_size:
      raise ConfigError(f"{flag}={self.tokenizer.path!r} has token ids up to {biggest}, beyond "
                        f"the model's vocab_size={vocab_size}; give the model's own tokenizer")
    return self

  def encode(self, text: str) -> np.ndarray:
    """int32 ids of `text`, after BOS when the model has one."""
    ids = self.tokenizer.encode(text).astype(np.int32)
    return ids if self.bos is None else np.concatenate([[self.bos], ids]).astype(np.int32)

  def decode(self, ids) -> str:
    return self.tokenizer.decode(ids, skip_special=True)

  def stop_at_eos(self, params: SamplingParams) -> SamplingParams:
    """`params` with the model's EOS ids among its stop tokens."""
    stop = tuple(dict.fromkeys(params.stop_tokens + self.eos))
    return dataclasses.replace(params, stop_tokens=stop)


BYTE_LEVEL = Codec(Tokenizer(BYTES))
