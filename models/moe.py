"""A mixture-of-experts feed-forward layer (Mixtral-style): a router picks `k` of `E` SwiGLU
experts per token and mixes their outputs with its renormalized probabilities.

Shapes: B batch, L length, T tokens, d model width (`embed`), m expert hidden width (`mlp`),
E experts (`experts`), k experts per token, C capacity (slots per expert and sequence).

Routing is plain array code the compiler partitions like the rest of the model: router logits
(float32), softmax, top-k, weights renormalized to sum to 1 (`route`). Two auxiliary losses
keep the router healthy (`load_balance_loss`, `router_z_loss`); the model adds them to the
training loss with the weights in its config and reports them, with the expert loads and the
fraction of dropped assignments, as metrics.

The experts run per device (`sharding.shard_map`) in one of two dispatch modes over the same
parameters:

  capacity  each sequence gives every expert C = min(L, ceil(L * k / E * capacity_factor))
            slots, first choices before second choices, earlier tokens first; assignments past
            an expert's capacity are dropped (the token keeps its other experts and the
            residual). One-hot dispatch and combine einsums move tokens into (E, B, C, d) and
            back; across the expert axis an all-to-all exchanges the slots.
  dropless  assignments sorted by expert and multiplied with `jax.lax.ragged_dot` (one group
            per expert), then unsorted: nothing is dropped. Across the expert axis either a
            ring of experts (all-gather the tokens, each device runs its own experts on them,
            reduce-scatter the outputs back; runs everywhere) or `jax.lax.ragged_all_to_all`
            (send each assignment only to the device that holds its expert and back; not
            implemented by XLA:CPU in jax 0.10, so it is proven by TPU ahead-of-time compiles).

Expert parallelism: the rules map `experts` onto mesh axes (`expert` in the *_ep presets);
each device holds E / (their size) experts. When the batch is split over those axes too, the
tokens are exchanged as above; when it is not, every device already has every token, runs its
own experts and the outputs are summed over the expert axes. A split expert hidden width
(`mlp` over `tensor`) sums the partial outputs over those axes.
"""
from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

import sharding
from models.params import normal

DISPATCH_MODES = ("dropless", "capacity")
EXCHANGES = ("ring", "ragged_all_to_all")


def validate(cfg, field: str = "model") -> None:
  """The mixture-of-experts fields of a model config; raises ValueError naming field and fix."""
  if cfg.n_experts < 0:
    raise ValueError(f"{field}.n_experts={cfg.n_experts} must be >= 0 (0: a dense model)")
  if not cfg.n_experts:
    return
  if not 1 <= cfg.experts_per_token <= cfg.n_experts:
    raise ValueError(f"{field}.experts_per_token={cfg.experts_per_token} must be between 1 and "
                     f"{field}.n_experts={cfg.n_experts}; a token cannot use more experts than "
                     f"there are")
  if cfg.moe_every < 1 or cfg.n_layers % cfg.moe_every:
    raise ValueError(f"{field}.moe_every={cfg.moe_every} must be >= 1 and divide "
                     f"{field}.n_layers={cfg.n_layers} (1: every layer is a mixture of experts)")
  if cfg.moe_dispatch not in DISPATCH_MODES:
    raise ValueError(f"{field}.moe_dispatch={cfg.moe_dispatch!r} is unknown; use "
                     f"{' or '.join(map(repr, DISPATCH_MODES))}")
  if cfg.expert_exchange not in EXCHANGES:
    raise ValueError(f"{field}.expert_exchange={cfg.expert_exchange!r} is unknown; use "
                     f"{' or '.join(map(repr, EXCHANGES))}")
  if not cfg.capacity_factor > 0:
    raise ValueError(f"{field}.capacity_factor={cfg.capacity_factor} must be > 0; "
                     f"{cfg.n_experts / cfg.experts_per_token:g} (= n_experts / "
                     f"experts_per_token) or more drops nothing")
  for name in ("load_balance_weight", "router_z_weight"):
    if not getattr(cfg, name) >= 0:
      raise ValueError(f"{field}.{name}={getattr(cfg, name)} must be >= 0")


# --- routing and its losses -------------------------------------------------------------------

class Routing(NamedTuple):
  experts: jax.Array  # (..., k) int32: the chosen experts, best first
  weights: jax.Array  # (..., k) float32: their probabilities, renormalized to sum to 1
  probs: jax.Array    # (..., E) float32: the router's softmax over all experts


