"""DLRM-DCNv2 (models/dlrm.py) against a float64 NumPy re-implementation written from the two
papers (full-rank and low-rank cross layers); on 8 devices with row-wise tables its logits and
every parameter's gradient equal one device's; and a config that cannot be built is one error."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import sharding
from models.dlrm import DLRM, DLRMConfig
from tests.tiny_runs import TOLERANCE

BATCH, BAG = 16, 3


def _batch(cfg: DLRMConfig, seed: int = 0):
  rng = np.random.default_rng(seed)
  dense = np.log1p(rng.geometric(0.3, size=(BATCH, cfg.dense_features))).astype(np.float32)
  ids = rng.integers(-2**31, 2**31, size=(BATCH, len(cfg.table_rows), BAG)).astype(np.int32)
  lengths = rng.integers(0, BAG + 1, size=(BATCH, len(cfg.table_rows))).astype(np.int32)
  return dense, ids, lengths


def _model(cfg: DLRMConfig):
  graphdef, _ = nnx.split(nnx.eval_shape(lambda: DLRM(cfg, rngs=nnx.Rngs(params=0))))
  state = jax.jit(lambda: nnx.to_pure_dict(nnx.state(DLRM(cfg, rngs=nnx.Rngs(params=0)),
                                                     nnx.Param)))()
  return graphdef, state


def _apply(graphdef, state, *batch):
  model = nnx.merge(graphdef, nnx.State(state) if not isinstance(state, nnx.State) else state)
  return model(*batch)


def _numpy_dlrm(cfg: DLRMConfig, p, dense, ids, lengths) -> np.ndarray:
  p = jax.tree.map(lambda x: np.asarray(x, np.float64), p)
  relu = lambda x: np.maximum(x, 0)

  def mlp(x, layers, last_relu):
    count = len(layers) // 2
    for i in range(count):
      x = x @ layers[f"w{i}"] + layers[f"b{i}"]
      if i < count - 1 or last_relu:
        x = relu(x)
    return x

  pooled = []
  for t, rows in enumerate(cfg.table_rows):
    hashed = [[(int(i) % 2**32) * 2654435761 % 2**32 % rows for i in bag] for bag in ids[:, t]]
    pooled.append(np.stack([
        sum((p[f"table{t}"][hashed[b][k]] for k in range(lengths[b, t])), np.zeros(cfg.embed_dim))
        for b in range(BATCH)]))
  if cfg.dense_features:
    pooled.insert(0, mlp(dense.astype(np.float64), p["bottom"], True))
  x0 = np.concatenate(pooled, axis=1)
  x = x0
  for layer in range(cfg.cross_layers):
    c = p["cross"]
    w = c[f"u{layer}"] @ c[f"v{layer}"] if cfg.cross_rank else c[f"w{layer}"]
    x = x0 * (x @ w + c[f"b{layer}"]) + x
  return mlp(x, p["top"], False)[:, 0]


@pytest.mark.parametrize("cross_rank,dense_features", [(0, 13), (4, 13), (0, 0)])
def test_logits_equal_a_float64_numpy_dlrm(cross_rank, dense_features):
  bottom = {} if dense_features else dict(bottom_mlp=())  # MovieLens: ids only, no bottom MLP
  cfg = DLRMConfig.preset("tiny", cross_rank=cross_rank, dense_features=dense_features, **bottom)
  graphdef, state = _model(cfg)
  batch = _batch(cfg)
  got = jax.jit(lambda s, *b: _apply(graphdef, s, *b))(state, *batch)
  np.testing.assert_allclose(got, _numpy_dlrm(cfg, state, *batch), rtol=1e-5, atol=1e-5)


def test_row_wise_tables_on_8_devices_train_as_on_one():
  cfg = DLRMConfig.preset("tiny")
  graphdef, state = _model(cfg)
  batch = _batch(cfg, seed=1)
  labels = jnp.asarray(np.random.default_rng(2).integers(0, 2, BATCH), jnp.float32)

  def loss(s, dense, ids, lengths):
    logits = _apply(graphdef, s, dense, ids, lengths)
    return jnp.mean(jax.nn.softplus(logits) - labels * logits)

  want = jax.jit(jax.value_and_grad(loss))(state, *batch)
  mesh = sharding.make_mesh(sharding.parse_axis_sizes("data:2,fsdp:4", "mesh.ici"))
  rules = sharding.Rules.preset("fsdp", param_overrides="table_rows=data+fsdp",
                                activation_overrides="table_rows=data+fsdp")

  def sharded(s, *b):
    with sharding.activation_rules(rules, mesh):
      return jax.value_and_grad(loss)(s, *b)

  got = jax.jit(sharded)(state, *batch)
  np.testing.assert_allclose(got[0], want[0], **TOLERANCE)
  jax.tree.map(lambda g, w: np.testing.assert_allclose(g, w, **TOLERANCE), got[1], want[1])


@pytest.mark.parametrize("overrides,message", [
    (dict(bottom_mlp=(16, 4)), "must end at model.embed_dim=8"),
    (dict(table_rows=(5, 0)), "at least one row"),
    (dict(pooling="max"), "pooling='max'"),
    (dict(dense_features=0), "no dense input to feed it; set model.bottom_mlp=()"),
])
def test_a_config_that_cannot_be_built_is_one_error(overrides, message):
  with pytest.raises(ValueError, match=message):
    DLRM(dataclasses.replace(DLRMConfig.preset("tiny"), **overrides), rngs=nnx.Rngs(params=0))
  with pytest.raises(ValueError, match="preset 'huge' is unknown"):
    DLRMConfig.preset("huge")
