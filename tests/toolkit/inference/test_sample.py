"""Sampling text from a trained checkpoint."""
import pytest

from tests.tiny_runs import tiny_config
from toolkit import training
from toolkit.inference import text as text_lib
from toolkit.errors import ConfigError


@pytest.mark.slow  # 20 s; the default suite stays near its budget (docs/testing.md)
def test_sample_from_checkpoint_is_reproducible(tmp_path):
  config = tiny_config(steps=4)
  config.train.sample_tokens = 8
  result = training.run(config, str(tmp_path), sampler=text_lib.sample_after_training)
  assert result.sample is not None and result.sample.startswith("The ")
  greedy = text_lib.sample_from_checkpoint(str(tmp_path), "The ", 12, temperature=0.0, seed=0)
  assert greedy.startswith("The ") and len(greedy.encode("utf-8", "replace")) >= 12
  assert greedy == text_lib.sample_from_checkpoint(str(tmp_path), "The ", 12, 0.0, seed=5)
  a = text_lib.sample_from_checkpoint(str(tmp_path), "The ", 12, temperature=1.0, seed=1)
  assert a == text_lib.sample_from_checkpoint(str(tmp_path), "The ", 12, temperature=1.0, seed=1)


def test_sample_without_checkpoint_is_a_clear_error(tmp_path):
  with pytest.raises(ConfigError, match="holds no checkpoint; train first"):
    text_lib.sample_from_checkpoint(str(tmp_path), "The ", 4, 0.0, 0)
  with pytest.raises(ConfigError, match="does not exist"):
    text_lib.sample_from_checkpoint(str(tmp_path / "missing"), "The ", 4, 0.0, 0)
