"""The experiment config's defaults and its one validation pass.

`defaults()` is the single shared fragment every experiment starts from; `resolve()` checks
every field once, before anything touches the workdir, and returns typed pieces. Each error
names the field, the value and the fix.
"""
from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Sequence

import jax
import ml_collections
from jax.sharding import Mesh

import sharding
from models import KINDS, LlamaConfig
from toolkit.errors import ConfigError
from toolkit.training import init_from
from toolkit.training.profiler import parse_profile_steps


def defaults() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.seed = 0
  # The fields of the model family's config dataclass. An optional `kind` picks the family
  # (models.KINDS) and with it the task: absent or "llama" -> next-token LM, "vit" -> image
  # classification (experiments/vit.py sets it).
  c.model = ml_collections.ConfigDict(dataclasses.asdict(LlamaConfig.preset("cpu")))
  c.mesh = ml_collections.ConfigDict(dict(ici="data:1,fsdp:-1,tensor:1", dcn=""))
  c.sharding = ml_collections.ConfigDict(dict(
      preset="fsdp", param_overrides="", activation_overrides="",
      max_replicated_fraction=0.05, replicated_action="warn"))
  c.data = ml_collections.ConfigDict(dict(
      source="stdlib_docs", seq_len=128, global_batch_size=32, eval_batches=4,
      eval_fraction=0.1,
      # Files for source=tokens (a scripts/prepare_text.py folder), npz or image_folder;
      # eval_path: a separate held-out set (else eval_fraction of path is held out).
      path="", eval_path="",
      # Grain worker processes (0: Grain's threads in this process) for token shards and
      # images; batches prepared ahead in a thread for stdlib_docs/synthetic tokens.
      worker_count=0, prefetch=2,
      # Images: training augmentation (pad-and-crop pixels, left-right flips) and the
      # normalization (x - mean) / std of pixels in [0, 1], train and held-out alike.
      crop_padding=0, flip=False, mean=0.0, std=1.0))
  c.optimizer = ml_collections.ConfigDict(dict(
      learning_rate=3e-3, min_lr_ratio=0.1, warmup_steps=20, b1=0.9, b2=0.95, eps=1e-8,
      weight_decay=0.1, clip_norm=1.0,
      # Length of the warmup + cosine schedule; 0 means train.steps. Set it to stop a run
      # early (train.steps < schedule_steps) and continue it later on the same schedule.
      schedule_steps=0))
  c.train = ml_collections.ConfigDict(dict(
      steps=300, microbatches=1, log_every=25, eval_every=100, checkpoint_every=100,
      keep_checkpoints=3, resume_from="", peak_flops_per_device=0.0, sample_tokens=200,
      sample_prompt="The ", transfer_guard=True,
      # Weights to start from, with a fresh optimizer, when neither the workdir nor
      # resume_from has a checkpoint: "hf:DIR", a Hugging Face model folder (toolkit/hf).
      init_from="",
      # "START:STOP": a jax.profiler trace of steps START..STOP-1 in workdir/profile.
      profile_steps=""))
  return c


@dataclasses.dataclass(frozen=True)
class RunSpec:
  """What `resolve` checked: typed pieces the loop uses."""
  model: LlamaConfig
  mesh: Mesh
  rules: sharding.Rules
  batch_ways: int
  task: str = "lm"  # toolkit.tasks.TASKS key, from model.kind


# task -> data.source values it accepts.
_SOURCES = {"lm": ("stdlib_docs", "synthetic", "tokens"),
            "classification": ("digits", "npz", "image_folder", "synthetic")}
_TASK_OF_KIND = {"llama": "lm", "vit": "classification"}


