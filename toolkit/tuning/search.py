"""Search spaces: what an experiment's `get_sweep(arg)` returns, and the trials it expands to.

  def get_sweep(arg=None):
    return search.Sweep(
        base="tiny",                                     # get_config(base) of the same file
        parameters={"optimizer.learning_rate": search.LogUniform(1e-4, 1e-2),
                    "optimizer.weight_decay": search.Choice([0.0, 0.1])},
        method="random", budget=8, seed=0,
        fixed={"train.steps": 40})                       # set on every trial

A grid takes every combination of the listed values (in the order given, the last field
varying fastest), capped at `budget` when it is > 0; a random search draws `budget` trials from
the distributions (a list stands for a uniform choice among its values). The expansion is a
pure function of the declaration, so a restarted sweep finds the same trials.
"""
from __future__ import annotations

import dataclasses
import itertools
import math
import shlex
from collections.abc import Mapping, Sequence
from typing import Any

import ml_collections
import numpy as np

from toolkit.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class LogUniform:
  """A float drawn uniformly in log space from [low, high]: learning rates, weight decays."""
  low: float
  high: float

  def sample(self, rng: np.random.Generator) -> float:
    return float(math.exp(rng.uniform(math.log(self.low), math.log(self.high))))

  def check(self, field: str) -> None:
    if not 0 < self.low <= self.high:
      raise ConfigError(f"sweep parameter {field}: LogUniform({self.low}, {self.high}) needs "
                        f"0 < low <= high")


@dataclasses.dataclass(frozen=True)
class Uniform:
  """A float drawn uniformly from [low, high]."""
  low: float
  high: float

  def sample(self, rng: np.random.Generator) -> float:
    return float(rng.uniform(self.low, self.high))

  def check(self, field: str) -> None:
    if not self.low <= self.high:
      raise ConfigError(f"sweep parameter {field}: Uniform({self.low}, {self.high}) needs "
                        f"low <= high")


@dataclasses.dataclass(frozen=True)
class Choice:
  """One of `values`, each equally likely (random search) or each in turn (grid)."""
  values: Sequence[Any]

  def sample(self, rng: np.random.Generator) -> Any:
    return self.values[int(rng.integers(len(self.values)))]

  def check(self, field: str) -> None:
    if not self.values:
      raise ConfigError(f"sweep parameter {field}: Choice([]) is empty; give at least one value")


@dataclasses.dataclass(frozen=True)
class Halving:
  """Successive halving on the eval loss: at `min_steps`, `min_steps * eta`, ... (the rungs)
  only the best 1/eta of the trials that reached the rung go on; the rest stop there."""
  min_steps: int
  eta: int = 2

  def rungs(self, steps: int) -> list[int]:
    """Every step at which trials are compared, ending with `steps` (no decision there)."""
    if self.min_steps < 1 or self.eta < 2:
      raise ConfigError(f"sweep halving: min_steps={self.min_steps} must be >= 1 and "
                        f"eta={self.eta} >= 2")
    rungs, at = [], self.min_steps
    while at < steps:
      rungs.append(at)
      at *= self.eta
    return rungs + [steps]


_METHODS = ("grid", "random")


@dataclasses.dataclass(frozen=True)
class Sweep:
  """A sweep declaration: plain data, validated by `trials`."""
  base: str                            # the variant given to the experiment's get_config
  parameters: Mapping[str, Any]        # dotted config field -> values (grid) or distribution
  method: str = "grid"
  budget: int = 0                      # random: trial count (required); grid: cap (0 = all)
  seed: int = 0                        # of the random search, not of the trials' training
  fixed: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  halving: Halving | None = None


def _values(field: str, spec: Any) -> Sequence[Any]:
  if isinstance(spec, Choice):
    spec.check(field)
    return list(spec.values)
  if isinstance(spec, (list, tuple)):
    if not spec:
      raise ConfigError(f"sweep parameter {field}: the list of values is empty")
    return list(spec)
  raise ConfigError(f"sweep parameter {field}: a grid needs a list of values or Choice(...), "
                    f"got {spec!r}; use method='random' for distributions")


