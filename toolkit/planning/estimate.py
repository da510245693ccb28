"""Analytic per-device estimates of a training step: memory, FLOPs, communication, step time.

These are the numbers one writes on a whiteboard, next to which `toolkit.compile` puts what
the compiler reports; the planner (`toolkit.planning.planner`) uses them to prune and order candidates
before compiling any. All figures are per device (one JAX device = one chip) and per step.

Memory (bytes):
  params        the sharding report's bytes per device (exact for the rules and mesh)
  optimizer     AdamW's two moments, shaped and sharded like the trainable parameters
  gradients     one copy of the trainable parameters in their dtype; with micro-batches also a
                float32 accumulator
With LoRA adapters (models/lora.py) only the adapters train: the frozen base has no optimizer
state and no gradient, so no output-matrix gradient accumulator in the logits' share and no
gradient copy among the weights in use (the backward pass skips its weight gradients: 2 of the
6 FLOPs per weight and token, `LlamaConfig.flops_per_token`; the gradient collectives carry
only the adapters).
  activations   what the backward pass keeps per layer under the remat policy, for all layers,
                plus one layer's full set while it is recomputed or differentiated:
                  none       everything (norms, q/k/v before and after rotary, MLP hidden, and
                             with `xla` attention its probabilities: heads x length per token,
                             float32 scores and a compute-dtype copy; the kernels keep one
                             float32 softmax statistic per head instead)
                  save_dots  the layer input and the outputs of the weight matmuls
                             (`dots_with_no_batch_dims_saveable`)
                  minimal    the layer input, q/k/v, the attention output (and the kernels'
                             statistic), the MLP's gate and up projections
                  save_attention  the layer input, q/k/v and the attention output
                  full       the layer input only
  reference     post-training's frozen copy of the starting weights, when the state holds one
                (dpo/grpo.reference="frozen"): the params again
  logits        unchunked: float32 logits, their gradient and a compute-dtype copy (vocab over
                tensor); chunked (model.loss_chunk): the same for one chunk of tokens, one
                float32 logsumexp per token, the float32 gradient accumulator of the output
                matrix and the strided copy of the features
  weights_in_use  parameters gathered over fsdp and cast for compute: a layer being used, the
                next one prefetched and the gradient before it is reduce-scattered, plus the
                embedding tables
A mixture of experts (models/moe.py) counts its expert weights at E / (expert ways) per
device, k experts' hidden activations per token, and in one layer's working set the tokens
its exchange gathers (the ring: every expert-axis peer's tokens and their k copies).
Communication (bytes sent per device, ring algorithms): parameter all-gathers over fsdp
(forward and backward, per micro-batch), gradient reduce-scatter over fsdp (at the parameters'
bytes: what XLA sends when it all-reduces the compute-dtype gradient whole, as the 7b's layers
do, or reduce-scatters it and all-reduces the float32 table gradients, as the 1b's do) and
all-reduce over the other batch axes in the dtype the gradient comes in (a matmul weight's as
the cotangent of its cast to the compute dtype, the embedding tables' in the parameters' dtype
from the lookup's scatter-add and the loss's float32 accumulator: 209.83 MiB compiled for the
7b across two v5p-128 slices, 208.63 MiB so, 401.64 MiB all at float32; not over the expert
axes for expert weights, which they split), tensor-
parallel all-reduces of the residual stream (two per layer forward, two backward, two more
when `full` remat recomputes them), under context parallelism the keys and values each layer
gathers over the `sequence` axes (and their gradients' reduce-scatter), and per MoE layer the token exchange over the expert axes
(ring: an all-gather and a reduce-scatter of the tokens; ragged all-to-all or capacity: the
k assignments there and back), forward, backward and once more under a remat policy that
recomputes it (full, minimal, save_attention); the part across slices is counted for a
hierarchical algorithm.
"""
from __future__ import annotations

import dataclasses
import math


import sharding
from models import LlamaConfig, lora
from models import attention as attention_lib
from toolkit.training import config as config_lib
from toolkit.training.objectives import losses, tasks

_BYTES = {"float32": 4, "bfloat16": 2}


