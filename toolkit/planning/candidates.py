"""The layouts `python -m toolkit.compile --plan` tries (step 1 of `toolkit.planning.planner`):
meshes x rules presets x remat policies x micro-batch counts x attention x loss chunking, plus
context-parallel meshes for long sequences and a pipeline stage per slice across slices."""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import ml_collections

from toolkit.planning.target import Target

PRESETS = ("dp", "fsdp", "tp", "fsdp_tp", "fsdp_ep", "fsdp_tp_ep", "fsdp_cp", "fsdp_pp")
# From this many positions per sequence the planner also tries context parallelism: a sequence
# axis of 2, 4 or 8 with fsdp_cp (the attention then splits its queries' work over it).
SEQUENCE_FROM = 8192
SEQUENCES = (2, 4, 8)
# Across slices the planner also tries a pipeline with one stage per slice (fsdp_pp, the stage
# axis over DCN) and this many pipeline micro-batches per stage.
PIPELINE_MICROBATCHES = (1, 2, 4)
REMATS = ("none", "save_dots", "minimal", "save_attention", "full")
MICROBATCHES = (1, 2, 4, 8, 16, 32, 64)
ATTENTIONS = ("auto", "xla")


@dataclasses.dataclass
class Candidate:
  overrides: dict                       # dotted config field -> value
  mesh: dict[str, int] = dataclasses.field(default_factory=dict)
  status: str = "pending"               # fits / does not fit / pruned / lint / budget
  reason: str = ""
  analytic_bytes: float | None = None
  analytic_step_s: float | None = None
  compiled_bytes: float | None = None
  step_time: dict = dataclasses.field(default_factory=dict)
  compile_seconds: float | None = None
  given: bool = False                   # the layout the config already has

  @property
  def label(self) -> str:
    o = self.overrides
    mesh = "x".join(f"{k}{v}" for k, v in self.mesh.items() if v > 1) or "1"
    dcn = f" dcn {o['mesh.dcn']}" if o.get("mesh.dcn") else ""
    return (f"{o['sharding.preset']:<7} {mesh}{dcn} remat={o['model.remat']} "
            f"micro={o['train.microbatches']} attention={o['model.attention']} "
            f"chunk={o['model.loss_chunk']}"
            + (f" pipeline={o['model.pipeline_microbatches']}"
               if o.get("model.pipeline_microbatches") else "")
            + (" (given)" if self.given else ""))


def _divisors(n: int) -> list[int]:
  return [d for d in range(1, n + 1) if n % d == 0]


def enumerate_candidates(config: ml_collections.ConfigDict, target: Target,
                         presets: Sequence[str] = PRESETS, remats: Sequence[str] = REMATS,
                         microbatches: Sequence[int] = MICROBATCHES,
                         attentions: Sequence[str] = ATTENTIONS,
                         loss_chunks: Sequence[int] | None = None) -> list[Candidate]:
  """Every mesh x preset x remat x micro-batch count x attention x loss chunking worth trying
  on `target`; loss_chunks None means the config's own model.loss_chunk and 0 (off)."""
  if loss_chunks is None:
    loss_chunks = tuple(dict.fromkeys((config.model.loss_chunk, 0)))
  variants = [(a, c) for a in dict.fromkeys(attentions) for c in dict.fromkeys(loss_chunks)]
  per_slice = len(target.devices) // target.slices
  # A mixture of experts also splits its experts over an expert axis (sizes dividing both).
  n_experts = config.model.get("n_experts", 0)
  expert_sizes = [e for e in _divisors(per_slice) if n_experts % e == 0] if n_experts else [1]
  # Long sequences also split their positions (even sizes the length's 2 x CP chunks divide).
  seq_len = config.data.seq_len
  sequence_sizes = [1] + [s for s in SEQUENCES if per_slice % s == 0 and seq_len % (2 * s) == 0
                          and seq_len >= SEQUENCE_FROM]
  meshes = []
  for expert, tensor, sequence in ((e, t, q) for e in expert_sizes for q in sequence_sizes
                                   for t in _divisors(per_slice // (e * q))):
    for fsdp in _divisors(per_slice // (expert * tensor * sequence)):
      data = per_slice // (expert * tensor * sequence * fsdp)
      for preset in presets:
        # Each preset on the meshes where every axis does work: the others repeat one.
        wanted = {"dp": fsdp == 1 and tensor == 1, "fsdp": tensor == 1 and fsdp > 1,
                  "tp": fsdp == 1 and tensor > 1, "fsdp_tp": fsdp > 1 and tensor > 1,
                  "fsdp_ep": tensor == 1, "fsdp_tp_ep": tensor > 1, "fsdp_cp": tensor == 1,
                  "fsdp_pp": False}  # fsdp_pp: _pipeline_candidates, on fsdp's meshes
        if preset.endswith("_ep") != (expert > 1) or preset.endswith("_cp") != (sequence > 1):
          continue  # the *_ep (*_cp) presets exactly on meshes with an expert (sequence) axis
        if wanted[preset] or (preset in ("fsdp", "fsdp_tp") and per_slice == 1):
          mesh = {"data": data, "fsdp": fsdp, "sequence": sequence, "expert": expert,
                  "tensor": tensor}
          meshes.append((preset, {k: v for k, v in mesh.items()
                                  if not (k == "expert" and not n_experts)
                                  and not (k == "sequence" and sequence == 1)}))
  dcn_axes = ["data"] if target.slices > 1 else [""]
  batch = config.data.global_batch_size
  found = []
  for preset, mesh in meshes:
    for dcn_axis in dcn_axes + (["fsdp"] if target.slices > 1 and "fsdp" in preset else []):
      for remat in remats:
        for micro in microbatches:
          if batch % micro:
            continue
          for attention, loss_chunk in variants:
            overrides = {"mesh.ici": ",".join(f"{k}:{v}" for k, v in mesh.items()),
                         "mesh.dcn": f"{dcn_axis}:{target.slices}" if dcn_axis else "",
                         "sharding.preset": preset, "model.remat": remat,
                         "train.microbatches": micro, "model.attention": attention,
                         "model.loss_chunk": loss_chunk}
            full_mesh = {k: v * (target.slices if k == dcn_axis else 1)
                         for k, v in mesh.items()}
            found.append(Candidate(overrides=overrides, mesh=full_mesh))
  if target.slices > 1 and "fsdp_pp" in presets and not n_experts:
    found += _pipeline_candidates(meshes, target.slices, batch, remats, microbatches, variants)
  return found


def _pipeline_candidates(meshes, slices: int, batch: int, remats, microbatches, variants):
  """Across slices also a pipeline: one stage per slice over DCN (fsdp_pp on fsdp's meshes
  inside each slice), with S, 2S and 4S pipeline micro-batches (PIPELINE_MICROBATCHES)."""
  found = []
  for preset, mesh in meshes:
    if preset != "fsdp":
      continue
    for remat in remats:
      for micro in (m for m in microbatches if batch % m == 0):
        pipes = [f * slices for f in PIPELINE_MICROBATCHES if (batch // micro) % (f * slices) == 0]
        for pipe in pipes:
          for attention, loss_chunk in variants:
            overrides = {"mesh.ici": ",".join(f"{k}:{v}" for k, v in {"stage": 1, **mesh}.items()),
                         "mesh.dcn": f"stage:{slices}", "sharding.preset": "fsdp_pp",
                         "model.remat": remat, "train.microbatches": micro,
                         "model.pipeline_microbatches": pipe, "model.attention": attention,
                         "model.loss_chunk": loss_chunk}
            found.append(Candidate(overrides=overrides, mesh={"stage": slices, **mesh}))
  return found
