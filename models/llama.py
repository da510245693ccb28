"""A Llama-style decoder LM: RMSNorm, rotary positions, grouped-query causal attention, SwiGLU.

Every parameter carries logical axis names in its ``out_sharding`` metadata; activations are
constrained at block boundaries through `sharding.constrain`, which is a no-op unless the
caller activated rules for a mesh. Layers are stored stacked along a leading `layers` axis so
the parameter tree is the same whether the forward pass scans over layers or unrolls them.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Literal

import jax
import jax.numpy as jnp
from flax import nnx

from sharding import constrain

RematPolicy = Literal["none", "full", "save_dots"]


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
  """Shapes and numerics of the decoder. `head_dim` 0 means d_model // n_heads."""
  vocab_size: int = 256
  d_model: int = 128
  n_layers: int = 4
  n_heads: int = 4
  n_kv_heads: int = 2
  head_dim: int = 0
  mlp_dim: int = 384
  rope_theta: float = 10_000.0
  norm_eps: float = 1e-5
  tie_embeddings: bool = False
  init_std: float = 0.02
  param_dtype: str = "float32"
  compute_dtype: str = "float32"
  remat: RematPolicy = "none"
  scan_layers: bool = True

  @property
  def resolved_head_dim(self) -> int:
    return self.head_dim or self.d_model // self.n_heads

  @classmethod
  def preset(cls, name: str, **overrides) -> LlamaConfig:
    if name not in PRESETS:
      raise ValueError(f"model preset {name!r} is unknown; choose one of {', '.join(PRESETS)}")
    return dataclasses.replace(PRESETS[name], **overrides)

  def validate(self, field: str = "model") -> None:
    """Raises ValueError naming the field and the fix."""
    for name in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "mlp_dim"):
      if getattr(self, name) < 1:
        raise ValueError(f"{field}.{name}={getattr(self, name)} must be >= 1")
    if self.n_heads % self.n_kv_heads:
      raise ValueError(
          f"{field}.n_heads={self.n_heads} is not a multiple of {field}.n_kv_heads="
          f"{self.n_kv_heads}; grouped-query attention needs heads = k * kv_heads")
    if not self.head_dim and self.d_model % self.n_heads:
      raise ValueError(
          f"{field}.d_model={self.d_model} is not divisible by {field}.n_heads={self.n_heads}; "
          f"set {field}.head_dim explicitly")
    if self.resolved_head_dim % 2:
      raise ValueError(f"{field}: head_dim {self.resolved_head_dim} must be even for rotary "
                       f"embeddings")
    for name in ("param_dtype", "compute_dtype"):
      if getattr(self, name) not in ("float32", "bfloat16"):
        raise ValueError(f"{field}.{name}={getattr(self, name)!r}; use 'float32' or 'bfloat16'")
    if self.remat not in ("none", "full", "save_dots"):
      raise ValueError(f"{field}.remat={self.remat!r}; use 'none', 'full' or 'save_dots'")

  def num_params(self) -> int:
    d, hd = self.d_model, self.resolved_head_dim
    attention = d * hd * (2 * self.n_heads + 2 * self.n_kv_heads)
    block = attention + 3 * d * self.mlp_dim + 2 * d
    embeddings = self.vocab_size * d * (1 if self.tie_embeddings else 2)
    return self.n_layers * block + embeddings + d

  def flops_per_token(self, seq_len: int) -> float:
    """Training FLOPs per token (forward + backward): 6 x matmul parameters plus attention
    scores and values, counted as in the PaLM paper's appendix B (no causal discount)."""
    d, hd = self.d_model, self.resolved_head_dim
    matmul_params = (self.n_layers * (d * hd * (2 * self.n_heads + 2 * self.n_kv_heads)
                                      + 3 * d * self.mlp_dim) + self.vocab_size * d)
    attention = 12 * self.n_layers * self.n_heads * hd * seq_len
    return 6 * matmul_params + attention


