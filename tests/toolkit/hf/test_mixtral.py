"""Hugging Face `MixtralForCausalLM`: a tiny random Mixtral (built locally by transformers, no
download) imported onto 8 devices with its experts split over `expert` gives transformers'
logits at every position of a 256-token prompt; exported again through the workdir it loads
in transformers with meshkit's logits and the original tensors, bit for bit."""
import dataclasses
import json

import numpy as np
import optax
import pytest
from safetensors.numpy import load_file

import sharding
from models import LlamaConfig
from tests.toolkit.hf import reference
from tests.toolkit.hf.reference import HF_PARITY, ROUND_TRIP
from toolkit import conversion, hf
from toolkit.errors import ConfigError
from toolkit.training import config as config_lib
from toolkit.training import state as state_lib

# 4 experts of width 96, 2 per token, grouped-query attention, no RoPE scaling, untied.
MIXTRAL = dict(reference.tiny_hf_model.TINY, intermediate_size=96, num_local_experts=4,
               num_experts_per_tok=2, rope_scaling=None, tie_word_embeddings=False,
               router_aux_loss_coef=0.02)
ICI, PRESET = "fsdp:2,expert:2,tensor:2", "fsdp_tp_ep"


def write_mixtral(path, seed: int = 0):
  """A random MixtralForCausalLM saved at `path` (every weight random, as for the Llama
  folders); returns the model in eval mode."""
  torch, transformers = reference.torch, reference.transformers
  torch.manual_seed(seed)
  model = transformers.MixtralForCausalLM(transformers.MixtralConfig(**MIXTRAL))
  reference.tiny_hf_model.randomize(model, seed)
  model.eval()
  model.save_pretrained(str(path))
  return model


def import_params(path):
  """(params with the experts split 2 ways, model config, graphdef) from the folder."""
  folder = hf.HFFolder(str(path))
  cfg = folder.model_config(LlamaConfig())
  mesh = sharding.make_mesh(sharding.parse_axis_sizes(ICI), [])
  layout = state_lib.layout(cfg, optax.identity(), sharding.Rules.preset(PRESET), mesh)
  params = hf.read_params(folder, cfg, layout.shardings["params"], progress=lambda _: None)
  return params, cfg, layout.graphdef


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
  """(folder, transformers model, params, config, graphdef) of one tiny Mixtral."""
  path = tmp_path_factory.mktemp("mixtral") / "original"
  model = write_mixtral(path)
  return (path, model, *import_params(path))


def test_config_is_read_as_written(mixtral):
  _, model, params, cfg, _ = mixtral
  assert (cfg.n_experts, cfg.experts_per_token, cfg.moe_every, cfg.mlp_dim) == (4, 2, 1, 96)
  # transformers' aux loss sums over the k choices: k times meshkit's load_balance_loss.
  assert cfg.load_balance_weight == pytest.approx(0.02 * 2)
  assert params["layers"]["mlp"]["w_gate"].shape == (2, 4, 64, 96)    # layers, experts, ...
  assert "'expert'" in str(params["layers"]["mlp"]["w_gate"].sharding.spec)


def test_logits_match_transformers_at_every_position(mixtral):
  _, model, params, cfg, graphdef = mixtral
  tokens = reference.prompt(cfg.vocab_size)
  expected = reference.hf_logits(model, tokens)
  difference = np.abs(reference.meshkit_logits(graphdef, params, tokens) - expected).max()
  print(f"mixtral: max |logit difference| {difference:.2e} over {tokens.shape[1]} positions "
        f"(logits up to {np.abs(expected).max():.1f})")
  assert difference <= HF_PARITY


def test_swapped_experts_are_caught(mixtral):
  """The negative control: experts 0 and 1 exchanged in every layer change the logits."""
  _, model, params, cfg, graphdef = mixtral
  mlp = dict(params["layers"]["mlp"])
  for name in ("w_gate", "w_up", "w_down"):
    mlp[name] = mlp[name][:, np.array([1, 0, 2, 3])]
  swapped = {**params, "layers": {**params["layers"], "mlp": mlp}}
  tokens = reference.prompt(cfg.vocab_size)
  difference = np.abs(reference.meshkit_logits(graphdef, swapped, tokens)
                      - reference.hf_logits(model, tokens)).max()
  assert difference > 1e-2


def test_export_through_the_workdir_loads_in_transformers(mixtral, tmp_path):
  original, _, params, cfg, graphdef = mixtral
  config = config_lib.defaults()
  config.mesh.ici, config.sharding.preset = ICI, PRESET
  conversion.import_checkpoint(str(original), str(tmp_path / "workdir"), config)
  conversion.export_checkpoint(str(tmp_path / "workdir"), str(tmp_path / "exported"))
  out = tmp_path / "exported"
  before, after = (load_file(str(original / "model.safetensors")),
                   load_file(str(out / "model.safetensors")))
  assert sorted(before) == sorted(after)
  for name in before:
    np.testing.assert_array_equal(after[name], before[name], err_msg=name)
  written = json.loads((out / "config.json").read_text())
  assert written["architectures"] == ["MixtralForCausalLM"]
  assert written["router_aux_loss_coef"] == pytest.approx(0.02)
  model = reference.transformers.AutoModelForCausalLM.from_pretrained(str(out)).eval()
  tokens = reference.prompt(cfg.vocab_size, seed=1)
  difference = np.abs(reference.hf_logits(model, tokens)
                      - reference.meshkit_logits(graphdef, params, tokens)).max()
  print(f"transformers on the Mixtral export vs meshkit: max |logit difference| "
        f"{difference:.2e}")
  assert difference <= ROUND_TRIP


def test_architecture_follows_the_model_and_mismatches_are_one_line():
  moe, dense = LlamaConfig.preset("moe_tiny"), LlamaConfig.preset("tiny")
  assert hf.for_model(moe).name == "MixtralForCausalLM"
  assert hf.for_model(dense).name == "LlamaForCausalLM"
  with pytest.raises(ConfigError, match="moe_every=2.*only a model with moe_every=1"):
    hf.for_model(moe).hf_config(dataclasses.replace(moe, moe_every=2))
  mixtral = hf.ARCHITECTURES["MixtralForCausalLM"]
  hub = {**MIXTRAL, "architectures": ["MixtralForCausalLM"], "model_type": "mixtral"}
  with pytest.raises(ConfigError, match="sliding_window=4096"):
    mixtral.model_config({**hub, "sliding_window": 4096}, LlamaConfig())
  with pytest.raises(ConfigError, match="num_local_experts=None"):
    mixtral.model_config({k: v for k, v in hub.items() if k != "num_local_experts"},
                         LlamaConfig())
