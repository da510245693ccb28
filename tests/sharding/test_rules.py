"""Rules presets, overrides, resolution errors and `constrain` under jit."""
import re

import jax
import jax.numpy as jnp
import jaxlib.version
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from sharding import (LOGICAL_AXES, PRESETS, Rules, ShardingError, activation_rules, constrain,
                      constrain_grad, make_mesh)
from sharding.rules import parse_overrides
from toolkit.planning import collectives

BATCH = ("data", "fsdp")


@pytest.fixture(scope="module")
def mesh():
  """Every axis the presets use, each of size 2, so no axis is dropped."""
  return make_mesh([("data", 2), ("fsdp", 2), ("tensor", 2)])


# ---------------------------------------------------------------------------------------------
# Presets
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_each_preset_has_one_entry_per_logical_axis(preset):
  for table in PRESETS[preset]:
    assert set(table) == set(LOGICAL_AXES)


# (logical axes of a parameter) -> expected spec per preset.
PARAM_CASES = [
    # (logical axes,                         dp,   fsdp,                 tp,                        fsdp_tp)
    (("vocab", "embed"),                     P(), P(None, "fsdp"),        P("tensor"),               P("tensor", "fsdp")),
    (("embed", "vocab"),                     P(), P("fsdp"),              P(None, "tensor"),         P("fsdp", "tensor")),
    (("layers", "embed", "mlp"),             P(), P(None, "fsdp"),        P(None, None, "tensor"),   P(None, "fsdp", "tensor")),
    (("layers", "mlp", "embed"),             P(), P(None, None, "fsdp"),  P(None, "tensor"),         P(None, "tensor", "fsdp")),
    (("layers", "embed", "heads", "head_dim"), P(), P(None, "fsdp"),      P(None, None, "tensor"),   P(None, "fsdp", "tensor")),
    (("layers", "embed", "kv_heads", "head_dim"), P(), P(None, "fsdp"),   P(None, None, "tensor"),   P(None, "fsdp", "tensor")),
    (("layers", "heads", "head_dim", "embed"), P(), P(None, None, None, "fsdp"), P(None, "tensor"), P(None, "tensor", None, "fsdp")),
    (("layers", "norm"),                     P(), P(),                    P(),                       P()),
    (("patch", "classes"),                   P(), P(),                    P(),                       P()),
]  # yapf: disable
PRESET_ORDER = ("dp", "fsdp", "tp", "fsdp_tp")


@pytest.mark.parametrize("preset", PRESET_ORDER)
@pytest.mark.parametrize("case", PARAM_CASES, ids=lambda case: ",".join(case[0]))
def test_preset_param_specs(mesh, preset, case):
  logical_axes, expected = case[0], case[1 + PRESET_ORDER.index(preset)]
  assert Rules.preset(preset).param_spec(logical_axes, mesh) == expected


ACTIVATION_CASES = [
    # (logical axes,                        dp,          fsdp,        tp,                              fsdp_tp)
    (("batch", "length", "embed"),          P(BATCH),    P(BATCH),    P(BATCH),                        P(BATCH)),
    (("batch", "length", "mlp"),            P(BATCH),    P(BATCH),    P(BATCH, None, "tensor"),        P(BATCH, None, "tensor")),
    (("batch", "length", "heads", None),    P(BATCH),    P(BATCH),    P(BATCH, None, "tensor"),        P(BATCH, None, "tensor")),
    (("batch", "length", "kv_heads", None), P(BATCH),    P(BATCH),    P(BATCH, None, "tensor"),        P(BATCH, None, "tensor")),
    (("batch", "length", "vocab"),          P(BATCH),    P(BATCH),    P(BATCH, None, "tensor"),        P(BATCH, None, "tensor")),
]  # yapf: disable


@pytest.mark.parametrize("preset", PRESET_ORDER)
@pytest.mark.parametrize("case", ACTIVATION_CASES, ids=lambda case: ",".join(map(str, case[0])))
def test_preset_activation_specs(mesh, preset, case):
  logical_axes, expected = case[0], case[1 + PRESET_ORDER.index(preset)]
  assert Rules.preset(preset).activation_spec(logical_axes, mesh) == expected


# Expert parallelism: each *_ep preset is its base preset plus `experts` -> expert, with the
# batch also split over expert (data parallel outside the experts).
EP_PRESETS = {"fsdp_ep": "fsdp", "fsdp_tp_ep": "fsdp_tp"}


