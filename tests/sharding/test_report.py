"""ShardingReport: golden PartitionSpecs per model and preset, byte totals, the table, and the
replicated-bytes check."""
import json

import jax
import pytest

from models import LlamaConfig
from sharding import Rules, ShardingError, make_mesh, sharding_report
from tests.sharding import regen_golden
from tests.sharding.regen_golden import MODEL_PRESETS, RULES_PRESETS

REGEN_HINT = ("resolved shardings differ from {path}; if the change is intended, run "
              "`python -m tests.sharding.regen_golden` and review the diff")


# ---------------------------------------------------------------------------------------------
# Golden dumps
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("preset", RULES_PRESETS)
@pytest.mark.parametrize("model", MODEL_PRESETS)
def test_specs_match_golden(model, preset):
  path = regen_golden.golden_path(model, preset)
  assert path.exists(), f"missing {path}; run `python -m tests.sharding.regen_golden`"
  golden = json.loads(path.read_text())
  assert regen_golden.resolved_specs(model, preset) == golden, REGEN_HINT.format(path=path)


def test_no_stale_golden_files():
  expected = {regen_golden.golden_path(m, p).name for m in MODEL_PRESETS for p in RULES_PRESETS}
  assert {path.name for path in regen_golden.GOLDEN_DIR.glob("*.json")} == expected


def test_golden_covers_every_parameter():
  for model in MODEL_PRESETS:
    paths = {path for path, *_ in regen_golden.entries(model)}
    for preset in RULES_PRESETS:
      golden = json.loads(regen_golden.golden_path(model, preset).read_text())
      assert set(golden) == paths, (model, preset)


# What the preset tables intend, written by hand so that regenerating the goldens cannot
# silently bless a wrong table.
INTENDED = {
    "dp": {},  # every parameter P()
    "fsdp": {
        "embed": "P(None, 'fsdp')",
        "unembed": "P('fsdp',)",
        "layers/mlp/w_gate": "P(None, 'fsdp')",
        "layers/mlp/w_down": "P(None, None, 'fsdp')",
        "layers/attention/wo": "P(None, None, None, 'fsdp')",
    },
    "tp": {
        "embed": "P('tensor',)",
        "unembed": "P(None, 'tensor')",
        "layers/mlp/w_gate": "P(None, None, 'tensor')",
        "layers/mlp/w_down": "P(None, 'tensor')",
        "layers/attention/wk": "P(None, None, 'tensor')",
        "layers/attention/wo": "P(None, 'tensor')",
    },
    "fsdp_tp": {
        "embed": "P('tensor', 'fsdp')",
        "unembed": "P('fsdp', 'tensor')",
        "layers/mlp/w_gate": "P(None, 'fsdp', 'tensor')",
        "layers/mlp/w_down": "P(None, 'tensor', 'fsdp')",
        "layers/attention/wq": "P(None, 'fsdp', 'tensor')",
        "layers/attention/wo": "P(None, 'tensor', None, 'fsdp')",
    },
}
# fsdp_cp: fsdp's table with the sequence axis beside fsdp (regen_golden's mesh has both).
INTENDED["fsdp_cp"] = {path: spec.replace("'fsdp'", "('fsdp', 'sequence')")
                       for path, spec in INTENDED["fsdp"].items()}
# fsdp_pp: fsdp's table with the stacked layers over stage (regen_golden's mesh has both).
INTENDED["fsdp_pp"] = {
    "embed": "P(None, 'fsdp')",
    "unembed": "P('fsdp',)",
    "layers/mlp/w_gate": "P('stage', 'fsdp')",
    "layers/mlp/w_down": "P('stage', None, 'fsdp')",
    "layers/attention/wo": "P('stage', None, None, 'fsdp')",
}
# The *_ep presets add only the experts' split: a dense model's specs are their base preset's.
INTENDED["fsdp_ep"], INTENDED["fsdp_tp_ep"] = INTENDED["fsdp"], INTENDED["fsdp_tp"]
# A mixture of experts' MLP: router (layers, embed, experts), w_gate (layers, experts, embed,
# mlp), w_down (layers, experts, mlp, embed); the experts split over `expert` only by *_ep.
INTENDED_MOE_MLP = {
    "fsdp": {"router": "P(None, 'fsdp')", "w_gate": "P(None, None, 'fsdp')",
             "w_down": "P(None, None, None, 'fsdp')"},
    "fsdp_cp": {"router": "P(None, ('fsdp', 'sequence'))",
                "w_gate": "P(None, None, ('fsdp', 'sequence'))",
                "w_down": "P(None, None, None, ('fsdp', 'sequence'))"},
    "fsdp_pp": {"router": "P('stage', 'fsdp')", "w_gate": "P('stage', None, 'fsdp')",
                "w_down": "P('stage', None, None, 'fsdp')"},
    "tp": {"router": "P()", "w_gate": "P(None, None, None, 'tensor')",
           "w_down": "P(None, None, 'tensor')"},
    "fsdp_tp": {"router": "P(None, 'fsdp')", "w_gate": "P(None, None, 'fsdp', 'tensor')",
                "w_down": "P(None, None, 'tensor', 'fsdp')"},
    "fsdp_ep": {"router": "P(None, 'fsdp', 'expert')", "w_gate": "P(None, 'expert', 'fsdp')",
                "w_down": "P(None, 'expert', None, 'fsdp')"},
    "fsdp_tp_ep": {"router": "P(None, 'fsdp', 'expert')",
                   "w_gate": "P(None, 'expert', 'fsdp', 'tensor')",
                   "w_down": "P(None, 'expert', 'tensor', 'fsdp')"},
}


