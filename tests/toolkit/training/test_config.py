"""The range table (toolkit/training/config.py RANGES): every numeric field of the defaults and
of every experiment variant has a row, their values lie inside it, and each value outside it is
refused with one message naming the field, the value, the range and a value that works."""
import copy
import math

import pytest

from experiments import lm, moe, sft, vit
from toolkit.errors import ConfigError
from toolkit.training import config as config_lib

# Every variant an experiment file offers (its docstring lists them).
CONFIGS = {
    "defaults": config_lib.defaults,
    **{f"lm:{arg}": (lambda arg=arg: lm.get_config(arg))
       for arg in ("cpu", "tiny", "size=tiny", "size=125m", "size=1b", "size=7b", "size=70b",
                   "data=synthetic", "data=tokens")},
    **{f"vit:{arg}": (lambda arg=arg: vit.get_config(arg))
       for arg in ("cpu", "tiny", "b16", "data=npz")},
    **{f"moe:{arg}": (lambda arg=arg: moe.get_config(arg))
       for arg in ("cpu", "tiny", "size=8x7b", "dispatch=capacity", "every=2")},
    **{f"sft:{arg}": (lambda arg=arg: sft.get_config(arg))
       for arg in ("cpu", "tiny", "1b", "task=add,packing=on")},
}


def _set(config, path: str, value) -> None:
  *sections, name = path.split(".")
  node = config
  for section in sections:
    node = node[section]
  with node.ignore_type():
    node[name] = value


def out_of_range(allowed: config_lib.Range) -> list:
  """Values just outside `allowed` on each finite side, and values no float field may take."""
  values = []
  if math.isfinite(allowed.low):
    values.append(allowed.low if allowed.low_open else allowed.low - 1)
  if math.isfinite(allowed.high):
    values.append(allowed.high if allowed.high_open else allowed.high + 1)
  if allowed.integer:
    values += [2**70, 1.5]  # beyond 64 bits (the seed crash of issue 16); not an integer
  else:
    values += [math.nan, math.inf, -math.inf]
  if allowed.integer:
    values = [int(v) if isinstance(v, float) and v.is_integer() else v for v in values]
  return values


@pytest.mark.parametrize("name", CONFIGS)
def test_every_numeric_field_has_a_row_and_its_value_is_inside(name):
  fields = config_lib.numeric_fields(CONFIGS[name]())
  missing = sorted(set(fields) - set(config_lib.RANGES))
  assert not missing, (f"{name}: numeric fields without a row in RANGES "
                       f"(toolkit/training/config.py): {missing}; add one per field")
  outside = {path: value for path, value in fields.items()
             if not config_lib.RANGES[path].contains(value)}
  assert not outside, f"{name}: values outside their range: {outside}"
  config_lib.check_ranges(CONFIGS[name]())  # passes


@pytest.mark.parametrize("name", CONFIGS)
def test_each_value_outside_its_range_is_one_clear_error(name):
  config = CONFIGS[name]()
  checked = 0
  for path in config_lib.numeric_fields(config):
    allowed = config_lib.RANGES[path]
    for bad in out_of_range(allowed):
      broken = copy.deepcopy(config)
      _set(broken, path, bad)
      with pytest.raises(ConfigError) as raised:
        config_lib.check_ranges(broken)
      message = str(raised.value)
      assert message.startswith(f"{path}={bad!r} must be {allowed} ({allowed.meaning})"), message
      assert "\n" not in message
      checked += 1
  assert checked >= 3 * len(config_lib.numeric_fields(config))


def test_the_fix_names_a_value_inside_the_range():
  config = lm.get_config("tiny")
  _set(config, "optimizer.b1", 1.5)
  with pytest.raises(ConfigError, match=r"give e\.g\. --config\.optimizer\.b1=0\.9$"):
    config_lib.check_ranges(config)
  config = vit.get_config("tiny")
  _set(config, "model.patch_size", 0)
  with pytest.raises(ConfigError, match=r"give e\.g\. --config\.model\.patch_size=2$"):
    config_lib.check_ranges(config)


def test_resolve_checks_ranges_before_anything_else():
  config = lm.get_config("tiny")
  config.mesh.ici = "fsdp:3"  # would be a mesh error, but the range comes first
  config.optimizer.clip_norm = -1.0
  with pytest.raises(ConfigError, match=r"^optimizer\.clip_norm=-1\.0 must be a finite number "
                                        r">= 0 \(global gradient-norm clip; 0 turns it off\)"):
    config_lib.resolve(config)


def test_range_text():
  assert str(config_lib.RANGES["optimizer.b1"]) == "a finite number in [0, 1)"
  assert str(config_lib.RANGES["optimizer.eps"]) == "a finite number > 0"
  assert str(config_lib.RANGES["train.steps"]) == "an integer in [1, 2**31 - 1]"
  assert str(config_lib.RANGES["data.eval_fraction"]) == "a finite number in (0, 1)"
