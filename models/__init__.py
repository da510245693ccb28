"""Model modules (Flax NNX) and their frozen configs. Models speak only logical axis names.

- `llama`, `llama_config`: the Llama-style decoder LM and its config with named presets;
- `vit`: the Vision Transformer classifier;
- `moe`: the mixture-of-experts feed-forward layer (Mixtral-style);
- `attention`, `blockwise`: attention implementations behind one call, and flash-style
  attention in plain JAX;
- `linear`, `params`: the matmul the layers share, and parameters with their logical axes;
- `rope`: rotary position embeddings;
- `stack`, `pipeline`: the layer stack (scanned or unrolled, under remat), and its stages for
  pipeline parallelism;
- `paged`: the paged KV cache for serving;
- `quantization`: int8 weights for serving;
- `lora`: LoRA adapters on the projections;
- `embedding_bag`: embedding tables looked up by bags of ids and pooled, placed row-wise,
  column-wise or replicated;
- `dlrm`: DLRM with a DCN-v2 cross network, for click prediction.
"""
from models.dlrm import DLRM, DLRMConfig
from models.llama import Llama, LlamaConfig
from models.vit import ViT, ViTConfig

# config.model.kind -> (config dataclass, module): the one place a model family is named.
KINDS = {"llama": (LlamaConfig, Llama), "vit": (ViTConfig, ViT), "dlrm": (DLRMConfig, DLRM)}


def kind_of(model_config) -> str:
  """The `config.model.kind` of a model config dataclass."""
  return next(kind for kind, (cls, _) in KINDS.items() if isinstance(model_config, cls))


def build_model(model_config, rngs):
  """The module for `model_config` (a LlamaConfig, ViTConfig, ...)."""
  return KINDS[kind_of(model_config)][1](model_config, rngs=rngs)


__all__ = ["DLRM", "DLRMConfig", "KINDS", "Llama", "LlamaConfig", "ViT", "ViTConfig",
           "build_model", "kind_of"]
