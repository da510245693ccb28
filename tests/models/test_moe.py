"""The mixture-of-experts layer against a plain loop over experts: both dispatch modes, values
and gradients, on one device and split over the `expert` axis; capacity, dropped tokens,
empty experts, the router losses and the config's checks."""
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import sharding
from models import LlamaConfig, moe
from models.llama import MLP
from tests.tiny_runs import TOLERANCE, assert_trees_close

CFG = LlamaConfig.preset("moe_tiny")        # d_model 32, 8 experts of width 32, 2 per token
BATCH, LENGTH = 8, 16

# (mesh, rules preset) with experts split: expert alone, beside data, beside fsdp and tensor.
MESHES = [("expert:8", "fsdp_ep"), ("data:2,expert:4", "fsdp_ep"),
          ("fsdp:2,expert:2,tensor:2", "fsdp_tp_ep")]


def init(make):
  """(graphdef, parameters) of the module `make()` builds, created in one compiled program
  (created eagerly, each random draw would compile and run on its own: seconds)."""
  graphdef, _ = nnx.split(nnx.eval_shape(make))
  return graphdef, jax.jit(lambda: nnx.to_pure_dict(nnx.state(make(), nnx.Param)))()


@functools.cache
def _layer_params(seed: int):
  return init(lambda: moe.MoE(CFG, nnx.Rngs(params=seed)))[1]


def layer_and_input(seed: int = 0, **overrides):
  """A layer's config, graphdef and parameters (the same for every dispatch mode), and x."""
  cfg = dataclasses.replace(CFG, **overrides)
  graphdef, _ = nnx.split(nnx.eval_shape(lambda: moe.MoE(cfg, nnx.Rngs(params=seed))))
  x = jax.random.normal(jax.random.key(seed + 1), (BATCH, LENGTH, cfg.d_model))
  return cfg, graphdef, dict(_layer_params(seed)), x


# --- the reference: a plain loop over experts ---------------------------------------------------

def reference_routing(params, x, k):
  """Softmax, top-k by sorting, renormalized: written independently of models/moe.py."""
  logits = x @ params["router"]
  probs = jnp.exp(logits - logits.max(-1, keepdims=True))
  probs = probs / probs.sum(-1, keepdims=True)
  experts = jnp.argsort(-probs, axis=-1)[..., :k]
  chosen = jnp.take_along_axis(probs, experts, axis=-1)
  return experts, chosen / chosen.sum(-1, keepdims=True)


def reference_kept(experts: np.ndarray, n_experts: int, capacity: int | None) -> np.ndarray:
  """Which assignments fit, by a loop: per sequence, first choices before second choices,
  earlier tokens first, each expert taking at most `capacity`; None keeps everything."""
  kept = np.ones(experts.shape, bool)
  if capacity is None:
    return kept
  for b in range(experts.shape[0]):
    used = [0] * n_experts
    for choice in range(experts.shape[2]):
      for t in range(experts.shape[1]):
        e = int(experts[b, t, choice])
        kept[b, t, choice] = used[e] < capacity
        used[e] += 1
  return kept


def reference_moe(params, x, cfg, kept):
  """Every token through every expert; each expert's output weighted by the router where the
  token chose it and the assignment was `kept` (B, L, k)."""
  experts, weights = reference_routing(params, x, cfg.experts_per_token)
  out = jnp.zeros_like(x)
  for e in range(cfg.n_experts):
    hidden = jax.nn.silu(x @ params["w_gate"][e]) * (x @ params["w_up"][e])
    weight = jnp.sum(jnp.where((experts == e) & kept, weights, 0.0), axis=-1)
    out = out + weight[..., None] * (hidden @ params["w_down"][e])
  return out


def reference_value_and_grads(params, x, cfg):
  """The loop's output and the gradient of `objective` w.r.t. (params, x); the assignments
  kept come from `reference_kept` with the layer's capacity."""
  experts, _ = jax.jit(reference_routing, static_argnums=2)(params, x, cfg.experts_per_token)
  kept = reference_kept(np.asarray(experts), cfg.n_experts, capacity_of(cfg))
  forward = lambda p, x: reference_moe(p, x, cfg, kept)
  loss = lambda p, x: objective(forward(p, x))
  return jax.jit(forward)(params, x), jax.jit(jax.grad(loss, argnums=(0, 1)))(params, x)


