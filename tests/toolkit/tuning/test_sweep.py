"""Sweeps: trial expansion, resuming a killed sweep, successive halving, refusals on the CLI."""
from __future__ import annotations

import json
import math
import os
import pathlib
import signal
import subprocess
import time

import pytest

from tests import preloaded
from tests.toolkit.test_cli import _env, the_error_line
from toolkit.tuning import results as results_lib, search
from toolkit.tuning import runner as sweep_lib
from toolkit.errors import ConfigError

REPO = pathlib.Path(__file__).resolve().parents[3]
SWEEP_TIMEOUT_S = 600  # a tiny 4-trial sweep takes ~40 s on 2 shared cores
TINY_SWEEP = "experiments/lm.py:tiny"


# --- declaration ---------------------------------------------------------------------------------

def test_grid_is_every_combination_in_order():
  sweep = search.Sweep(base="tiny", parameters={"a.x": [1, 2], "a.y": search.Choice(["p", "q"])})
  assert search.trials(sweep) == [{"a.x": 1, "a.y": "p"}, {"a.x": 1, "a.y": "q"},
                                  {"a.x": 2, "a.y": "p"}, {"a.x": 2, "a.y": "q"}]
  capped = search.Sweep(base="tiny", parameters={"a.x": [1, 2, 3]}, budget=2)
  assert search.trials(capped) == [{"a.x": 1}, {"a.x": 2}]


def test_random_search_is_reproducible_and_in_range():
  sweep = search.Sweep(base="tiny", method="random", budget=200, seed=3, parameters={
      "lr": search.LogUniform(1e-4, 1e-2), "wd": search.Uniform(0.0, 0.2),
      "warmup": search.Choice([0, 10]), "b1": [0.9, 0.95]})
  trials = search.trials(sweep)
  assert trials == search.trials(sweep) and len(trials) == 200
  lrs = [t["lr"] for t in trials]
  assert all(1e-4 <= lr <= 1e-2 for lr in lrs)
  # Log-uniform: about half the draws below the geometric mean 1e-3.
  assert 0.35 < sum(lr < 1e-3 for lr in lrs) / len(lrs) < 0.65
  assert all(0.0 <= t["wd"] <= 0.2 for t in trials)
  assert {t["warmup"] for t in trials} == {0, 10} and {t["b1"] for t in trials} == {0.9, 0.95}
  other = search.trials(search.Sweep(**{**sweep.__dict__, "seed": 4}))
  assert other != trials


@pytest.mark.parametrize("sweep,message", [
    (search.Sweep(base="tiny", parameters={"lr": search.LogUniform(1e-3, 1e-2)}),
     "a grid needs a list of values"),
    (search.Sweep(base="tiny", method="random", parameters={"lr": [1]}), "budget=0"),
    (search.Sweep(base="tiny", method="bayes", parameters={"lr": [1]}), "method='bayes'"),
    (search.Sweep(base="tiny", method="random", budget=2,
                  parameters={"lr": search.LogUniform(0, 1)}), "LogUniform"),
    (search.Sweep(base="tiny", parameters={}), "no parameters"),
])
def test_bad_declarations(sweep, message):
  with pytest.raises(ConfigError, match=message):
    search.trials(sweep)


def test_apply_checks_fields_and_types():
  from experiments import lm  # pylint: disable=g-import-not-at-top
  config = lm.get_config("tiny")
  applied = search.apply(config, {"optimizer.weight_decay": 0, "train.steps": 7.0})
  assert applied.optimizer.weight_decay == 0.0 and isinstance(applied.optimizer.weight_decay, float)
  assert applied.train.steps == 7 and config.train.steps == 10  # a copy
  for overrides, message in (({"optimizer.lr": 1.0}, "config has no field 'lr'"),
                             ({"optimiser.learning_rate": 1.0}, "no section 'optimiser'"),
                             ({"train.steps": 2.5}, "the field is an int"),
                             ({"optimizer.learning_rate": "fast"}, "give a number"),
                             ({"optimizer": 1}, "is a section")):
    with pytest.raises(ConfigError, match=message):
      search.apply(config, overrides)


