"""Pipeline parallelism (GPipe over a `stage` mesh axis, models/pipeline.py): the loss and every
gradient equal the sequential run, the bubble leaks nothing, parameters sit at 1/S per stage,
checkpoints move to a mesh without stages, and each impossible layout is one error line."""

import jax
import numpy as np
import pytest
from flax import nnx

import sharding
from models import pipeline
from tests.tiny_runs import TOLERANCE, assert_resume_is_bitwise, assert_trees_close, tiny_config
from toolkit import training
from toolkit.errors import ConfigError
from toolkit.planning import aot, target as target_lib
from toolkit.training import state as state_lib, step as step_lib
from toolkit.training.checkpoints import checkpoint

LAYERS = 8


def _config(ici: str = "fsdp:1", preset: str = "fsdp", microbatches: int = 0,
            repeats: int = 1):
  config = tiny_config(preset, ici, steps=4)
  config.model.n_layers = LAYERS
  config.model.pipeline_microbatches = microbatches
  config.model.pipeline_repeats = repeats
  return config


def _loss_and_grads(config, devices=None, bubble=None, monkeypatch=None):
  """The training loss of batch 0 and its gradient with respect to every parameter, from the
  same initial parameters whatever the mesh."""
  if bubble is not None:
    run = pipeline.run
    monkeypatch.setattr(pipeline, "run", lambda *a, **k: run(*a, **k, bubble=bubble))
  setup = training.build(config, devices)
  params = state_lib.create(setup.spec.model, setup.optimizer, setup.layout, 0)["params"]
  mesh, rules = setup.spec.mesh, setup.spec.rules

  @jax.jit
  def loss_and_grads(params, batch):
    with sharding.activation_rules(rules, mesh):
      return jax.value_and_grad(
          lambda p: step_lib.lm_loss(setup.layout.graphdef, p, batch)[0])(params)

  return jax.device_get(loss_and_grads(params, setup.batches.batch(0)))


@pytest.fixture(scope="module")
def sequential():
  return _loss_and_grads(_config(), jax.devices()[:1])


@pytest.mark.parametrize("ici,microbatches,repeats", [
    ("stage:4,fsdp:2", 4, 1), pytest.param("stage:4,fsdp:2", 8, 1, marks=pytest.mark.slow),
    ("stage:8", 8, 1), ("stage:4,fsdp:2", 4, 2)])  # the last: circular, 2 rounds
def test_loss_and_every_gradient_equal_the_sequential_run(sequential, ici, microbatches,
                                                          repeats):
  loss, grads = _loss_and_grads(_config(ici, "fsdp_pp", microbatches, repeats))
  np.testing.assert_allclose(loss, sequential[0], **TOLERANCE)
  assert_trees_close(grads, sequential[1], **TOLERANCE)


@pytest.mark.parametrize("repeats", [1, 2])
def test_nan_in_the_bubble_reaches_neither_values_nor_gradients(sequential, monkeypatch,
                                                                repeats):
  """The pipeline's buffers start as NaN: the masked slots keep it out (4 stages x 4
  micro-batches: 3 of 7 iterations per stage are bubble; circular, 3 of 11)."""
  loss, grads = _loss_and_grads(_config("stage:4,fsdp:2", "fsdp_pp", 4, repeats),
                                bubble=float("nan"), monkeypatch=monkeypatch)
  assert np.isfinite(loss) and all(np.isfinite(g).all() for g in jax.tree.leaves(grads))
  np.testing.assert_allclose(loss, sequential[0], **TOLERANCE)
  assert_trees_close(grads, sequential[1], **TOLERANCE)


@pytest.mark.slow  # ~25 s; the gradient equalities above are its one-step form
def test_training_steps_equal_the_sequential_run():
  from tests.tiny_runs import train_steps  # pylint: disable=g-import-not-at-top
  losses, params, _ = train_steps(_config("stage:4,fsdp:2", "fsdp_pp", 8))
  reference_losses, reference_params, _ = train_steps(_config(), jax.devices()[:1])
  np.testing.assert_allclose(losses, reference_losses, **TOLERANCE)
  assert_trees_close(params, reference_params, **TOLERANCE)


def test_each_stage_holds_its_share_of_the_layers():
  """Every stacked layer parameter: each device's block holds LAYERS / S layers (and the
  fsdp split of the rest); parameter bytes per device about total / S plus the embeddings."""
  setup = training.build(_config("stage:4,fsdp:2", "fsdp_pp", 4))
  state = state_lib.create(setup.spec.model, setup.optimizer, setup.layout, 0)
  flat = jax.tree_util.tree_flatten_with_path(state["params"])[0]
  layer_total = layer_local = 0
  for path, leaf in flat:
    if "layers" not in jax.tree_util.keystr(path):
      continue
    local = leaf.addressable_shards[0].data
    assert local.shape[0] == LAYERS // 4, (path, local.shape)
    layer_total, layer_local = layer_total + leaf.nbytes, layer_local + local.nbytes
  assert layer_local * 4 * 2 >= layer_total >= layer_local * 4  # / S, and / fsdp where split


def _write_pipelined_checkpoint(directory):
  setup = training.build(_config("stage:4,fsdp:2", "fsdp_pp", 4))
  state = state_lib.create(setup.spec.model, setup.optimizer, setup.layout, 1)
  train_step, _ = step_lib.compile_step(setup.step, setup.layout, setup.batches.abstract(),
                                        setup.spec.mesh)
  for step in range(2):
    state, _ = train_step(state, setup.batches.batch(step))
  manager = checkpoint.Checkpoints(str(directory))
  manager.save(2, state, {"model": {}}, {"step": 2})
  manager.close()
  return setup, jax.device_get(state)


