"""GRPO as a training task (data.source="prompts", the `grpo` config section): each step samples
`grpo.generations` completions of each of its prompts with the KV-cache engine on the training
mesh from the parameters being trained (rollouts.py), scores each with the reward function the
experiment names (`grpo.reward`, "module:function" or "path/file.py:function", called as
reward(completion_text, answer) -> float on the completion decoded up to the chat template's end
of turn), and takes one gradient step of GRPO's objective (toolkit/training/objectives/grpo.py,
tasks.grpo_loss) on the batch `rollouts.batch_of` builds.

`RolloutBatches` stands in for the run's data source in the training loop (`loop.run`'s
`batches`): the loop hands it each new state (`observe`), and it samples the next step's batch
from that state's parameters, so a step trains on its own rollouts (on-policy). A batch is a pure
function of (seed, step, parameters): the prompts of step s are a permutation's (prompts.order)
and each completion's seed rollouts.completion_seed's, so a resumed run redoes its steps
exactly. Evaluation (`evaluate`) is the held-out prompts answered greedily: their mean reward.
"""
from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import os
import time
from collections.abc import Callable

import jax
import numpy as np

from toolkit.data import prompts as prompts_lib
from toolkit.errors import ConfigError
from toolkit.inference.sampling import SamplingParams
from toolkit.inference.scheduler import generate
from toolkit.post_training import rollouts as rollouts_lib
from toolkit.training.setup import Setup

Reward = Callable[[str, object], float]


# What a progress line of `loss 0.0000 | grad_norm 0.000` means here, said once at start-up.
ZERO_LOSS_NOTE = ("grpo: a step's loss and grad_norm are 0 when every completion of each of its "
                  "prompts got the same reward (no advantage to learn from): watch the reward "
                  "and the held-out solved share (loss.png plots both)")


def load_reward(spec: str, field: str = "grpo.reward") -> Reward:
  """The callable `spec` names: "package.module:function" or "path/to/file.py:function"."""
  module_name, _, name = spec.rpartition(":")
  if not module_name or not name:
    raise ConfigError(f"{field}={spec!r}: name the reward function as 'module:function' or "
                      f"'path/to/file.py:function' (e.g. experiments.grpo:exact_match)")
  try:
    if module_name.endswith(".py"):
      if not os.path.isfile(module_name):
        raise ConfigError(f"{field}={spec!r}: {module_name} is not a file")
      loaded = importlib.util.spec_from_file_location("meshkit_reward", module_name)
      module = importlib.util.module_from_spec(loaded)
      loaded.loader.exec_module(module)
    else:
      module = importlib.import_module(module_name)
  except ImportError as e:
    raise ConfigError(f"{field}={spec!r}: cannot import {module_name} ({e})") from None
  function = getattr(module, name, None)
  if not callable(function):
    raise ConfigError(f"{field}={spec!r}: {module_name} has no function {name!r}")
  return function


@dataclasses.dataclass(frozen=True)
class Settings:
  """The grpo config section, checked (toolkit/training/config.py)."""
  generations: int
  max_tokens: int
  temperature: float
  top_p: float
  top_k: int
  beta: float
  epsilon: float
  epsilon_high: float
  loss: str
  scale_rewards: str
  reward: str

  @classmethod
  def of(cls, section) -> Settings:
    return cls(**{f.name: section[f.name] for f in dataclasses.fields(cls)})


