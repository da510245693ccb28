"""The layer stack: layers stored stacked along a leading "layers" axis, run in order (scanned
or unrolled) under a remat policy. Shared by the LM (models/llama.py) and encoders such as the
ViT (models/vit.py)."""
from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp
from flax import nnx

import sharding
from models import attention as attention_lib
from models import lora, moe, pipeline

# What each layer keeps for the backward pass (the rest is recomputed there):
#   none            everything
#   save_dots       every matmul output without batch dimensions: the q/k/v/output and MLP
#                   projections (attention kernels and the XLA scores are recomputed)
#   minimal         the q/k/v projections, the attention output (with the kernels' softmax
#                   statistics: attention never reruns) and the MLP's gate and up
#                   projections; not the scores, not the MLP hidden, not the output projections
#   save_attention  q/k/v and the attention output only: the MLP is recomputed
#   full            nothing but each layer's input
RematPolicy = Literal["none", "save_dots", "minimal", "save_attention", "full"]
REMAT_POLICIES = ("none", "save_dots", "minimal", "save_attention", "full")

_POLICIES = {
    "full": None,  # save nothing: recompute the whole block in the backward pass
    "save_dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "minimal": jax.checkpoint_policies.save_only_these_names(
        "query", "key", "value", attention_lib.CONTEXT, "mlp_gate", "mlp_up"),
    "save_attention": jax.checkpoint_policies.save_only_these_names(
        "query", "key", "value", attention_lib.CONTEXT),
}


def scan_or_unroll(body, carry, xs, scan: bool):
  """`jax.lax.scan(body, carry, xs)`, or the same loop unrolled in Python (outputs stacked)."""
  if scan:
    return jax.lax.scan(body, carry, xs)
  outputs = []
  for i in range(jax.tree.leaves(xs)[0].shape[0]):
    carry, out = body(carry, jax.tree.map(lambda a, i=i: a[i], xs))
    outputs.append(out)
  return carry, jax.tree.map(lambda *a: jnp.stack(a), *outputs)


def run_layers(layers: nnx.Module, cfg, x: jax.Array, positions: jax.Array,
               segment_ids: jax.Array | None = None
               ) -> tuple[jax.Array, list[dict[str, jax.Array]]]:
  """Applies stacked blocks (one Block, or Group, vmapped over "layers") in order: scanned or
  unrolled per cfg.scan_layers, each under cfg.remat. Returns x and the router statistics of
  the MoE blocks (`moe.capture_router_stats`, stacked over layers; [] for a dense model). Shared
  by the LM and encoders such as the ViT. `segment_ids` (batch, length), packed documents, go
  to each layer beside the positions (layers that take them: models/llama.py)."""
  graphdef, stacked = nnx.split(layers)
  if sharding.active_ways("layers") > 1:  # a pipeline over the stage axes (no router stats)
    return _pipelined(graphdef, stacked, cfg, x, positions, segment_ids), []
  tokens = (positions,) if segment_ids is None else (positions, segment_ids)

  def body(carry: jax.Array, inputs):
    layer_state, index = inputs
    with lora.layer(index):  # each layer draws its own LoRA dropout masks
      return moe.capture_router_stats(lambda layer, x: layer(x, *tokens),
                                      nnx.merge(graphdef, layer_state), carry)

  if cfg.remat != "none":
    body = jax.checkpoint(body, policy=_POLICIES[cfg.remat])
  units = jax.tree.leaves(stacked)[0].shape[0]
  return scan_or_unroll(body, x, (stacked, jnp.arange(units)), cfg.scan_layers)


def _pipelined(graphdef, stacked, cfg, x: jax.Array, positions: jax.Array,
               segment_ids: jax.Array | None = None) -> jax.Array:
  """run_layers' loop as a pipeline: each stage runs its consecutive layers as above; the
  positions (and segment ids) move through the stages with their rows."""
  def stage(stage_layers, h, stage_tokens):
    def layer(carry, layer_state):
      return nnx.merge(graphdef, layer_state)(carry, *stage_tokens), None

    if cfg.remat != "none":
      layer = jax.checkpoint(layer, policy=_POLICIES[cfg.remat])
    return scan_or_unroll(layer, h, stage_layers, cfg.scan_layers)[0]

  tokens = (positions,) if segment_ids is None else (positions, segment_ids)
  return pipeline.run(stage, stacked, x, tokens, cfg.pipeline_microbatches,
                      cfg.pipeline_repeats)
