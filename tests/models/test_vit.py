"""ViT: patches, bidirectional blocks shared with the LM, logical axes on every parameter,
sharded == unsharded training on every preset, and the ViT-B/16 shapes."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from experiments import vit as vit_experiment
from models import ViT, ViTConfig
from models.vit import patchify
from sharding.axes import LOGICAL_AXES
from tests import extras
from tests.tiny_runs import TOLERANCE, assert_trees_close, train_steps
from toolkit.training import state as state_lib, step as step_lib
from toolkit import training


def test_patchify_is_raster_order():
  images = np.arange(2 * 4 * 6 * 3, dtype=np.float32).reshape(2, 4, 6, 3)
  patches = np.asarray(patchify(jnp.asarray(images), 2))
  assert patches.shape == (2, 6, 12)
  for index, (row, col) in enumerate((r, c) for r in range(2) for c in range(3)):
    block = images[:, 2 * row:2 * row + 2, 2 * col:2 * col + 2]
    np.testing.assert_array_equal(patches[:, index], block.reshape(2, -1))


def _model(pool="gap"):
  cfg = ViTConfig.preset("tiny", pool=pool)
  model = ViT(cfg, rngs=nnx.Rngs(params=0))
  # The head starts at zero (every logit 0); give it weights to see the encoder through it.
  model.head[...] = jax.random.normal(jax.random.key(1), model.head[...].shape)
  return cfg, model


@pytest.mark.parametrize("pool", ["gap", "cls"])
def test_logits_and_bidirectional_attention(pool):
  cfg, model = _model(pool)
  images = jax.random.uniform(jax.random.key(2), (3, 8, 8, 1))
  logits = model(images)
  assert logits.shape == (3, cfg.num_classes) and logits.dtype == jnp.float32
  # The last patch (bottom-right pixels) reaches the first token: attention is not causal.
  x = patchify(images, cfg.patch_size) @ model.patch_embed[...] + model.patch_bias[...]
  changed = images.at[:, -2:, -2:, :].add(1.0)
  first_token = lambda imgs: _first_token(model, imgs)
  assert not np.allclose(first_token(images), first_token(changed))
  assert x.shape == (3, cfg.num_patches, cfg.d_model)


def _first_token(model, images):
  cfg = model.cfg
  x = patchify(images, cfg.patch_size) @ model.patch_embed[...] + model.patch_bias[...]
  if cfg.pool == "cls":
    x = jnp.concatenate([jnp.broadcast_to(model.class_token[...], (x.shape[0], 1, x.shape[2])),
                         x], axis=1)
  x = x + model.position_embed[...]
  positions = jnp.broadcast_to(jnp.arange(x.shape[1]), x.shape[:2])
  return np.asarray(model._run_layers(x, positions)[:, 0])  # pylint: disable=protected-access


def test_every_parameter_has_known_logical_axes():
  for pool in ("gap", "cls"):
    _, entries = state_lib.param_entries(ViTConfig.preset("tiny", pool=pool))
    for path, shape, _, axes in entries:
      assert len(axes) == len(shape) and all(a in LOGICAL_AXES for a in axes), (path, axes)


def test_preset_sizes():
  assert ViTConfig.preset("b16").num_params() == 86_463_976  # ViT-B/16: 86 M
  assert ViTConfig.preset("digits").num_params() == 166_410
  with pytest.raises(ValueError, match="image_size=10 is not divisible by model.patch_size=4"):
    ViTConfig(image_size=10, patch_size=4).validate()


def _tiny(preset, ici):
  config = vit_experiment.get_config("tiny")
  config.sharding.preset = preset
  config.mesh.ici = ici
  config.train.steps = 10
  return config


@pytest.fixture(scope="module")
def unsharded():
  losses, params, _ = train_steps(_tiny("dp", "data:1"), jax.devices()[:1])
  return losses, params


# fsdp_tp covers both of fsdp's and tp's splits by default; the single presets are slow.
@pytest.mark.parametrize("preset,ici", [
    ("dp", "data:-1"), pytest.param("fsdp", "fsdp:-1", marks=pytest.mark.slow),
    pytest.param("tp", "data:4,tensor:2", marks=pytest.mark.slow),
    ("fsdp_tp", "fsdp:4,tensor:2")])
def test_sharded_equals_unsharded(unsharded, preset, ici):
  losses, params, setup = train_steps(_tiny(preset, ici))
  assert setup.spec.mesh.size == 8 and setup.spec.task == "classification"
  # The ViT sits on a plateau for its first ~50 steps (zero-initialized head), so check that
  # training moved the parameters far beyond the tolerance, for the comparison to mean much.
  initial = jax.device_get(state_lib.create(setup.spec.model, setup.optimizer, setup.layout,
                                            0)["params"])
  moved = max(float(np.max(np.abs(a - b))) for a, b in zip(jax.tree.leaves(params),
                                                           jax.tree.leaves(initial)))
  assert moved > 1e-3, moved
  np.testing.assert_allclose(losses, unsharded[0], **TOLERANCE)
  assert_trees_close(params, unsharded[1], **TOLERANCE)


def test_b16_step_lowers_for_a_pod_sized_batch():
  """The ImageNet-shaped variant builds (synthetic data, fsdp) and its real train step lowers
  with the global batch of 4,096 on 8 devices; `toolkit.compile` compiles it for TPUs."""
  config = vit_experiment.get_config("b16")
  setup = training.build(config)
  assert setup.batches.abstract()["images"].shape == (4096, 224, 224, 3)
  train_jit, _ = step_lib.jit_step(setup.step, setup.layout, setup.batches.abstract(),
                                   setup.spec.mesh)
  lowered = train_jit.trace(setup.layout.abstract, setup.batches.abstract()).lower()
  assert "mhlo.num_partitions = 8" in lowered.as_text()
  assert setup.layout.report.replicated_fraction < config.sharding.max_replicated_fraction


@pytest.mark.tpu_aot
@pytest.mark.slow
def test_b16_compiles_for_a_tpu_slice():
  """ViT-B/16, global batch 1,024, fsdp over a v5p-16 slice (8 chips): the real train step
  compiled ahead of time from this CPU machine, with its memory per chip."""
  from toolkit.planning import target as target_lib  # pylint: disable=g-import-not-at-top
  if target_lib.libtpu_missing_reason():
    extras.require("libtpu")
  target_lib.prepare_libtpu_environment()
  config = vit_experiment.get_config("b16")
  config.data.global_batch_size = 1024
  tpu = target_lib.target_for("v5p-16")
  setup = training.build(config, devices=list(tpu.devices))
  train_jit, _ = step_lib.jit_step(setup.step, setup.layout, setup.batches.abstract(),
                                   setup.spec.mesh)
  compiled = train_jit.lower(setup.layout.abstract, setup.batches.abstract()).compile()
  memory = compiled.memory_analysis()
  used = memory.argument_size_in_bytes + memory.temp_size_in_bytes
  assert 0 < used < tpu.hbm_bytes_per_device
