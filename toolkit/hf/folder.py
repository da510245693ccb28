"""A Hugging Face model folder on disk: config.json, safetensors weights (`model.safetensors`,
or shards listed in `model.safetensors.index.json`), special token ids, tokenizer files.

Everything is checked from the files' headers before a tensor is read: a missing tensor, a
shape that disagrees with config.json (a vocabulary of another size included), an unknown
tensor, tied embeddings that are not tied. Each mistake is one ConfigError naming the file,
the tensor or field, and the fix.

The folder may be a Cloud Storage URL (gs://bucket/path). Its JSON files are read from there;
its safetensors files are copied once into a local cache folder (`workdir.cache_folder`) and read
from that copy, because safetensors reads slices from a memory-mapped local file. Messages
still name the gs:// URL.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import os

import numpy as np

from models import LlamaConfig
from toolkit import workdir
from toolkit.errors import ConfigError
from toolkit.hf import architectures
from toolkit.hf.tensors import TensorMap

CONFIG = "config.json"
GENERATION_CONFIG = "generation_config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# Copied along on export so the exported folder loads with its tokenizer.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "tokenizer.model", GENERATION_CONFIG)
_DTYPES = {"F32": np.float32, "BF16": "bfloat16", "F16": np.float16, "F64": np.float64}
_COMPARE_ROWS = 4096  # rows of lm_head / embed_tokens compared at a time (bounded memory)


def read_json(path: str, what: str) -> dict:
  """The JSON object in the file `path` (local or gs://); errors name the file and `what`."""
  try:
    if workdir.is_url(path):
      value = json.loads(workdir.read_text(path))
    else:
      with open(path, encoding="utf-8") as f:
        value = json.load(f)
  except FileNotFoundError:
    raise ConfigError(f"{path} is missing; {what}") from None
  except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
    raise ConfigError(f"{path} is not valid JSON ({e}); {what}") from None
  if not isinstance(value, dict):
    raise ConfigError(f"{path} does not hold a JSON object; {what}")
  return value


@dataclasses.dataclass(frozen=True)
class TensorInfo:
  file: str  # as the user named it: a local path or a gs:// URL
  shape: tuple[int, ...]
  dtype: str  # safetensors' name: F32, BF16, ...
  local: str  # the local file read: `file` itself, or its cached copy when `file` is gs://


class HFFolder:
  """A Hugging Face model folder, local or gs://; `field` names the flag or config field that
  gave its path. A gs:// folder's weights are copied into `workdir.cache_folder(path, "hf")`
  when first needed (`tensors`) and reused from there while each file's size matches its
  object's."""

  def __init__(self, path: str, field: str = "--hf"):
    if workdir.is_url(path):
      path = workdir.absolute(path)  # no trailing slash: one cache folder per URL
    self.path, self.field = path, field
    self._listing: set[str] | None = None  # a gs:// folder's file names
    if workdir.is_url(path):
      if (why := workdir.problem(path, field, reach=True)) is not None:
        raise ConfigError(why)
      if not workdir.isdir(path):
        raise ConfigError(f"{field}={path!r} holds no objects; give the URL of a Hugging Face "
                          f"model folder (config.json and *.safetensors)")
      self._listing = {p.name for p in workdir.path(path).iterdir()}
    elif not os.path.isdir(path):
      raise ConfigError(f"{field}={path!r} is not a directory; give a Hugging Face model folder "
                        f"(config.json and *.safetensors)")
    self.config_path = self._where(CONFIG)
    self.config = read_json(self.config_path, f"{field} must be a Hugging Face model folder")
    self.architecture = architectures.for_hf_config(self.config, self.config_path)
    self._checked: dict[LlamaConfig, list[TensorMap]] = {}

  def model_config(self, base: LlamaConfig) -> LlamaConfig:
    """meshkit's model config for this folder; fields HF does not describe come from `base`."""
    return self.architecture.model_config(self.config, base, self.config_path)

  # --- the files --------------------------------------------------------------------------------
  def _where(self, name: str) -> str:
    """The file `name` of this folder as the user would name it (a path or a URL)."""
    return workdir.join(self.path, name)

  def _has(self, name: str) -> bool:
    if self._listing is not None:
      return name in self._listing
    return os.path.isfile(self._where(name))

  def _local(self, name: str) -> str:
    """A local file holding `name`: the file itself, or its cached copy for a gs:// folder."""
    if self._listing is None:
      return self._where(name)
    url = self._where(name)
    local = os.path.join(workdir.cache_folder(self.path, "hf"), name)
    try:
      return workdir.cached_copy(url, local, workdir.path(url).stat().length)
    except OSError as e:
      raise ConfigError(f"{url} cannot be copied into {os.path.dirname(local)} ({e}); check "
                        f"the bucket's permissions and this machine's free disk space") from None

  # --- the weights' headers ------------------------------------------------------------------
  @functools.cached_property
  def tensors(self) -> dict[str, TensorInfo]:
    """Every tensor's file, shape and dtype, from the safetensors headers (no data read)."""
    from safetensors import safe_open  # pylint: disable=g-import-not-at-top
    index_path = self._where(INDEX_FILE)
    if self._has(INDEX_FILE):
      weight_map = read_json(index_path, "rewrite it or remove it to read model.safetensors"
                             ).get("weight_map")
      if not isinstance(weight_map, dict) or not weight_map:
        raise ConfigError(f"{index_path} has no weight_map; it must list each tensor's file")
      files = sorted(set(weight_map.values()))
    elif self._has(SINGLE_FILE):
      weight_map, files = None, [SINGLE_FILE]
    else:
      raise ConfigError(f"{self.field}={self.path!r} holds neither {SINGLE_FILE} nor "
                        f"{INDEX_FILE}; meshkit reads safetensors weights only (save them with "
                        f"save_pretrained(..., safe_serialization=True))")
    found: dict[str, TensorInfo] = {}
    for name in files:
      file = self._where(name)
      if not self._has(name):
        raise ConfigError(f"{file} is missing (listed in {INDEX_FILE}); the download is "
                          f"incomplete")
      local = self._local(name)
      try:
        with safe_open(local, framework="np") as f:
          for key in f.keys():
            piece = f.get_slice(key)
            found[key] = TensorInfo(file, tuple(piece.get_shape()), piece.get_dtype(), local)
      except Exception as e:  # pylint: disable=broad-except  # safetensors raises its own types
        raise ConfigError(f"{file} is not a readable safetensors file ({e})") from None
    if weight_map is not None:
      for key, name in weight_map.items():
        if key not in found or found[key].file != self._where(name):
          raise ConfigError(f"{INDEX_FILE} places tensor {key} in {name}, which does not hold "
                            f"it; the index and the shards disagree")
    return found

  def check(self, cfg: LlamaConfig) -> list[TensorMap]:
    """The tensor table for `cfg`, after checking the files hold exactly those tensors with
    the shapes config.json implies (once per config: the tied-embedding check reads)."""
    if cfg not in self._checked:
      self._checked[cfg] = self._check(cfg)
    return self._checked[cfg]

  def _check(self, cfg: LlamaConfig) -> list[TensorMap]:
    table = self.architecture.tensors(cfg)
    expected = {}
    for entry in table:
      for _, name in entry.hf_tensors(cfg.n_layers):
        expected[name] = entry.hf_shape
    found = self.tensors
    self._check_tied(cfg, found)  # before the general checks: its message says more
    for name, shape in expected.items():
      if name not in found:
        raise ConfigError(f"{self.field}={self.path!r}: tensor {name} is missing from the "
                          f"weights; the checkpoint is incomplete or {CONFIG} does not "
                          f"belong to it")
      info = found[name]
      if info.dtype not in _DTYPES:
        raise ConfigError(f"{info.file}: tensor {name} has dtype {info.dtype}; meshkit reads "
                          f"{', '.join(_DTYPES)} (quantized weights are not supported)")
      if info.shape != shape:
        raise ConfigError(self._shape_error(name, info, shape, cfg))
    extra = [name for name in found if name not in expected
             and name != self.architecture.head  # checked equal to the embedding when tied
             and not self.architecture.is_ignored(name)]
    if extra:
      raise ConfigError(f"{found[extra[0]].file}: tensor {extra[0]} has no place in meshkit's "
                        f"{self.architecture.name} ({len(extra)} such tensor(s)); meshkit "
                        f"cannot represent it (biases, adapters and quantization scales are "
                        f"not supported)")
    return table

  def _shape_error(self, name: str, info: TensorInfo, shape: tuple, cfg: LlamaConfig) -> str:
    vocabulary = (self.architecture.head, self.architecture.embedding)
    if name in vocabulary and info.shape[1:] == shape[1:]:
      return (f"{info.file}: tensor {name} has {info.shape[0]} rows but {self.config_path} "
              f"says vocab_size={cfg.vocab_size}; the vocabulary of config.json and the "
              f"weights must agree: fix vocab_size in {CONFIG}")
    return (f"{info.file}: tensor {name} has shape {list(info.shape)} but {self.config_path} "
            f"implies {list(shape)}; config.json does not belong to these weights")

  def _check_tied(self, cfg: LlamaConfig, found: dict[str, TensorInfo]) -> None:
    head_name, embedding_name = self.architecture.head, self.architecture.embedding
    head, embed = found.get(head_name), found.get(embedding_name)
    if not cfg.tie_embeddings:
      if head is None:
        raise ConfigError(f"{self.config_path} says tie_word_embeddings=false but the weights "
                          f"hold no {head_name}; set tie_word_embeddings=true if the output "
                          f"layer shares the input embedding")
      return
    if head is None or embed is None:
      return
    same = head.shape == embed.shape
    for start in range(0, embed.shape[0] if same else 0, _COMPARE_ROWS):
      rows = (slice(start, min(start + _COMPARE_ROWS, embed.shape[0])), slice(None))
      same = np.array_equal(self.read(head_name, rows), self.read(embedding_name, rows))
      if not same:
        break
    if not same:
      raise ConfigError(f"{self.config_path} says tie_word_embeddings=true but {head_name} "
                        f"differs from {embedding_name}; set tie_word_embeddings=false to keep "
                        f"both")

  # --- reading -------------------------------------------------------------------------------
  def read(self, name: str, index: tuple[slice, ...]) -> np.ndarray:
    """Block `index` of tensor `name`. The file is opened (memory-mapped) for this one read
    and closed again, so no more than the block's pages stay resident."""
    from safetensors import safe_open  # pylint: disable=g-import-not-at-top
    with safe_open(self.tensors[name].local, framework="np") as f:
      return f.get_slice(name)[index]

  # --- tokens --------------------------------------------------------------------------------
  def special_tokens(self) -> tuple[int | None, tuple[int, ...]]:
    """(BOS id or None, EOS ids) from generation_config.json, else config.json."""
    return special_tokens(self.path)


def special_tokens(path: str) -> tuple[int | None, tuple[int, ...]]:
  """(BOS id or None, EOS ids) of a Hugging Face model folder (local or gs://):
  generation_config.json's when it has them, else config.json's; missing files give
  (None, ())."""
  bos, eos = None, None
  for name in (CONFIG, GENERATION_CONFIG):  # the later file wins, as in transformers
    file = workdir.join(path, name)
    if not (workdir.isfile(file) if workdir.is_url(file) else os.path.isfile(file)):
      continue
    values = read_json(file, "fix or remove it")
    bos = values.get("bos_token_id", bos)
    eos = values.get("eos_token_id", eos)
  eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
  if not (bos is None or isinstance(bos, int)) or not all(isinstance(i, int) for i in eos_ids):
    raise ConfigError(f"{path}: bos_token_id={bos!r} / eos_token_id={eos!r} must be integer "
                      f"token ids")
  return bos, eos_ids


def dtype(name: str) -> np.dtype:
  """numpy's dtype for a meshkit param_dtype or a safetensors dtype name."""
  import ml_dtypes  # pylint: disable=g-import-not-at-top
  name = _DTYPES.get(name, name)
  return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)
