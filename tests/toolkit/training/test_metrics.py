"""The metric writer's TensorBoard output without torch: tensorboardX's package imports torch
whenever it is installed (1.4 s of a restart's time to its first step), so the writer loads
tensorboardX with torch hidden. Likewise the training command imports Grain only for the data
that reads through it. Checked in a fresh process: this one may have imported both."""
from __future__ import annotations

import subprocess
import sys

from tests.toolkit.test_cli import REPO, _env

_WRITE_AND_READ_BACK = """
import importlib.util, pathlib, struct, sys
import toolkit.train
assert "grain" not in sys.modules, "the training command imported Grain"
from toolkit.training import metrics
workdir = pathlib.Path(sys.argv[1])
writer = metrics.MetricWriter(str(workdir))
writer.write(7, "train", {"loss": 2.5})
writer.close()
assert "torch" not in sys.modules, "the metric writer imported torch"
from tensorboardX.proto import event_pb2
[events] = (workdir / "tensorboard").glob("events.out.tfevents.*")
data, scalars = events.read_bytes(), []
while data:  # TFRecord: length (8 bytes), its CRC (4), the record, its CRC (4)
  (length,) = struct.unpack("<Q", data[:8])
  event = event_pb2.Event.FromString(data[12:12 + length])
  scalars += [(event.step, v.tag, v.simple_value) for v in event.summary.value]
  data = data[16 + length:]
print(scalars)
if importlib.util.find_spec("torch") is not None:
  import torch  # still importable after the writer hid it
  print("torch importable")
"""


def test_training_imports_and_tensorboard_scalars_without_torch_or_grain(tmp_path):
  result = subprocess.run([sys.executable, "-c", _WRITE_AND_READ_BACK, str(tmp_path)], cwd=REPO,
                          env=_env(), capture_output=True, text=True, timeout=120, check=False)
  assert result.returncode == 0, result.stdout + result.stderr
  assert result.stdout.splitlines()[0] == "[(7, 'train/loss', 2.5)]", result.stdout
