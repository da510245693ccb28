"""Text sampling from a trained byte-level LM: a helper the demo uses, and a small CLI.

Recomputes the forward pass over a fixed window per token (no KV cache); the serving issue
brings the cached decoder. The window keeps the compiled shape fixed: one compile per run.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from toolkit import data


def sample_text(graphdef: nnx.GraphDef, params, prompt: str, num_tokens: int, window: int,
                temperature: float = 0.8, seed: int = 0) -> str:
  """Continues `prompt` by `num_tokens` byte tokens sampled at `temperature` (0 = greedy)."""
  params = jax.device_get(params)  # a small model: sample on the default device

  @jax.jit
  def next_token(params, tokens, last, key):
    logits = nnx.merge(graphdef, params)(tokens[None])[0, last]
    if temperature <= 0:
      return jnp.argmax(logits)
    return jax.random.categorical(key, logits / temperature)

  tokens = list(data.encode(prompt)) or [ord(" ")]
  key = jax.random.key(seed)
  for i in range(num_tokens):
    context = tokens[-window:]
    buffer = np.zeros(window, np.int32)
    buffer[:len(context)] = context
    token = next_token(params, buffer, len(context) - 1, jax.random.fold_in(key, i))
    tokens.append(int(token))
  return data.decode(tokens)
