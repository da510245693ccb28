"""A plan file applied to the run it was made for, and not silently to another one."""
from __future__ import annotations

import pytest

from toolkit.errors import ConfigError
from toolkit.planning import plan as plan_lib

PLAN = {"overrides": {"model.remat": "full"}, "config_argument": "experiments/lm.py:size=7b"}


def test_the_same_experiment_and_variant_pass_quietly():
  said = []
  for argument in ("experiments/lm.py:size=7b", "./experiments/lm.py:size=7b",
                   "/home/me/repo/experiments/lm.py:size=7b", None):
    plan_lib.check_made_for(PLAN, "plan.json", argument, said.append)
  plan_lib.check_made_for({"overrides": {}}, "plan.json", "experiments/vit.py:cpu", said.append)
  assert said == []


def test_another_variant_is_one_warning_line():
  said = []
  plan_lib.check_made_for(PLAN, "plan.json", "experiments/lm.py:size=1b", said.append)
  assert len(said) == 1 and "\n" not in said[0]
  assert said[0].startswith("warning: --plan=plan.json was made for "
                            "--config=experiments/lm.py:size=7b; this run is "
                            "--config=experiments/lm.py:size=1b"), said


def test_another_experiment_file_is_refused():
  with pytest.raises(ConfigError, match=r"made for --config=experiments/lm\.py:size=7b, not "
                                        r"experiments/vit\.py:cpu; make one"):
    plan_lib.check_made_for(PLAN, "plan.json", "experiments/vit.py:cpu")


def test_the_planner_says_why_it_skipped_candidates():
  from toolkit.planning import planner
  from toolkit.planning.candidates import Candidate

  def skipped(status, reason):
    return Candidate(overrides={}, status=status, reason=reason)
  candidates = (
      [skipped("pruned", f"analytic estimate {g}.0 GiB > 16 GiB HBM") for g in (20, 30, 40)]
      + [skipped("lint", f"data.global_batch_size=256 (micro-batch {m}) is not divisible by "
                         f"the batch-sharding axes data=64xfsdp=1 (64 ways); use a multiple "
                         f"of 512") for m in (4, 8)]
      + [skipped("pruned", "2 micro-batch(es) fit by the estimate; more only add communication"),
         skipped("lint", "parameter layers/attention/wk: dimension 2 (kv_heads) has size 8, "
                         "not divisible by tensor=16 (16 ways); set ..."),
         Candidate(overrides={}, status="pending")])
  lines = planner.skipped_reasons(candidates, top=2)
  assert lines == [
      "  skipped     3 (pruned): needs more memory than the chip has, by the estimate",
      "  skipped     2 (lint): the micro-batch does not divide over the batch axes",
      "  skipped     2: 2 other reasons (--json lists every candidate's)"]
  assert "kv_heads does not divide over its mesh axes" in "\n".join(
      planner.skipped_reasons(candidates))
