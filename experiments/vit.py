"""Vision Transformer image classifiers.

CPU variant (the default): scikit-learn's bundled handwritten digits (1,797 real 8x8 images, no
download; 359 held out), a 0.17 M-parameter ViT on four 4x4 patches, 8 simulated devices:

  XLA_FLAGS=--xla_force_host_platform_device_count=8 \\
    python -m toolkit.train --config=experiments/vit.py:cpu --workdir=runs/vit_digits

Expected result: held-out accuracy >= 97% for each of seeds 0, 1, 2 (--config.seed=N), and
runs/vit_digits/confusion.png and loss.png. Measured: 98.89%, 99.16% and 98.61%, i.e. 98.89%
+- 0.28% (mean +- standard deviation), 85 s per run on 2 CPU cores shared with other jobs, by

  XLA_FLAGS=--xla_force_host_platform_device_count=8 \\
    python scripts/launch/seeds.py --config=experiments/vit.py:cpu --seeds=0,1,2 --workdir=runs/vit_seeds

tests/test_documented_results.py checks the floor and the mean (slow; .ci/run runs it).

The recipe: weight decay 0.5 (AdamW, matrices only), four 4x4 patches, label smoothing 0.1
and no pad-and-crop. The earlier one (2x2 patches, 1-pixel pad-and-crop, weight decay 0.05)
memorized the 1,437 training images (training loss 0.008 against 0.16 held out) and ended
between 95.0% and 98.3% depending on the seed and on the machine's float rounding. Stronger
weight decay alone spread the seeds wider; 4x4 patches learn ~2.5x faster per step and spread
less; label smoothing keeps the logits of memorized images from growing; and shifted copies
of these centred, size-normalized digits only moved the training images away from the
held-out ones. docs/images.md has the runs behind each choice.

ViT-B/16 on ImageNet shapes (224x224x3, 1000 classes, 86 M parameters), for a pod-sized run;
its data is synthetic unless a path is given. `toolkit.compile` reports on the Llama LM only
so far (its estimates are the LM's); tests/models/test_vit.py compiles this variant's real
train step for a v5p-16 slice from a CPU.

To train it on ImageNet, convert the training set to one folder per class (the usual
`train/n01440764/*.JPEG` layout, 1,281,167 images) and the validation set likewise (50,000):

  python -m toolkit.train --config=experiments/vit.py:b16,data=image_folder \\
    --config.data.path=/data/imagenet/train --config.data.eval_path=/data/imagenet/val \\
    --config.data.worker_count=16 --workdir=/mnt/shared/vit-b16

Images are decoded in Grain worker processes, resized to 224x224, padded-and-cropped and
flipped; the held-out images only resized and normalized.

Variants after the colon, comma separated:
  cpu          (default) digits, 1,200 steps, batch 128
  tiny         the unit-test size: a 2-layer ViT on digits, 6 steps
  b16          ViT-B/16 on ImageNet shapes, global batch 4096, bf16 compute, fsdp
  rules=NAME   sharding preset: dp, fsdp, tp, fsdp_tp
  data=NAME    digits, npz, image_folder or synthetic (npz/image_folder: set data.path)
  workers=N    Grain worker processes
"""
import dataclasses

import ml_collections

from models.vit import PRESETS as MODEL_PRESETS
from toolkit.training.config import defaults

_VARIANTS = ("cpu", "tiny", "b16")
_KEYS = ("rules", "data", "workers")


def get_config(arg: str | None = None):
  config = defaults()
  _set_model(config, "digits")
  config.mesh.ici = "data:-1"
  config.sharding.preset = "dp"
  # Data parallel on purpose: 0.17 M parameters (0.7 MB) are cheaper replicated than gathered,
  # so the replication check allows all of them (variants that shard set the limit back).
  config.sharding.max_replicated_fraction = 1.0
  # Two Grain worker processes prepare batches while the step runs. No pad-and-crop for the
  # digits: they come centred and size-normalized, and shifted copies cost accuracy (module
  # docstring). Weight decay 0.5 and label smoothing 0.1 keep the model from memorizing them.
  config.data.update(source="digits", global_batch_size=128, eval_fraction=0.2,
                     crop_padding=0, flip=False, mean=0.5, std=0.5, worker_count=2)
  config.optimizer.update(learning_rate=2e-3, warmup_steps=60, weight_decay=0.5)
  config.train.update(steps=1200, log_every=100, eval_every=200, checkpoint_every=600,
                      sample_tokens=0, label_smoothing=0.1)
  for item in filter(None, (arg or "cpu").split(",")):
    key, sep, value = item.partition("=")
    if not sep:
      if key not in _VARIANTS:
        raise ValueError(f"experiments/vit.py: unknown variant {key!r}; choose from "
                         f"{', '.join(_VARIANTS)} or key=value with keys {', '.join(_KEYS)}")
      if key == "tiny":
        _set_model(config, "tiny")
        # Augmented, so that the pipeline tests cover its reproducibility and resume.
        config.data.update(global_batch_size=32, worker_count=0, crop_padding=1)
        config.optimizer.update(learning_rate=3e-3, warmup_steps=2)
        config.train.update(steps=6, log_every=3, eval_every=6, checkpoint_every=3)
      if key == "b16":
        _set_model(config, "b16")
        config.mesh.ici = "data:1,fsdp:-1,tensor:1"
        config.sharding.preset = "fsdp"
        config.sharding.max_replicated_fraction = defaults().sharding.max_replicated_fraction
        config.data.update(source="synthetic", global_batch_size=4096, crop_padding=16,
                           flip=True, worker_count=16)
        config.optimizer.update(learning_rate=1e-3, warmup_steps=10_000, weight_decay=0.1)
        config.train.update(steps=300_000, log_every=100, eval_every=5000,
                            checkpoint_every=5000)
    elif key == "rules":
      config.sharding.preset = value
      if value != "dp":
        config.sharding.max_replicated_fraction = defaults().sharding.max_replicated_fraction
    elif key == "data":
      config.data.source = value
    elif key == "workers":
      config.data.worker_count = int(value)
    else:
      raise ValueError(f"experiments/vit.py: unknown variant key {key!r}; use one of "
                       f"{', '.join(_KEYS)}")
  return config


def _set_model(config, preset: str) -> None:
  config.model = ml_collections.ConfigDict(
      {"kind": "vit", **dataclasses.asdict(MODEL_PRESETS[preset])})
