"""Held-out exact match of a chat model: each held-out conversation's last assistant turn is
generated greedily through the KV-cache engine (toolkit/inference/engine.py) from the turns
before it, rendered with the generation prompt, and compared with the data's answer as text.

  python scripts/dev/chat_exact_match.py --config=experiments/sft.py:cpu,base=runs/lm_cpu_hf \\
      --checkpoint=runs/sft_repeat

--checkpoint: a training workdir (its latest step); without it, the weights the config starts
from (train.init_from), i.e. the score before fine-tuning. The held-out conversations are the
config's (data.eval_path, or a synthetic task's own held-out split). Prints
"exact match: 97.3 % (249 of 256) ..." and a few of the outputs.
"""
from __future__ import annotations

import dataclasses


# Requests decoded together: every one of a round gets the same max_tokens and no stop token,
# so a round prefills and decodes one shape each (two compiles in all); the answer is the
# output up to the template's end-of-turn token.
BATCH_SIZE = 64


@dataclasses.dataclass(frozen=True)
class Score:
  correct: int
  total: int
  outputs: list[tuple[str, str]]  # (generated, expected)

  @property
  def accuracy(self) -> float:
    return self.correct / self.total

  def format(self, show: int = 3) -> str:
    lines = [f"exact match: {self.accuracy:.1%} ({self.correct} of {self.total})"]
    lines += [f"  {got!r} (expected {want!r})" for got, want in self.outputs[:show]]
    return "\n".join(lines)


def score(config, params, model_cfg, batch_size: int = BATCH_SIZE) -> Score:
  """Exact match of `params` (a `model_cfg` LM) on `config`'s held-out conversations, on this
  process's first device."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  from toolkit.data import chat, instruct  # pylint: disable=g-import-not-at-top
  from toolkit.inference import engine as engine_lib, text  # pylint: disable=g-import-not-at-top
  from toolkit.inference.sampling import SamplingParams  # pylint: disable=g-import-not-at-top
  d = config.data
  chat.check_config(d)
  tokenizer = chat.ChatTokenizer.load(chat.tokenizer_path(d, config.train.get("init_from", "")),
                                      d.chat_template)
  _, conversations, _ = chat.split_conversations(d)
  prompts, answers = zip(*(instruct.prompt_and_answer(c.messages) for c in conversations))
  ids = [tokenizer.encode_prompt(p) for p in prompts]
  stop = tokenizer.end_of_turn()
  # Room for the longest answer and its end of turn, within the cache.
  longest = max(len(tokenizer.token_ids(a)[0]) for a in answers) + 1
  window = max(len(i) for i in ids) + longest
  engine = text.one_device_engine(model_cfg, params, window)
  results = engine_lib.generate(engine, ids, [SamplingParams(max_tokens=longest)] * len(ids),
                                min(batch_size, len(ids)))
  outputs = []
  for result, answer in zip(results, answers):
    tokens = np.asarray(result.tokens, np.int64)
    end = np.flatnonzero(tokens == stop)
    outputs.append((tokenizer.decode(tokens[:end[0]] if end.size else tokens), answer))
  return Score(sum(got == want for got, want in outputs), len(outputs), outputs)


def initial_params(config, devices):
  """(params, model config) the config starts from, as training starts: train.init_from's
  folder (with LoRA, its adapters fresh beside it), else fresh weights from the seed."""
  import jax  # pylint: disable=g-import-not-at-top
  from toolkit import hf, training  # pylint: disable=g-import-not-at-top
  from toolkit.training import init_from, state as state_lib  # pylint: disable=g-import-not-at-top
  setup = training.build(config, devices)
  folder = init_from.parse(config.train.get("init_from", ""))
  if folder is None:
    state = state_lib.create(setup.spec.model, setup.optimizer, setup.layout, config.seed)
  else:
    state = init_from.initial_state(hf.HFFolder(folder, init_from.FIELD), setup, config.seed)
  return jax.device_get(state["params"]), setup.spec.model


def main() -> None:
  from absl import app, flags  # pylint: disable=g-import-not-at-top
  from ml_collections import config_flags  # pylint: disable=g-import-not-at-top
  from toolkit import command_line  # pylint: disable=g-import-not-at-top
  config_flag = config_flags.DEFINE_config_file("config", None, "Experiment and variant.",
                                                lock_config=True)
  checkpoint_flag = flags.DEFINE_string("checkpoint", None, "A training workdir; without it, "
                                        "the weights the config starts from.")
  cache_flag = command_line.define_runtime_flags()

  def run(argv) -> None:
    del argv
    import jax  # pylint: disable=g-import-not-at-top
    import sharding  # pylint: disable=g-import-not-at-top
    from toolkit import runtime  # pylint: disable=g-import-not-at-top
    from toolkit.errors import ConfigError  # pylint: disable=g-import-not-at-top
    from toolkit.inference.restore import restore_params  # pylint: disable=g-import-not-at-top
    command_line.quiet_logging()
    runtime.start(cache_flag.value, mesh=config_flag.value.mesh)
    command_line.check_platform()
    config = config_flag.value
    try:
      if checkpoint_flag.value:
        params, model_cfg, *_ = restore_params(config, checkpoint_flag.value)
        params = jax.device_get(params)
      else:
        params, model_cfg = initial_params(config, None)
      result = score(config, params, model_cfg)
    except (ConfigError, sharding.ShardingError) as e:
      command_line.fail(e)
    print(result.format(), flush=True)

  app.run(run, flags_parser=lambda argv: command_line.parse_flags(argv, config_flag))


if __name__ == "__main__":
  main()