def route(logits: jax.Array, k: int) -> Routing:
  """Top-k softmax routing, renormalized over the chosen k (Mixtral's)."""
  probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
  top, experts = jax.lax.top_k(probs, k)
  return Routing(experts.astype(jnp.int32), top / jnp.sum(top, axis=-1, keepdims=True), probs)


def load_balance_loss(probs: jax.Array, experts: jax.Array) -> jax.Array:
  """Switch Transformer's auxiliary loss over all k choices: E * sum_e f_e * P_e, where f_e is
  the fraction of the k * T assignments that go to expert e and P_e the mean router
  probability of e, over the tokens. (Hugging Face's Mixtral loss is k times this.)

  It is 1.0 whenever the router's probabilities are uniform, and grows as routing and
  probability pile onto the same experts: E/k at most, E for a top-1 router that sends
  everything to one expert. Its gradient reaches the router through P_e (f_e counts)."""
  n_experts = probs.shape[-1]
  fraction = jnp.mean(jax.nn.one_hot(experts.reshape(-1), n_experts), axis=0)
  return n_experts * jnp.sum(fraction * jnp.mean(probs.reshape(-1, n_experts), axis=0))


def router_z_loss(logits: jax.Array) -> jax.Array:
  """ST-MoE's z-loss: the mean squared log-partition of the router logits (keeps them small)."""
  return jnp.mean(jax.nn.logsumexp(logits.astype(jnp.float32), axis=-1) ** 2)


def capacity(group_size: int, k: int, n_experts: int, factor: float) -> int:
  """Slots per expert and sequence: ceil(tokens * k / E * factor), at most the tokens (an
  expert can take each token once)."""
  return max(1, min(group_size, math.ceil(group_size * k / n_experts * factor)))


def capacity_slots(experts: jax.Array, n_experts: int, slots: int) -> tuple[jax.Array, jax.Array]:
  """Each assignment's slot in its expert's buffer, per sequence, and whether it fits.

  experts: (B, L, k). Priority: every token's first choice (in position order), then every
  second choice, ... Returns slot (B, L, k) int32 and keep (B, L, k) bool (slot < slots)."""
  b, length, k = experts.shape
  one_hot = jax.nn.one_hot(experts, n_experts, dtype=jnp.int32)          # (B, L, k, E)
  ordered = one_hot.transpose(0, 2, 1, 3).reshape(b, k * length, n_experts)
  position = jnp.cumsum(ordered, axis=1) - 1                             # per expert, in order
  slot = jnp.sum(position * ordered, axis=-1).reshape(b, k, length).transpose(0, 2, 1)
  return slot.astype(jnp.int32), slot < slots


# --- the experts on one device ----------------------------------------------------------------

def swiglu(x: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array,
           matmul: Callable) -> jax.Array:
  """down(silu(x @ gate) * (x @ up)), with `matmul(x, w)` per expert (einsum or ragged_dot)."""
  return matmul(jax.nn.silu(matmul(x, w_gate)) * matmul(x, w_up), w_down)


def grouped_swiglu(rows: jax.Array, group_sizes: jax.Array, w_gate, w_up, w_down) -> jax.Array:
  """rows (M, d) sorted by expert, group_sizes (E_local,) -> (M, d); rows past the last group
  come out 0 (and so do the gradients of experts with no rows)."""
  matmul = lambda x, w: jax.lax.ragged_dot(x, w.astype(x.dtype), group_sizes)
  return swiglu(rows, w_gate, w_up, w_down, matmul)


