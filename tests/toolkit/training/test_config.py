"""The range table (toolkit/training/config.py RANGES): every numeric field of the defaults and
of every experiment variant has a row, their values lie inside it, and each value outside it is
refused with one message naming the field, the value, the range and a value that works. And
model.attention kernels that cannot run on the config's devices or lengths, refused alike."""
import copy
import dataclasses
import math
import re

import jax
import ml_collections
import pytest

from experiments import dpo, lm, moe, sft, vit
from models import LlamaConfig
from tests import extras
from toolkit.errors import ConfigError
from toolkit.training import config as config_lib, ranges

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
    **{f"dpo:{arg}": (lambda arg=arg: dpo.get_config(arg))
       for arg in ("cpu", "tiny", "task=add")},
}


@pytest.mark.parametrize("experiment,arg,words", [
    (moe, "cpu,tiny", "experiments/moe.py: 'cpu,tiny' names 2 variants (cpu, tiny); choose one"),
    (sft, "tiny,cpu", "names 2 variants"), (dpo, "cpu,tiny", "names 2 variants"),
    (dpo, "nosuch", "experiments/dpo.py: unknown variant 'nosuch'"),
    (dpo, "lora=16", "unknown variant 'lora=16'; choose from cpu, tiny or key=value with keys "
                     "base, task")])
def test_an_experiment_argument_names_one_variant_and_known_keys(experiment, arg, words):
  with pytest.raises(ValueError, match=re.escape(words)):
    experiment.get_config(arg)


def _set(config, path: str, value) -> None:
  *sections, name = path.split(".")
  node = config
  for section in sections:
    node = node[section]
  with node.ignore_type():
    node[name] = value


def out_of_range(allowed: ranges.Range) -> list:
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
  fields = ranges.numeric_fields(CONFIGS[name]())
  missing = sorted(set(fields) - set(ranges.RANGES))
  assert not missing, (f"{name}: numeric fields without a row in RANGES "
                       f"(toolkit/training/config.py): {missing}; add one per field")
  outside = {path: value for path, value in fields.items()
             if not ranges.RANGES[path].contains(value)}
  assert not outside, f"{name}: values outside their range: {outside}"
  config_lib.check_ranges(CONFIGS[name]())  # passes


@pytest.mark.parametrize("name", CONFIGS)
def test_each_value_outside_its_range_is_one_clear_error(name):
  config = CONFIGS[name]()
  checked = 0
  for path in ranges.numeric_fields(config):
    allowed = ranges.RANGES[path]
    for bad in out_of_range(allowed):
      broken = copy.deepcopy(config)
      _set(broken, path, bad)
      with pytest.raises(ConfigError) as raised:
        config_lib.check_ranges(broken)
      message = str(raised.value)
      assert message.startswith(f"{path}={bad!r} must be {allowed} ({allowed.meaning})"), message
      assert "\n" not in message
      checked += 1
  assert checked >= 3 * len(ranges.numeric_fields(config))


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
  assert str(ranges.RANGES["optimizer.b1"]) == "a finite number in [0, 1)"
  assert str(ranges.RANGES["optimizer.eps"]) == "a finite number > 0"
  assert str(ranges.RANGES["train.steps"]) == "an integer in [1, 2**31 - 1]"
  assert str(ranges.RANGES["data.eval_fraction"]) == "a finite number in (0, 1)"


# --- model.attention: kernels that cannot run on the devices or the lengths -----------------