def test_launch_command_round_trips_values():
  command = search.launch_command("experiments/lm.py", "tiny",
                                  {"optimizer.learning_rate": 0.0012345678901234567,
                                   "train.transfer_guard": False}, "/tmp/w")
  assert ("--config.optimizer.learning_rate=0.0012345678901234567 "
          "--config.train.transfer_guard=false --workdir=/tmp/w") in command
  assert float(repr(0.0012345678901234567)) == 0.0012345678901234567


def test_halving_rungs():
  assert search.Halving(min_steps=3, eta=2).rungs(20) == [3, 6, 12, 20]
  assert search.Halving(min_steps=25, eta=3).rungs(100) == [25, 75, 100]
  with pytest.raises(ConfigError, match="eta=1"):
    search.Halving(min_steps=3, eta=1).rungs(10)


# --- running ------------------------------------------------------------------------------------

def _sweep_args(workdir, *args):
  return [f"--config={TINY_SWEEP}", f"--workdir={workdir}", *args]


def _wait_for(condition, process, timeout_s: float) -> None:
  deadline = time.monotonic() + timeout_s
  while not condition():
    if process.poll() is not None:
      raise AssertionError(f"the sweep exited ({process.returncode}) before the condition held: "
                           f"{process.stdout.read()}")
    if time.monotonic() > deadline:
      process.kill()
      raise AssertionError(f"condition not met within {timeout_s} s")
    time.sleep(0.02)


def _table(path):
  """results.csv rows without what differs between runs of the same trials."""
  return [{k: v for k, v in row.items() if k not in results_lib.TIMING_COLUMNS + ("workdir",)}
          for row in results_lib.read_csv(path)]


def _record(workdir, trial):
  with open(os.path.join(workdir, "trials", trial, "trial.json")) as f:
    return json.load(f)


