"""Text in and out of an LM with the KV-cache engine: continue a prompt from a trained state
(the end of a training run) or from a workdir's latest checkpoint (`python -m toolkit.sample`).
Text is byte-level unless a tokenizer is given (toolkit/inference/codec.py).

Generation runs in windows of the training sequence length: the cache holds `window`
positions, and once a window is full the last half of it becomes the next prompt. The model
never sees a position beyond those it was trained on, however many tokens are asked for.
"""
from __future__ import annotations

import jax
import ml_collections
import numpy as np
from jax.experimental import multihost_utils

import sharding
from models import LlamaConfig
from toolkit.data import text
from toolkit.errors import ConfigError
from toolkit.inference import engine as engine_lib
from toolkit.inference.codec import BYTE_LEVEL, BYTES, Codec
from toolkit.inference.restore import open_latest, restore_params, single_device_config
from toolkit.inference.sampling import SamplingParams

# The end-of-run sample of a multi-process run gathers the parameters on every host; above this
# size it is skipped (toolkit.sample restores onto one device instead).
SAMPLE_GATHER_LIMIT_BYTES = 2**30


def continue_text(engine: engine_lib.Engine, prompt: str, num_tokens: int,
                  temperature: float = 0.8, seed: int = 0, codec: Codec = BYTE_LEVEL) -> str:
  """`prompt` followed by up to `num_tokens` tokens sampled at `temperature` (0 = greedy);
  an EOS token of `codec`'s model ends the text early."""
  tokens = [int(t) for t in codec.encode(prompt)] or [ord(" ")]
  window = engine.cache_length
  produced, round_index = 0, 0
  while produced < num_tokens:
    # The first window takes as much of the prompt as leaves room to generate; later ones
    # keep the last half window of text as context.
    keep = window - 1 if round_index == 0 else window // 2
    context = np.asarray(tokens[-keep:], np.int32)
    count = min(num_tokens - produced, window - len(context))
    params = codec.stop_at_eos(SamplingParams(max_tokens=count, temperature=temperature,
                                              seed=(seed + round_index) % 2**32))
    result, = engine_lib.generate(engine, [context], [params], batch_size=engine.batch_ways)
    if result.finish_reason == "error":
      raise RuntimeError(f"generation failed: {result.error}")
    tokens += result.tokens
    produced += len(result.tokens)
    round_index += 1
    if result.finish_reason == "stop":
      break
  return codec.decode(tokens)


def one_device_engine(model_cfg: LlamaConfig, params, window: int) -> engine_lib.Engine:
  """An engine on this process's first device, parameters replicated (a small model)."""
  devices = jax.local_devices()[:1]
  mesh = sharding.make_mesh([("data", 1)], [], devices)
  return engine_lib.Engine(model_cfg, params, mesh, sharding.Rules.preset("dp"), window)


def sample_after_training(config: ml_collections.ConfigDict, setup, state) -> str | None:
  """The end-of-run sample of `toolkit.train`: `train.sample_tokens` tokens after
  `train.sample_prompt`, printed by process 0; None for classifiers or when turned off.

  With several processes the parameters are gathered first (a collective: every process
  takes part), unless they are too big to hold on one host."""
  if setup.task.name != "lm" or config.train.sample_tokens <= 0:
    return None
  params = state["params"]
  if jax.process_count() > 1:
    total = setup.layout.report.total_bytes
    if total > SAMPLE_GATHER_LIMIT_BYTES:
      if jax.process_index() == 0:
        print(f"no sample: the parameters ({total / 2**30:.1f} GiB) are too big to gather on "
              f"one host; sample from the checkpoint (python -m toolkit.sample)", flush=True)
      return None
    params = multihost_utils.process_allgather(params, tiled=True)
  if jax.process_index() != 0:
    return None
  engine = one_device_engine(setup.spec.model, jax.device_get(params), config.data.seq_len)
  sample = continue_text(engine, config.train.sample_prompt, config.train.sample_tokens,
                         seed=config.seed)
  print(f"sample:\n{sample}", flush=True)
  return sample


def sample_from_checkpoint(workdir: str, prompt: str, num_tokens: int, temperature: float,
                           seed: int, tokenizer: str = BYTES) -> str:
  """Restores the latest parameters of a training workdir onto one device and continues
  `prompt` (text through `tokenizer`: 'bytes', or a tokenizer.json / Hugging Face folder)."""
  if (problem := text.utf8_problem(prompt)) is not None:
    raise ConfigError(f"--prompt is not valid UTF-8 text ({problem}); give the prompt in UTF-8")
  manager, step = open_latest(workdir, "--workdir")
  try:
    config = single_device_config(manager.saved_config(step))
  finally:
    manager.close()
  if config.model.get("kind", "llama") != "llama":
    raise ConfigError(f"--workdir={workdir!r} holds a {config.model.kind!r} model, not a "
                      f"language model; predict with python -m toolkit.predict")
  codec = Codec.load(tokenizer).check(config.model.vocab_size)
  params, model_cfg, _, _, _ = restore_params(config, workdir, jax.devices()[:1])
  engine = one_device_engine(model_cfg, params, config.data.seq_len)
  return continue_text(engine, prompt, num_tokens, temperature=temperature, seed=seed,
                       codec=codec)
