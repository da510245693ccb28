"""Fine-tuning a Hugging Face model end to end: a tiny random HF Llama trained 20 steps on
CPython's docs with `train.init_from=hf:DIR`, exported, reloaded in transformers. The exported
weights have moved, and transformers' loss on the held-out batches equals meshkit's eval loss;
before training it equals meshkit's step-0 eval (the weights were read right). A workdir
written by the import holds exactly the state init_from starts from."""
import jax
import numpy as np
import pytest
from safetensors.numpy import load_file

from experiments import hf as hf_experiment
from tests.toolkit.hf import reference
from toolkit import conversion, hf, training
from toolkit.training import init_from
from toolkit.training.checkpoints import checkpoint, resume

torch = reference.torch
LOSS_TOLERANCE = 1e-4  # transformers' held-out loss vs meshkit's eval loss, nats (issue 12)
STEPS = 20


def _config(folder):
  config = hf_experiment.get_config(str(folder))
  config.mesh.ici, config.sharding.preset = "fsdp:4,tensor:2", "fsdp_tp"
  config.data.update(seq_len=64, global_batch_size=16, eval_batches=2)
  config.train.update(steps=STEPS, eval_every=STEPS, checkpoint_every=STEPS, log_every=10)
  return config


def _transformers_loss(model, config) -> float:
  """Mean next-token cross-entropy of `model` over the run's held-out batches (float64)."""
  batches = training.build(config).batches
  losses = []
  for i in range(config.data.eval_batches):
    batch = jax.device_get(batches.eval_batch(i))
    with torch.no_grad():
      logits = model(torch.tensor(np.asarray(batch["inputs"]), dtype=torch.long)).logits
    losses.append(float(torch.nn.functional.cross_entropy(
        logits.double().reshape(-1, logits.shape[-1]),
        torch.tensor(np.asarray(batch["targets"]), dtype=torch.long).reshape(-1))))
  return float(np.mean(losses))


@pytest.mark.slow  # 12 s; the default suite stays near its budget (docs/testing.md)
def test_fine_tune_export_and_reload(tmp_path):
  original = reference.write_folder(tmp_path / "hf")
  config = _config(tmp_path / "hf")
  result = training.run(config, str(tmp_path / "tuned"))
  assert result.final_step == STEPS
  before = _transformers_loss(original, config)
  print(f"held-out loss at step 0: meshkit {result.eval_losses[0]:.6f}, transformers {before:.6f}")
  assert abs(result.eval_losses[0] - before) <= LOSS_TOLERANCE

  conversion.export_checkpoint(str(tmp_path / "tuned"), str(tmp_path / "exported"))
  old = load_file(str(tmp_path / "hf" / "model.safetensors"))
  new = load_file(str(tmp_path / "exported" / "model.safetensors"))
  assert sorted(old) == sorted(new)
  assert all(not np.array_equal(old[k], new[k]) for k in old), "a tensor was not trained"
  tuned = reference.transformers.AutoModelForCausalLM.from_pretrained(
      str(tmp_path / "exported")).eval()
  after = _transformers_loss(tuned, config)
  print(f"held-out loss at step {STEPS}: meshkit {result.eval_losses[STEPS]:.6f}, "
        f"transformers {after:.6f}")
  assert abs(result.eval_losses[STEPS] - after) <= LOSS_TOLERANCE
  assert after < before - 1.0  # it learned something

  # An imported workdir holds the state init_from starts from: toolkit.train's restore of its
  # step-0 checkpoint gives the same parameters, a fresh optimizer and the same rng.
  conversion.import_checkpoint(str(tmp_path / "hf"), str(tmp_path / "imported"), _config(
      tmp_path / "hf"))
  setup = training.build(config)
  restored, position = resume.restore_or_init(
      config, setup, checkpoint.Checkpoints(str(tmp_path / "imported" / "checkpoints"),
                                            read_only=True), print)
  fresh = init_from.initial_state(hf.HFFolder(str(tmp_path / "hf")), setup, config.seed)
  assert position["step"] == 0
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
               restored, fresh)
