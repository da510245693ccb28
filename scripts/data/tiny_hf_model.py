"""A tiny random Hugging Face `LlamaForCausalLM` folder, built locally (no download): the stand-in
for a published checkpoint in docs/huggingface.md and the tests.

  python scripts/data/tiny_hf_model.py --out=runs/hf_tiny

Writes what `save_pretrained` writes (config.json, generation_config.json, model.safetensors)
plus a byte-level tokenizer (tokenizer.json: ids 0-255 are the UTF-8 bytes, 256 is
<|begin_of_text|>, 257 <|end_of_text|>), so CPython's docs as bytes (`data.source=stdlib_docs`)
are exactly this tokenizer's tokens. Every weight is random, with norm scales around 1, so a
swapped or transposed tensor shows in the logits. Needs transformers and torch (the `test`
extra: pip install -e '.[test]').
"""
from __future__ import annotations

import os

BOS, EOS = 256, 257
# 2 layers, grouped-query attention (4 heads, 2 KV heads), Llama 3's RoPE scaling with a short
# original context so that every band of the scaling is used within a few hundred positions.
TINY = dict(vocab_size=258, hidden_size=64, intermediate_size=192, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5,
            max_position_embeddings=512, tie_word_embeddings=True, bos_token_id=BOS,
            eos_token_id=EOS,
            rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                          "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
            rope_theta=500_000.0)
# Larger models of the same family for benchmarks (--size): 25m is a 25 M-parameter Llama
# with a 32k vocabulary (scripts/bench/bench_batch_fit.py serves it).
SIZES = {"tiny": {}, "25m": dict(vocab_size=32_000, hidden_size=384, intermediate_size=1024,
                                 num_hidden_layers=8, num_attention_heads=6,
                                 num_key_value_heads=6, max_position_embeddings=4096)}


def byte_tokenizer():
  """A `tokenizers` byte-level BPE without merges: token i is byte i (GPT-2's byte-to-unicode
  alphabet), plus the BOS and EOS special tokens."""
  # pylint: disable-next=g-import-not-at-top
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers
  printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
               *range(ord("®"), ord("ÿ") + 1)]
  extra = iter(range(256, 512))
  alphabet = {b: chr(b) if b in printable else chr(next(extra)) for b in range(256)}
  tokenizer = Tokenizer(models.BPE({alphabet[b]: b for b in range(256)}, []))
  tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
  tokenizer.decoder = decoders.ByteLevel()
  tokenizer.add_special_tokens(["<|begin_of_text|>", "<|end_of_text|>"])
  return tokenizer


def randomize(model, seed: int) -> None:
  """Every weight random: matrices ~ N(0, 1/columns) (unit-scale activations and logits), norm
  scales 1 + N(0, 0.1^2)."""
  import torch  # pylint: disable=g-import-not-at-top
  generator = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    for weight in model.parameters():
      noise = torch.randn(weight.shape, generator=generator, dtype=weight.dtype)
      if weight.ndim == 1:
        weight.copy_(1 + 0.1 * noise)
      else:
        weight.copy_(noise / weight.shape[1] ** 0.5)


def write(out: str, seed: int = 0, tokenizer: str | None = "bytes", **overrides):
  """Saves a random LlamaForCausalLM (TINY with `overrides`) into `out`; returns the model
  (eval mode). `tokenizer`: "bytes" writes the byte tokenizer, a path copies that
  tokenizer.json, None writes none."""
  import shutil  # pylint: disable=g-import-not-at-top
  import torch  # pylint: disable=g-import-not-at-top
  import transformers  # pylint: disable=g-import-not-at-top
  torch.manual_seed(seed)
  model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**TINY, **overrides}))
  randomize(model, seed)
  model.eval()
  model.save_pretrained(out)
  if tokenizer == "bytes":
    transformers.PreTrainedTokenizerFast(
        tokenizer_object=byte_tokenizer(), bos_token="<|begin_of_text|>",
        eos_token="<|end_of_text|>").save_pretrained(out)
  elif tokenizer:
    shutil.copyfile(tokenizer, os.path.join(out, "tokenizer.json"))
  return model


def main() -> None:
  from absl import app, flags  # pylint: disable=g-import-not-at-top
  from toolkit import command_line  # pylint: disable=g-import-not-at-top
  from toolkit.planning.report import human_count  # pylint: disable=g-import-not-at-top
  out = flags.DEFINE_string("out", None, "Required. The new model folder.")
  seed = flags.DEFINE_integer("seed", 0, "Seed of the random weights.")
  size = flags.DEFINE_enum("size", "tiny", list(SIZES), "Model size: tiny (the tests' model) "
                           "or 25m (benchmarks).")

  def run(argv) -> None:
    del argv
    if os.path.exists(out.value) and os.listdir(out.value):
      command_line.fail(f"--out={out.value!r} exists and is not empty; give a new folder")
    try:
      import transformers  # noqa: F401  pylint: disable=g-import-not-at-top,unused-import
    except ImportError:
      command_line.fail("this script needs transformers and torch: pip install -e '.[test]'")
    model = write(out.value, seed.value, **SIZES[size.value])
    print(f"wrote {out.value}: LlamaForCausalLM, {human_count(model.num_parameters())} "
          f"parameters, byte tokenizer (BOS {BOS}, EOS {EOS})")

  app.run(run, flags_parser=lambda argv: command_line.parse_flags(
      argv, required={"out": "a new folder, e.g. --out=runs/hf_tiny"}))


if __name__ == "__main__":
  main()
