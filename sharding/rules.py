"""Rules: which mesh axes each logical axis is split over, kept apart for parameters at rest
and for activations in compute (so FSDP is a change of table, not of model code).

Each preset is one table per role with one entry per logical name (`sharding.axes`). An entry
is a tuple of mesh axes (split over their product, in order) or () for replicated. Mesh axes
that the current mesh lacks are dropped, so `batch -> (data, fsdp)` works on an fsdp-only mesh.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from collections.abc import Iterator, Mapping, Sequence

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from sharding.axes import LOGICAL_AXES
from sharding.errors import ShardingError
from sharding.mesh import MESH_AXES

Table = Mapping[str, tuple[str, ...]]

_BATCH = ("data", "fsdp")
# Every logical name starts replicated; a preset lists the ones it splits. `lora_rank` (a LoRA
# adapter's rank, a few dozen wide) is replicated in every preset: an adapter's matrices split
# along the axes they share with their weight (embed, heads, mlp).
_REPLICATED: Table = {name: () for name in LOGICAL_AXES}
# Every preset splits a population's trials over the `population` mesh axis, parameters and
# activations alike; meshes without that axis (every single run) drop it.
_TRIAL = {"trial": ("population",)}


def _table(**entries: tuple[str, ...]) -> Table:
  return {**_REPLICATED, **_TRIAL, **entries}


def _compute(**entries: tuple[str, ...]) -> Table:
  """An activation table: every preset splits token positions over the `sequence` mesh axis
  (context parallelism), which meshes without that axis drop; `kv_length` stays whole."""
  return _table(length=("sequence",), **entries)


# Expert parallelism: each device holds its share of a mixture-of-experts layer's experts
# (parameters and their compute alike), and the `expert` axis splits the batch everywhere else,
# so it is data parallel for attention and the dense layers.
_EXPERTS = {"experts": ("expert",)}
_BATCH_EP = ("data", "fsdp", "expert")
_TP = dict(heads=("tensor",), kv_heads=("tensor",), mlp=("tensor",), vocab=("tensor",))

# preset -> (parameter table, activation table)
PRESETS: dict[str, tuple[Table, Table]] = {
    # Data parallel: parameters replicated, the batch split over every batch-like axis.
    "dp": (_table(), _compute(batch=_BATCH)),
    # ZeRO-3 style: parameters stored split along `embed` over fsdp, gathered for compute.
    "fsdp": (_table(embed=("fsdp",)), _compute(batch=_BATCH)),
    # Megatron-style tensor parallel: heads, mlp and vocab split over tensor, weights and
    # activations alike; the residual stream stays whole.
    "tp": (
        _table(heads=("tensor",), kv_heads=("tensor",), mlp=("tensor",), vocab=("tensor",)),
        _compute(batch=_BATCH, heads=("tensor",), kv_heads=("tensor",), mlp=("tensor",),
                 vocab=("tensor",)),
    ),
    # Both: fsdp over the residual width at rest, tensor over heads/mlp/vocab.
    "fsdp_tp": (
        _table(embed=("fsdp",), heads=("tensor",), kv_heads=("tensor",), mlp=("tensor",),
               vocab=("tensor",)),
        _compute(batch=_BATCH, heads=("tensor",), kv_heads=("tensor",), mlp=("tensor",),
                 vocab=("tensor",)),
    ),
    # fsdp with context parallelism: parameters stored split over fsdp and sequence together
    # (so a sequence axis holds no replicated copies), the batch over data/fsdp and the token
    # positions over sequence in compute.
    "fsdp_cp": (_table(embed=("fsdp", "sequence")), _compute(batch=_BATCH)),
    # fsdp with pipeline stages: the stacked layers stored and run split over stage (each
    # stage holds its consecutive layers), the rest as fsdp (models/pipeline.py).
    "fsdp_pp": (_table(embed=("fsdp",), layers=("stage",)),
                _compute(batch=_BATCH, layers=("stage",))),
    # fsdp plus expert parallelism: experts split over `expert`, the batch also over it.
    "fsdp_ep": (_table(embed=("fsdp",), **_EXPERTS), _compute(batch=_BATCH_EP, **_EXPERTS)),
    # fsdp_tp plus expert parallelism; each expert's hidden width is split over tensor.
    "fsdp_tp_ep": (_table(embed=("fsdp",), **_TP, **_EXPERTS),
                   _compute(batch=_BATCH_EP, **_TP, **_EXPERTS)),
}


def parse_overrides(text: str, field: str) -> dict[str, tuple[str, ...]]:
  """Parses ``"kv_heads=none,batch=data+fsdp"`` into ``{"kv_heads": (), "batch": ("data", "fsdp")}``."""
  overrides: dict[str, tuple[str, ...]] = {}
  for item in (part.strip() for part in text.split(",")):
    if not item:
      continue
    name, sep, value = item.partition("=")
    name, value = name.strip(), value.strip()
    if not sep or not name:
      raise ShardingError(
          f"{field}: entry {item!r} is not 'logical=mesh_axis'; write e.g. 'mlp=tensor,vocab=none'")
    if name not in LOGICAL_AXES:
      raise ShardingError(
          f"{field}: unknown logical axis {name!r}; known: {', '.join(LOGICAL_AXES)}")
    # One entry per logical name, as in the tables: a second one would silently win.
    if name in overrides:
      raise ShardingError(f"{field}: logical axis {name!r} is listed twice; list each once")
    axes = () if value.lower() in ("", "none") else tuple(a.strip() for a in value.split("+"))
    for axis in axes:
      if axis not in MESH_AXES:
        raise ShardingError(
            f"{field}: {name}={value!r} names unknown mesh axis {axis!r}; "
            f"use one of {', '.join(MESH_AXES)} or 'none'")
    if len(set(axes)) < len(axes):
      raise ShardingError(
          f"{field}: {name}={value!r} repeats a mesh axis; name each mesh axis once")
    overrides[name] = axes
  return overrides


@dataclasses.dataclass(frozen=True)
class Rules:
  """A parameter table and an activation table, each logical name -> mesh axes."""
  params: Table
  activations: Table
  name: str = "custom"

  def __hash__(self) -> int:
    # The tables are dicts; hashing their items lets Rules key JAX's jit cache (see below).
    return hash((self.name, tuple(sorted(self.params.items())),
                 tuple(sorted(self.activations.items()))))

  @classmethod
  def preset(cls, name: str, param_overrides: str = "", activation_overrides: str = "") -> Rules:
    if name not in PRESETS:
      raise ShardingError(
          f"sharding.preset={name!r} is unknown; choose one of {', '.join(PRESETS)}")
    params, activations = PRESETS[name]
    return cls(
        params={**params, **parse_overrides(param_overrides, "sharding.param_overrides")},
        activations={**activations,
                     **parse_overrides(activation_overrides, "sharding.activation_overrides")},
        name=name)

  def param_spec(self, logical_axes: Sequence[str | None], mesh: Mesh,
                 shape: Sequence[int] | None = None, what: str = "parameter") -> PartitionSpec:
    return _resolve(self.params, logical_axes, mesh, shape, what, "sharding.param_overrides")

  def activation_spec(self, logical_axes: Sequence[str | None], mesh: Mesh,
                      shape: Sequence[int] | None = None, what: str = "activation") -> PartitionSpec:
    return _resolve(self.activations, logical_axes, mesh, shape, what,
                    "sharding.activation_overrides")


def _resolve(table: Table, logical_axes: Sequence[str | None], mesh: Mesh,
             shape: Sequence[int] | None, what: str, knob: str) -> PartitionSpec:
  """Maps logical axes to a PartitionSpec, failing on unknown names, reused mesh axes and
  dimensions that the mesh axes do not divide."""
  if shape is not None and len(shape) != len(logical_axes):
    raise ShardingError(
        f"{what}: {len(logical_axes)} logical axes {tuple(logical_axes)} for a "
        f"{len(shape)}-d array of shape {tuple(shape)}; give one logical name (or None) "
        f"per dimension")
  used: dict[str, str] = {}
  entries: list[str | tuple[str, ...] | None] = []
  for dim, name in enumerate(logical_axes):
    if name is None:
      entries.append(None)
      continue
    if name not in table:
      raise ShardingError(
          f"{what}: unknown logical axis {name!r}; known: {', '.join(sorted(table))}")
    axes = tuple(axis for axis in table[name] if axis in mesh.shape)
    for axis in axes:
      if axis in used:
        raise ShardingError(
            f"{what}: logical axes {used[axis]!r} and {name!r} both map to mesh axis {axis!r}; "
            f"one array cannot use a mesh axis twice; change one of them with {knob}")
      used[axis] = name
    if shape is not None and axes:
      ways = math.prod(mesh.shape[axis] for axis in axes)
      if shape[dim] % ways:
        split = "x".join(f"{axis}={mesh.shape[axis]}" for axis in axes)
        raise ShardingError(
            f"{what}: dimension {dim} ({name}) has size {shape[dim]}, not divisible by "
            f"{split} ({ways} ways); set {knob}='{name}=none' or change the mesh or model size")
    entries.append(None if not axes else axes[0] if len(axes) == 1 else axes)
  while entries and entries[-1] is None:
    entries.pop()
  return PartitionSpec(*entries)


# A JAX user context rather than a plain contextvar: its value is part of jit's cache key, so a
# function traced outside `activation_rules` is traced again inside it instead of silently
# reusing the unconstrained trace.
_ACTIVE = jax.make_user_context(default_value=None)


@contextlib.contextmanager
def activation_rules(rules: Rules, mesh: Mesh) -> Iterator[None]:
  """Makes `constrain` place activations on `mesh` by `rules` while tracing inside this block."""
  with _ACTIVE((rules, mesh)):
    yield


def active() -> tuple[Rules, Mesh] | None:
  """(rules, mesh) of the enclosing `activation_rules`, or None outside them."""
  return _ACTIVE.value


@contextlib.contextmanager
def no_rules() -> Iterator[None]:
  """Turns `activation_rules` off inside the block (per-device code sees local blocks)."""
  with _ACTIVE(None):
    yield


def constrain(x: jax.Array, logical_axes: Sequence[str | None]) -> jax.Array:
  """Sharding constraint by logical axes; a no-op outside `activation_rules` (e.g. unsharded)."""
  active = _ACTIVE.value
  if active is None:
    return x
  rules, mesh = active
  spec = rules.activation_spec(logical_axes, mesh, x.shape)
  return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))


def constrain_grad(x: jax.Array, logical_axes: Sequence[str | None]) -> jax.Array:
  """`x` unchanged, its gradient constrained by logical axes as `constrain` would (a no-op
  outside `activation_rules`): lays out a gradient that XLA would otherwise lay out from the
  forward's operands, without touching the forward pass."""
  active = _ACTIVE.value
  if active is None:
    return x
  rules, mesh = active
  return _grad_constrained(x, NamedSharding(mesh, rules.activation_spec(logical_axes, mesh,
                                                                        x.shape)))


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _grad_constrained(x: jax.Array, _: NamedSharding) -> jax.Array:
  return x


def _grad_constrained_fwd(x: jax.Array, _: NamedSharding):
  return x, None


def _grad_constrained_bwd(grad_sharding: NamedSharding, _, g: jax.Array):
  return (jax.lax.with_sharding_constraint(g, grad_sharding),)


_grad_constrained.defvjp(_grad_constrained_fwd, _grad_constrained_bwd)
