"""Every expected result that README.md, docs/*.md or an experiment docstring states, checked
at the tolerance written here; docs/testing.md lists them with these tests.

Why tolerances, and how wide. Training is chaotic: a CPU with other vector widths or other
library kernels rounds differently, and its run drifts away from the documented one. Each
tolerance covers what was measured to move a result on this machine: other seeds (a much
larger push than rounding) and the documented seed with XLA limited to SSE4.2
(`XLA_FLAGS=--xla_cpu_max_isa=SSE4_2`, an older CPU's rounding), plus margin. The long runs
are marked slow; .ci/run runs them after `make test`.

`test_the_docs_state_what_is_tested` fails when a documented number changes without its test
(or the other way round): each claim's text is quoted here once, with the files that state it.
"""
from __future__ import annotations

import ast
import json
import math
import os
import pathlib
import re

import pytest

from experiments import hf as hf_experiment, lm, moe as moe_experiment, vit
from models import LlamaConfig, ViTConfig
from tests import extras, preloaded, tiers, tiny_runs
from toolkit import training
from tests.tiny_runs import TOLERANCE
from tests.models import test_quantization
from tests.models.test_quantization import AGREEMENT, LOGIT_BOUND, TIE_MARGIN
from tests.toolkit.training.checkpoints.test_resume import DAMAGE
from toolkit.tuning import population, results as results_lib, runner, seeds as seeds_lib

REPO = pathlib.Path(__file__).resolve().parents[1]

# --- what the docs say ----------------------------------------------------------------------

# The LM demo (`make demo`): held-out bits per byte at step 0 and at step 300, seed 0 (the
# default). Measured 8.096 and 1.9234; with SSE4.2 rounding 8.096 and 1.9234 again (the LM moves
# by 1e-4, not by rounding's chaos). Seeds 1 and 2 end at 1.96 and 2.06, but they also draw other
# held-out windows (toolkit/data/text.py), so they are other measurements, not other runs of it.
LM_START_BITS, LM_END_BITS = 8.1, 1.9
LM_START_TOLERANCE = 0.05  # an untrained model: log2(256) = 8 plus the init's spread
LM_END_TOLERANCE = 0.05

# The ViT digits recipe: every one of seeds 0, 1, 2 at or above this held-out accuracy...
VIT_FLOOR = 0.97
# ...and their mean as documented, within VIT_MEAN_TOLERANCE (1 point = 3.6 held-out images).
VIT_MEAN, VIT_MEAN_TOLERANCE = 0.9889, 0.01

# The CPU LM sweep (experiments/lm.py get_sweep("cpu")): final held-out bits per byte of the
# trial that came first and of the one that came last, after 100 steps. Trial 002 trains at a
# high learning rate, where rounding matters most: 2.73 in the documented 8-trial population,
# 2.70 two trials at a time, 2.72 two at a time with SSE4.2 rounding and with the layers
# unrolled (2026-12-05, a CPU with AVX-512 FP16). Trial 001: 3.862 each time.
SWEEP_BEST_TRIAL, SWEEP_BEST_BITS, SWEEP_BEST_TOLERANCE = 2, 2.73, 0.1
SWEEP_WORST_TRIAL, SWEEP_WORST_BITS, SWEEP_WORST_TOLERANCE = 1, 3.86, 0.05

# The Hugging Face fine-tune (experiments/hf.py on scripts/data/tiny_hf_model.py's random model):
# held-out bits per byte at step 0 (random weights) and at step 100, and the exported model's
# parameter count as transformers prints it.
HF_START_BITS, HF_END_BITS, HF_TOLERANCE = 8.5, 3.4, 0.1  # the docs round to 0.1
HF_PARAMETERS = 115136

# The mixture of experts (experiments/moe.py, docs/moe.md), on its `tiny` variant for 100 steps:
# the held-out loss falls by more than MOE_LOSS_DROP nats per token, and at the last step the
# least-loaded expert has at least MOE_LOAD_MIN of the mean load, load_balance_loss lies
# strictly between MOE_BALANCE's bounds and nothing is dropped. The `cpu` variant's figures are
# not stated: its 300 steps take 2.7 min on 2 quiet cores, and its final expert loads moved
# between runs (0.54-1.36 of the mean in one, 0.24-1.50 in another).
MOE_STEPS, MOE_LOSS_DROP, MOE_LOAD_MIN, MOE_BALANCE = 100, 1.5, 0.5, (0.9, 1.5)
_MOE_RESULT = (f"trained for {MOE_STEPS} steps", f"the held-out loss falls by more than "
               f"{MOE_LOSS_DROP} nats per token", f"the least-loaded expert has at least "
               f"{MOE_LOAD_MIN} of the mean load", f"load_balance_loss lies between "
               f"{MOE_BALANCE[0]} and {MOE_BALANCE[1]} and nothing is dropped")


