"""LoRA on a Hugging Face base and back out: a tiny random HF Llama fine-tuned with adapters
(`train.init_from=hf:DIR`, model.lora_rank), its base read bitwise and left so, the checkpoint
naming that base; `--peft` writes adapters that `peft.PeftModel.from_pretrained` loads on top
of the folder with meshkit's logits, `--merge_lora` a model transformers loads with them; and
the mistakes, one error each."""
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from experiments import hf as hf_experiment
from tests import extras, preloaded
from tests.toolkit.hf import reference
from tests.toolkit.test_cli import _env, the_error_line
from toolkit import conversion, hf, training
from toolkit.errors import ConfigError
from toolkit.inference.restore import restore_params
from toolkit.training import state as state_lib
from toolkit.training.checkpoints import checkpoint

peft = extras.require("peft")
torch = reference.torch
STEPS = 8
# ~20 s on a quiet machine, most of it the fine-tune's compile: the slow half (docs/testing.md).
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tuned(tmp_path_factory):
  """(root, config, the original transformers model): LoRA adapters of rank 4 on every
  projection of reference.write_folder's model, trained STEPS steps on 8 devices."""
  root = tmp_path_factory.mktemp("lora")
  original = reference.write_folder(root / "hf")
  config = hf_experiment.get_config(str(root / "hf"))
  config.mesh.ici, config.sharding.preset = "fsdp:4,tensor:2", "fsdp_tp"
  config.data.update(seq_len=64, global_batch_size=16, eval_batches=1)
  config.train.update(steps=STEPS, eval_every=STEPS, checkpoint_every=STEPS, log_every=STEPS,
                      sample_tokens=0)
  config.model.update(lora_rank=4, lora_alpha=8.0, lora_dropout=0.1)
  config.optimizer.update(learning_rate=1e-2, warmup_steps=2)
  training.run(config, str(root / "tuned"))
  return root, config, original


def _meshkit_logits(config, workdir, tokens) -> np.ndarray:
  params, model_cfg, *_ = restore_params(config, str(workdir))
  graphdef = state_lib.param_entries(model_cfg)[0]
  return np.asarray(jax.jit(lambda p, t: nnx.merge(graphdef, p)(t))(params, jnp.asarray(tokens)))


def test_the_base_is_read_bitwise_kept_and_named(tuned):
  root, config, _ = tuned
  params, model_cfg, *_ = restore_params(config, str(root / "tuned"))
  layout = training.build(config).layout
  read = hf.read_params(hf.HFFolder(str(root / "hf")), model_cfg, layout.shardings["params"],
                        progress=lambda _: None)
  trainable, frozen = state_lib.split_trainable(params)
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
               frozen, read)
  assert all(np.any(np.asarray(b)) for b in jax.tree.leaves(trainable))  # trained
  manager = checkpoint.Checkpoints(str(root / "tuned" / "checkpoints"), read_only=True)
  base = manager.base(STEPS)
  manager.close()
  assert base["init_from"] == config.train.init_from == f"hf:{root / 'hf'}"
  assert base["fingerprint"] == checkpoint.base_fingerprint(read)


def test_peft_export_loads_in_peft_with_meshkits_logits(tuned):
  root, config, original = tuned
  out = root / "peft"
  written = conversion.export_checkpoint(str(root / "tuned"), str(out), lora="peft")
  assert sorted(written) == ["adapter_config.json", "adapter_model.safetensors"]
  adapter_config = json.loads((out / "adapter_config.json").read_text())
  # Relative to the current directory: no absolute path of this machine in a shared folder.
  assert adapter_config["base_model_name_or_path"] == os.path.relpath(root / "hf")
  assert not os.path.isabs(adapter_config["base_model_name_or_path"])
  assert (adapter_config["r"], adapter_config["lora_alpha"]) == (4, 8)
  tokens = reference.prompt(original.config.vocab_size, 64)
  base_logits = reference.hf_logits(original, tokens)
  model = peft.PeftModel.from_pretrained(
      reference.transformers.AutoModelForCausalLM.from_pretrained(str(root / "hf")),
      str(out)).eval()
  expected = _meshkit_logits(config, root / "tuned", tokens)
  difference = np.max(np.abs(reference.hf_logits(model, tokens) - expected))
  print(f"peft vs meshkit: max |logit difference| {difference:.2e}")
  assert difference <= reference.HF_PARITY
  assert np.max(np.abs(base_logits - expected)) > 100 * reference.HF_PARITY  # adapters matter


def test_merged_export_loads_in_transformers_with_meshkits_logits(tuned):
  root, config, original = tuned
  conversion.export_checkpoint(str(root / "tuned"), str(root / "merged"), lora="merge")
  model = reference.transformers.AutoModelForCausalLM.from_pretrained(
      str(root / "merged")).eval()
  tokens = reference.prompt(original.config.vocab_size, 64, seed=1)
  difference = np.max(np.abs(reference.hf_logits(model, tokens)
                             - _meshkit_logits(config, root / "tuned", tokens)))
  print(f"merged export vs meshkit: max |logit difference| {difference:.2e}")
  assert difference <= reference.HF_PARITY


def test_export_mistakes(tuned, tmp_path):
  root, config, _ = tuned
  with pytest.raises(ConfigError, match=r"holds LoRA adapters \(model.lora_rank=4\); give "
                                        r"--merge_lora .* or --peft"):
    conversion.export_checkpoint(str(root / "tuned"), str(tmp_path / "plain"))
  imported = tmp_path / "imported"
  conversion.import_checkpoint(str(root / "hf"), str(imported))
  with pytest.raises(ConfigError, match=r"--peft: .* holds no LoRA adapters"):
    conversion.export_checkpoint(str(imported), str(tmp_path / "out"), lora="peft")
  assert not os.path.exists(tmp_path / "plain") and not os.path.exists(tmp_path / "out")
  both = preloaded.run("toolkit.convert", ["export", f"--workdir={root / 'tuned'}",
                                           f"--out={tmp_path / 'x'}", "--merge_lora", "--peft"],
                       env=_env(), timeout=60)
  assert "--merge_lora and --peft each choose" in the_error_line(both)
  assert both.returncode == 2