@dataclasses.dataclass(frozen=True)
class Shape:
  """What the estimates need to know about one run on one mesh."""
  model: LlamaConfig
  mesh_shape: dict[str, int]          # axis -> size (DCN part included)
  dcn_shape: dict[str, int]           # axis -> slices along it (empty: one slice)
  rules: sharding.Rules
  global_batch_size: int
  seq_len: int
  microbatches: int
  param_bytes_per_device: int         # from the sharding report
  param_count: int
  platform: str = "tpu"               # of the target's devices: decides model.attention=auto
  # With LoRA adapters: what trains (the adapters), per device and in all; None: everything.
  trainable_bytes_per_device: int | None = None
  trainable_count: int | None = None
  # Post-training's reference model as a frozen copy of the starting weights in the train
  # state (dpo/grpo.reference, toolkit.training.objectives.tasks `frozen_reference`): params again.
  reference_copy: bool = False

  @property
  def trainable_bytes(self) -> float:
    """Bytes per device of the parameters that train (all of them without LoRA)."""
    if self.trainable_bytes_per_device is None:
      return float(self.param_bytes_per_device)
    return float(self.trainable_bytes_per_device)

  @property
  def devices(self) -> int:
    return math.prod(self.mesh_shape.values())

  def activation_ways(self, logical: str) -> int:
    return math.prod(self.mesh_shape[a] for a in self.rules.activations.get(logical, ())
                     if a in self.mesh_shape)

  def param_ways(self, logical: str) -> int:
    return math.prod(self.mesh_shape[a] for a in self.rules.params[logical]
                     if a in self.mesh_shape)

  @property
  def work_ways(self) -> int:
    """Devices that split a step's matmuls: the batch axes x tensor (`mlp`) x context
    parallelism (`length`) x pipeline stages (`layers`); any other axis repeats the work."""
    return (self.activation_ways("batch") * self.activation_ways("mlp")
            * self.activation_ways("length") * self.activation_ways("layers"))

  @property
  def rows_per_device(self) -> float:
    """Sequences of one micro-batch that one device processes (split over batch axes)."""
    return self.global_batch_size / self.microbatches / self.activation_ways("batch")

  @property
  def tokens_per_device(self) -> float:
    """Tokens of one micro-batch that one device processes (positions split over `length`'s
    axes under context parallelism)."""
    return self.rows_per_device * self.seq_len / self.activation_ways("length")

  @property
  def attention(self) -> str:
    """The attention implementation the step runs (model.attention, `auto` resolved)."""
    m = self.model
    q_shape = (1, self.seq_len, m.n_heads, m.resolved_head_dim)
    kv_shape = (1, self.seq_len, m.n_kv_heads, m.resolved_head_dim)
    return attention_lib.resolve(m.attention, q_shape, kv_shape, m.compute_dtype,
                                 on=self.platform,
                                 split_length=self.activation_ways("length") > 1)

  @property
  def loss_chunk_positions(self) -> int:
    """Positions per chunk of the vocabulary loss; 0 when it runs over full logits."""
    if not self.model.loss_chunk:
      return 0
    return losses.split_chunk_positions(self.model.loss_chunk, int(self.rows_per_device),
                                        self.seq_len, self.activation_ways("length"))

  @property
  def gathered_kv_bytes(self) -> float:
    """Context parallelism's keys and values of one layer, gathered whole on every device
    (models.attention.gathered; ring attention holds one block at a time): 0 unsplit."""
    m = self.model
    if self.activation_ways("length") == 1 or self.attention == "ring":
      return 0.0
    kv = 2 * m.n_kv_heads * m.resolved_head_dim / self.activation_ways("kv_heads")
    return self.rows_per_device * self.seq_len * kv * _BYTES[m.compute_dtype]


@dataclasses.dataclass(frozen=True)
class Memory:
  params: float
  optimizer: float
  gradients: float
  activations: float
  logits: float
  weights_in_use: float
  reference: float = 0.0  # a frozen copy of the starting weights (Shape.reference_copy)

  @property
  def total(self) -> float:
    return (self.params + self.optimizer + self.gradients + self.activations + self.logits
            + self.weights_in_use + self.reference)

  def as_dict(self) -> dict[str, float]:
    return {**dataclasses.asdict(self), "total": self.total}


def _moe_share(m: LlamaConfig) -> float:
  """The fraction of layers that are mixtures of experts."""
  return m.n_moe_layers / m.n_layers


def _experts_per_token(m: LlamaConfig) -> float:
  """MLP widths a token uses per layer, averaged over layers (1 for a dense model)."""
  return 1 + (m.experts_per_token - 1) * _moe_share(m)