# Context parallelism: fsdp_cp is fsdp with parameters stored over fsdp and sequence together.
CP_PRESETS = {"fsdp_cp": "fsdp"}
# Pipeline stages: fsdp_pp is fsdp with the stacked layers over stage, stored and computed.
PP_PRESETS = {"fsdp_pp": "fsdp"}


def test_presets_are_exactly_the_documented_ones():
  assert set(PRESETS) == set(PRESET_ORDER) | set(EP_PRESETS) | set(CP_PRESETS) | set(PP_PRESETS)


def test_fsdp_pp_splits_the_stacked_layers_over_stage_at_rest_and_in_compute():
  mesh = make_mesh([("stage", 4), ("fsdp", 2)])
  rules = Rules.preset("fsdp_pp")
  assert rules.param_spec(("layers", "embed", "mlp"), mesh) == P("stage", "fsdp")
  assert rules.activation_spec(("layers", "batch", "length", "embed"), mesh) == P("stage", "fsdp")
  assert Rules.preset("fsdp").activation_spec(("layers",), mesh) == P()


@pytest.mark.parametrize("preset", [*PRESET_ORDER, *EP_PRESETS, *CP_PRESETS, *PP_PRESETS])
def test_every_preset_splits_positions_over_sequence_and_keeps_keys_whole(preset):
  mesh = make_mesh([("fsdp", 2), ("sequence", 2), ("tensor", 2)])
  rules = Rules.preset(preset)
  assert rules.activation_spec(("length",), mesh) == P("sequence")
  assert rules.activation_spec(("kv_length",), mesh) == P()
  # A mesh without the axis drops it: positions stay whole.
  assert Rules.preset(preset).activation_spec(("length",), make_mesh([("fsdp", 8)])) == P()


def test_fsdp_cp_stores_parameters_over_fsdp_and_sequence():
  mesh = make_mesh([("fsdp", 2), ("sequence", 4)])
  rules, base = Rules.preset("fsdp_cp"), Rules.preset("fsdp")
  assert rules.param_spec(("embed", "mlp"), mesh) == P(("fsdp", "sequence"))
  assert base.param_spec(("embed", "mlp"), mesh) == P("fsdp")
  assert rules.activations == base.activations


@pytest.mark.parametrize("preset", EP_PRESETS)
def test_expert_presets_add_only_the_expert_split(preset):
  mesh = make_mesh([("fsdp", 2), ("expert", 2), ("tensor", 2)])
  rules, base = Rules.preset(preset), Rules.preset(EP_PRESETS[preset])
  for case in PARAM_CASES:
    assert rules.param_spec(case[0], mesh) == base.param_spec(case[0], mesh), case[0]
  tp = ("tensor",) if preset == "fsdp_tp_ep" else ()
  assert rules.param_spec(("layers", "experts", "embed", "mlp"), mesh) == P(
      None, "expert", "fsdp", *tp)
  assert rules.param_spec(("layers", "embed", "experts"), mesh) == P(None, "fsdp", "expert")
  assert base.param_spec(("layers", "experts", "embed", "mlp"), mesh) == P(
      None, None, "fsdp", *tp)
  assert rules.activation_spec(("batch", "length", "embed"), mesh) == P(("fsdp", "expert"))
  assert rules.activation_spec(("experts", None, "embed"), mesh) == P("expert")


def test_mesh_axes_absent_from_the_mesh_are_dropped():
  fsdp_only = make_mesh([("fsdp", 8)])
  rules = Rules.preset("fsdp_tp")
  assert rules.activation_spec(("batch", "length", "mlp"), fsdp_only) == P("fsdp")
  assert rules.param_spec(("layers", "embed", "mlp"), fsdp_only) == P(None, "fsdp")
  data_only = make_mesh([("data", 8)])
  assert rules.activation_spec(("batch", "length"), data_only) == P("data")
  assert rules.param_spec(("layers", "embed", "mlp"), data_only) == P()


def test_none_logical_axis_stays_unsharded(mesh):
  assert Rules.preset("fsdp_tp").param_spec((None, "embed", None, "mlp"), mesh) == P(
      None, "fsdp", None, "tensor")


# ---------------------------------------------------------------------------------------------
# Overrides
# ---------------------------------------------------------------------------------------------

def test_parse_overrides():
  assert parse_overrides("kv_heads=none,batch=data+fsdp", "f") == {
      "kv_heads": (), "batch": ("data", "fsdp")}
  assert parse_overrides(" mlp = tensor , vocab= , ,embed=NONE", "f") == {
      "mlp": ("tensor",), "vocab": (), "embed": ()}
  assert parse_overrides("", "f") == {}


