"""LoRA adapters (Hu et al., 2021) on the Llama's projections: the weight W stays frozen and a
low-rank update is trained beside it,

  y = x W + (lora_alpha / lora_rank) * dropout(x) A B

with A (in..., lora_rank) drawn uniformly in +-1/sqrt(fan_in) (peft's default) and B
(lora_rank, out...) zero, so a fresh adapter changes no output (the base model's logits,
bitwise). The config fields live in `LlamaConfig` (lora_rank, lora_alpha, lora_dropout,
lora_targets); `lora_targets` names the projections: q, k, v, o (attention) and gate, up, down
(a dense MLP; a mixture of experts' experts are not adapted).

Adapters are plain float32 `nnx.Param`s named by logical axes, the projection's own input and
output axes plus `lora_rank` (replicated by every rules preset), so the rules shard them like
their weights. Their parameter paths end in `lora_<target>/a` and `/b` (`is_adapter`): a
model that holds adapters trains only them (toolkit/training/state.py).

Training sets `runtime(...)` around the loss: each row's dropout key (so the masks do not
depend on how a batch is split into micro-batches or over devices) and, for a population of
trials (toolkit/tuning/population.py), per-trial alpha and dropout as traced values (its
evaluation, the alpha alone). Outside it (evaluation, generation, export) no dropout is
applied and the config's alpha is used.
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
from collections.abc import Iterator

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models.linear import dense

# target -> (the weight it adapts, the projection's place in HF/peft names)
TARGETS: dict[str, tuple[str, str]] = {
    "q": ("wq", "self_attn.q_proj"), "k": ("wk", "self_attn.k_proj"),
    "v": ("wv", "self_attn.v_proj"), "o": ("wo", "self_attn.o_proj"),
    "gate": ("w_gate", "mlp.gate_proj"), "up": ("w_up", "mlp.up_proj"),
    "down": ("w_down", "mlp.down_proj"),
}
MLP_TARGETS = ("gate", "up", "down")
PREFIX = "lora_"  # an adapter's module attribute: lora_q, lora_gate, ...
# Adapters draw A from a stream of their own (the layer's params key folded with this), so a
# model with adapters has the very base weights the same seed gives without them.
_STREAM = 0x10A


def targets(cfg) -> tuple[str, ...]:
  """The projections `cfg.lora_targets` names, in TARGETS order; () without LoRA."""
  if not getattr(cfg, "lora_rank", 0):
    return ()
  named = {t.strip() for t in cfg.lora_targets.split(",") if t.strip()}
  return tuple(t for t in TARGETS if t in named)


def validate(cfg, field: str = "model") -> None:
  """The LoRA fields of a model config; raises ValueError naming the field and the fix."""
  if cfg.lora_rank < 0:
    raise ValueError(f"{field}.lora_rank={cfg.lora_rank} must be >= 0 (0: no adapters)")
  if not cfg.lora_rank:
    return
  if not (math.isfinite(cfg.lora_alpha) and cfg.lora_alpha > 0):
    raise ValueError(f"{field}.lora_alpha={cfg.lora_alpha} must be a finite number > 0 (the "
                     f"update is scaled by lora_alpha / lora_rank)")
  if not 0 <= cfg.lora_dropout < 1:
    raise ValueError(f"{field}.lora_dropout={cfg.lora_dropout} must be in [0, 1)")
  named = [t.strip() for t in cfg.lora_targets.split(",") if t.strip()]
  unknown = [t for t in named if t not in TARGETS]
  if unknown or not named:
    raise ValueError(f"{field}.lora_targets={cfg.lora_targets!r}: "
                     + (f"{unknown[0]!r} is not a projection" if unknown else "names nothing")
                     + f"; give a comma-separated subset of {','.join(TARGETS)}")
  if cfg.n_experts and cfg.moe_every == 1 and set(named) & set(MLP_TARGETS):
    raise ValueError(f"{field}.lora_targets={cfg.lora_targets!r} names MLP projections, but "
                     f"every layer's MLP is a mixture of experts, whose experts LoRA does not "
                     f"adapt; use {field}.lora_targets=q,k,v,o")
  if cfg.lora_dropout and cfg.pipeline_microbatches:
    raise ValueError(f"{field}.lora_dropout={cfg.lora_dropout} with a pipeline "
                     f"({field}.pipeline_microbatches={cfg.pipeline_microbatches}): the "
                     f"pipeline regroups rows, which the per-row dropout masks cannot follow; "
                     f"set {field}.lora_dropout=0")


def is_adapter(path: str | tuple) -> bool:
  """Whether a parameter path ("layers/attention/lora_q/a", or its parts) is an adapter's."""
  parts = path.split("/") if isinstance(path, str) else path
  return any(str(part).startswith(PREFIX) for part in parts)


