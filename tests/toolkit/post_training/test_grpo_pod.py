"""GRPO on a simulated pod (2 processes x 4 CPU devices): every process samples the same
rollouts on the global mesh (the engine's next tokens replicated, so each process reads them)
and the run trains as one process on 8 devices does."""
from __future__ import annotations

import io
import json
import pathlib

import numpy as np
import pytest

from tests.tiny_runs import TOLERANCE
from tests.toolkit.post_training import test_grpo_task
from toolkit.pod import local
from toolkit.post_training import grpo_task

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]  # a 2-process run: ~1 min

STEPS = test_grpo_task.STEPS
RUN_TIMEOUT_S = 300
# Held-out prompts of the tiny run's evaluations: 8 instead of the task's 256 (~15 s each).
HELD_OUT = [{"prompt": w, "answer": w}
            for w in ("cat", "sun", "tree", "blue", "river", "stone", "lamp", "cloud")]


def _records(workdir: pathlib.Path) -> dict[int, dict]:
  lines = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
  return {r["step"]: r for r in lines if r["kind"] == "train"}


def test_two_processes_sample_and_train_as_one(tmp_path):
  held_out = tmp_path / "held_out.jsonl"
  held_out.write_text("".join(json.dumps(r) + "\n" for r in HELD_OUT))
  config = test_grpo_task._config()  # fsdp 4 x tensor 2 on 8 devices
  config.data.eval_path = str(held_out)
  reference = _records_of(grpo_task.run(config, str(tmp_path / "one")), tmp_path / "one")

  args = ["--config=experiments/grpo.py:tiny", "--config.mesh.ici=fsdp:4,tensor:2",
          "--config.sharding.preset=fsdp_tp", f"--config.grpo.reward={test_grpo_task.REWARD}",
          f"--config.train.steps={STEPS}", "--config.train.log_every=1",
          f"--config.train.eval_every={STEPS}", "--config.train.checkpoint_every=2",
          "--config.optimizer.warmup_steps=0", f"--config.optimizer.schedule_steps={STEPS}",
          f"--config.data.eval_path={held_out}", f"--compilation_cache={tmp_path / 'cache'}"]
  workdir = tmp_path / "pod"
  out, err = io.StringIO(), io.StringIO()
  with local.Pod(2, 4, [*args, f"--workdir={workdir}"], out=out, err=err) as pod:
    code = pod.start().wait(RUN_TIMEOUT_S)
  assert code == 0, f"{out.getvalue()[-3000:]}\n{err.getvalue()[-3000:]}"
  # Both processes compile (tests/toolkit/test_runtime_gpu.py checks the switch itself).
  assert "compilation cache off: with several CPU processes" in pod.output(0)
  records = _records(workdir)
  assert sorted(records) == list(range(1, STEPS + 1))
  for step, record in records.items():
    assert record["reward"] == reference[step]["reward"]  # the same completions were sampled
    np.testing.assert_allclose(record["loss"], reference[step]["loss"], **TOLERANCE)


def _records_of(result, workdir: pathlib.Path) -> dict[int, dict]:
  assert result.eval_metrics[STEPS]["prompts"] == len(HELD_OUT)
  records = _records(workdir)
  rewards = [records[s]["reward"] for s in records]
  assert 0 < max(rewards) and min(rewards) < 1  # groups that score differently
  return records