def capacity_of(cfg) -> int | None:
  if cfg.moe_dispatch == "dropless":
    return None
  return moe.capacity(LENGTH, cfg.experts_per_token, cfg.n_experts, cfg.capacity_factor)


# --- running the layer --------------------------------------------------------------------------

PROBE = jax.random.normal(jax.random.key(99), (BATCH, LENGTH, CFG.d_model))


def objective(output):
  return jnp.sum(output * PROBE)  # a loss whose gradient reaches every output element


def layer_fn(graphdef):
  def apply(params, x):
    out, stats = moe.capture_router_stats(lambda layer, x: layer(x), nnx.merge(graphdef, params),
                                          x)
    return out, stats[0]
  return apply


def value_and_grads(graphdef, params, x, ici=None, preset=None):
  """The layer's output, router stats and the gradient of `objective` w.r.t. (params, x), on
  one device or on a mesh under `preset`'s rules."""
  apply = layer_fn(graphdef)

  def loss(params, x):
    out, stats = apply(params, x)
    return objective(out), (out, stats)

  def run(params, x):
    (_, (out, stats)), grads = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(params, x)
    return out, stats, grads

  if ici is None:
    return jax.jit(run)(params, x)
  mesh = sharding.make_mesh(sharding.parse_axis_sizes(ici, "mesh.ici"))
  rules = sharding.Rules.preset(preset)

  def sharded(params, x):
    with sharding.activation_rules(rules, mesh):
      return run(params, x)

  return jax.jit(sharded)(params, x)


def emulated_ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets,
                               recv_sizes, *, axis_name):
  """`jax.lax.ragged_all_to_all`'s documented semantics built from all-gathers, for XLA:CPU,
  which lacks the real one: each source's slice for this device lands at the offset the
  source names."""
  del recv_sizes  # implied by the senders' send_sizes
  me = jax.lax.axis_index(axis_name)
  operands = jax.lax.all_gather(operand, axis_name)              # (sources, rows, ...)
  starts = jax.lax.all_gather(input_offsets, axis_name)[:, me]
  sizes = jax.lax.all_gather(send_sizes, axis_name)[:, me]
  at = jax.lax.all_gather(output_offsets, axis_name)[:, me]
  rows = jnp.arange(output.shape[0])
  for source in range(operands.shape[0]):
    inside = (rows >= at[source]) & (rows < at[source] + sizes[source])
    index = jnp.clip(rows - at[source] + starts[source], 0, operand.shape[0] - 1)
    output = jnp.where(inside[:, None], operands[source][index], output)
  return output


@pytest.fixture
def emulated_exchange(monkeypatch):
  """The ragged_all_to_all variant with the emulated collective (the real one is proven by a
  TPU compile, tests/toolkit/planning/test_compile.py)."""
  monkeypatch.setattr(moe, "all_to_all_per_device", functools.partial(
      moe.all_to_all_per_device, exchange=emulated_ragged_all_to_all))


# --- equal to the loop --------------------------------------------------------------------------

MODES = {"dropless": dict(moe_dispatch="dropless"),
         # capacity factor 1: 4 slots per expert and sequence of 16, so some are dropped
         "capacity": dict(moe_dispatch="capacity", capacity_factor=1.0)}


@pytest.mark.parametrize("mode", MODES)
def test_one_device_equals_a_loop_over_experts(mode):
  cfg, graphdef, params, x = layer_and_input(**MODES[mode])
  out, stats, grads = value_and_grads(graphdef, params, x)
  ref_out, ref_grads = reference_value_and_grads(params, x, cfg)
  np.testing.assert_allclose(out, ref_out, **TOLERANCE)
  assert_trees_close(grads, ref_grads, **TOLERANCE)
  if mode == "capacity":  # the check means more when some assignments were dropped
    assert 0.05 < float(stats["dropped_fraction"]) < 0.5


# The layer alone, every mode on every mesh; the default tier runs each mode on one mesh
# (dropless on expert:8 and fsdp:2,expert:2,tensor:2 is the full model's test in
# tests/toolkit/training/test_moe.py), the rest is slow.
_DEFAULT = {("capacity", "fsdp:2,expert:2,tensor:2"),
            ("ragged_all_to_all", "fsdp:2,expert:2,tensor:2"), ("dropless", "data:2,expert:4")}