def intended(model: str, preset: str) -> dict[str, str]:
  if not LlamaConfig.preset(model).n_experts:
    return INTENDED[preset]
  return {**INTENDED[preset],
          **{f"layers/mlp/{name}": spec for name, spec in INTENDED_MOE_MLP[preset].items()}}


@pytest.mark.parametrize("preset", RULES_PRESETS)
@pytest.mark.parametrize("model", MODEL_PRESETS)
def test_golden_matches_the_intent_of_the_preset(model, preset):
  golden = json.loads(regen_golden.golden_path(model, preset).read_text())
  expected = intended(model, preset) if preset != "dp" else {}
  for path, spec in golden.items():
    if path.endswith("/scale") or preset == "dp":
      # norms and everything under dp stay replicated; a pipeline's layers' norms per stage
      stacked = preset.endswith("_pp") and path.startswith("layers/")
      assert spec == ("P('stage',)" if stacked else "P()"), (path, spec)
      continue
    if path in expected:
      assert spec == expected[path], path
    # Every weight matrix has an `embed` dimension, and one of heads/kv_heads/mlp/vocab (the
    # router's second is `experts`, which only the *_ep presets split).
    if "fsdp" in preset:
      assert "'fsdp'" in spec, (path, spec)
    if preset.endswith("_cp"):
      assert "('fsdp', 'sequence')" in spec, (path, spec)
    if preset.endswith("_pp") and path.startswith("layers/"):
      assert spec.startswith("P('stage'"), (path, spec)
    if "tp" in preset and not path.endswith("/router"):
      assert "'tensor'" in spec, (path, spec)
    if preset.endswith("_ep") and path.endswith(("/router", "/w_gate", "/w_up", "/w_down")):
      assert ("'expert'" in spec) == bool(LlamaConfig.preset(model).n_experts), (path, spec)


# ---------------------------------------------------------------------------------------------
# Totals
# ---------------------------------------------------------------------------------------------

def test_total_and_per_device_bytes_from_the_model_size():
  """Against hand counts: all tiny parameters in float32, and on fsdp=4 x tensor=2 every
  weight matrix split 8 ways while the norm scales (final d + 2 per layer) stay whole."""
  tiny = LlamaConfig.preset("tiny")
  report = regen_golden.report("tiny", "fsdp_tp")
  total = tiny.num_params() * 4
  norm_bytes = (tiny.d_model + 2 * tiny.n_layers * tiny.d_model) * 4
  assert report.total_bytes == total == 139_904
  assert report.per_device_bytes == (total - norm_bytes) // 8 + norm_bytes == 18_048


def test_bytes_of_hand_made_rows():
  mesh = make_mesh([("data", 1), ("fsdp", 4), ("tensor", 2)])
  report = sharding_report([("w", (8, 4), "float32", ("embed", "mlp")),
                            ("v", (8, 4), "float32", ("embed", None)),
                            ("b", (4,), "bfloat16", ("norm",))],
                           Rules.preset("fsdp_tp"), mesh)
  w, v, b = report.rows
  assert (w.total_bytes, w.per_device_bytes, w.replicated) == (128, 16, False)  # 8 ways
  assert (v.total_bytes, v.per_device_bytes, v.replicated) == (128, 32, False)  # 4 ways
  assert (b.total_bytes, b.per_device_bytes, b.replicated) == (8, 8, True)
  assert (b.dtype, b.logical_axes, b.shape) == ("bfloat16", ("norm",), (4,))
  assert (report.total_bytes, report.per_device_bytes, report.replicated_bytes) == (264, 56, 8)
  assert report.replicated_fraction == pytest.approx(8 / 264)


