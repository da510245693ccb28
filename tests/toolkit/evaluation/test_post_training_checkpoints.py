"""Every checkpoint a run produces evaluates and generates as it was trained: DPO's and GRPO's
models are the language model (they were refused as "model.kind=None, not a language model"),
with the tokenizer their data used (bytes where the config names none)."""
from __future__ import annotations

import os

import pytest

from tests import extras
from toolkit import training
from toolkit.evaluation import harness, offline as evaluation
from toolkit.inference import offline as generation
from toolkit.inference.sampling import SamplingParams
from toolkit.post_training import grpo_task as grpo_lib

CHOICE = os.path.join(os.path.dirname(__file__), "..", "..", "..", "experiments", "eval_tasks",
                      "arithmetic_choice.yaml")


def _trained(name: str, workdir: str):
  from experiments import dpo, grpo  # pylint: disable=g-import-not-at-top
  config = {"dpo": dpo, "grpo": grpo}[name].get_config("tiny")
  config.mesh.ici = "fsdp:4,tensor:2"  # the suite's 8 devices
  config.train.update(steps=2, log_every=1, eval_every=2, checkpoint_every=2)
  (grpo_lib.run if name == "grpo" else training.run)(config, workdir)
  return config


@pytest.mark.slow  # two tiny post-training runs, an evaluation and a generation each: 102 s busy
@pytest.mark.parametrize("name", ["dpo", "grpo"])
def test_a_post_training_checkpoint_evaluates_and_generates(name, tmp_path, monkeypatch):
  extras.require("lm_eval")
  monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
  monkeypatch.setenv("HF_HUB_OFFLINE", "1")
  config = _trained(name, str(tmp_path))
  results = evaluation.run(config, str(tmp_path), CHOICE, limit=2, bootstrap_iters=0,
                           batch_size=8)
  scores = harness.scalars(results)
  assert set(scores) == {"meshkit_arithmetic_choice/acc", "meshkit_arithmetic_choice/acc_norm"}
  written = generation.run(config, str(tmp_path), prompt="The ", batch_size=8,
                           cache_length=32, defaults=SamplingParams(max_tokens=4))
  assert len(written) == 1 and len(written[0]["tokens"]) == 4, written


@pytest.mark.parametrize("experiment", ["sft", "dpo", "grpo"])
def test_a_fine_tune_of_a_byte_level_base_reads_its_text_as_bytes(experiment, tmp_path):
  """Issue 62: an SFT config with base= (a Hugging Face folder without a tokenizer, as the
  demo's export is) was refused by toolkit.evaluate with a message that contradicted itself
  ("data.source='chat' (token ids, no tokenizer)"): its data was tokenized as bytes, the
  documented fallback, and so is its evaluation."""
  import importlib  # pylint: disable=g-import-not-at-top
  from tests.toolkit.hf import reference  # pylint: disable=g-import-not-at-top
  from toolkit.evaluation import tokens  # pylint: disable=g-import-not-at-top
  folder = tmp_path / "base"
  reference.write_folder(folder)
  for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
    (folder / name).unlink(missing_ok=True)
  config = importlib.import_module(f"experiments.{experiment}").get_config(f"cpu,base={folder}")
  assert tokens.trained_with(config) == "bytes"
  assert tokens.codec_for(config).byte_level
