"""`python -m toolkit.generate`: offline batch generation from a checkpoint, many prompts in,
one JSON line per prompt out (toolkit/inference/offline.py does the work).

  python -m toolkit.generate --config=experiments/lm.py:cpu --checkpoint=runs/lm_cpu \\
      --prompts_file=in.jsonl --output=out.jsonl
  python -m toolkit.generate --config=experiments/lm.py:cpu --checkpoint=runs/lm_cpu \\
      --prompt="The " --max_tokens=100
  python -m toolkit.generate --config=experiments/hf.py:runs/hf_tiny --checkpoint=runs/hf_import \\
      --tokenizer=runs/hf_tiny --prompt="The " --max_tokens=20
"""
from __future__ import annotations

from toolkit.errors import ConfigError
from toolkit.inference import offline
from toolkit.inference.requests import sampling_defaults


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


def define_engine_flags():
  """The cache and weight flags `toolkit.generate` and `toolkit.serve` share; `engine_options`
  turns their values into an engine.Options."""
  from absl import flags  # pylint: disable=g-import-not-at-top
  from toolkit.inference import engine  # pylint: disable=g-import-not-at-top
  return dict(
      page_size=flags.DEFINE_integer("page_size", engine.DEFAULT_PAGE_SIZE, "KV cache "
                                     "positions per page.", lower_bound=1),
      cache_pages=flags.DEFINE_integer("cache_pages", 0, "KV cache pages in all; 0: "
                                       "batch_size x the pages of one cache_length request.",
                                       lower_bound=0),
      prefill_chunk=flags.DEFINE_integer("prefill_chunk", 0, "Prompt tokens prefilled per step "
                                         "beside the decoding requests; 0: whole prompts at "
                                         "once.", lower_bound=0),
      prefix_caching=flags.DEFINE_bool("prefix_caching", True, "Reuse the cached pages of "
                                       "prompt prefixes seen before."),
      quantize=flags.DEFINE_enum("quantize", "none", list(engine.WEIGHT_FORMATS), "Weights as "
                                 "served: none (as restored), bfloat16, or int8 (per-channel "
                                 "scales)."),
  )


def engine_options(engine_flags: dict):
  from toolkit.inference import engine  # pylint: disable=g-import-not-at-top
  return engine.Options(**{name: flag.value for name, flag in engine_flags.items()})


def define_tokenizer_flag():
  """--tokenizer, shared by `toolkit.generate`, `toolkit.serve` and `toolkit.sample`."""
  from absl import flags  # pylint: disable=g-import-not-at-top
  return flags.DEFINE_string(
      "tokenizer", "bytes", "How text becomes tokens: 'bytes' (byte-level models) or a Hugging "
      "Face tokenizer.json / model folder; its folder's BOS id is put before each prompt and "
      "its EOS ids end each request.")


def cli() -> None:
  """`python -m toolkit.generate`: flags are defined here and nowhere else."""
  from absl import app, flags  # pylint: disable=g-import-not-at-top
  from ml_collections import config_flags  # pylint: disable=g-import-not-at-top
  import sharding  # pylint: disable=g-import-not-at-top
  from toolkit import command_line, runtime, xla_flags  # pylint: disable=g-import-not-at-top
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
  cache_flag = flags.DEFINE_integer("cache_length", offline.DEFAULT_CACHE_LENGTH,
                                    "KV cache positions per request: prompt + max_tokens must "
                                    "fit.", lower_bound=2)
  sampling_flags = define_sampling_flags()
  engine_flags = define_engine_flags()
  tokenizer_flag = define_tokenizer_flag()
  cache_dir_flag = command_line.define_runtime_flags()

  def main(argv) -> None:
    del argv
    command_line.quiet_logging()
    runtime.start(cache_dir_flag.value, mesh=config_flag.value.mesh,
                  xla_flags=xla_flags.setting_of(config_flag.value))
    command_line.check_platform()
    try:
      defaults = sampling_defaults(**{k: f.value for k, f in sampling_flags.items()})
      records = offline.run(config_flag.value, checkpoint_flag.value, prompt=prompt_flag.value,
                    prompts_file=prompts_file_flag.value, output=output_flag.value,
                    defaults=defaults, batch_size=batch_flag.value,
                    cache_length=cache_flag.value, tokenizer=tokenizer_flag.value,
                    options=engine_options(engine_flags))
    except (ConfigError, sharding.ShardingError) as e:
      command_line.fail(e)
    if prompt_flag.value is not None:
      print(prompt_flag.value + records[0]["completion"])

  app.run(main, flags_parser=lambda argv: command_line.parse_flags(
      argv, config_flag, required={"checkpoint": "a training workdir, e.g. "
                                                 "--checkpoint=runs/lm_cpu"}))


if __name__ == "__main__":
  cli()
