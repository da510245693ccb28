"""Batch prediction for classifier models (`python -m toolkit.predict`) (model.kind 'vit', or any model whose __call__ maps a
batch of inputs to logits (batch, classes)): an inputs file in, one JSON line per example out.

  python -m toolkit.predict --config=experiments/vit.py:cpu --checkpoint=runs/vit_digits \\
      --inputs=images.npz --output=predictions.jsonl

Inputs: an `.npz` with `images` (N, H, W[, C]; uint8 0-255 or float 0-1) and optionally
`labels` (N,), an `.npy` of images, or a folder with one sub-folder of image files per class
(the training layout). Images get the training normalization (data.mean, data.std). Each
output line: {"index", "label", "probability", "top_k": [[class, probability], ...]} and
"true_label" when the inputs have labels (then accuracy is printed too). The batch is
compiled once, sharded along `batch` by the config's rules; the last one is padded.
"""
from __future__ import annotations

import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding

import sharding
from toolkit.data import images as images_lib
from toolkit.errors import ConfigError
from toolkit.inference.restore import restore_params
from toolkit.training import config as config_lib
from toolkit.training import state as state_lib


def load_inputs(path: str, image_size: int, channels: int, num_classes: int
                ) -> tuple[np.ndarray, np.ndarray | None]:
  """(images (N, H, W, C) float32 in [0, 1], labels (N,) int32 or None)."""
  shape = images_lib.ImageShape(image_size, channels, num_classes)
  if os.path.isdir(path):
    folder, _ = images_lib.load_folder(path, shape, "--inputs")
    return (np.stack([folder[i]["image"] for i in range(len(folder))]),
            np.asarray(folder.labels, np.int32))
  if not os.path.isfile(path):
    raise ConfigError(f"--inputs={path!r} does not exist; give an .npz (images[, labels]), an "
                      f".npy of images or a folder of class folders")
  labels = None
  try:
    if path.endswith(".npz"):
      with np.load(path) as archive:
        if "images" not in archive.files:
          raise ConfigError(f"{path} has no array 'images' (it has "
                            f"{', '.join(archive.files) or 'none'}); save it with "
                            f"numpy.savez(path, images=...[, labels=...])")
        images = archive["images"]
        labels = archive["labels"] if "labels" in archive.files else None
    elif path.endswith(".npy"):
      images = np.load(path)
    else:
      raise ConfigError(f"--inputs={path!r}: use an .npz or .npy file or a folder")
  except (OSError, ValueError) as e:
    raise ConfigError(f"--inputs={path!r} cannot be read ({e}); write it with numpy.save "
                      f"or numpy.savez") from None
  if images.ndim == 3:
    images = images[..., None]
  want = (image_size, image_size, channels)
  if images.ndim != 4 or images.shape[1:] != want or len(images) == 0:
    raise ConfigError(f"{path}: images have shape {images.shape}, expected (N>=1, {want[0]}, "
                      f"{want[1]}, {want[2]}) for this model; resize them")
  if np.issubdtype(images.dtype, np.integer):
    images = images.astype(np.float32) / 255.0
  if labels is not None:
    if labels.shape != (len(images),) or not np.issubdtype(labels.dtype, np.integer):
      raise ConfigError(f"{path}: labels have shape {labels.shape} ({labels.dtype}); give one "
                        f"integer label per image")
    labels = labels.astype(np.int32)
  return images.astype(np.float32), labels


