"""Collectives scheduled to overlap compute: the HLO reader (toolkit/planning/scheduling.py, and
`collectives.parse` counting each transfer once), and the TPU compile with and without the
overlap flags of toolkit/xla_flags.py (tests/conftest.py sets them for the suite's TPU
compiles, as toolkit.compile does for its own).

Measured with libtpu 0.0.42.1, the CPU LM on v5p-8 (fsdp 2 x tensor 2): with the flags 13
start/done pairs (the 12 fsdp all-gathers and a collective-permute) and 22 collectives
synchronous; with runtime.xla_flags=none 1 pair (the collective-permute: async by default)
and 34 synchronous, 17 of them all-gathers. The bytes each kind moves are the same both ways.
The control compiles for v5p: on v5e-8 the same libtpu makes those 12 all-gathers async by
itself (12 pairs without the flags too; 0 with them set to false).
"""
from __future__ import annotations

import json

import pytest

from experiments import lm, moe
from tests import tiers
from tests.toolkit.planning.test_compile import _compile_cli, needs_libtpu
from toolkit import xla_flags
from toolkit.planning import aot, collectives, scheduling, target as target_lib

# The three async forms (classic start/done, async-start wrapping a reduce-scatter, libtpu's
# async collective fusion with its done's and continuation's echoes of channel 3) and two
# collectives run in place.
_HLO = """HloModule jit_step, is_scheduled=true, num_partitions=4

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %sum = f32[] add(%x, %y)
}

%fused_computation.1 (param_0.1: bf16[64,128]) -> (bf16[64,128], bf16[256,128]) {
  %param_0.1 = bf16[64,128]{1,0} parameter(0)
  %all-gather.1 = bf16[256,128]{1,0} all-gather(%param_0.1), channel_id=3, replica_groups=[1,4]<=[4], dimensions={0}, use_global_device_ids=true
  ROOT %tuple.1 = (bf16[64,128]{1,0}, bf16[256,128]{1,0}) tuple(%param_0.1, %all-gather.1)
}

%async_collective_fusion.2 (param_0.2: bf16[64,128]) -> bf16[256,128] {
  %param_0.2 = bf16[64,128]{1,0} parameter(0)
  ROOT %all-gather.2 = bf16[256,128]{1,0} all-gather(%param_0.2), channel_id=3, replica_groups=[1,4]<=[4], dimensions={0}, use_global_device_ids=true
}

%fused_computation.3 (param_0.3: bf16[64,128]) -> bf16[256,128] {
  %param_0.3 = bf16[64,128]{1,0} parameter(0)
  ROOT %all-gather.3 = bf16[256,128]{1,0} all-gather(%param_0.3), channel_id=3, replica_groups=[1,4]<=[4], dimensions={0}, use_global_device_ids=true
}

%wrapped_reduce_scatter (param_0.4: f32[64]) -> f32[16] {
  %param_0.4 = f32[64]{0} parameter(0)
  ROOT %reduce-scatter.1 = f32[16]{0} reduce-scatter(%param_0.4), channel_id=5, replica_groups=[1,4]<=[4], dimensions={0}, to_apply=%add
}

ENTRY %main (a: bf16[64,128], g: f32[64], w: f32[8]) -> (bf16[256,128], f32[16], f32[32]) {
  %a = bf16[64,128]{1,0} parameter(0)
  %async-collective-start = (bf16[64,128]{1,0}, bf16[256,128]{1,0}) fusion(%a), kind=kCustom, calls=%fused_computation.1
  %fusion.2 = bf16[256,128]{1,0} fusion(%a), kind=kOutput, calls=%async_collective_fusion.2
  %get-tuple-element.1 = bf16[64,128]{1,0} get-tuple-element(%async-collective-start), index=0
  %async-collective-done = bf16[256,128]{1,0} fusion(%get-tuple-element.1), kind=kCustom, calls=%fused_computation.3
  %g = f32[64]{0} parameter(1)
  %async-start = ((f32[64]{0}), f32[16]{0}, u32[]) async-start(%g), calls=%wrapped_reduce_scatter
  %async-done = f32[16]{0} async-done(%async-start), calls=%wrapped_reduce_scatter
  %w = f32[8]{0} parameter(2)
  %all-reduce-start.1 = f32[8]{0} all-reduce-start(%w), channel_id=7, replica_groups=[1,4]<=[4], to_apply=%add
  %all-reduce-done.1 = f32[8]{0} all-reduce-done(%all-reduce-start.1)
  %collective-permute.1 = f32[8]{0} collective-permute(%all-reduce-done.1), channel_id=8, source_target_pairs={{0,1},{1,2},{2,3},{3,0}}
  %all-gather.4 = f32[32]{0} all-gather(%collective-permute.1), channel_id=9, replica_groups=[1,4]<=[4], dimensions={0}
  ROOT %tuple.2 = (bf16[256,128]{1,0}, f32[16]{0}, f32[32]{0}) tuple(%async-collective-done, %async-done, %all-gather.4)
}
"""


