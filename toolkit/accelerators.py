"""Cloud TPU accelerator types: chips, hosts, topology, memory, peak FLOP/s, bandwidths.

One explicit table, `TPU_TYPES` (accelerator name -> frozen `TpuType`), generated from the
per-generation constants in `GENERATIONS` by the slice-shape rules below. The launchers
(`scripts/launch/tpu_pod.py`, `scripts/launch/gke_jobset.py`) validate and size their commands from it; the
ahead-of-time compiler takes `TpuType.topology_desc_kwargs()` for
`jax.experimental.topologies.get_topology_desc`. Nothing here imports JAX.

  accelerator("v5litepod-16")  # 16 chips, 2 hosts x 8 chips, topology 4x4
  accelerator("v5e-16")        # the same type (GKE / MaxText spelling)
  python -m toolkit.topology v5p-128 v5e-16   # print their rows; no names: the whole table

Naming: v4-N and v5p-N count TensorCores (2 per chip, "megacore": JAX sees one device per
chip), so chips = N/2; v5litepod-N (alias v5e-N) and v6e-N count chips.
"""
from __future__ import annotations

import dataclasses
import difflib

GiB = 2**30


def human_bytes(n: float) -> str:
  """`n` bytes as B, KiB, MiB or GiB (two decimals past B)."""
  for unit in ("B", "KiB", "MiB", "GiB"):
    if n < 1024 or unit == "GiB":
      return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
    n /= 1024
  raise AssertionError


@dataclasses.dataclass(frozen=True)
class Generation:
  """Per-chip constants of one TPU generation and the conventions of its names.

  Bandwidths are bytes/s per chip: ICI counts all of a chip's ports in both directions (the
  figure Cloud TPU docs publish); DCN is the chip's share of its host's data-center network.
  """
  name: str                       # "v5e"
  accelerator_prefix: str         # the Cloud TPU API's name: "v5litepod" in "v5litepod-16"
  aliases: tuple[str, ...]        # other spellings of the prefix: ("v5e",)
  tensorcores_per_chip: int       # 2: the name counts TensorCores; 1: it counts chips
  chip_counts: tuple[int, ...]    # slice sizes in the table (chips)
  chips_per_host: int             # chips per TPU VM in multi-host slices
  single_host_max_chips: int      # slices up to this many chips run on one VM
  torus_dims: int                 # 3: AxBxC (v4, v5p); 2: AxB (v5e, v6e)
  hbm_bytes_per_chip: int
  hbm_bytes_per_second_per_chip: float
  peak_bf16_flops_per_chip: float
  ici_bytes_per_second_per_chip: float
  dcn_bytes_per_second_per_chip: float
  runtime_version: str            # `gcloud compute tpus tpu-vm create --version`
  device_kind: str                # jax.devices()[0].device_kind on this chip
  libtpu_name: str                # the prefix of libtpu's topology name: "v5e" in "v5e:4x4"
  chip_config_name: str           # libtpu: "megacore" (2 TensorCores as one device) or "default"
  gke_accelerator: str            # node label cloud.google.com/gke-tpu-accelerator
  gke_machine_type: str           # machine type of the multi-host GKE node pool
  gke_chips_per_node: int         # chips per GKE node in multi-host node pools


def _powers_of_two(first: int, last: int) -> tuple[int, ...]:
  return tuple(2**k for k in range(first.bit_length() - 1, last.bit_length()))


