"""The shipped price table (a source and a date on every row), price files a user writes
(each mistake one error naming the row and the fix), GPU cluster names and the stand-in
targets toolkit.cost estimates on."""
from __future__ import annotations

import json
import re

import jax
import pytest

from toolkit import accelerators
from toolkit.planning.cost import layouts, prices
from toolkit.planning.target import TargetError, target_for


def test_every_shipped_row_has_a_source_a_date_and_positive_prices():
  assert {"v5e", "v5p", "v6e", "h100", "h200"} <= set(prices.PRICES)
  for p in prices.PRICES.values():
    assert p.source.startswith("https://"), p
    assert re.fullmatch(r"\d{4}-\d{2}(-\d{2})?", p.as_of), p
    assert p.dollars and all(v > 0 and m in prices.MODES for m, v in p.dollars.items()), p
    # Committed use is never dearer than on-demand.
    assert p.dollars.get("3y", 0) <= p.dollars.get("1y", 0) <= p.dollars["on_demand"], p


def test_the_written_table_parses_back_and_a_file_replaces_only_its_rows():
  text = prices.to_json(prices.PRICES)
  assert prices.parse(text, "p.json") == prices.PRICES
  mine = prices.parse(json.dumps([{"accelerator": "V5E", "dollars": {"spot": 0.5},
                                   "source": "my quote", "as_of": "2026-12-01"}]), "p.json")
  merged = prices.table(mine)
  assert merged["v5e"].dollars == {"spot": 0.5}
  assert merged["v5p"] == prices.PRICES["v5p"]


@pytest.mark.parametrize("text, fragments", [
    ("{not json", ["is not JSON", "--write_prices"]),
    ("[]", ["expected a list of rows"]),
    ('[{"accelerator": "v5e", "dollars": {"on_demand": 1}}]', ["row 1 lacks source, as_of"]),
    ('[{"accelerator": "v5e", "dollars": {"monthly": 1}, "source": "s", "as_of": "2026"}]',
     ["row 1: mode 'monthly' is unknown", "on_demand"]),
    ('[{"accelerator": "v5e", "dollars": {"spot": -1}, "source": "s", "as_of": "2026"}]',
     ["dollars.spot=-1", "positive number"]),
    ('[{"accelerator": "v5e", "dollars": {"spot": true}, "source": "s", "as_of": "2026"}]',
     ["dollars.spot=True"]),
    ('["v5e"]', ["row 1 is str"]),
])
def test_a_bad_price_file_is_one_error_naming_the_row(text, fragments):
  with pytest.raises(prices.PriceError) as e:
    prices.parse(text, "p.json")
  message = str(e.value)
  assert "--prices=p.json" in message and "\n" not in message
  for fragment in fragments:
    assert fragment in message, message


def test_gpu_cluster_names_size_nodes():
  c = accelerators.gpu_cluster("H100x64")
  assert (c.name, c.count, c.nodes, c.gpus_per_node) == ("h100x64", 64, 8, 8)
  assert accelerators.gpu_cluster("h200x4").nodes == 1
  assert accelerators.gpu_cluster("b200x16").gpu.hbm_bytes_per_chip == 180 * 10**9
  for bad, fragment in (("h100x12", "not whole 8-GPU nodes"), ("h100x3", "not whole"),
                        ("h100x0", "not whole"), ("h100", "write TYPExN"),
                        ("a100x8", "unknown TPU accelerator")):
    with pytest.raises((ValueError, TargetError)) as e:
      layouts.parse_target(bad)
    assert fragment in str(e.value), str(e.value)
  # The MFU table knows each GPU by the name JAX gives its devices.
  assert accelerators.peak_flops_per_chip("NVIDIA H100 80GB HBM3") == 989e12


def test_targets_and_their_meshes():
  tpu = layouts.parse_target("v5e-256x2")
  assert (tpu.chips, tpu.slices, tpu.price_key, tpu.name) == (512, 2, "v5e", "v5litepod-256x2")
  assert 1024 in tpu.family_sizes
  gpu = layouts.parse_target("h100x16")
  assert (gpu.chips, gpu.slices, gpu.platform) == (16, 2, "gpu")
  assert {8, 16, 24, 4096} <= set(gpu.family_sizes)
  # Stand-in devices: the GPU cluster's nodes are slices, its numbers the table's.
  devices = jax.devices("cpu")
  target = layouts.stand_in(layouts.parse_target("h100x8"), devices)
  assert (target.platform, target.hbm_bytes_per_device, target.dcn_bytes_per_second) == (
      "gpu", 80 * 2**30, 50e9)
  with pytest.raises(TargetError, match="needs 16 stand-in host devices"):
    layouts.stand_in(gpu, devices[:8])
  with pytest.raises(TargetError, match="no GPU compiler runs on this machine"):
    target_for("h100x8")