def trials(sweep: Sweep) -> list[dict[str, Any]]:
  """The overrides of every trial, in trial-id order."""
  if sweep.method not in _METHODS:
    raise ConfigError(f"sweep method={sweep.method!r} is unknown; use one of {', '.join(_METHODS)}")
  if not sweep.parameters:
    raise ConfigError("the sweep has no parameters; give at least one field to vary")
  fields = list(sweep.parameters)
  if sweep.method == "grid":
    grids = [_values(field, sweep.parameters[field]) for field in fields]
    combos = [dict(zip(fields, combo)) for combo in itertools.product(*grids)]
    return combos[:sweep.budget] if sweep.budget > 0 else combos
  if sweep.budget < 1:
    raise ConfigError(f"sweep budget={sweep.budget}: a random search needs the number of "
                      f"trials, e.g. budget=8")
  for field, spec in sweep.parameters.items():
    if hasattr(spec, "check"):
      spec.check(field)
    elif not isinstance(spec, (list, tuple)) or not spec:
      raise ConfigError(f"sweep parameter {field}: {spec!r} is not a distribution; use "
                        f"LogUniform, Uniform, Choice or a non-empty list")
  rng = np.random.default_rng(sweep.seed)
  draw = lambda spec: spec.sample(rng) if hasattr(spec, "sample") else Choice(spec).sample(rng)
  return [{field: draw(sweep.parameters[field]) for field in fields}
          for _ in range(sweep.budget)]


def apply(config: ml_collections.ConfigDict, overrides: Mapping[str, Any],
          what: str = "sweep") -> ml_collections.ConfigDict:
  """A copy of `config` with dotted fields set, each checked to exist and converted to the
  field's type (an int grid value for a float field is fine; a string for a number is not)."""
  config = ml_collections.ConfigDict(config.to_dict())
  for field, value in overrides.items():
    node, *path = [config] + field.split(".")
    parents = path[:-1]
    for key in parents:
      if not isinstance(node, ml_collections.ConfigDict) or key not in node:
        raise ConfigError(f"{what} field {field}: config has no section {key!r}; check the name")
      node = node[key]
    leaf = path[-1]
    if not isinstance(node, ml_collections.ConfigDict) or leaf not in node:
      raise ConfigError(f"{what} field {field}: config has no field {leaf!r}; check the name")
    current = node[leaf]
    if isinstance(current, ml_collections.ConfigDict):
      raise ConfigError(f"{what} field {field} is a section; give one of its fields")
    node[leaf] = _convert(field, current, value, what)
  return config


def _convert(field: str, current: Any, value: Any, what: str) -> Any:
  if isinstance(current, bool) or current is None:
    if isinstance(current, bool) and not isinstance(value, (bool, np.bool_)):
      raise ConfigError(f"{what} field {field}={value!r}: the field is a bool; give True/False")
    return value
  if isinstance(current, (int, float)):
    if isinstance(value, (bool, str)) or not isinstance(value, (int, float, np.number)):
      raise ConfigError(f"{what} field {field}={value!r}: the field is a "
                        f"{type(current).__name__}; give a number")
    if isinstance(current, int) and float(value) != int(value):
      raise ConfigError(f"{what} field {field}={value!r}: the field is an int; give whole numbers")
    return type(current)(value)
  if isinstance(current, str) and not isinstance(value, str):
    raise ConfigError(f"{what} field {field}={value!r}: the field is a string")
  return value


def flag_value(value: Any) -> str:
  """How `value` is written after --config.FIELD= so that it parses back exactly."""
  if isinstance(value, bool):
    return str(value).lower()
  if isinstance(value, float):
    return repr(value)
  return str(value)


def launch_command(config_file: str, base: str, overrides: Mapping[str, Any],
                   workdir: str) -> str:
  """The `python -m toolkit.train` command that trains one trial on its own."""
  parts = ["python", "-m", "toolkit.train", f"--config={config_file}:{base}"]
  parts += [f"--config.{field}={flag_value(value)}" for field, value in overrides.items()]
  parts.append(f"--workdir={workdir}")
  return " ".join(shlex.quote(part) for part in parts)