def resolve(config: ml_collections.ConfigDict,
            devices: Sequence[jax.Device] | None = None) -> RunSpec:
  """Validates `config` against the devices; raises ConfigError or ShardingError."""
  known = set(defaults().keys())
  for key in config.keys():
    if key not in known:
      raise ConfigError(f"config.{key} is not a known section; known: {', '.join(sorted(known))}; "
                        f"remove it from the experiment's get_config or fix its name")
  model = model_config(config.model)
  mesh = _mesh(config.mesh, devices)
  s = config.sharding
  rules = sharding.Rules.preset(s.preset, s.param_overrides, s.activation_overrides)
  if s.replicated_action not in ("warn", "fail"):
    raise ConfigError(f"sharding.replicated_action={s.replicated_action!r}; use 'warn' or 'fail'")
  if not 0 <= s.max_replicated_fraction <= 1:
    raise ConfigError(f"sharding.max_replicated_fraction={s.max_replicated_fraction} must be in "
                      f"[0, 1]")

  d = config.data
  kind = config.model.get("kind", "llama")
  task = _TASK_OF_KIND[kind]
  if d.source not in _SOURCES[task]:
    raise ConfigError(f"data.source={d.source!r} does not fit model.kind={kind!r} "
                      f"({task}); choose one of {', '.join(_SOURCES[task])}")
  # Configs saved before these data fields existed (older checkpoints) lack them: defaults.
  new = {key: d.get(key, value) for key, value in defaults().data.items()}
  if d.source in ("tokens", "npz", "image_folder") and not new["path"]:
    raise ConfigError(f"data.source={d.source!r} needs data.path: give "
                      f"--config.data.path=" + ("a folder written by scripts/prepare_text.py"
                                                if d.source == "tokens" else "the "
                                                + d.source.replace("_", " ")))
  if new["worker_count"] < 0 or new["prefetch"] < 0 or new["crop_padding"] < 0:
    raise ConfigError(f"data.worker_count={new['worker_count']}, data.prefetch="
                      f"{new['prefetch']} and data.crop_padding={new['crop_padding']} must be >= 0")
  if not new["std"] > 0:
    raise ConfigError(f"data.std={new['std']} must be > 0 (images are (x - mean) / std)")
  if d.source == "stdlib_docs" and model.vocab_size < 256:
    raise ConfigError(f"model.vocab_size={model.vocab_size} is below 256, the byte-level "
                      f"vocabulary of data.source='stdlib_docs'; set model.vocab_size>=256")
  _positive(d, "data", "seq_len", "global_batch_size", "eval_batches")
  if not 0 < d.eval_fraction < 1:
    raise ConfigError(f"data.eval_fraction={d.eval_fraction} must be between 0 and 1 "
                      f"(exclusive); e.g. 0.1 holds out a tenth of the text")
  batch_spec = rules.activation_spec(("batch",), mesh)
  batch_axes = [a for e in batch_spec if e for a in ((e,) if isinstance(e, str) else e)]
  batch_ways = math.prod(mesh.shape[a] for a in batch_axes)
  t = config.train
  _positive(t, "train", "steps", "microbatches", "log_every", "eval_every", "checkpoint_every",
            "keep_checkpoints")
  if d.global_batch_size % t.microbatches:
    raise ConfigError(
        f"data.global_batch_size={d.global_batch_size} is not divisible by train.microbatches="
        f"{t.microbatches}; pick a micro-batch count that divides the batch")
  micro = d.global_batch_size // t.microbatches
  if micro % batch_ways:
    axes = "x".join(f"{a}={mesh.shape[a]}" for a in batch_axes)
    raise ConfigError(
        f"data.global_batch_size={d.global_batch_size} (micro-batch {micro}) is not divisible by "
        f"the batch-sharding axes {axes} ({batch_ways} ways); use a multiple of "
        f"{batch_ways * t.microbatches}")
  o = config.optimizer
  if o.schedule_steps < 0:
    raise ConfigError(f"optimizer.schedule_steps={o.schedule_steps} must be >= 0 (0 means "
                      f"train.steps)")
  if not (o.learning_rate > 0 and math.isfinite(o.learning_rate)):  # also catches nan
    raise ConfigError(f"optimizer.learning_rate={o.learning_rate} must be a finite number > 0; "
                      f"give e.g. --config.optimizer.learning_rate=3e-3")
  if t.resume_from and not os.path.isdir(t.resume_from):
    raise ConfigError(f"train.resume_from={t.resume_from!r} is not a directory; give a workdir "
                      f"or its checkpoints/ folder")
  init_from.parse(t.get("init_from", ""))  # absent from configs saved before it existed
  if t.peak_flops_per_device < 0:
    raise ConfigError(f"train.peak_flops_per_device={t.peak_flops_per_device} must be >= 0; "
                      f"0 looks the peak up from the device kind")
  parse_profile_steps(t.get("profile_steps", ""), t.steps)  # a bad window: ConfigError
  return RunSpec(model=model, mesh=mesh, rules=rules, batch_ways=batch_ways, task=task)


def _mesh(section: ml_collections.ConfigDict, devices: Sequence[jax.Device] | None) -> Mesh:
  """The config's mesh; on CPU devices a mismatch also names the two ways out."""
  try:
    return sharding.make_mesh(sharding.parse_axis_sizes(section.ici, "mesh.ici"),
                              sharding.parse_axis_sizes(section.dcn, "mesh.dcn"), devices)
  except sharding.ShardingError as e:
    found = list(jax.devices() if devices is None else devices)
    if "devices" not in str(e) or found[0].platform != "cpu":
      raise
    raise sharding.ShardingError(
        f"{e}. On a CPU either simulate devices before JAX starts "
        f"(XLA_FLAGS=--xla_force_host_platform_device_count=8; the toolkit commands do it from "
        f"the mesh, toolkit.runtime.simulate_cpu_devices in Python) or fit the mesh to the "
        f"{len(found)} device(s) there are: --config.mesh.ici=fsdp:-1") from None


def model_config(section: ml_collections.ConfigDict):
  """The model config dataclass of a config's `model` section, validated (ConfigError)."""
  values = section.to_dict()
  kind = values.pop("kind", "llama")
  if kind not in KINDS:
    raise ConfigError(f"model.kind={kind!r} is unknown; choose one of {', '.join(KINDS)}")
  cls = KINDS[kind][0]
  fields = {f.name for f in dataclasses.fields(cls)}
  unknown = sorted(set(values) - fields)
  if unknown:
    raise ConfigError(f"model.{unknown[0]} is not a {cls.__name__} field; known: "
                      f"{', '.join(sorted(fields))}")
  model = cls(**values)
  try:
    model.validate()
  except ValueError as e:
    raise ConfigError(str(e)) from None
  return model


def _positive(section: ml_collections.ConfigDict, name: str, *fields: str) -> None:
  for field in fields:
    if getattr(section, field) < 1:
      raise ConfigError(f"{name}.{field}={getattr(section, field)} must be >= 1; give a positive "
                        f"integer")