def test_fully_sharded_param_takes_an_eighth_per_device():
  rows = {row.path: row for row in regen_golden.report("tiny", "fsdp_tp").rows}
  w_gate = rows["layers/mlp/w_gate"]
  assert w_gate.per_device_bytes == w_gate.total_bytes // 8
  assert w_gate.total_bytes == 2 * 32 * 64 * 4


def test_replicated_fraction():
  tiny = LlamaConfig.preset("tiny")
  assert regen_golden.report("tiny", "dp").replicated_fraction == 1.0
  # Under fsdp_tp only the norm scales stay whole: final (d) + 2 per layer (layers x d).
  norm_bytes = (tiny.d_model + 2 * tiny.n_layers * tiny.d_model) * 4
  report = regen_golden.report("tiny", "fsdp_tp")
  assert report.replicated_bytes == norm_bytes
  assert report.replicated_fraction == pytest.approx(norm_bytes / report.total_bytes)


def test_axis_of_size_one_counts_as_replicated():
  # data=1: a spec naming only `data` still leaves a full copy on every device.
  mesh = make_mesh([("data", 1), ("fsdp", 8)])
  report = sharding_report([("w", (8, 4), "float32", ("embed", "mlp"))],
                           Rules.preset("dp", param_overrides="embed=data"), mesh)
  assert report.rows[0].replicated
  assert report.replicated_fraction == 1.0


def test_resolution_errors_name_the_parameter_path():
  mesh = make_mesh([("fsdp", 8)])
  with pytest.raises(ShardingError, match=r"parameter layers/w: dimension 1 \(embed\) has size 12"):
    sharding_report([("layers/w", (2, 12), "float32", ("layers", "embed"))],
                    Rules.preset("fsdp"), mesh)


# ---------------------------------------------------------------------------------------------
# format()
# ---------------------------------------------------------------------------------------------

def test_format_lists_every_parameter_and_the_totals():
  report = regen_golden.report("tiny", "fsdp_tp")
  text = report.format()
  lines = text.splitlines()
  assert lines[0] == "sharding on mesh data=1 fsdp=4 tensor=2"
  assert lines[1].split() == ["parameter", "shape", "logical", "axes", "PartitionSpec",
                              "bytes/device"]
  body = lines[3:-1]
  assert [line.split()[0] for line in body] == [row.path for row in report.rows]
  w_gate = next(line for line in body if line.startswith("layers/mlp/w_gate "))
  assert w_gate.split() == ["layers/mlp/w_gate", "2x32x64", "layers,embed,mlp",
                            "P(None,", "fsdp,", "tensor)", "2.0", "KiB"]
  assert lines[-1] == ("total 136.6 KiB of parameters, 17.6 KiB per device; "
                       "replicated 640 B (0.5%)")


def test_format_of_an_empty_report():
  report = sharding_report([], Rules.preset("dp"), make_mesh([("fsdp", 8)]))
  assert report.format().splitlines()[-1] == (
      "total 0 B of parameters, 0 B per device; replicated 0 B (0.0%)")


# ---------------------------------------------------------------------------------------------
# check_replicated
# ---------------------------------------------------------------------------------------------

def test_check_replicated_warns_above_the_limit():
  message = regen_golden.report("tiny", "dp").check_replicated(0.05, "warn")
  assert message == ("100.0% of parameter bytes are replicated on every device (limit "
                     "sharding.max_replicated_fraction=0.05); use a preset that shards "
                     "parameters (fsdp, fsdp_tp) or raise the limit")


def test_check_replicated_fails_above_the_limit():
  with pytest.raises(ShardingError,
                     match=r"100\.0% of parameter bytes are replicated on every device \(limit "
                           r"sharding\.max_replicated_fraction=0\.05\)"):
    regen_golden.report("tiny", "dp").check_replicated(0.05, "fail")


@pytest.mark.parametrize("action", ["warn", "fail"])
def test_check_replicated_passes_at_or_below_the_limit(action):
  report = regen_golden.report("tiny", "fsdp_tp")
  assert 0 < report.replicated_fraction < 0.05
  assert report.check_replicated(0.05, action) is None
  assert report.check_replicated(report.replicated_fraction, action) is None


@pytest.mark.parametrize("action", ["warn", "fail"])
def test_check_replicated_is_silent_on_one_device(action):
  mesh = make_mesh([("data", 1), ("fsdp", -1)], devices=jax.devices()[:1])
  report = sharding_report(regen_golden.entries("tiny"), Rules.preset("dp"), mesh)
  assert report.replicated_fraction == 1.0
  assert report.check_replicated(0.0, action) is None