def _exponent(value: float) -> str:
  """1e-05 as the docs write it: 1e-5."""
  return re.sub(r"e([+-])0*(\d)", r"e\1\2", f"{value:.0e}")


CLAIMS = {
    "README.md": [
        "a 0.9 M-parameter Llama-style model",
        f"**{LM_START_BITS} bits per byte at step 0 to {LM_END_BITS} at step 300**",
        f"with >= {VIT_FLOOR:.0%} held-out accuracy on each of seeds 0, 1, 2 ({VIT_MEAN:.2%}",
    ],
    "experiments/lm.py": [
        f"from {LM_START_BITS} bits per byte at step 0 to about {LM_END_BITS} at step 300",
        f"trial 00{SWEEP_BEST_TRIAL} (learning rate 0.0127, warmup 30) at {SWEEP_BEST_BITS} bits",
        f"trial 00{SWEEP_WORST_TRIAL} (learning rate 3.6e-4) at {SWEEP_WORST_BITS};",
    ],
    "experiments/vit.py": [f"held-out accuracy >= {VIT_FLOOR:.0%} for each of seeds 0, 1, 2",
                           f"i.e. {VIT_MEAN:.2%} +-"],
    "docs/images.md": [f">= {VIT_FLOOR:.0%} held-out accuracy on each of seeds 0, 1 and 2",
                       f"({VIT_MEAN:.2%} +-"],
    "experiments/hf.py": [f"held-out loss falls from {HF_START_BITS} bits per byte (random "
                          f"weights) to {HF_END_BITS} at step 100"],
    "docs/huggingface.md": [f"held-out loss falls from {HF_START_BITS} bits per byte to "
                            f"{HF_END_BITS} in the 100 steps",
                            f"prints `['LlamaForCausalLM'] {HF_PARAMETERS}`"],
    "docs/sweeps.md": [f"00{SWEEP_BEST_TRIAL} (learning rate 0.0127, warmup 30), {SWEEP_BEST_BITS} "
                       f"bits per byte", f"00{SWEEP_WORST_TRIAL} (learning rate 3.6e-4), "
                       f"{SWEEP_WORST_BITS}"],
    "experiments/moe.py": list(_MOE_RESULT),
    "docs/moe.md": [*_MOE_RESULT, f"`moe_tiny` learns the stdlib docs in {MOE_STEPS} steps (the "
                    f"held-out loss falls by more than {MOE_LOSS_DROP} nats per token) with its "
                    f"least-loaded expert at >= {MOE_LOAD_MIN} of the mean load",
                    # The float32 tolerance the page quotes is the shared one.
                    f"the project tolerance `rtol={_exponent(TOLERANCE['rtol'])}, "
                    f"atol={_exponent(TOLERANCE['atol'])}`"],
}


# Supervised fine-tuning (experiments/sft.py, docs/post_training.md): the demo's model (the CPU
# LM after `make demo`'s 300 steps on CPython's docs, exported to a Hugging Face folder) fine-
# tuned on synthetic:repeat, fully (sft.py:cpu) and with rank-SFT_LORA_RANK adapters on a frozen
# base (sft.py:cpu,lora=16); held-out exact match of greedy generation through the KV-cache
# engine, before (the demo's model) and after, on each of seeds 0, 1, 2. Measured: 0 % before;
# after, as the trials of one population (as sft_scores runs them), on one CPU device (as the
# commands run; since 2026-12-06) 99.6, 100 and 98.0 % fully and 100 % on each with adapters;
# in a process of 8 simulated devices 100 % on each seed of both,
# and on seeds 3, 4, 5 (at step 300 the full fine-tunes had >= 99 % on seeds 0-5; at step 600,
# one seed's adapters 30 %). The task is learnt suddenly at a step that moves with the seed
# (experiments/sft.py), so the floor is 90 %.
SFT_SEEDS, SFT_BEFORE_MAX, SFT_AFTER_MIN, SFT_LORA_RANK = (0, 1, 2), 0.05, 0.90, 16
_SFT_RESULT = (f"held-out exact match from <= {SFT_BEFORE_MAX:.0%} before to >= "
               f"{SFT_AFTER_MIN:.0%} after fine-tuning on each of seeds 0, 1, 2",
               f"with rank-{SFT_LORA_RANK} LoRA adapters on the frozen base, from <= "
               f"{SFT_BEFORE_MAX:.0%} before to >= {SFT_AFTER_MIN:.0%} after on each of seeds "
               f"0, 1, 2")
CLAIMS.update({"experiments/sft.py": list(_SFT_RESULT),
               "docs/post_training.md": list(_SFT_RESULT)})

