"""Model modules (Flax NNX) and their frozen configs. Models speak only logical axis names."""
from models.llama import Llama, LlamaConfig
from models.vit import ViT, ViTConfig

# config.model.kind -> (config dataclass, module): the one place a model family is named.
KINDS = {"llama": (LlamaConfig, Llama), "vit": (ViTConfig, ViT)}


def kind_of(model_config) -> str:
  """The `config.model.kind` of a model config dataclass."""
  return next(kind for kind, (cls, _) in KINDS.items() if isinstance(model_config, cls))


def build_model(model_config, rngs):
  """The module for `model_config` (a LlamaConfig, ViTConfig, ...)."""
  return KINDS[kind_of(model_config)][1](model_config, rngs=rngs)


__all__ = ["KINDS", "Llama", "LlamaConfig", "ViT", "ViTConfig", "build_model", "kind_of"]