PRESETS: dict[str, LlamaConfig] = {
    # For unit tests: a few hundred kB of parameters.
    "tiny": LlamaConfig(vocab_size=256, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                        mlp_dim=64),
    # The CPU demo: ~0.9 M parameters, byte-level vocabulary.
    "cpu": LlamaConfig(vocab_size=256, d_model=128, n_layers=4, n_heads=4, n_kv_heads=2,
                       mlp_dim=384),
    # Real shapes for ahead-of-time compiles. 125m: GPT-3 Small widths with a Llama MLP and
    # untied 32k vocabulary (134 M in all, 85 M without embeddings); 1b is Llama 3.2 1B,
    # 7b Llama 2 7B, 70b Llama 2 70B (32k vocab).
    "125m": LlamaConfig(vocab_size=32_000, d_model=768, n_layers=12, n_heads=12, n_kv_heads=12,
                        mlp_dim=2048, param_dtype="float32", compute_dtype="bfloat16"),
    "1b": LlamaConfig(vocab_size=128_256, d_model=2048, n_layers=16, n_heads=32, n_kv_heads=8,
                      mlp_dim=8192, rope_theta=500_000.0, tie_embeddings=True,
                      compute_dtype="bfloat16", remat="save_dots"),
    "7b": LlamaConfig(vocab_size=32_000, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=32,
                      mlp_dim=11_008, compute_dtype="bfloat16", remat="save_dots"),
    "70b": LlamaConfig(vocab_size=32_000, d_model=8192, n_layers=80, n_heads=64, n_kv_heads=8,
                       mlp_dim=28_672, compute_dtype="bfloat16", remat="full"),
}


def _param(rngs: nnx.Rngs, shape: tuple[int, ...], axes: tuple[str, ...], std: float,
           dtype: str) -> nnx.Param:
  value = std * jax.random.normal(rngs.params(), shape, jnp.float32)
  # eager_sharding=False: the names are logical; meshkit's rules resolve them, not Flax.
  return nnx.Param(value.astype(dtype), out_sharding=axes, eager_sharding=False)


class RMSNorm(nnx.Module):
  def __init__(self, cfg: LlamaConfig):
    self.eps = cfg.norm_eps
    self.scale = nnx.Param(jnp.ones((cfg.d_model,), cfg.param_dtype), out_sharding=("norm",),
                           eager_sharding=False)

  def __call__(self, x: jax.Array) -> jax.Array:
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
    return (normed * self.scale[...].astype(jnp.float32)).astype(x.dtype)


def rotary(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
  """Rotary embedding, rotate-half convention. x: (batch, length, heads, head_dim)."""
  half = x.shape[-1] // 2
  inv_freq = 1.0 / theta ** (jnp.arange(half, dtype=jnp.float32) / half)
  angles = positions[..., None].astype(jnp.float32) * inv_freq  # (batch, length, half)
  sin, cos = jnp.sin(angles)[:, :, None, :], jnp.cos(angles)[:, :, None, :]
  x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


class Attention(nnx.Module):
  def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs):
    d, hd, std = cfg.d_model, cfg.resolved_head_dim, cfg.init_std
    out_std = std / math.sqrt(2 * cfg.n_layers)
    self.cfg = cfg
    self.wq = _param(rngs, (d, cfg.n_heads, hd), ("embed", "heads", "head_dim"), std,
                     cfg.param_dtype)
    self.wk = _param(rngs, (d, cfg.n_kv_heads, hd), ("embed", "kv_heads", "head_dim"), std,
                     cfg.param_dtype)
    self.wv = _param(rngs, (d, cfg.n_kv_heads, hd), ("embed", "kv_heads", "head_dim"), std,
                     cfg.param_dtype)
    self.wo = _param(rngs, (cfg.n_heads, hd, d), ("heads", "head_dim", "embed"), out_std,
                     cfg.param_dtype)

  def __call__(self, x: jax.Array, positions: jax.Array) -> jax.Array:
    dtype = x.dtype
    q = jnp.einsum("bte,ehd->bthd", x, self.wq[...].astype(dtype))
    k = jnp.einsum("bte,ehd->bthd", x, self.wk[...].astype(dtype))
    v = jnp.einsum("bte,ehd->bthd", x, self.wv[...].astype(dtype))
    q = constrain(rotary(q, positions, self.cfg.rope_theta), ("batch", "length", "heads", None))
    k = constrain(rotary(k, positions, self.cfg.rope_theta), ("batch", "length", "kv_heads", None))
    v = constrain(v, ("batch", "length", "kv_heads", None))
    out = jax.nn.dot_product_attention(q, k, v, is_causal=True)
    return jnp.einsum("bthd,hde->bte", out, self.wo[...].astype(dtype))