def test_attention_that_cannot_run_here_is_refused_by_resolve():
  """splash at data.seq_len 32 and cudnn on CPU devices once failed in the first step, after
  the workdir was written (issue 32); splash at multiples of 128 runs on a CPU in Pallas
  interpret mode, as the tests run it."""
  def config(attention, seq_len):
    c = lm.get_config("tiny")
    c.model.attention, c.data.seq_len = attention, seq_len
    return c

  for seq_len, fix in ((32, 128), (200, 256)):
    with pytest.raises(ConfigError, match=(
        rf"^model\.attention='splash' needs sequence lengths that are multiples of 128 \(the "
        rf"kernel's blocks\), not data\.seq_len={seq_len}; use model\.attention=auto, or "
        rf"data\.seq_len={fix}$")):
      config_lib.resolve(config("splash", seq_len))
  with pytest.raises(ConfigError, match=(
      r"^model\.attention='cudnn' is cuDNN's fused attention, which needs an NVIDIA GPU; the "
      r"mesh's devices are CPUs; use model\.attention=auto \(it picks what runs on CPU\)$")):
    config_lib.resolve(config("cudnn", 128))
  for seq_len in (128, 384):
    config_lib.resolve(config("splash", seq_len))


def test_cudnn_limits_on_a_gpu_and_a_tpu():
  """The GPU's own limits (cuDNN's fused attention, jax 0.10): 16-bit inputs, head_dim a
  multiple of 8 up to 128, even lengths when the documents' mask goes in as a bias."""
  check = config_lib._check_attention  # pylint: disable=protected-access
  data = config_lib.defaults().data  # seq_len 128
  model = LlamaConfig.preset("tiny", attention="cudnn")  # float32, head_dim 8
  with pytest.raises(ConfigError, match=(
      r"not model\.compute_dtype='float32' with head_dim 8; set model\.compute_dtype=bfloat16, "
      r"or model\.attention=auto$")):
    check(model, "gpu", data)
  bf16 = dataclasses.replace(model, compute_dtype="bfloat16")
  check(bf16, "gpu", data)
  with pytest.raises(ConfigError, match=r"head_dim 160; set a model\.head_dim that is a "
                                        r"multiple of 8 up to 128, or model\.attention=auto$"):
    check(dataclasses.replace(bf16, head_dim=160), "gpu", data)
  packed = ml_collections.ConfigDict({**data.to_dict(), "source": "tokens", "packing": True,
                                      "seq_len": 127})
  with pytest.raises(ConfigError, match=r"needs an even data\.seq_len, not 127; use "
                                        r"data\.seq_len=128 or model\.attention=auto$"):
    check(bf16, "gpu", packed)
  with pytest.raises(ConfigError, match=r"the mesh's devices are TPUs; use model\.attention=auto"):
    check(bf16, "tpu", data)
  check(dataclasses.replace(bf16, attention="splash"), "tpu", data)


@pytest.mark.tpu_aot
def test_compile_targets_are_checked_as_their_own_platform():
  """toolkit.compile resolves on a TPU target's devices from a CPU: splash is the TPU's own
  kernel there, cudnn is refused as on any other non-GPU."""
  extras.require("libtpu")
  from toolkit.planning import target as target_lib  # pylint: disable=g-import-not-at-top
  devices = list(target_lib.target_for("v5p-8").devices)
  config = lm.get_config("tiny")
  config.data.seq_len = 128
  config.model.attention = "splash"
  config_lib.resolve(config, devices)
  config.model.attention = "cudnn"
  with pytest.raises(ConfigError, match=r"needs an NVIDIA GPU; the mesh's devices are TPUs"):
    config_lib.resolve(config, devices)


def test_the_saved_config_of_a_gpu_run_still_samples_and_exports_here():
  """toolkit.sample and toolkit.convert export read the run's saved config, which the user
  cannot override; neither runs model.attention, so a GPU run's cudnn is no reason to refuse
  them on a CPU, while training with it here is refused."""
  from toolkit.conversion import exporter  # pylint: disable=g-import-not-at-top
  from toolkit.inference import restore  # pylint: disable=g-import-not-at-top
  config = lm.get_config("tiny")
  config.model.update(attention="cudnn", compute_dtype="bfloat16")
  saved = config.to_dict()
  with pytest.raises(ConfigError, match=r"needs an NVIDIA GPU"):
    config_lib.resolve(ml_collections.ConfigDict(saved))
  config_lib.resolve(restore.single_device_config(saved), jax.devices()[:1])
  exporter._placement(ml_collections.ConfigDict(saved))  # pylint: disable=protected-access
