"""`python -m toolkit.compile --decode`: the generation engine's decode step compiled ahead of
time for a target from this CPU (toolkit/inference/decode_cost.py): the served weights per
device against bfloat16's, the compiler's total against the chip's HBM, the exit status, the
mistakes."""
from __future__ import annotations

import json

import jax
import optax
import pytest

import sharding
from models import LlamaConfig
from tests import extras
from tests.toolkit.planning.test_compile import _compile_cli
from toolkit.inference import decode_cost
from toolkit.training import state as state_lib


def _decode_json(tmp_path, *args: str) -> tuple[dict, str]:
  out = tmp_path / "decode.json"
  result = _compile_cli("--decode", f"--json={out}", *args)
  assert result.returncode == 0, result.stderr
  return json.loads(out.read_text()), result.stdout


def test_the_decode_report_on_simulated_devices(tmp_path):
  report, stdout = _decode_json(tmp_path, "--config=experiments/lm.py:tiny", "--topology=cpu:8",
                                "--decode_batch=8", "--cache_length=64")
  assert "decode step, the config's model on cpu:8" in stdout
  assert "(2.00x bfloat16's)" in stdout  # the tiny LM's float32 weights, served as they are
  # The weights as the engine serves them, from the tiny LM's own layout on that mesh.
  cfg = LlamaConfig.preset("tiny")
  mesh = sharding.make_mesh(list(report["mesh"].items()), [], jax.devices())
  layout = state_lib.layout(cfg, optax.identity(), sharding.Rules.preset(report["rules"]), mesh)
  assert report["weight_bytes_per_device"] == decode_cost.served_bytes(layout, "none",
                                                                  cfg.compute_dtype)
  assert (report["batch"], report["cache_length"], report["page_size"]) == (8, 64, 16)
  assert report["total_bytes_per_device"] >= report["weight_bytes_per_device"]
  assert report["flops_per_device"] > 0


@pytest.mark.tpu_aot
@pytest.mark.slow  # two 7b decode compiles: 14 s
def test_int8_weights_halve_the_7b_decode_step_on_v5e_8(tmp_path):
  """The engine's paged decode step of the 7b with int8 weights compiles for a v5e-8 (16 GiB
  chips, libtpu) and fits, its weights per device about half of bfloat16's: int8 values and
  float32 per-channel scales for the layers, bfloat16 embeddings (tests/models/
  test_quantization.py checks the same ratio without compiling). Layers scanned, as the config
  has them, so the compile stays small: weight bytes come from the served parameters, not the
  cost analysis. (Not the tiny model: it computes in float32, so int8 keeps its embeddings --
  half its parameters -- in float32, and that weighs more than all of it in bfloat16.)"""
  extras.require("libtpu")
  common = ("--config=experiments/lm.py:size=7b", "--topology=v5e-8", "--decode_batch=8",
            "--cache_length=64", "--page_size=16")
  int8, stdout = _decode_json(tmp_path, *common, "--quantize=int8")
  assert "(0.52x bfloat16's)" in stdout and ": fits" in stdout
  bf16, _ = _decode_json(tmp_path, *common, "--quantize=bfloat16")
  assert 0.5 < int8["weight_bytes_per_device"] / bf16["weight_bytes_per_device"] < 0.54
  assert bf16["weight_bytes_per_device"] == bf16["bfloat16_weight_bytes_per_device"]
  assert int8["total_bytes_per_device"] < bf16["total_bytes_per_device"]
  assert int8["flops_per_device"] > 0


@pytest.mark.parametrize("args,message", [
    (("--plan",), "--decode reports the decode step: drop --plan and --hlo"),
    (("--quantize=int4",), "--quantize"),
    (("--decode_batch=0",), "--decode_batch"),
    (("--config=experiments/vit.py:cpu",), "model.kind='vit' has no decode step"),
])
def test_decode_mistakes_are_one_error_line(args, message):
  config = [] if any(a.startswith("--config=") for a in args) else [
      "--config=experiments/lm.py:tiny"]
  result = _compile_cli("--decode", "--topology=cpu:8", *config, *args)
  assert result.returncode == 2, (result.stdout, result.stderr)
  lines = result.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith("error:") and message in lines[0], lines