def local_experts(tokens: jax.Array, experts: jax.Array, weights: jax.Array, w_gate, w_up,
                  w_down) -> jax.Array:
  """Dropless on one device: tokens (T, d), experts (T, k) numbered among this device's
  experts (those outside [0, E_local) are not here), weights (T, k) -> (T, d), the weighted
  sum of this device's experts' outputs for each token."""
  t, k = experts.shape
  n_local = w_gate.shape[0]
  flat = experts.reshape(-1)
  key = jnp.where((flat >= 0) & (flat < n_local), flat, n_local)   # not here: sorted last
  order = jnp.argsort(key, stable=True)
  group_sizes = jnp.bincount(key, length=n_local + 1)[:n_local].astype(jnp.int32)
  out = grouped_swiglu(tokens[order // k], group_sizes, w_gate, w_up, w_down)
  out = out[jnp.argsort(order)].reshape(t, k, -1)                    # unsort
  return jnp.einsum("tkd,tk->td", out, weights.astype(out.dtype))


def _shard_index(axes: tuple[str, ...]) -> jax.Array | int:
  return jax.lax.axis_index(axes) if axes else 0


def _reduce(x: jax.Array, axes: tuple[str, ...]) -> jax.Array:
  return jax.lax.psum(x, axes) if axes else x


class Axes(NamedTuple):
  """Mesh axes (resolved from logical names) the per-device expert code communicates over."""
  experts: tuple[str, ...]    # the experts are split over these
  exchange: bool              # the tokens are split over them too: exchange tokens
  mlp: tuple[str, ...]        # each expert's hidden width is split over these: sum outputs


def capacity_per_device(x, experts, weights, slot, w_gate, w_up, w_down, *, axes: Axes,
                        n_experts: int, slots: int):
  """Capacity dispatch on one device: x (B, L, d), experts/weights/slot (B, L, k) -> (B, L, d).

  Assignments whose slot is >= `slots` are dropped (one_hot of an out-of-range index is 0)."""
  n_local = w_gate.shape[0]
  # With an exchange every device fills all E experts' slots for its own sequences and an
  # all-to-all delivers them; without one it fills only its own experts' slots.
  first = 0 if axes.exchange else _shard_index(axes.experts) * n_local
  count = n_experts if axes.exchange else n_local
  expert_hot = jax.nn.one_hot(experts - first, count, dtype=x.dtype)      # (B, L, k, E')
  slot_hot = jax.nn.one_hot(slot, slots, dtype=x.dtype)                   # (B, L, k, C)
  dispatch = jnp.einsum("blke,blkc->blec", expert_hot, slot_hot)
  combine = jnp.einsum("blke,blkc,blk->blec", expert_hot, slot_hot, weights.astype(x.dtype))
  expert_in = jnp.einsum("blec,bld->ebcd", dispatch, x)                   # (E', B, C, d)
  if axes.exchange and axes.experts:
    expert_in = jax.lax.all_to_all(expert_in, axes.experts, 0, 1, tiled=True)
  matmul = lambda h, w: jnp.einsum("ebcx,exy->ebcy", h, w.astype(h.dtype))
  expert_out = swiglu(expert_in, w_gate, w_up, w_down, matmul)
  if axes.exchange and axes.experts:
    expert_out = jax.lax.all_to_all(expert_out, axes.experts, 1, 0, tiled=True)
  out = jnp.einsum("blec,ebcd->bld", combine, expert_out)
  return _reduce(out, axes.mlp + (() if axes.exchange else axes.experts))


def ring_per_device(x, experts, weights, w_gate, w_up, w_down, *, axes: Axes):
  """Dropless, ring of experts: x (B, L, d), experts/weights (B, L, k) -> (B, L, d).

  With an exchange the tokens of every device along the expert axes are gathered, this
  device's experts run on those routed to them, and the outputs are reduce-scattered back."""
  b, length, d = x.shape
  k = experts.shape[-1]
  tokens, experts, weights = x.reshape(-1, d), experts.reshape(-1, k), weights.reshape(-1, k)
  gather = axes.exchange and axes.experts
  if gather:
    tokens, experts, weights = (jax.lax.all_gather(a, axes.experts, tiled=True)
                                for a in (tokens, experts, weights))
  first = _shard_index(axes.experts) * w_gate.shape[0]
  out = local_experts(tokens, experts - first, weights, w_gate, w_up, w_down)
  if gather:
    out = jax.lax.psum_scatter(out, axes.experts, scatter_dimension=0, tiled=True)
  elif axes.experts:
    out = jax.lax.psum(out, axes.experts)
  return _reduce(out, axes.mlp).reshape(b, length, d)


def all_to_all_per_device(x, experts, weights, w_gate, w_up, w_down, *, axes: Axes,
                          exchange: Callable = jax.lax.ragged_all_to_all):
  """Dropless, each assignment sent only to the device holding its expert and back.

  x (B, L, d), experts/weights (B, L, k) -> (B, L, d); needs the tokens split over the expert
  axes (`axes.exchange`). `exchange` has `jax.lax.ragged_all_to_all`'s signature (tests
  pass an equivalent built from all-gathers, since XLA:CPU lacks the real one). The receive
  buffer holds the worst case, every device's assignments landing on one device."""
  b, length, d = x.shape
  k = experts.shape[-1]
  n_local = w_gate.shape[0]
  shards = jax.lax.axis_size(axes.experts)
  tokens, flat = x.reshape(-1, d), experts.reshape(-1)
  order = jnp.argsort(flat, stable=True)            # by destination device, then its expert
  rows = tokens[order // k]
  per_expert = jnp.bincount(flat, length=n_local * shards).astype(jnp.int32)
  per_destination = per_expert.reshape(shards, n_local)
  send_sizes = jnp.sum(per_destination, axis=1)
  input_offsets = jnp.cumsum(send_sizes) - send_sizes
  # From each source: how many rows it sends for each of this device's experts.
  received = jax.lax.all_to_all(per_destination, axes.experts, 0, 0, tiled=True)
  recv_sizes = jnp.sum(received, axis=1)
  recv_offsets = jnp.cumsum(recv_sizes) - recv_sizes
  # A source's rows land after those of lower-numbered sources on each destination.
  sent = jax.lax.all_gather(send_sizes, axes.experts)                # (source, destination)
  output_offsets = (jnp.cumsum(sent, axis=0) - sent)[jax.lax.axis_index(axes.experts)]
  buffer = jnp.zeros((rows.shape[0] * shards, d), rows.dtype)
  arrived = exchange(rows, buffer, input_offsets, send_sizes, output_offsets, recv_sizes,
                     axis_name=axes.experts)
  # Arrived rows run source by source, each sorted by expert: regroup them by expert.
  ends = jnp.cumsum(received.reshape(-1))
  group = jnp.searchsorted(ends, jnp.arange(buffer.shape[0]), side="right")
  key = jnp.where(group < ends.shape[0], group % n_local, n_local)
  regroup = jnp.argsort(key, stable=True)
  out = grouped_swiglu(arrived[regroup], jnp.sum(received, axis=0), w_gate, w_up, w_down)
  out = out[jnp.argsort(regroup)]
  # Send each result back to where its row came from, into the sender's sorted order.
  back_offsets = jax.lax.all_to_all(input_offsets, axes.experts, 0, 0, tiled=True)
  returned = exchange(out, jnp.zeros_like(rows), recv_offsets, recv_sizes, back_offsets,
                      send_sizes, axis_name=axes.experts)
  out = returned[jnp.argsort(order)].reshape(-1, k, d)
  out = jnp.einsum("tkd,tk->td", out, weights.reshape(-1, k).astype(out.dtype))
  return _reduce(out, axes.mlp).reshape(b, length, d)


# --- the layer --------------------------------------------------------------------------------

TOKENS = ("batch", "length", None)       # (B, L, d) and (B, L, k): whole d and k per device
GATE_UP = ("experts", None, "mlp")       # (E, d, m) in compute: experts split, d whole
DOWN = ("experts", "mlp", None)          # (E, m, d)


def expert_axes() -> Axes:
  """The mesh axes of the active rules the expert code communicates over."""
  experts = sharding.active_axes("experts")
  token_axes = sharding.active_axes("batch") + sharding.active_axes("length")
  shared = [a for a in experts if a in token_axes]
  if shared and len(shared) < len(experts):
    raise sharding.ShardingError(
        f"experts are split over mesh axes {'+'.join(experts)} but the batch only over "
        f"{'+'.join(shared)} of them; split the batch over all of them or none (sharding."
        f"activation_overrides)")
  return Axes(experts=experts, exchange=bool(shared), mlp=sharding.active_axes("mlp"))


def capacity_dispatch(x, routing: Routing, weights, cfg) -> tuple[jax.Array, jax.Array]:
  """Capacity mode: (output (B, L, d), kept (B, L, k) bool)."""
  slots = capacity(x.shape[1], cfg.experts_per_token, cfg.n_experts, cfg.capacity_factor)
  slot, keep = capacity_slots(routing.experts, cfg.n_experts, slots)
  per_device = functools.partial(capacity_per_device, axes=expert_axes(),
                                 n_experts=cfg.n_experts, slots=slots)
  run = sharding.shard_map(per_device, in_axes=(TOKENS,) * 4 + (GATE_UP, GATE_UP, DOWN),
                           out_axes=TOKENS)
  return run(x, routing.experts, routing.weights, slot, *weights), keep


def dropless_dispatch(x, routing: Routing, weights, cfg) -> tuple[jax.Array, jax.Array]:
  """Dropless mode: (output (B, L, d), kept: all True)."""
  axes = expert_axes()
  ragged = cfg.expert_exchange == "ragged_all_to_all" and axes.exchange
  per_device = functools.partial(all_to_all_per_device if ragged else ring_per_device,
                                 axes=axes)
  run = sharding.shard_map(per_device, in_axes=(TOKENS,) * 3 + (GATE_UP, GATE_UP, DOWN),
                           out_axes=TOKENS)
  return run(x, routing.experts, routing.weights, *weights), jnp.ones(routing.experts.shape,
                                                                     bool)


DISPATCH = {"capacity": capacity_dispatch, "dropless": dropless_dispatch}


def router_stats(logits: jax.Array, routing: Routing, keep: jax.Array) -> dict[str, jax.Array]:
  """One layer's router statistics: its two auxiliary losses, the fraction of assignments
  dropped, and each expert's share of the assignments (E,)."""
  n_experts = logits.shape[-1]
  assigned = jax.nn.one_hot(routing.experts, n_experts).reshape(-1, n_experts)
  return {"load_balance_loss": load_balance_loss(routing.probs, routing.experts),
          "router_z_loss": router_z_loss(logits),
          "dropped_fraction": 1.0 - jnp.mean(keep.astype(jnp.float32)),
          "expert_load": jnp.mean(assigned, axis=0)}


class MoE(nnx.Module):
  """The mixture-of-experts feed-forward block: (B, L, d) -> (B, L, d).

  Parameters: router (embed, experts); w_gate, w_up (experts, embed, mlp); w_down (experts,
  mlp, embed). Each call sows `router_stats` (an nnx.Intermediate; `capture_router_stats`)."""

  def __init__(self, cfg, rngs: nnx.Rngs):
    d, m, e, std = cfg.d_model, cfg.mlp_dim, cfg.n_experts, cfg.init_std
    self.cfg = cfg
    self.router = normal(rngs, (d, e), ("embed", "experts"), std, cfg.param_dtype)
    self.w_gate = normal(rngs, (e, d, m), ("experts", "embed", "mlp"), std, cfg.param_dtype)
    self.w_up = normal(rngs, (e, d, m), ("experts", "embed", "mlp"), std, cfg.param_dtype)
    self.w_down = normal(rngs, (e, m, d), ("experts", "mlp", "embed"),
                         std / math.sqrt(2 * cfg.n_layers), cfg.param_dtype)

  def __call__(self, x: jax.Array) -> jax.Array:
    cfg = self.cfg
    logits = sharding.constrain(
        jnp.einsum("bld,de->ble", x.astype(jnp.float32), self.router[...].astype(jnp.float32)),
        ("batch", "length", None))
    routing = route(logits, cfg.experts_per_token)
    weights = tuple(w[...].astype(x.dtype) for w in (self.w_gate, self.w_up, self.w_down))
    out, keep = DISPATCH[cfg.moe_dispatch](x, routing, weights, cfg)
    self.sow(nnx.Intermediate, "router_stats", router_stats(logits, routing, keep),
             reduce_fn=lambda _, new: new)
    return out


def capture_router_stats(apply: Callable, module: nnx.Module, *args):
  """Runs `apply(module, *args)`; returns its result and the router statistics that the MoE
  blocks inside `module` sowed, in tree order ([] for a dense module)."""
  result, captured = nnx.capture(apply, nnx.Intermediate)(module, *args)
  return result, [variable.get_value() for path, variable in nnx.to_flat_state(captured)
                  if path[-1] == "router_stats"]


def summarize(stats: list[dict[str, jax.Array]], cfg) -> tuple[jax.Array, dict[str, jax.Array]]:
  """(the auxiliary loss to add to the training loss, metrics) from every MoE layer's stats,
  each possibly stacked over scanned layers: losses and dropped fraction averaged over layers,
  the least and most loaded expert of any layer relative to the mean load (1.0 = even), and
  the auxiliary loss (the weighted router losses). A dense model has no stats: (0.0, {})."""
  if not stats:
    return jnp.zeros((), jnp.float32), {}
  gather = lambda name: jnp.concatenate([jnp.reshape(s[name], (-1,)) for s in stats])
  loads = jnp.concatenate([jnp.reshape(s["expert_load"], (-1, cfg.n_experts)) for s in stats])
  metrics = {"load_balance_loss": jnp.mean(gather("load_balance_loss")),
             "router_z_loss": jnp.mean(gather("router_z_loss")),
             "dropped_fraction": jnp.mean(gather("dropped_fraction")),
             "expert_load_min": jnp.min(loads) * cfg.n_experts,
             "expert_load_max": jnp.max(loads) * cfg.n_experts}
  metrics["aux_loss"] = (cfg.load_balance_weight * metrics["load_balance_loss"]
                         + cfg.router_z_weight * metrics["router_z_loss"])
  return metrics["aux_loss"], metrics
