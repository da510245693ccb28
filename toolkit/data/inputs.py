"""A run's inputs from its config: which batches class serves `data.source`."""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
from jax.sharding import NamedSharding

from toolkit.data import shards, text
from toolkit.errors import ConfigError

if TYPE_CHECKING:
  from toolkit.data.grain_batches import GrainBatches
  from toolkit.data.packing import DocumentBatches


def from_config(config, spec) -> text.Batches | GrainBatches | DocumentBatches:
  """The run's batches: `text.Batches` for the built-in text and synthetic tokens, Grain for
  token shards (their documents packed into rows with `data.packing`: `packing.DocumentBatches`)
  and images. `spec` is the resolved config (toolkit.training.config.RunSpec:
  mesh, rules, model, task). Raises ConfigError naming a missing or bad input file."""
  d, mesh, rules = config.data, spec.mesh, spec.rules
  if spec.task == "lm" and d.source not in ("tokens", "chat"):
    batch_sharding = NamedSharding(mesh, rules.activation_spec(("batch", None), mesh))
    return text.Batches(text.TokenSource.from_config(d, spec.model.vocab_size), config.seed,
                        d.seq_len, d.global_batch_size, d.eval_batches, batch_sharding)
  if d.source == "chat":
    return _chat_batches(config, spec)
  if d.source == "preference":
    return _preference_batches(config, spec)
  if d.source == "prompts":  # GRPO: the step's shapes; its batches are sampled from the model
    from toolkit.data import prompts  # pylint: disable=g-import-not-at-top
    return prompts.PromptSource(d.global_batch_size * config.grpo.generations, d.seq_len,
                                config.grpo.loss, mesh, rules)
  # Grain (0.1 s to import) only for the runs that read through it: the built-in text above
  # reaches its first step sooner without it.
  from toolkit.data import images  # pylint: disable=g-import-not-at-top
  from toolkit.data.grain_batches import (  # pylint: disable=g-import-not-at-top
      GrainBatches, ImagesToModel, TokensToModel, order_seed)
  common = dict(seed=config.seed, global_batch_size=d.global_batch_size, mesh=mesh, rules=rules,
                worker_count=d.worker_count, prefetch=d.prefetch)
  if spec.task == "click":
    return _click_batches(config, spec, GrainBatches, common)
  if spec.task == "lm":
    train_stream = shards.TokenStream(d.path, "train")
    if train_stream.vocab_size > spec.model.vocab_size:
      padded = -(-train_stream.vocab_size // 128) * 128  # divisible by the usual mesh axes
      raise ConfigError(f"{d.path}: the shards' vocabulary has {train_stream.vocab_size} ids "
                        f"but model.vocab_size={spec.model.vocab_size}; set "
                        f"--config.model.vocab_size={padded} (or any size >= "
                        f"{train_stream.vocab_size} that the mesh divides)")
    if d.get("packing", False):  # absent from configs saved before it existed
      from toolkit.data import packing  # pylint: disable=g-import-not-at-top
      return packing.DocumentBatches(
          shards.TokenDocuments(train_stream, d.seq_len),
          shards.TokenDocuments(shards.TokenStream(d.path, "val"), d.seq_len), d.seq_len,
          config.seed, d.global_batch_size, mesh, rules, d.eval_batches, d.prefetch,
          bins=d.get("packing_bins", 0))
    train = shards.TokenWindows(train_stream, d.seq_len)
    held_out = shards.TokenWindows(shards.TokenStream(d.path, "val"), d.seq_len)
    row = ((d.seq_len,), np.int32)
    return GrainBatches(train, held_out, [TokensToModel()], [TokensToModel()],
                        {"inputs": row, "targets": row}, eval_batches=d.eval_batches,
                        pad_eval=False, **common)
  m = spec.model
  shape = images.ImageShape(m.image_size, m.channels, m.num_classes)
  train, held_out = images.load_splits(d, shape)
  normalize = images.Normalize(d.mean, d.std)
  train_ops = [normalize, ImagesToModel()]
  if d.crop_padding or d.flip:
    train_ops.insert(0, images.RandomCropFlip(d.crop_padding, d.flip,
                                              order_seed(config.seed, 2)))
  row_specs = {"images": ((m.image_size, m.image_size, m.channels), np.float32),
               "labels": ((), np.int32), "weights": ((), np.float32)}
  return GrainBatches(train, held_out, train_ops, [normalize, ImagesToModel()], row_specs,
                      eval_batches=None, pad_eval=True, **common)


def _click_batches(config, spec, grain_batches, common: dict):
  """Click examples (toolkit/data/clicks.py) through Grain, the held-out set whole and padded,
  checked against the model's tables and dense width."""
  from toolkit.data import clicks  # pylint: disable=g-import-not-at-top
  examples = clicks.load(config.data)
  m = spec.model
  if examples.ids.shape[1] != len(m.table_rows) or examples.dense.shape[1] != m.dense_features:
    raise ConfigError(
        f"data.source={config.data.source!r} has {examples.ids.shape[1]} categorical and "
        f"{examples.dense.shape[1]} dense features; the model has {len(m.table_rows)} tables "
        f"(model.table_rows) and model.dense_features={m.dense_features}: make them equal")
  if not m.hash_ids:
    largest = examples.ids.max(axis=(0, 2))
    for table, (top, rows) in enumerate(zip(largest, m.table_rows)):
      if top >= rows:
        raise ConfigError(f"data.source={config.data.source!r}: feature {table} has ids up to "
                          f"{top}, but model.table_rows[{table}]={rows}; give it at least "
                          f"{top + 1} rows or set model.hash_ids=True")
  train, held_out = clicks.split(examples, config.data.eval_fraction)
  row_specs = {"dense": (train.dense.shape[1:], np.float32), "ids": (train.ids.shape[1:], np.int32),
               "lengths": (train.lengths.shape[1:], np.int32), "labels": ((), np.float32),
               "weights": ((), np.float32)}
  return grain_batches(train, held_out, [clicks.ClicksToModel()], [clicks.ClicksToModel()],
                       row_specs, eval_batches=None, pad_eval=True, **common)


def _chat_batches(config, spec) -> DocumentBatches:
  """Conversations (toolkit/data/chat.py) through the packer: several to a row with
  data.packing, else one per row."""
  from toolkit.data import chat  # pylint: disable=g-import-not-at-top
  d = config.data
  data = chat.ChatData.from_config(d, config.train.get("init_from", ""))
  data.check_vocab(spec.model.vocab_size)
  return chat.ChatBatches(data, d.seq_len, config.seed, d.global_batch_size, spec.mesh,
                          spec.rules, d.eval_batches, d.prefetch, bins=d.get("packing_bins", 0),
                          packed=d.get("packing", False))


def _preference_batches(config, spec):
  """Preference pairs (toolkit/data/preference.py) through the chat template."""
  from toolkit.data import preference  # pylint: disable=g-import-not-at-top
  d = config.data
  data = preference.PreferenceData.from_config(d, config.train.get("init_from", ""))
  data.check_vocab(spec.model.vocab_size)
  batch_sharding = NamedSharding(spec.mesh, spec.rules.activation_spec(("batch", None, None),
                                                                       spec.mesh))
  precomputed = preference.reference_precomputed(config.dpo.get("reference", "auto"),
                                                 spec.model.lora_rank)
  return preference.PreferenceBatches(data.train, data.held_out, config.seed,
                                      d.global_batch_size, d.eval_batches, batch_sharding,
                                      notes=data.notes, precomputed_reference=precomputed)


def token_unit(config) -> str:
  """What one token of an LM's data is: "byte" for CPython's docs and for token shards written
  byte-level (scripts/data/prepare_text.py's default), else "token" (a tokenizer's shards, random
  synthetic tokens). An LM's loss / ln 2 is bits per that unit."""
  d = config.data
  if d.source == "stdlib_docs":
    return "byte"
  if d.source == "tokens":
    return "byte" if shards.read_meta(d.path).get("tokenizer") == "bytes" else "token"
  if d.source == "chat":
    from toolkit.data import chat  # pylint: disable=g-import-not-at-top
    return ("byte" if chat.tokenizer_path(d, config.train.get("init_from", "")) == chat.BYTES
            else "token")
  return "token"
