"""`python -m toolkit.sample --workdir=DIR --prompt="The "`: continue a prompt with a trained
LM, from its workdir's latest checkpoint, on one device with the KV-cache engine
(toolkit/inference/text.py). Text is byte-level unless --tokenizer names a tokenizer.json."""
from __future__ import annotations

from toolkit.errors import ConfigError
from toolkit.generate import define_tokenizer_flag
from toolkit.inference import text


def cli() -> None:
  """`python -m toolkit.sample --workdir=DIR --prompt="The "`: flags live here only."""
  from absl import app, flags  # pylint: disable=g-import-not-at-top
  from toolkit import command_line, runtime  # pylint: disable=g-import-not-at-top
  workdir = flags.DEFINE_string("workdir", None, "Required. Workdir of a training run.")
  prompt = flags.DEFINE_string("prompt", "The ", "Text to continue.")
  tokens = flags.DEFINE_integer("tokens", 200, "Tokens to generate (fewer when the model "
                                "emits its EOS).", lower_bound=1)
  temperature = flags.DEFINE_float(
      "temperature", 0.8, "Sampling temperature; 0 is greedy. The default 0.8 gives varied "
      "text, like the sample at the end of training (toolkit.generate and toolkit.serve default "
      "to greedy, 0).", lower_bound=0.0)
  seed = flags.DEFINE_integer("seed", 0, "Sampling seed: the same seed, prompt and checkpoint "
                              "give the same text; change it for another sample.")
  tokenizer = define_tokenizer_flag()
  cache_flag = command_line.define_runtime_flags()

  def main(argv):
    del argv
    command_line.quiet_logging()
    runtime.start(cache_flag.value)  # one device: nothing to simulate
    command_line.check_platform()
    try:
      print(text.sample_from_checkpoint(workdir.value, prompt.value, tokens.value,
                                        temperature.value, seed.value, tokenizer.value))
    except ConfigError as e:
      command_line.fail(e)

  app.run(main, flags_parser=lambda argv: command_line.parse_flags(
      argv, required={"workdir": "the workdir of a training run"}))


if __name__ == "__main__":
  cli()
