"""Rollouts for reinforcement learning (GRPO, toolkit/training/objectives/grpo.py): G sampled completions
of each prompt from the KV-cache engine (toolkit/inference: paged cache, continuous batching,
prefix caching, so a prompt's G copies share its cached pages) on the training mesh, reading
the training parameters where they are: no copy of the weights, no second process.

A completion's sampling seed is a pure function of (seed, step, prompt, generation)
(`completion_seed`): the engine samples each request from its own seed and token index, so a
rollout is the same whatever else shares its batch, and equals `scheduler.generate` of the same
prompt and seed (tests/toolkit/post_training/test_rollouts.py); a resumed run samples the
steps it redoes as the uninterrupted run did.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
from jax.sharding import Mesh

import sharding
from models import LlamaConfig
from toolkit.inference import engine as engine_lib
from toolkit.inference.sampling import SamplingParams
from toolkit.inference.scheduler import Result, generate
from toolkit.data import prompts
from toolkit.training.objectives import grpo


def completion_seed(seed: int, step: int, prompt: int, generation: int) -> int:
  """The sampling seed of completion `generation` of prompt `prompt` at `step`, in [0, 2**32)."""
  return int(np.random.SeedSequence([seed, step, prompt, generation]).generate_state(1)[0])


@dataclasses.dataclass(frozen=True)
class Group:
  """One prompt's G completions, in generation order."""
  prompt: np.ndarray
  results: tuple[Result, ...]


class Rollouts:
  """G completions of each prompt with `sampling` (its seed replaced per completion), up to
  `batch_size` requests decoded at once, from an engine on `mesh` that reads the parameters
  handed to each call."""

  def __init__(self, model_cfg: LlamaConfig, params, mesh: Mesh, rules: sharding.Rules,
               cache_length: int, sampling: SamplingParams, generations: int, batch_size: int,
               page_size: int = engine_lib.DEFAULT_PAGE_SIZE):
    if generations < 2:
      raise ValueError(f"generations={generations}: a group needs >= 2 completions of each "
                       f"prompt (its advantages are relative to each other)")
    self.engine = engine_lib.Engine(model_cfg, params, mesh, rules, cache_length, page_size)
    self.sampling, self.generations, self.batch_size = sampling, generations, batch_size
    self.engine.params = None  # each call hands in the parameters of its step

  def requests(self, count: int, seed: int, step: int) -> list[SamplingParams]:
    """The sampling of each of `count` prompts' G completions, prompt-major."""
    return [dataclasses.replace(self.sampling, seed=completion_seed(seed, step, p, g))
            for p in range(count) for g in range(self.generations)]

  def __call__(self, params, prompts: Sequence[np.ndarray], seed: int, step: int) -> list[Group]:
    """Each prompt's group, sampled with `params` (the training state's, in their training
    shardings: the engine reads them as they are)."""
    self.engine.params = params
    try:
      flat = generate(self.engine, [p for p in prompts for _ in range(self.generations)],
                      self.requests(len(prompts), seed, step), self.batch_size)
    finally:
      self.engine.params = None  # the next step donates these buffers
    for result in flat:
      if result.finish_reason == "error":
        raise RuntimeError(f"a rollout failed: {result.error}")
    g = self.generations
    return [Group(np.asarray(p), tuple(flat[i * g:(i + 1) * g])) for i, p in enumerate(prompts)]

  def tokens(self, groups: Sequence[Group]) -> int:
    """Completion tokens in `groups`: what rollout throughput counts."""
    return sum(len(r.tokens) for group in groups for r in group.results)



def batch_of(groups: Sequence[Group], rewards: np.ndarray, seq_len: int, scale: str, loss: str,
             stop_token: int | None = None) -> dict[str, np.ndarray]:
  """The GRPO step's batch (toolkit/training/objectives/tasks.py `grpo_loss`) from the groups and their
  (prompts, G) rewards: a row per completion, prompt-major, the prompt then the completion (and
  `stop_token` after a completion that stopped on it, so the model learns to stop) cut to
  `seq_len` + 1 tokens; the completion mask on the targets that are completion tokens; each
  row's group advantage (`grpo.group_advantages` with `scale`)."""
  rows = [np.concatenate([g.prompt, r.tokens, [stop_token] if stop_token is not None
                          and r.finish_reason == "stop" else []]).astype(np.int32)
          for g in groups for r in g.results]
  starts = [len(g.prompt) for g in groups for _ in g.results]
  inputs = np.zeros((len(rows), seq_len), np.int32)
  targets = np.zeros((len(rows), seq_len), np.int32)
  weights = np.zeros((len(rows), seq_len), np.float32)
  for i, (row, start) in enumerate(zip(rows, starts)):
    row = row[:seq_len + 1]
    inputs[i, :len(row) - 1], targets[i, :len(row) - 1] = row[:-1], row[1:]
    weights[i, start - 1:len(row) - 1] = 1.0  # target t is token t + 1: completion from start
  advantages = np.asarray(grpo.group_advantages(np.asarray(rewards, np.float32), scale))
  return {"inputs": inputs, "targets": targets, prompts.mask_key(loss): weights,
          "advantages": advantages.reshape(-1).astype(np.float32)}
