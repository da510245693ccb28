"""What an export says of its model beside the weights: its context
(toolkit.conversion.exporter.context_length: the export's max_position_embeddings, and so
toolkit.evaluate's default --max_length, as the harness's `hf` backend reads it), and the ids
generation starts and ends with (generation_config.json)."""
from __future__ import annotations

import dataclasses
import json

from experiments import lm
from toolkit.conversion import exporter
from toolkit.training import config as config_lib


def test_a_model_trained_here_has_the_context_it_trained_at():
  config = lm.get_config("tiny")
  model = config_lib.model_config(config.model)
  assert exporter.context_length(model, config) == config.data.seq_len


def test_an_imported_model_keeps_its_folders_context(tmp_path):
  (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 4096}))
  config = lm.get_config("tiny")
  config.train.init_from = f"hf:{tmp_path}"
  model = config_lib.model_config(config.model)
  assert exporter.context_length(model, config) == 4096
  assert exporter.context_length(model, config, source="") == config.data.seq_len


def test_llama_3_scaled_rope_gives_its_scaled_context():
  config = lm.get_config("tiny")
  model = dataclasses.replace(config_lib.model_config(config.model), rope_type="llama3",
                              rope_original_max_positions=64, rope_factor=8.0)
  assert exporter.context_length(model, config) == 512


def test_a_chat_fine_tune_ends_generation_at_its_templates_end_of_turn():
  """Issue 62: exports carried no generation_config.json, so transformers' generate of a chat
  fine-tune ran past the end of its answer."""
  from experiments import sft  # pylint: disable=g-import-not-at-top
  plain = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": None}
  assert exporter.generation_config(plain, lm.get_config("tiny")) == {
      "_from_model_config": True, "bos_token_id": 1, "eos_token_id": 2}
  chat = exporter.generation_config(plain, sft.get_config("cpu"))
  assert chat["eos_token_id"] == [2, ord("\n")]  # the byte template ends a turn with "\n"
  byte_level = exporter.generation_config({}, sft.get_config("cpu"))
  assert byte_level == {"_from_model_config": True, "eos_token_id": ord("\n")}

