"""A Vision Transformer classifier: patch embedding, a stack of encoder blocks, pooling, head.

The encoder blocks are the LM's own (`models.llama.Block`: RMSNorm, rotary multi-head
attention, SwiGLU), run bidirectionally (`causal=False`), so both models share one tested
block. Patches also get a learned position embedding; rotary positions are the patch's index
in raster order. Pooling is the mean over patch tokens (`gap`, as big_vision's "better plain
ViT baselines") or a class token (`cls`, as the original ViT). The head is zero-initialized.

Parameters carry logical axes (`patch`, `embed`, `length`, `classes`, and the block's own);
layers are stacked along `layers` as in the LM.
"""
from __future__ import annotations

import dataclasses
from typing import Literal

import jax
import jax.numpy as jnp
from flax import nnx

from models.llama import Block, LlamaConfig, RMSNorm
from models.stack import RematPolicy, run_layers
from sharding import constrain

Pool = Literal["gap", "cls"]


@dataclasses.dataclass(frozen=True)
class ViTConfig:
  """Image and encoder shapes. Images are (image_size, image_size, channels)."""
  image_size: int = 8
  patch_size: int = 2
  channels: int = 1
  num_classes: int = 10
  d_model: int = 64
  n_layers: int = 4
  n_heads: int = 4
  mlp_dim: int = 128
  pool: Pool = "gap"
  rope_theta: float = 100.0
  norm_eps: float = 1e-6
  init_std: float = 0.02
  param_dtype: str = "float32"
  compute_dtype: str = "float32"
  remat: RematPolicy = "none"
  scan_layers: bool = True

  @property
  def num_patches(self) -> int:
    return (self.image_size // self.patch_size) ** 2

  @property
  def num_tokens(self) -> int:
    return self.num_patches + (self.pool == "cls")

  @property
  def patch_features(self) -> int:
    return self.patch_size * self.patch_size * self.channels

  def block_config(self) -> LlamaConfig:
    """The encoder block's config: the LM block, bidirectional, full multi-head attention."""
    return LlamaConfig(vocab_size=1, d_model=self.d_model, n_layers=self.n_layers,
                       n_heads=self.n_heads, n_kv_heads=self.n_heads, mlp_dim=self.mlp_dim,
                       rope_theta=self.rope_theta, norm_eps=self.norm_eps,
                       init_std=self.init_std, param_dtype=self.param_dtype,
                       compute_dtype=self.compute_dtype, remat=self.remat,
                       scan_layers=self.scan_layers, causal=False)

  @classmethod
  def preset(cls, name: str, **overrides) -> ViTConfig:
    if name not in PRESETS:
      raise ValueError(f"ViT preset {name!r} is unknown; choose one of {', '.join(PRESETS)}")
    return dataclasses.replace(PRESETS[name], **overrides)

  def validate(self, field: str = "model") -> None:
    """Raises ValueError naming the field and the fix."""
    for name in ("image_size", "patch_size", "channels", "num_classes", "d_model", "n_layers",
                 "n_heads", "mlp_dim"):
      if getattr(self, name) < 1:
        raise ValueError(f"{field}.{name}={getattr(self, name)} must be >= 1")
    if self.image_size % self.patch_size:
      raise ValueError(f"{field}.image_size={self.image_size} is not divisible by "
                       f"{field}.patch_size={self.patch_size}; pick a patch size that tiles "
                       f"the image")
    if self.pool not in ("gap", "cls"):
      raise ValueError(f"{field}.pool={self.pool!r}; use 'gap' (mean of patch tokens) or 'cls'")
    try:
      self.block_config().validate(field)
    except ValueError as e:
      raise ValueError(str(e)) from None

  def num_params(self) -> int:
    d = self.d_model
    block = 4 * d * d + 3 * d * self.mlp_dim + 2 * d
    return (self.patch_features * d + d + self.num_tokens * d + (d if self.pool == "cls" else 0)
            + self.n_layers * block + d + d * self.num_classes + self.num_classes)

  def flops_per_example(self) -> float:
    """Training FLOPs per image (forward + backward), counted like
    `LlamaConfig.flops_per_token`: 6 x matmul parameters per token plus the block's attention
    (bidirectional: every token pair, no causal halving)."""
    d, t = self.d_model, self.num_tokens
    per_token = self.n_layers * (4 * d * d + 3 * d * self.mlp_dim)
    matmuls = 6 * (per_token * t + self.patch_features * d * self.num_patches
                   + d * self.num_classes)
    return matmuls + self.block_config().attention_flops_per_token(t) * t


PRESETS: dict[str, ViTConfig] = {
    # Unit tests: a few thousand parameters on 8x8 one-channel images.
    "tiny": ViTConfig(d_model=32, n_layers=2, n_heads=4, mlp_dim=64),
    # scikit-learn's 8x8 handwritten digits (experiments/vit.py:cpu): ~0.17 M parameters.
    # Four 4x4 patches: 2x2 patches (16 tokens) learned 2.5x slower per step and, over seeds,
    # generalized worse (experiments/vit.py has the measurements). Its 4 layers run unrolled:
    # scanned, XLA:CPU trained it 1.14x slower (scripts/bench/bench_train.py, docs/benchmarks.md);
    # the weights are stacked either way (models/stack.py), so checkpoints are unchanged.
    "digits": ViTConfig(patch_size=4, scan_layers=False),
    # ViT-B/16 shapes on ImageNet (224x224x3, 1000 classes) for ahead-of-time compiles. The
    # SwiGLU MLP's 3 matrices of width 2048 hold as many weights as ViT-B's 2 of 3072: 86 M.
    "b16": ViTConfig(image_size=224, patch_size=16, channels=3, num_classes=1000, d_model=768,
                     n_layers=12, n_heads=12, mlp_dim=2048, rope_theta=10_000.0,
                     compute_dtype="bfloat16"),
}


def _param(rngs: nnx.Rngs, shape: tuple[int, ...], axes: tuple[str, ...], std: float,
           dtype: str) -> nnx.Param:
  value = std * jax.random.normal(rngs.params(), shape, jnp.float32)
  return nnx.Param(value.astype(dtype), out_sharding=axes, eager_sharding=False)


def _zeros(shape: tuple[int, ...], axes: tuple[str, ...], dtype: str) -> nnx.Param:
  return nnx.Param(jnp.zeros(shape, dtype), out_sharding=axes, eager_sharding=False)


def patchify(images: jax.Array, patch_size: int) -> jax.Array:
  """(batch, H, W, C) -> (batch, H/p * W/p, p * p * C), patches in raster order."""
  b, h, w, c = images.shape
  p = patch_size
  x = images.reshape(b, h // p, p, w // p, p, c).transpose(0, 1, 3, 2, 4, 5)
  return x.reshape(b, (h // p) * (w // p), p * p * c)


class ViT(nnx.Module):
  """images (batch, H, W, C) float -> logits (batch, num_classes) float32."""

  def __init__(self, cfg: ViTConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    d, std = cfg.d_model, cfg.init_std
    self.patch_embed = _param(rngs, (cfg.patch_features, d), ("patch", "embed"),
                              (1.0 / cfg.patch_features) ** 0.5, cfg.param_dtype)
    self.patch_bias = _zeros((d,), ("embed",), cfg.param_dtype)
    self.position_embed = _param(rngs, (cfg.num_tokens, d), ("length", "embed"), std,
                                 cfg.param_dtype)
    if cfg.pool == "cls":
      self.class_token = _zeros((d,), ("embed",), cfg.param_dtype)
    block_cfg = cfg.block_config()
    layer_keys = jax.random.split(rngs.params(), cfg.n_layers)
    make_layers = nnx.vmap(lambda key: Block(block_cfg, nnx.Rngs(params=key)),
                           in_axes=0, out_axes=0,
                           transform_metadata={nnx.PARTITION_NAME: "layers"})
    self.layers = make_layers(layer_keys)
    self.final_norm = RMSNorm(block_cfg)
    self.head = _zeros((d, cfg.num_classes), ("embed", "classes"), cfg.param_dtype)
    self.head_bias = _zeros((cfg.num_classes,), ("classes",), cfg.param_dtype)

  def __call__(self, images: jax.Array) -> jax.Array:
    cfg = self.cfg
    dtype = jnp.dtype(cfg.compute_dtype)
    patches = patchify(images.astype(dtype), cfg.patch_size)
    x = patches @ self.patch_embed[...].astype(dtype) + self.patch_bias[...].astype(dtype)
    if cfg.pool == "cls":
      token = jnp.broadcast_to(self.class_token[...].astype(dtype), (x.shape[0], 1, x.shape[2]))
      x = jnp.concatenate([token, x], axis=1)
    x = constrain(x + self.position_embed[...].astype(dtype), ("batch", "length", "embed"))
    positions = jnp.broadcast_to(jnp.arange(x.shape[1]), x.shape[:2])
    x = self.final_norm(self._run_layers(x, positions))
    pooled = x[:, 0] if cfg.pool == "cls" else jnp.mean(x, axis=1)
    logits = pooled @ self.head[...].astype(dtype) + self.head_bias[...].astype(dtype)
    return constrain(logits.astype(jnp.float32), ("batch", "classes"))

  def _run_layers(self, x: jax.Array, positions: jax.Array) -> jax.Array:
    return run_layers(self.layers, self.cfg, x, positions)[0]  # the LM's layer loop
