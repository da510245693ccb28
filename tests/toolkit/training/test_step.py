"""The step: sharded == unsharded, micro-batching == one batch, compiled exactly once."""
import jax
import numpy as np
import pytest

from tests.tiny_runs import TOLERANCE, assert_trees_close, tiny_config, train_steps
from toolkit.training import step as step_lib
from toolkit import training


@pytest.fixture(scope="module")
def unsharded():
  """12 steps on one device: the reference."""
  losses, params, _ = train_steps(tiny_config("dp", "data:1"), jax.devices()[:1])
  return losses, params


@pytest.mark.parametrize("preset,ici", [
    ("dp", "data:-1"), ("fsdp", "fsdp:-1"), ("tp", "data:4,tensor:2"),
    pytest.param("fsdp_tp", "fsdp:4,tensor:2", marks=pytest.mark.smoke)])
def test_sharded_equals_unsharded(unsharded, preset, ici):
  losses, params, setup = train_steps(tiny_config(preset, ici))
  assert setup.spec.mesh.size == 8
  ref_losses, ref_params = unsharded
  assert losses[-1] < losses[0] - 0.3, "the run must actually learn for the check to mean much"
  np.testing.assert_allclose(losses, ref_losses, **TOLERANCE)
  assert_trees_close(params, ref_params, **TOLERANCE)


@pytest.mark.parametrize("microbatches", [2, 4])
def test_microbatches_equal_one_batch(unsharded, microbatches):
  losses, params, _ = train_steps(tiny_config(microbatches=microbatches))
  np.testing.assert_allclose(losses, unsharded[0], **TOLERANCE)
  assert_trees_close(params, unsharded[1], **TOLERANCE)


def test_loss_and_grads_microbatched_matches_full_batch():
  setup = training.build(tiny_config())
  from toolkit.training import state as state_lib  # pylint: disable=g-import-not-at-top
  state = state_lib.create(setup.spec.model, setup.optimizer, setup.layout, 0)
  batch = setup.batches.batch(0)
  loss_fn = lambda p, b: step_lib.lm_loss(setup.layout.graphdef, p, b)
  full = jax.jit(lambda p, b: step_lib.loss_and_grads(loss_fn, p, b, 1))(state["params"], batch)
  split = jax.jit(lambda p, b: step_lib.loss_and_grads(loss_fn, p, b, 4))(state["params"], batch)
  np.testing.assert_allclose(split[0][0], full[0][0], **TOLERANCE)
  assert_trees_close(jax.device_get(split[1]), jax.device_get(full[1]), **TOLERANCE)


def test_split_microbatches_keeps_rows_on_their_device():
  batch = {"inputs": np.arange(16 * 3).reshape(16, 3)}
  parts = step_lib.split_microbatches(batch, 4)["inputs"]
  assert parts.shape == (4, 4, 3)
  # micro-batch m holds rows m, m+4, m+8, m+12; together they are every row once.
  np.testing.assert_array_equal(parts[1][:, 0], np.array([1, 5, 9, 13]) * 3)
  assert sorted(np.asarray(parts).reshape(16, 3)[:, 0]) == list(range(0, 48, 3))


def test_metrics_and_schedule():
  config = tiny_config(steps=4)
  config.optimizer.warmup_steps = 2
  losses, _, setup = train_steps(config)
  schedule = step_lib.learning_rate_schedule(config.optimizer, 4)
  assert float(schedule(0)) == 0.0
  assert float(schedule(2)) == pytest.approx(config.optimizer.learning_rate)
  assert float(schedule(4)) == pytest.approx(config.optimizer.learning_rate
                                             * config.optimizer.min_lr_ratio)
  # A fresh init's loss is near log(vocab) for a byte-level model.
  assert abs(losses[0] - np.log(256)) < 0.1
  assert setup.step.traces == 1


@pytest.mark.smoke
def test_run_compiles_the_step_once(tmp_path):
  config = tiny_config(steps=6)
  config.train.update(log_every=2, eval_every=3, checkpoint_every=3)
  result = training.run(config, str(tmp_path))
  assert result.step_traces == 1
  assert sorted(result.train_losses) == list(range(1, 7))
  assert sorted(result.eval_losses) == [0, 3, 6]


def test_state_is_donated():
  config = tiny_config(steps=1)
  setup = training.build(config)
  from toolkit.training import state as state_lib  # pylint: disable=g-import-not-at-top
  state = state_lib.create(setup.spec.model, setup.optimizer, setup.layout, 0)
  train_step, _ = step_lib.compile_step(setup.step, setup.layout, setup.batches.abstract(),
                                        setup.spec.mesh)
  leaf = jax.tree.leaves(state["params"])[0]
  new_state, _ = train_step(state, setup.batches.batch(0))
  assert leaf.is_deleted()
  # Output shardings are exactly the layout's.
  for actual, expected in zip(jax.tree.leaves(new_state), jax.tree.leaves(setup.layout.shardings)):
    assert actual.sharding == expected


@pytest.mark.parametrize("clip_norm", [0.0, jax.numpy.float32(0.0)])
def test_clip_norm_zero_turns_clipping_off(clip_norm):
  """0 is "off" (not "clip every gradient to nothing"), for a number and for a traced value as
  a population passes it: Adam's first moment sees the unclipped gradient exactly."""
  import types  # pylint: disable=g-import-not-at-top
  import optax  # pylint: disable=g-import-not-at-top
  config = tiny_config().optimizer.to_dict()
  grads = {"w": jax.numpy.full((4, 4), 3.0), "b": jax.numpy.full((4,), -2.0)}  # norm 12.6
  params = jax.tree.map(jax.numpy.zeros_like, grads)

  def first_moment(clip):
    optimizer = step_lib.make_optimizer(types.SimpleNamespace(**{**config, "clip_norm": clip}),
                                        10, lambda count: 1e-2)
    _, state = optimizer.update(grads, optimizer.init(params), params)
    return optax.tree_utils.tree_get(state, "mu")

  off, unclipped, clipped = first_moment(clip_norm), first_moment(1e30), first_moment(1.0)
  for a, b in zip(jax.tree.leaves(off), jax.tree.leaves(unclipped)):
    np.testing.assert_array_equal(a, b)
  np.testing.assert_allclose(optax.global_norm(off), (1 - config["b1"]) * 12.649, rtol=1e-4)
  np.testing.assert_allclose(optax.global_norm(clipped), 1 - config["b1"], rtol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("ici,dcn", [("data:2,fsdp:2,tensor:2", ""),
                                     ("data:1,fsdp:2,tensor:2", "data:2")])
def test_a_data_axis_beside_fsdp_with_the_vocabulary_split_trains_as_one_device(unsharded, ici,
                                                                                dcn):
  """docs/sharding.md: with the batch over data and fsdp and the vocabulary over tensor, XLA
  can replicate the embedding lookup's output on its way to the batch's split, and says so
  ("Involuntary full rematerialization": the tiny LM on one slice here, the CPU demo on two);
  the losses and parameters are one device's all the same."""
  config = tiny_config("fsdp_tp", ici)
  config.mesh.dcn = dcn
  losses, params, setup = train_steps(config)
  assert setup.spec.mesh.shape["data"] == 2
  np.testing.assert_allclose(losses, unsharded[0], **TOLERANCE)
  assert_trees_close(params, unsharded[1], **TOLERANCE)