_SPLIT = [pytest.param(mode, ici, preset,
                       marks=() if (mode, ici) in _DEFAULT else pytest.mark.slow)
          for mode in (*MODES, "ragged_all_to_all") for ici, preset in MESHES]


@pytest.mark.parametrize("mode, ici, preset", _SPLIT)
def test_split_over_experts_equals_a_loop_over_experts(mode, ici, preset, request):
  overrides = MODES.get(mode, dict(moe_dispatch="dropless", expert_exchange=mode))
  if mode == "ragged_all_to_all":
    request.getfixturevalue("emulated_exchange")
  cfg, graphdef, params, x = layer_and_input(**overrides)
  out, _, grads = value_and_grads(graphdef, params, x, ici, preset)
  ref_out, ref_grads = reference_value_and_grads(params, x, cfg)
  np.testing.assert_allclose(out, ref_out, **TOLERANCE)
  assert_trees_close(grads, ref_grads, **TOLERANCE)


def test_capacity_factor_of_experts_over_k_drops_nothing():
  factor = CFG.n_experts / CFG.experts_per_token
  cfg, graphdef, params, x = layer_and_input(moe_dispatch="capacity", capacity_factor=factor)
  assert moe.capacity(LENGTH, cfg.experts_per_token, cfg.n_experts, factor) == LENGTH
  out, stats, _ = value_and_grads(graphdef, params, x)
  dropless, _, _ = value_and_grads(*layer_and_input()[1:3], x)
  assert float(stats["dropped_fraction"]) == 0.0
  np.testing.assert_allclose(out, dropless, **TOLERANCE)


@pytest.mark.parametrize("mode", [pytest.param("dropless"),
                                  pytest.param("capacity", marks=pytest.mark.slow)])
def test_one_ffn_copied_into_every_expert_is_the_dense_ffn(mode):
  overrides = dict(MODES[mode], capacity_factor=CFG.n_experts / CFG.experts_per_token)
  cfg, graphdef, params, x = layer_and_input(**overrides)
  dense_graphdef, dense = init(lambda: MLP(cfg, nnx.Rngs(params=7)))
  for name in ("w_gate", "w_up", "w_down"):
    params[name] = jnp.broadcast_to(dense[name], params[name].shape)
  out, _, _ = value_and_grads(graphdef, params, x)
  np.testing.assert_allclose(out, nnx.merge(dense_graphdef, dense)(x), **TOLERANCE)


# --- dropping, empty experts, the router losses ---------------------------------------------------

@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("ici, preset", [pytest.param(None, None, marks=pytest.mark.slow),
                                         MESHES[0]])
def test_an_expert_without_tokens_gets_exactly_zero_gradient(mode, ici, preset):
  cfg, graphdef, params, x = layer_and_input(**MODES[mode])
  x = x.at[..., 0].set(jnp.abs(x[..., 0]) + 1.0)
  params["router"] = params["router"].at[:, 3].set(0.0).at[0, 3].set(-100.0)  # nobody picks 3
  out, stats, (grads, _) = value_and_grads(graphdef, params, x, ici, preset)
  assert float(stats["expert_load"][3]) == 0.0
  for name in ("w_gate", "w_up", "w_down"):
    assert not np.any(np.asarray(grads[name][3])), name        # exactly 0, not merely small
    assert np.any(np.asarray(grads[name][0])), name            # the others do learn


def test_capacity_factor_1_keeps_exactly_capacity_when_every_token_picks_expert_0():
  cfg, graphdef, params, x = layer_and_input(moe_dispatch="capacity", capacity_factor=1.0)
  x = x.at[..., 0].set(jnp.abs(x[..., 0]) + 1.0)
  params["router"] = params["router"].at[:, 0].set(0.0).at[0, 0].set(100.0)  # expert 0 first
  slots = moe.capacity(LENGTH, 2, 8, 1.0)
  assert slots == 4
  routing = moe.route(x @ params["router"], cfg.experts_per_token)
  assert np.all(np.asarray(routing.experts[..., 0]) == 0)
  slot, keep = moe.capacity_slots(routing.experts, cfg.n_experts, slots)
  kept_at_0 = np.sum(np.asarray(keep) & (np.asarray(routing.experts) == 0), axis=(1, 2))
  np.testing.assert_array_equal(kept_at_0, slots)             # per sequence, exactly capacity
  # The first `capacity` tokens of each sequence keep expert 0, in order.
  np.testing.assert_array_equal(np.asarray(keep)[:, :slots, 0], True)
  np.testing.assert_array_equal(np.asarray(slot)[0, :, 0], np.arange(LENGTH))
  # The layer agrees: what it drops is what the loop drops, and it reports it.
  out, stats, _ = value_and_grads(graphdef, params, x)
  np.testing.assert_allclose(out, reference_value_and_grads(params, x, cfg)[0], **TOLERANCE)
  kept = reference_kept(np.asarray(routing.experts), cfg.n_experts, slots)
  assert float(stats["dropped_fraction"]) == pytest.approx(1 - kept.mean())


