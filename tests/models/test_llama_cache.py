"""KV-cache decoding against the full forward pass, token by token."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models import Llama, LlamaConfig
from models.llama import init_cache

# float32, same model, same math in another order (cached keys vs recomputed ones; attention
# over the cache length instead of the sequence): measured max |diff| <= 1.2e-7 on logits of
# magnitude ~1 for the tiny model. Stated once here.
CACHE_TOLERANCE = dict(rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("scan_layers", [True, False])
def test_prefill_then_decode_matches_full_forward_at_every_step(scan_layers):
  cfg = LlamaConfig.preset("tiny", scan_layers=scan_layers)
  model = Llama(cfg, rngs=nnx.Rngs(params=0))
  batch, total, cache_length = 3, 24, 32
  tokens = jax.random.randint(jax.random.key(1), (batch, total), 0, cfg.vocab_size)
  full = np.asarray(model(tokens))  # (batch, total, vocab): the reference
  lengths = jnp.array([1, 9, 6])  # different prompt lengths in one batch, right-padded
  logits, kv = model.prefill(tokens[:, :16], lengths)
  rows = jnp.arange(batch)
  np.testing.assert_allclose(logits, full[rows, lengths - 1], **CACHE_TOLERANCE)
  cache = jax.tree.map(lambda c, new: c.at[:, :, :16].set(new), init_cache(cfg, batch,
                                                                            cache_length), kv)
  positions = lengths
  decode = jax.jit(lambda t, p, c: model.decode(t, p, c))
  checked = 0
  for step in range(total - int(lengths.min())):
    # Rows that reached the end of the reference sequence keep decoding (their position stays
    # inside the cache) but are no longer compared.
    inside = np.asarray(positions) < total
    at = jnp.minimum(positions, total - 1)
    logits, cache = decode(tokens[rows, at], positions, cache)
    np.testing.assert_allclose(np.asarray(logits)[inside], full[rows, at][inside],
                               **CACHE_TOLERANCE, err_msg=f"decode step {step}")
    checked += int(inside.sum())
    positions = positions + 1
  assert checked == sum(total - int(n) for n in lengths)  # every position of every row


def test_cache_rows_past_the_position_are_never_read():
  """Garbage in the cache beyond each row's position (padding, a previous request) must not
  change the logits."""
  cfg = LlamaConfig.preset("tiny")
  model = Llama(cfg, rngs=nnx.Rngs(params=0))
  tokens = jax.random.randint(jax.random.key(2), (2, 8), 0, cfg.vocab_size)
  _, kv = model.prefill(tokens, jnp.array([8, 8]))
  clean = jax.tree.map(lambda c, new: c.at[:, :, :8].set(new), init_cache(cfg, 2, 16), kv)
  dirty = jax.tree.map(lambda c: c.at[:, :, 8:].set(1e3), clean)
  step = (tokens[:, -1], jnp.array([8, 8]))
  a, _ = model.decode(*step, clean)
  b, _ = model.decode(*step, dirty)
  np.testing.assert_array_equal(a, b)
