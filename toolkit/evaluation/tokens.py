"""Which tokenizer turns a task's text into a checkpoint's tokens: the one given (--tokenizer),
else the one its config trained with:

  data.source=chat          data.tokenizer (a Hugging Face folder)
  train.init_from=hf:DIR    DIR's tokenizer.json, when DIR has one
  data.source=tokens        the tokenizer scripts/data/prepare_text.py recorded in the shards' meta.json
  data.source=stdlib_docs   bytes (the byte-level models of experiments/lm.py)

A model trained on synthetic token ids has no text: evaluating it needs --tokenizer.
"""
from __future__ import annotations

import os

import ml_collections

from toolkit import workdir as workdir_lib
from toolkit.data import shards
from toolkit.errors import ConfigError
from toolkit.inference.codec import BYTES, TOKENIZER_FILE, Codec
from toolkit.training import config as config_lib, init_from


def trained_with(config: ml_collections.ConfigDict) -> str | None:
  """'bytes', a tokenizer.json or a folder holding one: what `config`'s data was tokenized
  with; None when it was not text."""
  data = config.data
  if data.source in ("chat", "preference", "prompts"):  # SFT, DPO, GRPO: as their data has it
    from toolkit.data import chat  # pylint: disable=g-import-not-at-top  # imports Grain
    return chat.tokenizer_path(data, config.train.get("init_from", ""))
  folder = init_from.parse(config.train.get("init_from", ""))
  if folder and workdir_lib.isfile(workdir_lib.join(folder, TOKENIZER_FILE)):
    return folder
  if data.source == "tokens" and data.get("path", ""):
    try:
      recorded = shards.read_meta(data.path).get("tokenizer", "")
    except ConfigError:
      return None
    return recorded if recorded == BYTES or os.path.isfile(recorded) else None
  return BYTES if data.source == "stdlib_docs" else None


def codec_for(config: ml_collections.ConfigDict, tokenizer: str = "", field: str = "--tokenizer",
              fix: str = "give the model's tokenizer with --tokenizer=DIR/tokenizer.json (or "
                         "'bytes' for a byte-level model)") -> Codec:
  """The Codec for `config`'s model: `tokenizer` when given ('bytes', a tokenizer.json or its
  folder), else the one the config trained with. ConfigError (naming `fix`) when there is
  none, or when its ids do not fit the model's vocabulary."""
  vocab_size = config_lib.model_config(config.model).vocab_size
  path = tokenizer or trained_with(config)
  if path is None:
    raise ConfigError(f"the model trained on data.source={config.data.source!r} (token ids, "
                      f"no tokenizer) and the harness's tasks are text; {fix}")
  return Codec.load(path, field).check(vocab_size, field)
