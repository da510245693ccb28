"""The Llama-style decoder's config (`LlamaConfig`: shapes, numerics, attention, mixture of
experts) and its named presets, apart from the modules (models/llama.py) that build it."""
from __future__ import annotations

import dataclasses

from models import attention as attention_lib
from models import lora, moe, pipeline, rope
from models.stack import REMAT_POLICIES, RematPolicy


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
  """Shapes and numerics of the decoder. `head_dim` 0 means d_model // n_heads."""
  vocab_size: int = 256
  d_model: int = 128
  n_layers: int = 4
  n_heads: int = 4
  n_kv_heads: int = 2
  head_dim: int = 0
  mlp_dim: int = 384
  rope_theta: float = 10_000.0
  # "default": plain rotary frequencies; "llama3": Llama 3.1+'s frequency scaling (Hugging
  # Face's rope_scaling.rope_type="llama3"): frequencies whose wavelength exceeds
  # rope_original_max_positions / rope_low_freq_factor are divided by rope_factor, those
  # shorter than rope_original_max_positions / rope_high_freq_factor are kept, and the band
  # between is interpolated.
  rope_type: str = "default"
  rope_factor: float = 8.0
  rope_low_freq_factor: float = 1.0
  rope_high_freq_factor: float = 4.0
  rope_original_max_positions: int = 8192
  norm_eps: float = 1e-5
  tie_embeddings: bool = False
  init_std: float = 0.02
  param_dtype: str = "float32"
  compute_dtype: str = "float32"
  remat: RematPolicy = "none"  # what each layer keeps for the backward pass: models/stack.py
  scan_layers: bool = True
  pipeline_microbatches: int = 0  # with a stage mesh axis: models/pipeline.py (0: no pipeline)
  pipeline_repeats: int = 1  # rounds of the circular schedule (1: GPipe)
  # False: every position attends to every other (bidirectional), for encoders such as
  # models/vit.py that reuse these blocks; the LM is causal.
  causal: bool = True
  # models.attention: auto, xla, blockwise, splash, cudnn, ring (decoding one token keeps its
  # own).
  attention: str = "auto"
  # Tokens per device whose logits the training loss holds at once (the vocabulary loss runs
  # over chunks of positions and never holds all float32 logits or their gradient); 0 = one
  # pass over full logits. z_loss: weight of mean(logsumexp^2) added to the loss (0 = off).
  loss_chunk: int = 2048
  z_loss: float = 0.0
  # Mixture of experts (models/moe.py): 0 experts is a dense model. Otherwise the MLP of every
  # `moe_every`-th layer (1: all) becomes n_experts SwiGLU experts of width mlp_dim, of which
  # the router picks experts_per_token per token. moe_dispatch: "dropless" (sort +
  # ragged_dot) or "capacity" (capacity_factor x the even share of slots per expert and
  # sequence, the rest dropped). expert_exchange: how dropless moves tokens across the expert
  # axis, "ring" or "ragged_all_to_all" (TPU/GPU). The router's load-balancing and z losses
  # join the training loss with these weights.
  n_experts: int = 0
  experts_per_token: int = 2
  moe_every: int = 1
  moe_dispatch: str = "dropless"
  capacity_factor: float = 1.25
  expert_exchange: str = "ring"
  load_balance_weight: float = 0.01
  router_z_weight: float = 0.001
  # LoRA adapters (models/lora.py): lora_rank 0 is none. With a rank, each projection named in
  # lora_targets (q, k, v, o: attention; gate, up, down: a dense MLP) gets a trained float32
  # update (lora_alpha / lora_rank) x dropout(x) A B, and every other weight is frozen, stored
  # in param_dtype (bfloat16 halves the base's memory), with no gradient or optimizer state.
  lora_rank: int = 0
  lora_alpha: float = 16.0
  lora_dropout: float = 0.0
  lora_targets: str = "q,k,v,o,gate,up,down"

  @property
  def resolved_head_dim(self) -> int:
    return self.head_dim or self.d_model // self.n_heads

  @property
  def n_moe_layers(self) -> int:
    return self.n_layers // self.moe_every if self.n_experts else 0

  @classmethod
  def preset(cls, name: str, **overrides) -> LlamaConfig:
    if name not in PRESETS:
      raise ValueError(f"model preset {name!r} is unknown; choose one of {', '.join(PRESETS)}")
    return dataclasses.replace(PRESETS[name], **overrides)

  def validate(self, field: str = "model") -> None:
    """Raises ValueError naming the field and the fix."""
    for name in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "mlp_dim"):
      if getattr(self, name) < 1:
        raise ValueError(f"{field}.{name}={getattr(self, name)} must be >= 1")
    if self.n_heads % self.n_kv_heads:
      raise ValueError(
          f"{field}.n_heads={self.n_heads} is not a multiple of {field}.n_kv_heads="
          f"{self.n_kv_heads}; grouped-query attention needs heads = k * kv_heads")
    if not self.head_dim and self.d_model % self.n_heads:
      raise ValueError(
          f"{field}.d_model={self.d_model} is not divisible by {field}.n_heads={self.n_heads}; "
          f"set {field}.head_dim explicitly")
    if self.resolved_head_dim % 2:
      raise ValueError(f"{field}: head_dim {self.resolved_head_dim} must be even for rotary "
                       f"embeddings")
    for name in ("param_dtype", "compute_dtype"):
      if getattr(self, name) not in ("float32", "bfloat16"):
        raise ValueError(f"{field}.{name}={getattr(self, name)!r}; use 'float32' or 'bfloat16'")
    if self.remat not in REMAT_POLICIES:
      raise ValueError(f"{field}.remat={self.remat!r}; use one of {', '.join(REMAT_POLICIES)}")
    if self.attention not in attention_lib.CHOICES:
      raise ValueError(f"{field}.attention={self.attention!r}; use one of "
                       f"{', '.join(attention_lib.CHOICES)}")
    if self.loss_chunk < 0:
      raise ValueError(f"{field}.loss_chunk={self.loss_chunk} must be >= 0 (0 computes the "
                       f"loss over full logits)")
    if not 0 <= self.z_loss < float("inf"):
      raise ValueError(f"{field}.z_loss={self.z_loss} must be a finite number >= 0 (0 is off)")
    rope.validate(self, field)
    moe.validate(self, field)
    pipeline.validate(self, field)
    lora.validate(self, field)

  def layer_matmul_params(self, active: bool = False) -> float:
    """Matmul weights of one layer, averaged over the layers (MoE layers count all their
    experts and the router, or with `active` only the experts_per_token a token uses)."""
    d, hd = self.d_model, self.resolved_head_dim
    mlp = 3 * d * self.mlp_dim
    experts = self.experts_per_token if active else self.n_experts
    moe_layer = experts * mlp + d * self.n_experts
    mlps = (self.n_layers - self.n_moe_layers) * mlp + self.n_moe_layers * moe_layer
    return d * hd * (2 * self.n_heads + 2 * self.n_kv_heads) + mlps / self.n_layers

  def num_params(self) -> int:
    embeddings = self.vocab_size * self.d_model * (1 if self.tie_embeddings else 2)
    return round(self.n_layers * (self.layer_matmul_params() + 2 * self.d_model)
                 + embeddings + self.d_model)

  def attention_flops_per_token(self, seq_len: int) -> float:
    """Training FLOPs per token of attention's two matmuls (scores q.k, then p.v), all
    layers, forward + backward: 3 x 2 matmuls x 2 FLOPs x heads x head_dim x the keys a query
    sees. Bidirectional (`causal` False) that is all seq_len keys, as in the PaLM paper's
    appendix B; causal, half of them on average, so the count is halved, as MaxText's
    `calculate_tflops_training_per_device` does ("Divide attention flops by 2 due to causal
    mask", citing Megatron-LM and NeMo). That is the useful work, which the flash-style
    kernels (splash, blockwise, cuDNN) execute by skipping key blocks above the diagonal; the
    full count would exceed what they run and put MFU above 100 %."""
    keys = seq_len / 2 if self.causal else seq_len
    return 12 * self.n_layers * self.n_heads * self.resolved_head_dim * keys

  def flops_per_token(self, seq_len: int) -> float:
    """Training FLOPs per token (forward + backward), the numerator of MFU: 6 x matmul
    parameters a token uses (the router and its experts_per_token experts in an MoE layer)
    plus attention (`attention_flops_per_token`: halved when causal). With LoRA the frozen
    weights cost 4 (no weight gradient) and the adapters 6 per parameter. Remat's recomputation
    is not counted: it is work the step executes (toolkit.planning.estimate), not model FLOPs."""
    matmul_params = (self.n_layers * self.layer_matmul_params(active=True)
                     + self.vocab_size * self.d_model)
    attention = self.attention_flops_per_token(seq_len)
    if self.lora_rank:
      return 4 * matmul_params + 6 * lora.trainable_count(self) + attention
    return 6 * matmul_params + attention


