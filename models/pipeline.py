"""Pipeline parallelism (GPipe) over the stacked layers: `run` is what `models.stack.run_layers`
does when the activation rules split `layers` over devices (a `stage` mesh axis, preset
`fsdp_pp`) and the model config sets `pipeline_microbatches`.

GPipe (R = 1): the L stacked layers are cut into S stages of L/S consecutive layers (stage s
holds layers s L/S ... (s+1) L/S - 1, which is how the rules store the stacked parameters
split over `stage`, so nothing moves), and the batch into M micro-batches (micro-batch m:
rows m, m + M, ...; each device keeps its rows). One loop of M + S - 1 iterations runs every
stage at once, a `jax.vmap` over the stages whose vmapped axis is split over the stage
devices (`spmd_axis_name`): at iteration t stage s works on micro-batch t - s, then the
activations move one stage on (`jnp.roll`, a collective-permute between neighbouring stages)
and micro-batch t + 1 enters stage 0. Slots where t - s is outside 0..M-1 are the bubble:
their inputs are masked to zeros, so whatever the buffer holds there (NaN included) reaches
neither values nor gradients. The bubble is (S - 1) / (M + S - 1) of the stage slots.

Circular (R rounds, `pipeline_repeats`): the layers are cut into S R chunks, chunk r S + s
running on stage s in round r, and each micro-batch goes around the stages R times: R M + S - 1
iterations, item t - s of stage s being micro-batch (t - s) mod M in round (t - s) // M; the
last stage's outputs wait in a buffer of M until their next round (M >= S). The bubble shrinks
to (S - 1) / (R M + S - 1). The parameters stay stored in layer order (a checkpoint restores
onto any mesh as it is), so each step the compiler moves every stage's chunks to it: the
schedule trades the smaller bubble for that weight traffic over `stage`.

Inside a stage the layers run as without a pipeline (scanned or unrolled, under the remat
policy), and fsdp and tensor parallelism work as usual. The embedding and the output layer
run outside, on the whole batch. Models name no mesh axis here either: the stage axes are
whatever the rules give `layers`.
"""
from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

import sharding


def validate(cfg, field: str = "model") -> None:
  """Raises ValueError for a negative `pipeline_microbatches` or `pipeline_repeats` below 1."""
  if cfg.pipeline_microbatches < 0:
    raise ValueError(f"{field}.pipeline_microbatches={cfg.pipeline_microbatches} must be >= 0 "
                     f"(0: no pipeline)")
  if cfg.pipeline_repeats < 1:
    raise ValueError(f"{field}.pipeline_repeats={cfg.pipeline_repeats} must be >= 1 (1: GPipe)")


def check(n_layers: int, rows: int, stages: int, microbatches: int, n_experts: int = 0,
          repeats: int = 1, field: str = "model") -> str | None:
  """Why a pipeline of `stages` stages, `microbatches` micro-batches and `repeats` rounds
  cannot run `n_layers` layers on `rows` rows per step (None if it can)."""
  if stages <= 1:
    return None
  if not microbatches:
    return (f"the layers are split over {stages} pipeline stages but "
            f"{field}.pipeline_microbatches=0; set it to at least {stages} (the bubble is "
            f"(stages - 1) / (micro-batches + stages - 1))")
  if microbatches < stages:
    return (f"{field}.pipeline_microbatches={microbatches} is below the {stages} pipeline "
            f"stages; use at least {stages} so every stage gets work")
  if n_layers % (stages * repeats):
    rounds = f" x {field}.pipeline_repeats={repeats}" if repeats > 1 else ""
    return (f"{field}.n_layers={n_layers} is not divisible by the {stages} pipeline "
            f"stages{rounds}; use a multiple of {stages * repeats} layers or another stage axis")
  if rows % microbatches:
    return (f"the batch of {rows} rows (per training micro-batch) is not divisible by "
            f"{field}.pipeline_microbatches={microbatches}")
  if n_experts:
    return "a mixture of experts does not run in a pipeline yet; drop the stage mesh axis"
  return None


