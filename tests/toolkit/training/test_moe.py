"""A Mixtral-style LM with expert parallelism: the training loss and gradients on meshes with an
`expert` axis equal one device's, expert weights stay split (at rest and in the compiled
program, with a negative control for the pattern that looks for their gathers), the expert
axis really splits the work, and the layout mistakes are refused. That a tiny MoE learns the
stdlib docs with its experts in use, the result experiments/moe.py and docs/moe.md state, is
tests/test_documented_results.py's."""
from __future__ import annotations

import dataclasses
import math
import re

import jax
import numpy as np
import pytest

import sharding
from experiments import moe as moe_experiment
from models import moe
from tests.tiny_runs import TOLERANCE, assert_trees_close
from toolkit import training
from toolkit.errors import ConfigError
from toolkit.training import state as state_lib, step as step_lib

EXPERT_WEIGHTS = ("w_gate", "w_up", "w_down")


def tiny(ici: str = "data:1", preset: str = "dp", **model):
  config = moe_experiment.get_config("tiny")
  config.mesh.ici, config.sharding.preset = ici, preset
  config.model.update(model)
  return config


@dataclasses.dataclass
class Compiled:
  """One batch's loss, metrics and gradients from a compiled `loss_and_grads` on a mesh."""
  setup: training.Setup
  params: dict
  loss: float
  metrics: dict
  grads: dict
  program: jax.stages.Compiled
  shapes: list = dataclasses.field(default_factory=list)  # (rows, expert weight) per ragged dot


def compile_loss_and_grads(config, params_host, devices=None) -> Compiled:
  setup = training.build(config, devices)
  mesh, rules, graphdef = setup.spec.mesh, setup.spec.rules, setup.layout.graphdef
  params = jax.device_put(params_host, setup.layout.shardings["params"])
  batch = setup.batches.batch(0)

  def loss_and_grads(params, batch):
    with sharding.activation_rules(rules, mesh):
      return step_lib.loss_and_grads(lambda p, b: step_lib.lm_loss(graphdef, p, b), params,
                                     batch, 1)

  program = jax.jit(loss_and_grads).lower(params, batch).compile()
  (loss, metrics), grads = jax.device_get(program(params, batch))
  return Compiled(setup, params, float(loss), metrics, grads, program)


@pytest.fixture(scope="module")
def initial_params():
  """The tiny MoE's initial parameters on the host (the same for every mesh and mode)."""
  config = tiny()
  setup = training.build(config, jax.devices()[:1])
  state = state_lib.create(setup.spec.model, setup.optimizer, setup.layout, config.seed)
  return jax.device_get(state["params"])


@pytest.fixture(scope="module")
def compiled(initial_params):
  """(mesh, preset, mode) -> Compiled, each compiled once for this module; mesh None is the
  reference on one device. Records the shapes the per-device expert code saw (`shapes`)."""
  cache = {}

  def get(ici: str | None, preset: str = "dp", mode: str = "dropless") -> Compiled:
    key = (ici, preset, mode)
    if key not in cache:
      seen = []
      grouped = moe.grouped_swiglu

      def recording(rows, group_sizes, *weights):
        seen.append((rows.shape, weights[0].shape))
        return grouped(rows, group_sizes, *weights)

      with pytest.MonkeyPatch.context() as patch:
        patch.setattr(moe, "grouped_swiglu", recording)
        cache[key] = compile_loss_and_grads(
            tiny(ici or "data:1", preset, moe_dispatch=mode), initial_params,
            jax.devices()[:1] if ici is None else None)
      cache[key].shapes = seen
    return cache[key]
  return get