def test_async_pairs_are_counted_in_every_form_and_each_transfer_once():
  scheduled = scheduling.read(_HLO)
  assert scheduled.pairs == {"all-gather": 1, "all-reduce": 1, "reduce-scatter": 1}
  assert scheduled.synchronous == {"all-gather": 1, "collective-permute": 1}
  assert scheduled.as_dict()["async_pair_count"] == 3
  assert scheduled.as_dict()["synchronous_count"] == 2
  # The parser: channel 3's all-gather once (at its start, not in the done's or the
  # continuation's computation), and the wrapped reduce-scatter once (its async-done calls the
  # same computation, which does not run again).
  found = collectives.parse(_HLO, [("fsdp", 4)])
  assert sorted((c.kind, c.name, c.count) for c in found) == [
      ("all-gather", "all-gather.1", 1), ("all-gather", "all-gather.4", 1),
      ("all-reduce", "all-reduce-start.1", 1), ("collective-permute", "collective-permute.1", 1),
      ("reduce-scatter", "reduce-scatter.1", 1)]
  plain = scheduling.read(_HLO.replace("async-collective-", "x-"))
  assert plain.pairs == {"all-reduce": 1, "reduce-scatter": 1}   # the named fusions are the form


@pytest.mark.tpu_aot
@pytest.mark.slow  # two TPU compiles, one in a new process: 14 s (29 s on busy cores)
def test_without_the_overlap_flags_the_all_gathers_run_synchronously(tmp_path):
  """The negative control of test_compile.py's test_cpu_lm_compiles_and_fits_on_small_slices:
  toolkit.compile with runtime.xla_flags=none schedules no all-gather async (libtpu 0.0.42
  still makes the one collective-permute async by itself); the bytes per kind and mesh axes
  are the flags' run's (each transfer counted once)."""
  needs_libtpu()
  out = tmp_path / "none.json"
  done = _compile_cli("--config=experiments/lm.py:cpu", "--topology=v5p-8",
                      "--config.runtime.xla_flags=none", f"--json={out}")
  assert done.returncode == 0, done.stdout + done.stderr
  assert done.stdout.startswith("overlap flags: none (runtime.xla_flags=none)")
  off = json.loads(out.read_text())
  on = aot.compile_report(lm.get_config("cpu"), target_lib.target_for("v5p-8"))  # with them
  assert on.overlap["async_pairs"].get("all-gather", 0) >= 4, on.overlap
  assert off["overlap"]["flags"]["preset"] == [], off["overlap"]
  assert "all-gather" not in off["overlap"]["async_pairs"], off["overlap"]
  assert (off["overlap"]["synchronous"]["all-gather"]
          > on.overlap["synchronous"].get("all-gather", 0))
  assert (off["overlap"]["async_pair_count"] + off["overlap"]["synchronous_count"]
          == on.overlap["async_pair_count"] + on.overlap["synchronous_count"])
  payload = lambda rows: {(c["kind"], c["axes"]): c["payload_bytes"] for c in rows}  # noqa: E731
  assert payload(on.collectives) == payload(off["collectives"])