# Preference tuning (experiments/dpo.py, docs/post_training.md): rank-16 adapters on the demo's
# model (exported as for the fine-tuning result) trained with DPO on synthetic:repeat pairs;
# the held-out pairs whose chosen completion the model finds likelier (choice_accuracy) before
# and after, and after, the implicit rewards' preference accuracy, on each of seeds 0, 1, 2.
# Measured: 50.8 % before (the base model; the same for every seed); after 400 steps
# 99.2-100 % and a preference accuracy of 99.2-100 % on each of seeds 0-5 (>= 84 % at step
# 200 on each).
DPO_SEEDS, DPO_BEFORE_MAX, DPO_AFTER_MIN = (0, 1, 2), 0.65, 0.90
_DPO_RESULT = (f"the held-out pairs whose chosen completion the model finds likelier go from "
               f"<= {DPO_BEFORE_MAX:.0%} before to >= {DPO_AFTER_MIN:.0%} after, with a "
               f"preference accuracy >= {DPO_AFTER_MIN:.0%}, on each of seeds 0, 1, 2",)
CLAIMS["experiments/dpo.py"] = list(_DPO_RESULT)
CLAIMS["docs/post_training.md"] += list(_DPO_RESULT)

# Reinforcement learning (experiments/grpo.py, docs/post_training.md): GRPO's rank-16 adapters
# on experiments/sft.py's full fine-tune stopped before it has learned the task: at the last of
# GRPO_SFT_STOPS (steps of its 400, from the demo's model, exported as for the fine-tuning
# result) whose held-out exact match is at most GRPO_BEFORE_MAX; held-out exact match answered
# greedily before and after GRPO's 200 steps, on each of seeds 0, 1, 2. Where the fine-tune
# learns moves with the CPU's rounding and with the demo's layers run scanned or unrolled (the
# demo's weights differ). On a CPU with AVX-512 FP16, unrolled: 2.3 % at step 200, 13.7 % at
# 210, 24.6 % at 220, 32.4 % at 230, 39.8 % at 240, 62.9 % at 250; scanned: 3.5 % at 160,
# 25.4 % at 180, 43.4 % at 190, 66.4 % at 200, 84.4 % at 220; another CPU, scanned, 11.7 % at
# 200 and 32.0 % at 220. Stops 20 steps apart (160, 180, 200, 220 until 2026-12-05) picked the
# unrolled demo's step 220 at 24.6 %, from which GRPO reached only 45.3, 48.8, 44.9 % on seeds
# 0, 1, 2, and from 32.4 % (step 230) 54.3, 52.3 (19.9 points up), 55.9 %: a base near the
# bound learns fastest. Measured from the picks of stops 10 apart: unrolled from 39.8 % (step
# 240) 73.4, 78.5, 68.0 % after on seeds 0, 1, 2; scanned from 43.4 % (step 190) 78.9, 91.0,
# 99.2 %; earlier picks, scanned: from 32.0 % (step 220, the other CPU) 82.8, 80.5, 70.7 % and
# 60.5, 62.5 % on seeds 3, 4 (52.7 % on seed 0 at learning rate 1e-3 and temperature 1.0, the
# earlier defaults); from 25.4 % (step 180) 93.4, 80.5, 84.4 %. On one CPU device, as the
# commands run (since 2026-12-06), an AMD EPYC (Zen 5): 32.8 % at step 190, 55.5 % at 200; from
# step 190 57.4, 57.0, 57.8 %.
GRPO_SEEDS, GRPO_SFT_STOPS = (0, 1, 2), tuple(range(160, 261, 10))
GRPO_BEFORE_MAX, GRPO_AFTER_MIN, GRPO_GAIN_MIN = 0.45, 0.50, 0.20
_GRPO_RESULT = (f"from <= {GRPO_BEFORE_MAX:.0%} before to >= {GRPO_AFTER_MIN:.0%} after 200 "
                f"steps, and at least {GRPO_GAIN_MIN * 100:.0f} points above where it started, "
                f"on each of seeds 0, 1, 2",
                f"the last of steps {GRPO_SFT_STOPS[0]} to {GRPO_SFT_STOPS[-1]} of its 400, "
                f"every {GRPO_SFT_STOPS[1] - GRPO_SFT_STOPS[0]}, whose held-out exact match is at "
                f"most {GRPO_BEFORE_MAX:.0%}")
CLAIMS["experiments/grpo.py"] = list(_GRPO_RESULT)
CLAIMS["docs/post_training.md"] += list(_GRPO_RESULT)

# Int8 weight-only serving against bfloat16 on the demo's CPU LM: the bounds are
# tests/models/test_quantization.py's (where they are measured); checked below.
CLAIMS["docs/inference.md"] = [
    f"On the `cpu` model `make demo` trains ({lm.get_config('cpu').train.steps}",
    f"bfloat16's at >= {AGREEMENT:.0%} of positions", f"no logit moves by more than {LOGIT_BOUND}",
    f"two best logits are within {TIE_MARGIN} of each other"]


def _words(text: str) -> str:
  """Whitespace-insensitive, and "98.89 %" (the docs' style) reads as "98.89%"."""
  return " ".join(text.split()).replace(" %", "%")


