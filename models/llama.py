"""A Llama-style decoder LM: RMSNorm, rotary positions, grouped-query causal attention, SwiGLU;
with `n_experts` > 0 a Mixtral-style mixture of experts replaces the MLP of every `moe_every`-th
layer (models/moe.py).

Every parameter carries logical axis names in its ``out_sharding`` metadata; activations are
constrained at block boundaries through `sharding.constrain`, which is a no-op unless the
caller activated rules for a mesh. Layers are stored stacked along a leading `layers` axis so
the parameter tree is the same whether the forward pass scans over layers or unrolls them.
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from models import attention as attention_lib
from models import moe, pipeline, rope
from models.linear import dense
from models.params import normal as _param
from models.stack import REMAT_POLICIES, RematPolicy, run_layers, scan_or_unroll
import sharding
from sharding import constrain

# Logical axes of one layer's key or value cache; the stacked cache has "layers" in front.
CACHE_AXES = ("batch", "length", "kv_heads", "head_dim")
KVCache = dict[str, jax.Array]  # {"k", "v"}: (layers, batch, cache_length, kv_heads, head_dim)


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
  """Shapes and numerics of the decoder. `head_dim` 0 means d_model // n_heads."""
  vocab_size: int = 256
  d_model: int = 128
  n_layers: int = 4
  n_heads: int = 4
  n_kv_heads: int = 2
  head_dim: int = 0
  mlp_dim: int = 384
  rope_theta: float = 10_000.0
  # "default": plain rotary frequencies; "llama3": Llama 3.1+'s frequency scaling (Hugging
  # Face's rope_scaling.rope_type="llama3"): frequencies whose wavelength exceeds
  # rope_original_max_positions / rope_low_freq_factor are divided by rope_factor, those
  # shorter than rope_original_max_positions / rope_high_freq_factor are kept, and the band
  # between is interpolated.
  rope_type: str = "default"
  rope_factor: float = 8.0
  rope_low_freq_factor: float = 1.0
  rope_high_freq_factor: float = 4.0
  rope_original_max_positions: int = 8192
  norm_eps: float = 1e-5
  tie_embeddings: bool = False
  init_std: float = 0.02
  param_dtype: str = "float32"
  compute_dtype: str = "float32"
  remat: RematPolicy = "none"  # what each layer keeps for the backward pass: models/stack.py
  scan_layers: bool = True
  pipeline_microbatches: int = 0  # with a stage mesh axis: models/pipeline.py (0: no pipeline)
  pipeline_repeats: int = 1  # rounds of the circular schedule (1: GPipe)
  # False: every position attends to every other (bidirectional), for encoders such as
  # models/vit.py that reuse these blocks; the LM is causal.
  causal: bool = True
  # models.attention: auto, xla, blockwise, splash, cudnn, ring (decoding one token keeps its
  # own).
  attention: str = "auto"
  # Tokens per device whose logits the training loss holds at once (the vocabulary loss runs
  # over chunks of positions and never holds all float32 logits or their gradient); 0 = one
  # pass over full logits. z_loss: weight of mean(logsumexp^2) added to the loss (0 = off).
  loss_chunk: int = 2048
  z_loss: float = 0.0
  # Mixture of experts (models/moe.py): 0 experts is a dense model. Otherwise the MLP of every
  # `moe_every`-th layer (1: all) becomes n_experts SwiGLU experts of width mlp_dim, of which
  # the router picks experts_per_token per token. moe_dispatch: "dropless" (sort +
  # ragged_dot) or "capacity" (capacity_factor x the even share of slots per expert and
  # sequence, the rest dropped). expert_exchange: how dropless moves tokens across the expert
  # axis, "ring" or "ragged_all_to_all" (TPU/GPU). The router's load-balancing and z losses
  # join the training loss with these weights.
  n_experts: int = 0
  experts_per_token: int = 2
  moe_every: int = 1
  moe_dispatch: str = "dropless"
  capacity_factor: float = 1.25
  expert_exchange: str = "ring"
  load_balance_weight: float = 0.01
  router_z_weight: float = 0.001

  @property
  def resolved_head_dim(self) -> int:
    return self.head_dim or self.d_model // self.n_heads

  @property
  def n_moe_layers(self) -> int:
    return self.n_layers // self.moe_every if self.n_experts else 0

  @classmethod
  def preset(cls, name: str, **overrides) -> LlamaConfig:
    if name not in PRESETS:
      raise ValueError(f"model preset {name!r} is unknown; choose one of {', '.join(PRESETS)}")
    return dataclasses.replace(PRESETS[name], **overrides)

  def validate(self, field: str = "model") -> None:
    """Raises ValueError naming the field and the fix."""
    for name in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "mlp_dim"):
      if getattr(self, name) < 1:
        raise ValueError(f"{field}.{name}={getattr(self, name)} must be >= 1")
    if self.n_heads % self.n_kv_heads:
      raise ValueError(
          f"{field}.n_heads={self.n_heads} is not a multiple of {field}.n_kv_heads="
          f"{self.n_kv_heads}; grouped-query attention needs heads = k * kv_heads")
    if not self.head_dim and self.d_model % self.n_heads:
      raise ValueError(
          f"{field}.d_model={self.d_model} is not divisible by {field}.n_heads={self.n_heads}; "
          f"set {field}.head_dim explicitly")
    if self.resolved_head_dim % 2:
      raise ValueError(f"{field}: head_dim {self.resolved_head_dim} must be even for rotary "
                       f"embeddings")
    for name in ("param_dtype", "compute_dtype"):
      if getattr(self, name) not in ("float32", "bfloat16"):
        raise ValueError(f"{field}.{name}={getattr(self, name)!r}; use 'float32' or 'bfloat16'")
    if self.remat not in REMAT_POLICIES:
      raise ValueError(f"{field}.remat={self.remat!r}; use one of {', '.join(REMAT_POLICIES)}")
    if self.attention not in attention_lib.CHOICES:
      raise ValueError(f"{field}.attention={self.attention!r}; use one of "
                       f"{', '.join(attention_lib.CHOICES)}")
    if self.loss_chunk < 0:
      raise ValueError(f"{field}.loss_chunk={self.loss_chunk} must be >= 0 (0 computes the "
                       f"loss over full logits)")
    if not 0 <= self.z_loss < float("inf"):
      raise ValueError(f"{field}.z_loss={self.z_loss} must be a finite number >= 0 (0 is off)")
    rope.validate(self, field)
    moe.validate(self, field)
    pipeline.validate(self, field)

  def layer_matmul_params(self, active: bool = False) -> float:
    """Matmul weights of one layer, averaged over the layers (MoE layers count all their
    experts and the router, or with `active` only the experts_per_token a token uses)."""
    d, hd = self.d_model, self.resolved_head_dim
    mlp = 3 * d * self.mlp_dim
    experts = self.experts_per_token if active else self.n_experts
    moe_layer = experts * mlp + d * self.n_experts
    mlps = (self.n_layers - self.n_moe_layers) * mlp + self.n_moe_layers * moe_layer
    return d * hd * (2 * self.n_heads + 2 * self.n_kv_heads) + mlps / self.n_layers

  def num_params(self) -> int:
    embeddings = self.vocab_size * self.d_model * (1 if self.tie_embeddings else 2)
    return round(self.n_layers * (self.layer_matmul_params() + 2 * self.d_model)
                 + embeddings + self.d_model)

  def flops_per_token(self, seq_len: int) -> float:
    """Training FLOPs per token (forward + backward): 6 x matmul parameters a token uses (the
    router and its experts_per_token experts in an MoE layer) plus attention scores and
    values, counted as in the PaLM paper's appendix B (no causal discount)."""
    matmul_params = (self.n_layers * self.layer_matmul_params(active=True)
                     + self.vocab_size * self.d_model)
    attention = 12 * self.n_layers * self.n_heads * self.resolved_head_dim * seq_len
    return 6 * matmul_params + attention


