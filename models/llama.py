"""A Llama-style decoder LM: RMSNorm, rotary positions, grouped-query causal attention, SwiGLU;
with `n_experts` > 0 a Mixtral-style mixture of experts replaces the MLP of every `moe_every`-th
layer (models/moe.py).

Every parameter carries logical axis names in its ``out_sharding`` metadata; activations are
constrained at block boundaries through `sharding.constrain`, which is a no-op unless the
caller activated rules for a mesh. Layers are stored stacked along a leading `layers` axis so
the parameter tree is the same whether the forward pass scans over layers or unrolls them.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from models import attention as attention_lib
from models import lora, moe, rope
from models import paged, quantization
from models.linear import dense
from models.llama_config import LlamaConfig
from models.params import normal as _param
from models.stack import run_layers, scan_or_unroll
import sharding
from sharding import constrain

# Logical axes of one layer's key or value cache; the stacked cache has "layers" in front.
CACHE_AXES = ("batch", "length", "kv_heads", "head_dim")
KVCache = dict[str, jax.Array]  # {"k", "v"}: (layers, batch, cache_length, kv_heads, head_dim)


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
    # LoRA updates of the projections cfg.lora_targets names (None for the others).
    self.lora_q = lora.adapter(cfg, "q", rngs, ("embed",), ("heads", "head_dim"))
    self.lora_k = lora.adapter(cfg, "k", rngs, ("embed",), ("kv_heads", "head_dim"))
    self.lora_v = lora.adapter(cfg, "v", rngs, ("embed",), ("kv_heads", "head_dim"))
    self.lora_o = lora.adapter(cfg, "o", rngs, ("heads", "head_dim"), ("embed",))

  def _project(self, x: jax.Array, positions: jax.Array):
    """Queries, keys and values with rotary positions applied: (batch, length, heads, head_dim)."""
    dtype = x.dtype
    q = lora.add(self.lora_q, x, dense(x, self.wq[...].astype(dtype)))
    k = lora.add(self.lora_k, x, dense(x, self.wk[...].astype(dtype)))
    v = lora.add(self.lora_v, x, dense(x, self.wv[...].astype(dtype)))
    inv_freq = rope.frequencies(self.cfg)
    q = constrain(rope.rotary(q, positions, inv_freq), ("batch", "length", "heads", None))
    k = constrain(rope.rotary(k, positions, inv_freq), ("batch", "length", "kv_heads", None))
    v = constrain(v, ("batch", "length", "kv_heads", None))
    return checkpoint_name(q, "query"), checkpoint_name(k, "key"), checkpoint_name(v, "value")

  def _output(self, out: jax.Array) -> jax.Array:
    return lora.add(self.lora_o, out, dense(out, self.wo[...].astype(out.dtype), contract=2))

  def _attend(self, q, k, v, causal: bool, positions: jax.Array,
              segment_ids: jax.Array | None = None):
    return attention_lib.attend(q, k, v, causal=causal, implementation=self.cfg.attention,
                                positions=positions, segment_ids=segment_ids)

  def __call__(self, x: jax.Array, positions: jax.Array,
               segment_ids: jax.Array | None = None) -> jax.Array:
    """Self-attention of x (batch, length, embed); with `segment_ids` (batch, length) each
    packed document attends only within itself (models/attention.py), rotary positions then
    per document."""
    q, k, v = self._project(x, positions)
    return self._output(self._attend(q, k, v, self.cfg.causal, positions, segment_ids))

  def prefill(self, x: jax.Array, positions: jax.Array):
    """Causal self-attention over a prompt, also returning its keys and values (the rows it
    writes into the KV cache), each (batch, length, kv_heads, head_dim)."""
    q, k, v = self._project(x, positions)
    return self._output(self._attend(q, k, v, True, positions)), k, v

  def decode(self, x: jax.Array, positions: jax.Array, cache: tuple[jax.Array, jax.Array],
             layer, pages=None):
    """One new token per row. x (batch, 1, embed) at positions (batch, 1); cache the stacked
    (keys, values), each (layers, batch, cache_length, kv_heads, head_dim), and `layer` this
    layer's index in it. Writes the token's key and value at its position, in place, then
    attends to cache positions 0..position of its own row.

    With `pages` (models/paged.py's Rows) the cache is paged and x (tokens, 1, embed) holds
    the step's tokens of every row, laid out as models/paged.py says, at positions (tokens,
    1)."""
    q, k, v = self._project(x, positions)
    if pages is not None:
      out, cache = paged.write_and_attend(q, k, v, cache, layer, pages, positions)
      return self._output(out), cache
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
    self.lora_gate = lora.adapter(cfg, "gate", rngs, ("embed",), ("mlp",))
    self.lora_up = lora.adapter(cfg, "up", rngs, ("embed",), ("mlp",))
    self.lora_down = lora.adapter(cfg, "down", rngs, ("mlp",), ("embed",))

  def __call__(self, x: jax.Array) -> jax.Array:
    dtype = x.dtype
    gate = lora.add(self.lora_gate, x, dense(x, self.w_gate[...].astype(dtype)))
    up = lora.add(self.lora_up, x, dense(x, self.w_up[...].astype(dtype)))
    gate, up = checkpoint_name(gate, "mlp_gate"), checkpoint_name(up, "mlp_up")
    hidden = constrain(jax.nn.silu(gate) * up, ("batch", "length", "mlp"))
    return lora.add(self.lora_down, hidden, dense(hidden, self.w_down[...].astype(dtype)))


class Block(nnx.Module):
  """Pre-norm transformer block; input and output (batch, length, embed). With `experts` its
  feed-forward is a mixture of experts (models/moe.py), else a SwiGLU MLP."""

  def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs, experts: bool = False):
    self.attention_norm = RMSNorm(cfg)
    self.attention = Attention(cfg, rngs)
    self.mlp_norm = RMSNorm(cfg)
    self.mlp = moe.MoE(cfg, rngs) if experts else MLP(cfg, rngs)

  def __call__(self, x: jax.Array, positions: jax.Array,
               segment_ids: jax.Array | None = None) -> jax.Array:
    x = x + self.attention(self.attention_norm(x), positions, segment_ids)
    x = x + self.mlp(self.mlp_norm(x))
    return constrain(x, ("batch", "length", "embed"))

  def prefill(self, x: jax.Array, positions: jax.Array):
    """As __call__, also returning (keys, values) for the cache."""
    attended, k, v = self.attention.prefill(self.attention_norm(x), positions)
    x = x + attended
    x = x + self.mlp(self.mlp_norm(x))
    return constrain(x, ("batch", "length", "embed")), (k, v)

  def decode(self, x: jax.Array, positions: jax.Array, cache: tuple[jax.Array, jax.Array],
             layer, pages=None):
    """One token per row against the stacked (keys, values) cache at `layer` (paged with
    `pages`: Attention.decode); returns x and the cache with this layer's new token written."""
    attended, cache = self.attention.decode(self.attention_norm(x), positions, cache, layer,
                                            pages)
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

  def __call__(self, x: jax.Array, positions: jax.Array,
               segment_ids: jax.Array | None = None) -> jax.Array:
    for block in self.blocks:
      x = block(x, positions, segment_ids)
    return x

  def prefill(self, x: jax.Array, positions: jax.Array):
    caches = []
    for block in self.blocks:
      x, cache = block.prefill(x, positions)
      caches.append(cache)
    return x, jax.tree.map(lambda *c: jnp.stack(c), *caches)

  def decode(self, x: jax.Array, positions: jax.Array, cache: tuple[jax.Array, jax.Array],
             unit, pages=None):
    """Block i of this group is layer unit * len(blocks) + i of the stacked cache."""
    for i, block in enumerate(self.blocks):
      x, cache = block.decode(x, positions, cache, unit * len(self.blocks) + i, pages)
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
  shards like the cache. Bytes accessed per decode step (scripts/bench/decode_cost.py, v5e-8, batch
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


def init_paged_cache(cfg: LlamaConfig, pages: int, page_size: int) -> KVCache:
  """An empty paged KV cache (models/paged.py): `pages` pages of `page_size` positions each,
  (layers, kv_heads, pages, page_size, head_dim) for keys and values, compute dtype."""
  return paged.init(cfg.n_layers, cfg.n_kv_heads, cfg.resolved_head_dim, pages, page_size,
                    cfg.compute_dtype)


class Llama(nnx.Module):
  """tokens (batch, length) int32 -> logits (batch, length, vocab) float32.

  `positions` (batch, length) int: each token's position for the rotary embedding (default
  0..length-1). `segment_ids` (batch, length) int: for rows packed with several documents,
  which one each token belongs to (1, 2, ...; 0 padding); attention then stays within each
  document, and `positions` restart at 0 with each (models/attention.py). None: one sequence
  per row."""

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

  def __call__(self, tokens: jax.Array, positions: jax.Array | None = None,
               segment_ids: jax.Array | None = None) -> jax.Array:
    return self._logits(self.features(tokens, positions, segment_ids))

  def features(self, tokens: jax.Array, positions: jax.Array | None = None,
               segment_ids: jax.Array | None = None) -> jax.Array:
    """The final norm's output (batch, length, embed) in the compute dtype: what the
    unembedding turns into logits. Losses that never hold full logits start here."""
    return self.features_and_aux(tokens, positions, segment_ids)[0]

  def logits_and_aux(self, tokens: jax.Array, positions: jax.Array | None = None,
                     segment_ids: jax.Array | None = None):
    """(logits, auxiliary loss, metrics), as `features_and_aux` with the features turned into
    logits."""
    features, aux_loss, metrics = self.features_and_aux(tokens, positions, segment_ids)
    return self._logits(features), aux_loss, metrics

  def features_and_aux(self, tokens: jax.Array, positions: jax.Array | None = None,
                       segment_ids: jax.Array | None = None):
    """(features, auxiliary loss, metrics): `features`, the loss the router adds to training
    (weighted by the config; 0 for a dense model) and its metrics ({} for a dense model),
    models/moe.py's `summarize`. The router sees every position, padding included (it takes
    expert slots like any token)."""
    if positions is None:
      positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    x = self._embed(tokens)
    x, router_stats = run_layers(self.layers, self.cfg, x, positions, segment_ids)
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
    x, cache = self._through_cache(self._embed(tokens[:, None]), positions[:, None], cache)
    return self._logits(self.final_norm(x))[:, 0], cache

  def extend(self, tokens: jax.Array, positions: jax.Array, cache: KVCache, rows: paged.Rows,
             last: jax.Array) -> tuple[jax.Array, KVCache]:
    """A step against a paged cache (models/paged.py): each row's next tokens (one when
    decoding, a chunk of a prompt when prefilling) through the model. tokens and positions
    (tokens,) are every row's tokens laid out as models/paged.py says; `rows` their groups,
    page tables and counts; last (rows,) the index in `tokens` of each row's last real token.
    Returns the logits there (rows, vocab) float32 and the cache with the real tokens' keys
    and values written (padding is never written)."""
    x, cache = self._through_cache(self._embed(tokens[:, None]), positions[:, None], cache,
                                   rows)
    x = constrain(jnp.take(x, last, axis=0), ("batch", "length", "embed"))
    return self._logits(self.final_norm(x))[:, 0], cache

  def _through_cache(self, x: jax.Array, positions: jax.Array, cache: KVCache, pages=None):
    """The layers over x (batch, length, embed) reading and writing `cache` (contiguous, or
    paged with `pages`, models/paged.py's Rows). Int8 weights (models/quantization.py) are
    turned back into the compute dtype one layer at a time, inside the loop."""
    graphdef, stacked = nnx.split(self.layers)
    units = jax.tree.leaves(stacked)[0].shape[0]

    # The whole stacked cache is carried through the layers and each layer writes its token
    # into it in place: no per-layer slices of the cache are copied out and stacked back.
    def body(carry, inputs):
      h, layer_cache = carry
      unit_state, unit = inputs
      unit_module = nnx.merge(graphdef, quantization.dequantized(unit_state,
                                                                 self.cfg.compute_dtype))
      step = lambda module, h_: module.decode(h_, positions, layer_cache, unit, pages)
      return moe.capture_router_stats(step, unit_module, h)[0], None  # stats unused

    (x, (k, v)), _ = scan_or_unroll(body, (x, (cache["k"], cache["v"])),
                                    (stacked, jnp.arange(units)), self.cfg.scan_layers)
    return x, {"k": k, "v": v}

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
