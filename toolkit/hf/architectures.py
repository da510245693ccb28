"""The one table of Hugging Face architectures meshkit reads and writes.

Each entry says how config.json maps to a meshkit model config and back, and which HF tensor
holds each meshkit parameter. A new architecture is one module like `toolkit/hf/llama.py`
(or `mixtral.py`) and one entry here.
"""
from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable

from models import LlamaConfig, kind_of
from toolkit.errors import ConfigError
from toolkit.hf import llama, mixtral
from toolkit.hf.tensors import TensorMap


@dataclasses.dataclass(frozen=True)
class Architecture:
  name: str                                            # config.json "architectures"[0]
  kind: str                                            # config.model.kind (models.KINDS)
  model_config: Callable[[dict, LlamaConfig, str], LlamaConfig]  # (config.json, base, where)
  hf_config: Callable[[LlamaConfig], dict]             # model config -> config.json fields
  tensors: Callable[[LlamaConfig], list[TensorMap]]    # the name and layout table
  head: str                                            # the output head's tensor ...
  embedding: str                                       # ... and the input embedding's
  ignored: tuple[str, ...] = ()                        # regexes of HF tensors to skip
  moe: bool = False                                    # writes models with n_experts > 0

  def is_ignored(self, name: str) -> bool:
    return any(re.fullmatch(pattern, name) for pattern in self.ignored)


ARCHITECTURES: dict[str, Architecture] = {
    llama.ARCHITECTURE: Architecture(llama.ARCHITECTURE, "llama", llama.model_config,
                                     llama.hf_config, llama.tensors, llama.HEAD,
                                     llama.EMBEDDING, llama.IGNORED),
    mixtral.ARCHITECTURE: Architecture(mixtral.ARCHITECTURE, "llama", mixtral.model_config,
                                       mixtral.hf_config, mixtral.tensors, mixtral.HEAD,
                                       mixtral.EMBEDDING, mixtral.IGNORED, moe=True),
}


def for_hf_config(hf: dict, where: str) -> Architecture:
  """The entry for a config.json's `architectures`; ConfigError naming it otherwise."""
  names = hf.get("architectures") or []
  if not isinstance(names, list) or len(names) != 1:
    raise ConfigError(f"{where}: architectures={names!r}; expected one of "
                      f"{', '.join(ARCHITECTURES)}")
  if names[0] not in ARCHITECTURES:
    raise ConfigError(f"{where}: architecture {names[0]!r} is not supported; meshkit reads "
                      f"{', '.join(ARCHITECTURES)}")
  return ARCHITECTURES[names[0]]


def for_model(model_cfg) -> Architecture:
  """The entry that writes a meshkit model config's family."""
  kind, moe = kind_of(model_cfg), getattr(model_cfg, "n_experts", 0) > 0
  for architecture in ARCHITECTURES.values():
    if architecture.kind == kind and architecture.moe == moe:
      return architecture
  raise ConfigError(f"model.kind={kind!r} has no Hugging Face architecture to export to; "
                    f"supported: {', '.join(sorted({a.kind for a in ARCHITECTURES.values()}))}")