class RolloutBatches:
  """The batches of a GRPO run, sampled from the model being trained (module docstring)."""

  def __init__(self, setup: Setup, data: prompts_lib.PromptData, settings: Settings, seed: int,
               prompts_per_batch: int, seq_len: int, log: Callable[[str], None] = print,
               log_every: int = 0):
    self.setup, self.data, self.settings, self.seed = setup, data, settings, seed
    self.prompts_per_batch, self.seq_len, self.log = prompts_per_batch, seq_len, log
    self.log_every = log_every
    self.rows = prompts_per_batch * settings.generations
    self.reward = load_reward(settings.reward)
    self.stop = data.tokenizer.end_of_turn()
    self.sampling = SamplingParams(max_tokens=settings.max_tokens,
                                   temperature=settings.temperature, top_k=settings.top_k,
                                   top_p=settings.top_p, stop_tokens=(self.stop,))
    self._rollouts: rollouts_lib.Rollouts | None = None
    self._params = None
    self.eval_batches = 0
    self.timings = {"rollout": 0.0, "scoring": 0.0, "tokens": 0.0, "reward": 0.0, "steps": 0}

  # --- what the loop asks of a data source ---------------------------------------------------
  def abstract(self) -> dict[str, jax.ShapeDtypeStruct]:
    return self.setup.batches.abstract()  # the PromptSource's shapes

  def describe(self) -> str:
    s = self.settings
    return "\n".join([*self.data.notes, (
        f"grpo: {self.prompts_per_batch} prompts a step x {s.generations} completions of up "
        f"to {s.max_tokens} tokens (temperature {s.temperature}), sampled on the training "
        f"mesh; reward {s.reward}; loss {s.loss}, beta {s.beta}, clip {s.epsilon}/"
        f"{s.epsilon_high}, advantages scaled by {s.scale_rewards}"),
        ZERO_LOSS_NOTE])

  def observe(self, state) -> None:
    """The state the next batch is sampled from. Returns once its parameters are computed: the
    loop calls it right after dispatching a step, so the step's compute counts as step time,
    not as the next rollout's, which waits for those parameters (the CPU variant's log said
    rollouts 92 % of each step; sampling alone is ~40 %)."""
    self._params = jax.block_until_ready(state["params"])

  def iterator(self, start_step: int, position: dict | None = None, prefetch: int = 0):
    del position, prefetch  # a batch needs the previous step's parameters: nothing ahead
    return _Iterator(self, start_step)

  # --- sampling, scoring, batching -----------------------------------------------------------
  def rollouts(self) -> rollouts_lib.Rollouts:
    if self._rollouts is None:
      spec = self.setup.spec
      self._rollouts = rollouts_lib.Rollouts(
          spec.model, self._params, spec.mesh, spec.rules, self.seq_len + 1, self.sampling,
          self.settings.generations, batch_size=self.rows)
    return self._rollouts

  def score(self, records, groups) -> np.ndarray:
    """(prompts, G) rewards of each group's completions, decoded up to the end of turn."""
    decode = self.data.tokenizer.decode
    return np.asarray([[float(self.reward(decode(r.tokens), record.answer)) for r in g.results]
                       for record, g in zip(records, groups)], np.float64)

  def host_batch(self, step: int) -> dict[str, np.ndarray]:
    """Step `step`'s batch on the host: its prompts' rollouts, scored."""
    if self._params is None:
      raise RuntimeError("RolloutBatches: observe(state) before the first batch")
    train = self.data.train
    picked = prompts_lib.order(len(train), self.seed, self.prompts_per_batch, step)
    started = time.perf_counter()
    groups = self.rollouts()(self._params, [train.tokens[i] for i in picked], self.seed, step)
    scored = time.perf_counter()
    rewards = self.score([train.records[i] for i in picked], groups)
    self.count(step, scored - started, time.perf_counter() - scored,
               self.rollouts().tokens(groups), float(rewards.mean()))
    batch = rollouts_lib.batch_of(groups, rewards, self.seq_len, self.settings.scale_rewards,
                                  self.settings.loss, self.stop)
    batch["rewards"] = rewards.reshape(-1).astype(np.float32)
    return batch

  def count(self, step: int, rollout_s: float, scoring_s: float, tokens: int,
            reward: float) -> None:
    """Adds one step's rollout to the timings; every `log_every` steps (and after the first)
    logs their split since the last line and resets them."""
    t = self.timings
    for key, value in (("rollout", rollout_s), ("scoring", scoring_s), ("tokens", tokens),
                       ("reward", reward), ("steps", 1)):
      t[key] += value
    done = step + 1
    if self.log_every and (done % self.log_every == 0 or t["steps"] == done):
      steps = t["steps"]
      self.log(f"rollouts to step {done}: {t['rollout'] / steps:.2f} s a step sampling "
               f"{t['tokens'] / steps:,.0f} tokens ({t['tokens'] / max(t['rollout'], 1e-9):,.0f} "
               f"tok/s), scoring {t['scoring'] / steps * 1000:.1f} ms, mean reward "
               f"{t['reward'] / steps:.3f}")
      self.timings = {key: 0.0 for key in t} | {"steps": 0}

  def place(self, host: dict[str, np.ndarray]) -> dict[str, jax.Array]:
    shardings = {key: value.sharding for key, value in self.abstract().items()}
    with jax.transfer_guard_host_to_device("allow"):  # a deliberate transfer (text.Batches)
      return {key: jax.device_put(value, shardings[key]) for key, value in host.items()}

  # --- evaluation ----------------------------------------------------------------------------
  def evaluate(self, state, step: int) -> dict[str, float]:
    """The held-out prompts answered greedily by `state`'s parameters: their mean reward."""
    del step
    held_out = self.data.held_out
    self.observe(state)
    engine = self.rollouts().engine
    greedy = dataclasses.replace(self.sampling, temperature=0.0, top_k=0, top_p=1.0)
    engine.params = state["params"]
    try:
      with jax.transfer_guard("allow"):  # deliberate host work, as in the rollouts
        results = generate(engine, list(held_out.tokens), [greedy] * len(held_out), self.rows)
    finally:
      engine.params = None
    decode = self.data.tokenizer.decode
    rewards = [float(self.reward(decode(r.tokens), record.answer))
               for r, record in zip(results, held_out.records)]
    return {"reward": float(np.mean(rewards)), "prompts": float(len(rewards)),
            "solved": float(np.mean([r >= 1.0 for r in rewards]))}


