"""The chunked vocabulary loss's communication on the plain (XLA-partitioned) path, the one TPU
runs: the output matrix is gathered once per step and its gradient reduced once, not in every
chunk (on the 1b job on v5p-32 that was 32 gathers of the matrix and 32 reduce-scatters of
its float32 gradient, 46 GiB per device and step: docs/compile.md). Read from the compiled
program with the same parser `toolkit.compile` uses; values and gradients equal the unsharded
full-logits objective's."""
from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding

import sharding
from models import Llama, LlamaConfig
from tests.tiny_runs import TOLERANCE, assert_trees_close
from toolkit.planning import collectives
from toolkit.training.objectives import losses

VOCAB = 320  # a dimension no other array of the tiny model has


@pytest.mark.parametrize("preset, mesh_axes", [
    ("fsdp", [("data", 2), ("fsdp", 4)]),                  # batch over 8, matrix over fsdp
    ("fsdp_tp", [("data", 2), ("fsdp", 2), ("tensor", 2)]),  # and the vocabulary over tensor
])
def test_matrix_moves_once_per_step_not_once_per_chunk(preset, mesh_axes):
  cfg = dict(vocab_size=VOCAB, init_std=0.2)
  tokens = jax.random.randint(jax.random.key(4), (8, 17), 0, VOCAB)
  inputs, targets = tokens[:, :-1], tokens[:, 1:]
  full = _value_and_grad(Llama(LlamaConfig.preset("tiny", loss_chunk=0, **cfg),
                               rngs=nnx.Rngs(params=0)), inputs, targets)
  model = Llama(LlamaConfig.preset("tiny", loss_chunk=4, **cfg), rngs=nnx.Rngs(params=0))
  mesh, rules = sharding.make_mesh(mesh_axes), sharding.Rules.preset(preset)
  graphdef, params = nnx.split(model)
  placed = jax.tree.map(lambda v: jax.device_put(v, NamedSharding(
      mesh, rules.param_spec(v.get_metadata()["out_sharding"], mesh))), params,
      is_leaf=lambda x: isinstance(x, nnx.Variable))
  rows = NamedSharding(mesh, rules.activation_spec(("batch", "length"), mesh))

  @jax.jit
  def run(params, inputs, targets):
    with sharding.activation_rules(rules, mesh):
      assert not losses.vocab_parallel_axes(VOCAB, model.unembedding()[1])  # the plain path
      fn = lambda p: losses.next_token_objective(nnx.merge(graphdef, p), inputs, targets)[0]
      return jax.value_and_grad(fn)(params)

  args = (placed, jax.device_put(inputs, rows), jax.device_put(targets, rows))
  value, grads = run(*args)
  np.testing.assert_allclose(value, full[0], **TOLERANCE)
  assert_trees_close(grads, full[1], **TOLERANCE)
  # 4 tokens per device: 4 chunks of 4 positions (1 row per device) or 8 chunks of 2 (2 rows);
  # the collectives that carry the vocabulary dimension run once per step, not per chunk.
  found = collectives.parse(run.lower(*args).compile().as_text(), list(mesh.shape.items()))
  vocab = {str(VOCAB), str(VOCAB // dict(mesh_axes).get("tensor", 1))}  # whole or split
  over_vocab = [c for c in found
                if vocab & set(c.result.replace("[", ",").replace("]", ",").split(","))]
  assert over_vocab, [c.result for c in found]
  assert all(c.count == 1 for c in over_vocab), [(c.result, c.count) for c in over_vocab]


def _value_and_grad(model, inputs, targets):
  graphdef, params = nnx.split(model)
  fn = lambda p: losses.next_token_objective(nnx.merge(graphdef, p), inputs, targets)[0]
  return jax.jit(jax.value_and_grad(fn))(params)