@pytest.mark.slow  # ~5 min on 2 shared cores: three sweeps, two of them in fresh processes
@pytest.mark.timeout(1800)  # measured up to ~11 min while other jobs loaded the 2 cores
def test_killed_sweep_resumes_to_the_same_table(tmp_path):
  """Population mode, 2 trials at a time: kill the sweep once the second population has saved
  step 3 of 6, restart it: the first two trials are not rerun, the last two continue from step
  3, and the table equals that of a sweep that ran straight through."""
  killed = tmp_path / "killed"
  args = ("--mode=population", "--max_concurrent=2")
  process = preloaded.start("toolkit.sweep", _sweep_args(killed, *args), env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  try:
    saved = lambda: all((killed / "trials" / t / "checkpoints" / "3").is_dir()
                        for t in ("002", "003"))
    _wait_for(saved, process, SWEEP_TIMEOUT_S)
    process.send_signal(signal.SIGKILL)
    process.wait(timeout=60)
  finally:
    if process.poll() is None:
      process.kill()
  assert _record(killed, "000")["status"] == "done"
  assert _record(killed, "002")["status"] == "running", "killed too late to test resuming"
  assert not (killed / "results.csv").exists()

  resumed = preloaded.run("toolkit.sweep", _sweep_args(killed, *args), env=_env(),
                          timeout=SWEEP_TIMEOUT_S)
  assert resumed.returncode == 0, resumed.stdout + resumed.stderr
  assert "population 1/1: trials 002,003 to step 6" in resumed.stdout
  assert "restored the 2 trials at step 3" in resumed.stdout
  assert [_record(killed, t)["starts"] for t in ("000", "001", "002", "003")] == [1, 1, 2, 2]

  straight = tmp_path / "straight"
  sweep_lib.run(TINY_SWEEP, str(straight), mode="population", max_concurrent=2,
                log=lambda line: None)
  table = _table(killed / "results.csv")
  assert table == _table(straight / "results.csv")
  assert [row["status"] for row in table] == ["done"] * 4
  assert all(math.isfinite(float(row["final_eval_loss"])) for row in table)
  # A third run finds nothing to do and changes no trial.
  again = sweep_lib.run(TINY_SWEEP, str(killed), mode="population", max_concurrent=2,
                        log=lambda line: None)
  assert [_record(killed, t)["starts"] for t in ("000", "001", "002", "003")] == [1, 1, 2, 2]
  assert [r.final_eval_loss for r in again.results] == [float(r["final_eval_loss"])
                                                        for r in table]
  for name in ("results.md", "eval_loss.png", "hyperparameters.png"):
    assert (killed / name).is_file(), name
  assert "python -m toolkit.train --config=experiments/lm.py:tiny" in (
      killed / "results.md").read_text()


EXPERIMENT = '''
from experiments.lm import get_config
from toolkit.tuning import search

def get_sweep(arg=None):
  fixed = {"mesh.ici": "data:1,fsdp:-1,tensor:1", "sharding.preset": "fsdp",
           "train.sample_tokens": 0, "train.steps": 8, "train.eval_every": 2,
           "train.checkpoint_every": 2, "train.log_every": 2}
  if arg == "shapes":
    return search.Sweep(base="tiny", parameters={"model.d_model": [32, 64]}, fixed=fixed)
  return search.Sweep(base="tiny", fixed=fixed, halving=search.Halving(min_steps=2, eta=2),
                      parameters={"optimizer.learning_rate": [1e-4, 1e-3, 3e-3, 1e-2]})
'''


@pytest.fixture
def experiment(tmp_path):
  path = tmp_path / "exp.py"
  path.write_text(EXPERIMENT)
  return str(path)


@pytest.mark.slow  # ~1.5 min on 2 shared cores
def test_successive_halving(tmp_path, experiment):
  result = sweep_lib.run(experiment, str(tmp_path / "w"), mode="population",
                         log=lambda line: None)
  by_trial = {r.trial: r for r in result.results}
  # Rungs 2, 4, 8: 4 trials -> 2 -> 1. The decision at each rung is by eval loss there.
  steps = sorted(r.steps for r in result.results)
  assert steps == [2, 2, 4, 8]
  for r in result.results:
    assert r.status == ("done" if r.steps == 8 else "stopped")
  for rung, survivors in ((2, 2), (4, 1)):
    reached = [r for r in result.results if r.steps >= rung]
    went_on = sorted(reached, key=lambda r: r.eval_losses[rung])[:survivors]
    assert {r.trial for r in went_on} == {r.trial for r in reached if r.steps > rung}
  assert by_trial["000"].status == "stopped"  # lr 1e-4 learns least in 2 steps


def test_population_refuses_a_shape_field_on_the_command_line(tmp_path, experiment):
  result = preloaded.run(
      "toolkit.sweep", [f"--config={experiment}:shapes", f"--workdir={tmp_path / 'w'}",
                        "--mode=population"], env=_env(), timeout=120)
  line = the_error_line(result)
  assert "model.d_model" in line and "changes a shape" in line and "--mode=processes" in line
  assert result.returncode == 1
  assert not (tmp_path / "w").exists()


@pytest.mark.parametrize("args,message", [
    (["--config=experiments/nope.py"], "the experiment file experiments/nope.py does not exist"),
    (["--config=experiments/lm.py:huge"], "unknown sweep 'huge'"),
    (["--config=toolkit/training/config.py"], "defines no get_sweep"),
    (["--config=experiments/lm.py:tiny", "--mode=fast"], "--mode"),
])
def test_command_line_mistakes(tmp_path, args, message):
  result = preloaded.run("toolkit.sweep", [*args, f"--workdir={tmp_path / 'w'}"], env=_env(),
                         timeout=120)
  assert message in the_error_line(result)