class _Iterator:
  """Batches from `start_step` on, each sampled when asked for (the loop asks after handing
  the previous step's state to `observe`). `work_seconds` is the time spent making them: the
  loop counts it as the run's work (goodput's rollouts), not as waiting for data."""

  def __init__(self, batches: RolloutBatches, start_step: int):
    self.batches, self.step = batches, start_step
    self.work_seconds = 0.0

  def __iter__(self):
    return self

  def __next__(self) -> dict[str, jax.Array]:
    started = time.perf_counter()
    with jax.transfer_guard("allow"):  # sampling and scoring are deliberate host work
      batch = self.batches.place(self.batches.host_batch(self.step))
    self.step += 1
    self.work_seconds += time.perf_counter() - started
    return batch

  def observe(self, state) -> None:
    self.batches.observe(state)

  def position(self) -> dict:
    return {"step": self.step}

  def close(self) -> None:
    pass


def batches_for(config, log: Callable[[str], None]) -> Callable[[Setup], RolloutBatches]:
  """`loop.run`'s `batches` for a GRPO config: the run's setup -> its RolloutBatches."""
  def make(setup: Setup) -> RolloutBatches:
    d, settings = config.data, Settings.of(config.grpo)
    data = prompts_lib.PromptData.from_config(d, d.seq_len + 1 - settings.max_tokens,
                                              config.train.get("init_from", ""))
    data.check_vocab(setup.spec.model.vocab_size)
    return RolloutBatches(setup, data, settings, config.seed, d.global_batch_size, d.seq_len,
                          log, config.train.log_every)
  return make


def run(config, workdir: str, devices=None, **options):
  """`toolkit.training.run` of a GRPO config, its batches sampled by `RolloutBatches`."""
  from toolkit.training import loop, startup  # pylint: disable=g-import-not-at-top
  return loop.run(config, workdir, devices, batches=batches_for(config, startup.log), **options)