@pytest.mark.parametrize("path", sorted(CLAIMS))
def test_the_docs_state_what_is_tested(path):
  text = _words((REPO / path).read_text())
  for claim in CLAIMS[path]:
    assert _words(claim) in text, f"{path} no longer says {claim!r}: update the test or the doc"


def test_parameter_counts_as_documented():
  """README: a 0.9 M-parameter LM; docs/images.md and experiments/vit.py: 0.17 M and 86 M."""
  assert round(LlamaConfig.preset("cpu").num_params() / 1e6, 1) == 0.9
  assert round(ViTConfig.preset("digits").num_params() / 1e6, 2) == 0.17
  assert round(ViTConfig.preset("b16").num_params() / 1e6) == 86


_NUMBER_WORDS = ("no", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine",
                 "ten")


def _assignments(path: str) -> dict[str, ast.expr]:
  """name -> value of a module's top-level assignments, read from its source (so a module that
  needs the test extra's torch is not imported)."""
  tree = ast.parse((REPO / path).read_text())
  return {target.id: node.value for node in tree.body if isinstance(node, ast.Assign)
          for target in node.targets if isinstance(target, ast.Name)}


def test_the_counts_in_testing_md_are_the_tests():
  """docs/testing.md's counts of what a test covers, read from the tests, so the page cannot
  drift from them: the kinds of checkpoint damage, the Hugging Face parity configurations
  with their bound and prompt length, the slowest tests `make test` lists, and every test the
  documented-results table names is one of this module's."""
  page = (REPO / "docs/testing.md").read_text()
  text = _words(page)
  assert f"{len(DAMAGE)} kinds of damage to the newest checkpoint" in text, len(DAMAGE)
  reference = _assignments("tests/toolkit/hf/reference.py")
  configurations = len(reference["CONFIGS"].keys)
  parity, length = (ast.literal_eval(reference[name]) for name in ("HF_PARITY", "PROMPT_LENGTH"))
  assert (f"within {_exponent(parity)} at {length} positions" in text
          and f"; {_NUMBER_WORDS[configurations]} configurations)" in text), configurations
  durations = re.search(r"--durations=(\d+)", (REPO / "Makefile").read_text()).group(1)
  assert f"its {durations} slowest tests (`--durations={durations}`)" in text, durations
  table = [line for line in page.splitlines() if line.startswith("| ")]
  named = {name for line in table for name in re.findall(r"`(test_\w+)`", line)}
  assert named and named <= set(globals()), named - set(globals())


def test_every_three_seed_result_runs_seed_0_in_presubmit_and_its_other_seeds_in_full():
  """tests/tiers.py's SEEDS clause: each result the docs state for seeds 0, 1 and 2 has a seed-0
  test in the presubmit tier and a test of seeds 1 and 2 in the full tier, and no seed is left
  out."""
  assert FIRST_SEED + OTHER_SEEDS == SFT_SEEDS == DPO_SEEDS == GRPO_SEEDS == (0, 1, 2)
  three_seed = [name for name in globals() if re.fullmatch(r"test_\w+_on_three_seeds", name)]
  assert len(three_seed) == 4, three_seed  # the ViT, SFT (full and LoRA), DPO, GRPO
  for name in three_seed:
    params = {p.id: p for mark in globals()[name].pytestmark if mark.name == "parametrize"
              for p in mark.args[1]}
    assert set(params) == {"seed_0", "seeds_1_2"}, (name, params)
    assert params["seed_0"].values == (FIRST_SEED,) and not params["seed_0"].marks, name
    assert params["seeds_1_2"].values == (OTHER_SEEDS,), name
    assert [m.name for m in params["seeds_1_2"].marks] == [tiers.MARKER], name


# --- the runs behind them -------------------------------------------------------------------

# A result stated for seeds 0, 1 and 2 is checked in two tests (tests/tiers.py): seed 0 in the
# presubmit tier, at the same floor, and the other seeds, with any check across all three (the
# ViT's mean), in the full tier.
FIRST_SEED, OTHER_SEEDS = (0,), (1, 2)


def _seeds(test: str):
  """The parameters of a three-seed result's test `test`: seed 0, and seeds 1 and 2 full-tier."""
  return pytest.mark.parametrize("seeds", [
      pytest.param(FIRST_SEED, id="seed_0"),
      pytest.param(OTHER_SEEDS, id="seeds_1_2", marks=tiers.full(
          tiers.SEEDS, by=f"tests/test_documented_results.py::{test}[seed_0]"))])

# Whole training runs get a wider limit than pyproject's 600 s per test: the demo, 1.9-3.8 min
# on 2 quiet cores, ran past 600 s at a load average of ~14.
RUN_TIMEOUT_S = 1800


