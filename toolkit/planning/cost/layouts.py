"""The layout toolkit.cost prices on each target: the planner's candidates (meshes x presets x
remat x micro-batches, `toolkit.planning.candidates`) linted and estimated by the analytic model
(`toolkit.planning.planner.prepare`), nothing compiled; the fastest by the estimate whose memory
fits the chip wins, ties (within the planner's 1 %) going to the least memory.

The estimates run on host devices that stand in for the target's chips: a TPU slice or a GPU
cluster is a count of devices with the table's memory, peak FLOP/s and bandwidths, and the
attention the step would run there (splash on TPU, cuDNN on NVIDIA GPUs). A GPU cluster's
nodes are its slices: NVLink inside a node is the mesh's ICI part, the network between nodes
its DCN part, over which the planner puts the data or fsdp axis.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import jax
import ml_collections

from toolkit import accelerators
from toolkit.errors import ConfigError
from toolkit.planning import aot, candidates as candidates_lib, estimate, planner
from toolkit.planning import plan as plan_lib
from toolkit.planning.target import Target, TargetError
from toolkit.training import config as config_lib

# What the cost search tries: the fsdp family (every preset shards the batch; the planner's
# tp/dp-only meshes are never the cheapest at pod scale and multiply the candidates).
PRESETS = ("fsdp", "fsdp_tp", "fsdp_ep", "fsdp_tp_ep", "fsdp_cp")
ATTENTIONS = ("auto",)


@dataclasses.dataclass(frozen=True)
class Chips:
  """A cost target: its name, chip count, slices (GPU: nodes), the family's sizes (for a
  deadline) and the price table's key."""
  name: str
  chips: int
  slices: int
  family_sizes: tuple[int, ...]
  price_key: str
  platform: str                   # tpu or gpu
  table: object                   # accelerators.TpuType or accelerators.GpuCluster


def parse_target(name: str) -> Chips:
  """'v5p-128' (with an optional 'xS' slice count: 'v5e-256x2') or 'h100x64'."""
  text = str(name).strip()
  try:
    if accelerators.is_gpu_name(text):
      c = accelerators.gpu_cluster(text)
      per_node = c.gpu.gpus_per_node
      sizes = tuple(sorted({1, 2, 4, per_node, *(per_node * k for k in range(1, 1025))}))
      return Chips(c.name, c.count, c.nodes, sizes, c.gpu.name, "gpu", c)
    base, sep, count = text.rpartition("x")
    slices = 1
    if sep and count.isdigit() and "-" in base:
      text, slices = base, int(count)
    t = accelerators.accelerator(text)
  except ValueError as e:
    raise TargetError(f"--targets: {e}") from None
  if slices < 1:
    raise TargetError(f"--targets={name!r}: give at least one slice")
  sizes = tuple(sorted({c * s for c in accelerators.GENERATIONS[t.generation].chip_counts
                        for s in (1, 2, 4, 8, 16, 32)}))
  label = t.name + (f"x{slices}" if slices > 1 else "")
  return Chips(label, t.chips * slices, slices, sizes, t.generation, "tpu", t)


def stand_in(chips: Chips, devices: Sequence[jax.Device]) -> Target:
  """A Target with the first `chips.chips` host devices standing in for the target's."""
  if len(devices) < chips.chips:
    raise TargetError(f"{chips.name} needs {chips.chips} stand-in host devices; this process "
                      f"has {len(devices)} (toolkit.cost sets jax_num_cpu_devices)")
  tpu = chips.table if chips.platform == "tpu" else None
  gpu = chips.table if chips.platform == "gpu" else None
  return Target(name=chips.name, slices=chips.slices, devices=tuple(devices[:chips.chips]),
                tpu=tpu, gpu=gpu, stand_in_for=chips.platform)


@dataclasses.dataclass
class Layout:
  """The layout chosen for one target, or why none fits."""
  target: str
  candidate: candidates_lib.Candidate | None
  tried: int
  reason: str = ""
  step: dict = dataclasses.field(default_factory=dict)   # estimate.step_seconds + model FLOPs


def best_layout(config: ml_collections.ConfigDict, target: Target,
                remats: Sequence[str] = candidates_lib.REMATS,
                microbatches: Sequence[int] = candidates_lib.MICROBATCHES) -> Layout:
  """The fastest layout that fits by the analytic estimate (see the module docstring)."""
  try:
    config, _ = aot.scale_config(config, target)
  except aot.LintError as e:
    raise ConfigError(str(e)) from None
  found = candidates_lib.enumerate_candidates(
      config, target, presets=PRESETS, remats=remats, microbatches=microbatches,
      attentions=ATTENTIONS, loss_chunks=[config.model.loss_chunk])
  planner.prepare(config, found, target)
  fitting = [c for c in found if c.status == "pending"]
  if not fitting:
    hbm = (target.hbm_bytes_per_device or 0) / 2**30
    reason = (f"no layout fits {hbm:.4g} GiB per chip by the estimate ({len(found)} tried)"
              if found else "no layout: the batch or the model does not divide these chips")
    return Layout(target.name, None, len(found), reason)
  fastest = min(c.analytic_step_s for c in fitting)
  best = min(fitting, key=lambda c: (c.analytic_step_s > fastest * (1 + planner.TIE),
                                     c.analytic_bytes, c.analytic_step_s, c.label))
  return Layout(target.name, best, len(found), step=_step(config, best, target))


def _step(config: ml_collections.ConfigDict, c: candidates_lib.Candidate,
          target: Target) -> dict:
  """The chosen layout's step-time parts and its model FLOPs per device."""
  import sharding  # pylint: disable=g-import-not-at-top
  from toolkit.training import state as state_lib  # pylint: disable=g-import-not-at-top
  cfg = plan_lib.apply_overrides(config, c.overrides)
  spec = config_lib.resolve(cfg, list(target.devices))
  report = sharding.sharding_report(state_lib.param_entries(spec.model)[1], spec.rules,
                                    spec.mesh)
  shape = dataclasses.replace(estimate.shape_for(spec, cfg, report, target.slices),
                              platform=target.platform)
  ici, dcn = estimate.communication(shape)
  step = estimate.step_seconds(estimate.executed_flops_per_device(shape), ici, dcn,
                               target.peak_flops_per_device, target.ici_bytes_per_second,
                               target.dcn_bytes_per_second)
  model_flops = estimate.model_flops_per_step(shape) / target.chips
  tokens = cfg.data.global_batch_size * cfg.data.seq_len
  return {**step, "ici_bytes": ici, "dcn_bytes": dcn, "memory_bytes": estimate.memory(shape).total,
          "model_flops_per_device": model_flops, "tokens_per_step": tokens,
          "mfu": model_flops / target.peak_flops_per_device / step["total_s"],
          "attention": shape.attention, "mesh": dict(spec.mesh.shape),
          "global_batch_size": cfg.data.global_batch_size,
          "hbm_bytes": target.hbm_bytes_per_device, "devices": math.prod(spec.mesh.shape.values())}
