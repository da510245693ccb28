"""The train state as an explicit pytree, its shardings, and its creation without ever
materializing it unsharded: `eval_shape` gives the abstract state, the rules give shardings,
`jit(init, out_shardings=...)` makes the arrays on their devices.

State layout (a plain dict, which is also the checkpoint layout):
  step: int32 scalar · params: nested dict of arrays · opt_state: optax state · rng: uint32[2]
  reference: a frozen copy of the starting params, sharded like them, when the layout holds
             one (`layout(reference=True)`: post-training's reference model, kept unchanged
             by every step, checkpointed and restored with the rest)

Trainable and frozen parameters (`split_trainable`): a model with LoRA adapters
(models/lora.py) trains only the adapters; the rest of `params` is its frozen base, which has
no optimizer state (opt_state is the optimizer's state of the trainable part) and, in the
step, no gradient. A model without adapters trains every parameter.
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
from models import Llama, LlamaConfig, build_model, lora
from toolkit.training.programs import Programs

State = dict[str, Any]


@dataclasses.dataclass(frozen=True)
class StateLayout:
  """Everything about the state except its values."""
  graphdef: nnx.GraphDef
  abstract: State          # ShapeDtypeStructs carrying their shardings: the restore target
  shardings: State         # NamedSharding per leaf
  report: sharding.ShardingReport
  reference: bool = False  # the state holds a frozen copy of the starting params


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


def split_trainable(params: dict) -> tuple[dict, dict]:
  """(trainable, frozen) parts of a parameter tree, each a nested dict holding only its own
  leaves: the LoRA adapters and the rest when the tree holds adapters (`models.lora`), else
  every parameter and {}. `combine` puts them back together."""
  paths = [path for path, _ in _flat_items(params)]
  if not any(lora.is_adapter(path) for path in paths):
    return params, {}
  return (_select(params, lambda path: lora.is_adapter(path)),
          _select(params, lambda path: not lora.is_adapter(path)))


def combine(first: dict, second: dict) -> dict:
  """Two parameter trees merged into one; where both hold a leaf, `first`'s."""
  merged = dict(second)
  for key, value in first.items():
    if isinstance(value, dict) and isinstance(second.get(key), dict):
      merged[key] = combine(value, second[key])
    else:
      merged[key] = value
  return merged


def _flat_items(tree: dict, prefix: tuple = ()):
  for key, value in tree.items():
    if isinstance(value, dict):
      yield from _flat_items(value, prefix + (key,))
    else:
      yield prefix + (key,), value


def _select(tree: dict, keep, prefix: tuple = ()) -> dict:
  """The leaves of `tree` whose path `keep` accepts (empty branches left out)."""
  selected = {}
  for key, value in tree.items():
    if isinstance(value, dict):
      branch = _select(value, keep, prefix + (key,))
      if branch:
        selected[key] = branch
    elif keep(prefix + (key,)):
      selected[key] = value
  return selected


def init_params(model_cfg: LlamaConfig, seed: jax.Array) -> dict:
  """The parameters `create` gives `seed`, as a nested dict."""
  params_key, _ = jax.random.split(jax.random.key(seed))
  return nnx.to_pure_dict(nnx.state(_model_fn(model_cfg, params_key), nnx.Param))


def _init(model_cfg: LlamaConfig, optimizer: optax.GradientTransformation, seed: jax.Array,
          reference: bool = False) -> State:
  return _around(init_params(model_cfg, seed), optimizer, seed, reference)


def _around(params, optimizer: optax.GradientTransformation, seed: jax.Array,
            reference: bool = False) -> State:
  """Step 0, a new optimizer state (of the trainable parameters) and the seed's rng around
  `params`, and a frozen copy of them with `reference`."""
  _, state_key = jax.random.split(jax.random.key(seed))
  state = {"step": jnp.zeros((), jnp.int32), "params": params,
           "opt_state": optimizer.init(split_trainable(params)[0]),
           "rng": jax.random.key_data(state_key)}
  if reference:
    state["reference"] = frozen_copy(params)
  return state


def frozen_copy(params) -> dict:
  """A copy of `params` as the state's frozen reference (its own buffers: the step donates the
  params, never the copy's values)."""
  return jax.tree.map(jnp.copy, params)


def layout(model_cfg: LlamaConfig, optimizer: optax.GradientTransformation,
           rules: sharding.Rules, mesh: Mesh, reference: bool = False) -> StateLayout:
  """Abstract state and shardings: parameters (and their frozen copy, with `reference`) by
  the rules, optimizer moments like their parameters, scalars replicated."""
  graphdef, entries = param_entries(model_cfg)
  report = sharding.sharding_report(entries, rules, mesh)
  param_shardings = _nest({row.path: NamedSharding(mesh, row.spec) for row in report.rows})
  abstract = jax.eval_shape(lambda: _init(model_cfg, optimizer, jnp.int32(0), reference))
  replicated = NamedSharding(mesh, PartitionSpec())
  # The optimizer's moments are trees like the trainable parameters: sharded like them.
  trainable_shardings = split_trainable(param_shardings)[0]
  params_def = jax.tree.structure(split_trainable(abstract["params"])[0])
  is_param_tree = lambda node: jax.tree.structure(node) == params_def
  opt_shardings = jax.tree.map(
      lambda node: trainable_shardings if is_param_tree(node) else replicated,
      abstract["opt_state"], is_leaf=lambda node: is_param_tree(node))
  shardings = {"step": replicated, "params": param_shardings, "opt_state": opt_shardings,
               "rng": replicated}
  if reference:
    shardings["reference"] = param_shardings
  abstract = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                          abstract, shardings)
  return StateLayout(graphdef=graphdef, abstract=abstract, shardings=shardings, report=report,
                     reference=reference)


def create(model_cfg: LlamaConfig, optimizer: optax.GradientTransformation,
           state_layout: StateLayout, seed: int, programs: Programs | None = None) -> State:
  """Initializes the state directly into its shardings (the init program read back from
  `programs` when it holds it)."""
  init = jax.jit(lambda s: _init(model_cfg, optimizer, s, state_layout.reference),
                 out_shardings=state_layout.shardings)
  seed = jnp.int32(seed)
  return (programs or Programs(None, "")).compile("init", init, seed)(seed)


def from_params(params, optimizer: optax.GradientTransformation, state_layout: StateLayout,
                seed: int, model_cfg: LlamaConfig | None = None) -> State:
  """A fresh state around given parameters (already in their shardings, say read from a
  Hugging Face checkpoint): step 0, a new optimizer state, and the rng `create` would give
  `seed`. Parameters `params` lacks (a LoRA model's adapters beside a base read from Hugging
  Face) get the initialization `create` would give them from `seed` (`model_cfg` says how).
  The parameter buffers are donated, not copied."""
  def around(given, seed):
    if model_cfg is not None:  # unused draws of the init are dropped by the compiler
      given = combine(given, init_params(model_cfg, seed))
    return _around(given, optimizer, seed)

  around = jax.jit(around, out_shardings=state_layout.shardings, donate_argnums=0)
  return around(params, jnp.int32(seed))
