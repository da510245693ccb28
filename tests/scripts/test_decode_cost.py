"""The compiled decode step writes each layer's new token into the donated cache in place: the
stacked cache is never rebuilt from per-layer slices (concatenate) or copied whole, which is
what made the decode step's bytes accessed grow (issue 11; scripts/decode_cost.py)."""
import pathlib
import re
import sys

import pytest

from tests import extras

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "scripts"))
import decode_cost  # pylint: disable=g-import-not-at-top,wrong-import-position


@pytest.mark.parametrize("unroll", [True, False])
def test_decode_step_updates_the_stacked_cache_in_place(unroll):
  compiled, *_, cache_shape = decode_cost.compile_decode(
      "tiny", "cpu:8", "data:1,fsdp:-1,tensor:2", "fsdp_tp", batch=8, cache_length=64,
      unroll=unroll)
  hlo = compiled.as_text()
  # Each device holds (layers, batch/4, length, kv_heads/2, head_dim) of k and of v.
  layers, batch, length, kv_heads, head_dim = cache_shape
  local = f"f32[{layers},{batch // 4},{length},{kv_heads // 2},{head_dim}]"
  producers = [m.group(1) for m in re.finditer(re.escape(local) + r"\{[^}]*\} ([\w-]+)\(", hlo)]
  assert producers, f"no {local} in the compiled decode step"
  assert not {"concatenate", "copy", "transpose"} & set(producers), producers
  if unroll:  # one in-place write per layer, for k and for v (scanned: inside the loop body)
    assert producers.count("dynamic-update-slice") == 2 * layers, producers


def test_decode_cost_reports_the_cache_it_compiled_for():
  result = decode_cost.decode_cost("tiny", "cpu:8", "data:1,fsdp:-1,tensor:2", "fsdp_tp",
                                   batch=8, cache_length=64, unroll=True)
  # tiny: 2 layers, 2 kv heads of 8, float32; k and v over 8 devices.
  assert result["cache_bytes_per_device"] == 2 * (2 * 8 * 64 * 2 * 8 * 4) / 8
  assert result["bytes_accessed_per_device"] >= result["cache_bytes_per_device"]
  assert result["flops_per_device"] > 0


def test_the_paged_decode_step_writes_pages_in_place():
  """The engine's step (pages of 16, 8 rows of one token) scatters each layer's new keys and
  values into the donated pool: the pool is never copied or rebuilt."""
  compiled, *_, cache_shape = decode_cost.compile_decode(
      "tiny", "cpu:8", "data:1,fsdp:-1,tensor:2", "fsdp_tp", batch=8, cache_length=64,
      unroll=False, page_size=16)
  layers, kv_heads, pages, page_size, head_dim = cache_shape
  local = f"f32[{layers},{kv_heads // 2},{pages // 4},{page_size},{head_dim}]"
  producers = [m.group(1) for m in re.finditer(re.escape(local) + r"\{[^}]*\} ([\w-]+)\(",
                                               compiled.as_text())]
  assert producers, f"no {local} in the compiled step"
  assert not {"concatenate", "copy", "transpose"} & set(producers), producers


@pytest.mark.tpu_aot
def test_the_int8_paged_decode_step_compiles_for_v5e_8():
  """The engine's paged decode step with int8 weights compiles for a v5e-8 (libtpu), and its
  weights per device are about half of bfloat16's. On the 7b (bfloat16 compute), layers
  scanned so the compile stays small: weight bytes come from the served parameters, not the
  cost analysis. (Not the tiny model: it computes in float32, so int8 keeps its embeddings --
  half its parameters -- in float32, and that weighs more than all of it in bfloat16.)"""
  extras.require("libtpu")
  run = lambda quantize: decode_cost.decode_cost(
      "7b", "v5e-8", "data:1,fsdp:-1,tensor:2", "fsdp_tp", batch=8, cache_length=64,
      unroll=False, page_size=16, quantize=quantize)
  bf16, int8 = run("bfloat16"), run("int8")
  # int8 values + float32 per-channel scales for the layers, bfloat16 embeddings (4 %):
  # 0.52x (tests/models/test_quantization.py checks the same ratio without compiling).
  assert 0.5 < int8["weight_bytes_per_device"] / bf16["weight_bytes_per_device"] < 0.54
  assert int8["total_bytes_per_device"] < bf16["total_bytes_per_device"]
  assert int8["flops_per_device"] > 0