# Sources (Cloud TPU docs, cloud.google.com/tpu/docs/{v4,v5e,v5p,v6e}, read 2026-11):
#   HBM bandwidth per chip: v4 1,200 GB/s, v5e 819 GB/s, v5p 2,765 GB/s, v6e 1,638 GB/s.
#   v4:  275 TFLOP/s bf16, 32 GiB HBM2 per chip, 4 chips per host, pod of 4096 chips (3D).
#        ICI and DCN per chip are not published for v4: ICI estimated as 6 links x 45 GB/s each
#        way ("How to Scale Your Model", ch. 2); DCN assumed equal to v5p's 50 Gbps per chip.
#   v5e: 197 TFLOP/s, 16 GiB, 400 GB/s bidirectional ICI per chip (4 ports), 8 chips per host
#        for slices of >= 16 chips (v5litepod-1/4/8 are one VM), 2 x 100 Gbps NIC per host
#        (= 25 Gbps per chip; 6.4 Tbps per 256-chip pod).
#   v5p: 459 TFLOP/s, 95 GiB, 1200 GB/s bidirectional ICI per chip, 50 Gbps DCN per chip,
#        4 chips per host (ct5p-hightpu-4t).
#   v6e: 918 TFLOP/s, 32 GiB, 800 GB/s bidirectional ICI per chip (4 ports), 8 chips per host
#        for slices of >= 16 chips (v6e-1/4/8 are one VM); DCN 100 Gbps per chip (secondary
#        sources; the v6e page gives pod figures only).
# libtpu topology names and chip configs follow MaxText's accelerator_to_spec_map (v5p is
# "v5:AxBxC"); GKE labels and machine types follow GKE's "Plan TPUs" page and XPK, whose
# multi-host v5e/v6e node pools have 4 chips per node (ct5lp-hightpu-4t, ct6e-standard-4t).
# Runtime versions: Cloud TPU's JAX table (tpu-ubuntu2204-base; v2-alpha-tpuv6e for v6e).
GENERATIONS: dict[str, Generation] = {
    "v4": Generation(
        name="v4", accelerator_prefix="v4", aliases=(), tensorcores_per_chip=2,
        chip_counts=_powers_of_two(4, 2048), chips_per_host=4, single_host_max_chips=4,
        torus_dims=3, hbm_bytes_per_chip=32 * GiB, hbm_bytes_per_second_per_chip=1200e9,
        peak_bf16_flops_per_chip=275e12,
        ici_bytes_per_second_per_chip=6 * 2 * 45e9, dcn_bytes_per_second_per_chip=50e9 / 8,
        runtime_version="tpu-ubuntu2204-base", device_kind="TPU v4", libtpu_name="v4",
        chip_config_name="megacore", gke_accelerator="tpu-v4-podslice",
        gke_machine_type="ct4p-hightpu-4t", gke_chips_per_node=4),
    "v5e": Generation(
        name="v5e", accelerator_prefix="v5litepod", aliases=("v5e",), tensorcores_per_chip=1,
        chip_counts=(1,) + _powers_of_two(4, 256), chips_per_host=8, single_host_max_chips=8,
        torus_dims=2, hbm_bytes_per_chip=16 * GiB, hbm_bytes_per_second_per_chip=819e9,
        peak_bf16_flops_per_chip=197e12,
        ici_bytes_per_second_per_chip=400e9, dcn_bytes_per_second_per_chip=25e9 / 8,
        runtime_version="tpu-ubuntu2204-base", device_kind="TPU v5 lite", libtpu_name="v5e",
        chip_config_name="default", gke_accelerator="tpu-v5-lite-podslice",
        gke_machine_type="ct5lp-hightpu-4t", gke_chips_per_node=4),
    "v5p": Generation(
        name="v5p", accelerator_prefix="v5p", aliases=(), tensorcores_per_chip=2,
        chip_counts=_powers_of_two(4, 4096), chips_per_host=4, single_host_max_chips=4,
        torus_dims=3, hbm_bytes_per_chip=95 * GiB, hbm_bytes_per_second_per_chip=2765e9,
        peak_bf16_flops_per_chip=459e12,
        ici_bytes_per_second_per_chip=1200e9, dcn_bytes_per_second_per_chip=50e9 / 8,
        runtime_version="tpu-ubuntu2204-base", device_kind="TPU v5", libtpu_name="v5",
        chip_config_name="megacore", gke_accelerator="tpu-v5p-slice",
        gke_machine_type="ct5p-hightpu-4t", gke_chips_per_node=4),
    "v6e": Generation(
        name="v6e", accelerator_prefix="v6e", aliases=(), tensorcores_per_chip=1,
        chip_counts=(1,) + _powers_of_two(4, 256), chips_per_host=8, single_host_max_chips=8,
        torus_dims=2, hbm_bytes_per_chip=32 * GiB, hbm_bytes_per_second_per_chip=1638e9,
        peak_bf16_flops_per_chip=918e12,
        ici_bytes_per_second_per_chip=800e9, dcn_bytes_per_second_per_chip=100e9 / 8,
        runtime_version="v2-alpha-tpuv6e", device_kind="TPU v6 lite", libtpu_name="v6e",
        chip_config_name="default", gke_accelerator="tpu-v6e-slice",
        gke_machine_type="ct6e-standard-4t", gke_chips_per_node=4),
}


