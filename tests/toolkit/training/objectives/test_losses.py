"""The vocabulary loss (toolkit.training.objectives.losses): chunked == over full logits, in value and
gradients, with and without z-loss, sharded and not; and the compiled step's temporaries
shrink by at least the logits when chunked."""
import dataclasses
import functools
import re

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding

import sharding
from models import Llama, LlamaConfig
from tests.tiny_runs import TOLERANCE, assert_trees_close
from toolkit import training
from toolkit.training import config as config_lib, step as step_lib
from toolkit.training.objectives import losses


def _model(**overrides):
  cfg = LlamaConfig.preset("tiny", init_std=0.2, **overrides)
  return Llama(cfg, rngs=nnx.Rngs(params=0))


def _batch(batch=4, length=19, vocab=256, seed=0):
  tokens = jax.random.randint(jax.random.key(seed), (batch, length + 1), 0, vocab)
  return tokens[:, :-1], tokens[:, 1:]


def _objective_and_grads(model, inputs, targets):
  graphdef, params = nnx.split(model)

  @jax.jit
  def run(params):
    fn = lambda p: losses.next_token_objective(nnx.merge(graphdef, p), inputs, targets)[0]
    return jax.value_and_grad(fn)(params)

  return run(params)


@functools.cache
def _full_logits_reference(tie: bool, z_loss: float):
  """The objective and gradients over the full logits: computed once per (tie, z_loss) and
  shared by the three chunk sizes, which compare against the same program's result."""
  inputs, targets = _batch()
  return _objective_and_grads(_model(tie_embeddings=tie, z_loss=z_loss, loss_chunk=0),
                              inputs, targets)


@pytest.mark.parametrize("tie", [True, False])
@pytest.mark.parametrize("z_loss", [0.0, 1e-2])
@pytest.mark.parametrize("loss_chunk", [4, 12, 4096])  # 19 positions: 1, 3 and 19 per chunk
def test_chunked_equals_full_logits(tie, z_loss, loss_chunk):
  inputs, targets = _batch()
  full = _full_logits_reference(tie, z_loss)
  chunked = _objective_and_grads(
      _model(tie_embeddings=tie, z_loss=z_loss, loss_chunk=loss_chunk), inputs, targets)
  np.testing.assert_allclose(chunked[0], full[0], **TOLERANCE)
  assert_trees_close(chunked[1], full[1], **TOLERANCE)
  # The z-loss adds weight x mean(logsumexp^2), which is > 0 here.
  if z_loss:
    ce, z = losses.next_token_loss(_model(tie_embeddings=tie, loss_chunk=loss_chunk), inputs,
                                   targets)
    np.testing.assert_allclose(chunked[0], ce + z_loss * z, **TOLERANCE)
    assert z > 0


def test_eval_losses_agree_and_skip_the_gradient_work():
  inputs, targets = _batch(seed=1)
  full = losses.next_token_loss(_model(loss_chunk=0), inputs, targets)
  chunked = losses.next_token_loss(_model(loss_chunk=8), inputs, targets)
  np.testing.assert_allclose(chunked, full, **TOLERANCE)
  # Undifferentiated, the chunked objective computes losses only: its jaxpr has the logits
  # matmul and no gradient matmuls (a scan over chunks with one dot_general).
  model = _model(loss_chunk=8)
  matrix, letters = model.unembedding()
  jaxpr = jax.make_jaxpr(lambda f: losses.chunked_objective(f, matrix, targets, letters, 2,
                                                            0.0))(model.features(inputs))
  text = str(jaxpr)
  assert text.count("dot_general") == 1, text


