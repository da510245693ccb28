"""The model's context (toolkit.conversion.exporter.context_length): what its export's
max_position_embeddings says, and so toolkit.evaluate's default --max_length, as the harness's
`hf` backend reads it from the exported folder."""
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
