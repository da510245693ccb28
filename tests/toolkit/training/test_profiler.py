"""train.profile_steps: a jax.profiler trace of the window's steps, which Perfetto and
TensorBoard's profile plugin open, holding the train step's XLA ops; bad windows refused."""
import collections
import gzip
import json
import re

import pytest

from experiments import lm
from toolkit import training
from toolkit.errors import ConfigError
from toolkit.training import profiler


def test_the_trace_holds_the_steps_xla_ops(tmp_path):
  config = lm.get_config("tiny")
  config.train.steps = 3
  config.train.profile_steps = "2:3"
  training.run(config, str(tmp_path))
  runs = list((tmp_path / "profile" / "plugins" / "profile").iterdir())
  assert len(runs) == 1, runs
  assert list(runs[0].glob("*.xplane.pb"))  # TensorBoard's profile plugin / XProf
  with gzip.open(runs[0] / "perfetto_trace.json.gz") as f:  # ui.perfetto.dev
    events = json.load(f)["traceEvents"]
  ops = collections.Counter(re.sub(r"\.\d+$", "", e["name"]) for e in events
                            if e.get("ph") == "X" and re.search(r"\.\d+$", e["name"]))
  # The fsdp x tensor step gathers its parameters and reduces its gradients: XLA's own
  # instruction names (kind.N) in the trace, which only the compiled step's execution makes.
  assert ops["all-gather"] > 0 and ops["all-reduce"] > 0, ops.most_common(20)
  assert any("fusion" in name for name in ops), ops.most_common(20)


@pytest.mark.parametrize("text,fragment", [
    ("10", "is not START:STOP"), ("a:b", "is not START:STOP"), ("0:2", "1 <= START < STOP"),
    ("3:3", "1 <= START < STOP"), ("5:12", "train.steps + 1 = 11")])
def test_bad_windows_name_the_field_and_the_fix(text, fragment):
  with pytest.raises(ConfigError, match="train.profile_steps") as error:
    profiler.parse_profile_steps(text, total_steps=10)
  assert fragment in str(error.value) and "--config.train.profile_steps=" in str(error.value)


def test_no_window_and_a_full_window():
  assert profiler.parse_profile_steps("", 10) is None
  assert profiler.parse_profile_steps("1:11", 10) == (1, 11)
