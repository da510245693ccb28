"""The generation engine's decode step compiled ahead of time for a TPU topology, from a CPU:
XLA's cost analysis (bytes accessed, FLOPs), the weights and memory per device.

  python scripts/bench/decode_cost.py --model=7b --topology=v5e-8 --batch=16 --cache_length=4096
  python scripts/bench/decode_cost.py --model=7b --topology=v5e-8 --quantize=int8
  python scripts/bench/decode_cost.py --model=tiny --topology=cpu:8 --batch=8 --cache_length=64

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
  from toolkit.inference import decode_cost as decode  # pylint: disable=g-import-not-at-top
  compiled = compile_decode(model_name, topology, mesh_text, preset, batch, cache_length,
                            unroll, page_size, quantize)
  return {"model": model_name, "topology": topology, **decode.costs(compiled)}


def compile_decode(model_name: str, topology: str, mesh_text: str, preset: str, batch: int,
                   cache_length: int, unroll: bool, page_size: int = 0, quantize: str = "none"):
  """The compiled decode step (toolkit.inference.decode_cost.Compiled) of preset `model_name` on
  `topology`'s devices: the paged step with `page_size` > 0, else the contiguous cache's."""
  import sharding  # pylint: disable=g-import-not-at-top
  from models import LlamaConfig  # pylint: disable=g-import-not-at-top
  from toolkit.inference import decode_cost as decode  # pylint: disable=g-import-not-at-top
  from toolkit.planning.target import target_for  # pylint: disable=g-import-not-at-top
  model_cfg = LlamaConfig.preset(model_name, scan_layers=not unroll)
  mesh = sharding.make_mesh(sharding.parse_axis_sizes(mesh_text, "--mesh"), [],
                            list(target_for(topology).devices))
  return decode.compile_step(model_cfg, mesh, sharding.Rules.preset(preset), batch,
                             cache_length, page_size, quantize)


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
  from toolkit.planning.report import format_decode  # pylint: disable=g-import-not-at-top
  print(format_decode(r, f"{r['model']} on {r['topology']}"))
  if f.json:
    with open(f.json, "w") as out:
      json.dump(r, out, indent=2, default=str)


if __name__ == "__main__":
  define_flags()
  app.run(main)
