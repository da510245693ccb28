"""LoRA adapters (models/lora.py): a fresh adapter leaves the base model's logits bitwise
unchanged, a trained one computes W + (alpha / rank) A B (against the float64 NumPy reference
with the update merged into the weights), dropout in training only, and the config checks."""
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models import LlamaConfig, lora
from tests.models.test_llama import LOGITS_TOLERANCE, reference_logits
from toolkit.training import state as state_lib

TARGETS = "q,k,v,o,gate,up,down"


def _config(rank: int = 4, **overrides) -> LlamaConfig:
  return LlamaConfig.preset("tiny", lora_rank=rank, lora_alpha=8.0, lora_targets=TARGETS,
                            **overrides)


def _graphdef(cfg: LlamaConfig):
  return state_lib.param_entries(cfg)[0]


@functools.cache
def _forward(cfg: LlamaConfig):
  graphdef = _graphdef(cfg)
  return jax.jit(lambda params, tokens: nnx.merge(graphdef, params)(tokens))


_init = jax.jit(state_lib.init_params, static_argnums=0)


@pytest.fixture(scope="module")
def params():
  """A fresh LoRA model's parameters (B = 0), shared by the tests below."""
  return _init(_config(), jnp.int32(3))


@pytest.fixture(scope="module")
def tokens():
  return jnp.asarray(np.random.default_rng(0).integers(0, 256, size=(2, 24)), jnp.int32)


def test_fresh_adapters_leave_the_base_logits_bitwise(params, tokens):
  cfg = _config()
  base_cfg = dataclasses.replace(cfg, lora_rank=0)
  base = _init(base_cfg, jnp.int32(3))
  trainable, frozen = state_lib.split_trainable(params)
  # Every projection has its adapter; the base is the very one the seed gives without LoRA.
  adapters = jax.tree_util.tree_flatten_with_path(trainable)[0]
  assert len(adapters) == 2 * len(TARGETS.split(","))
  assert sum(leaf.size for _, leaf in adapters) == lora.trainable_count(cfg)
  assert all(lora.is_adapter([k.key for k in path]) for path, _ in adapters)
  jax.tree.map(np.testing.assert_array_equal, frozen, base)
  assert not any(np.any(leaf) for path, leaf in adapters
                 if jax.tree_util.keystr(path).endswith("['b']"))
  np.testing.assert_array_equal(_forward(cfg)(params, tokens), _forward(base_cfg)(base, tokens))


def test_trained_adapters_equal_the_merged_weights(params, tokens):
  """Random A and B on every projection: the model's logits equal the float64 reference run
  with W + (alpha / rank) A B in place of each W (what --merge_lora exports)."""
  cfg = _config()
  keys = iter(jax.random.split(jax.random.key(7), 64))
  params = jax.tree_util.tree_map_with_path(
      lambda path, x: 0.1 * jax.random.normal(next(keys), x.shape)
      if jax.tree_util.keystr(path).endswith("['b']") else x, params)
  merged = state_lib.split_trainable(params)[1]
  for parent, weights in (("attention", ("wq", "wk", "wv", "wo")),
                          ("mlp", ("w_gate", "w_up", "w_down"))):
    for weight in weights:
      target = next(t for t, (w, _) in lora.TARGETS.items() if w == weight)
      adapter = params["layers"][parent][lora.PREFIX + target]
      merged["layers"][parent][weight] = lora.merged(
          np.asarray(merged["layers"][parent][weight]), np.asarray(adapter["a"]),
          np.asarray(adapter["b"]), cfg.lora_alpha, cfg.lora_rank)
  logits = _forward(cfg)(params, tokens)
  base_cfg = dataclasses.replace(cfg, lora_rank=0)
  for row in range(tokens.shape[0]):
    expected = reference_logits(base_cfg, merged, np.asarray(tokens[row]))
    np.testing.assert_allclose(logits[row], expected, **LOGITS_TOLERANCE)
  # The update is not small: the adapters move the logits well past the tolerance.
  assert np.max(np.abs(logits - _forward(base_cfg)(state_lib.split_trainable(params)[1],
                                                     tokens))) > 0.1


def test_dropout_applies_in_training_only(params, tokens):
  """Inside `lora.runtime` with keys (the train step's), dropout at the given rate; outside
  (eval, generation) none. The rate is traced here, as a population passes it."""
  cfg = _config()
  params = jax.tree_util.tree_map_with_path(
      lambda path, x: jnp.ones_like(x) * 0.05 if jax.tree_util.keystr(path).endswith("['b']")
      else x, params)
  graphdef = _graphdef(cfg)
  keys = lora.row_keys(jax.random.key(0), tokens.shape[0])

  @jax.jit
  def training(params, tokens, keys, rate):
    with lora.runtime(keys=keys, dropout=rate):
      return nnx.merge(graphdef, params)(tokens)

  plain = _forward(cfg)(params, tokens)
  assert np.max(np.abs(training(params, tokens, keys, 0.5) - plain)) > 1e-3
  # A rate of 0 is no dropout at all, bitwise.
  np.testing.assert_array_equal(training(params, tokens, keys, 0.0), plain)


@pytest.mark.parametrize("overrides,message", [
    (dict(lora_targets="q,x"), r"model\.lora_targets='q,x': 'x' is not a projection"),
    (dict(lora_targets=""), r"model\.lora_targets='': names nothing"),
    (dict(lora_alpha=0.0), r"model\.lora_alpha=0.0 must be a finite number > 0"),
    (dict(lora_dropout=1.0), r"model\.lora_dropout=1.0 must be in \[0, 1\)"),
    (dict(lora_rank=-1), r"model\.lora_rank=-1 must be >= 0"),
    (dict(n_experts=8, mlp_dim=32), r"every layer's MLP is a mixture of experts.*"
                                    r"lora_targets=q,k,v,o"),
    (dict(lora_dropout=0.1, pipeline_microbatches=2), r"per-row dropout masks"),
])
def test_config_mistakes_name_the_field(overrides, message):
  cfg = dataclasses.replace(_config(), **overrides)
  with pytest.raises(ValueError, match=message):
    cfg.validate()
