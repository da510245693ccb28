"""Offline batch generation from a checkpoint: many prompts in, one JSON line per prompt out.

  python -m toolkit.generate --config=experiments/lm.py:cpu --checkpoint=runs/lm_cpu \\
      --prompts_file=in.jsonl --output=out.jsonl
  python -m toolkit.generate --config=experiments/lm.py:cpu --checkpoint=runs/lm_cpu \\
      --prompt="The " --max_tokens=100

Each input line is a JSON object with "prompt" (text, byte-level tokens) or "tokens" (ids),
an optional "id" copied to the output, and optional sampling fields that override the flags
(max_tokens, temperature, top_k, top_p, seed, stop_tokens). A line without "seed" gets
--seed + its line index. Output lines keep the input order.
"""
from __future__ import annotations

import dataclasses
import json
import os
import sys
import time

import jax
import ml_collections
import numpy as np

from toolkit import checkpoint, config as config_lib, data, engine as engine_lib
from toolkit import metrics as metrics_lib
from toolkit.config import ConfigError
from toolkit.sampling import RequestError, SamplingParams

DEFAULT_CACHE_LENGTH = 256


def restore_params(config: ml_collections.ConfigDict, checkpoint_path: str, devices=None):
  """The parameters of `checkpoint_path`'s latest step, restored straight into the shardings
  that `config`'s mesh and rules give them (the path `toolkit.sample` uses). Returns
  (params, model config, mesh, rules, step)."""
  from toolkit import train  # pylint: disable=g-import-not-at-top  # pulls in the loop
  if not checkpoint_path:
    raise ConfigError("--checkpoint is empty; give a training workdir or its checkpoints/ folder")
  directory = checkpoint.checkpoints_dir(checkpoint_path)
  if not os.path.isdir(directory):
    raise ConfigError(f"--checkpoint={checkpoint_path!r} does not exist; give the workdir of a "
                      f"training run")
  manager = checkpoint.Checkpoints(directory, read_only=True)
  try:
    step = manager.latest_step()
    if step is None:
      raise ConfigError(f"--checkpoint={checkpoint_path!r} holds no checkpoint; train first "
                        f"(python -m toolkit.train ... --workdir={checkpoint_path})")
    setup = train.build(config, devices)
    checkpoint.check_compatible(manager.saved_config(step), setup.spec.model,
                                f"{directory} step {step}")
    # Parameters only: the optimizer moments (2x the parameters for AdamW) are never read.
    params = manager.restore_params(step, setup.layout.abstract["params"])
  finally:
    manager.close()
  return params, setup.spec.model, setup.spec.mesh, setup.spec.rules, step


def read_requests(path: str, defaults: SamplingParams, vocab_size: int
                  ) -> tuple[list[dict], list[np.ndarray], list[SamplingParams]]:
  """Parses a prompts file; every mistake is a ConfigError naming the file and line."""
  if not os.path.isfile(path):
    raise ConfigError(f"--prompts_file={path!r} does not exist; give a JSONL file with one "
                      f'{{"prompt": "..."}} object per line')
  lines, prompts, params = [], [], []
  with open(path, encoding="utf-8") as f:
    for number, line in enumerate(f, 1):
      if not line.strip():
        continue
      where = f"{path} line {number}"
      try:
        record = json.loads(line)
      except json.JSONDecodeError as e:
        raise ConfigError(f"{where} is not valid JSON ({e.msg}); write one JSON object per "
                          f"line") from None
      try:
        prompt = parse_prompt(record)
        fields = {k: v for k, v in record.items() if k not in ("prompt", "tokens", "id")}
        fields.setdefault("seed", defaults.seed + len(prompts))
        params.append(SamplingParams.from_dict(fields, vocab_size, defaults))
      except RequestError as e:
        raise ConfigError(f"{where}: {e}") from None
      lines.append(record)
      prompts.append(prompt)
  if not prompts:
    raise ConfigError(f"--prompts_file={path!r} holds no prompts; give one JSON object per line")
  return lines, prompts, params