@dataclasses.dataclass(frozen=True)
class TpuType:
  """One Cloud TPU accelerator type (a single slice). Bytes and bytes/s per chip."""
  name: str                       # the Cloud TPU API name: "v5litepod-16"
  generation: str                 # key of GENERATIONS: "v5e"
  chips: int
  tensorcores: int
  hosts: int                      # TPU VMs in the slice (Cloud TPU API / gcloud tpu-vm)
  chips_per_host: int
  topology: str                   # physical chip grid: "4x4", "2x2x1"
  hbm_bytes_per_chip: int
  hbm_bytes_per_second_per_chip: float
  peak_bf16_flops_per_chip: float
  ici_bytes_per_second_per_chip: float
  dcn_bytes_per_second_per_chip: float
  runtime_version: str
  device_kind: str
  libtpu_topology_name: str       # get_topology_desc(topology_name=...): "v5e:4x4"
  chip_config_name: str
  chips_per_host_bounds: tuple[int, int, int]  # the host tile libtpu compiles for
  wrap: tuple[bool, bool, bool]   # torus wraparound links per dimension
  gke_accelerator: str
  gke_machine_type: str
  gke_chips_per_node: int         # GKE multi-host node pools: chips per node (= per pod)

  @property
  def topology_dims(self) -> tuple[int, ...]:
    return tuple(int(d) for d in self.topology.split("x"))

  @property
  def gke_nodes(self) -> int:
    """Kubernetes nodes (= pods of a JobSet job) per slice on GKE."""
    return self.chips // self.gke_chips_per_node

  @property
  def hbm_bytes(self) -> int:
    return self.hbm_bytes_per_chip * self.chips

  @property
  def peak_bf16_flops(self) -> float:
    return self.peak_bf16_flops_per_chip * self.chips

  def topology_desc_kwargs(self, num_slices: int = 1) -> dict:
    """Keyword arguments of `jax.experimental.topologies.get_topology_desc` for this type.

    The host tile is libtpu's (2x2x1 chips, as MaxText uses for every multi-chip type); it
    sets the simulated process count of the compile, not the compiled program.
    """
    return dict(platform="tpu", topology_name=self.libtpu_topology_name,
                chip_config_name=self.chip_config_name,
                chips_per_host_bounds=self.chips_per_host_bounds, num_slices=num_slices,
                wrap=self.wrap)


