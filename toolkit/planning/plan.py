"""Plan files: the config overrides a search (`python -m toolkit.compile --plan`) picked.

A plan is JSON; `overrides` maps dotted config fields to values and is all that training
reads; the rest records where the plan came from:

  {"meshkit_plan": 1,
   "overrides": {"mesh.ici": "data:1,fsdp:-1,tensor:2", "mesh.dcn": "",
                 "sharding.preset": "fsdp_tp", "model.remat": "save_dots",
                 "train.microbatches": 1, "model.attention": "auto",
                 "model.loss_chunk": 2048},
   "target": "v5p-128", "slices": 1, "mesh_on_target": {"data": 1, "fsdp": 32, "tensor": 2},
   "compiled": {...}, "config_argument": "experiments/lm.py:size=7b"}

mesh.ici keeps a -1 on its largest data-like axis (fsdp, else data), so on the target it fills
to exactly the searched size and on fewer devices (a CPU rehearsal) it scales down.

  config = plan.apply_plan(config, "plan.json")   # a copy with the overrides set

A plan made for another experiment file is refused, one made for another variant of the same
file (size=7b vs size=1b) is used with a one-line warning (`check_made_for`).

A plan file may be a gs:// URL (read and written through toolkit.workdir).
"""
from __future__ import annotations

import copy
import json
import os
from collections.abc import Callable, Sequence

import ml_collections

from toolkit import workdir
from toolkit.errors import ConfigError

VERSION = 1
FIELDS = ("mesh.ici", "mesh.dcn", "sharding.preset", "model.remat", "train.microbatches",
          "model.attention", "model.loss_chunk")


def load_plan(path: str) -> dict:
  """The plan at `path` (local or gs://), checked for shape; raises ConfigError naming the file
  and the fix."""
  if workdir.is_url(path) and (why := workdir.problem(path, "--plan", reach=True)) is not None:
    raise ConfigError(why)
  try:
    plan = json.loads(workdir.read_text(path))
  except FileNotFoundError:
    raise ConfigError(f"--plan={path}: no such file; write one with python -m toolkit.compile "
                      f"... --plan --plan_out={path}") from None
  except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
    raise ConfigError(f"--plan={path}: not a readable JSON plan ({e}); write one with "
                      f"python -m toolkit.compile ... --plan") from None
  if not isinstance(plan, dict) or not isinstance(plan.get("overrides"), dict):
    raise ConfigError(f"--plan={path}: no 'overrides' object; is this a plan written by "
                      f"python -m toolkit.compile --plan?")
  if plan.get("meshkit_plan", VERSION) != VERSION:
    raise ConfigError(f"--plan={path}: plan version {plan.get('meshkit_plan')!r}; this meshkit "
                      f"reads version {VERSION}; write the plan again")
  return plan


def apply_overrides(config: ml_collections.ConfigDict, overrides: dict,
                    where: str = "plan") -> ml_collections.ConfigDict:
  """A copy of `config` with dotted fields set, type-checked like --config.FIELD flags."""
  config = copy.deepcopy(config)
  for key, value in overrides.items():
    node = config
    *parents, field = str(key).split(".")
    for part in parents:
      if not isinstance(node, ml_collections.ConfigDict) or part not in node:
        raise ConfigError(f"{where}: override {key!r} names no config section; known "
                          f"sections: {', '.join(sorted(config.keys()))}")
      node = node[part]
    if not isinstance(node, ml_collections.ConfigDict) or field not in node:
      raise ConfigError(f"{where}: override {key!r} names no config field")
    try:
      node[field] = value  # ConfigDict checks the type, as for a --config.FIELD flag
    except (TypeError, ValueError) as e:
      raise ConfigError(f"{where}: override {key}={value!r} does not fit config.{key} "
                        f"(now {node[field]!r}): {e}") from None
  return config


def check_made_for(plan: dict, path: str, config_argument: str | None,
                   warn: Callable[[str], None] = print) -> None:
  """Refuses a plan made for another experiment file, and warns (one line) about a plan made
  for another variant of this one: its layout was searched for that model and batch.
  `config_argument` is this run's --config value (None: not known, nothing checked)."""
  made_for = plan.get("config_argument") or ""
  if not config_argument or not made_for:
    return
  def split(argument: str) -> tuple[str, str]:
    file, _, variant = argument.partition(":")
    return os.path.normpath(file), variant
  (plan_file, plan_variant), (file, variant) = split(made_for), split(config_argument)
  if os.path.basename(plan_file) != os.path.basename(file):
    raise ConfigError(f"--plan={path} was made for --config={made_for}, not {config_argument}; "
                      f"make one for this experiment with python -m toolkit.compile "
                      f"--config={config_argument} --topology=... --plan, or drop --plan")
  if plan_variant != variant:
    warn(f"warning: --plan={path} was made for --config={made_for}; this run is "
         f"--config={config_argument}, so its layout was searched for another model or batch "
         f"(python -m toolkit.compile --config={config_argument} --plan makes one for it)")


def apply_plan(config: ml_collections.ConfigDict, path: str,
               flagged: Sequence[str] = (), config_argument: str | None = None,
               warn: Callable[[str], None] = print) -> ml_collections.ConfigDict:
  """A copy of `config` with the plan's overrides; validate it with `toolkit.training.config.resolve`
  (`toolkit.training.run` does). `flagged`: fields also set by --config.FIELD flags, which
  would be silently replaced, so they are refused. `config_argument`: this run's --config
  value, checked against the one the plan was made for (`check_made_for`)."""
  plan = load_plan(path)
  check_made_for(plan, path, config_argument, warn)
  overrides = plan["overrides"]
  both = [field for field in flagged if field in overrides]
  if both:
    raise ConfigError(f"--config.{both[0]} and --plan={path} both set {both[0]}; drop the flag "
                      f"or edit the plan's overrides")
  return apply_overrides(config, overrides, where=f"--plan={path}")


def scalable_ici(mesh_shape: dict[str, int]) -> str:
  """The mesh.ici text of a per-slice mesh with -1 on its largest data-like axis."""
  flexible = max((a for a in ("fsdp", "data") if a in mesh_shape),
                 key=lambda a: (mesh_shape[a], a == "fsdp"), default=None)
  return ",".join(f"{axis}:{-1 if axis == flexible else size}"
                  for axis, size in mesh_shape.items())


def flags_for(overrides: dict) -> list[str]:
  """--config.FIELD=VALUE flags equivalent to `overrides`."""
  return [f"--config.{key}={value}" for key, value in overrides.items()]


def write_plan(path: str, plan: dict) -> None:
  """The plan as the JSON file `path` (local or gs://), written whole."""
  workdir.write_text(path, json.dumps({"meshkit_plan": VERSION, **plan}, indent=2, default=str)
                     + "\n")