def _layer_weights_per_device(shape: Shape) -> float:
  """Matmul weights of one (average) layer a device computes with, before tensor splits:
  all of them, but only its own E / (expert ways) experts."""
  m = shape.model
  experts = _moe_share(m) * m.n_experts * 3 * m.d_model * m.mlp_dim
  return m.layer_matmul_params() - experts + experts / shape.activation_ways("experts")


def _per_token_layer_bytes(shape: Shape, policy: str) -> float:
  """Bytes per token that one layer keeps for the backward pass under `policy`."""
  m = shape.model
  a = _BYTES[m.compute_dtype]
  d, hd = m.d_model, m.resolved_head_dim
  local_heads = m.n_heads / shape.activation_ways("heads")
  heads = local_heads * hd
  kv = 2 * m.n_kv_heads * hd / shape.activation_ways("kv_heads")
  mlp = _experts_per_token(m) * m.mlp_dim / shape.activation_ways("mlp")
  carry = d * a
  # Per token: xla attention's probabilities (float32 scores and a compute-dtype copy), or
  # the kernels' float32 softmax statistic per head.
  kernel = shape.attention != "xla"
  statistics = local_heads * (4 if kernel else shape.seq_len * (4 + a))
  if policy == "full":
    return carry
  if policy == "save_dots":
    return carry + a * (heads + kv + d + 2 * mlp + d)
  if policy == "minimal":
    return carry + a * (2 * heads + kv + 2 * mlp) + (local_heads * 4 if kernel else 0)
  if policy == "save_attention":
    return carry + a * (2 * heads + kv) + (local_heads * 4 if kernel else 0)
  exchanged = _moe_share(m) * shape.activation_ways("experts") * (1 + m.experts_per_token) * d
  return (carry + a * (d + 2 * (heads + kv) + heads + 3 * d + 4 * mlp + exchanged) + statistics
          + 2 * 4 * d)  # the norms' float32 intermediates


def _logits_bytes(shape: Shape) -> float:
  """The vocabulary loss's memory (module docstring)."""
  m = shape.model
  a = _BYTES[m.compute_dtype]
  vocab = m.vocab_size / shape.activation_ways("vocab")
  tokens = shape.tokens_per_device
  chunk = shape.loss_chunk_positions
  if not chunk:
    return tokens * vocab * (4 + 4 + a)
  chunk_tokens = shape.rows_per_device * chunk / shape.activation_ways("length")
  matrix = m.vocab_size * m.d_model / shape.param_ways("vocab")
  if shape.trainable_count is not None:  # LoRA: the output matrix is frozen
    matrix = 0.0
  return chunk_tokens * vocab * (4 + 4 + a) + tokens * 4 + matrix * 4 + tokens * m.d_model * a


def memory(shape: Shape) -> Memory:
  m = shape.model
  a = _BYTES[m.compute_dtype]
  params = float(shape.param_bytes_per_device)
  trainable = shape.trainable_bytes
  gradients = trainable
  if shape.microbatches > 1:  # the float32 accumulator (LoRA adapters are float32 already)
    gradients += trainable * (4 / _BYTES[m.param_dtype] if shape.trainable_count is None else 1)
  tokens = shape.tokens_per_device
  # A pipeline stage keeps its own layers' share, for every micro-batch (GPipe).
  kept = m.n_layers / shape.activation_ways("layers") * _per_token_layer_bytes(shape, m.remat)
  working = _per_token_layer_bytes(shape, "none") if m.remat != "none" else 0.0
  # Under context parallelism one layer's keys and values gathered whole, and their
  # gradients before the reduce-scatter.
  activations = tokens * (kept + working) + 2 * shape.gathered_kv_bytes
  logits = _logits_bytes(shape)
  tensor = shape.param_ways("mlp")
  tables = 1 if m.tie_embeddings else 2
  copies = 3 if shape.trainable_count is None else 2  # LoRA: no weight gradient to hold
  weights_in_use = a * (copies * _layer_weights_per_device(shape) / tensor
                        + tables * m.vocab_size * m.d_model / shape.param_ways("vocab"))
  return Memory(params=params, optimizer=2 * trainable, gradients=gradients,
                activations=activations, logits=logits, weights_in_use=weights_in_use,
                reference=params if shape.reference_copy else 0.0)