def parse_prompt(record) -> np.ndarray:
  """Token ids from a request object's "prompt" (text) or "tokens" (ids)."""
  if not isinstance(record, dict):
    raise RequestError('the request must be a JSON object such as {"prompt": "The "}')
  if ("prompt" in record) == ("tokens" in record):
    raise RequestError('give exactly one of "prompt" (text) or "tokens" (a list of ids)')
  if "prompt" in record:
    if not isinstance(record["prompt"], str):
      raise RequestError(f'"prompt" must be a string, not {type(record["prompt"]).__name__}')
    return data.encode(record["prompt"])
  tokens = record["tokens"]
  if not isinstance(tokens, list) or not all(
      isinstance(t, int) and not isinstance(t, bool) for t in tokens):
    raise RequestError('"tokens" must be a list of integer token ids')
  return np.asarray(tokens, np.int32)


def result_record(result: engine_lib.Result, request: dict | None = None) -> dict:
  record = {"completion": data.decode(result.tokens), "tokens": result.tokens,
            "finish_reason": result.finish_reason, "prompt_tokens": result.prompt_tokens,
            "completion_tokens": len(result.tokens)}
  if request is not None and "id" in request:
    record = {"id": request["id"], **record}
  return record


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
        cache_length: int = DEFAULT_CACHE_LENGTH) -> list[dict]:
  """Generates for `prompt` or every line of `prompts_file`; writes `output` if given and
  returns the output records."""
  if (prompt is None) == (prompts_file is None):
    raise ConfigError("give exactly one of --prompt or --prompts_file")
  if output:
    parent = os.path.dirname(os.path.abspath(output))
    if not os.path.isdir(parent):
      raise ConfigError(f"--output={output!r}: folder {parent} does not exist; create it first")
  # Input mistakes first: they need only the model's vocabulary, not the restored weights.
  spec = config_lib.resolve(config)
  if spec.task != "lm":
    raise ConfigError(f"--config has model.kind={config.model.get('kind')!r}, not a language "
                      f"model; predict with python -m toolkit.predict")
  vocab_size = spec.model.vocab_size
  try:
    defaults = defaults.validate(vocab_size)
  except RequestError as e:
    raise ConfigError(f"--{str(e)}") from None
  if prompts_file is not None:
    requests, prompts, sampling_params = read_requests(prompts_file, defaults, vocab_size)
  else:
    requests, prompts, sampling_params = [{}], [data.encode(prompt)], [defaults]
  params, model_cfg, mesh, rules, step = restore_params(config, checkpoint_path)
  try:
    engine = engine_lib.Engine(model_cfg, params, mesh, rules, cache_length)
    batch_size = min(batch_size, engine.prefill_rows(len(prompts), batch_size))
    engine.check_batch_size(batch_size)
    for i, (p, q) in enumerate(zip(prompts, sampling_params)):
      try:
        engine.check_request(p, q)
      except RequestError as e:
        where = f"{prompts_file} request {i + 1}" if prompts_file else "--prompt"
        raise ConfigError(f"{where}: {e} (--cache_length={cache_length})") from None
  except RequestError as e:
    raise ConfigError(f"--{e}") from None
  print(f"restored step {step}; mesh {dict(mesh.shape)}, rules {rules.name}; {len(prompts)} "
        f"prompt(s), batch {batch_size}, cache length {cache_length}", file=sys.stderr,
        flush=True)
  results = engine_lib.generate(engine, prompts, sampling_params, batch_size, Progress())
  records = [result_record(r, q) for r, q in zip(results, requests)]
  if output and jax.process_index() == 0:
    with open(output, "w", encoding="utf-8") as f:
      for record in records:
        f.write(json.dumps(record) + "\n")
  return records