def trainable_count(cfg) -> int:
  """Adapter parameters of the whole model (all layers)."""
  return cfg.n_layers * sum(cfg.lora_rank * (math.prod(i) + math.prod(o))
                            for i, o in (shapes(cfg, t) for t in targets(cfg)))


def shapes(cfg, target: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
  """(input shape, output shape) of one layer's projection `target`, as its weight stores it
  (attention weights keep heads as their own axes)."""
  d, hd = cfg.d_model, cfg.resolved_head_dim
  return {"q": ((d,), (cfg.n_heads, hd)), "k": ((d,), (cfg.n_kv_heads, hd)),
          "v": ((d,), (cfg.n_kv_heads, hd)), "o": ((cfg.n_heads, hd), (d,)),
          "gate": ((d,), (cfg.mlp_dim,)), "up": ((d,), (cfg.mlp_dim,)),
          "down": ((cfg.mlp_dim,), (d,))}[target]


# --- the modules ------------------------------------------------------------------------------

class Adapter(nnx.Module):
  """One projection's update: `a` (*in, lora_rank) and `b` (lora_rank, *out), float32, named
  (*in_axes, "lora_rank") and ("lora_rank", *out_axes)."""

  def __init__(self, cfg, target: str, in_axes: tuple[str, ...], out_axes: tuple[str, ...],
               key: jax.Array):
    in_shape, out_shape = shapes(cfg, target)
    bound = 1 / math.sqrt(math.prod(in_shape))
    a = jax.random.uniform(key, (*in_shape, cfg.lora_rank), jnp.float32, -bound, bound)
    # eager_sharding=False: the names are logical; meshkit's rules resolve them, not Flax.
    self.a = nnx.Param(a, out_sharding=(*in_axes, "lora_rank"), eager_sharding=False)
    self.b = nnx.Param(jnp.zeros((cfg.lora_rank, *out_shape), jnp.float32),
                       out_sharding=("lora_rank", *out_axes), eager_sharding=False)
    self.alpha, self.rank, self.dropout = cfg.lora_alpha, cfg.lora_rank, cfg.lora_dropout
    self.site, self.contract = list(TARGETS).index(target), len(in_shape)

  def __call__(self, x: jax.Array) -> jax.Array:
    """The update for x (batch, length, *in) in x's dtype: (batch, length, *out)."""
    run = _RUNTIME.get()
    alpha = self.alpha if run is None or run.alpha is None else run.alpha
    if run is not None and run.keys is not None:  # training: dropout
      rate = self.dropout if run.dropout is None else run.dropout
      if not isinstance(rate, (int, float)) or rate > 0:  # traced (a population) or set
        x = _dropout(x, rate, run.keys, self.site)
    low = dense(x, self.a[...].astype(x.dtype), self.contract)  # (batch, length, lora_rank)
    scale = jnp.asarray(alpha / self.rank, x.dtype)
    return dense(low * scale, self.b[...].astype(x.dtype))


def adapter(cfg, target: str, rngs: nnx.Rngs, in_axes: tuple[str, ...],
            out_axes: tuple[str, ...]) -> Adapter | None:
  """The adapter of projection `target` when `cfg` adapts it, else None."""
  if target not in targets(cfg):
    return None
  stream = jax.random.fold_in(rngs.params.key[...], _STREAM)
  return Adapter(cfg, target, in_axes, out_axes,
                 jax.random.fold_in(stream, list(TARGETS).index(target)))


def add(update: Adapter | None, x: jax.Array, y: jax.Array) -> jax.Array:
  """y, the frozen projection of x, plus `update`'s (nothing when it is None)."""
  return y if update is None else y + update(x).astype(y.dtype)


# --- at trace time: dropout keys, a population's per-trial values ---------------------------

@dataclasses.dataclass(frozen=True)
class _Runtime:
  keys: jax.Array | None       # (batch, 2) uint32: each row's dropout key data (training)
  alpha: object = None         # a traced scalar replacing the config's, or None
  dropout: object = None
  layer: object = 0            # the index of the layer being run (models.stack sets it)


_RUNTIME: contextvars.ContextVar[_Runtime | None] = contextvars.ContextVar(
    "lora_runtime", default=None)


@contextlib.contextmanager
def runtime(keys: jax.Array | None = None, alpha=None, dropout=None) -> Iterator[None]:
  """Adapters traced inside use these: with `keys` (training), dropout at the config's rate
  (or `dropout`), row r's masks drawn from `keys[r]` (key data, (batch, 2) uint32) folded with
  the layer and the projection; `alpha` and `dropout`, when given (traced scalars: a
  population's trial values), replace the config's."""
  token = _RUNTIME.set(_Runtime(keys, alpha, dropout))
  try:
    yield
  finally:
    _RUNTIME.reset(token)


@contextlib.contextmanager
def _replaced(**changes) -> Iterator[None]:
  run = _RUNTIME.get() or _Runtime(None)
  token = _RUNTIME.set(dataclasses.replace(run, **changes))
  try:
    yield
  finally:
    _RUNTIME.reset(token)


def no_dropout():
  """Adapters traced inside apply no dropout; a population's alpha stays (preference tuning
  trains without dropout, as trl's DPOTrainer does by default)."""
  return _replaced(keys=None)


def base_only():
  """Adapters traced inside add nothing (their scale is 0): the outputs are the frozen base
  model's, DPO's reference, without a second copy of the weights."""
  return _replaced(keys=None, alpha=0.0)


@contextlib.contextmanager
def layer(index) -> Iterator[None]:
  """Marks the layer being run (an int or a traced index in a scan over the stacked layers),
  so each layer draws its own dropout masks; a no-op outside `runtime`."""
  run = _RUNTIME.get()
  token = _RUNTIME.set(None if run is None else dataclasses.replace(run, layer=index))
  try:
    yield
  finally:
    _RUNTIME.reset(token)


def _dropout(x: jax.Array, rate, keys: jax.Array, site: int) -> jax.Array:
  """x (batch, ...) with each element zeroed with probability `rate` and the rest scaled by
  1 / (1 - rate); row r's mask from keys[r] folded with the layer and `site`. A rate of 0
  (even traced) keeps x exactly."""
  layer_index = _RUNTIME.get().layer

  def keep(row_key):
    key = jax.random.fold_in(jax.random.fold_in(jax.random.wrap_key_data(row_key),
                                                layer_index), site)
    return jax.random.bernoulli(key, 1 - rate, x.shape[1:])

  mask = jax.vmap(keep)(keys)
  return jnp.where(mask, x / jnp.asarray(1 - rate, x.dtype), jnp.zeros((), x.dtype))


def row_keys(key: jax.Array, rows: int) -> jax.Array:
  """`rows` dropout keys (key data, (rows, 2) uint32) from one typed key."""
  return jax.random.key_data(jax.random.split(key, rows))


# --- merging into the weights ----------------------------------------------------------------

def merged(weight: np.ndarray, a: np.ndarray, b: np.ndarray, alpha: float, rank: int
           ) -> np.ndarray:
  """W + (alpha / rank) A B for one layer's (or stacked layers') weight, in float32 then cast
  to the weight's dtype: a (..., *in, r), b (..., r, *out), weight (..., *in, *out)."""
  a32, b32 = np.asarray(a, np.float32), np.asarray(b, np.float32)
  lead = a32.ndim + b32.ndim - 2 - weight.ndim  # stacked axes (layers), if any
  in_shape = a32.shape[lead:-1]
  out_shape = b32.shape[lead + 1:]
  flat_a = a32.reshape(*a32.shape[:lead], math.prod(in_shape), a32.shape[-1])
  flat_b = b32.reshape(*b32.shape[:lead], b32.shape[lead], math.prod(out_shape))
  update = (flat_a @ flat_b).reshape(*a32.shape[:lead], *in_shape, *out_shape)
  return (np.asarray(weight, np.float32) + (alpha / rank) * update).astype(weight.dtype)
