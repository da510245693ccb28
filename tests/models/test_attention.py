"""Attention implementations (models.attention) against the XLA reference: outputs and
dq/dk/dv, on one device and sharded; the selection `auto` makes; splash in Pallas interpret
mode (the kernel's own code, run by the interpreter on CPU)."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding

import sharding
from models import Llama, LlamaConfig
from models import attention
from tests import extras
from tests.tiny_runs import TOLERANCE, assert_trees_close, tiny_config, train_steps
from toolkit.training import step as step_lib


def _inputs(batch, q_length, kv_length, heads, kv_heads, head_dim, seed=0):
  keys = jax.random.split(jax.random.key(seed), 4)
  q = jax.random.normal(keys[0], (batch, q_length, heads, head_dim))
  k = jax.random.normal(keys[1], (batch, kv_length, kv_heads, head_dim))
  v = jax.random.normal(keys[2], (batch, kv_length, kv_heads, head_dim))
  weights = jax.random.normal(keys[3], (batch, q_length, heads, head_dim))
  return q, k, v, weights


def _value_and_grads(fn, q, k, v, weights):
  """The output and d(sum(output * weights))/d(q, k, v): a cotangent that differs per element;
  jitted (eager loops would dispatch op by op)."""
  @jax.jit
  def run(q, k, v, weights):
    loss = lambda q, k, v: jnp.sum(fn(q, k, v) * weights)
    return fn(q, k, v), jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
  return run(q, k, v, weights)


def _assert_same(actual, expected):
  """Within the project's float32 TOLERANCE, each array measured in units of its reference's
  largest magnitude: the tolerance's atol is meant for values of order 1 (the tiny model's),
  and gradients here sum hundreds of terms (|dv| up to ~15)."""
  (out_a, grads_a), (out_e, grads_e) = actual, expected
  for name, a, e in zip(("output", "dq", "dk", "dv"), (out_a, *grads_a), (out_e, *grads_e)):
    scale = float(np.max(np.abs(e)))
    np.testing.assert_allclose(np.asarray(a) / scale, np.asarray(e) / scale, **TOLERANCE,
                               err_msg=name)


# (batch, q_length, kv_length, heads, kv_heads, head_dim, causal, block): lengths that are not
# multiples of the block, grouped-query heads, several blocks on both sides, keys != queries.
CASES = [
    (2, 37, 37, 4, 2, 8, True, 16),
    (2, 37, 37, 4, 2, 8, False, 16),
    (1, 64, 64, 4, 4, 8, True, 16),
    (2, 20, 45, 4, 1, 8, False, 16),
    (2, 45, 20, 6, 2, 8, True, 8),
    (2, 16, 16, 2, 2, 8, True, 64),   # one block, bigger than the input
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "x".join(map(str, c[:6])) + f"-causal{c[6]}")
def test_blockwise_equals_xla(case):
  *shape, causal, block = case
  q, k, v, weights = _inputs(*shape)
  expected = _value_and_grads(lambda q, k, v: attention.xla(q, k, v, causal), q, k, v, weights)
  actual = _value_and_grads(lambda q, k, v: attention.blockwise(q, k, v, causal, block),
                            q, k, v, weights)
  _assert_same(actual, expected)


@pytest.mark.parametrize("implementation", ["blockwise", "splash"])
def test_sharded_equals_unsharded(implementation, monkeypatch):
  """Under fsdp_tp rules on fsdp 4 x tensor 2 (batch split 4 ways, heads 2 ways), jitted."""
  monkeypatch.setattr(attention, "BLOCK", 64)  # several blocks for blockwise
  q, k, v, weights = _inputs(4, 128, 128, 4, 2, 16, seed=1)
  causal = True
  expected = _value_and_grads(lambda q, k, v: attention.xla(q, k, v, causal), q, k, v, weights)
  mesh = sharding.make_mesh([("fsdp", 4), ("tensor", 2)])
  rules = sharding.Rules.preset("fsdp_tp")
  placed = [jax.device_put(x, NamedSharding(mesh, rules.activation_spec(axes, mesh)))
            for x, axes in zip((q, k, v, weights), [("batch", "length", "heads", None),
                                                    ("batch", "length", "kv_heads", None),
                                                    ("batch", "length", "kv_heads", None),
                                                    ("batch", "length", "heads", None)])]

  def sharded(q, k, v):
    with sharding.activation_rules(rules, mesh):
      return attention.attend(q, k, v, causal, implementation)

  _assert_same(_value_and_grads(sharded, *placed), expected)


@pytest.mark.parametrize("causal", [True, False])
def test_splash_in_interpret_mode_equals_xla(causal):
  """The Pallas splash kernel, interpreted on CPU: grouped-query heads, two 128-blocks."""
  q, k, v, weights = _inputs(2, 256, 256, 4, 2, 32, seed=2)
  expected = _value_and_grads(lambda q, k, v: attention.xla(q, k, v, causal), q, k, v, weights)
  actual = _value_and_grads(lambda q, k, v: attention.splash(q, k, v, causal), q, k, v, weights)
  _assert_same(actual, expected)


def test_blockwise_model_loss_and_gradients_equal_xla(monkeypatch):
  """The tiny LM's training loss and its gradient with respect to every parameter: one step's
  worth of what the 10-step test below trains on (the default suite's short variant)."""
  monkeypatch.setattr(attention, "BLOCK", 8)  # sequences of 32: four blocks
  tokens = jax.random.randint(jax.random.key(3), (4, 33), 0, 256)
  batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
  runs = {}
  for implementation in ("xla", "blockwise"):
    cfg = LlamaConfig.preset("tiny", init_std=0.2, attention=implementation)
    graphdef, params = nnx.split(Llama(cfg, rngs=nnx.Rngs(params=0)))
    loss = lambda p, graphdef=graphdef: step_lib.lm_loss(graphdef, p, batch)[0]
    runs[implementation] = jax.jit(jax.value_and_grad(loss))(params)
  np.testing.assert_allclose(runs["blockwise"][0], runs["xla"][0], **TOLERANCE)
  assert_trees_close(runs["blockwise"][1], runs["xla"][1], **TOLERANCE)


@pytest.mark.slow  # ~76 s on 2 busy cores; the test above is its short variant
def test_blockwise_training_equals_xla_over_10_steps(monkeypatch):
  """The tiny LM on fsdp 4 x tensor 2: 10 steps of losses and the final parameters."""
  monkeypatch.setattr(attention, "BLOCK", 8)  # sequences of 32: four blocks
  runs = {}
  for implementation in ("xla", "blockwise"):
    config = tiny_config(steps=10)
    config.model.attention = implementation
    losses, params, _ = train_steps(config)
    runs[implementation] = losses, params
  np.testing.assert_allclose(runs["blockwise"][0], runs["xla"][0], **TOLERANCE)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, **TOLERANCE), runs["blockwise"][1],
               runs["xla"][1])


