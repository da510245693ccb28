"""Meshes, logical sharding rules and sharding reports. This package knows nothing about models
or the training loop: models speak logical axis names, rules map those names onto mesh axes,
and the mesh maps mesh axes onto devices.

- `axes`: the canonical logical axis names, one line of meaning each;
- `mesh`: device meshes from ordered (axis, size) pairs, inside a slice (ICI) and across slices
  (DCN);
- `rules`: the rules presets, mesh axes per logical axis, for parameters at rest and for
  activations in compute;
- `report`: the per-run table of every parameter's logical axes, PartitionSpec and bytes;
- `per_device`: per-device code under the active rules (`jax.shard_map` by logical axes);
- `sequence`: the load-balanced order of positions for context parallelism;
- `errors`: the one error type for mistakes in meshes and rules.
"""
from sharding import sequence
from sharding.axes import LOGICAL_AXES
from sharding.errors import ShardingError
from sharding.mesh import MESH_AXES, make_mesh, parse_axis_sizes
from sharding.rules import (PRESETS, Rules, activation_rules, constrain,
                            constrain_grad)
from sharding.report import ShardingReport, sharding_report
from sharding.per_device import active_axes, active_mesh, active_ways, shard_map, take_rows

__all__ = [
    "LOGICAL_AXES", "MESH_AXES", "PRESETS", "Rules", "ShardingError", "ShardingReport",
    "activation_rules", "active_axes", "active_mesh", "active_ways", "constrain",
    "constrain_grad", "make_mesh", "parse_axis_sizes", "sequence", "shard_map", "sharding_report",
    "take_rows",
]