@pytest.mark.slow  # the whole demo: 1.9-3.8 min on 2 quiet cores, ~8-10 while other jobs run
@pytest.mark.timeout(RUN_TIMEOUT_S)
def test_lm_demo_bits_per_byte(lm_demo):
  """README and experiments/lm.py: `make demo`'s held-out loss, 8.1 -> 1.9 bits per byte."""
  bits, _ = lm_demo
  print(f"\nheld-out bits per byte: {bits}")
  assert bits[0] == pytest.approx(LM_START_BITS, abs=LM_START_TOLERANCE)
  assert bits[lm.get_config("cpu").train.steps] == pytest.approx(LM_END_BITS,
                                                                  abs=LM_END_TOLERANCE)


@pytest.fixture(scope="module")
def lm_demo(tmp_path_factory) -> tuple[dict[int, float], str]:
  """`make demo`'s run, once for the module: (held-out bits per byte by step, its workdir). The
  supervised fine-tuning results start from its checkpoint."""
  workdir = str(tmp_path_factory.mktemp("lm_demo"))
  return {int(step): value for step, value in _as_a_user_runs("demo_bits", workdir).items()}, \
      workdir


@pytest.mark.slow  # the forward passes: seconds once the demo's run is there
@pytest.mark.timeout(2 * RUN_TIMEOUT_S)  # the demo's run comes first when unshared
def test_int8_weights_agree_with_bfloat16_on_the_demo_model(lm_demo):
  """docs/inference.md: int8 weights pick bfloat16's greedy token at >= 99 % of held-out
  positions on `make demo`'s model (the bounds: tests/models/test_quantization.py)."""
  test_quantization.check_int8_agrees_with_bfloat16(lm.get_config("cpu"), lm_demo[1])


def _as_a_user_runs(name: str, *args, devices: int | None = None):
  """`name(*args)`, one of the runs below, in a process of its own with XLA's default code
  generation, as a user's run has it (the suite turns LLVM's optimizations off, which makes
  these long runs' steps ~1.8x slower; tests/tiny_runs.py), and with `devices` CPU devices
  instead of the suite's 8 where the documented commands train on one device (their step took
  0.85x the time there, quiet, with 2 XLA threads instead of 8 on 2 cores). The process has
  the compilation cache on, as a user's command has by default (`as_a_user`)."""
  return preloaded.call("tests.test_documented_results:as_a_user", name, *args,
                        env=tiny_runs.default_codegen_env(devices), timeout=RUN_TIMEOUT_S)


def as_a_user(name: str, *args):
  """`name(*args)` in the process `_as_a_user_runs` starts, with JAX's persistent compilation
  cache in the folder toolkit.train's --compilation_cache names by default (under
  XDG_CACHE_HOME: the suite's own cache, tests/conftest.py): a run on the second and third seed
  reads the programs of the first back, as a user's command run again does."""
  from toolkit import runtime  # pylint: disable=g-import-not-at-top
  runtime.enable_compilation_cache(runtime.default_cache_dir())
  return globals()[name](*args)


def demo_bits(workdir: str) -> dict[int, float]:
  """`make demo`'s run: held-out bits per byte by step."""
  result = training.run(lm.get_config("cpu"), workdir)
  return {step: m["bits_per_byte"] for step, m in result.eval_metrics.items()}


def vit_seeds(seeds: list[int], workdir: str) -> dict:
  """The ViT recipe on `seeds`: each seed's last evaluation, and their mean accuracy."""
  results = seeds_lib.run(vit.get_config("cpu"), list(seeds), workdir, log=print)
  print(seeds_lib.format_report(results))
  return {"rows": [{"step": r.step, "examples": r.metrics["examples"],
                    "accuracy": r.metrics["accuracy"]} for r in results],
          "mean": seeds_lib.summarize(results)["accuracy"].mean}


def sweep_bits(workdir: str) -> dict[int, float]:
  """The CPU LM sweep's first and last trials trained as the sweep trains them (one population
  program): final held-out bits per byte by trial."""
  loaded = runner.load("experiments/lm.py:cpu")
  picked = [SWEEP_BEST_TRIAL, SWEEP_WORST_TRIAL]
  workdirs = [os.path.join(workdir, f"{i:03d}") for i in picked]
  population.run([loaded.configs[i] for i in picked], workdirs, until=100, log=print)
  return {trial: results_lib.eval_losses(folder)[100] / math.log(2)
          for trial, folder in zip(picked, workdirs)}


@pytest.mark.slow  # a run of the recipe: ~1.5 min on 2 shared cores
@pytest.mark.timeout(RUN_TIMEOUT_S)
@_seeds("test_vit_digits_recipe_on_three_seeds")
def test_vit_digits_recipe_on_three_seeds(seeds, tmp_path):
  """experiments/vit.py, README, docs/images.md: >= 97 % on each of seeds 0, 1, 2, and their
  mean as documented (the full tier's test trains seed 0 again for it)."""
  with_mean = seeds != FIRST_SEED
  trained = _as_a_user_runs("vit_seeds", FIRST_SEED + seeds if with_mean else seeds,
                            str(tmp_path))
  assert len(trained["rows"]) == len(seeds) + with_mean
  for row in trained["rows"]:
    assert row["step"] == 1200 and row["examples"] == 359, row
    assert row["accuracy"] >= VIT_FLOOR, row
  if with_mean:
    assert trained["mean"] == pytest.approx(VIT_MEAN, abs=VIT_MEAN_TOLERANCE)