def _logits(setup, params, tokens):
  @jax.jit
  def forward(params, tokens):
    with sharding.activation_rules(setup.spec.rules, setup.spec.mesh):
      return nnx.merge(setup.layout.graphdef, params)(tokens)
  return np.asarray(forward(params, tokens))


@pytest.mark.slow  # two meshes' compiles and a checkpoint, ~20 s
def test_a_pipelined_checkpoint_restores_onto_plain_fsdp_with_the_same_logits(tmp_path):
  source, state = _write_pipelined_checkpoint(tmp_path / "checkpoints")
  target = training.build(_config("fsdp:8", "fsdp"))
  manager = checkpoint.Checkpoints(str(tmp_path / "checkpoints"), read_only=True)
  restored, _ = manager.restore(2, target.layout.abstract)
  manager.close()
  for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(state)):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  tokens = source.batches.batch(0)["inputs"]
  pipelined = _logits(source, jax.device_put(state["params"], source.layout.shardings["params"]),
                      tokens)
  np.testing.assert_allclose(_logits(target, restored["params"], tokens), pipelined,
                             **TOLERANCE)


@pytest.mark.parametrize("ici,preset,fields,message", [
    ("stage:2,fsdp:4", "fsdp", {},
     r"mesh has stage=2 but sharding.preset='fsdp' .* sharding.preset=fsdp_pp"),
    ("stage:2,fsdp:4", "fsdp_pp", {"pipeline_microbatches": 0},
     r"pipeline_microbatches=0; set it to at least 2"),
    ("stage:4,fsdp:2", "fsdp_pp", {"pipeline_microbatches": 2},
     r"pipeline_microbatches=2 is below the 4 pipeline stages"),
    ("stage:4,fsdp:2", "fsdp_pp", {"pipeline_microbatches": 4, "n_layers": 6},
     r"model.n_layers=6 is not divisible by the 4 pipeline stages"),
    ("stage:2,fsdp:4", "fsdp_pp", {"pipeline_microbatches": 3},
     r"batch of 16 rows .* not divisible by model.pipeline_microbatches=3"),
    ("stage:2,fsdp:4", "fsdp_pp", {"pipeline_microbatches": 8},
     r"pipeline micro-batch of 2 rows .* not divisible by the 4 ways"),
    ("stage:4,fsdp:2", "fsdp_pp", {"pipeline_microbatches": 4, "pipeline_repeats": 3},
     r"n_layers=8 is not divisible by the 4 pipeline stages x model.pipeline_repeats=3"),
])
def test_layouts_that_cannot_run_are_refused_in_one_line(ici, preset, fields, message):
  config = _config(ici, preset, 4)
  config.model.update(fields)
  with pytest.raises(ConfigError, match=message) as error:
    training.build(config)
  assert "\n" not in str(error.value)


def test_the_compile_report_measures_the_bubble_from_the_loop():
  """toolkit.compile's note: the stage shift's executions per pass (the loop's trip count,
  M + S - 1 = 11) against the formula (S - 1) / (M + S - 1) = 3/11."""
  config = _config("stage:4,fsdp:2", "fsdp_pp", 8)
  report = aot.compile_report(config, target_lib.target_for("cpu:8"))
  [note] = [n for n in report.notes if n.startswith("pipeline")]
  assert "bubble (S-1)/(M+S-1) = 27.3%" in note and "runs 11 times" in note, note
  assert "bubble 1 - 8/11 = 27.3%" in note


@pytest.mark.slow  # three training processes, ~60 s
def test_resume_with_pipeline_stages_is_bitwise(tmp_path):
  config = tiny_config("fsdp_pp", "stage:2,fsdp:4")
  config.model.pipeline_microbatches = 4
  assert_resume_is_bitwise(tmp_path, config, "mesh.ici=stage:2,fsdp:4",
                           "sharding.preset=fsdp_pp", "model.pipeline_microbatches=4")


@pytest.mark.slow  # a second compile of the pipelined step; the GPipe one runs by default
def test_the_compile_report_measures_the_circular_bubble():
  """R = 2 rounds: R M + S - 1 = 11 iterations for 4 stages x 4 micro-batches, 3/11 idle."""
  config = _config("stage:4,fsdp:2", "fsdp_pp", 4, repeats=2)
  report = aot.compile_report(config, target_lib.target_for("cpu:8"))
  [note] = [n for n in report.notes if n.startswith("pipeline")]
  assert "x 2 rounds, bubble (S-1)/(RM+S-1) = 27.3%" in note, note
  assert "runs 11 times per pass, bubble 1 - 8/11 = 27.3%" in note, note


def test_bubble_fraction_formula():
  assert pipeline.bubble_fraction(4, 8) == pytest.approx(3 / 11)
  assert pipeline.bubble_fraction(4, 4, repeats=2) == pytest.approx(3 / 11)
  assert pipeline.bubble_fraction(1, 8) == 0.0
  with pytest.raises(ValueError, match="pipeline_microbatches=-1 must be >= 0"):
    from models import LlamaConfig  # pylint: disable=g-import-not-at-top
    LlamaConfig.preset("tiny", pipeline_microbatches=-1).validate()
