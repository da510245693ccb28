"""The compiled decode step writes each layer's new token into the donated cache in place: the
stacked cache is never rebuilt from per-layer slices (concatenate) or copied whole, which is
what made the decode step's bytes accessed grow (issue 11; scripts/bench/decode_cost.py)."""
import re

import pytest

from scripts.bench import decode_cost


@pytest.mark.parametrize("unroll", [True, False])
def test_decode_step_updates_the_stacked_cache_in_place(unroll):
  compiled = decode_cost.compile_decode(
      "tiny", "cpu:8", "data:1,fsdp:-1,tensor:2", "fsdp_tp", batch=8, cache_length=64,
      unroll=unroll)
  hlo, cache_shape = compiled.executable.as_text(), compiled.cache_shape
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
  compiled = decode_cost.compile_decode(
      "tiny", "cpu:8", "data:1,fsdp:-1,tensor:2", "fsdp_tp", batch=8, cache_length=64,
      unroll=False, page_size=16)
  layers, kv_heads, pages, page_size, head_dim = compiled.cache_shape
  local = f"f32[{layers},{kv_heads // 2},{pages // 4},{page_size},{head_dim}]"
  producers = [m.group(1) for m in re.finditer(re.escape(local) + r"\{[^}]*\} ([\w-]+)\(",
                                               compiled.executable.as_text())]
  assert producers, f"no {local} in the compiled step"
  assert not {"concatenate", "copy", "transpose"} & set(producers), producers