def sampling_defaults(max_tokens: int, temperature: float, top_k: int, top_p: float, seed: int,
                      stop_tokens: list[str]) -> SamplingParams:
  try:
    stop = tuple(int(t) for t in stop_tokens)
  except ValueError:
    raise ConfigError(f"--stop_tokens={','.join(stop_tokens)}: give integer token ids, e.g. "
                      f"--stop_tokens=10") from None
  return dataclasses.replace(SamplingParams(), max_tokens=max_tokens, temperature=temperature,
                             top_k=top_k, top_p=top_p, seed=seed, stop_tokens=stop)


def define_sampling_flags():
  """The sampling flags `toolkit.generate` and `toolkit.serve` share (request defaults)."""
  from absl import flags  # pylint: disable=g-import-not-at-top
  return dict(
      max_tokens=flags.DEFINE_integer("max_tokens", 64, "New tokens per request.", lower_bound=1),
      temperature=flags.DEFINE_float("temperature", 0.0, "Sampling temperature; 0 is greedy.",
                                     lower_bound=0.0),
      top_k=flags.DEFINE_integer("top_k", 0, "Keep the k most likely tokens; 0 is off.",
                                 lower_bound=0),
      top_p=flags.DEFINE_float("top_p", 1.0, "Nucleus sampling mass in (0, 1]; 1 is off."),
      seed=flags.DEFINE_integer("seed", 0, "Sampling seed.", lower_bound=0),
      stop_tokens=flags.DEFINE_list("stop_tokens", [], "Token ids that end a request, e.g. 10 "
                                    "(newline)."),
  )


def cli() -> None:
  """`python -m toolkit.generate`: flags are defined here and nowhere else."""
  from absl import app, flags  # pylint: disable=g-import-not-at-top
  from ml_collections import config_flags  # pylint: disable=g-import-not-at-top
  import sharding  # pylint: disable=g-import-not-at-top
  from toolkit import command_line  # pylint: disable=g-import-not-at-top
  config_flag = config_flags.DEFINE_config_file(
      "config", None, "Required. The experiment file the checkpoint was trained with, e.g. "
      "experiments/lm.py:cpu; its mesh and sharding rules place the model.", lock_config=True)
  checkpoint_flag = flags.DEFINE_string("checkpoint", None, "Required. A training workdir or "
                                        "its checkpoints/ folder; the latest step is used.")
  prompt_flag = flags.DEFINE_string("prompt", None, "One prompt (text); the completion is "
                                    "printed.")
  prompts_file_flag = flags.DEFINE_string("prompts_file", None, "JSONL file of requests.")
  output_flag = flags.DEFINE_string("output", None, "JSONL file for the results.")
  batch_flag = flags.DEFINE_integer("batch_size", 16, "Requests decoded together (cache slots).",
                                    lower_bound=1)
  cache_flag = flags.DEFINE_integer("cache_length", DEFAULT_CACHE_LENGTH,
                                    "KV cache positions per request: prompt + max_tokens must "
                                    "fit.", lower_bound=2)
  sampling_flags = define_sampling_flags()

  def main(argv) -> None:
    del argv
    command_line.quiet_logging()
    try:
      defaults = sampling_defaults(**{k: f.value for k, f in sampling_flags.items()})
      records = run(config_flag.value, checkpoint_flag.value, prompt=prompt_flag.value,
                    prompts_file=prompts_file_flag.value, output=output_flag.value,
                    defaults=defaults, batch_size=batch_flag.value,
                    cache_length=cache_flag.value)
    except (ConfigError, sharding.ShardingError) as e:
      command_line.fail(e)
    if prompt_flag.value is not None:
      print(prompt_flag.value + records[0]["completion"])

  app.run(main, flags_parser=lambda argv: command_line.parse_flags(
      argv, config_flag, required={"checkpoint": "a training workdir, e.g. "
                                                 "--checkpoint=runs/lm_cpu"}))


if __name__ == "__main__":
  cli()