PRESETS: dict[str, LlamaConfig] = {
    # For unit tests: a few hundred kB of parameters.
    "tiny": LlamaConfig(vocab_size=256, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                        mlp_dim=64),
    # The CPU demo: ~0.9 M parameters, byte-level vocabulary. Its 4 layers run unrolled (the
    # weights stay stacked, so checkpoints are the same): XLA:CPU trained the demo 1.28x and the
    # one-device fine-tune 1.58x faster so (scripts/bench/bench_train.py, docs/benchmarks.md).
    "cpu": LlamaConfig(vocab_size=256, d_model=128, n_layers=4, n_heads=4, n_kv_heads=2,
                       mlp_dim=384, scan_layers=False),
    # Real shapes for ahead-of-time compiles. 125m: GPT-3 Small widths with a Llama MLP and
    # untied 32k vocabulary (134 M in all, 85 M without embeddings); 1b is Llama 3.2 1B (its
    # config.json's values, RoPE scaling included), 8b Llama 3.1 8B (likewise), 7b Llama 2 7B,
    # 70b Llama 2 70B (32k vocab).
    "125m": LlamaConfig(vocab_size=32_000, d_model=768, n_layers=12, n_heads=12, n_kv_heads=12,
                        mlp_dim=2048, param_dtype="float32", compute_dtype="bfloat16"),
    "1b": LlamaConfig(vocab_size=128_256, d_model=2048, n_layers=16, n_heads=32, n_kv_heads=8,
                      mlp_dim=8192, rope_theta=500_000.0, rope_type="llama3", rope_factor=32.0,
                      rope_low_freq_factor=1.0, rope_high_freq_factor=4.0,
                      rope_original_max_positions=8192, norm_eps=1e-5, tie_embeddings=True,
                      compute_dtype="bfloat16", remat="full"),
    "8b": LlamaConfig(vocab_size=128_256, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=8,
                      mlp_dim=14_336, rope_theta=500_000.0, rope_type="llama3", rope_factor=8.0,
                      rope_low_freq_factor=1.0, rope_high_freq_factor=4.0,
                      rope_original_max_positions=8192, norm_eps=1e-5, compute_dtype="bfloat16",
                      remat="full"),
    "7b": LlamaConfig(vocab_size=32_000, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=32,
                      mlp_dim=11_008, compute_dtype="bfloat16", remat="minimal"),
    "70b": LlamaConfig(vocab_size=32_000, d_model=8192, n_layers=80, n_heads=64, n_kv_heads=8,
                       mlp_dim=28_672, compute_dtype="bfloat16", remat="full"),
    # Mixtral-style mixtures of experts: 8 experts, 2 per token, in every layer. moe_tiny and
    # moe_cpu use experts half as wide as tiny's and cpu's MLP, so a token uses as many
    # weights as in those dense models (plus the router); 8x7b is Mixtral 8x7B (46.7 B).
    "moe_tiny": LlamaConfig(vocab_size=256, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                            mlp_dim=32, n_experts=8),
    "moe_cpu": LlamaConfig(vocab_size=256, d_model=128, n_layers=4, n_heads=4, n_kv_heads=2,
                           mlp_dim=192, n_experts=8),
    "8x7b": LlamaConfig(vocab_size=32_000, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=8,
                        mlp_dim=14_336, rope_theta=1_000_000.0, compute_dtype="bfloat16",
                        remat="full", n_experts=8),
}