def test_overrides_apply_to_their_role_only(mesh):
  rules = Rules.preset("fsdp_tp", param_overrides="kv_heads=none,embed=data+fsdp",
                       activation_overrides="batch=data,mlp=none")
  assert rules.param_spec(("embed", "kv_heads", "head_dim"), mesh) == P(("data", "fsdp"))
  assert rules.param_spec(("embed", "heads", "head_dim"), mesh) == P(("data", "fsdp"), "tensor")
  assert rules.activation_spec(("batch", "length", "mlp"), mesh) == P("data")
  # The activation overrides left the parameter table alone and vice versa.
  assert rules.param_spec(("embed", "mlp"), mesh) == P(("data", "fsdp"), "tensor")
  assert rules.activation_spec(("batch", "length", "kv_heads"), mesh) == P("data", None,
                                                                           "tensor")


def test_overrides_do_not_change_the_preset_tables():
  Rules.preset("tp", param_overrides="mlp=none", activation_overrides="batch=data")
  assert PRESETS["tp"][0]["mlp"] == ("tensor",)
  assert PRESETS["tp"][1]["batch"] == BATCH
  assert Rules.preset("tp").params["mlp"] == ("tensor",)


# ---------------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------------

def test_unknown_preset():
  with pytest.raises(ShardingError,
                     match=r"sharding\.preset='zero3' is unknown; choose one of dp, fsdp, tp, "
                           r"fsdp_tp"):
    Rules.preset("zero3")


def test_unknown_logical_axis_in_override():
  with pytest.raises(ShardingError,
                     match=r"sharding\.param_overrides: unknown logical axis 'hidden'; known: "
                           r"batch, length, kv_length, embed"):
    Rules.preset("tp", param_overrides="hidden=tensor")


def test_unknown_logical_axis_in_activation_override_names_its_knob():
  with pytest.raises(ShardingError,
                     match=r"sharding\.activation_overrides: unknown logical axis 'seq'"):
    Rules.preset("tp", activation_overrides="seq=sequence")


def test_unknown_logical_axis_in_resolution(mesh):
  with pytest.raises(ShardingError,
                     match=r"parameter layers/mlp/w_gate: unknown logical axis 'hidden'; known: "
                           r"batch, classes, embed"):
    Rules.preset("tp").param_spec(("embed", "hidden"), mesh, what="parameter layers/mlp/w_gate")


def test_unknown_mesh_axis_in_override():
  with pytest.raises(ShardingError,
                     match=r"sharding\.param_overrides: mlp='model' names unknown mesh axis "
                           r"'model'; use one of population, data, stage, fsdp, sequence, expert, "
                           r"tensor or "
                           r"'none'"):
    Rules.preset("tp", param_overrides="mlp=model")


@pytest.mark.parametrize("entry", ["mlp", "=tensor", "mlp:tensor"])
def test_malformed_override_entry(entry):
  with pytest.raises(ShardingError,
                     match=rf"sharding\.param_overrides: entry '{entry}' is not "
                           r"'logical=mesh_axis'; write e\.g\. 'mlp=tensor,vocab=none'"):
    Rules.preset("tp", param_overrides=f"vocab=none,{entry}")


def test_override_listing_a_logical_axis_twice():
  with pytest.raises(ShardingError,
                     match=r"sharding\.param_overrides: logical axis 'mlp' is listed twice; "
                           r"list each once"):
    Rules.preset("tp", param_overrides="mlp=tensor,mlp=none")


def test_override_repeating_a_mesh_axis():
  with pytest.raises(ShardingError,
                     match=r"sharding\.activation_overrides: batch='data\+data' repeats a mesh "
                           r"axis; name each mesh axis once"):
    Rules.preset("dp", activation_overrides="batch=data+data")


def test_two_dimensions_on_one_mesh_axis(mesh):
  rules = Rules.preset("fsdp_tp", param_overrides="mlp=fsdp")
  with pytest.raises(ShardingError,
                     match=r"parameter: logical axes 'embed' and 'mlp' both map to mesh axis "
                           r"'fsdp'; one array cannot use a mesh axis twice; change one of them "
                           r"with sharding\.param_overrides"):
    rules.param_spec(("embed", "mlp"), mesh)


