"""Int8 weight-only quantization for serving: each matrix of the layer stack stored as int8
with one float32 scale per output channel, turned back into the compute dtype one layer at a
time inside the decode loop (Llama._through_cache), so the weights cross memory at one byte per
value and no whole bfloat16 copy is ever held.

  q = round(w / scale) in [-127, 127], scale = max |w| over the contracted dimensions / 127

Which dimensions a weight contracts (its inputs) comes from its logical axes: `CONTRACTED`
names them per parameter (wq: embed; wo: heads and head_dim; w_down: mlp; the experts' w_gate,
w_up, w_down alike), so the scale keeps every other dimension, layers and experts included,
and is sharded like the weight along them. Embeddings, the unembedding, norms and the router
stay as they are: the unembedding decides the sampled token, and for the 7b the embeddings
are 4 % of the weights.

Why not a library. qwix (0.1.8) quantizes Flax modules by intercepting `dot_general`/`einsum`
calls and finding the weight among the module's parameters by identity; meshkit's layers cast
weights and reshape them into one matmul (models/linear.py) and run under nnx.split/merge
inside a scan, where that interception does not reach, and its quantized arrays carry no
logical axes for meshkit's rules. aqtp targets Linen's `dot_general` injection the same way.
This module is the ~60 lines those would replace; tests/models/test_quantization.py checks
the error bound per channel and the greedy agreement with bfloat16.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

# Parameter name -> the logical axes its matmul contracts (models/llama.py, models/moe.py).
CONTRACTED: dict[str, tuple[str, ...]] = {
    "wq": ("embed",), "wk": ("embed",), "wv": ("embed",), "wo": ("heads", "head_dim"),
    "w_gate": ("embed",), "w_up": ("embed",), "w_down": ("mlp",),
}
METHODS = ("none", "int8")


@struct.dataclass
class Int8Weight:
  """A quantized weight: `values` int8 of the weight's shape, `scale` float32 of the same rank
  with the contracted dimensions of size 1."""
  values: jax.Array
  scale: jax.Array

  @property
  def shape(self):
    return self.values.shape


def reduced_dims(path: str, logical_axes: tuple[str | None, ...]) -> tuple[int, ...] | None:
  """The dimensions a layer-stack weight at `path` (a "/"-joined parameter path) contracts, or
  None for a parameter that stays unquantized."""
  name = path.split("/")[-1]
  if not path.startswith("layers/") or name not in CONTRACTED:
    return None
  dims = tuple(i for i, axis in enumerate(logical_axes) if axis in CONTRACTED[name])
  return dims or None


def quantize(w: jax.Array, dims: tuple[int, ...]) -> Int8Weight:
  """Per-channel symmetric int8: one scale for every index of the dimensions not in `dims`."""
  w32 = w.astype(jnp.float32)
  scale = jnp.max(jnp.abs(w32), axis=dims, keepdims=True) / 127.0
  scale = jnp.where(scale > 0, scale, 1.0)  # an all-zero channel stays zero
  values = jnp.clip(jnp.round(w32 / scale), -127, 127).astype(jnp.int8)
  return Int8Weight(values, scale)


def dequantize(weight: Int8Weight, dtype) -> jax.Array:
  return (weight.values.astype(jnp.float32) * weight.scale).astype(dtype)


def dequantized(tree, dtype):
  """`tree` with every Int8Weight replaced by its values in `dtype` (other leaves as they are)."""
  is_int8 = lambda x: isinstance(x, Int8Weight)
  return jax.tree.map(lambda x: dequantize(x, dtype) if is_int8(x) else x, tree, is_leaf=is_int8)