def test_load_balance_loss_is_1_when_uniform_and_e_when_collapsed():
  e, tokens = CFG.n_experts, 64
  uniform = jnp.full((tokens, e), 1.0 / e)
  for k in (1, 2):
    spread = (jnp.arange(tokens * k) % e).reshape(tokens, k)
    assert float(moe.load_balance_loss(uniform, spread)) == pytest.approx(1.0)
    # Uniform probabilities: 1 however the choices fall (the loss sees the router through P).
    piled = jnp.broadcast_to(jnp.arange(k), (tokens, k))
    assert float(moe.load_balance_loss(uniform, piled)) == pytest.approx(1.0)
  # Collapsed: every token to expert 0 with probability 1 (top-1) gives E; with k = 2 the
  # second choice must go elsewhere, so a router collapsed onto two experts gives E / 2.
  collapsed = jax.nn.one_hot(jnp.zeros(tokens, int), e)
  assert float(moe.load_balance_loss(collapsed, jnp.zeros((tokens, 1), int))) == pytest.approx(e)
  onto_two = jnp.broadcast_to(jnp.arange(2), (tokens, 2))
  assert float(moe.load_balance_loss(collapsed, onto_two)) == pytest.approx(e / 2)
  # The z-loss of all-zero logits is log(E)^2.
  assert float(moe.router_z_loss(jnp.zeros((tokens, e)))) == pytest.approx(np.log(e) ** 2)


def test_every_nth_layer_moe_has_dense_layers_between():
  from models import Llama  # pylint: disable=g-import-not-at-top
  cfg = dataclasses.replace(CFG, n_layers=4, moe_every=2)
  graphdef, abstract = nnx.split(nnx.eval_shape(lambda: Llama(cfg, rngs=nnx.Rngs(params=0))))
  rng = np.random.default_rng(0)  # any values do for the structure and the forward pass
  params = jax.tree.map(lambda a: 0.02 * rng.standard_normal(a.shape, np.float32),
                        nnx.to_pure_dict(abstract))
  blocks = params["layers"]["blocks"]
  assert set(blocks[0]["mlp"]) == {"w_gate", "w_up", "w_down"}              # dense
  assert blocks[1]["mlp"]["w_gate"].shape == (2, 8, 32, 32)               # 2 groups x MoE
  tokens = jnp.zeros((2, 8), jnp.int32)
  forward = jax.jit(lambda p, t: nnx.merge(graphdef, p).logits_and_aux(t))
  _, aux_loss, metrics = forward(params, tokens)
  assert float(aux_loss) > 0 and set(metrics) >= {"load_balance_loss", "expert_load_min"}
  assert cfg.num_params() == sum(a.size for a in jax.tree.leaves(params))


@pytest.mark.parametrize("overrides, fragments", [
    (dict(experts_per_token=9), ["model.experts_per_token=9", "model.n_experts=8",
                                 "between 1 and"]),
    (dict(moe_dispatch="nosuch"), ["model.moe_dispatch='nosuch'", "'dropless' or 'capacity'"]),
    (dict(expert_exchange="nosuch"), ["model.expert_exchange='nosuch'", "'ring'"]),
    (dict(moe_every=3), ["model.moe_every=3", "divide model.n_layers=2"]),
    (dict(capacity_factor=0.0), ["model.capacity_factor=0.0", "4 (= n_experts"]),
])
def test_bad_moe_fields_name_the_field_and_the_fix(overrides, fragments):
  with pytest.raises(ValueError) as raised:
    dataclasses.replace(CFG, **overrides).validate()
  for fragment in fragments:
    assert fragment in str(raised.value), str(raised.value)