def model_flops_per_step(shape: Shape) -> float:
  """Training FLOPs of one step by the model's formula (`LlamaConfig.flops_per_token`: causal
  attention at half the pairs), the numerator of MFU."""
  return shape.model.flops_per_token(shape.seq_len) * shape.global_batch_size * shape.seq_len


def _kernel_block(shape: Shape) -> int:
  """Queries (and keys) per block of the attention kernel that skips blocks: blockwise's
  (models.blockwise._blocks), else splash's; one block for a short sequence."""
  block = None if shape.attention == "blockwise" else attention_lib.splash_block(
      shape.seq_len, shape.seq_len)
  return min(block or attention_lib.BLOCK, shape.seq_len)


def attention_flops_per_token(shape: Shape) -> float:
  """Attention FLOPs (scores and values, all layers) one token costs as executed: forward,
  backward and what remat recomputes. `xla` computes every (query, key) pair, masked or not:
  2 matmuls forward, 4 backward. The kernels skip key blocks above the causal diagonal (n
  blocks of b: n(n+1)/2 block pairs, b(n+1)/2 keys per query, at least half of them) and
  recompute the scores in their backward pass (5 matmuls); a policy that saves their output
  (`minimal`, `save_attention`) never reruns their forward. Either is at least the model's
  count (`LlamaConfig.attention_flops_per_token`: 6 matmuls over half the keys when causal)."""
  m = shape.model
  one_matmul = 2 * m.n_layers * m.n_heads * m.resolved_head_dim * shape.seq_len
  if shape.attention == "xla":
    rerun = {"none": 0, "minimal": 1, "save_attention": 1}.get(m.remat, 2)  # scores (and values)
    return one_matmul * (2 + 4 + rerun)
  block = _kernel_block(shape)
  blocks = max(1, -(-shape.seq_len // block))
  pairs = blocks * (blocks + 1) / 2 if m.causal else blocks * blocks
  visible = pairs * block * block / shape.seq_len ** 2  # keys computed per query / seq_len
  rerun = 0 if m.remat in ("none", "minimal", "save_attention") else 2
  return one_matmul * (2 + 5 + rerun) * visible


def kernel_attention_flops_per_device(shape: Shape) -> float:
  """The attention FLOPs per device that a traced program does not show, added to its count by
  `toolkit.planning.aot`: the splash kernel's (its matmuls live inside the Pallas kernel) and
  causal blockwise attention's without a length split (its block loops are while loops whose
  trip count depends on the block index, which `aot.program_flops` leaves out). Under context
  parallelism blockwise masks by position in loops of fixed length, which the trace counts."""
  blockwise_loops = (shape.attention == "blockwise" and shape.model.causal
                     and shape.activation_ways("length") == 1)
  if shape.attention != "splash" and not blockwise_loops:
    return 0.0
  split = shape.activation_ways("batch") * shape.activation_ways("heads")
  return attention_flops_per_token(shape) * shape.global_batch_size * shape.seq_len / split


def executed_flops_per_device(shape: Shape) -> float:
  """FLOPs one device executes: the weight matmuls (6 per parameter per token) plus what remat
  recomputes of them, the attention as executed (`attention_flops_per_token`), divided over
  the devices that split the work (`Shape.work_ways`); devices that only replicate work (an
  axis no rule for that work uses) do it again. Never below the model's count per device
  (`model_flops_per_step` / devices): the same weight matmuls, at least as many attention
  pairs, plus recomputation."""
  m = shape.model
  d, hd = m.d_model, m.resolved_head_dim
  output_projection = d * m.n_heads * hd
  mlp_projection = d * m.mlp_dim * _experts_per_token(m)  # one of the MLP's (its k experts')
  recomputed = {  # weight matmul parameters each policy runs again in the backward pass
      # full: every layer matmul but the MLP's down projection, whose output the backward
      # pass does not need.
      "full": m.layer_matmul_params(active=True) - mlp_projection,
      "minimal": output_projection,
      "save_attention": output_projection + 2 * mlp_projection,
  }.get(m.remat, 0)
  # The chunked vocabulary loss runs the output layer's three matmuls once, as the full-logits
  # path does (toolkit.training.objectives.losses): nothing to add for it.
  per_token = (m.flops_per_token(shape.seq_len) - m.attention_flops_per_token(shape.seq_len)
               + 2 * m.n_layers * recomputed + attention_flops_per_token(shape))
  stages = shape.activation_ways("layers")
  # A pipeline's stages also run the bubble's slots (on zeros): (M + S - 1) / M of the work.
  work = m.pipeline_microbatches * m.pipeline_repeats
  bubble = 1.0 if stages == 1 else (work + stages - 1) / work
  return per_token * shape.global_batch_size * shape.seq_len / shape.work_ways * bubble


def communication(shape: Shape) -> tuple[float, float]:
  """(ICI bytes, DCN bytes) one device sends per step, by the formulas in the docstring."""
  m = shape.model
  a, p = _BYTES[m.compute_dtype], _BYTES[m.param_dtype]
  n = float(shape.param_count)
  mesh, dcn = shape.mesh_shape, shape.dcn_shape
  fsdp_axes = [x for x in shape.rules.params["embed"] if x in mesh]
  f = math.prod(mesh[x] for x in fsdp_axes)
  t = shape.param_ways("mlp")
  batch_axes = [x for x in shape.rules.activations["batch"] if x in mesh]
  # Gradients are reduced over batch axes the parameters are not split over.
  replica_axes = [x for x in batch_axes if x not in fsdp_axes]
  micro = shape.microbatches
  ici = dcn_bytes = 0.0

  def split(volume: float, axes: list[str], scale: float) -> tuple[float, float]:
    """A collective of `volume` bytes per device over `axes`: (ICI, DCN) bytes."""
    size = math.prod(mesh[x] for x in axes)
    slices = math.prod(dcn.get(x, 1) for x in axes)
    if size <= 1:
      return 0.0, 0.0
    if slices <= 1:
      return scale * volume * (size - 1) / size, 0.0
    inside = size // slices
    across = scale * volume * (slices - 1) / slices / inside
    within = scale * volume * (inside - 1) / inside if inside > 1 else 0.0
    return within, across

  # Expert weights split over the expert axes: a device gathers and reduces only its own.
  expert_axes = [x for x in shape.rules.params.get("experts", ()) if x in mesh]
  ep = math.prod(mesh[x] for x in expert_axes)
  experts = m.n_moe_layers * m.n_experts * 3 * m.d_model * m.mlp_dim
  held = n - experts + experts / ep          # parameters per fsdp x tensor group
  # The gradients: of every parameter, or with LoRA of the (float32) adapters only.
  adapted = shape.trainable_count is not None
  gradient_bytes = shape.trainable_count * 4 if adapted else held * p
  if f > 1:
    for volume, scale in ((held / t * a, 2.0 * micro), (gradient_bytes / t, 1.0 * micro)):
      i, d = split(volume, fsdp_axes, scale)  # all-gathers; the gradient reduce-scatter
      ici, dcn_bytes = ici + i, dcn_bytes + d
  if adapted:
    reduced = [(shape.trainable_count * 4, replica_axes)]
  else:
    # In the dtype they come in: compute for matmul weights, float32 tables (module docstring).
    tables = m.vocab_size * m.d_model * (1 if m.tie_embeddings else 2)
    reduced = [((n - experts - tables) * a + tables * p, replica_axes),
               (experts / ep * a, [x for x in replica_axes if x not in expert_axes])]
  for volume, axes in reduced:
    i, d = split(volume / (f * t), axes, 2.0 * micro)
    ici, dcn_bytes = ici + i, dcn_bytes + d
  # Forward, backward, and once more where remat recomputes the MoE layer (its exchange's
  # outputs are not among what minimal or save_attention keep).
  passes = {"none": 2, "save_dots": 2}.get(m.remat, 3)
  i, d = split(_exchanged_bytes(shape), [x for x in shape.rules.activations.get("experts", ())
                                         if x in mesh], passes * micro)
  ici, dcn_bytes = ici + i, dcn_bytes + d
  # Context parallelism: each layer gathers keys and values over `length`'s axes (forward,
  # again where remat recomputes them) and reduce-scatters their gradients.
  length_axes = [x for x in shape.rules.activations.get("length", ()) if x in mesh]
  i, d = split(shape.gathered_kv_bytes, length_axes,
               (2 if m.remat == "none" else 3) * m.n_layers * micro)
  ici, dcn_bytes = ici + i, dcn_bytes + d
  # A pipeline: each iteration shifts one micro-batch's activations to the next stage,
  # forward and backward, M + S - 1 iterations per training micro-batch.
  stages = shape.activation_ways("layers")
  if stages > 1:
    stage_axes = [x for x in shape.rules.activations.get("layers", ()) if x in mesh]
    shifted = shape.tokens_per_device / m.pipeline_microbatches * m.d_model * a
    i, d = split(shifted * stages / (stages - 1), stage_axes,
                 2 * (m.pipeline_microbatches * m.pipeline_repeats + stages - 1) * micro)
    ici, dcn_bytes = ici + i, dcn_bytes + d
  tensor = shape.activation_ways("mlp")
  if tensor > 1:
    # Two all-reduces forward and two backward; recomputing the output projections (full,
    # minimal, save_attention) repeats one or both forward ones.
    per_layer = {"full": 6, "minimal": 5, "save_attention": 5}.get(m.remat, 4)
    volume = shape.tokens_per_device * m.d_model * a
    ici += per_layer * m.n_layers * micro * 2 * volume * (tensor - 1) / tensor
  return ici, dcn_bytes


def _exchanged_bytes(shape: Shape) -> float:
  """Bytes per device that the MoE layers' token exchange carries in one forward pass, as a
  collective volume (split() applies the (n-1)/n of the ring)."""
  m = shape.model
  ways = shape.activation_ways("experts")
  if not m.n_experts or ways <= 1:
    return 0.0
  tokens = shape.tokens_per_device * m.d_model * _BYTES[m.compute_dtype]
  if m.moe_dispatch == "dropless" and m.expert_exchange == "ring":
    per_layer = 2 * tokens * ways                   # all-gather in, reduce-scatter out
  else:
    factor = m.capacity_factor if m.moe_dispatch == "capacity" else 1.0
    per_layer = 2 * tokens * m.experts_per_token * factor      # there and back
  return m.n_moe_layers * per_layer


def step_seconds(flops_per_device: float, ici_bytes: float, dcn_bytes: float,
                 peak_flops: float, ici_bandwidth: float, dcn_bandwidth: float,
                 memory_bytes: float = 0.0, memory_bandwidth: float = 0.0) -> dict[str, float]:
  """Compute at the matmul peak, plus the memory traffic outside the matmuls at the memory's
  bandwidth (`toolkit.planning.traffic`: known only from a compiled program, else 0), plus
  communication, without overlap (an upper bound on a real step)."""
  compute = flops_per_device / peak_flops if peak_flops else float("nan")
  memory = memory_bytes / memory_bandwidth if memory_bandwidth else 0.0
  ici = ici_bytes / ici_bandwidth if ici_bandwidth else 0.0
  dcn = dcn_bytes / dcn_bandwidth if dcn_bandwidth else 0.0
  return {"compute_s": compute, "memory_s": memory, "ici_s": ici, "dcn_s": dcn,
          "total_s": compute + memory + ici + dcn}


def shape_for(spec, config, report, num_slices: int = 1) -> Shape:
  """The Shape of a resolved run (`toolkit.training.config.resolve`), its sharding report and its
  number of slices (fills a -1 in mesh.dcn)."""
  dcn = dict(sharding.parse_axis_sizes(config.mesh.dcn, "mesh.dcn")) if config.mesh.dcn else {}
  if -1 in dcn.values():
    known = math.prod(v for v in dcn.values() if v != -1)
    dcn = {k: (num_slices // known if v == -1 else v) for k, v in dcn.items()}
  param_count = sum(math.prod(r.shape) for r in report.rows)
  adapters = [r for r in report.rows if lora.is_adapter(r.path)]
  return Shape(model=spec.model, mesh_shape=dict(spec.mesh.shape), dcn_shape=dcn,
               rules=spec.rules, global_batch_size=config_lib.rows_per_step(config, spec.task),
               seq_len=config.data.seq_len, microbatches=config.train.microbatches,
               param_bytes_per_device=report.per_device_bytes, param_count=param_count,
               platform=spec.mesh.devices.flat[0].platform,
               trainable_bytes_per_device=(sum(r.per_device_bytes for r in adapters)
                                           if adapters else None),
               trainable_count=sum(math.prod(r.shape) for r in adapters) if adapters else None,
               reference_copy=tasks.frozen_reference(spec.task, config))