@pytest.mark.parametrize("platform,dtype,head_dim,length,expected", [
    ("tpu", jnp.bfloat16, 128, 4096, "splash"),
    ("tpu", jnp.float32, 64, attention.SPLASH_FROM, "splash"),
    ("tpu", jnp.float32, 64, attention.SPLASH_FROM - 128, "xla"),  # short: the scores are cheaper
    ("tpu", jnp.bfloat16, 128, 1000, "xla"),         # not a multiple of 128: no splash
    ("tpu", jnp.bfloat16, 128, 2000, "blockwise"),
    ("gpu", jnp.bfloat16, 128, 4096, "cudnn"),
    ("gpu", jnp.float16, 64, 100, "cudnn"),
    ("gpu", jnp.float32, 128, 4096, "blockwise"),    # cuDNN takes 16-bit inputs only
    ("gpu", jnp.bfloat16, 256, 512, "xla"),          # head_dim above cuDNN's 128
    ("cpu", jnp.float32, 64, attention.BLOCKWISE_FROM - 1, "xla"),
    ("cpu", jnp.float32, 64, attention.BLOCKWISE_FROM, "blockwise"),
])
def test_auto_picks_by_platform_and_shape(platform, dtype, head_dim, length, expected):
  shape = (1, length, 8, head_dim)
  assert attention.resolve("auto", shape, shape, dtype, on=platform) == expected
  assert attention.resolve("xla", shape, shape, dtype, on=platform) == "xla"


# A shape every platform has its own pick for: splash on TPU, cudnn on GPU, blockwise on CPU.
LONG = (1, 4096, 8, 128)


def _auto_under(mesh) -> tuple[str, str]:
  """(platform, what "auto" resolves to) for LONG in bfloat16 under `mesh`'s activation rules,
  the platform left for `resolve` to find, as the model leaves it."""
  with sharding.activation_rules(sharding.Rules.preset("fsdp"), mesh):
    return attention.platform(), attention.resolve("auto", LONG, LONG, jnp.bfloat16)


class _FakeGpu:
  """Stands in for a GPU in a mesh: the selection only reads the devices' platform."""
  platform, device_kind = "gpu", "fake GPU"

  def __init__(self, index: int):
    self.id = index


def test_auto_follows_the_active_mesh_platform():
  """Compiling for another platform from a CPU host: the mesh's devices decide, not the
  host. Outside any mesh (and under a CPU mesh) it is the host's CPU; under a mesh of GPU
  devices, cudnn (a mesh of TPU devices: the tpu_aot test below)."""
  assert attention.platform() == "cpu"
  assert attention.resolve("auto", LONG, LONG, jnp.bfloat16) == "blockwise"
  assert _auto_under(sharding.make_mesh([("fsdp", 8)])) == ("cpu", "blockwise")
  gpus = jax.sharding.Mesh(np.array([_FakeGpu(i) for i in range(8)]), ("fsdp",))
  assert _auto_under(gpus) == ("gpu", "cudnn")
  assert attention.platform() == "cpu"  # the mesh's platform ends with its rules


@pytest.mark.tpu_aot
def test_auto_picks_splash_under_a_mesh_of_tpu_devices():
  """A mesh of a v5e-8's compile-only devices (libtpu, as toolkit.compile uses them)."""
  extras.require("libtpu")
  from toolkit.planning import target as target_lib  # pylint: disable=g-import-not-at-top
  target_lib.prepare_libtpu_environment()
  tpus = target_lib.target_for("v5litepod-8").devices
  assert _auto_under(sharding.make_mesh([("fsdp", 8)], devices=tpus)) == ("tpu", "splash")


def test_splash_refuses_lengths_it_cannot_tile():
  q, k, v, _ = _inputs(1, 100, 100, 2, 2, 8)
  with pytest.raises(ValueError, match="multiples of 128, not 100 queries"):
    attention.splash(q, k, v, True)


def test_model_attention_field_is_checked_and_used():
  cfg = LlamaConfig.preset("tiny")
  with pytest.raises(ValueError, match="model.attention='flash'; use one of auto, xla"):
    dataclasses.replace(cfg, attention="flash").validate()
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, 256, size=(2, 24)))
  logits = {}
  for implementation in ("xla", "blockwise"):
    model = Llama(dataclasses.replace(cfg, attention=implementation), rngs=nnx.Rngs(params=0))
    logits[implementation] = np.asarray(model(tokens))
  np.testing.assert_allclose(logits["blockwise"], logits["xla"], **TOLERANCE)
