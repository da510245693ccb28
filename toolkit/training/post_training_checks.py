"""The validation pass's checks of the post-training tasks (toolkit/training/config.py
`resolve`): preference tuning (data.source="preference", task dpo) and reinforcement learning
(data.source="prompts", task grpo). Each raises one ConfigError naming the field and the fix."""
from __future__ import annotations

import ml_collections
from jax.sharding import Mesh

from toolkit.errors import ConfigError


def check_preference(config: ml_collections.ConfigDict, model, mesh: Mesh,
                     default: ml_collections.ConfigDict) -> None:
  """Preference tuning (task dpo): the objective's settings, a reference the model has (the
  base needs LoRA adapters), no dropout, whole rows on each device."""
  from toolkit.data import preference  # pylint: disable=g-import-not-at-top
  from toolkit.training import dpo  # pylint: disable=g-import-not-at-top
  settings = config.get("dpo", default)
  try:
    dpo.check(settings.beta, settings.loss, settings.label_smoothing)
  except ValueError as e:
    raise ConfigError(f"dpo.{e}") from None
  reference = settings.get("reference", "auto")
  if reference not in preference.REFERENCES:
    raise ConfigError(f"dpo.reference={reference!r} is unknown; choose one of "
                      f"{', '.join(preference.REFERENCES)}")
  if reference == "base" and not model.lora_rank:
    raise ConfigError("dpo.reference='base' is a LoRA model's base (its adapters off), and "
                      "model.lora_rank is 0; set model.lora_rank (e.g. 16) or "
                      "dpo.reference='precomputed' (the starting weights' log-probabilities, "
                      "one pass before the first step)")
  _whole_rows(model, mesh, "preference tuning")


def check_grpo(config: ml_collections.ConfigDict, model, mesh: Mesh,
               default: ml_collections.ConfigDict) -> None:
  """Reinforcement learning (task grpo): the objective's settings (the sampling's numbers are
  ranges.py's), a reward function named, a KL reference the model has, room for the
  completions."""
  from toolkit.training import grpo  # pylint: disable=g-import-not-at-top
  settings = config.get("grpo", default)
  try:
    grpo.check(settings.beta, settings.epsilon, settings.epsilon_high, settings.loss,
               settings.scale_rewards)
  except ValueError as e:
    raise ConfigError(f"grpo.{e}") from None
  if not settings.reward:
    raise ConfigError("grpo.reward is empty: name the reward function, 'module:function' or "
                      "'path/to/file.py:function', called as reward(completion, answer)")
  if settings.beta and not model.lora_rank:
    raise ConfigError(f"grpo.beta={settings.beta}: the KL penalty's reference is a LoRA "
                      f"model's base, and model.lora_rank is 0; set grpo.beta=0 or "
                      f"model.lora_rank (e.g. 16)")
  if settings.max_tokens >= config.data.seq_len:
    raise ConfigError(f"grpo.max_tokens={settings.max_tokens} leaves no room for a prompt in "
                      f"data.seq_len={config.data.seq_len} + 1 tokens; raise data.seq_len or "
                      f"lower grpo.max_tokens")
  if config.data.get("packing", False):
    raise ConfigError("data.packing=True: GRPO's rows are one completion each; set it False")
  _whole_rows(model, mesh, "GRPO")


def _whole_rows(model, mesh: Mesh, what: str) -> None:
  if model.lora_dropout:
    raise ConfigError(f"model.lora_dropout={model.lora_dropout}: {what} trains without "
                      f"dropout (as trl does by default); set it to 0")
  for axis in ("sequence", "stage"):
    if mesh.shape.get(axis, 1) > 1:
      raise ConfigError(f"mesh.ici has {axis}={mesh.shape[axis]}: {what} runs whole rows "
                        f"through the whole model on each device so far; drop the {axis} axis")