def bubble_fraction(stages: int, microbatches: int, repeats: int = 1) -> float:
  """The share of stage slots that hold no micro-batch: (S - 1) / (R M + S - 1)."""
  return (stages - 1) / (repeats * microbatches + stages - 1)


def _split_rows(x, count: int):
  """(B, ...) -> (count, B / count, ...), group m holding rows m, m + count, ..."""
  return jnp.swapaxes(x.reshape(x.shape[0] // count, count, *x.shape[1:]), 0, 1)


def _merge_rows(x):
  """Inverse of `_split_rows`."""
  return jnp.swapaxes(x, 0, 1).reshape(-1, *x.shape[2:])


def run(stage: Callable, stacked, x: jax.Array, positions, microbatches: int,
        repeats: int = 1, bubble: float = 0.0) -> jax.Array:
  """x (batch, length, embed) through the stacked layers as a pipeline (module docstring).

  Args:
    stage: `stage(layers, x, positions) -> x` running one stage's consecutive layers, the
      parameters `layers` stacked along their leading axis.
    stacked: the parameters of all layers, each leaf (n_layers, ...).
    positions: (batch, length) int, or a pytree of such arrays (the positions and the segment
      ids of packed documents), moved through the pipeline with the rows.
    repeats: R, the circular schedule's rounds (1: GPipe).
    bubble: what the buffers hold where no micro-batch is (tests write NaN there).
  """
  axes = sharding.active_axes("layers")
  stages = sharding.active_ways("layers")
  # Layer l is in chunk l // (L / (S R)); chunk r S + s runs on stage s in round r.
  by_stage = jax.tree.map(lambda a: jnp.swapaxes(
      a.reshape(repeats, stages, a.shape[0] // (stages * repeats), *a.shape[1:]), 0, 1),
                          stacked)
  micro = _split_rows(x, microbatches)
  micro_positions = jax.tree.map(lambda a: _split_rows(a, microbatches), positions)
  per_stage = lambda a: sharding.constrain(a, ("layers", "batch", "length", "embed")[:a.ndim])

  def one_stage(layers, round_, h, pos):
    return stage(jax.tree.map(lambda a: a[round_], layers), h, pos)

  run_stages = jax.vmap(one_stage, spmd_axis_name=axes if len(axes) > 1 else axes[0])
  index = jnp.arange(stages)
  items = repeats * microbatches

  def iteration(carry, t):
    out, pos, done = carry
    # Stage 0 takes a fresh micro-batch in round 0, else the micro-batch's output from the
    # last stage one round ago (kept in `done`: M >= S, so it is there by now).
    slot = t % microbatches
    entering = jnp.where(t < microbatches, micro[slot], done[slot])
    state = jnp.roll(out, 1, axis=0).at[0].set(entering.astype(out.dtype))
    pos = jax.tree.map(lambda p, m: jnp.roll(p, 1, axis=0).at[0].set(m[slot]), pos,
                       micro_positions)
    item = t - index                                  # what each stage works on, if anything
    working = (item >= 0) & (item < items)
    state = per_stage(jnp.where(working[:, None, None, None], state, 0))
    out = per_stage(run_stages(by_stage, jnp.clip(item // microbatches, 0, repeats - 1),
                               state, pos))
    finished = (t - stages + 1) % microbatches       # the last stage's micro-batch
    done = jnp.where(working[-1], done.at[finished].set(out[-1]), done)
    return (out, pos, done), None

  out = per_stage(jnp.full((stages, *micro.shape[1:]), bubble, x.dtype))
  pos = jax.tree.map(lambda m: jnp.zeros((stages, *m.shape[1:]), m.dtype), micro_positions)
  done = jnp.full(micro.shape, bubble, x.dtype)
  (_, _, done), _ = jax.lax.scan(iteration, (out, pos, done),
                                 jnp.arange(items + stages - 1))
  return _merge_rows(done)
