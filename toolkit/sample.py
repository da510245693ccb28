"""Text sampling from a trained byte-level LM: a helper the demo uses, and a small CLI.

Recomputes the forward pass over a fixed window per token (no KV cache); the serving issue
brings the cached decoder. The window keeps the compiled shape fixed: one compile per run.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from toolkit import data


def sample_text(graphdef: nnx.GraphDef, params, prompt: str, num_tokens: int, window: int,
                temperature: float = 0.8, seed: int = 0) -> str:
  """Continues `prompt` by `num_tokens` byte tokens sampled at `temperature` (0 = greedy)."""
  params = jax.device_get(params)  # a small model: sample on the default device

  @jax.jit
  def next_token(params, tokens, last, key):
    logits = nnx.merge(graphdef, params)(tokens[None])[0, last]
    if temperature <= 0:
      return jnp.argmax(logits)
    return jax.random.categorical(key, logits / temperature)

  tokens = list(data.encode(prompt)) or [ord(" ")]
  key = jax.random.key(seed)
  for i in range(num_tokens):
    context = tokens[-window:]
    buffer = np.zeros(window, np.int32)
    buffer[:len(context)] = context
    token = next_token(params, buffer, len(context) - 1, jax.random.fold_in(key, i))
    tokens.append(int(token))
  return data.decode(tokens)


def sample_from_checkpoint(workdir: str, prompt: str, num_tokens: int, temperature: float,
                           seed: int) -> str:
  """Restores the latest checkpoint of a training workdir (on one device) and samples."""
  import os  # pylint: disable=g-import-not-at-top
  import ml_collections  # pylint: disable=g-import-not-at-top
  from toolkit import checkpoint, train  # pylint: disable=g-import-not-at-top
  from toolkit.config import ConfigError  # pylint: disable=g-import-not-at-top

  directory = checkpoint.checkpoints_dir(workdir)
  if not os.path.isdir(directory):
    raise ConfigError(f"--workdir={workdir!r} does not exist; give the workdir of a training run")
  manager = checkpoint.Checkpoints(directory, read_only=True)
  step = manager.latest_step()
  if step is None:
    raise ConfigError(f"--workdir={workdir!r} holds no checkpoint; train first "
                      f"(python -m toolkit.train ... --workdir={workdir})")
  config = ml_collections.ConfigDict(manager.saved_config(step))
  # Sampling needs no model parallelism here: one device, parameters replicated.
  config.mesh.update(ici="data:1", dcn="")
  config.sharding.update(preset="dp", param_overrides="", activation_overrides="")
  config.data.global_batch_size = config.train.microbatches
  setup = train.build(config, jax.devices()[:1])
  state, _ = manager.restore(step, setup.layout.abstract)
  manager.close()
  return sample_text(setup.layout.graphdef, state["params"], prompt, num_tokens,
                     config.data.seq_len, temperature=temperature, seed=seed)


def cli() -> None:
  """`python -m toolkit.sample --workdir=DIR --prompt="The "`: flags live here only."""
  from absl import app, flags  # pylint: disable=g-import-not-at-top
  from toolkit import command_line  # pylint: disable=g-import-not-at-top
  from toolkit.config import ConfigError  # pylint: disable=g-import-not-at-top
  workdir = flags.DEFINE_string("workdir", None, "Required. Workdir of a training run.")
  prompt = flags.DEFINE_string("prompt", "The ", "Text to continue.")
  tokens = flags.DEFINE_integer("tokens", 200, "Byte tokens to generate.", lower_bound=1)
  temperature = flags.DEFINE_float("temperature", 0.8, "Sampling temperature; 0 is greedy.",
                                   lower_bound=0.0)
  seed = flags.DEFINE_integer("seed", 0, "Sampling seed.")

  def main(argv):
    del argv
    command_line.quiet_logging()
    try:
      print(sample_from_checkpoint(workdir.value, prompt.value, tokens.value, temperature.value,
                                   seed.value))
    except ConfigError as e:
      command_line.fail(e)

  app.run(main, flags_parser=lambda argv: command_line.parse_flags(
      argv, required={"workdir": "the workdir of a training run"}))


if __name__ == "__main__":
  cli()