def full_expert_all_gathers(hlo: str, cfg) -> list[str]:
  """All-gathers whose result has the shape of an expert weight with every expert in it (an
  (E, d, m') or (E, m', d) array, possibly with a leading layers axis): the expert axis undone."""
  e, d = cfg.n_experts, cfg.d_model
  found = []
  for line in hlo.splitlines():
    match = re.search(r"=\s*\(?[a-z0-9]+\[([\d,]+)\][^=]*\ball-gather(?:-start)?\(", line)
    if not match:
      continue
    dims = [int(x) for x in match.group(1).split(",")]
    for i in range(len(dims) - 2):
      if dims[i] == e and d in (dims[i + 1], dims[i + 2]) and len(dims) - i == 3:
        found.append(line.strip()[:160])
  return found


# The layer alone on every mesh in every mode is tests/models/test_moe.py's (against a loop).
MESHES = [("expert:8", "fsdp_ep", "dropless"),
          pytest.param("data:2,expert:4", "fsdp_ep", "dropless", marks=pytest.mark.slow),
          ("fsdp:2,expert:2,tensor:2", "fsdp_tp_ep", "dropless"),
          pytest.param("fsdp:2,expert:2,tensor:2", "fsdp_tp_ep", "capacity",
                       marks=pytest.mark.slow)]


@pytest.mark.parametrize("ici, preset, mode", MESHES)
def test_split_over_experts_equals_one_device(compiled, ici, preset, mode):
  sharded, reference = compiled(ici, preset, mode), compiled(None, mode=mode)
  np.testing.assert_allclose(sharded.loss, reference.loss, **TOLERANCE)
  assert_trees_close(sharded.metrics, reference.metrics, **TOLERANCE)
  assert_trees_close(sharded.grads, reference.grads, **TOLERANCE)
  assert sharded.metrics["load_balance_loss"] > 0.9   # the router losses are really there
  # Expert weights at rest: each device holds 1/EP of the experts (times what fsdp and tensor
  # split of each expert), and the compiled program never gathers them back over `expert`.
  mesh, cfg = sharded.setup.spec.mesh, sharded.setup.spec.model
  for name in EXPERT_WEIGHTS:
    weight = sharded.params["layers"]["mlp"][name]
    spec = weight.sharding.spec
    assert spec[1] == "expert", (name, spec)
    ways = math.prod(mesh.shape[a] for entry in spec if entry
                     for a in ((entry,) if isinstance(entry, str) else entry))
    per_device = weight.addressable_shards[0].data.nbytes
    assert per_device == weight.nbytes // ways
    if set(mesh.shape) <= {"data", "expert"}:
      assert per_device == weight.nbytes // mesh.shape["expert"]
  assert not full_expert_all_gathers(sharded.program.as_text(), cfg)


def test_the_all_gather_pattern_finds_expert_weights_gathered_over_expert(compiled):
  """The negative control of `full_expert_all_gathers`: the same loss and gradients on
  expert:8, compiled with the expert weights first constrained to be replicated (every
  device gathers all 8 experts: what the fsdp_ep rules prevent), and the pattern must find
  those all-gathers; without the constraint it finds none."""
  sharded = compiled("expert:8", "fsdp_ep")
  setup, cfg = sharded.setup, sharded.setup.spec.model
  mesh, rules, graphdef = setup.spec.mesh, setup.spec.rules, setup.layout.graphdef
  replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())

  def gathered_loss_and_grads(params, batch):
    mlp = params["layers"]["mlp"]
    params = {**params, "layers": {**params["layers"], "mlp": {
        **mlp, **{name: jax.lax.with_sharding_constraint(mlp[name], replicated)
                  for name in EXPERT_WEIGHTS}}}}
    with sharding.activation_rules(rules, mesh):
      return step_lib.loss_and_grads(lambda p, b: step_lib.lm_loss(graphdef, p, b), params,
                                     batch, 1)

  batch = setup.batches.batch(0)
  hlo = jax.jit(gathered_loss_and_grads).lower(sharded.params, batch).compile().as_text()
  found = full_expert_all_gathers(hlo, cfg)
  assert found, "the pattern missed expert weights all-gathered over `expert`"
  assert not full_expert_all_gathers(sharded.program.as_text(), cfg)


