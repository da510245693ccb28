"""Parameter creation shared by the model modules: values with their logical axis names."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx


def normal(rngs: nnx.Rngs, shape: tuple[int, ...], axes: tuple[str, ...], std: float,
           dtype: str) -> nnx.Param:
  """A parameter drawn from N(0, std^2) in float32, stored in `dtype`, named by `axes`."""
  value = std * jax.random.normal(rngs.params(), shape, jnp.float32)
  # eager_sharding=False: the names are logical; meshkit's rules resolve them, not Flax.
  return nnx.Param(value.astype(dtype), out_sharding=axes, eager_sharding=False)