PRESETS: dict[str, LlamaConfig] = {
    # For unit tests: a few hundred kB of parameters.
    "tiny": LlamaConfig(vocab_size=256, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                        mlp_dim=64),
    # The CPU demo: ~0.9 M parameters, byte-level vocabulary.
    "cpu": LlamaConfig(vocab_size=256, d_model=128, n_layers=4, n_heads=4, n_kv_heads=2,
                       mlp_dim=384),
    # Real shapes for ahead-of-time compiles. 125m: GPT-3 Small widths with a Llama MLP and
    # untied 32k vocabulary (134 M in all, 85 M without embeddings); 1b is Llama 3.2 1B (its
    # config.json's values, RoPE scaling included), 7b Llama 2 7B, 70b Llama 2 70B (32k vocab).
    "125m": LlamaConfig(vocab_size=32_000, d_model=768, n_layers=12, n_heads=12, n_kv_heads=12,
                        mlp_dim=2048, param_dtype="float32", compute_dtype="bfloat16"),
    "1b": LlamaConfig(vocab_size=128_256, d_model=2048, n_layers=16, n_heads=32, n_kv_heads=8,
                      mlp_dim=8192, rope_theta=500_000.0, rope_type="llama3", rope_factor=32.0,
                      rope_low_freq_factor=1.0, rope_high_freq_factor=4.0,
                      rope_original_max_positions=8192, norm_eps=1e-5, tie_embeddings=True,
                      compute_dtype="bfloat16", remat="full"),
    "7b": LlamaConfig(vocab_size=32_000, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=32,
                      mlp_dim=11_008, compute_dtype="bfloat16", remat="minimal"),
    "70b": LlamaConfig(vocab_size=32_000, d_model=8192, n_layers=80, n_heads=64, n_kv_heads=8,
                       mlp_dim=28_672, compute_dtype="bfloat16", remat="full"),
    # Mixtral-style mixtures of experts: 8 experts, 2 per token, in every layer. moe_tiny and
    # moe_cpu use experts half as wide as tiny's and cpu's MLP, so a token uses as many
    # weights as in those dense models (plus the router); 8x7b is Mixtral 8x7B (46.7 B).
    "moe_tiny": LlamaConfig(vocab_size=256, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                            mlp_dim=32, n_experts=8),
    "moe_cpu": LlamaConfig(vocab_size=256, d_model=128, n_layers=4, n_heads=4, n_kv_heads=2,
                           mlp_dim=192, n_experts=8),
    "8x7b": LlamaConfig(vocab_size=32_000, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=8,
                        mlp_dim=14_336, rope_theta=1_000_000.0, compute_dtype="bfloat16",
                        remat="full", n_experts=8),
}


