"""Golden dumps of resolved parameter shardings, one JSON file per (model preset, rules preset).

Regenerate after an intended change to a preset table or a model's parameters, then read the
diff before committing it:

  .venv/bin/python -m tests.sharding.regen_golden
"""
import functools
import json
import pathlib

import tests.conftest  # noqa: F401  (8 simulated CPU devices, set before JAX starts)

from models import LlamaConfig
from sharding import PRESETS, Rules, make_mesh, parse_axis_sizes, sharding_report
from toolkit.training.state import param_entries

GOLDEN_DIR = pathlib.Path(__file__).parent / "golden"
MODEL_PRESETS = ("tiny", "cpu", "moe_tiny")
RULES_PRESETS = tuple(PRESETS)
MESH = "data:1,fsdp:4,tensor:2"
# A mixture of experts also on an expert axis, where the *_ep presets split its experts.
MESHES = {"moe_tiny": "data:1,fsdp:2,expert:2,tensor:2"}
# Presets for an axis MESH lacks get a mesh with it (fsdp_cp stores parameters over fsdp and
# sequence together; fsdp_pp the stacked layers over stage), for every model.
PRESET_MESHES = {"fsdp_cp": "data:1,fsdp:2,sequence:4", "fsdp_pp": "data:1,stage:2,fsdp:4"}


def golden_path(model: str, preset: str) -> pathlib.Path:
  return GOLDEN_DIR / f"{model}_{preset}.json"


@functools.cache
def entries(model: str) -> tuple:
  """(path, shape, dtype, logical axes) of every parameter of a model preset, abstractly."""
  _, param_list = param_entries(LlamaConfig.preset(model))
  return tuple(param_list)


@functools.cache
def mesh(model: str, preset: str = ""):
  return make_mesh(parse_axis_sizes(PRESET_MESHES.get(preset) or MESHES.get(model, MESH)))


def report(model: str, preset: str):
  return sharding_report(entries(model), Rules.preset(preset), mesh(model, preset))


def resolved_specs(model: str, preset: str) -> dict[str, str]:
  """path -> PartitionSpec text, as the golden files store it."""
  return report(model, preset).specs()


def to_json(specs: dict[str, str]) -> str:
  return json.dumps(specs, indent=2, sort_keys=True) + "\n"


def main() -> None:
  GOLDEN_DIR.mkdir(exist_ok=True)
  for model in MODEL_PRESETS:
    for preset in RULES_PRESETS:
      path = golden_path(model, preset)
      path.write_text(to_json(resolved_specs(model, preset)))
      print(f"wrote {path}")


if __name__ == "__main__":
  main()
