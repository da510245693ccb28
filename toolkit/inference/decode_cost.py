"""The generation engine's decode step compiled ahead of time for a target (a TPU topology, from
a CPU): the served weights' bytes per device, the compiler's memory per device, and XLA's cost
analysis. `python -m toolkit.compile --decode` and scripts/bench/decode_cost.py report it
(toolkit/planning/report.py's format_decode prints it).

The step is the engine's: `toolkit.inference.engine.paged_step` with one decoding row per slot
(`batch` rows, one token each, against a paged cache of batch x cache_length positions in pages
of `page_size`), or with page_size 0 `decode_step` against the contiguous cache. Weights as
`quantize` says (none: the model's dtype; bfloat16; int8: per-channel scales, models/
quantization.py). Jitted with the engine's shardings and the cache donated, on abstract
parameters and cache: nothing is allocated. XLA's cost analysis counts a loop body once, so with
scanned layers its bytes accessed and FLOPs cover one layer (unroll them for the whole step).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding

import sharding
from models import LlamaConfig, paged
from models.llama import CACHE_AXES
from toolkit.inference import engine, sampling
from toolkit.training import state as state_lib


@dataclasses.dataclass(frozen=True)
class Compiled:
  """A compiled decode step and what its report needs beside it."""
  executable: object
  model: LlamaConfig
  mesh: jax.sharding.Mesh
  rules_name: str
  batch: int
  cache_length: int
  page_size: int
  quantize: str
  weight_bytes: float           # served weights per device
  bfloat16_weight_bytes: float  # the same weights served in bfloat16, per device
  cache_shape: tuple


def served_bytes(layout, quantize: str, compute_dtype) -> float:
  """Bytes per device of the weights as served with `quantize` (abstract: nothing allocated)."""
  params = engine.served_abstract(layout, quantize, compute_dtype)
  return float(sum(np.prod(a.sharding.shard_shape(a.shape)) * np.dtype(a.dtype).itemsize
                   for a in jax.tree.leaves(params)))


def compile_step(model_cfg: LlamaConfig, mesh, rules: sharding.Rules, batch: int,
                 cache_length: int, page_size: int = 0, quantize: str = "none") -> Compiled:
  """Compiles the decode step for `mesh`'s devices on abstract inputs (raises what the
  compiler raises, e.g. its out-of-memory error)."""
  layout = state_lib.layout(model_cfg, optax.identity(), rules, mesh)
  params = engine.served_abstract(layout, quantize, model_cfg.compute_dtype)
  spec = lambda axes: NamedSharding(mesh, rules.activation_spec(axes, mesh))
  rows = spec(("batch",))
  row_arrays = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=rows)
                for k, v in sampling.row_arrays([sampling.SamplingParams()] * batch).items()}
  token_rows = jax.ShapeDtypeStruct((batch,), jnp.int32, sharding=rows)
  out = lambda cache_sharding: (cache_sharding, rows, spec(("batch", "vocab")))
  if page_size:
    per_row = -(-cache_length // page_size)
    cache_shape = (model_cfg.n_layers, model_cfg.n_kv_heads, batch * per_row, page_size,
                   model_cfg.resolved_head_dim)
    cache_sharding = spec(paged.CACHE_AXES)
    table = jax.ShapeDtypeStruct((batch, per_row), jnp.int32, sharding=spec(("batch", None)))
    step = jax.jit(lambda p, c, t, pos, tables, counts, last, r, i: engine.paged_step(
        layout.graphdef, rules, mesh, p, c, t, pos, paged.Rows(tables, counts, (1,)), last, r,
        i), donate_argnums=1, out_shardings=out(cache_sharding))
    args = (token_rows, token_rows, (table,), (token_rows,), token_rows)
  else:
    cache_shape = (model_cfg.n_layers, batch, cache_length, model_cfg.n_kv_heads,
                   model_cfg.resolved_head_dim)
    cache_sharding = spec(("layers",) + CACHE_AXES)
    step = jax.jit(lambda *args: engine.decode_step(layout.graphdef, rules, mesh, *args),
                   donate_argnums=1, out_shardings=out(cache_sharding))
    args = (token_rows, token_rows)
  one_cache = jax.ShapeDtypeStruct(cache_shape, model_cfg.compute_dtype, sharding=cache_sharding)
  executable = step.lower(params, {"k": one_cache, "v": one_cache}, *args, row_arrays,
                          token_rows).compile()
  return Compiled(executable, model_cfg, mesh, rules.name, batch, cache_length, page_size,
                  quantize, served_bytes(layout, quantize, model_cfg.compute_dtype),
                  served_bytes(layout, "bfloat16", model_cfg.compute_dtype), cache_shape)


def costs(c: Compiled) -> dict:
  """XLA's cost and memory analysis of a compiled decode step, as plain numbers."""
  cost = c.executable.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  memory = c.executable.memory_analysis()
  cache_bytes = 2 * np.prod(c.cache_shape) * jnp.dtype(c.model.compute_dtype).itemsize
  return {"mesh": dict(c.mesh.shape), "rules": c.rules_name, "batch": c.batch,
          "cache_length": c.cache_length, "unrolled": not c.model.scan_layers,
          "bytes_accessed_per_device": float(cost.get("bytes accessed", 0.0)),
          "flops_per_device": float(cost.get("flops", 0.0)),
          "cache_bytes_per_device": float(cache_bytes) / c.mesh.size,
          "temp_bytes_per_device": float(getattr(memory, "temp_size_in_bytes", 0)),
          "page_size": c.page_size, "quantize": c.quantize,
          "weight_bytes_per_device": c.weight_bytes,
          "bfloat16_weight_bytes_per_device": c.bfloat16_weight_bytes,
          # Arguments (weights, cache, inputs) + outputs not aliased to them + temporaries.
          "total_bytes_per_device": float(
              getattr(memory, "argument_size_in_bytes", 0)
              + getattr(memory, "output_size_in_bytes", 0)
              - getattr(memory, "alias_size_in_bytes", 0)
              + getattr(memory, "temp_size_in_bytes", 0)),
          "model_config": dataclasses.asdict(c.model)}