class MLP(nnx.Module):
  def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs):
    d, std = cfg.d_model, cfg.init_std
    self.w_gate = _param(rngs, (d, cfg.mlp_dim), ("embed", "mlp"), std, cfg.param_dtype)
    self.w_up = _param(rngs, (d, cfg.mlp_dim), ("embed", "mlp"), std, cfg.param_dtype)
    self.w_down = _param(rngs, (cfg.mlp_dim, d), ("mlp", "embed"),
                         std / math.sqrt(2 * cfg.n_layers), cfg.param_dtype)

  def __call__(self, x: jax.Array) -> jax.Array:
    dtype = x.dtype
    gate = x @ self.w_gate[...].astype(dtype)
    hidden = constrain(jax.nn.silu(gate) * (x @ self.w_up[...].astype(dtype)),
                       ("batch", "length", "mlp"))
    return hidden @ self.w_down[...].astype(dtype)


class Block(nnx.Module):
  """Pre-norm transformer block; input and output (batch, length, embed)."""

  def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs):
    self.attention_norm = RMSNorm(cfg)
    self.attention = Attention(cfg, rngs)
    self.mlp_norm = RMSNorm(cfg)
    self.mlp = MLP(cfg, rngs)

  def __call__(self, x: jax.Array, positions: jax.Array) -> jax.Array:
    x = x + self.attention(self.attention_norm(x), positions)
    x = x + self.mlp(self.mlp_norm(x))
    return constrain(x, ("batch", "length", "embed"))


_REMAT_POLICIES = {
    "full": None,  # save nothing: recompute the whole block in the backward pass
    "save_dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


class Llama(nnx.Module):
  """tokens (batch, length) int32 -> logits (batch, length, vocab) float32."""

  def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    self.embed = _param(rngs, (cfg.vocab_size, cfg.d_model), ("vocab", "embed"), cfg.init_std,
                        cfg.param_dtype)
    layer_keys = jax.random.split(rngs.params(), cfg.n_layers)
    make_layers = nnx.vmap(lambda key: Block(cfg, nnx.Rngs(params=key)),
                           in_axes=0, out_axes=0,
                           transform_metadata={nnx.PARTITION_NAME: "layers"})
    self.layers = make_layers(layer_keys)
    self.final_norm = RMSNorm(cfg)
    if not cfg.tie_embeddings:
      self.unembed = _param(rngs, (cfg.d_model, cfg.vocab_size), ("embed", "vocab"),
                            cfg.init_std, cfg.param_dtype)

  def __call__(self, tokens: jax.Array, positions: jax.Array | None = None) -> jax.Array:
    cfg = self.cfg
    if positions is None:
      positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    x = jnp.take(self.embed[...], tokens, axis=0).astype(cfg.compute_dtype)
    x = constrain(x, ("batch", "length", "embed"))
    x = self._run_layers(x, positions)
    x = self.final_norm(x)
    if cfg.tie_embeddings:
      logits = jnp.einsum("bte,ve->btv", x, self.embed[...].astype(x.dtype))
    else:
      logits = x @ self.unembed[...].astype(x.dtype)
    return constrain(logits.astype(jnp.float32), ("batch", "length", "vocab"))

  def _run_layers(self, x: jax.Array, positions: jax.Array) -> jax.Array:
    graphdef, stacked = nnx.split(self.layers)

    def body(carry: jax.Array, layer_state) -> tuple[jax.Array, None]:
      return nnx.merge(graphdef, layer_state)(carry, positions), None

    if self.cfg.remat != "none":
      body = jax.checkpoint(body, policy=_REMAT_POLICIES[self.cfg.remat])
    if self.cfg.scan_layers:
      x, _ = jax.lax.scan(body, x, stacked)
      return x
    for i in range(self.cfg.n_layers):
      x, _ = body(x, jax.tree.map(lambda a, i=i: a[i], stacked))
    return x