class RMSNorm(nnx.Module):
  def __init__(self, cfg: LlamaConfig):
    self.eps = cfg.norm_eps
    self.scale = nnx.Param(jnp.ones((cfg.d_model,), cfg.param_dtype), out_sharding=("norm",),
                           eager_sharding=False)

  def __call__(self, x: jax.Array) -> jax.Array:
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
    return (normed * self.scale[...].astype(jnp.float32)).astype(x.dtype)


class Attention(nnx.Module):
  def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs):
    d, hd, std = cfg.d_model, cfg.resolved_head_dim, cfg.init_std
    out_std = std / math.sqrt(2 * cfg.n_layers)
    self.cfg = cfg
    self.wq = _param(rngs, (d, cfg.n_heads, hd), ("embed", "heads", "head_dim"), std,
                     cfg.param_dtype)
    self.wk = _param(rngs, (d, cfg.n_kv_heads, hd), ("embed", "kv_heads", "head_dim"), std,
                     cfg.param_dtype)
    self.wv = _param(rngs, (d, cfg.n_kv_heads, hd), ("embed", "kv_heads", "head_dim"), std,
                     cfg.param_dtype)
    self.wo = _param(rngs, (cfg.n_heads, hd, d), ("heads", "head_dim", "embed"), out_std,
                     cfg.param_dtype)

  def _project(self, x: jax.Array, positions: jax.Array):
    """Queries, keys and values with rotary positions applied: (batch, length, heads, head_dim)."""
    dtype = x.dtype
    q = dense(x, self.wq[...].astype(dtype))
    k = dense(x, self.wk[...].astype(dtype))
    v = dense(x, self.wv[...].astype(dtype))
    inv_freq = rope.frequencies(self.cfg)
    q = constrain(rope.rotary(q, positions, inv_freq), ("batch", "length", "heads", None))
    k = constrain(rope.rotary(k, positions, inv_freq), ("batch", "length", "kv_heads", None))
    v = constrain(v, ("batch", "length", "kv_heads", None))
    return checkpoint_name(q, "query"), checkpoint_name(k, "key"), checkpoint_name(v, "value")

  def _output(self, out: jax.Array) -> jax.Array:
    return dense(out, self.wo[...].astype(out.dtype), contract=2)

  def _attend(self, q, k, v, causal: bool, positions: jax.Array):
    return attention_lib.attend(q, k, v, causal=causal, implementation=self.cfg.attention,
                                positions=positions)

  def __call__(self, x: jax.Array, positions: jax.Array) -> jax.Array:
    q, k, v = self._project(x, positions)
    return self._output(self._attend(q, k, v, self.cfg.causal, positions))

  def prefill(self, x: jax.Array, positions: jax.Array):
    """Causal self-attention over a prompt, also returning its keys and values (the rows it
    writes into the KV cache), each (batch, length, kv_heads, head_dim)."""
    q, k, v = self._project(x, positions)
    return self._output(self._attend(q, k, v, True, positions)), k, v

  def decode(self, x: jax.Array, positions: jax.Array, cache: tuple[jax.Array, jax.Array],
             layer):
    """One new token per row. x (batch, 1, embed) at positions (batch, 1); cache the stacked
    (keys, values), each (layers, batch, cache_length, kv_heads, head_dim), and `layer` this
    layer's index in it. Writes the token's key and value at its position, in place, then
    attends to cache positions 0..position of its own row."""
    q, k, v = self._project(x, positions)
    cache_k, cache_v = (write_cache(c, layer, positions[:, 0], new)
                        for c, new in zip(cache, (k, v)))
    layer_k, layer_v = (jax.lax.dynamic_index_in_dim(c, layer, 0, keepdims=False).astype(q.dtype)
                        for c in (cache_k, cache_v))
    out = jax.nn.dot_product_attention(q, layer_k, layer_v,
                                       key_value_seq_lengths=positions[:, 0] + 1)
    return self._output(out), (cache_k, cache_v)


