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
  from toolkit.training.objectives import dpo  # pylint: disable=g-import-not-at-top
  settings = config.get("dpo", default)
  try:
    dpo.check(settings.beta, settings.loss, settings.label_smoothing)
  except ValueError as e:
    raise ConfigError(f"dpo.{e}") from None
  _check_reference("dpo", settings, model, "dpo.reference='precomputed' (the starting "
                   "weights' log-probabilities, one pass before the first step) or 'frozen'")
  _whole_rows(model, mesh, "preference tuning")


def _check_reference(task: str, settings, model, instead: str) -> None:
  """The section's `reference` is one the task knows and the model has (tasks.REFERENCES)."""
  from toolkit.training.objectives import tasks  # pylint: disable=g-import-not-at-top
  reference = settings.get("reference", "auto")
  if reference not in tasks.REFERENCES[task]:
    raise ConfigError(f"{task}.reference={reference!r} is unknown; choose one of "
                      f"{', '.join(tasks.REFERENCES[task])}")
  if reference == "base" and not model.lora_rank:
    raise ConfigError(f"{task}.reference='base' is a LoRA model's base (its adapters off), and "
                      f"model.lora_rank is 0; set model.lora_rank (e.g. 16) or {instead}")


def check_grpo(config: ml_collections.ConfigDict, model, mesh: Mesh,
               default: ml_collections.ConfigDict) -> None:
  """Reinforcement learning (task grpo): the objective's settings (the sampling's numbers are
  ranges.py's), a reward function named, a KL reference the model has and reads, room for the
  completions."""
  from toolkit.training.objectives import grpo  # pylint: disable=g-import-not-at-top
  settings = config.get("grpo", default)
  try:
    grpo.check(settings.beta, settings.epsilon, settings.epsilon_high, settings.loss,
               settings.scale_rewards)
  except ValueError as e:
    raise ConfigError(f"grpo.{e}") from None
  if not settings.reward:
    raise ConfigError("grpo.reward is empty: name the reward function, 'module:function' or "
                      "'path/to/file.py:function', called as reward(completion, answer)")
  _check_reference("grpo", settings, model, "grpo.reference='frozen' (a copy of the starting "
                   "weights in the train state)")
  if settings.get("reference", "auto") != "auto" and not settings.beta:
    raise ConfigError(f"grpo.reference={settings.reference!r} with grpo.beta=0: without the KL "
                      f"penalty nothing reads the reference; set grpo.beta > 0 (e.g. 0.04) or "
                      f"grpo.reference='auto'")
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
