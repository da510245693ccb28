"""Hugging Face `MixtralForCausalLM` <-> meshkit's Llama with a mixture of experts in every
layer (`n_experts` > 0, `moe_every` 1): config.json fields and the tensor table.

Attention, norms and embeddings are Llama's (`toolkit.hf.llama`); the MLP is Mixtral's sparse
block: router `block_sparse_moe.gate` (experts, embed) and per expert `w1` (gate), `w3` (up),
`w2` (down), stored one tensor per expert as on the Hub (transformers 5 fuses them in memory
but writes this layout). The routing is the same computation: softmax over all experts, the
top `num_experts_per_tok`, renormalized.
"""
from __future__ import annotations

import dataclasses

from models import LlamaConfig
from toolkit.errors import ConfigError
from toolkit.hf import llama
from toolkit.hf.tensors import EXPERT, LAYER, TensorMap

ARCHITECTURE = "MixtralForCausalLM"
MODEL_TYPE = "mixtral"
HEAD, EMBEDDING, IGNORED = llama.HEAD, llama.EMBEDDING, llama.IGNORED


def model_config(hf: dict, base: LlamaConfig, where: str = "config.json") -> LlamaConfig:
  """meshkit's config for a Mixtral config.json (see `llama.model_config` for the shared
  fields). Hugging Face's router_aux_loss_coef weighs a load-balancing loss k times meshkit's
  (it sums over the k choices), so load_balance_weight = coef * k. Refuses a sliding window."""
  if hf.get("sliding_window") is not None:
    raise ConfigError(f"{where}: sliding_window={hf['sliding_window']!r}; meshkit attends to "
                      f"the whole context (use a checkpoint with sliding_window null)")
  experts, per_token = hf.get("num_local_experts"), hf.get("num_experts_per_tok", 2)
  for key, value in (("num_local_experts", experts), ("num_experts_per_tok", per_token)):
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
      raise ConfigError(f"{where}: {key}={value!r}; a Mixtral config.json needs a positive "
                        f"integer {key}")
  return llama.model_config(
      hf, base, where, model_type=MODEL_TYPE, n_experts=experts, experts_per_token=per_token,
      moe_every=1, load_balance_weight=float(hf.get("router_aux_loss_coef", 0.001)) * per_token)


def hf_config(cfg: LlamaConfig) -> dict:
  """The config.json fields that describe `cfg`; every layer must be a mixture of experts."""
  if cfg.moe_every != 1:
    raise ConfigError(f"model.moe_every={cfg.moe_every}: MixtralForCausalLM has experts in "
                      f"every layer; only a model with moe_every=1 exports to it")
  fields = {key: value for key, value in llama.hf_config(cfg).items()
            if key not in ("mlp_bias", "pretraining_tp")}
  return {**fields, "architectures": [ARCHITECTURE], "model_type": MODEL_TYPE,
          "num_local_experts": cfg.n_experts, "num_experts_per_tok": cfg.experts_per_token,
          "router_aux_loss_coef": cfg.load_balance_weight / cfg.experts_per_token,
          "router_jitter_noise": 0.0, "output_router_logits": False, "sliding_window": None}


def tensors(cfg: LlamaConfig) -> list[TensorMap]:
  """Llama's table with the MLP's three tensors replaced by the router and the experts'."""
  d, mlp, experts = cfg.d_model, cfg.mlp_dim, cfg.n_experts
  moe = f"model.layers.{LAYER}.block_sparse_moe"
  expert = f"{moe}.experts.{EXPERT}"
  table = [entry for entry in llama.tensors(dataclasses.replace(cfg, n_experts=0))
           if not entry.path.startswith("layers/mlp/")]
  return table + [
      TensorMap("layers/mlp/router", f"{moe}.gate.weight", ((experts,), (d,)), (1, 0)),
      TensorMap("layers/mlp/w_down", f"{expert}.w2.weight", ((d,), (mlp,)), (1, 0), experts),
      TensorMap("layers/mlp/w_gate", f"{expert}.w1.weight", ((mlp,), (d,)), (1, 0), experts),
      TensorMap("layers/mlp/w_up", f"{expert}.w3.weight", ((mlp,), (d,)), (1, 0), experts),
  ]