@pytest.mark.slow  # two trials x 100 steps of the CPU LM in one population: ~4 min
@pytest.mark.timeout(RUN_TIMEOUT_S)
def test_sweep_best_and_worst_trials(tmp_path):
  """experiments/lm.py and docs/sweeps.md: the sweep's first and last trials, trained as the
  sweep trains them (one population program; each trial equals its own run, see
  tests/toolkit/tuning/test_population.py)."""
  final = {int(trial): bits for trial, bits in _as_a_user_runs("sweep_bits",
                                                                 str(tmp_path)).items()}
  print(f"\nfinal held-out bits per byte by trial: {final}")
  assert final[SWEEP_BEST_TRIAL] == pytest.approx(SWEEP_BEST_BITS, abs=SWEEP_BEST_TOLERANCE)
  assert final[SWEEP_WORST_TRIAL] == pytest.approx(SWEEP_WORST_BITS, abs=SWEEP_WORST_TOLERANCE)


@pytest.mark.slow  # 14 s; the default suite stays near its budget (docs/testing.md)
def test_tiny_moe_learns_the_stdlib_docs_with_every_expert_in_use(tmp_path):
  """experiments/moe.py and docs/moe.md: the tiny MoE's held-out loss falls by more than 1.5
  nats per token in 100 steps, its experts all in use at the end."""
  config = moe_experiment.get_config("tiny")
  config.train.update(steps=MOE_STEPS, log_every=25, eval_every=MOE_STEPS,
                      checkpoint_every=MOE_STEPS)
  result = training.run(config, str(tmp_path))
  assert result.eval_losses[MOE_STEPS] < result.eval_losses[0] - MOE_LOSS_DROP, result.eval_losses
  records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  last = [r for r in records if r["kind"] == "train"][-1]
  assert last["step"] == MOE_STEPS
  assert last["expert_load_min"] >= MOE_LOAD_MIN, last        # least-loaded expert vs the mean
  assert last["dropped_fraction"] == 0.0
  assert MOE_BALANCE[0] < last["load_balance_loss"] < MOE_BALANCE[1], last
  # The training loss is the cross-entropy plus the weighted router losses it reports.
  assert last["aux_loss"] == pytest.approx(0.01 * last["load_balance_loss"]
                                           + 0.001 * last["router_z_loss"], rel=1e-5)


@pytest.mark.slow  # 100 steps of the tiny HF model: ~30 s on 2 cores at a load average of ~5
@pytest.mark.timeout(RUN_TIMEOUT_S)
def test_hf_fine_tune_bits_per_byte(tmp_path):
  """experiments/hf.py and docs/huggingface.md: the tiny random HF Llama, fine-tuned on
  CPython's docs, 8.5 -> 3.4 bits per byte; its export has 115,136 parameters."""
  from scripts.data import tiny_hf_model  # pylint: disable=g-import-not-at-top
  extras.require("transformers")
  folder = tmp_path / "hf_tiny"
  model = tiny_hf_model.write(str(folder))  # the script's defaults: seed 0, byte tokenizer
  assert model.num_parameters() == HF_PARAMETERS
  config = hf_experiment.get_config(str(folder))
  result = training.run(config, str(tmp_path / "tuned"))
  bits = {step: loss / math.log(2) for step, loss in result.eval_losses.items()}
  print(f"\nheld-out bits per byte: {bits}")
  assert bits[0] == pytest.approx(HF_START_BITS, abs=HF_TOLERANCE)
  assert bits[config.train.steps] == pytest.approx(HF_END_BITS, abs=HF_TOLERANCE)


# --- supervised fine-tuning (experiments/sft.py) ----------------------------------------------

@pytest.fixture(scope="module")
def sft_base(lm_demo, tmp_path_factory) -> str:
  """The Hugging Face folder the fine-tuning results start from: the demo's checkpoint
  exported, as experiments/sft.py's commands do. Shared by the full fine-tuning result and
  the LoRA one."""
  from toolkit import conversion  # pylint: disable=g-import-not-at-top
  out = str(tmp_path_factory.mktemp("sft_base") / "lm_cpu_hf")
  conversion.export_checkpoint(lm_demo[1], out)
  return out