class MLP(nnx.Module):
  def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs):
    d, std = cfg.d_model, cfg.init_std
    self.w_gate = _param(rngs, (d, cfg.mlp_dim), ("embed", "mlp"), std, cfg.param_dtype)
    self.w_up = _param(rngs, (d, cfg.mlp_dim), ("embed", "mlp"), std, cfg.param_dtype)
    self.w_down = _param(rngs, (cfg.mlp_dim, d), ("mlp", "embed"),
                         std / math.sqrt(2 * cfg.n_layers), cfg.param_dtype)

  def __call__(self, x: jax.Array) -> jax.Array:
    dtype = x.dtype
    gate = checkpoint_name(dense(x, self.w_gate[...].astype(dtype)), "mlp_gate")
    up = checkpoint_name(dense(x, self.w_up[...].astype(dtype)), "mlp_up")
    hidden = constrain(jax.nn.silu(gate) * up, ("batch", "length", "mlp"))
    return dense(hidden, self.w_down[...].astype(dtype))


class Block(nnx.Module):
  """Pre-norm transformer block; input and output (batch, length, embed). With `experts` its
  feed-forward is a mixture of experts (models/moe.py), else a SwiGLU MLP."""

  def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs, experts: bool = False):
    self.attention_norm = RMSNorm(cfg)
    self.attention = Attention(cfg, rngs)
    self.mlp_norm = RMSNorm(cfg)
    self.mlp = moe.MoE(cfg, rngs) if experts else MLP(cfg, rngs)

  def __call__(self, x: jax.Array, positions: jax.Array) -> jax.Array:
    x = x + self.attention(self.attention_norm(x), positions)
    x = x + self.mlp(self.mlp_norm(x))
    return constrain(x, ("batch", "length", "embed"))

  def prefill(self, x: jax.Array, positions: jax.Array):
    """As __call__, also returning (keys, values) for the cache."""
    attended, k, v = self.attention.prefill(self.attention_norm(x), positions)
    x = x + attended
    x = x + self.mlp(self.mlp_norm(x))
    return constrain(x, ("batch", "length", "embed")), (k, v)

  def decode(self, x: jax.Array, positions: jax.Array, cache: tuple[jax.Array, jax.Array],
             layer):
    """One token per row against the stacked (keys, values) cache at `layer`; returns x and
    the cache with this layer's new token written."""
    attended, cache = self.attention.decode(self.attention_norm(x), positions, cache, layer)
    x = x + attended
    x = x + self.mlp(self.mlp_norm(x))
    return constrain(x, ("batch", "length", "embed")), cache


