"""Text files or JSONL -> pre-tokenized shard files for `data.source=tokens` (toolkit/data/shards.py).

  python scripts/data/prepare_text.py --out=data/mytext book1.txt book2.txt notes.jsonl
  python scripts/data/prepare_text.py --out=data/hf --tokenizer=path/to/tokenizer.json corpus.jsonl

Every `.txt` file (or any file not ending in .jsonl) is one document; every line of a `.jsonl`
file is one document, its text in the field `--text_key` ("text"). A document is tokenized
(byte-level by default: ids 0-255 are UTF-8 bytes, 256 ends a document; or any Hugging Face
tokenizer.json through the `tokenizers` library) and followed by the end-of-document token.
The last `--val_fraction` (default 5 %) of every document's text goes to the `val` split, the
rest to `train`: one file gives both splits, and val holds that share of the tokens. Output:
`train_00000.bin`, ... (flat little-endian uint16, or uint32 for vocabularies above 65,536)
and `meta.json`.

Then train on them:

  python -m toolkit.train --config=experiments/lm.py:cpu,data=tokens \\
    --config.data.path=data/mytext --config.model.vocab_size=384 --workdir=runs/mytext
"""
from __future__ import annotations

from toolkit.data import shards
from toolkit.data.preparation import prepare
from toolkit.errors import ConfigError


def main() -> None:
  from absl import app, flags  # pylint: disable=g-import-not-at-top
  from toolkit import command_line  # pylint: disable=g-import-not-at-top
  out = flags.DEFINE_string("out", None, "Required. Output folder for the shards and meta.json.")
  tokenizer = flags.DEFINE_string("tokenizer", "bytes", "'bytes' (built in) or the path of a "
                                  "Hugging Face tokenizer.json.")
  eot_token = flags.DEFINE_string("eot_token", "", "The tokenizer's end-of-document token "
                                  "(default: the first of <|endoftext|>, </s>, <eos>, ...).")
  val_fraction = flags.DEFINE_float("val_fraction", 0.05, "Share of every document's text "
                                    "held out (its tail) for the val split.",
                                    lower_bound=0.0, upper_bound=0.5)
  shard_tokens = flags.DEFINE_integer("shard_tokens", 100_000_000, "Tokens per shard file.",
                                      lower_bound=1)
  text_key = flags.DEFINE_string("text_key", "text", "The text field of .jsonl records.")

  inputs: list[str] = []

  def parse(argv: list[str]) -> list[str]:
    # Input files are positional (shell globs work); the flags are parsed the usual way.
    inputs.extend(a for a in argv[1:] if not a.startswith("-"))
    return command_line.parse_flags([argv[0]] + [a for a in argv[1:] if a.startswith("-")],
                                    required={"out": "an output folder, e.g. --out=data/text"})

  def run(argv) -> None:
    del argv
    try:
      prepare(inputs, out.value, shards.Tokenizer(tokenizer.value, eot_token.value),
              val_fraction.value, shard_tokens.value, text_key.value)
    except ConfigError as e:
      command_line.fail(e)

  app.run(run, flags_parser=parse)


if __name__ == "__main__":
  main()
