"""Benchmark: GRPO's rollouts against toolkit.generate on the same batch.

  python scripts/bench/bench_rollouts.py            # experiments/grpo.py:cpu, its step's rollouts
  python scripts/bench/bench_rollouts.py --quick    # seconds: the tiny variant, 2 rounds

The rollouts (toolkit/post_training/rollouts.py) sample each step's completions from the
KV-cache engine on the training mesh, reading the training state's parameters where they are
and handing them back after the call. toolkit.generate builds its engine on the same mesh
and rules with the parameters it restored and keeps them. Both here start from one fresh
training state of the experiment's model (its LoRA adapters included) and sample the same
requests: the experiment's `data.global_batch_size` prompts of its task x
`grpo.generations` completions of up to `grpo.max_tokens` tokens, each completion's seed the
rollouts' (`completion_seed`), `batch_size` the step's rows. Completion tokens/s of each:
the median of --rounds timed rounds after one untimed round that compiles. The ratio
rollouts / generate is the claim (target >= 0.8: sharing the mesh does not slow the engine).
"""
from __future__ import annotations

import json
import statistics
import sys
import time

from absl import app, flags

_CONFIG = flags.DEFINE_string("config", "cpu", "experiments/grpo.py's variant.")
_ROUNDS = flags.DEFINE_integer("rounds", 5, "Timed rounds of each (median taken).",
                               lower_bound=1)
_QUICK = flags.DEFINE_bool("quick", False, "The tiny variant, 2 rounds.")
_JSON = flags.DEFINE_string("json", "", "Write the results as JSON to this path.")

TARGET_RATIO = 0.8  # rollouts / toolkit.generate completion tokens/s, at least


def _timed(call, rounds: int) -> tuple[float, int]:
  """(median seconds of `rounds` calls after an untimed one, completion tokens per call)."""
  tokens = call()
  seconds = []
  for _ in range(rounds):
    start = time.perf_counter()
    again = call()
    seconds.append(time.perf_counter() - start)
    assert again == tokens, "the same requests sampled other completions"
  return statistics.median(seconds), tokens


def measure(variant: str, rounds: int) -> dict:
  """Builds the experiment's model and prompts, times both paths; the results as a dict."""
  import jax  # pylint: disable=g-import-not-at-top
  from experiments import grpo as grpo_experiment  # pylint: disable=g-import-not-at-top
  from toolkit import training  # pylint: disable=g-import-not-at-top
  from toolkit.inference import engine as engine_lib  # pylint: disable=g-import-not-at-top
  from toolkit.post_training import grpo_task  # pylint: disable=g-import-not-at-top
  from toolkit.post_training import rollouts as rollouts_lib  # pylint: disable=g-import-not-at-top
  from toolkit.training import state as state_lib  # pylint: disable=g-import-not-at-top

  config = grpo_experiment.get_config(variant)
  setup = training.build(config)
  batches = grpo_task.batches_for(config, log=lambda line: None)(setup)
  state = state_lib.create(setup.spec.model, setup.optimizer, setup.layout, config.seed)
  params, spec = state["params"], setup.spec
  prompts = [batches.data.train.tokens[i] for i in range(batches.prompts_per_batch)]
  batches.observe(state)
  rollouts = batches.rollouts()
  generations = batches.settings.generations
  flat = [p for p in prompts for _ in range(generations)]
  requests = rollouts.requests(len(prompts), config.seed, 0)

  def rollout() -> list:
    groups = rollouts(params, prompts, config.seed, 0)
    return [r.tokens for g in groups for r in g.results]

  engine = engine_lib.Options().engine(spec.model, params, spec.mesh, spec.rules,
                                       rollouts.engine.cache_length)

  def generate() -> list:
    results = engine_lib.generate(engine, flat, requests, batches.rows,
                                  **engine_lib.Options().batcher())
    return [r.tokens for r in results]

  rollout_s, sampled = _timed(rollout, rounds)
  generate_s, baseline = _timed(generate, rounds)
  assert sampled == baseline, "the rollouts and toolkit.generate sampled other completions"
  tokens = sum(len(t) for t in sampled)
  return {"variant": variant, "devices": jax.device_count(), "mesh": dict(spec.mesh.shape),
          "prompts": len(prompts), "generations": generations,
          "max_tokens": batches.settings.max_tokens, "completion_tokens": tokens,
          "rounds": rounds, "rollouts_s": rollout_s, "generate_s": generate_s,
          "rollouts_tokens_per_s": tokens / rollout_s,
          "generate_tokens_per_s": tokens / generate_s,
          "ratio": generate_s / rollout_s, "target": TARGET_RATIO}


def main(argv) -> None:
  del argv
  from experiments import grpo as grpo_experiment  # pylint: disable=g-import-not-at-top
  from toolkit import runtime  # pylint: disable=g-import-not-at-top
  variant, rounds = ("tiny", 2) if _QUICK.value else (_CONFIG.value, _ROUNDS.value)
  # No TPU or GPU: JAX on the CPU with the devices the variant's mesh needs.
  runtime.start(mesh=grpo_experiment.get_config(variant).mesh)
  r = measure(variant, rounds)
  print(f"experiments/grpo.py:{r['variant']} on {r['devices']} device(s), mesh {r['mesh']}: "
        f"{r['prompts']} prompts x {r['generations']} completions of up to {r['max_tokens']} "
        f"tokens ({r['completion_tokens']} tokens), median of {r['rounds']} rounds")
  print(f"  rollouts          {r['rollouts_s'] * 1000:8.1f} ms  "
        f"{r['rollouts_tokens_per_s']:10,.0f} tok/s")
  print(f"  toolkit.generate  {r['generate_s'] * 1000:8.1f} ms  "
        f"{r['generate_tokens_per_s']:10,.0f} tok/s")
  verdict = "meets" if r["ratio"] >= TARGET_RATIO else "misses"
  print(f"  ratio {r['ratio']:.2f} (rollouts / generate tokens/s): {verdict} the target "
        f">= {TARGET_RATIO}")
  if _JSON.value:
    with open(_JSON.value, "w", encoding="utf-8") as f:
      json.dump(r, f, indent=1)
  sys.exit(0 if r["ratio"] >= TARGET_RATIO or _QUICK.value else 1)


if __name__ == "__main__":
  app.run(main)