class Group(nnx.Module):
  """`moe_every` consecutive blocks, the last with a mixture of experts: the unit the layers
  are stacked and scanned in when only every n-th layer is MoE (the blocks differ in shape).
  prefill stacks the blocks' caches along a leading axis; decode writes them in place."""

  def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs):
    self.blocks = nnx.List([Block(cfg, rngs, experts=i == cfg.moe_every - 1)
                            for i in range(cfg.moe_every)])

  def __call__(self, x: jax.Array, positions: jax.Array) -> jax.Array:
    for block in self.blocks:
      x = block(x, positions)
    return x

  def prefill(self, x: jax.Array, positions: jax.Array):
    caches = []
    for block in self.blocks:
      x, cache = block.prefill(x, positions)
      caches.append(cache)
    return x, jax.tree.map(lambda *c: jnp.stack(c), *caches)

  def decode(self, x: jax.Array, positions: jax.Array, cache: tuple[jax.Array, jax.Array],
             unit):
    """Block i of this group is layer unit * len(blocks) + i of the stacked cache."""
    for i, block in enumerate(self.blocks):
      x, cache = block.decode(x, positions, cache, unit * len(self.blocks) + i)
    return x, cache


def layers_per_unit(cfg: LlamaConfig) -> int:
  """Layers in one stacked unit: a Group of moe_every blocks, or one Block."""
  return cfg.moe_every if cfg.n_experts and cfg.moe_every > 1 else 1


def _layer_unit(cfg: LlamaConfig, rngs: nnx.Rngs) -> nnx.Module:
  if layers_per_unit(cfg) > 1:
    return Group(cfg, rngs)
  return Block(cfg, rngs, experts=cfg.n_experts > 0)


def write_cache(cache: jax.Array, layer, rows_positions: jax.Array, new: jax.Array) -> jax.Array:
  """`cache` (layers, batch, cache_length, kv_heads, head_dim) with each row's `new` (batch, 1,
  kv_heads, head_dim) written at (layer, row, rows_positions[row]): a one-hot select over this
  layer's slice, put back in place (the other layers are never copied); elementwise, so it
  shards like the cache. Bytes accessed per decode step (scripts/decode_cost.py, v5e-8, batch
  16, cache 4096, fsdp_tp): 125m 2.48 -> 1.86 GiB, 1b 10.87 -> 7.88, 7b 76.09 -> 66.03 against
  the per-layer slices stacked back before. A scatter of the rows (`.at[...].set`) gave 1b
  13.14 (TPU relayouts 64-wide heads), 7b 54.10: it wins only where head_dim fills 128 lanes."""
  write = (jnp.arange(cache.shape[2])[None, :] == rows_positions[:, None])[:, :, None, None]
  layer_cache = jax.lax.dynamic_index_in_dim(cache, layer, 0, keepdims=False)
  layer_cache = jnp.where(write, new.astype(cache.dtype), layer_cache)
  written = jax.lax.dynamic_update_index_in_dim(cache, layer_cache, layer, 0)
  return constrain(written, ("layers",) + CACHE_AXES)


