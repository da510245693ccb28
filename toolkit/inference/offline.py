"""Offline batch generation from a checkpoint: many prompts in, one JSON line per prompt out
(`python -m toolkit.generate`).

Each input line is a JSON object with "prompt" (text: byte-level tokens, or through
--tokenizer with the model's BOS in front) or "tokens" (ids),
an optional "id" copied to the output, and optional sampling fields that override the flags
(max_tokens, temperature, top_k, top_p, seed, stop_tokens). A line without "seed" gets
--seed + its line index. Output lines keep the input order.
"""
from __future__ import annotations

import json
import os
import sys
import time

import jax
import ml_collections

from toolkit.data import text
from toolkit.errors import ConfigError
from toolkit.inference import engine as engine_lib
from toolkit.inference.codec import BYTES, Codec
from toolkit.inference.requests import read_requests, result_record
from toolkit.inference.restore import restore_params
from toolkit.inference.sampling import RequestError, SamplingParams
from toolkit.training import config as config_lib
from toolkit.training import metrics as metrics_lib

DEFAULT_CACHE_LENGTH = 256


class Progress:
  """A progress line at most every `every_s` seconds: requests/s, tokens/s, ETA."""

  def __init__(self, every_s: float = 2.0, stream=sys.stderr):
    self.every_s, self.stream = every_s, stream
    self.start = self.last = time.perf_counter()

  def __call__(self, done: int, total: int, tokens: int) -> None:
    now = time.perf_counter()
    if now - self.last < self.every_s and done < total:
      return
    self.last = now
    elapsed = max(now - self.start, 1e-9)
    rate = done / elapsed
    eta = (total - done) / rate if rate > 0 else float("nan")
    print(f"requests {done}/{total} ({done / total:.0%}) | {rate:.1f} requests/s | "
          f"{tokens / elapsed:,.0f} tokens/s | ETA "
          f"{metrics_lib.format_duration(eta) if eta == eta else '?'}",
          file=self.stream, flush=True)


def run(config: ml_collections.ConfigDict, checkpoint_path: str, *, prompt: str | None = None,
        prompts_file: str | None = None, output: str | None = None,
        defaults: SamplingParams = SamplingParams(), batch_size: int = 16,
        cache_length: int = DEFAULT_CACHE_LENGTH, tokenizer: str = BYTES,
        options: engine_lib.Options = engine_lib.Options()) -> list[dict]:
  """Generates for `prompt` or every line of `prompts_file`; writes `output` if given and
  returns the output records. Text goes through `tokenizer` ('bytes' or a tokenizer.json /
  Hugging Face folder, whose EOS ids also end every request); `options` say how the cache and
  the weights are held."""
  if (prompt is None) == (prompts_file is None):
    raise ConfigError("give exactly one of --prompt or --prompts_file")
  if prompt is not None and (problem := text.utf8_problem(prompt)) is not None:
    raise ConfigError(f"--prompt is not valid UTF-8 text ({problem}); give the prompt in UTF-8")
  if output:
    parent = os.path.dirname(os.path.abspath(output))
    if not os.path.isdir(parent):
      raise ConfigError(f"--output={output!r}: folder {parent} does not exist; create it first")
  # Input mistakes first: they need only the model's vocabulary, not the restored weights.
  spec = config_lib.resolve(config)
  if spec.task not in config_lib.LANGUAGE_MODEL_TASKS:
    raise ConfigError(f"--config has model.kind={config.model.get('kind')!r}, not a language "
                      f"model; predict with python -m toolkit.predict")
  vocab_size = spec.model.vocab_size
  codec = Codec.load(tokenizer).check(vocab_size)
  try:
    defaults = codec.stop_at_eos(defaults.validate(vocab_size))
  except RequestError as e:
    raise ConfigError(f"--{str(e)}") from None
  if prompts_file is not None:
    requests, prompts, sampling_params = read_requests(prompts_file, defaults, vocab_size, codec)
  else:
    requests, prompts, sampling_params = [{}], [codec.encode(prompt)], [defaults]
  params, model_cfg, mesh, rules, step = restore_params(config, checkpoint_path)
  try:
    engine = options.engine(model_cfg, params, mesh, rules, cache_length)
    asked, batch_size = batch_size, min(batch_size, engine.prefill_rows(len(prompts), batch_size))
    engine.check_batch_size(batch_size)
    engine_lib.Batcher.check_options(engine, batch_size, **options.batcher())
    for i, (p, q) in enumerate(zip(prompts, sampling_params)):
      try:
        engine.check_request(p, q)
      except RequestError as e:
        where = f"{prompts_file} request {i + 1}" if prompts_file else "--prompt"
        raise ConfigError(f"{where}: {e} (--cache_length={cache_length})") from None
  except RequestError as e:
    raise ConfigError(f"--{e}") from None
  capped = (f" (--batch_size={asked} capped: {len(prompts)} prompt(s) fill {batch_size} slots)"
            if batch_size < asked else "")
  print(f"restored step {step}; mesh {dict(mesh.shape)}, rules {rules.name}; {len(prompts)} "
        f"prompt(s), batch {batch_size}{capped}, cache length {cache_length}; "
        f"{engine.describe_weights()}", file=sys.stderr, flush=True)
  results = engine_lib.generate(engine, prompts, sampling_params, batch_size, Progress(),
                                **options.batcher())
  records = [result_record(r, q, codec) for r, q in zip(results, requests)]
  if output and jax.process_index() == 0:
    with open(output, "w", encoding="utf-8") as f:
      for record in records:
        f.write(json.dumps(record) + "\n")
  return records