class Predictor:
  """A classifier's forward pass + softmax + top-k, compiled once for one batch size."""

  def __init__(self, graphdef: nnx.GraphDef, params, mesh, rules: sharding.Rules,
               batch_size: int, top_k: int):
    self.batch_sharding = NamedSharding(mesh, rules.activation_spec(("batch",), mesh))
    self.batch_size, self.top_k = batch_size, top_k
    self.params = params
    self.traces = 0

    def predict(params, images):
      self.traces += 1
      with sharding.activation_rules(rules, mesh):
        logits = nnx.merge(graphdef, params)(images)
      probabilities = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
      top_p, top_i = jax.lax.top_k(probabilities, top_k)
      return top_i.astype(jnp.int32), top_p

    self._predict = jax.jit(predict, out_shardings=(self.batch_sharding, self.batch_sharding))

  def __call__(self, images: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Top-k classes and probabilities, each (len(images), top_k)."""
    count = len(images)
    if count > self.batch_size:
      raise ValueError(f"{count} images for a batch of {self.batch_size}")
    padded = np.zeros((self.batch_size, *images.shape[1:]), np.float32)
    padded[:count] = images
    classes, probabilities = self._predict(self.params,
                                           jax.device_put(padded, self.batch_sharding))
    return np.asarray(classes)[:count], np.asarray(probabilities)[:count]


def run(config: ml_collections.ConfigDict, checkpoint_path: str, inputs: str, output: str,
        batch_size: int = 256, top_k: int = 3) -> dict:
  """Predicts every input; writes `output` (JSONL) and returns a summary."""
  spec = config_lib.resolve(config)
  model_cfg = spec.model
  if spec.task != "classification":
    raise ConfigError(f"--config has model.kind={config.model.get('kind', 'llama')!r}, not a "
                      f"classifier; generate text with python -m toolkit.generate")
  if output:
    parent = os.path.dirname(os.path.abspath(output))
    if not os.path.isdir(parent):
      raise ConfigError(f"--output={output!r}: folder {parent} does not exist; create it first")
  if not 1 <= top_k <= model_cfg.num_classes:
    raise ConfigError(f"--top_k={top_k} must be in [1, {model_cfg.num_classes}] (model."
                      f"num_classes)")
  if batch_size % spec.batch_ways:
    raise ConfigError(f"--batch_size={batch_size} must be a multiple of {spec.batch_ways}, the "
                      f"ways the mesh splits the batch")
  images, labels = load_inputs(inputs, model_cfg.image_size, model_cfg.channels,
                               model_cfg.num_classes)
  images = (images - config.data.mean) / config.data.std  # the training normalization
  params, model_cfg, mesh, rules, step = restore_params(config, checkpoint_path)
  layout = state_lib.layout(model_cfg, optax.identity(), rules, mesh)
  predictor = Predictor(layout.graphdef, params, mesh, rules, batch_size, top_k)
  print(f"restored step {step}; mesh {dict(mesh.shape)}, rules {rules.name}; {len(images)} "
        f"inputs, batch {batch_size}", file=sys.stderr, flush=True)
  records, start, last_report = [], time.perf_counter(), 0.0
  for begin in range(0, len(images), batch_size):
    classes, probabilities = predictor(images[begin:begin + batch_size])
    for row, (c, p) in enumerate(zip(classes, probabilities)):
      index = begin + row
      record = {"index": index, "label": int(c[0]), "probability": float(p[0]),
                "top_k": [[int(k), float(q)] for k, q in zip(c, p)]}
      if labels is not None:
        record["true_label"] = int(labels[index])
      records.append(record)
    elapsed = time.perf_counter() - start
    if elapsed - last_report >= 2.0 or len(records) == len(images):
      last_report = elapsed
      print(f"predicted {len(records)}/{len(images)} ({len(records) / len(images):.0%}) | "
            f"{len(records) / elapsed:,.0f} examples/s", file=sys.stderr, flush=True)
  summary = {"examples": len(records), "seconds": time.perf_counter() - start,
             "traces": predictor.traces}
  if labels is not None:
    summary["accuracy"] = float(np.mean([r["label"] == r["true_label"] for r in records]))
    print(f"accuracy {summary['accuracy']:.2%} on {len(records)} labelled inputs",
          file=sys.stderr, flush=True)
  if output and jax.process_index() == 0:
    with open(output, "w") as f:
      for record in records:
        f.write(json.dumps(record) + "\n")
  return summary