def init_cache(cfg: LlamaConfig, batch: int, cache_length: int) -> KVCache:
  """An empty KV cache: zeros for `batch` rows of `cache_length` positions, compute dtype."""
  shape = (cfg.n_layers, batch, cache_length, cfg.n_kv_heads, cfg.resolved_head_dim)
  return {"k": jnp.zeros(shape, cfg.compute_dtype), "v": jnp.zeros(shape, cfg.compute_dtype)}


class Llama(nnx.Module):
  """tokens (batch, length) int32 -> logits (batch, length, vocab) float32."""

  def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    self.embed = _param(rngs, (cfg.vocab_size, cfg.d_model), ("vocab", "embed"), cfg.init_std,
                        cfg.param_dtype)
    layer_keys = jax.random.split(rngs.params(), cfg.n_layers // layers_per_unit(cfg))
    make_layers = nnx.vmap(lambda key: _layer_unit(cfg, nnx.Rngs(params=key)),
                           in_axes=0, out_axes=0,
                           transform_metadata={nnx.PARTITION_NAME: "layers"})
    self.layers = make_layers(layer_keys)
    self.final_norm = RMSNorm(cfg)
    if not cfg.tie_embeddings:
      self.unembed = _param(rngs, (cfg.d_model, cfg.vocab_size), ("embed", "vocab"),
                            cfg.init_std, cfg.param_dtype)

  def __call__(self, tokens: jax.Array, positions: jax.Array | None = None) -> jax.Array:
    return self._logits(self.features(tokens, positions))

  def features(self, tokens: jax.Array, positions: jax.Array | None = None) -> jax.Array:
    """The final norm's output (batch, length, embed) in the compute dtype: what the
    unembedding turns into logits. Losses that never hold full logits start here."""
    return self.features_and_aux(tokens, positions)[0]

  def logits_and_aux(self, tokens: jax.Array, positions: jax.Array | None = None):
    """(logits, auxiliary loss, metrics), as `features_and_aux` with the features turned into
    logits."""
    features, aux_loss, metrics = self.features_and_aux(tokens, positions)
    return self._logits(features), aux_loss, metrics

  def features_and_aux(self, tokens: jax.Array, positions: jax.Array | None = None):
    """(features, auxiliary loss, metrics): `features`, the loss the router adds to training
    (weighted by the config; 0 for a dense model) and its metrics ({} for a dense model),
    models/moe.py's `summarize`."""
    if positions is None:
      positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    x = self._embed(tokens)
    x, router_stats = run_layers(self.layers, self.cfg, x, positions)
    return (self.final_norm(x), *moe.summarize(router_stats, self.cfg))

  def unembedding(self) -> tuple[jax.Array, str]:
    """(the output matrix in the compute dtype, its einsum letters): the tied embedding
    (vocab, embed) "ve", or the separate unembedding (embed, vocab) "ev". Logits are
    einsum(f"bte,{letters}->btv", features, matrix)."""
    dtype = self.cfg.compute_dtype
    if self.cfg.tie_embeddings:
      return self.embed[...].astype(dtype), "ve"
    return self.unembed[...].astype(dtype), "ev"

  def _embed(self, tokens: jax.Array) -> jax.Array:
    table = self.embed[...]
    # XLA's partitioner moves the batch split of the rows, or of their gradient, onto the
    # table's embed split only by replicating them ("involuntary full rematerialization").
    if sharding.active_ways("length") > 1:  # the forward gather would: compute layout first
      table = constrain(table, ("vocab", "embed"))  # (with the length whole this timed out
      # two-process CPU runs in Gloo's all-gather, tests/toolkit/pod/test_multiprocess.py)
      x = jnp.take(table, tokens, axis=0)
    else:  # the backward's scatter-add would weigh (then drop) such a reshard: per device
      x = sharding.take_rows(table, tokens)  # where the layouts allow, else layout named
    return constrain(x.astype(self.cfg.compute_dtype), ("batch", "length", "embed"))

  def _logits(self, features: jax.Array) -> jax.Array:
    matrix, letters = self.unembedding()
    logits = jnp.einsum(f"bte,{letters}->btv", features, matrix)
    return constrain(logits.astype(jnp.float32), ("batch", "length", "vocab"))

  # --- generation with a KV cache ------------------------------------------------------------
  # The cache is an explicit pytree passed in and returned (not NNX state), so the parameter
  # tree and the training forward pass are untouched, and jit can donate the cache buffers.

  def prefill(self, tokens: jax.Array, lengths: jax.Array) -> tuple[jax.Array, KVCache]:
    """Prompts right-padded to a common length: tokens (batch, length), lengths (batch,) >= 1.

    Returns the logits at each row's last prompt token (batch, vocab) float32 and the keys and
    values of every position (layers, batch, length, kv_heads, head_dim). Rows past a prompt's
    length hold padding; causality keeps it from touching the real positions, and decoding
    overwrites it before any query can see it."""
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    x = self._embed(tokens)
    x, (k, v) = self._layers_with_cache(x, lambda block, h, _: block.prefill(h, positions), None)
    last = jnp.take_along_axis(x, (lengths - 1)[:, None, None], axis=1)  # (batch, 1, embed)
    return self._logits(self.final_norm(last))[:, 0], {"k": k, "v": v}

  def decode(self, tokens: jax.Array, positions: jax.Array,
             cache: KVCache) -> tuple[jax.Array, KVCache]:
    """One token per row: tokens and positions (batch,), cache as from `init_cache` with
    positions 0..position-1 of each row filled. Returns logits (batch, vocab) float32 and the
    cache with each row's token written at its position."""
    positions = positions[:, None]
    x = self._embed(tokens[:, None])
    graphdef, stacked = nnx.split(self.layers)
    units = jax.tree.leaves(stacked)[0].shape[0]

    # The whole stacked cache is carried through the layers and each layer writes its token
    # into it in place: no per-layer slices of the cache are copied out and stacked back.
    def body(carry, inputs):
      h, layer_cache = carry
      unit_state, unit = inputs
      unit_module = nnx.merge(graphdef, unit_state)
      step = lambda module, h_: module.decode(h_, positions, layer_cache, unit)
      return moe.capture_router_stats(step, unit_module, h)[0], None  # stats unused

    (x, (k, v)), _ = scan_or_unroll(body, (x, (cache["k"], cache["v"])),
                                    (stacked, jnp.arange(units)), self.cfg.scan_layers)
    return self._logits(self.final_norm(x))[:, 0], {"k": k, "v": v}

  def _layers_with_cache(self, x: jax.Array, apply, per_layer):
    """Runs `apply(unit, x, per_layer[i]) -> (x, out_i)` over the stacked units (scanned or
    unrolled as in training); returns x and the outputs stacked along a leading layers axis.
    Per-layer arrays are regrouped per unit (Group) and back."""
    graphdef, stacked = nnx.split(self.layers)
    per_unit = layers_per_unit(self.cfg)
    by_unit = lambda a: a.reshape(a.shape[0] // per_unit, per_unit, *a.shape[1:])
    by_layer = lambda a: a.reshape(-1, *a.shape[2:])

    def body(carry, inputs):
      layer_state, layer_inputs = inputs
      unit = nnx.merge(graphdef, layer_state)
      return moe.capture_router_stats(apply, unit, carry, layer_inputs)[0]  # stats unused

    if per_unit > 1:
      per_layer = jax.tree.map(by_unit, per_layer)
    x, outputs = scan_or_unroll(body, x, (stacked, per_layer), self.cfg.scan_layers)
    return x, jax.tree.map(by_layer, outputs) if per_unit > 1 else outputs
