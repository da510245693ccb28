"""Hugging Face `LlamaForCausalLM` <-> meshkit's Llama: config.json fields and the tensor table.

meshkit's Llama already computes what Hugging Face's does (rotate-half RoPE on q and k as
stored, 1/sqrt(head_dim) attention, grouped-query heads, RMSNorm, SwiGLU, no biases), so
the weights need only transposing and reshaping (`toolkit.hf.tensors`), never permuting.
Meta's original `.pth` files store q and k with RoPE pairs interleaved; they are not read here.
"""
from __future__ import annotations

import dataclasses

from models import LlamaConfig
from toolkit.errors import ConfigError
from toolkit.hf.tensors import LAYER, TensorMap

ARCHITECTURE = "LlamaForCausalLM"
MODEL_TYPE = "llama"
_LLAMA3_FIELDS = {"factor": "rope_factor", "low_freq_factor": "rope_low_freq_factor",
                  "high_freq_factor": "rope_high_freq_factor",
                  "original_max_position_embeddings": "rope_original_max_positions"}
# The output head and the input embedding: one tensor (the embedding) when tied.
HEAD, EMBEDDING = "lm_head.weight", "model.embed_tokens.weight"
# Tensors some checkpoints carry that hold nothing meshkit needs (old RoPE caches).
IGNORED = (r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq",)


def _positive_int(hf: dict, key: str, where: str) -> int:
  value = hf.get(key)
  if isinstance(value, bool) or not isinstance(value, int) or value < 1:
    raise ConfigError(f"{where}: {key}={value!r}; a Llama config.json needs a positive integer "
                      f"{key}")
  return value


def _rope(hf: dict, where: str) -> dict:
  """meshkit's rope_* fields from `rope_theta` + `rope_scaling` (transformers 4 and the Hub's
  files) or `rope_parameters` (transformers 5)."""
  rope = {**(hf.get("rope_scaling") or {}), **(hf.get("rope_parameters") or {})}
  fields = {"rope_theta": float(rope.get("rope_theta", hf.get("rope_theta", 10_000.0)))}
  rope_type = rope.get("rope_type", rope.get("type", "default"))
  if rope_type == "default":
    return {**fields, "rope_type": "default"}
  if rope_type != "llama3":
    raise ConfigError(f"{where}: rope_scaling rope_type={rope_type!r} is not supported; meshkit "
                      f"implements 'default' (no scaling) and 'llama3' (Llama 3.1+)")
  for key in _LLAMA3_FIELDS:
    if not isinstance(rope.get(key), (int, float)):
      raise ConfigError(f"{where}: rope_scaling rope_type='llama3' needs a number for {key} "
                        f"(got {rope.get(key)!r})")
  return {**fields, "rope_type": "llama3",
          **{name: type(getattr(LlamaConfig, name))(rope[key])
             for key, name in _LLAMA3_FIELDS.items()}}


def model_config(hf: dict, base: LlamaConfig, where: str = "config.json",
                 model_type: str = MODEL_TYPE, **fields) -> LlamaConfig:
  """meshkit's config for a Llama config.json. Fields Hugging Face does not describe (compute
  dtype, remat, scan, parameter dtype) come from `base`. Refuses, naming the field, what the
  model cannot compute: biases, another activation, an unsupported RoPE scaling. `model_type`:
  what config.json must say; `fields`: more of meshkit's fields, validated with the rest
  (Mixtral's reads its attention and sizes through here and adds its experts)."""
  if hf.get("model_type", model_type) != model_type:
    raise ConfigError(f"{where}: model_type={hf.get('model_type')!r} is not {model_type!r}")
  act = hf.get("hidden_act", "silu")
  if act not in ("silu", "swish"):
    raise ConfigError(f"{where}: hidden_act={act!r}; meshkit's Llama MLP is SwiGLU (silu)")
  for key in ("attention_bias", "mlp_bias"):
    if hf.get(key):
      raise ConfigError(f"{where}: {key}=true; meshkit's Llama has no biases")
  d_model = _positive_int(hf, "hidden_size", where)
  n_heads = _positive_int(hf, "num_attention_heads", where)
  head_dim = hf.get("head_dim") or 0
  cfg = dataclasses.replace(
      base, vocab_size=_positive_int(hf, "vocab_size", where), d_model=d_model,
      n_layers=_positive_int(hf, "num_hidden_layers", where), n_heads=n_heads,
      n_kv_heads=hf.get("num_key_value_heads") or n_heads,
      head_dim=0 if head_dim * n_heads == d_model else head_dim,
      mlp_dim=_positive_int(hf, "intermediate_size", where),
      norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
      tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
      init_std=float(hf.get("initializer_range", base.init_std)), causal=True,
      **_rope(hf, where), **fields)
  try:
    cfg.validate("model")
  except ValueError as e:
    raise ConfigError(f"{where}: {e}") from None
  return cfg


def hf_config(cfg: LlamaConfig) -> dict:
  """The config.json fields that describe `cfg` (the Hub's spelling, which transformers 4 and
  5 both read). Token ids and max_position_embeddings are the caller's."""
  rope_scaling = None
  if cfg.rope_type == "llama3":
    rope_scaling = {"rope_type": "llama3", **{key: getattr(cfg, name)
                                              for key, name in _LLAMA3_FIELDS.items()}}
  return {
      "architectures": [ARCHITECTURE], "model_type": MODEL_TYPE,
      "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model,
      "intermediate_size": cfg.mlp_dim, "num_hidden_layers": cfg.n_layers,
      "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads,
      "head_dim": cfg.resolved_head_dim, "hidden_act": "silu", "rms_norm_eps": cfg.norm_eps,
      "rope_theta": cfg.rope_theta, "rope_scaling": rope_scaling,
      "tie_word_embeddings": cfg.tie_embeddings, "attention_bias": False, "mlp_bias": False,
      "attention_dropout": 0.0, "initializer_range": cfg.init_std, "pretraining_tp": 1,
      "torch_dtype": cfg.param_dtype, "use_cache": True,
  }


def tensors(cfg: LlamaConfig) -> list[TensorMap]:
  """Every meshkit parameter and the HF tensor(s) it comes from, in meshkit's tree order."""
  d, heads, kv_heads = cfg.d_model, cfg.n_heads, cfg.n_kv_heads
  hd, mlp, vocab = cfg.resolved_head_dim, cfg.mlp_dim, cfg.vocab_size
  layer = f"model.layers.{LAYER}"
  table = [
      TensorMap("embed", EMBEDDING, ((vocab,), (d,)), (0, 1)),
      TensorMap("final_norm/scale", "model.norm.weight", ((d,),), (0,)),
      # Linear layers: HF (out, in) -> meshkit (in, out), with heads as their own axes.
      TensorMap("layers/attention/wk", f"{layer}.self_attn.k_proj.weight",
                ((kv_heads, hd), (d,)), (2, 0, 1)),
      TensorMap("layers/attention/wo", f"{layer}.self_attn.o_proj.weight",
                ((d,), (heads, hd)), (1, 2, 0)),
      TensorMap("layers/attention/wq", f"{layer}.self_attn.q_proj.weight",
                ((heads, hd), (d,)), (2, 0, 1)),
      TensorMap("layers/attention/wv", f"{layer}.self_attn.v_proj.weight",
                ((kv_heads, hd), (d,)), (2, 0, 1)),
      TensorMap("layers/attention_norm/scale", f"{layer}.input_layernorm.weight", ((d,),), (0,)),
      TensorMap("layers/mlp/w_down", f"{layer}.mlp.down_proj.weight", ((d,), (mlp,)), (1, 0)),
      TensorMap("layers/mlp/w_gate", f"{layer}.mlp.gate_proj.weight", ((mlp,), (d,)), (1, 0)),
      TensorMap("layers/mlp/w_up", f"{layer}.mlp.up_proj.weight", ((mlp,), (d,)), (1, 0)),
      TensorMap("layers/mlp_norm/scale", f"{layer}.post_attention_layernorm.weight",
                ((d,),), (0,)),
  ]
  if not cfg.tie_embeddings:
    table.append(TensorMap("unembed", HEAD, ((vocab,), (d,)), (1, 0)))
  return table
