"""Fine-tuning a Hugging Face Llama: the model from a folder's config.json, the weights from its
safetensors (`train.init_from=hf:DIR`, fresh optimizer), everything else from here.

The folder comes after the colon. With the tiny random model of scripts/data/tiny_hf_model.py (its
byte-level tokenizer makes CPython's docs as bytes its native tokens) on 8 simulated devices:

  python scripts/data/tiny_hf_model.py --out=runs/hf_tiny
  XLA_FLAGS=--xla_force_host_platform_device_count=8 \\
    python -m toolkit.train --config=experiments/hf.py:runs/hf_tiny --workdir=runs/hf_tuned

Expected result: held-out loss falls from 8.5 bits per byte (random weights) to 3.4 at step
100 (measured), in about a minute on 2 cores, half of it compiling.

The same config loads the checkpoint for generation and export (docs/huggingface.md):

  python -m toolkit.generate --config=experiments/hf.py:runs/hf_tiny \\
    --checkpoint=runs/hf_tuned --tokenizer=runs/hf_tiny --prompt="The " --max_tokens=40

Variants after the folder, comma separated:
  data=NAME    stdlib_docs (default, bytes), tokens (shards written by scripts/data/prepare_text.py
               with --tokenizer=DIR/tokenizer.json; set --config.data.path), synthetic
  rules=NAME   sharding preset: dp, fsdp (default), tp, fsdp_tp
"""
from toolkit.training import init_from
from toolkit.training.config import defaults

_KEYS = ("data", "rules")


def get_config(arg: str | None = None):
  if not arg:
    raise ValueError("experiments/hf.py needs a Hugging Face model folder after the colon, "
                     "e.g. --config=experiments/hf.py:runs/hf_tiny")
  folder, *items = arg.split(",")
  config = defaults()
  config.data.update(seq_len=128, global_batch_size=16, eval_batches=4)
  # A fine-tune: a lower peak learning rate and a short warmup than training from scratch.
  config.optimizer.update(learning_rate=1e-3, warmup_steps=10, weight_decay=0.0)
  # The end-of-run sample is byte-level text; sample with --tokenizer instead.
  config.train.update(steps=100, log_every=10, eval_every=50, checkpoint_every=50,
                      sample_tokens=0)
  for item in items:
    key, sep, value = item.partition("=")
    if not sep or key not in _KEYS:
      raise ValueError(f"experiments/hf.py: variant {item!r} is not key=value with a key of "
                       f"{', '.join(_KEYS)}")
    if key == "data":
      config.data.source = value
    else:
      config.sharding.preset = value
  return init_from.with_hf_model(config, folder, field="the folder")
