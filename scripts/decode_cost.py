"""The generation engine's decode step compiled ahead of time for a TPU topology, from a CPU:
XLA's cost analysis (bytes accessed, FLOPs), the weights and memory per device.

  python scripts/decode_cost.py --model=7b --topology=v5e-8 --batch=16 --cache_length=4096
  python scripts/decode_cost.py --model=7b --topology=v5e-8 --quantize=int8
  python scripts/decode_cost.py --model=tiny --topology=cpu:8 --batch=8 --cache_length=64

The step is the engine's: `toolkit.inference.engine.paged_step` with one decoding row per
slot (`--batch` rows, one token each, against a paged cache of --batch x cache_length
positions in pages of --page_size), or with --page_size=0 `decode_step` against the
contiguous cache (models/llama.py's decode). Weights as `--quantize` says (none: the preset's
dtype; bfloat16; int8: per-channel scales, models/quantization.py). Jitted with the engine's
shardings and the cache donated, on abstract parameters and cache: nothing is allocated.
Layers are unrolled by default (--nounroll keeps the scan): XLA's cost analysis counts a loop
body once, so only the unrolled program's bytes cover every layer. TPU topologies need libtpu
(the test extra).
"""
from __future__ import annotations

import dataclasses
import json
import os

from absl import app, flags


def define_flags() -> None:
  """The command's flags, defined only when it runs as a script: tests import this module
  beside other scripts whose flags share names (--mesh, --rules)."""
  flags.DEFINE_string("model", "7b", "Model preset (models.llama_config.PRESETS).")
  flags.DEFINE_string("topology", "v5e-8", "TPU type (v5e-8, v5p-8, ...) or cpu:N.")
  flags.DEFINE_string("mesh", "data:1,fsdp:-1,tensor:2", "Mesh axes (-1 fills).")
  flags.DEFINE_string("rules", "fsdp_tp", "Sharding preset.")
  flags.DEFINE_integer("batch", 16, "Cache slots decoded per step.")
  flags.DEFINE_integer("cache_length", 4096, "KV cache positions per slot.")
  flags.DEFINE_integer("page_size", 16, "Positions per cache page; 0: the contiguous cache.")
  flags.DEFINE_enum("quantize", "none", ["none", "bfloat16", "int8"], "Weights as served.")
  flags.DEFINE_bool("unroll", True, "Unroll the layers (see the docstring).")
  flags.DEFINE_string("json", "", "Write the numbers as JSON here.")


def decode_cost(model_name: str, topology: str, mesh_text: str, preset: str, batch: int,
                cache_length: int, unroll: bool, page_size: int = 0,
                quantize: str = "none") -> dict:
  """Compiles the decode step for `topology` on abstract inputs; returns its costs."""
  return costs(*compile_decode(model_name, topology, mesh_text, preset, batch, cache_length,
                               unroll, page_size, quantize))


