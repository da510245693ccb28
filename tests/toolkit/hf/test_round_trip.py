"""Import and export through the workdir, as `python -m toolkit.convert` does them: the exported
folder loads in transformers and computes meshkit's logits; importing it again gives the same
parameters bit for bit; an 8-device fsdp_tp import gives every device exactly its slice; a
sharded export (several safetensors files and the index) reads back the same."""
import json

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file

from tests.toolkit.hf import reference
from tests.toolkit.hf.reference import ROUND_TRIP
from toolkit import conversion, hf
from toolkit.training import config as config_lib

NAME = "gqa_untied_head_dim24_llama3"


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
  """(original folder, workdir, exported folder, params as imported) of one tiny model, moved
  HF -> workdir (fsdp_tp on 8 devices) -> HF."""
  root = tmp_path_factory.mktemp("round_trip")
  reference.write_folder(root / "original", NAME)
  config = config_lib.defaults()
  config.mesh.ici, config.sharding.preset = "fsdp:4,tensor:2", "fsdp_tp"
  conversion.import_checkpoint(str(root / "original"), str(root / "workdir"), config)
  conversion.export_checkpoint(str(root / "workdir"), str(root / "exported"))
  params, _, _ = reference.import_params(root / "original")
  return root / "original", root / "workdir", root / "exported", params


def test_transformers_loads_the_export_and_computes_meshkit_logits(exported):
  original, _, out, params = exported
  model = reference.transformers.AutoModelForCausalLM.from_pretrained(str(out)).eval()
  _, cfg, graphdef = reference.import_params(original)
  tokens = reference.prompt(cfg.vocab_size, seed=1)
  difference = np.abs(reference.hf_logits(model, tokens)
                      - reference.meshkit_logits(graphdef, params, tokens)).max()
  print(f"transformers on the export vs meshkit: max |logit difference| {difference:.2e}")
  assert difference <= ROUND_TRIP
  assert model.config.rope_parameters["rope_type"] == "llama3"
  assert model.config.head_dim == 24 and not model.config.tie_word_embeddings


def test_export_writes_the_original_tensors_config_and_tokenizer(exported):
  original, _, out, _ = exported
  before, after = load_file(str(original / "model.safetensors")), load_file(
      str(out / "model.safetensors"))
  assert sorted(before) == sorted(after)
  for name in before:  # float32 in, float32 out: not a bit changes
    np.testing.assert_array_equal(after[name], before[name], err_msg=name)
  config = json.loads((out / "config.json").read_text())
  source = json.loads((original / "config.json").read_text())
  for key in ("bos_token_id", "eos_token_id", "max_position_embeddings", "vocab_size",
              "num_key_value_heads", "head_dim", "rms_norm_eps"):
    assert config[key] == source[key], key
  assert config["rope_scaling"] == {k: v for k, v in source["rope_parameters"].items()
                                    if k != "rope_theta"}
  assert (out / "tokenizer.json").read_bytes() == (original / "tokenizer.json").read_bytes()


def test_import_of_the_export_is_bitwise_the_same(exported):
  _, _, out, params = exported
  again, _, _ = reference.import_params(out)
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
               again, params)


def test_every_device_holds_exactly_its_slice(exported):
  original, _, _, params = exported
  folder = hf.HFFolder(str(original))
  cfg = folder.model_config(reference.LlamaConfig())
  tensors = load_file(str(original / "model.safetensors"))
  for entry in folder.check(cfg):
    if entry.stacked:
      full = np.stack([entry.to_meshkit(tensors[entry.hf_name(i)]) for i in range(cfg.n_layers)])
    else:
      full = entry.to_meshkit(tensors[entry.name])
    array = params
    for part in entry.path.split("/"):
      array = array[part]
    assert array.shape == full.shape and len(array.addressable_shards) == 8
    for shard in array.addressable_shards:
      np.testing.assert_array_equal(np.asarray(shard.data), full[shard.index],
                                    err_msg=f"{entry.path} on {shard.device}")


def test_sharded_export_loads_and_reads_back(exported, tmp_path):
  _, workdir, _, params = exported
  out = tmp_path / "sharded"
  written = conversion.export_checkpoint(str(workdir), str(out), max_shard_bytes=150_000)
  shards = sorted(name for name in written if name.endswith(".safetensors"))
  assert len(shards) >= 3 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
  index = json.loads((out / "model.safetensors.index.json").read_text())
  assert set(index["weight_map"].values()) == set(shards)
  assert all((out / s).stat().st_size <= 150_000 + 4096 for s in shards)  # header slack
  model = reference.transformers.AutoModelForCausalLM.from_pretrained(str(out))
  assert model.num_parameters() == sum(a.size for a in jax.tree.leaves(params))
  again, _, _ = reference.import_params(out)
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
               again, params)


def test_bfloat16_checkpoints_upcast_exactly_and_export_as_bfloat16(tmp_path):
  """Published checkpoints are often bfloat16: read into float32 parameters without a rounding,
  and a model kept in bfloat16 (model.param_dtype) exports the same bits."""
  model = reference.write_folder(tmp_path / "hf", NAME).to(reference.torch.bfloat16)
  model.save_pretrained(str(tmp_path / "hf"))
  original = load_file(str(tmp_path / "hf" / "model.safetensors"))
  assert original["lm_head.weight"].dtype.name == "bfloat16"
  params, _, _ = reference.import_params(tmp_path / "hf")
  np.testing.assert_array_equal(np.asarray(params["unembed"]),
                                original["lm_head.weight"].astype(np.float32).T)
  config = config_lib.defaults()
  config.model.param_dtype = "bfloat16"
  conversion.import_checkpoint(str(tmp_path / "hf"), str(tmp_path / "workdir"), config)
  conversion.export_checkpoint(str(tmp_path / "workdir"), str(tmp_path / "exported"))
  exported = load_file(str(tmp_path / "exported" / "model.safetensors"))
  assert sorted(exported) == sorted(original)
  for name in original:
    assert exported[name].dtype == original[name].dtype
    np.testing.assert_array_equal(exported[name].view(np.uint16),
                                  original[name].view(np.uint16), err_msg=name)
  assert json.loads((tmp_path / "exported" / "config.json").read_text())["torch_dtype"] == (
      "bfloat16")
