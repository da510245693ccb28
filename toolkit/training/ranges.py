"""Every numeric config field's valid range, one row per field (`RANGES`), which
`config.check_ranges` applies before anything else of the validation pass."""
from __future__ import annotations

import dataclasses
import math

import ml_collections

# --- every numeric field's valid range: one row per field ----------------------------------
# `resolve` checks each numeric value of a config against its row, before anything else;
# tests/toolkit/training/test_config.py fails for a numeric field of any experiment that has no
# row here, so a new field cannot be forgotten: add `"section.name": Range(...)` with what the
# value means. Bounds are inclusive unless marked open; every float must also be finite.

INT32_MAX = 2**31 - 1  # step counters, seeds and warmups live in int32 arrays


@dataclasses.dataclass(frozen=True)
class Range:
  """low <= value <= high (or < when open); `integer` values must be ints; `meaning` is
  what the field is, shown in the error."""
  low: float
  high: float = math.inf
  meaning: str = ""
  low_open: bool = False
  high_open: bool = False
  integer: bool = False

  def contains(self, value) -> bool:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
      return False
    if self.integer and not isinstance(value, int):
      return False
    if isinstance(value, float) and not math.isfinite(value):
      return False
    above = value > self.low if self.low_open else value >= self.low
    below = value < self.high if self.high_open else value <= self.high
    return above and below

  def __str__(self) -> str:
    kind = "an integer" if self.integer else "a finite number"
    if self.high == math.inf:
      return f"{kind} {'>' if self.low_open else '>='} {_number(self.low)}"
    return (f"{kind} in {'(' if self.low_open else '['}{_number(self.low)}, "
            f"{_number(self.high)}{')' if self.high_open else ']'}")


def _number(value: float) -> str:
  return "2**31 - 1" if value == INT32_MAX else f"{value:g}"


def count(meaning: str, low: int = 1) -> Range:
  """An integer count, `low` (default 1) up to what an int32 holds."""
  return Range(low, INT32_MAX, meaning, integer=True)


def positive(meaning: str) -> Range:
  return Range(0.0, meaning=meaning, low_open=True)


def fraction(meaning: str, low_open: bool = False, high_open: bool = False) -> Range:
  return Range(0.0, 1.0, meaning, low_open=low_open, high_open=high_open)


