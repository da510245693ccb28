"""What a Hugging Face folder may hold, checked before a tensor is read: each refusal is one
ConfigError naming the file or field and the fix (the command-line side of the same checks is
tests/toolkit/test_convert.py)."""
import json
import shutil

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from models import LlamaConfig
from tests.toolkit.hf import reference
from toolkit import hf
from toolkit.errors import ConfigError
from toolkit.hf import llama
from toolkit.training import config as config_lib, init_from


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
  path = tmp_path_factory.mktemp("hf") / "tiny"
  reference.write_folder(path, "gqa_untied_head_dim24_llama3")
  return path


@pytest.fixture
def copy(tiny, tmp_path):
  shutil.copytree(tiny, tmp_path / "hf")
  return tmp_path / "hf"


def _config(path) -> dict:
  return json.loads((path / "config.json").read_text())


def _write_config(path, config: dict) -> None:
  (path / "config.json").write_text(json.dumps(config))


def _check(path):
  folder = hf.HFFolder(str(path))
  return folder.check(folder.model_config(LlamaConfig()))


def test_the_hub_spelling_of_rope_is_read_too():
  """transformers 4 and the Hub's files: rope_theta on top, rope_scaling with "rope_type" or
  the older "type"."""
  hub = {"hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2,
         "intermediate_size": 128, "vocab_size": 300, "rope_theta": 500000.0,
         "rope_scaling": {"type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                          "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}
  cfg = llama.model_config(hub, LlamaConfig())
  assert (cfg.rope_theta, cfg.rope_type, cfg.rope_factor, cfg.rope_original_max_positions) == (
      500000.0, "llama3", 32.0, 8192)
  assert cfg.n_kv_heads == 4 and cfg.head_dim == 0 and not cfg.tie_embeddings
  linear = {**hub, "rope_scaling": {"type": "linear", "factor": 2.0}}
  with pytest.raises(ConfigError, match="rope_type='linear' is not supported"):
    llama.model_config(linear, LlamaConfig())
  # What meshkit writes reads back as the same model.
  assert llama.model_config(llama.hf_config(cfg), LlamaConfig()) == cfg


@pytest.mark.parametrize("change, message", [
    ({"mlp_bias": True}, "mlp_bias=true; meshkit's Llama has no biases"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu'; meshkit's Llama MLP is SwiGLU"),
    ({"num_attention_heads": 0}, "num_attention_heads=0"),
    ({"num_key_value_heads": 3}, "not a multiple of model.n_kv_heads=3"),
    ({"architectures": ["LlamaForCausalLM", "X"]}, "expected one of LlamaForCausalLM"),
    ({"model_type": "mistral"}, "model_type='mistral' is not 'llama'"),
    ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0}},
     "needs a number for low_freq_factor"),
])
def test_config_refusals_name_the_field(copy, change, message):
  _write_config(copy, {**_config(copy), **change})
  with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace("[", r"\[")):
    _check(copy)


def test_an_unknown_tensor_is_refused_and_old_rope_caches_are_skipped(copy):
  tensors = load_file(str(copy / "model.safetensors"))
  tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = np.ones(12, np.float32)
  save_file(tensors, str(copy / "model.safetensors"))
  assert len(_check(copy)) == 12  # skipped
  tensors["model.layers.0.self_attn.q_proj.bias"] = np.ones(96, np.float32)
  save_file(tensors, str(copy / "model.safetensors"))
  with pytest.raises(ConfigError, match="tensor model.layers.0.self_attn.q_proj.bias has no "
                                        "place in meshkit's LlamaForCausalLM"):
    _check(copy)


def test_tied_embeddings_must_really_be_tied(copy):
  config = {**_config(copy), "tie_word_embeddings": True}
  _write_config(copy, config)
  with pytest.raises(ConfigError, match="lm_head.weight differs from model.embed_tokens.weight; "
                                        "set tie_word_embeddings=false"):
    _check(copy)
  tensors = load_file(str(copy / "model.safetensors"))
  tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"]  # equal: fine, read once
  save_file(tensors, str(copy / "model.safetensors"))
  assert [e.path for e in _check(copy)].count("unembed") == 0
  del tensors["lm_head.weight"]
  save_file(tensors, str(copy / "model.safetensors"))
  _write_config(copy, {**config, "tie_word_embeddings": False})
  with pytest.raises(ConfigError, match="tie_word_embeddings=false but the weights hold no "
                                        "lm_head.weight"):
    _check(copy)


def test_index_and_files_must_agree(copy):
  (copy / "model.safetensors.index.json").write_text(json.dumps(
      {"weight_map": {"model.norm.weight": "model-00002-of-00002.safetensors"}}))
  with pytest.raises(ConfigError, match="model-00002-of-00002.safetensors is missing"):
    _check(copy)
  (copy / "model.safetensors.index.json").unlink()
  (copy / "model.safetensors").rename(copy / "pytorch_model.bin")
  with pytest.raises(ConfigError, match="holds neither model.safetensors nor "
                                        "model.safetensors.index.json"):
    _check(copy)


def test_init_from_must_match_the_config(tiny):
  with pytest.raises(ConfigError, match="train.init_from='runs/x': give hf:DIR"):
    init_from.parse("runs/x")
  config = config_lib.defaults()
  config.train.init_from = f"hf:{tiny}"
  model = config_lib.resolve(config).model  # the defaults' cpu model, not the folder's
  with pytest.raises(ConfigError, match=r"its config.json gives model.vocab_size=258, the "
                                        r"config has 256; .*experiments/hf.py:"):
    init_from.source(config, model, str(tiny / "no_workdir"))
  config = init_from.with_hf_model(config_lib.defaults(), str(tiny))
  assert init_from.source(config, config_lib.resolve(config).model, "") is not None