def compile_decode(model_name: str, topology: str, mesh_text: str, preset: str, batch: int,
                   cache_length: int, unroll: bool, page_size: int = 0, quantize: str = "none"):
  """The compiled decode step and what `costs` reports beside it: the paged step with
  `page_size` > 0, else the contiguous cache's."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  import optax  # pylint: disable=g-import-not-at-top
  from jax.sharding import NamedSharding  # pylint: disable=g-import-not-at-top

  import sharding  # pylint: disable=g-import-not-at-top
  from models import LlamaConfig, paged  # pylint: disable=g-import-not-at-top
  from models.llama import CACHE_AXES  # pylint: disable=g-import-not-at-top
  from toolkit.inference import engine, sampling  # pylint: disable=g-import-not-at-top
  from toolkit.pod.target import target_for  # pylint: disable=g-import-not-at-top
  from toolkit.training import state as state_lib  # pylint: disable=g-import-not-at-top

  model_cfg = LlamaConfig.preset(model_name, scan_layers=not unroll)
  target = target_for(topology)
  mesh = sharding.make_mesh(sharding.parse_axis_sizes(mesh_text, "--mesh"), [],
                            list(target.devices))
  rules = sharding.Rules.preset(preset)
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
  compiled = step.lower(params, {"k": one_cache, "v": one_cache}, *args, row_arrays,
                        token_rows).compile()
  weights = sum(np.prod(a.sharding.shard_shape(a.shape)) * np.dtype(a.dtype).itemsize
                for a in jax.tree.leaves(params))
  return compiled, model_name, topology, mesh, preset, batch, cache_length, unroll, model_cfg, \
      page_size, quantize, float(weights), cache_shape


def costs(compiled, model_name, topology, mesh, preset, batch, cache_length, unroll, model_cfg,
          page_size, quantize, weight_bytes, cache_shape) -> dict:
  """XLA's cost and memory analysis of a compiled decode step, as plain numbers."""
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top

  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  memory = compiled.memory_analysis()
  cache_bytes = 2 * np.prod(cache_shape) * jnp.dtype(model_cfg.compute_dtype).itemsize
  return {"model": model_name, "topology": topology, "mesh": dict(mesh.shape), "rules": preset,
          "batch": batch, "cache_length": cache_length, "unrolled": unroll,
          "bytes_accessed_per_device": float(cost.get("bytes accessed", 0.0)),
          "flops_per_device": float(cost.get("flops", 0.0)),
          "cache_bytes_per_device": float(cache_bytes) / mesh.size,
          "temp_bytes_per_device": float(getattr(memory, "temp_size_in_bytes", 0)),
          "page_size": page_size, "quantize": quantize,
          "weight_bytes_per_device": weight_bytes,
          # Arguments (weights, cache, inputs) + outputs not aliased to them + temporaries.
          "total_bytes_per_device": float(
              getattr(memory, "argument_size_in_bytes", 0)
              + getattr(memory, "output_size_in_bytes", 0)
              - getattr(memory, "alias_size_in_bytes", 0)
              + getattr(memory, "temp_size_in_bytes", 0)),
          "model_config": dataclasses.asdict(model_cfg)}


def main(argv) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
  os.environ["JAX_PLATFORMS"] = "cpu"
  import jax  # pylint: disable=g-import-not-at-top
  jax.config.update("jax_platforms", "cpu")
  f = flags.FLAGS
  if f.topology.startswith("cpu:"):
    jax.config.update("jax_num_cpu_devices", int(f.topology.split(":")[1]))
  r = decode_cost(f.model, f.topology, f.mesh, f.rules, f.batch, f.cache_length, f.unroll,
                  f.page_size, f.quantize)
  from toolkit.pod.report import human_bytes  # pylint: disable=g-import-not-at-top
  cache = f"paged, pages of {r['page_size']}" if r["page_size"] else "contiguous"
  print(f"decode step, {r['model']} on {r['topology']} (mesh {r['mesh']}, rules {r['rules']}), "
        f"batch {r['batch']}, cache {r['cache_length']} ({cache}), weights "
        f"{r['quantize'] if r['quantize'] != 'none' else r['model_config']['param_dtype']}, "
        f"layers {'unrolled' if r['unrolled'] else 'scanned (cost counts one layer)'}:\n"
        f"  bytes accessed per device  {human_bytes(r['bytes_accessed_per_device'])} "
        f"(the KV cache: {human_bytes(r['cache_bytes_per_device'])} per device)\n"
        f"  FLOPs per device           {r['flops_per_device']:.4g}\n"
        f"  weights per device         {human_bytes(r['weight_bytes_per_device'])}\n"
        f"  temporaries per device     {human_bytes(r['temp_bytes_per_device'])}\n"
        f"  total per device           {human_bytes(r['total_bytes_per_device'])} (arguments + "
        f"outputs + temporaries)")
  if f.json:
    with open(f.json, "w") as out:
      json.dump(r, out, indent=2, default=str)


if __name__ == "__main__":
  define_flags()
  app.run(main)
