"""The local checkpoint tier on a pod of 2 processes x 2 devices (toolkit/training/checkpoints/host_shards.py):
a run whose newest persistent checkpoint is step 3 and whose local tier holds step 4 restarts
from step 4 when a host comes back empty (its shards from the copy on the other host) or with
its copy damaged, and trains step 5 exactly as before; a host lost with its peer's copy falls
back to step 3 with one warning. (Under toolkit.supervise, with a SIGKILL and a host back
empty: scripts/dev/drill_faults.py, a documented command.) Every run is a local pod started here
(bounded, killed by PID by toolkit.pod.local)."""
from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.multiprocess,
              pytest.mark.slow]  # ~35 s: five pod runs; the default suite is over its budget

REPO = pathlib.Path(__file__).resolve().parents[3]
TIMEOUT_S = 300  # one tiny 2-process run takes ~10-20 s on 2 shared cores
# --heartbeat_timeout: these runs are about restoring, not about noticing a dead peer (the
# default 10 s: tests/toolkit/pod/test_multiprocess.py). Under CI's load (both pytest processes
# and the newest-deps smoke tests beside them) one of them went 10 s without a heartbeat while
# both processes compiled, and the coordination service aborted the two as dead.
COMMON = ["--config=experiments/lm.py:tiny", "--config.optimizer.schedule_steps=6",
          "--config.train.checkpoint_every=3", "--config.train.eval_every=6",
          "--config.train.log_every=1", "--config.train.sample_tokens=0",
          "--config.train.local_checkpoint_every=2", "--heartbeat_timeout=60"]


def _pod(workdir: pathlib.Path, local: pathlib.Path, steps: int, status: int = 0) -> str:
  result = subprocess.run(
      [sys.executable, "scripts/launch/local_pod.py", "--processes=2", "--devices_per_process=2", "--",
       *COMMON, f"--workdir={workdir}", f"--config.train.local_checkpoint_dir={local}",
       f"--config.train.steps={steps}"],
      cwd=REPO, env=dict(os.environ), capture_output=True, text=True, timeout=TIMEOUT_S)
  assert result.returncode == status, result.stdout + result.stderr
  return result.stdout + result.stderr if status else result.stdout


def _losses(workdir: pathlib.Path) -> dict[int, float]:
  records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
  return {r["step"]: r["loss"] for r in records if r["kind"] == "train"}


@pytest.fixture(scope="module")
def crashed(tmp_path_factory):
  """5 steps: persistent checkpoints 3 and 5, local 2 and 4 on both hosts; then the
  persistent 5 is removed, as if the job had died after step 5 before saving it."""
  root = tmp_path_factory.mktemp("crashed")
  workdir, local = root / "run", root / "shm"
  _pod(workdir, local, steps=5)
  for process in (0, 1):
    assert sorted(os.listdir(local / f"process_{process}" / "checkpoints")) == ["2", "4"]
    assert sorted(os.listdir(local / f"process_{process}" / "checkpoints" / "4")) == [
        "own.bin", "own.json", "peer.bin", "peer.json"]
  shutil.rmtree(workdir / "checkpoints" / "5")
  return workdir, local, _losses(workdir)


def _restart(crashed, tmp_path, damage) -> tuple[str, dict[int, float]]:
  workdir, local, _ = crashed
  shutil.copytree(workdir, tmp_path / "run")
  shutil.copytree(local, tmp_path / "shm")
  for process in (0, 1):  # the folders now belong to the copied workdir
    (tmp_path / "shm" / f"process_{process}" / "run.json").write_text(
        json.dumps({"workdir": str(tmp_path / "run")}))
  damage(tmp_path / "shm")
  out = _pod(tmp_path / "run", tmp_path / "shm", steps=6)
  return out, _losses(tmp_path / "run")


def test_a_host_that_comes_back_empty_restores_from_its_peers_copy(crashed, tmp_path):
  out, losses = _restart(crashed, tmp_path, lambda shm: shutil.rmtree(shm / "process_1"))
  assert (f"[p0] restored step 4 from {tmp_path / 'shm' / 'process_0' / 'checkpoints'} "
          f"(process 1's shards from the copy on process 0's host)") in out.splitlines(), out
  assert losses[5] == crashed[2][5]  # bitwise: the same state and batch as before the crash
  assert sorted(losses) == [1, 2, 3, 4, 5, 6]


def test_a_damaged_copy_is_replaced_by_the_peers(crashed, tmp_path):
  def flip(shm):
    with open(shm / "process_0" / "checkpoints" / "4" / "own.bin", "r+b") as f:
      f.seek(100)
      byte = f.read(1)
      f.seek(100)
      f.write(bytes([byte[0] ^ 1]))
  out, losses = _restart(crashed, tmp_path, flip)
  assert "(process 0's shards from the copy on process 1's host)" in out, out
  assert losses[5] == crashed[2][5]


def test_a_host_lost_with_its_peers_copy_falls_back_to_the_persistent_tier(crashed, tmp_path):
  def lose(shm):
    shutil.rmtree(shm / "process_1")
    for name in ("peer.json", "peer.bin"):
      os.remove(shm / "process_0" / "checkpoints" / "4" / name)
  out, losses = _restart(crashed, tmp_path, lose)
  lines = out.splitlines()
  damaged = tmp_path / "shm" / "process_0" / "damaged_checkpoints"
  assert (f"[p0] warning: local checkpoint step 4 cannot be used (the shards of process 1 are "
          f"on no host (neither its own folder nor process 0's holds them)); moved it to "
          f"{damaged}") in lines, out
  assert f"[p0] restored step 3 from {tmp_path / 'run' / 'checkpoints'}" in lines, out
  assert [losses[s] for s in (4, 5)] == [crashed[2][s] for s in (4, 5)]


def test_another_runs_folder_stops_every_process_with_one_line(crashed, tmp_path):
  _, local, _ = crashed
  out = _pod(tmp_path / "other", local, steps=6, status=1)
  line = (f"error: train.local_checkpoint_dir='{local}' holds the local checkpoints of another "
          f"run (workdir {crashed[0]}); give this run its own folder, or remove that one")
  assert f"[p0] {line}" in out.splitlines() and f"[p1] {line}" in out.splitlines(), out
  assert "Traceback" not in out and "Fatal" not in out, out

