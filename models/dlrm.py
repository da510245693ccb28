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
  dense_features: int = 13             # 0: no dense input and no bottom MLP
  bottom_mlp: tuple[int, ...] = (64, 16)  # widths; the last is embed_dim; () without dense
  cross_layers: int = 3
  cross_rank: int = 0                  # 0: full W_l; r > 0: U_l V_l^T of rank r
  top_mlp: tuple[int, ...] = (64, 32)  # widths before the one logit
  pooling: str = "sum"
  hash_ids: bool = True                # False: ids are already rows (< each table's rows)
  param_dtype: str = "float32"

  def __post_init__(self):  # a config section's lists, as the tuples the frozen dataclass wants
    for name in ("table_rows", "bottom_mlp", "top_mlp"):
      object.__setattr__(self, name, tuple(int(v) for v in getattr(self, name)))

  @classmethod
  def preset(cls, name: str, **overrides) -> DLRMConfig:
    if name not in PRESETS:
      raise ValueError(f"DLRM preset {name!r} is unknown; choose one of {', '.join(PRESETS)}")
    return cls(**{**PRESETS[name], **overrides})

  @property
  def interaction_width(self) -> int:
    return self.embed_dim * (len(self.table_rows) + (1 if self.dense_features else 0))

  def validate(self, field: str = "model") -> None:
    """Raises ValueError naming the field and the fix."""
    if not self.table_rows or min(self.table_rows) < 1:
      raise ValueError(f"{field}.table_rows={self.table_rows}: give each table at least one row")
    if self.dense_features < 0:
      raise ValueError(f"{field}.dense_features={self.dense_features} must be >= 0")
    if not self.dense_features and self.bottom_mlp:
      raise ValueError(f"{field}.bottom_mlp={self.bottom_mlp} with {field}.dense_features=0: "
                       f"there is no dense input to feed it; set {field}.bottom_mlp=()")
    if self.dense_features and (not self.bottom_mlp or self.bottom_mlp[-1] != self.embed_dim):
      raise ValueError(f"{field}.bottom_mlp={self.bottom_mlp} must end at {field}.embed_dim="
                       f"{self.embed_dim}: its output sits beside the tables' rows")
    if self.pooling not in embedding_bag.POOLINGS:
      raise ValueError(f"{field}.pooling={self.pooling!r}; choose one of "
                       f"{', '.join(embedding_bag.POOLINGS)}")
    if self.cross_layers < 0 or self.cross_rank < 0:
      raise ValueError(f"{field}.cross_layers and cross_rank must be >= 0")

  def flops_per_example(self) -> float:
    """Training FLOPs per example (forward + backward): 6 x the dense layers' weights; the
    lookups are memory traffic, not FLOPs."""
    bottom = sum(a * b for a, b in zip((self.dense_features, *self.bottom_mlp),
                                       self.bottom_mlp)) if self.dense_features else 0
    width = self.interaction_width
    cross = self.cross_layers * (2 * width * self.cross_rank if self.cross_rank
                                 else width * width)
    top = sum(a * b for a, b in zip((width, *self.top_mlp), (*self.top_mlp, 1)))
    return 6.0 * (bottom + cross + top)


def _dense(rngs, fan_in: int, fan_out: int, dtype: str):
  """A ReLU layer's weight (He initialization) and zero bias."""
  weight = params.normal(rngs, (fan_in, fan_out), ("features", "features"),
                         (2.0 / max(fan_in, 1)) ** 0.5, dtype)
  bias = nnx.Param(jnp.zeros((fan_out,), dtype), out_sharding=("features",),
                   eager_sharding=False)
  return weight, bias


class MLP(nnx.Module):
  """Dense layers with ReLU between them (and none after the last): `w0`, `b0`, `w1`, ..."""

  def __init__(self, widths: tuple[int, ...], dtype: str, rngs: nnx.Rngs):
    self.count = len(widths) - 1
    for i, (a, b) in enumerate(zip(widths[:-1], widths[1:])):
      weight, bias = _dense(rngs, a, b, dtype)
      setattr(self, f"w{i}", weight)
      setattr(self, f"b{i}", bias)

  def __call__(self, x: jax.Array) -> jax.Array:
    for i in range(self.count):
      x = x @ getattr(self, f"w{i}")[...] + getattr(self, f"b{i}")[...]
      if i < self.count - 1:
        x = jax.nn.relu(x)
    return x


class CrossNetwork(nnx.Module):
  """DCN-v2's cross layers on x_0 (batch, width): layer l's `w{l}` (or `u{l}` `v{l}`), `b{l}`."""

  def __init__(self, width: int, layers: int, rank: int, dtype: str, rngs: nnx.Rngs):
    self.layers, self.rank = layers, rank
    std = (1.0 / width) ** 0.5
    for l in range(layers):
      if rank:
        setattr(self, f"u{l}", params.normal(rngs, (width, rank), ("features", None), std,
                                             dtype))
        setattr(self, f"v{l}", params.normal(rngs, (rank, width), (None, "features"),
                                             (1.0 / rank) ** 0.5, dtype))
      else:
        setattr(self, f"w{l}", params.normal(rngs, (width, width), ("features", None), std,
                                             dtype))
      setattr(self, f"b{l}", nnx.Param(jnp.zeros((width,), dtype), out_sharding=("features",),
                                       eager_sharding=False))

  def __call__(self, x0: jax.Array) -> jax.Array:
    x = x0
    for l in range(self.layers):
      mixed = (x @ getattr(self, f"u{l}")[...] @ getattr(self, f"v{l}")[...] if self.rank
               else x @ getattr(self, f"w{l}")[...])
      x = x0 * (mixed + getattr(self, f"b{l}")[...]) + x
    return x


class DLRM(nnx.Module):
  """(dense (batch, F), ids (batch, T, bag), lengths (batch, T)) -> click logits (batch,)."""

  def __init__(self, cfg: DLRMConfig, *, rngs: nnx.Rngs):
    cfg.validate()
    self.cfg = cfg
    for t, rows in enumerate(cfg.table_rows):  # `table0`, `table1`, ...: one per feature
      setattr(self, f"table{t}", params.normal(rngs, (rows, cfg.embed_dim), embedding_bag.TABLE,
                                               rows**-0.5, cfg.param_dtype))
    if cfg.dense_features:  # no zero-sized weights: a checkpoint cannot hold them
      self.bottom = MLP((cfg.dense_features, *cfg.bottom_mlp), cfg.param_dtype, rngs)
    self.cross = CrossNetwork(cfg.interaction_width, cfg.cross_layers, cfg.cross_rank,
                              cfg.param_dtype, rngs)
    self.top = MLP((cfg.interaction_width, *cfg.top_mlp, 1), cfg.param_dtype, rngs)

  def __call__(self, dense: jax.Array, ids: jax.Array, lengths: jax.Array) -> jax.Array:
    cfg = self.cfg
    tables = [getattr(self, f"table{t}")[...] for t in range(len(cfg.table_rows))]
    if cfg.hash_ids:
      ids = embedding_bag.hash_ids(ids, jnp.asarray(cfg.table_rows)[None, :, None])
    stacked = embedding_bag.lookup_stacked(tables, ids, lengths, pooling=cfg.pooling)
    pooled = [stacked.reshape(stacked.shape[0], -1)]
    if cfg.dense_features:
      pooled.insert(0, jax.nn.relu(self.bottom(dense.astype(jnp.float32))))
    x0 = jnp.concatenate(pooled, axis=1)
    return self.top(self.cross(x0))[:, 0].astype(jnp.float32)