def test_expert_axis_alone_really_splits_the_moe_work(compiled):
  """The silent-replication slip: with `expert` the only axis, the experts and their tokens
  must be split 8 ways, not run whole on every device."""
  with pytest.raises(ConfigError, match="does not split the experts"):
    training.build(tiny("expert:8", "fsdp"))             # the slip itself is refused
  sharded, reference = compiled("expert:8", "fsdp_ep"), compiled(None)
  cfg, tokens = sharded.setup.spec.model, 16 * 32                 # the tiny batch
  # Inside the per-device code each device runs 1 of the 8 experts (E/8) on the tokens
  # routed to it, out of all tokens gathered from the 8 devices (the ring's exchange); one
  # device alone runs all 8 on its own tokens.
  assert sharded.shapes and all(w == (1, cfg.d_model, cfg.mlp_dim) for _, w in sharded.shapes)
  assert all(r == (tokens * cfg.experts_per_token, cfg.d_model) for r, _ in sharded.shapes)
  assert all(w == (8, cfg.d_model, cfg.mlp_dim) for _, w in reference.shapes)
  # And the compiled step does about 1/8 of one device's arithmetic on each device.
  flops = lambda c: c.program.cost_analysis()["flops"]
  assert flops(sharded) < 0.2 * flops(reference)


def test_chunked_vocabulary_loss_adds_the_router_losses(initial_params):
  """The MoE trains on the chunked vocabulary loss (toolkit.training.objectives.losses) plus its router
  losses: in chunks of 2 positions, on one device and split over expert:8, the loss, router
  metrics and gradients equal those over full logits on one device, and the loss is the
  cross-entropy plus the weighted router losses."""
  full = compile_loss_and_grads(tiny(loss_chunk=0), initial_params, jax.devices()[:1])
  for ici, preset, rows in (("data:1", "dp", 16), ("expert:8", "fsdp_ep", 2)):
    chunked = compile_loss_and_grads(tiny(ici, preset, loss_chunk=2 * rows), initial_params,
                                     jax.devices()[:1] if ici == "data:1" else None)
    np.testing.assert_allclose(chunked.loss, full.loss, **TOLERANCE)
    assert_trees_close(chunked.metrics, full.metrics, **TOLERANCE)
    assert_trees_close(chunked.grads, full.grads, **TOLERANCE)
  graphdef = full.setup.layout.graphdef
  cross_entropy = jax.jit(lambda p, b: step_lib.cross_entropy_loss(graphdef, p, b))(
      full.params, full.setup.batches.batch(0))
  assert full.metrics["aux_loss"] > 0.009   # 0.01 x a load-balance loss near 1
  np.testing.assert_allclose(full.loss, cross_entropy + full.metrics["aux_loss"], **TOLERANCE)


@pytest.mark.parametrize("ici, preset, overrides, fragments", [
    ("fsdp:2,expert:4", "fsdp_ep", dict(n_experts=6),
     ["model.n_experts=6", "expert=4", "use a multiple of 4 experts"]),
    ("fsdp:1,expert:8", "fsdp_tp", dict(),
     ["mesh has expert=8", "sharding.preset='fsdp_tp'", "use sharding.preset=fsdp_ep"]),
    ("fsdp:2,expert:4", "fsdp_ep", dict(expert_exchange="ragged_all_to_all"),
     ["model.expert_exchange='ragged_all_to_all'", "XLA:CPU", "use model.expert_exchange=ring"]),
    ("fsdp:2,expert:4", "fsdp_ep", dict(experts_per_token=9),
     ["model.experts_per_token=9", "model.n_experts=8"]),
    ("fsdp:2,expert:4", "fsdp_ep", dict(moe_dispatch="nosuch"),
     ["model.moe_dispatch='nosuch'", "'dropless' or 'capacity'"]),
])
def test_moe_layout_mistakes_name_the_field_and_the_fix(ici, preset, overrides, fragments):
  with pytest.raises(ConfigError) as raised:
    training.build(tiny(ici, preset, **overrides))
  for fragment in fragments:
    assert fragment in str(raised.value), str(raised.value)