RANGES: dict[str, Range] = {
    "seed": count("the run's random seed; JAX keys take 32 bits", low=0),
    # model (llama and vit share most fields)
    "model.vocab_size": count("tokens in the vocabulary"),
    "model.d_model": count("width of the residual stream"),
    "model.n_layers": count("transformer blocks"),
    "model.n_heads": count("attention heads"),
    "model.n_kv_heads": count("key/value heads"),
    "model.head_dim": count("width of one head; 0 means d_model // n_heads", low=0),
    "model.mlp_dim": count("hidden width of the MLP"),
    "model.rope_theta": positive("rotary embedding base"),
    # Llama 3 rotary scaling (used when model.rope_type='llama3'; the model also checks that
    # rope_low_freq_factor < rope_high_freq_factor)
    "model.rope_factor": Range(1.0, meaning="what long-wavelength frequencies are divided by"),
    "model.rope_low_freq_factor": positive("wavelengths beyond original positions / this are "
                                           "scaled"),
    "model.rope_high_freq_factor": positive("wavelengths below original positions / this are "
                                            "kept"),
    "model.rope_original_max_positions": count("context length the model was trained at"),
    "model.norm_eps": positive("RMSNorm epsilon"),
    "model.init_std": positive("standard deviation of the initial weights"),
    "model.image_size": count("image height and width in pixels"),
    "model.patch_size": count("patch height and width in pixels"),
    "model.channels": count("image channels"),
    "model.num_classes": count("classes"),
    # the vocabulary loss (toolkit/training/objectives/losses.py)
    "model.pipeline_microbatches": count("micro-batches of a pipeline over the stage mesh "
                                         "axis; 0 is no pipeline", low=0),
    "model.pipeline_repeats": count("rounds of the circular pipeline schedule; 1 is GPipe"),
    "model.loss_chunk": count("tokens per device whose logits the loss holds at once; 0 is "
                              "one pass over full logits", low=0),
    "model.z_loss": Range(0.0, meaning="weight of mean(logsumexp^2) added to the LM's loss"),
    # mixture of experts (models/moe.py; the model also checks experts_per_token <= n_experts
    # and that moe_every divides n_layers)
    "model.n_experts": count("experts in a mixture-of-experts layer; 0 is a dense model", low=0),
    "model.experts_per_token": count("experts the router picks for each token"),
    "model.moe_every": count("every n-th layer is a mixture of experts"),
    "model.capacity_factor": positive("slots per expert as a multiple of its even share "
                                      "(capacity dispatch)"),
    "model.load_balance_weight": Range(0.0, meaning="weight of the router's load-balancing loss"),
    "model.router_z_weight": Range(0.0, meaning="weight of the router's z-loss"),
    # LoRA adapters (models/lora.py; the model also checks lora_targets)
    "model.lora_rank": count("rank of the LoRA adapters; 0 is none (every weight trains)",
                             low=0),
    "model.lora_alpha": positive("LoRA scale numerator: updates are scaled by alpha / rank"),
    "model.lora_dropout": fraction("share of a LoRA adapter's inputs dropped in training",
                                   high_open=True),
    # sharding
    "sharding.max_replicated_fraction": fraction("share of parameter bytes that may be "
                                                 "replicated before the run warns or fails"),
    # data
    "data.seq_len": count("tokens per training sequence"),
    "data.global_batch_size": count("sequences (or images) per step over all devices"),
    "data.eval_batches": count("held-out batches per eval"),
    "data.eval_fraction": fraction("share of the text held out", low_open=True, high_open=True),
    "data.worker_count": count("Grain worker processes; 0 reads in this process", low=0),
    "data.packing_bins": count("rows the packer fills at once; 0 is one global batch", low=0),
    "data.prefetch": count("batches prepared ahead", low=0),
    "data.crop_padding": count("pixels of padding before the random crop; 0 is off", low=0),
    "data.mean": Range(-math.inf, math.inf, "pixel mean subtracted (pixels in [0, 1])"),
    "data.std": positive("pixel standard deviation divided by"),
    # optimizer
    "optimizer.learning_rate": Range(0.0, meaning="peak learning rate"),
    "optimizer.min_lr_ratio": fraction("final learning rate as a share of the peak"),
    "optimizer.warmup_steps": count("steps of linear warmup", low=0),
    "optimizer.b1": fraction("Adam's first-moment decay", high_open=True),
    "optimizer.b2": fraction("Adam's second-moment decay", high_open=True),
    "optimizer.eps": positive("Adam's epsilon"),
    "optimizer.weight_decay": Range(0.0, meaning="AdamW weight decay"),
    "optimizer.clip_norm": Range(0.0, meaning="global gradient-norm clip; 0 turns it off"),
    "optimizer.schedule_steps": count("length of the schedule; 0 means train.steps", low=0),
    # train
    "train.steps": count("steps to train"),
    "train.microbatches": count("micro-batches each step's batch is split into"),
    "train.log_every": count("steps between progress lines"),
    "train.eval_every": count("steps between evals"),
    "train.checkpoint_every": count("steps between checkpoints"),
    "train.keep_checkpoints": count("checkpoints kept"),
    "train.local_checkpoint_every": count("steps between checkpoints of the local tier"),
    "train.peak_flops_per_device": Range(0.0, meaning="peak FLOP/s of one device for MFU; 0 "
                                                      "looks it up from the device kind"),
    "train.sample_tokens": count("tokens sampled after training; 0 is off", low=0),
    "train.label_smoothing": fraction("share of each classifier target's weight spread evenly "
                                      "over all classes", high_open=True),
    "dpo.beta": positive("DPO's reward scale: how far the policy may move from the reference"),
    "dpo.label_smoothing": fraction("probability that a pair's preference is flipped (the "
                                    "robust loss)", high_open=True),
    "grpo.generations": count("completions sampled per prompt, compared with each other", low=2),
    "grpo.max_tokens": count("tokens a sampled completion may have"),
    "grpo.temperature": Range(0.0, meaning="sampling temperature of the rollouts; 0 is greedy"),
    "grpo.top_p": Range(0.0, 1.0, meaning="nucleus sampling mass of the rollouts; 1 is off",
                        low_open=True),
    "grpo.top_k": count("the rollouts keep the k most likely tokens; 0 is off", low=0),
    "grpo.beta": Range(0.0, meaning="weight of the KL penalty to the reference; 0 is off"),
    "grpo.epsilon": Range(0.0, 1.0, meaning="how far below 1 the policy ratio is clipped",
                          low_open=True, high_open=True),
    "grpo.epsilon_high": Range(0.0, 1.0, meaning="how far above 1 the policy ratio is clipped",
                               low_open=True, high_open=True),
    "train.eval_tasks_every": count("steps between runs of train.eval_tasks"),
    "train.eval_tasks_limit": count("examples per task of train.eval_tasks; 0 is all", low=0),
    "train.hang_timeout_s": Range(0.0, meaning="seconds without progress before a process "
                                               "counts as hung and exits 75; 0 is off"),
    "train.storage_timeout_s": positive("seconds one metrics, config or plot write (or one "
                                        "object-store read) may take"),
    "train.straggler_every": count("steps between straggler reports of a multi-process run; "
                                   "0 is off", low=0),
}


def numeric_fields(config: ml_collections.ConfigDict, prefix: str = "") -> dict[str, float]:
  """Dotted path -> value of every int or float field (bools are not numbers here)."""
  found = {}
  for key, value in config.items():
    path = f"{prefix}{key}"
    if isinstance(value, ml_collections.ConfigDict):
      found.update(numeric_fields(value, path + "."))
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
      found[path] = value
  return found
