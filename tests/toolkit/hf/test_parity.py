"""Imported Hugging Face Llama weights give transformers' logits: every position of a
256-token prompt, on 8 devices under fsdp_tp, for multi-head and grouped-query attention,
tied and untied embeddings, rope_theta 5e5, head_dim != d_model / heads and Llama 3's RoPE
scaling; prefill + decode with the KV cache too. A deliberately wrong q/k layout (Meta's
interleaved RoPE pairs) must fail the same comparison."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models.llama import init_cache
from tests.toolkit.hf import reference
from tests.toolkit.hf.reference import HF_PARITY


_IMPORTED: dict = {}
# The configuration the cache and negative-control tests use: grouped-query, untied, head_dim
# 24 (d_model / heads is 16), Llama 3 RoPE scaling.
HARDEST = "gqa_untied_head_dim24_llama3"


def _imported(name, tmp_path_factory):
  """(name, transformers model, params, config, graphdef, prompt, HF logits, forward), built
  once per configuration."""
  if name not in _IMPORTED:
    path = tmp_path_factory.mktemp(name)
    model = reference.write_folder(path, name)
    params, cfg, graphdef = reference.import_params(path)
    tokens = reference.prompt(cfg.vocab_size)
    forward = jax.jit(lambda p, t: nnx.merge(graphdef, p)(t))
    _IMPORTED[name] = (name, model, params, cfg, graphdef, tokens,
                       reference.hf_logits(model, tokens), forward)
  return _IMPORTED[name]


@pytest.fixture(scope="module", params=[
    pytest.param(name, marks=pytest.mark.smoke) if name == HARDEST else name
    for name in sorted(reference.CONFIGS)])
def imported(request, tmp_path_factory):
  return _imported(request.param, tmp_path_factory)


@pytest.fixture(scope="module")
def hardest(tmp_path_factory):
  return _imported(HARDEST, tmp_path_factory)


def test_config_is_read_as_written(imported):
  name, model, _, cfg, _, _, _, _ = imported
  hf_cfg = model.config
  assert (cfg.n_heads, cfg.n_kv_heads, cfg.resolved_head_dim, cfg.tie_embeddings) == (
      hf_cfg.num_attention_heads, hf_cfg.num_key_value_heads, hf_cfg.head_dim,
      hf_cfg.tie_word_embeddings)
  assert cfg.rope_theta == 500_000.0
  assert cfg.rope_type == ("default" if name == "mha_tied_theta5e5" else "llama3")


def test_logits_match_transformers_at_every_position(imported):
  name, _, params, _, _, tokens, expected, forward = imported
  actual = np.asarray(forward(params, jnp.asarray(tokens)))
  difference = np.abs(actual - expected).max()
  print(f"{name}: max |logit difference| {difference:.2e} over {tokens.shape[1]} positions "
        f"(logits up to {np.abs(expected).max():.1f})")
  assert difference <= HF_PARITY


def test_prefill_then_decode_match_transformers_full_forward(hardest):
  _, _, params, cfg, graphdef, tokens, expected, _ = hardest
  prefill_length, decode_steps = 224, 32

  @jax.jit
  def prefill(p, t):
    return nnx.merge(graphdef, p).prefill(t, jnp.full((1,), prefill_length, jnp.int32))

  @jax.jit
  def decode(p, token, position, cache):
    return nnx.merge(graphdef, p).decode(token, position, cache)

  logits, kv = prefill(params, jnp.asarray(tokens[:, :prefill_length]))
  cache = init_cache(cfg, 1, prefill_length + decode_steps)
  cache = {n: cache[n].at[:, :, :prefill_length].set(kv[n]) for n in cache}
  rows = [np.asarray(logits)[0]]
  for position in range(prefill_length, prefill_length + decode_steps - 1):
    logits, cache = decode(params, jnp.asarray(tokens[:, position]),
                           jnp.full((1,), position, jnp.int32), cache)
    rows.append(np.asarray(logits)[0])
  window = expected[0, prefill_length - 1:prefill_length + decode_steps - 1]
  assert np.abs(np.stack(rows) - window).max() <= HF_PARITY


def _interleaved(w: jax.Array) -> jax.Array:
  """q or k with each head's rows in Meta's interleaved RoPE order (what an importer that
  wrongly "unpermutes" HF weights produces): head_dim entries 0, 2, 4, ..., 1, 3, 5, ..."""
  half = w.shape[-1] // 2
  order = np.concatenate([np.arange(half) * 2, np.arange(half) * 2 + 1])
  return w[..., order]


def test_a_wrong_qk_layout_is_caught(hardest):
  """The negative control: the parity comparison above fails for interleaved RoPE pairs. Only
  position 0 hides it (no rotation there: the same permutation of q and k cancels in q.k)."""
  name, _, params, _, _, tokens, expected, forward = hardest
  wrong = jax.tree.map(lambda a: a, params)
  attention = wrong["layers"]["attention"]
  attention["wq"], attention["wk"] = _interleaved(attention["wq"]), _interleaved(attention["wk"])
  difference = np.abs(np.asarray(forward(wrong, jnp.asarray(tokens))) - expected)
  late = difference[:, 17:].max()
  print(f"{name}: interleaved q/k: max |logit difference| {difference[:, :17].max():.2e} at "
        f"positions 0-16, {late:.2e} beyond")
  assert late > 1e-2 and difference[:, 0].max() <= HF_PARITY