def _grid(chips: int, torus_dims: int) -> tuple[int, ...]:
  """The slice shape Cloud TPU gives a power-of-two chip count: as square/cubic as it goes,
  larger dimensions last (16 -> 4x4, 8 -> 2x4; 3D: 4 -> 2x2x1, 16 -> 2x2x4, 32 -> 2x4x4)."""
  k = chips.bit_length() - 1
  if torus_dims == 3 and chips == 4:
    return (2, 2, 1)
  return tuple(2 ** (k // torus_dims + (1 if i >= torus_dims - k % torus_dims else 0))
               for i in range(torus_dims))


def _tpu_type(gen: Generation, chips: int) -> TpuType:
  dims = _grid(chips, gen.torus_dims)
  single_host = chips <= gen.single_host_max_chips
  chips_per_host = chips if single_host else gen.chips_per_host
  if gen.torus_dims == 3:
    # A 3D slice closes into a torus when every dimension is a multiple of 4 (full cubes).
    wrap = (all(d % 4 == 0 for d in dims),) * 3
  else:
    # 2D slices wrap along a dimension spanning the whole 16-chip side of the pod.
    wrap = (dims[0] == 16, dims[1] == 16, False)
  gke_chips_per_node = 1 if chips == 1 else gen.gke_chips_per_node
  # A one-chip slice is the "-1t" machine of the family (ct5lp-hightpu-1t, ct6e-standard-1t).
  gke_machine_type = (gen.gke_machine_type[:-2] + "1t") if chips == 1 else gen.gke_machine_type
  return TpuType(
      name=f"{gen.accelerator_prefix}-{chips * gen.tensorcores_per_chip}",
      generation=gen.name, chips=chips, tensorcores=chips * gen.tensorcores_per_chip,
      hosts=chips // chips_per_host, chips_per_host=chips_per_host,
      topology="x".join(map(str, dims)), hbm_bytes_per_chip=gen.hbm_bytes_per_chip,
      hbm_bytes_per_second_per_chip=gen.hbm_bytes_per_second_per_chip,
      peak_bf16_flops_per_chip=gen.peak_bf16_flops_per_chip,
      ici_bytes_per_second_per_chip=gen.ici_bytes_per_second_per_chip,
      dcn_bytes_per_second_per_chip=gen.dcn_bytes_per_second_per_chip,
      runtime_version=gen.runtime_version, device_kind=gen.device_kind,
      libtpu_topology_name=f"{gen.libtpu_name}:{'x'.join(map(str, dims))}",
      chip_config_name=gen.chip_config_name,
      chips_per_host_bounds=(1, 1, 1) if chips == 1 else (2, 2, 1), wrap=wrap,
      gke_accelerator=gen.gke_accelerator, gke_machine_type=gke_machine_type,
      gke_chips_per_node=gke_chips_per_node)


TPU_TYPES: dict[str, TpuType] = {
    t.name: t for gen in GENERATIONS.values()
    for t in (_tpu_type(gen, chips) for chips in gen.chip_counts)}

_PREFIXES: dict[str, Generation] = {
    prefix: gen for gen in GENERATIONS.values()
    for prefix in (gen.accelerator_prefix, *gen.aliases)}


def _sizes(gen: Generation) -> str:
  return ", ".join(str(c * gen.tensorcores_per_chip) for c in gen.chip_counts)


def accelerator(name: str) -> TpuType:
  """The table entry for a Cloud TPU accelerator type ("v4-32", "v5litepod-16" or "v5e-16").

  Raises:
    ValueError: one line naming `name`, the closest known types, and the valid sizes.
  """
  key = str(name).strip().lower()
  prefix, _, size = key.rpartition("-")
  gen = _PREFIXES.get(prefix)
  if gen is not None and size.isdigit():
    found = TPU_TYPES.get(f"{gen.accelerator_prefix}-{int(size)}")
    if found is not None:
      return found
  valid = "; ".join(f"{g.accelerator_prefix}-N with N in {_sizes(g)}"
                    + (f" (also {', '.join(g.aliases)}-N)" if g.aliases else "")
                    for g in GENERATIONS.values())
  if gen is not None:
    hint = ""
    if size.isdigit() and gen.tensorcores_per_chip > 1 and int(size) in gen.chip_counts:
      hint = (f"; {gen.accelerator_prefix}-N counts TensorCores ({gen.tensorcores_per_chip} "
              f"per chip), so {size} chips is {gen.accelerator_prefix}-"
              f"{int(size) * gen.tensorcores_per_chip}")
    raise ValueError(f"unknown TPU accelerator type {name!r}: {gen.accelerator_prefix} comes "
                     f"as {gen.accelerator_prefix}-N with N in {_sizes(gen)}{hint}")
  close = difflib.get_close_matches(key, list(TPU_TYPES), n=3, cutoff=0.6)
  hint = f"did you mean {' or '.join(close)}? " if close else ""
  raise ValueError(f"unknown TPU accelerator type {name!r}; {hint}known: {valid}")


@dataclasses.dataclass(frozen=True)
class GpuType:
  """One NVIDIA data-center GPU as clusters of 8-GPU nodes use it. Bytes and bytes/s per GPU.

  Named like TPU slices by the GPUs in all: h100x64 is 8 nodes of 8 H100s. Inside a node the
  GPUs talk over NVLink (the mesh's ICI part); nodes talk over the cluster network, one NIC per
  GPU (the DCN part: each node is a "slice" of the mesh).
  """
  name: str                       # "h100"
  device_kind: str                # jax.devices()[0].device_kind
  gpus_per_node: int
  hbm_bytes_per_chip: int
  hbm_bytes_per_second_per_chip: float
  peak_bf16_flops_per_chip: float  # dense (no sparsity)
  peak_fp8_flops_per_chip: float
  ici_bytes_per_second_per_chip: float   # NVLink, both directions (as TPU ICI is counted)
  dcn_bytes_per_second_per_chip: float   # the GPU's NIC, one direction (as TPU DCN)


# Sources (NVIDIA data sheets, SXM parts, dense figures; read 2026-11): H100 SXM 80 GB HBM3,
# 989 TFLOP/s bf16, 1,979 fp8, NVLink 4 900 GB/s, HBM 3.35 TB/s; H200 SXM 141 GB HBM3e at
# 4.8 TB/s, the same compute and NVLink; HGX B200 180 GB HBM3e per GPU at 8 TB/s, 2.25 PFLOP/s
# bf16, 4.5 fp8, NVLink 5 1.8 TB/s. Between nodes one 400 Gb/s NIC per GPU (ConnectX-7 in DGX
# H100/H200 and DGX B200; Google Cloud's A3 Mega/Ultra and A4 machines carry 8 of them), i.e.
# 50 GB/s.
GPU_TYPES: dict[str, GpuType] = {g.name: g for g in (
    GpuType(name="h100", device_kind="NVIDIA H100 80GB HBM3", gpus_per_node=8,
            hbm_bytes_per_chip=80 * GiB,
            hbm_bytes_per_second_per_chip=3.35e12, peak_bf16_flops_per_chip=989e12,
            peak_fp8_flops_per_chip=1979e12, ici_bytes_per_second_per_chip=900e9,
            dcn_bytes_per_second_per_chip=400e9 / 8),
    GpuType(name="h200", device_kind="NVIDIA H200", gpus_per_node=8,
            hbm_bytes_per_chip=141 * 10**9,
            hbm_bytes_per_second_per_chip=4.8e12, peak_bf16_flops_per_chip=989e12,
            peak_fp8_flops_per_chip=1979e12, ici_bytes_per_second_per_chip=900e9,
            dcn_bytes_per_second_per_chip=400e9 / 8),
    GpuType(name="b200", device_kind="NVIDIA B200", gpus_per_node=8,
            hbm_bytes_per_chip=180 * 10**9,
            hbm_bytes_per_second_per_chip=8e12, peak_bf16_flops_per_chip=2250e12,
            peak_fp8_flops_per_chip=4500e12, ici_bytes_per_second_per_chip=1800e9,
            dcn_bytes_per_second_per_chip=400e9 / 8),
)}


@dataclasses.dataclass(frozen=True)
class GpuCluster:
  """`count` GPUs of one type: whole nodes, or part of one node (1, 2, 4 or 8 GPUs)."""
  gpu: GpuType
  count: int

  @property
  def name(self) -> str:
    return f"{self.gpu.name}x{self.count}"

  @property
  def nodes(self) -> int:
    return max(1, self.count // self.gpu.gpus_per_node)

  @property
  def gpus_per_node(self) -> int:
    return min(self.count, self.gpu.gpus_per_node)


def gpu_cluster(name: str) -> GpuCluster:
  """'h100x64' -> 64 H100s in 8 nodes of 8.

  Raises:
    ValueError: one line naming `name`, the GPU types and the counts that make whole nodes.
  """
  key = str(name).strip().lower()
  kind, sep, count = key.partition("x")
  gpu = GPU_TYPES.get(kind)
  known = ", ".join(f"{g}xN" for g in GPU_TYPES)
  if gpu is None or not sep or not count.isdigit():
    raise ValueError(f"unknown GPU cluster {name!r}: write TYPExN with N GPUs in all, "
                     f"TYPE one of {known} (e.g. h100x64: 8 nodes of 8)")
  n, per_node = int(count), gpu.gpus_per_node
  if n < 1 or (n > per_node and n % per_node) or (n < per_node and per_node % n):
    raise ValueError(f"GPU cluster {name!r}: {n} GPUs are not whole {per_node}-GPU nodes; "
                     f"use 1, 2, 4, {per_node} or a multiple of {per_node}, e.g. "
                     f"{gpu.name}x{max(per_node, -(-max(n, 1) // per_node) * per_node)}")
  return GpuCluster(gpu=gpu, count=n)


def is_gpu_name(name: str) -> bool:
  """Whether `name` spells a GPU cluster (its type before an x), valid or not."""
  return str(name).strip().lower().partition("x")[0] in GPU_TYPES


# Dense bf16 peak FLOP/s of GPUs by jax's device_kind, for MFU (the table above, and the A100).
GPU_PEAK_BF16_FLOPS: dict[str, float] = {
    "NVIDIA A100-SXM4-40GB": 312e12, "NVIDIA A100-SXM4-80GB": 312e12,
    **{g.device_kind: g.peak_bf16_flops_per_chip for g in GPU_TYPES.values()},
}


def peak_flops_per_chip(device_kind: str) -> float:
  """Dense bf16 peak of one device of `device_kind` (jax's name), or 0.0 when unknown."""
  for gen in GENERATIONS.values():
    if gen.device_kind == device_kind:
      return gen.peak_bf16_flops_per_chip
  return GPU_PEAK_BF16_FLOPS.get(device_kind, 0.0)


def format_table(types=None) -> str:
  """A text table of `types` (default: all), one row per type."""
  rows = [("type", "chips", "hosts", "chips/host", "topology", "HBM/chip", "bf16/chip",
           "ICI/chip", "DCN/chip", "libtpu topology", "GKE nodes")]
  for t in types or TPU_TYPES.values():
    rows.append((t.name, str(t.chips), str(t.hosts), str(t.chips_per_host), t.topology,
                 f"{t.hbm_bytes_per_chip / GiB:g} GiB",
                 f"{t.peak_bf16_flops_per_chip / 1e12:g} TF/s",
                 f"{t.ici_bytes_per_second_per_chip / 1e9:g} GB/s",
                 f"{t.dcn_bytes_per_second_per_chip / 1e9:g} GB/s", t.libtpu_topology_name,
                 f"{t.gke_nodes} x {t.gke_chips_per_node}"))
  widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
  return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip()
                   for row in rows)


def format_gpu_table(clusters=None) -> str:
  """A text table of GPU clusters (default: one node of each type), one row per cluster."""
  clusters = clusters or [GpuCluster(g, g.gpus_per_node) for g in GPU_TYPES.values()]
  rows = [("cluster", "GPUs", "nodes", "GPUs/node", "HBM/GPU", "bf16/GPU", "fp8/GPU",
           "NVLink/GPU", "network/GPU")]
  for c in clusters:
    g = c.gpu
    rows.append((c.name, str(c.count), str(c.nodes), str(c.gpus_per_node),
                 f"{g.hbm_bytes_per_chip / GiB:.4g} GiB",
                 f"{g.peak_bf16_flops_per_chip / 1e12:g} TF/s",
                 f"{g.peak_fp8_flops_per_chip / 1e12:g} TF/s",
                 f"{g.ici_bytes_per_second_per_chip / 1e9:g} GB/s",
                 f"{g.dcn_bytes_per_second_per_chip / 1e9:g} GB/s"))
  widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
  return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip()
                   for row in rows)
