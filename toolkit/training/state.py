"""The train state as an explicit pytree, its shardings, and its creation without ever
materializing it unsharded: `eval_shape` gives the abstract state, the rules give shardings,
`jit(init, out_shardings=...)` makes the arrays on their devices.

State layout (a plain dict, which is also the checkpoint layout):
  step: int32 scalar · params: nested dict of arrays · opt_state: optax state · rng: uint32[2]
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import sharding
from models import Llama, LlamaConfig, build_model
from toolkit.training.programs import Programs

State = dict[str, Any]


@dataclasses.dataclass(frozen=True)
class StateLayout:
  """Everything about the state except its values."""
  graphdef: nnx.GraphDef
  abstract: State          # ShapeDtypeStructs carrying their shardings: the restore target
  shardings: State         # NamedSharding per leaf
  report: sharding.ShardingReport


def _model_fn(model_cfg: LlamaConfig, key: jax.Array) -> Llama:
  """The model of `model_cfg`'s family (models.KINDS): Llama, ViT, ..."""
  return build_model(model_cfg, nnx.Rngs(params=key))


def param_entries(model_cfg: LlamaConfig) -> tuple[nnx.GraphDef, list[tuple[str, tuple, Any, tuple]]]:
  """The graphdef and (path, shape, dtype, logical axes) of every parameter, in tree order."""
  abstract_model = nnx.eval_shape(lambda: _model_fn(model_cfg, jax.random.key(0)))
  graphdef, abstract_params = nnx.split(abstract_model)
  entries = []
  for path, variable in nnx.to_flat_state(abstract_params):
    value = variable.get_value()
    axes = tuple(variable.get_metadata().get("out_sharding") or (None,) * value.ndim)
    entries.append(("/".join(map(str, path)), value.shape, value.dtype, axes))
  return graphdef, entries


def _nest(flat: dict[str, Any]) -> dict[str, Any]:
  nested: dict[str, Any] = {}
  for path, value in flat.items():
    node = nested
    *parents, leaf = path.split("/")
    for part in parents:
      node = node.setdefault(part, {})
    node[leaf] = value
  return nested


def _init(model_cfg: LlamaConfig, optimizer: optax.GradientTransformation, seed: jax.Array) -> State:
  params_key, _ = jax.random.split(jax.random.key(seed))
  model = _model_fn(model_cfg, params_key)
  return _around(nnx.to_pure_dict(nnx.state(model, nnx.Param)), optimizer, seed)


def _around(params, optimizer: optax.GradientTransformation, seed: jax.Array) -> State:
  """Step 0, a new optimizer state and the seed's rng around `params`."""
  _, state_key = jax.random.split(jax.random.key(seed))
  return {"step": jnp.zeros((), jnp.int32), "params": params,
          "opt_state": optimizer.init(params), "rng": jax.random.key_data(state_key)}


def layout(model_cfg: LlamaConfig, optimizer: optax.GradientTransformation,
           rules: sharding.Rules, mesh: Mesh) -> StateLayout:
  """Abstract state and shardings: parameters by the rules, optimizer moments like their
  parameters, scalars replicated."""
  graphdef, entries = param_entries(model_cfg)
  report = sharding.sharding_report(entries, rules, mesh)
  param_shardings = _nest({row.path: NamedSharding(mesh, row.spec) for row in report.rows})
  abstract = jax.eval_shape(lambda: _init(model_cfg, optimizer, jnp.int32(0)))
  replicated = NamedSharding(mesh, PartitionSpec())
  params_def = jax.tree.structure(abstract["params"])
  is_param_tree = lambda node: jax.tree.structure(node) == params_def
  opt_shardings = jax.tree.map(
      lambda node: param_shardings if is_param_tree(node) else replicated,
      abstract["opt_state"], is_leaf=lambda node: is_param_tree(node))
  shardings = {"step": replicated, "params": param_shardings, "opt_state": opt_shardings,
               "rng": replicated}
  abstract = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                          abstract, shardings)
  return StateLayout(graphdef=graphdef, abstract=abstract, shardings=shardings, report=report)


def create(model_cfg: LlamaConfig, optimizer: optax.GradientTransformation,
           state_layout: StateLayout, seed: int, programs: Programs | None = None) -> State:
  """Initializes the state directly into its shardings (the init program read back from
  `programs` when it holds it)."""
  init = jax.jit(lambda s: _init(model_cfg, optimizer, s), out_shardings=state_layout.shardings)
  seed = jnp.int32(seed)
  return (programs or Programs(None, "")).compile("init", init, seed)(seed)


def from_params(params, optimizer: optax.GradientTransformation, state_layout: StateLayout,
                seed: int) -> State:
  """A fresh state around given parameters (already in their shardings, say read from a
  Hugging Face checkpoint): step 0, a new optimizer state, and the rng `create` would give
  `seed`. The parameter buffers are donated, not copied."""
  around = jax.jit(lambda p, s: _around(p, optimizer, s), out_shardings=state_layout.shardings,
                   donate_argnums=0)
  return around(params, jnp.int32(seed))