def test_sharded_chunked_equals_unsharded_full():
  """fsdp 4 x tensor 2 under fsdp_tp (vocab split over tensor), chunks of 2 positions."""
  inputs, targets = _batch(batch=8, length=16, seed=2)
  full = _objective_and_grads(_model(loss_chunk=0), inputs, targets)
  model = _model(loss_chunk=4)  # 2 rows per device x 2 positions
  graphdef, params = nnx.split(model)
  mesh = sharding.make_mesh([("fsdp", 4), ("tensor", 2)])
  rules = sharding.Rules.preset("fsdp_tp")
  rows = NamedSharding(mesh, rules.activation_spec(("batch", "length"), mesh))

  @jax.jit
  def run(params, inputs, targets):
    with sharding.activation_rules(rules, mesh):
      assert losses.chunk_positions(4, 8 // sharding.active_ways("batch"), 16) == 2
      fn = lambda p: losses.next_token_objective(nnx.merge(graphdef, p), inputs, targets)[0]
      return jax.value_and_grad(fn)(params)

  sharded = run(params, jax.device_put(inputs, rows), jax.device_put(targets, rows))
  np.testing.assert_allclose(sharded[0], full[0], **TOLERANCE)
  assert_trees_close(sharded[1], full[1], **TOLERANCE)


@pytest.mark.parametrize("preset, mesh_axes, tie, z_loss, vocab, vocab_parallel", [
    ("fsdp", [("fsdp", 8)], False, 0.0, 256, True),
    ("fsdp", [("fsdp", 8)], True, 1e-2, 256, True),  # tied: the lookup runs per device too
    # (under fsdp_tp a tied table's lookup is left to XLA, which all-reduces its gradient)
    ("fsdp_tp", [("fsdp", 4), ("tensor", 2)], False, 1e-2, 256, True),
    ("fsdp", [("fsdp", 8)], False, 0.0, 252, False),  # 8 devices do not split 252 words
    # The matrix is stored over fsdp only: a vocabulary split over data x fsdp could not give
    # its gradient back by an all-to-all (XLA would replicate it), so the plain chunked path.
    ("fsdp", [("data", 2), ("fsdp", 4)], False, 0.0, 256, False),
])
def test_vocab_parallel_equals_unsharded_full(preset, mesh_axes, tie, z_loss, vocab,
                                              vocab_parallel):
  """With the batch split 8 ways on CPU devices the loss splits the output matrix's
  vocabulary over the devices that store it. Same objective and gradients as over full logits
  on one device; on that path no collective moves the whole matrix (forward gather or
  gradient all-reduce), on the plain chunked path one does."""
  inputs, targets = _batch(batch=8, length=16, vocab=vocab, seed=3)
  overrides = dict(tie_embeddings=tie, z_loss=z_loss, vocab_size=vocab)
  full = _objective_and_grads(_model(loss_chunk=0, **overrides), inputs, targets)
  model = _model(loss_chunk=4, **overrides)
  graphdef, params = nnx.split(model)
  mesh = sharding.make_mesh(mesh_axes)
  rules = sharding.Rules.preset(preset)
  rows = NamedSharding(mesh, rules.activation_spec(("batch", "length"), mesh))
  placed = jax.tree.map(lambda v: jax.device_put(v, NamedSharding(
      mesh, rules.param_spec(v.get_metadata()["out_sharding"], mesh))), params,
      is_leaf=lambda x: isinstance(x, nnx.Variable))
  letters = model.unembedding()[1]

  @jax.jit
  def run(params, inputs, targets):
    with sharding.activation_rules(rules, mesh):
      assert bool(losses.vocab_parallel_axes(vocab, letters)) == vocab_parallel
      fn = lambda p: losses.next_token_objective(nnx.merge(graphdef, p), inputs, targets)[0]
      return jax.value_and_grad(fn)(params)

  args = (placed, jax.device_put(inputs, rows), jax.device_put(targets, rows))
  sharded = run(*args)
  np.testing.assert_allclose(sharded[0], full[0], **TOLERANCE)
  assert_trees_close(sharded[1], full[1], **TOLERANCE)
  matrix = model.unembedding()[0].shape
  whole = [s for s in re.findall(r"= \(?([a-z0-9]+\[[0-9,]*\])[^=]*? (?:all-gather|all-reduce)\(",
                                 run.lower(*args).compile().as_text())
           if s.endswith("[{},{}]".format(*matrix))]
  assert bool(whole) != vocab_parallel, whole


def _temporaries(loss_chunk: int) -> int:
  """Temporary bytes of the compiled train step of a 32k-vocabulary model on one device."""
  config = config_lib.defaults()
  config.model.update(d_model=64, n_layers=1, n_heads=2, n_kv_heads=2, mlp_dim=128,
                      vocab_size=32_000, loss_chunk=loss_chunk)
  config.mesh.ici = "data:1"
  config.sharding.preset = "dp"
  config.data.update(source="synthetic", seq_len=256, global_batch_size=8, eval_batches=1)
  setup = training.build(config, jax.devices()[:1])
  train, _ = step_lib.compile_step(setup.step, setup.layout, setup.batches.abstract(),
                                   setup.spec.mesh)
  return train.memory_analysis().temp_size_in_bytes


def test_chunked_step_temporaries_shrink_by_at_least_the_logits():
  logits_bytes = 8 * 256 * 32_000 * 4   # (tokens, vocab) float32: 262 MB
  full, chunked = _temporaries(0), _temporaries(512)
  assert full - chunked >= logits_bytes, (full, chunked)


def test_loss_chunk_is_checked():
  with pytest.raises(ValueError, match="model.loss_chunk=-1 must be >= 0"):
    dataclasses.replace(LlamaConfig.preset("tiny"), loss_chunk=-1).validate()
  with pytest.raises(ValueError, match="model.z_loss=-0.1 must be a finite number >= 0"):
    dataclasses.replace(LlamaConfig.preset("tiny"), z_loss=-0.1).validate()


def test_chunk_positions():
  assert losses.chunk_positions(2048, rows=32, length=2048) == 64
  assert losses.chunk_positions(2048, rows=1, length=256) == 256   # at most the length
  assert losses.chunk_positions(4, rows=8, length=256) == 1        # at least one position