# Every rules preset on v5p-8 (4 chips): the CPU LM with a mesh its axes use, the tiny MoE for
# the expert presets.
_PRESETS = {
    "dp": (lm, "rules=dp", {"mesh.ici": "data:-1,fsdp:1,tensor:1"}),
    "fsdp": (lm, "rules=fsdp", {"mesh.ici": "data:1,fsdp:-1,tensor:1"}),
    "tp": (lm, "rules=tp", {"mesh.ici": "data:2,fsdp:1,tensor:2"}),
    "fsdp_tp": (lm, "cpu", {}),
    "fsdp_cp": (lm, "cpu", {"sharding.preset": "fsdp_cp",
                            "mesh.ici": "data:1,fsdp:2,sequence:2,tensor:1"}),
    "fsdp_pp": (lm, "cpu", {"sharding.preset": "fsdp_pp", "model.pipeline_microbatches": 4,
                            "mesh.ici": "stage:2,data:1,fsdp:2,tensor:1"}),
    "fsdp_ep": (moe, "tiny", {"mesh.ici": "data:1,fsdp:-1,expert:2"}),
    "fsdp_tp_ep": (moe, "tiny,rules=fsdp_tp_ep", {"mesh.ici": "data:1,fsdp:1,expert:2,tensor:2"}),
}


# The pipeline's is the presubmit tier's compile of its code path; the step's other presets and
# the mixture of experts' compile in make test already (tests/tiers.py's COMPILE clause).
_COVERED_BY = {"fsdp_ep": "tests/toolkit/planning/test_compile.py::"
                          "test_moe_ragged_all_to_all_exchange_compiles_for_tpu",
               "fsdp_tp_ep": "tests/toolkit/planning/test_compile.py::"
                             "test_moe_ragged_all_to_all_exchange_compiles_for_tpu"}
_STEP = "tests/toolkit/planning/test_compile.py::test_cpu_lm_compiles_and_fits_on_small_slices[v5p-8]"


@pytest.mark.slow  # 4-6 s each, 36 s for the eight (55 s on busy cores)
@pytest.mark.tpu_aot
@pytest.mark.parametrize("preset", [
    pytest.param(preset, marks=() if preset == "fsdp_pp" else tiers.full(
        tiers.COMPILE, by=_COVERED_BY.get(preset, _STEP))) for preset in _PRESETS])
def test_every_rules_preset_compiles_for_v5p_8_with_the_overlap_flags(preset):
  needs_libtpu()
  experiment, variant, overrides = _PRESETS[preset]
  config = experiment.get_config(variant)
  for key, value in overrides.items():
    section, field = key.split(".")
    config[section][field] = value
  report = aot.compile_report(config, target_lib.target_for("v5p-8"))
  assert report.verdict == "fits" and report.run["preset"] == preset
  assert report.overlap["flags"] == xla_flags.in_effect("tpu")
  gathers = any(c["kind"] == "all-gather" and "fsdp" in c["axes"] for c in report.collectives)
  if gathers and preset not in ("fsdp_ep", "fsdp_tp_ep"):  # dense fsdp: the weights' gathers
    assert report.overlap["async_pairs"].get("all-gather", 0) >= 1, report.overlap


def test_the_step_estimate_hides_async_ici_time_behind_compute():
  class Chip:  # what _hidden reads of a target
    ici_bytes_per_second = 100e9
  summaries = [
      collectives.Summary("all-gather", "fsdp", False, 2, 32, 0, ici_bytes=10e9, dcn_bytes=0),
      collectives.Summary("all-reduce", "tensor", False, 1, 32, 0, ici_bytes=5e9, dcn_bytes=0)]
  # 3 of 4 all-gathers async, the all-reduces synchronous: 7.5 GB hideable = 75 ms of ICI.
  overlap = {"async_pairs": {"all-gather": 3}, "synchronous": {"all-gather": 1, "all-reduce": 2}}
  step = {"compute_s": 0.5, "ici_s": 0.15, "dcn_s": 0.0, "total_s": 0.65,
          "model_flops_utilization": 0.5}
  hidden = aot._hidden(step, summaries, overlap, Chip)  # pylint: disable=protected-access
  assert hidden["hidden_s"] == pytest.approx(0.075)
  assert hidden["total_s"] == pytest.approx(0.575) and hidden["no_overlap_s"] == 0.65
  assert hidden["model_flops_utilization"] == pytest.approx(0.5 * 0.65 / 0.575)
  # Never more than the compute it hides behind.
  short = dict(step, compute_s=0.01, total_s=0.16)
  assert aot._hidden(short, summaries, overlap, Chip)["hidden_s"] == pytest.approx(0.01)
