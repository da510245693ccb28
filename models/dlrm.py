"""DLRM with a DCN-v2 cross network (Naumov et al., 2019; Wang et al., 2021), the model of
MLPerf's recommendation benchmark: dense features through a bottom MLP, each categorical
feature's bag of ids through its own embedding table (models/embedding_bag.py), the
concatenation through a cross network, then a top MLP to one click logit.

  model = DLRM(DLRMConfig.preset("tiny"), rngs=nnx.Rngs(params=0))
  logits = model(dense, ids, lengths)   # (batch, 13) float, (batch, T, bag) int, (batch, T)

The cross network's layer l: x_{l+1} = x_0 * (W_l x_l + b_l) + x_l, with W_l full
(`cross_rank=0`) or low-rank U_l V_l^T. Ids are hashed into each table's range first
(`embedding_bag.hash_ids`), so raw 32-bit ids (Criteo's hex) go straight in. Tables carry the
logical axes ("table_rows", "table_embed"), which the rules place; the dense layers carry
"features", small and replicated.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from models import embedding_bag, params

# Preset -> the config's fields. "criteo_kaggle": the 26 tables of the Kaggle set at the
# usual hashing cap of 10^5 rows each.
PRESETS = {
    "tiny": dict(table_rows=(96, 64, 32), embed_dim=8, dense_features=13, bottom_mlp=(16, 8),
                 cross_layers=2, cross_rank=0, top_mlp=(16,)),
    "criteo_kaggle": dict(table_rows=(100_000,) * 26, embed_dim=16, dense_features=13,
                          bottom_mlp=(512, 256, 16), cross_layers=3, cross_rank=64,
                          top_mlp=(1024, 512, 256)),
}


@dataclasses.dataclass(frozen=True)
class DLRMConfig:
  table_rows: tuple[int, ...]          # one table per categorical feature
  embed_dim: int = 16                  # each table's row width, and the bottom MLP's output
  dense_features: int = 13
  bottom_mlp: tuple[int, ...] = (64, 16)  # widths; the last is embed_dim
  cross_layers: int = 3
  cross_rank: int = 0                  # 0: full W_l; r > 0: U_l V_l^T of rank r
  top_mlp: tuple[int, ...] = (64, 32)  # widths before the one logit
  pooling: str = "sum"
  param_dtype: str = "float32"

  @classmethod
  def preset(cls, name: str, **overrides) -> DLRMConfig:
    if name not in PRESETS:
      raise ValueError(f"DLRM preset {name!r} is unknown; choose one of {', '.join(PRESETS)}")
    return cls(**{**PRESETS[name], **overrides})

  @property
  def interaction_width(self) -> int:
    return self.embed_dim * (len(self.table_rows) + 1)

  def check(self) -> None:
    if not self.table_rows or min(self.table_rows) < 1:
      raise ValueError(f"DLRM table_rows={self.table_rows}: give each table at least one row")
    if not self.bottom_mlp or self.bottom_mlp[-1] != self.embed_dim:
      raise ValueError(f"DLRM bottom_mlp={self.bottom_mlp} must end at embed_dim="
                       f"{self.embed_dim}: its output sits beside the tables' rows")
    if self.pooling not in embedding_bag.POOLINGS:
      raise ValueError(f"DLRM pooling={self.pooling!r}; choose one of "
                       f"{', '.join(embedding_bag.POOLINGS)}")


def _dense(rngs, fan_in: int, fan_out: int, dtype: str):
  """A ReLU layer's weight (He initialization) and zero bias."""
  weight = params.normal(rngs, (fan_in, fan_out), ("features", "features"),
                         (2.0 / fan_in) ** 0.5, dtype)
  bias = nnx.Param(jnp.zeros((fan_out,), dtype), out_sharding=("features",),
                   eager_sharding=False)
  return weight, bias


class MLP(nnx.Module):
  """Dense layers with ReLU between them (and none after the last)."""

  def __init__(self, widths: tuple[int, ...], dtype: str, rngs: nnx.Rngs):
    pairs = [_dense(rngs, a, b, dtype) for a, b in zip(widths[:-1], widths[1:])]
    self.weights = nnx.List([w for w, _ in pairs])
    self.biases = nnx.List([b for _, b in pairs])

  def __call__(self, x: jax.Array) -> jax.Array:
    for i, (w, b) in enumerate(zip(self.weights, self.biases)):
      x = x @ w[...] + b[...]
      if i < len(self.weights) - 1:
        x = jax.nn.relu(x)
    return x


class CrossNetwork(nnx.Module):
  """DCN-v2's cross layers on x_0 (batch, width)."""

  def __init__(self, width: int, layers: int, rank: int, dtype: str, rngs: nnx.Rngs):
    std = (1.0 / width) ** 0.5
    if rank:
      self.u = nnx.List([params.normal(rngs, (width, rank), ("features", None), std, dtype)
                         for _ in range(layers)])
      self.v = nnx.List([params.normal(rngs, (rank, width), (None, "features"),
                                       (1.0 / rank) ** 0.5, dtype) for _ in range(layers)])
    else:
      self.w = nnx.List([params.normal(rngs, (width, width), ("features", None), std, dtype)
                         for _ in range(layers)])
    self.b = nnx.List([nnx.Param(jnp.zeros((width,), dtype), out_sharding=("features",),
                                 eager_sharding=False) for _ in range(layers)])
    self.rank = rank

  def __call__(self, x0: jax.Array) -> jax.Array:
    x = x0
    for layer, bias in enumerate(self.b):
      mixed = (x @ self.u[layer][...] @ self.v[layer][...] if self.rank
               else x @ self.w[layer][...])
      x = x0 * (mixed + bias[...]) + x
    return x


class DLRM(nnx.Module):
  """(dense (batch, F), ids (batch, T, bag), lengths (batch, T)) -> click logits (batch,)."""

  def __init__(self, cfg: DLRMConfig, *, rngs: nnx.Rngs):
    cfg.check()
    self.cfg = cfg
    self.tables = nnx.List([
        params.normal(rngs, (rows, cfg.embed_dim), embedding_bag.TABLE, rows**-0.5,
                      cfg.param_dtype) for rows in cfg.table_rows])
    self.bottom = MLP((cfg.dense_features, *cfg.bottom_mlp), cfg.param_dtype, rngs)
    self.cross = CrossNetwork(cfg.interaction_width, cfg.cross_layers, cfg.cross_rank,
                              cfg.param_dtype, rngs)
    self.top = MLP((cfg.interaction_width, *cfg.top_mlp, 1), cfg.param_dtype, rngs)

  def __call__(self, dense: jax.Array, ids: jax.Array, lengths: jax.Array) -> jax.Array:
    cfg = self.cfg
    pooled = [embedding_bag.lookup(
        table[...], embedding_bag.hash_ids(ids[:, t], rows), lengths[:, t], pooling=cfg.pooling,
        name=str(t)) for t, (table, rows) in enumerate(zip(self.tables, cfg.table_rows))]
    x0 = jnp.concatenate([jax.nn.relu(self.bottom(dense.astype(jnp.float32))), *pooled], axis=1)
    return self.top(self.cross(x0))[:, 0].astype(jnp.float32)