def test_two_dimensions_on_one_mesh_axis_in_activations(mesh):
  rules = Rules.preset("tp", activation_overrides="length=tensor")
  with pytest.raises(ShardingError,
                     match=r"activation: logical axes 'length' and 'mlp' both map to mesh axis "
                           r"'tensor'.*sharding\.activation_overrides"):
    rules.activation_spec(("batch", "length", "mlp"), mesh)


def test_dimension_not_divisible(mesh):
  with pytest.raises(ShardingError,
                     match=r"parameter w: dimension 1 \(mlp\) has size 3, not divisible by "
                           r"tensor=2 \(2 ways\); set sharding\.param_overrides='mlp=none' or "
                           r"change the mesh or model size"):
    Rules.preset("tp").param_spec(("embed", "mlp"), mesh, shape=(4, 3), what="parameter w")


def test_dimension_not_divisible_by_several_axes(mesh):
  with pytest.raises(ShardingError,
                     match=r"activation: dimension 0 \(batch\) has size 6, not divisible by "
                           r"data=2xfsdp=2 \(4 ways\); set sharding\.activation_overrides="
                           r"'batch=none'"):
    Rules.preset("dp").activation_spec(("batch", "length"), mesh, shape=(6, 16))


def test_divisible_shape_resolves(mesh):
  assert Rules.preset("dp").activation_spec(("batch", "length"), mesh, shape=(8, 3)) == P(BATCH)


def test_rank_mismatch(mesh):
  with pytest.raises(ShardingError,
                     match=r"parameter w: 2 logical axes \('embed', 'mlp'\) for a 3-d array of "
                           r"shape \(2, 4, 8\); give one logical name \(or None\) per dimension"):
    Rules.preset("tp").param_spec(("embed", "mlp"), mesh, shape=(2, 4, 8), what="parameter w")


# ---------------------------------------------------------------------------------------------
# constrain
# ---------------------------------------------------------------------------------------------

AXES = ("batch", "length", "mlp")


def _double_and_constrain(x):
  return constrain(x * 2, AXES)


def test_constrain_is_identity_outside_activation_rules():
  x = jnp.ones((8, 4, 6))
  assert constrain(x, AXES) is x


def test_constrain_under_jit_outside_activation_rules_adds_no_sharding():
  y = jax.jit(lambda x: constrain(x * 2, AXES))(jnp.ones((8, 4, 6)))
  assert len(y.sharding.device_set) == 1


def test_constrain_under_jit_inside_activation_rules(mesh):
  rules = Rules.preset("fsdp_tp")
  with activation_rules(rules, mesh):
    y = jax.jit(lambda x: constrain(x * 2, AXES))(jnp.ones((8, 4, 6)))
  expected = NamedSharding(mesh, P(BATCH, None, "tensor"))
  assert y.sharding.is_equivalent_to(expected, y.ndim)
  assert {shard.data.shape for shard in y.addressable_shards} == {(2, 4, 3)}
  assert len(y.sharding.device_set) == 8


def test_constrain_grad_lays_out_the_gradient_only(mesh):
  x = jnp.arange(8 * 4 * 6, dtype=jnp.float32).reshape(8, 4, 6)
  assert constrain_grad(x, AXES) is x  # outside activation_rules
  with activation_rules(Rules.preset("fsdp_tp"), mesh):
    y, grad = jax.jit(jax.value_and_grad(lambda x: jnp.sum(constrain_grad(x, AXES) ** 2)))(x)
  assert y == jnp.sum(x ** 2)
  assert grad.sharding.is_equivalent_to(NamedSharding(mesh, P(BATCH, None, "tensor")), 3)
  assert jnp.array_equal(grad, 2 * x)


# XLA warns when its partitioner weighs the reshard below up to jaxlib 0.11.1 (measured: 0.10.2,
# 0.11.0 and 0.11.1 warn; 0.11.2 and 0.12.0.1 compile the same program without a word).
XLA_WARNS_OF_WEIGHED_RESHARDS = jaxlib.version.__version_info__[:3] < (0, 11, 2)


def _collectives(compiled, mesh) -> list[tuple[str, str, tuple[str, ...]]]:
  """(kind, result type, mesh axes) of each collective of a compiled program."""
  return [(c.kind, c.result, c.axes)
          for c in collectives.parse(compiled.as_text(), list(mesh.shape.items()))]