def sft_scores(arg: str, seeds: list[int], workdir: str) -> dict:
  """experiments/sft.py:`arg` fine-tuned on one device once per seed of `seeds`, in
  `workdir`/seed_N: the held-out exact match (toolkit/evaluation/exact_match.py) of the weights it
  starts from ("before", the same for every seed) and of each seed's trained ones. The LoRA
  result passes its own variant. The seeds train as the trials of one population program, as
  a sweep over seed trains them (each trial equals its own run: tests/toolkit/tuning/
  test_population.py and test_population_lora.py): the CPU step's fixed cost is paid once for
  the three."""
  import jax  # pylint: disable=g-import-not-at-top
  from experiments import sft  # pylint: disable=g-import-not-at-top
  from toolkit.evaluation import exact_match  # pylint: disable=g-import-not-at-top
  from toolkit.inference.restore import restore_params  # pylint: disable=g-import-not-at-top
  devices = jax.devices()[:1]
  config = sft.get_config(arg)
  before = exact_match.score(config, *exact_match.initial_params(config, devices))
  print(f"before: {before.format()}", flush=True)
  configs = [sft.get_config(arg) for _ in seeds]
  for trial, seed in zip(configs, seeds):
    trial.seed = seed
  folders = [os.path.join(workdir, f"seed_{seed}") for seed in seeds]
  population.run(configs, folders, until=config.train.steps, devices=devices, log=print)
  after = {}
  for seed, folder in zip(seeds, folders):
    params, model_cfg, *_ = restore_params(config, folder, devices)
    score = exact_match.score(config, jax.device_get(params), model_cfg)
    print(f"seed {seed} after: {score.format()}", flush=True)
    after[seed] = {"accuracy": score.accuracy, "total": score.total}
  return {"before": {"accuracy": before.accuracy, "total": before.total}, "after": after}


@pytest.mark.slow  # ~270 s on 2 quiet cores for 3 seeds: two populations (400 and 1,000 steps)
@pytest.mark.timeout(2 * RUN_TIMEOUT_S)  # the demo's run (~130 s quiet) comes first when unshared
@_seeds("test_sft_learns_to_repeat_words_on_three_seeds")
def test_sft_learns_to_repeat_words_on_three_seeds(seeds, sft_base, tmp_path):
  """experiments/sft.py and docs/post_training.md: the demo's model fine-tuned on
  synthetic:repeat, fully and with rank-16 LoRA adapters on its frozen weights: held-out exact
  match <= 5 % before and >= 90 % after, on each of seeds 0, 1, 2."""
  for name, arg in (("full", f"cpu,base={sft_base}"),
                    ("lora", f"cpu,base={sft_base},lora={SFT_LORA_RANK}")):
    scores = _as_a_user_runs("sft_scores", arg, seeds, str(tmp_path / name), devices=1)
    print(f"\n{name}: held-out exact match: {scores}")
    assert scores["before"]["total"] == 256
    assert scores["before"]["accuracy"] <= SFT_BEFORE_MAX, (name, scores)
    assert sorted(scores["after"]) == [str(seed) for seed in seeds]
    for seed, row in scores["after"].items():
      assert row["total"] == 256 and row["accuracy"] >= SFT_AFTER_MIN, (name, seed, scores)


# --- preference tuning (experiments/dpo.py) ---------------------------------------------------

def dpo_scores(arg: str, seeds: list[int], workdir: str) -> dict:
  """experiments/dpo.py:`arg` trained once per seed of `seeds`, in `workdir`/seed_N: each
  run's held-out metrics at step 0 and at its last step. One run after another, as the
  documented command runs, not as the trials of one population (sft_scores): measured on one
  device, the three as a population took 141.5 s against 140.3 s in turn (DPO's step is
  compute-bound: a population shares nothing of it)."""
  import jax  # pylint: disable=g-import-not-at-top
  from experiments import dpo  # pylint: disable=g-import-not-at-top
  scores = {}
  for seed in seeds:
    config = dpo.get_config(arg)
    config.seed = seed
    result = training.run(config, os.path.join(workdir, f"seed_{seed}"), jax.devices()[:1])
    scores[seed] = {"before": result.eval_metrics[0],
                    "after": result.eval_metrics[config.train.steps]}
    print(f"seed {seed}: {scores[seed]}", flush=True)
  return scores


@pytest.mark.slow  # a run of 400 steps a seed: ~40 s on 2 quiet cores
@pytest.mark.timeout(2 * RUN_TIMEOUT_S)  # the demo's run comes first when unshared
@_seeds("test_dpo_prefers_the_right_word_on_three_seeds")
def test_dpo_prefers_the_right_word_on_three_seeds(seeds, sft_base, tmp_path):
  """experiments/dpo.py and docs/post_training.md: DPO on the demo's model makes it prefer the
  chosen completion of held-out pairs on each of seeds 0, 1, 2."""
  scores = _as_a_user_runs("dpo_scores", f"cpu,base={sft_base}", seeds, str(tmp_path),
                           devices=1)
  assert sorted(scores) == [str(seed) for seed in seeds]
  for seed, row in scores.items():
    assert row["before"]["pairs"] == row["after"]["pairs"] == 128, (seed, row)
    assert row["before"]["choice_accuracy"] <= DPO_BEFORE_MAX, (seed, row)
    assert row["after"]["choice_accuracy"] >= DPO_AFTER_MIN, (seed, row)
    assert row["after"]["preference_accuracy"] >= DPO_AFTER_MIN, (seed, row)


