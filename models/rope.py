"""Rotary position embeddings (RoPE) of the Llama models: the inverse frequencies, with Llama
3's long-context scaling when `rope_type` is "llama3", and the rotation itself. `cfg` is a
`models.llama.LlamaConfig` (its rope_* fields and resolved_head_dim)."""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp

ROPE_TYPES = ("default", "llama3")


def validate(cfg, field: str) -> None:
  """Raises ValueError naming the field and the fix when cfg's rope_* fields are unusable."""
  if cfg.rope_type not in ROPE_TYPES:
    raise ValueError(f"{field}.rope_type={cfg.rope_type!r}; use one of "
                     f"{', '.join(map(repr, ROPE_TYPES))}")
  if not cfg.rope_theta > 0:
    raise ValueError(f"{field}.rope_theta={cfg.rope_theta} must be > 0")
  if cfg.rope_type == "llama3" and not (
      cfg.rope_factor >= 1 and 0 < cfg.rope_low_freq_factor < cfg.rope_high_freq_factor
      and cfg.rope_original_max_positions >= 1):
    raise ValueError(
        f"{field}: rope_type='llama3' needs rope_factor >= 1 (got {cfg.rope_factor}), "
        f"0 < rope_low_freq_factor < rope_high_freq_factor (got {cfg.rope_low_freq_factor}, "
        f"{cfg.rope_high_freq_factor}) and rope_original_max_positions >= 1 (got "
        f"{cfg.rope_original_max_positions})")


def frequencies(cfg) -> jax.Array:
  """The rotary inverse frequencies (head_dim // 2,) float32: theta^(-2i / head_dim), with
  Llama 3's scaling applied when cfg.rope_type == "llama3"."""
  half = cfg.resolved_head_dim // 2
  inv_freq = 1.0 / cfg.rope_theta ** (jnp.arange(half, dtype=jnp.float32) / half)
  if cfg.rope_type == "default":
    return inv_freq
  wavelength = 2 * math.pi / inv_freq
  original = cfg.rope_original_max_positions
  # 0 at the low-frequency edge (wavelength original / low_freq_factor), 1 at the high one.
  smooth = ((original / wavelength - cfg.rope_low_freq_factor)
            / (cfg.rope_high_freq_factor - cfg.rope_low_freq_factor))
  scaled = jnp.where(wavelength > original / cfg.rope_low_freq_factor,
                     inv_freq / cfg.rope_factor, inv_freq)
  medium = ((wavelength >= original / cfg.rope_high_freq_factor)
            & (wavelength <= original / cfg.rope_low_freq_factor))
  return jnp.where(medium, (1 - smooth) * inv_freq / cfg.rope_factor + smooth * inv_freq, scaled)


def rotary(x: jax.Array, positions: jax.Array, inv_freq: jax.Array) -> jax.Array:
  """Rotary embedding, rotate-half convention. x: (batch, length, heads, head_dim);
  inv_freq (head_dim // 2,) from `frequencies`."""
  angles = positions[..., None].astype(jnp.float32) * inv_freq  # (batch, length, half)
  sin, cos = jnp.sin(angles)[:, :, None, :], jnp.cos(angles)[:, :, None, :]
  x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)
