"""scripts/launch/seeds.py and toolkit.tuning.seeds: one experiment over several seeds, each seed an
ordinary run with that seed, mean +- standard deviation, a rerun that trains nothing."""
from __future__ import annotations

import json
import pathlib
import statistics
import subprocess

import pytest

from experiments import vit
from tests import preloaded
from tests.toolkit.test_cli import _env, the_error_line
from toolkit.errors import ConfigError
from toolkit.tuning import seeds as seeds_lib

REPO = pathlib.Path(__file__).resolve().parents[3]
TIMEOUT_S = 600  # two 6-step tiny runs take ~40 s on 2 shared cores


def _script(*args: str) -> subprocess.CompletedProcess:
  return preloaded.run(script="scripts/launch/seeds.py", args=args, env=_env(), timeout=TIMEOUT_S)


@pytest.fixture(scope="module")
def two_seeds(tmp_path_factory) -> pathlib.Path:
  workdir = tmp_path_factory.mktemp("seeds")
  result = _script("--config=experiments/vit.py:tiny", "--seeds=3,4", f"--workdir={workdir}")
  assert result.returncode == 0, result.stdout + result.stderr
  (workdir / "stdout.txt").write_text(result.stdout)
  return workdir


def test_each_seed_is_a_run_with_that_seed(two_seeds):
  """Each seed is an ordinary run in its own folder, trained with that seed (so the seeds
  differ), and its row holds the run's last held-out evaluation."""
  saved = json.loads((two_seeds / "seeds.json").read_text())
  rows = {r["seed"]: r for r in saved["seeds"]}
  for seed in (3, 4):
    folder = two_seeds / f"seed_{seed}"
    assert json.loads((folder / "config.json").read_text())["seed"] == seed
    evals = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()
             if '"eval"' in line]
    assert rows[seed]["step"] == evals[-1]["step"] == vit.get_config("tiny").train.steps
    assert rows[seed]["metrics"] == {k: v for k, v in evals[-1].items()
                                     if k not in ("step", "kind")}
    assert (folder / "confusion.png").read_bytes().startswith(b"\x89PNG")
  assert rows[3]["metrics"]["loss"] != rows[4]["metrics"]["loss"]


def test_report_is_mean_and_sample_std_over_seeds(two_seeds):
  saved = json.loads((two_seeds / "seeds.json").read_text())
  accuracies = [r["metrics"]["accuracy"] for r in saved["seeds"]]
  assert [r["seed"] for r in saved["seeds"]] == [3, 4]
  summary = saved["summary"]["accuracy"]
  assert summary["mean"] == pytest.approx(statistics.fmean(accuracies), abs=1e-12)
  assert summary["std"] == pytest.approx(statistics.stdev(accuracies), abs=1e-12)
  assert (summary["low"], summary["high"]) == (min(accuracies), max(accuracies))
  stdout = (two_seeds / "stdout.txt").read_text()
  assert (f"  accuracy: {summary['mean']:.2%} +- {summary['std']:.2%} "
          f"(min {min(accuracies):.2%}, max {max(accuracies):.2%})") in stdout
  assert "over 2 seeds (3, 4):" in stdout
  assert (two_seeds / "seeds.png").read_bytes().startswith(b"\x89PNG")


def test_a_rerun_reads_finished_seeds_back_without_training(two_seeds, monkeypatch):
  before = {p: p.read_bytes() for p in two_seeds.glob("seed_*/metrics.jsonl")}
  monkeypatch.setattr(seeds_lib.loop, "run", lambda *a, **k: pytest.fail("trained again"))
  results = seeds_lib.run(vit.get_config("tiny"), [3, 4], str(two_seeds), log=lambda _: None)
  assert {p: p.read_bytes() for p in before} == before
  saved = json.loads((two_seeds / "seeds.json").read_text())
  assert [r.metrics for r in results] == [r["metrics"] for r in saved["seeds"]]


@pytest.mark.parametrize("args,message", [
    (["--seeds=0,one"], "--seeds=0,one: give comma-separated integers"),
    (["--seeds=1,1"], "give one or more distinct integers"),
])
def test_mistakes_are_one_error_line(tmp_path, args, message):
  result = _script("--config=experiments/vit.py:tiny", *args, f"--workdir={tmp_path / 'w'}")
  assert message in the_error_line(result)
  assert not (tmp_path / "w").exists()


def test_a_run_without_evaluation_is_named(tmp_path):
  (tmp_path / "metrics.jsonl").write_text('{"step": 1, "kind": "train", "loss": 1.0}\n')
  with pytest.raises(ConfigError, match="no held-out evaluation"):
    seeds_lib.read(str(tmp_path), seed=0)