# --- reinforcement learning (experiments/grpo.py) ---------------------------------------------

def grpo_base(demo_hf: str, workdir: str) -> str:
  """The fine-tune experiments/grpo.py starts from: experiments/sft.py's from `demo_hf`, exported
  at the last step of GRPO_SFT_STOPS whose held-out exact match is at most GRPO_BEFORE_MAX (the
  first stop when none is). One run to the last stop saves each one (a run stopped there and
  resumed trains bitwise the same: tests/toolkit/training/checkpoints/test_checkpoint.py); they are scored
  in turn until one is above the bound."""
  import jax  # pylint: disable=g-import-not-at-top
  from experiments import sft  # pylint: disable=g-import-not-at-top
  from toolkit.evaluation import exact_match  # pylint: disable=g-import-not-at-top
  from toolkit import conversion  # pylint: disable=g-import-not-at-top
  from toolkit.inference.restore import restore_params  # pylint: disable=g-import-not-at-top
  devices, folder, base = jax.devices()[:1], os.path.join(workdir, "sft"), None
  config = sft.get_config(f"cpu,base={demo_hf}")
  config.optimizer.schedule_steps = config.train.steps
  config.train.update(steps=GRPO_SFT_STOPS[-1], eval_every=1000,
                      checkpoint_every=GRPO_SFT_STOPS[1] - GRPO_SFT_STOPS[0],
                      keep_checkpoints=len(GRPO_SFT_STOPS))
  training.run(config, folder, devices)
  for stop in GRPO_SFT_STOPS:
    params, model_cfg, *_ = restore_params(config, folder, devices, step=stop)
    score = exact_match.score(config, jax.device_get(params), model_cfg)
    print(f"fine-tune at step {stop}: {score.format(show=0)}", flush=True)
    if score.accuracy > GRPO_BEFORE_MAX and base is not None:
      break
    base = stop
    if score.accuracy > GRPO_BEFORE_MAX:
      break  # past the bound at the first stop: the test's check of "before" says so
  out = os.path.join(workdir, f"sft_{base}_hf")
  conversion.export_checkpoint(folder, out, step=base)
  return out


def grpo_scores(demo_hf: str, seeds: list[int], workdir: str) -> dict:
  """experiments/grpo.py's documented commands from the demo's exported model `demo_hf`: the
  fine-tune stopped as `grpo_base` picks, then GRPO once per seed of `seeds` in
  `workdir`/seed_N. Each run's held-out evaluation at step 0 and at its last step (evaluated
  there only: the runs' other evaluations change nothing they train)."""
  import jax  # pylint: disable=g-import-not-at-top
  from experiments import grpo  # pylint: disable=g-import-not-at-top
  from toolkit.post_training import grpo_task as grpo_lib  # pylint: disable=g-import-not-at-top
  devices = jax.devices()[:1]
  base = grpo_base(demo_hf, workdir)
  scores = {}
  for seed in seeds:
    config = grpo.get_config(f"cpu,base={base}")
    config.seed = seed
    config.train.eval_every = config.train.steps
    result = grpo_lib.run(config, os.path.join(workdir, f"seed_{seed}"), devices)
    scores[seed] = {"before": result.eval_metrics[0],
                    "after": result.eval_metrics[config.train.steps]}
    print(f"seed {seed}: {scores[seed]}", flush=True)
  return scores


@pytest.mark.slow  # a 260-step fine-tune, its stops scored, a GRPO run of 200 steps a seed:
@pytest.mark.timeout(3 * RUN_TIMEOUT_S)  # ~4.5 min for 3 seeds; the demo's run first when unshared
@_seeds("test_grpo_raises_exact_match_on_three_seeds")
def test_grpo_raises_exact_match_on_three_seeds(seeds, sft_base, tmp_path):
  """experiments/grpo.py and docs/post_training.md: GRPO on an early stop of the fine-tune
  raises its held-out exact match on each of seeds 0, 1, 2."""
  scores = _as_a_user_runs("grpo_scores", sft_base, seeds, str(tmp_path), devices=1)
  assert sorted(scores) == [str(seed) for seed in seeds]
  for seed, row in scores.items():
    before, after = row["before"], row["after"]
    assert before["prompts"] == after["prompts"] == 256, (seed, row)
    assert before["solved"] <= GRPO_BEFORE_MAX, (seed, row)
    assert after["solved"] >= GRPO_AFTER_MIN, (seed, row)
    assert after["solved"] >= before["solved"] + GRPO_GAIN_MIN, (seed, row)
