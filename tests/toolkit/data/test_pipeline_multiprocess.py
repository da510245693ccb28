"""Grain pipelines in a local pod: 2 processes x 4 devices see the batches 1 process x 8 sees
(each process loads only its rows; the order is a function of (seed, step) alone)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from tests.toolkit.data.test_pipeline import N, lm_config, token_dir, vit_config  # noqa: F401
from tests.tiny_runs import TOLERANCE
from toolkit import training

pytestmark = pytest.mark.multiprocess

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
RUN_TIMEOUT_S = 300


@pytest.mark.parametrize("name", ["vit", pytest.param("lm", marks=pytest.mark.slow)])
def test_two_processes_see_the_batches_of_one(tmp_path, token_dir, name):  # noqa: F811
  config = lm_config(token_dir) if name == "lm" else vit_config()
  reference = training.run(config, str(tmp_path / "one")).train_losses
  flags = [f"--config.optimizer.schedule_steps={N}", f"--config.train.steps={N}",
           "--config.train.log_every=1", f"--config.train.checkpoint_every={N}"]
  if name == "lm":
    flags = ["--config=experiments/lm.py:tiny,data=tokens", "--config.model.vocab_size=384",
             f"--config.data.path={token_dir}", *flags]
  else:
    flags = ["--config=experiments/vit.py:tiny", f"--config.train.eval_every={N}", *flags]
  workdir = tmp_path / "two"
  proc = subprocess.run([sys.executable, "scripts/launch/local_pod.py", "--processes=2",
                         "--devices_per_process=4", "--", *flags, f"--workdir={workdir}"],
                        cwd=REPO, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
  assert proc.returncode == 0, proc.stdout + proc.stderr
  records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
  losses = {r["step"]: r["loss"] for r in records if r["kind"] == "train"}
  assert sorted(losses) == sorted(reference) == list(range(1, N + 1))
  np.testing.assert_allclose([losses[s] for s in sorted(losses)],
                             [reference[s] for s in sorted(reference)], **TOLERANCE)
