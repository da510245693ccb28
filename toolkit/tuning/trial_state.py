"""A population's train state: the leaves each trial holds its own copy of (a leading `trial`
axis, split over the `population` mesh axis), and the leaves every trial shares (one copy, no
trial axis): a LoRA model's frozen base. Without LoRA nothing is shared and every leaf has the
trial axis.

`TrialLayout` turns a single run's state layout into the population's and moves between the
two: one trial's state out of the population's (`take`, for its checkpoint), the trials'
states into it (`stack`, after a restore), and the vmap axes of the population's programs;
`initializer` makes the population's first state.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from toolkit import hf
from toolkit.training import init_from, state as state_lib


def shared_leaves(state) -> dict:
  """A tree like the train state `state` (arrays or abstract ones): True at the leaves every
  trial shares (the frozen parameters of a model with LoRA adapters), False elsewhere."""
  trainable, frozen = state_lib.split_trainable(state["params"])
  flags = jax.tree.map(lambda _: False, state)
  flags["params"] = state_lib.combine(jax.tree.map(lambda _: False, trainable),
                                      jax.tree.map(lambda _: True, frozen))
  return flags


def _prefixed(sharding_: NamedSharding) -> NamedSharding:
  return NamedSharding(sharding_.mesh, PartitionSpec("population", *sharding_.spec))


@dataclasses.dataclass(frozen=True)
class TrialLayout:
  """The population state of `trials` trials around a single run's layout (`single`, a
  `state.StateLayout` on the population's mesh)."""
  trials: int
  shared: dict                 # shared_leaves of the single state
  single_shardings: dict
  shardings: dict              # the population state's
  abstract: dict               # the population state's, with shardings
  axes: dict                   # vmap axes: 0 (the trial axis) or None (shared)

  @classmethod
  def of(cls, single, trials: int) -> TrialLayout:
    shared = shared_leaves(single.abstract)
    shardings = jax.tree.map(lambda s, is_shared: s if is_shared else _prefixed(s),
                             single.shardings, shared)
    abstract = jax.tree.map(
        lambda a, s, is_shared: jax.ShapeDtypeStruct(a.shape if is_shared else (trials,)
                                                     + a.shape, a.dtype, sharding=s),
        single.abstract, shardings, shared)
    axes = jax.tree.map(lambda is_shared: None if is_shared else 0, shared)
    return cls(trials=trials, shared=shared, single_shardings=single.shardings,
               shardings=shardings, abstract=abstract, axes=axes)

  @property
  def shares(self) -> bool:
    """Whether any leaf is shared (a LoRA population)."""
    return any(jax.tree.leaves(self.shared))

  def own(self, tree) -> list:
    """The leaves of a state-shaped `tree` that each trial holds its own of, in tree order."""
    return [x for x, is_shared in zip(jax.tree.leaves(tree), jax.tree.leaves(self.shared))
            if not is_shared]

  def assemble(self, own: list, shared_from) -> dict:
    """A state from its own leaves `own` and the shared ones of the state `shared_from`."""
    leaves, treedef = jax.tree.flatten(shared_from)
    own = iter(own)
    return treedef.unflatten([x if is_shared else next(own)
                              for x, is_shared in zip(leaves, jax.tree.leaves(self.shared))])

  def take_fn(self) -> Callable:
    """(population state, i) -> trial i's state in a single run's layout; the shared leaves
    are the population's own arrays (not copied)."""
    pick = jax.jit(lambda own, i: [x[i] for x in own],
                   in_shardings=(self.own(self.shardings), None),
                   out_shardings=self.own(self.single_shardings))
    return lambda state, i: self.assemble(pick(self.own(state), i), state)

  def stack_fn(self) -> Callable:
    """(*single states) -> the population state, the shared leaves from the first."""
    stack = jax.jit(lambda *owns: [jnp.stack(xs) for xs in zip(*owns)],
                    out_shardings=self.own(self.shardings))
    return lambda *states: self.assemble(stack(*(self.own(s) for s in states)), states[0])


def initializer(config, setup, layout: TrialLayout, hparams, vary: bool) -> Callable:
  """() -> the population's initial state: every trial's from its seed (and its init_std when
  `vary`), around the weights of `train.init_from` when it is set (read once). The shared
  leaves (a LoRA base) are those weights, or else the first trial's seed draws them."""
  model_cfg, single = setup.spec.model, setup.layout
  folder = init_from.parse(config.train.get("init_from", ""))
  init_own = _vmapped_init(setup, layout, vary)

  def read_params():
    if folder is None:
      return {}
    source = hf.HFFolder(folder, init_from.FIELD)
    init_from.check_model(source, model_cfg)
    return hf.read_params(source, model_cfg, single.shardings["params"])

  def init():
    read, seeds, stds = read_params(), hparams["seed"], hparams["model.init_std"]
    if not layout.shares:
      return layout.assemble(init_own(seeds, stds, read), single.abstract)
    # A LoRA population: the trials' own leaves from their seeds, the base once.
    base = read or jax.jit(lambda seed: state_lib.split_trainable(
        state_lib.init_params(model_cfg, seed))[1],
        out_shardings=state_lib.split_trainable(single.shardings["params"])[1])(seeds[0])
    return layout.assemble(init_own(seeds, stds, {}),
                           {**single.abstract, "params": state_lib.combine(
                               base, single.abstract["params"])})
  return init


def _vmapped_init(setup, layout: TrialLayout, vary: bool):
  """(seeds, init_stds, read) -> every trial's own leaves of its initial state, jitted; `read`
  (parameters from train.init_from, or {}) replaces the init's where it has them."""
  model_cfg = setup.spec.model

  def init_one(seed, init_std, read):
    if read:
      init = state_lib.init_params(model_cfg, seed)
      return layout.own(state_lib._around(  # pylint: disable=protected-access
          state_lib.combine(read, init), setup.optimizer, seed))
    if not vary:
      return layout.own(state_lib._init(  # pylint: disable=protected-access
          model_cfg, setup.optimizer, seed))
    # The init is affine in init_std (every parameter is a constant or init_std x a fixed
    # draw), so one draw at 0 and one at 1 give every trial's init with its own scale.
    init = state_lib._init  # pylint: disable=protected-access
    at = lambda std: init(dataclasses.replace(model_cfg, init_std=std), setup.optimizer, seed)
    zero, one = at(0.0), at(1.0)
    params = jax.tree.map(lambda p0, p1: (p0 + init_std * (p1 - p0)).astype(p0.dtype),
                          zero["params"], one["params"])
    return layout.own({**zero, "params": params,
                       "opt_state": setup.optimizer.init(state_lib.split_trainable(params)[0])})

  vmapped = jax.vmap(init_one, in_axes=(0, 0, None), spmd_axis_name="population")
  return jax.jit(vmapped, out_shardings=layout.own(layout.shardings))