def _rows_whole(found) -> list:
  """Collectives that hold the 8 x 4 looked-up rows (or their gradient) whole: the rows'
  batch split given up, as a full rematerialization does."""
  return [c for c in found if re.search(r"\bf32\[8,4,\d+\]", c[1])]


@pytest.mark.parametrize("grad_layout", [False, True])
def test_embedding_gradient_layout_and_the_involuntary_reshard(mesh, capfd, grad_layout):
  """models/llama.py's lookup: rows of an fsdp table taken for a batch split over data x
  fsdp. The gradient's scatter-add makes XLA weigh replicating the rows unless its layout
  (the compute one: the whole table) is named; the compiled program never does replicate
  them. With the layout named, the table's gradient is reduced whole over the batch axes.
  (Once the lowest jax this project supports no longer warns without it, from jaxlib 0.11.2
  on, the workaround in models/llama.py can go.)"""
  rules = Rules.preset("fsdp")

  def loss(table, tokens):
    with activation_rules(rules, mesh):
      if grad_layout:
        table = constrain_grad(table, ("vocab", "embed"))
      return jnp.sum(constrain(jnp.take(table, tokens, axis=0), ("batch", "length", "embed")))

  table = jax.device_put(jnp.ones((16, 8)), NamedSharding(mesh, P(None, "fsdp")))
  tokens = jax.device_put(jnp.zeros((8, 4), jnp.int32), NamedSharding(mesh, P(BATCH)))
  compiled = jax.jit(jax.grad(loss), out_shardings=table.sharding).lower(table, tokens).compile()
  grad = compiled(table, tokens)
  assert grad[0, 0] == 8 * 4 and grad[1, 0] == 0
  found = _collectives(compiled, mesh)
  assert not _rows_whole(found), found
  whole_table = [c for c in found if c[1] == "f32[16,8]"]
  assert whole_table == ([("all-reduce", "f32[16,8]", BATCH)] if grad_layout else []), found
  warned = "Involuntary full rematerialization" in capfd.readouterr().err
  assert warned == (XLA_WARNS_OF_WEIGHED_RESHARDS and not grad_layout)


def test_the_rows_pattern_matches_the_reshard_that_xla_weighs(mesh):
  """The negative control of the test above: the reshard itself, rows split over the batch
  axes moved onto the table's embed split, gathers the rows whole, and `_rows_whole` sees it."""
  rows = jax.ShapeDtypeStruct((8, 4, 8), jnp.float32, sharding=NamedSharding(mesh, P(BATCH)))
  moved = jax.jit(lambda r: r * 2, out_shardings=NamedSharding(mesh, P(None, None, "fsdp")))
  found = _collectives(moved.lower(rows).compile(), mesh)
  assert _rows_whole(found), found


def test_activation_rules_entered_while_tracing(mesh):
  # How the train step uses it: the block is entered inside the jitted function.
  def step(x):
    with activation_rules(Rules.preset("tp"), mesh):
      return constrain(x + 1, AXES)

  y = jax.jit(step)(jnp.ones((8, 4, 6)))
  assert y.sharding.is_equivalent_to(NamedSharding(mesh, P(BATCH, None, "tensor")), y.ndim)


def test_jitted_function_is_retraced_when_rules_change(mesh):
  # The jit cache must not hand back a trace made under other (or no) rules.
  step = jax.jit(_double_and_constrain)
  x = jnp.ones((8, 4, 6))
  assert len(step(x).sharding.device_set) == 1
  with activation_rules(Rules.preset("fsdp_tp"), mesh):
    y = step(x)
  assert y.sharding.is_equivalent_to(NamedSharding(mesh, P(BATCH, None, "tensor")), y.ndim)
  with activation_rules(Rules.preset("dp"), mesh):
    y = step(x)
  assert y.sharding.is_equivalent_to(NamedSharding(mesh, P(BATCH)), y.ndim)
  assert len(step(x).sharding.device_set) == 1


def test_activation_rules_reset_after_an_exception(mesh):
  x = jnp.ones((8, 4, 6))
  with pytest.raises(RuntimeError):
    with activation_rules(Rules.preset("tp"), mesh):
      raise RuntimeError("boom")
  assert constrain(x, AXES) is x


def test_constrain_checks_the_shape_inside_activation_rules(mesh):
  with activation_rules(Rules.preset("tp"), mesh):
    with pytest.raises(ShardingError, match=r"activation: dimension 2 \(mlp\) has size 5"):
      jax.jit(lambda x: constrain(x, AXES))(jnp.ones((8, 4, 5)))
